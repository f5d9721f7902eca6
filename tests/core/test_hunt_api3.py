"""Regressions found by the API hunt (hunt_api4): options, schemes and the CLI's contract as a
user meets them (case of option words, tensor scalars, fold of a plain model, a DataLoader or
an (x, y) batch as the sample, LSUV's all_converged, DKS's refusal, inspect's flags)."""
import numpy as np
import pytest
import torch
from torch import nn
import torch.nn.utils.parametrizations as P
from torch.utils.data import DataLoader, TensorDataset

import precondfx
from precondfx import PrecondError, cli
from tests.helpers import cli_help


def _mlp(act=nn.ReLU, width=16):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, width), act(), nn.Linear(width, 4)), torch.randn(32, 8)


# -- (e) option words in any case, in Python and on the command line ---------------------------
@pytest.mark.parametrize("kw, stored", [
    ({"init": "Fan_In"}, ("init", "fan_in")),
    ({"balance": "None"}, ("balance", "none")),
    ({"scheme": "LSUV"}, ("scheme", "lsuv")),
    ({"input_scale": "AUTO"}, ("input_scale", "auto")),
    ({"residual_scale": "NF:0.3"}, ("residual_scale", "nf:0.3")),
    ({"lr_scale": "SGD", "lr": None}, ("lr_scale", "sgd")),
])
def test_option_words_are_read_in_any_case(kw, stored):
    """init='Fan_In' was refused while optimizer='SGD' was taken (lowercased): the words of
    every option are now read in any case and stored lowercase."""
    from precondfx.core.options import Options
    opts = Options.from_keywords(**kw)
    assert getattr(opts, stored[0]) == stored[1]


def test_scheme_name_in_capitals_runs_the_scheme():
    """scheme='LSUV' (the paper's spelling) was refused: 'is not one of [...]'."""
    model, x = _mlp()
    _, rep = precondfx.precondition(model, x, scheme="LSUV")
    assert rep.plan.options["scheme"] == "lsuv" and "lsuv" in rep.conditioning


def test_misspelled_word_gets_a_hint():
    with pytest.raises(PrecondError, match=r"did you mean 'analytic'\?"):
        precondfx.analyze(*_mlp(), balance="analytc")
    with pytest.raises(PrecondError, match=r"did you mean 'lsuv'\?"):
        precondfx.analyze(*_mlp(), scheme="lsvu")


def test_cli_choice_in_capitals_is_taken(tmp_path, capsys):
    """--init Fan_In: argparse said 'invalid choice' while init='Fan_In' differs from 'fan_in'
    only in case; the flag now takes it as Python does."""
    from precondfx.core.options import cli_flags
    import argparse
    p = argparse.ArgumentParser()
    cli_flags(p.add_argument)
    a = p.parse_args(["--init", "Fan_In", "--balance", "NONE", "--calibration", "Eval"])
    assert (a.init, a.balance, a.calibration) == ("fan_in", "none", "eval")


# -- (f) tensor and numpy scalars for every number option --------------------------------------
@pytest.mark.parametrize("kw, name, want", [
    ({"target_std": torch.tensor(0.5)}, "target_std", 0.5),
    ({"input_scale": torch.tensor(2.0)}, "input_scale", 2.0),
    ({"balance_threshold": np.array(3.0)}, "balance_threshold", 3.0),
    ({"seed": torch.tensor(7)}, "seed", 7),
    ({"balance_samples": np.array(8)}, "balance_samples", 8),
    ({"lr": torch.tensor(0.1), "optimizer": "sgd"}, "lr", 0.1),
])
def test_zero_dim_tensor_and_array_scalars_are_numbers(kw, name, want):
    """residual_scale took torch.tensor(0.5); target_std, lr and seed refused it ('must be a
    positive number'). A 0-d tensor or array is now the number it holds."""
    from precondfx.core.options import Options
    v = getattr(Options.from_keywords(**kw), name)
    assert v == pytest.approx(want) and type(v) in (int, float)


def test_tensor_scalar_target_std_calibrates_to_it():
    model, x = _mlp()
    res, _ = precondfx.precondition(model, x, target_std=torch.tensor(0.5))
    with torch.no_grad():
        assert float(res(x).std(correction=0)) == pytest.approx(0.5, rel=1e-3)


def test_multi_element_tensor_and_bool_tensor_still_refused():
    with pytest.raises(PrecondError, match="target_std="):
        precondfx.analyze(*_mlp(), target_std=torch.tensor([0.5, 0.5]))
    with pytest.raises(PrecondError, match="a bool is not an integer"):
        precondfx.analyze(*_mlp(), seed=torch.tensor(True))


