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


def _pair():
    """A user's module:callable that returns (module, sample)."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(5, 6)


@pytest.mark.parametrize("out", ["o.pt", "o.onnx"])
def test_cli_external_data_refused_for_a_pytorch_model(tmp_path, capsys, out):
    """--external-data was silently ignored for module:callable (state_dict or
    torch.onnx.export): the run succeeded and wrote no OUT.data."""
    path = tmp_path / out
    assert cli.main(["precondition", "tests.core.test_hunt_api2:_pair", "-o", str(path),
                     "--external-data", "always", "--quiet"]) == 2
    assert "--external-data always applies to ONNX input files" in capsys.readouterr().err
    assert not path.exists()


def test_cli_sample_shape_over_the_callables_sample_is_said(tmp_path, capsys):
    path = tmp_path / "o.pt"
    assert cli.main(["precondition", "tests.core.test_hunt_api2:_pair", "-o", str(path),
                     "--sample-shape", "4x6", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "the sample tests.core.test_hunt_api2:_pair returned is not used" in err
    assert path.exists()


def test_reinit_with_a_whole_report_dict_says_to_pass_its_plan():
    """reinit(model, report.to_dict()) raised KeyError('options') from Plan.from_dict."""
    import torch
    from torch import nn

    import precondfx
    from precondfx import PrecondError
    torch.manual_seed(0)
    model, _ = precondfx.precondition(nn.Sequential(nn.Linear(4, 4), nn.ReLU(),
                                                    nn.Linear(4, 2)), torch.randn(8, 4))
    d = precondfx.analyze(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)),
                          torch.randn(8, 4)).to_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PrecondError, match=r"whole report's dict: pass its \['plan'\]"):
        precondfx.reinit(model, d)
    with pytest.raises(PrecondError, match="not a plan"):
        precondfx.reinit(model, {"inits": {}})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(precondfx.reinit(model, d["plan"])) == 4      # its plan still works



def test_forward_keyword_given_twice_is_refused():
    """precondition(model, x, scale=2.0, forward_kwargs={'scale': 3.0}) ran with scale=2.0
    and dropped forward_kwargs' 3.0 silently (split_keywords let the extra keyword win)."""
    import torch
    from torch import nn

    import precondfx
    from precondfx import PrecondError

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x, scale=1.0):
            return self.b(torch.relu(self.a(x))) * scale

    x = torch.randn(8, 4)
    for fn in (precondfx.precondition, precondfx.analyze):
        with pytest.raises(PrecondError, match=r"forward keyword 'scale' twice"):
            fn(Net(), x, scale=2.0, forward_kwargs={"scale": 3.0})
    # each place alone still reaches the forward
    assert precondfx.analyze(Net(), x, scale=2.0) is not None
    assert precondfx.analyze(Net(), x, forward_kwargs={"scale": 3.0}) is not None
