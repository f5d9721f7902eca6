"""Regressions found by the second scheme hunt (hunt_schemes2)."""
import pytest
import torch
import torch.nn as nn

import precondfx
from precondfx.errors import PrecondError


def _mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))


@pytest.mark.parametrize("scheme,key,hint", [
    ("lsuv", "tolerance", "did you mean 'tol'"),
    ("lsuv", "max_iters", "did you mean 'max_iter'"),
    ("tat", "shortcut_wieght", "did you mean 'shortcut_weight'"),
    ("wn", "gama_relu", "did you mean 'gamma_relu'"),
    ("tat", "zeta", "'zeta' is an option of scheme='dks'"),
    ("geometric", "tol", "'tol' is an option of scheme='lsuv'"),
])
def test_misspelled_scheme_option_is_refused_with_the_name_it_resembles(scheme, key, hint):
    with pytest.raises(PrecondError) as e:
        precondfx.precondition(_mlp(), torch.randn(8, 10), scheme=scheme,
                               scheme_options={key: 1})
    assert hint in str(e.value)


def test_wn_keeps_weight_normalized_layers_under_reinit_false():
    """scheme='wn' with reinit_weights=False redrew every weight-normalized layer's g, v and
    bias (the user's trained weights) and said nothing; it now keeps them and says so."""
    torch.manual_seed(0)
    wn = nn.utils.parametrizations.weight_norm
    m = nn.Sequential(wn(nn.Linear(16, 32)), nn.ReLU(), wn(nn.Linear(32, 32)), nn.ReLU(),
                      nn.Linear(32, 4))
    r, rep = precondfx.precondition(m, torch.randn(32, 16), scheme="wn",
                                    reinit_weights=False)
    mine = dict(m.named_parameters())
    changed = [n for n, p in r.named_parameters() if not torch.equal(p, mine[n])]
    assert changed == []
    assert any("reinit=False" in n and "weight-normalized" in n for n in rep.plan.notes)


def test_lsuv_says_a_frozen_layer_is_skipped_because_it_is_frozen():
    """LSUV skipped a frozen layer 'because no alpha buffer could be placed (see the report's
    skipped list)', a list that was empty: the reason now names the kept, frozen weight."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                      nn.Linear(32, 3))
    for p in m[0].parameters():
        p.requires_grad_(False)
    _, rep = precondfx.precondition(m, torch.randn(32, 10), scheme="lsuv")
    why = dict(rep.conditioning["lsuv"]["skipped"])
    frozen = [n for n, r in why.items() if "0.weight" in r]
    assert len(frozen) == 1 and "frozen" in why[frozen[0]]
    assert len(rep.conditioning["lsuv"]["sites"]) == 2


def test_dks_says_q_slope_has_no_effect_on_a_relu_only_network():
    """DKS drops ReLU's Q'(1) condition, so q_slope changes nothing on a ReLU-only network
    (identical state dict); it was accepted without a word, like tat's idle eta/tau are not."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(64, 16)
    base, _ = precondfx.precondition(m, x, scheme="dks")
    r, rep = precondfx.precondition(m, x, scheme="dks", scheme_options={"q_slope": 2.0})
    same = all(torch.equal(a, b) for a, b in zip(base.state_dict().values(),
                                                  r.state_dict().values()))
    assert same     # the option indeed changes nothing here
    assert any("q_slope=2.0 has no effect" in n for n in rep.plan.notes)