# -- (g) fold of a model precondition never saw -------------------------------------------------
def test_fold_of_a_plain_model_is_refused():
    """precondfx.fold(nn.Sequential(...)) returned a copy without a word: a user who loaded
    preconditioned weights into a fresh model (or folded twice) believed it folded."""
    model, x = _mlp()
    with pytest.raises(PrecondError, match="found nothing of precondfx"):
        precondfx.fold(model)
    res, _ = precondfx.precondition(model, x)
    plain = precondfx.fold(res)
    with torch.no_grad():
        assert torch.allclose(plain(x), res(x), atol=1e-5)
    with pytest.raises(PrecondError, match="one fold already returned"):
        precondfx.fold(plain)
    # fold_problems says what fold would: empty for the result, the one problem for the rest
    assert precondfx.fold_problems(res) == []
    assert [k for k, _ in precondfx.fold_problems(model)] == ["model"]


# -- (h) a DataLoader, an (x, y) batch or a numpy array as the sample ---------------------------
def test_dataloader_as_sample_says_to_pass_one_batch():
    model, x = _mlp()
    dl = DataLoader(TensorDataset(x, torch.randint(0, 4, (32,))), batch_size=8)
    with pytest.raises(PrecondError, match=r"sample is a DataLoader .*next\(iter\(loader\)\)"):
        precondfx.precondition(model, dl)


def test_inputs_labels_batch_as_sample_names_the_labels():
    """next(iter(loader)) passed whole: 'forward() takes 2 positional arguments but 3 were
    given' and nothing about the labels."""
    model, x = _mlp()
    y = torch.randint(0, 4, (32,))
    for batch in ((x, y), [x, y]):
        with pytest.raises(PrecondError, match=r"2 positional inputs .* takes 1 \(its last one "
                                               r"holds integers: labels\?\).*batch\[0\]"):
            precondfx.precondition(model, batch)


def test_numpy_array_as_sample_says_to_convert():
    model, x = _mlp()
    with pytest.raises(PrecondError, match=r"torch.as_tensor"):
        precondfx.precondition(model, x.numpy())


