"""Regressions found by the API hunt (hunt_api2): public-surface misuse a user makes."""
import pytest

from precondfx import cli


@pytest.mark.parametrize("argv, meant", [
    (["demo", "--balnce", "none"], "'--balance'"),
    (["demo", "--sed", "3"], "'--seed'"),
])
def test_cli_misspelled_flag_names_the_flag_meant(argv, meant, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"did you mean {meant}?" in err
    assert "precondfx demo --help" in err


def test_cli_flag_of_another_command_says_which(capsys):
    assert cli.main(["demo", "--target-std", "2"]) == 2
    err = capsys.readouterr().err
    assert "--target-std is a flag of inspect, precondition, not of demo" in err