# -- (c) LSUV's all_converged with a skipped layer ----------------------------------------------
def test_lsuv_all_converged_is_false_when_a_linear_layer_is_skipped():
    """A weight-normalized Linear among plain ones: LSUV skips it (its variance stays off the
    target) and the report said all_converged=True."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), P.weight_norm(nn.Linear(16, 16)), nn.ReLU(),
                      nn.Linear(16, 4))
    _, rep = precondfx.precondition(m, torch.randn(32, 8), scheme="lsuv")
    sec = rep.conditioning["lsuv"]
    assert len(sec["sites"]) == 2 and len(sec["skipped"]) == 1
    assert all(s["converged"] for s in sec["sites"])
    assert sec["all_converged"] is False
    assert any("not scaled by LSUV" in n for n in sec["notes"])


def test_lsuv_plain_mlp_still_all_converged():
    _, rep = precondfx.precondition(*_mlp(), scheme="lsuv")
    assert rep.conditioning["lsuv"]["all_converged"] is True


# -- (a) DKS's refusal says which targets and what to do ----------------------------------------
def test_dks_unreachable_targets_say_what_to_do(monkeypatch):
    """tanh with q_slope=2: 'Failed to find transformation parameters for activation 'tanh'
    from 50 starting points.' and nothing else.  The solver's own failure (measured: 24 s on
    this model) is replaced by its message at once, to keep the test fast."""
    import precondfx.schemes.tat.scheme as tat

    def fails(name, s, q):
        assert (name, q) == ("tanh", 2.0)
        raise PrecondError("Failed to find transformation parameters for activation 'tanh' "
                           "from 50 starting points.")
    monkeypatch.setattr(tat, "solve_dks_local", fails)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 4))
    with pytest.raises(PrecondError) as e:
        precondfx.precondition(m, torch.randn(32, 8), scheme="dks",
                               scheme_options={"q_slope": 2.0})
    msg = str(e.value)
    assert "scheme='dks'" in msg and "q_slope=2.0" in msg and "drop scheme_options q_slope" \
        in msg and "C'(1)=1.22474" in msg


# -- (d) inspect --help offers no flag inspect refuses ------------------------------------------
def test_inspect_help_lists_no_flag_it_refuses():
    """inspect --help listed --scheme, --calibration {train}, --balance-threshold and
    --balance-samples, whose every value but the default the ONNX back end refuses."""
    text = cli_help("inspect")
    for flag in ("--scheme", "--calibration", "--balance-threshold", "--balance-samples"):
        assert flag not in text, flag
    for flag in ("--init", "--balance", "--target-std", "--no-reinit", "--lr-scale"):
        assert flag in text, flag
    assert "--scheme" in cli_help("precondition")


def test_inspect_with_a_precondition_only_flag_says_why(capsys):
    assert cli.main(["inspect", "m.onnx", "--scheme", "lsuv"]) == 2
    err = capsys.readouterr().err
    assert "--scheme is a flag of precondition, not of inspect: scheme= other than " \
           "'geometric' needs the PyTorch model" in err


# -- (b) scheme options without effect are said, and listed with the other idle options -------
def _idle(rep):
    return [w for kind, w in rep.skipped if kind == "option"]


def test_wn_direction_without_weight_normalized_layer_is_said():
    """scheme='wn', direction='gaussian' on a model without weight_norm layers: accepted
    without a word (the plan's notes said only that no such layer was found)."""
    _, rep = precondfx.precondition(*_mlp(), scheme="wn",
                                    scheme_options={"direction": "gaussian"})
    idle = _idle(rep)
    assert len(idle) == 1 and "direction='gaussian' has no effect" in idle[0]
    _, rep = precondfx.precondition(*_mlp(), scheme="wn")       # the default: nothing to say
    assert _idle(rep) == []


def test_scheme_option_without_effect_is_listed_as_core_options_are():
    """lsuv alphas='keep' with balance='none': the scheme's note was in plan.notes only, while
    a core option without effect (pool_conv with maxpool='keep') is also in report.skipped."""
    _, rep = precondfx.precondition(*_mlp(), scheme="lsuv", balance="none",
                                    scheme_options={"alphas": "keep"})
    assert any("alphas='keep' has no effect" in w for w in _idle(rep))
    _, rep = precondfx.precondition(*_mlp(), maxpool="keep", pool_conv="avg")
    assert any("pool_conv='avg' has no effect" in w for w in _idle(rep))


# -- more of the public surface ----------------------------------------------------------------
def test_optimizer_instance_names_its_family():
    """optimizer=opt (the user's SGD object) was refused with the optimizer's whole repr in the
    message; its class says the family as the class itself does."""
    from precondfx.core.options import Options
    model, _ = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert Options.from_keywords(lr=0.1, optimizer=sgd).optimizer == "sgd"
    assert Options.from_keywords(lr=1e-3, optimizer=adamw).optimizer == "adam"
    rms = torch.optim.RMSprop(model.parameters())
    with pytest.raises(PrecondError, match=r"optimizer=a RMSprop optimizer is not") as e:
        Options.from_keywords(lr=1e-3, optimizer=rms)
    assert "\n" not in str(e.value)


def test_field_name_of_a_renamed_option_points_to_its_keyword():
    """precondition(model, x, reinit=False): 'did you mean 'init'?' (the closer word), while
    the option is reinit_weights (reinit is its field and report name)."""
    with pytest.raises(PrecondError, match=r"'reinit' \(did you mean 'reinit_weights'\?\)"):
        precondfx.precondition(*_mlp(), reinit=False)


def test_fold_of_the_result_pair_says_to_pass_its_model():
    res = precondfx.precondition(*_mlp())
    with pytest.raises(PrecondError, match=r"the \(model, report\) pair; .*fold\(result.model\)"):
        precondfx.fold(res)


def test_scheme_option_tensor_and_capitals_read_as_pass_options():
    """scheme_options={'tol': torch.tensor(0.05)} and {'alphas': 'Keep'} were refused ('must
    be a number', "must be 'none' ... or 'keep'") while the pass's own options take both."""
    _, rep = precondfx.precondition(*_mlp(), scheme="lsuv",
                                    scheme_options={"tol": torch.tensor(0.05), "alphas": "Keep"})
    sec = rep.conditioning["lsuv"]
    assert sec["tol"] == pytest.approx(0.05) and type(sec["tol"]) is float
    assert rep.plan.options["balance"] == "auto"       # alphas='keep': balance not turned off


def test_residual_scale_sequence_on_a_model_without_joins_is_said_not_refused():
    """residual_scale=[0.5] on an MLP: 'has 1 values, but the model has 0 residual joins ():
    pass 0 values', where one number is accepted and noted as having no effect."""
    _, rep = precondfx.precondition(*_mlp(), residual_scale=[0.5])
    assert any("residual_scale=(0.5,) has no effect: the model has no residual join" in w
               for w in _idle(rep))


def test_cli_demo_model_in_capitals(capsys):
    """demo --model MLP: 'unknown demo model' while every other word is read in any case; its
    --help now lists the models as choices."""
    assert cli.main(["demo", "--model", "MLP", "--quiet", "--balance", "none"]) == 0
    assert "--model {maxpool_cnn,mlp}" in cli_help("demo")


def test_analyze_with_precondition_only_arguments_says_so():
    """analyze(model, x, inplace=True): 'unknown keyword 'inplace': it is not an option ... and
    not a parameter of Sequential.forward(input)', though it is precondition's argument."""
    with pytest.raises(PrecondError, match=r"analyze\(\) got inplace=: an argument of "
                                           r"precondition\(\); analyze changes nothing"):
        precondfx.analyze(*_mlp(), inplace=True)
