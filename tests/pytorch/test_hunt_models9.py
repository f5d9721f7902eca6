"""Hunt (models9): models a user may bring, and the options.  Each test failed on the code
before its fix (figures in the docstrings)."""
from __future__ import annotations

import math
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError


def _notes(rep) -> list[str]:
    return list(rep.plan.notes)


# -- (c) output_key with target_std=None --------------------------------------------------------
class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"logits": self.b(torch.relu(h)), "aux": h}


def test_output_key_without_output_scale_is_said():
    """output_key='aux' with target_std=None: no note at all before (the option was read by
    nothing, or only by the measurements, and the report did not say so)."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    _, rep = precondfx.precondition(_TwoHeads(), x, output_key="aux", target_std=None,
                                    balance="none", lr=None)
    idle = [n for n in _notes(rep) if n.startswith("output_key='aux' has no effect")]
    assert len(idle) == 1 and "target_std=None" in idle[0]
    # read by measured balancing (the default): said, not called idle
    _, rep = precondfx.precondition(_TwoHeads(), x, output_key="aux", target_std=None)
    said = [n for n in _notes(rep) if n.startswith("output_key='aux'")]
    assert len(said) == 1 and "scales no output" in said[0] and "no effect" not in said[0]
    # with an output scale: nothing to say
    _, rep = precondfx.precondition(_TwoHeads(), x, output_key="aux")
    assert not [n for n in _notes(rep) if n.startswith("output_key=")]


# -- (b) a constant main output on the sample -----------------------------------------------------
class _Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(self.enc(a), self.enc(b), dim=-1)


def test_constant_output_on_the_sample_is_refused_with_what_to_do():
    """A siamese net calibrated on identical pairs: cosine 1 +- 1e-7.  Before: output std
    8.75e-08 scaled by 1.14e7 (rounding noise), then 'the output std is 0.8268 after
    calibration, not the target 1 ... (please report this model)'.  Now: refused, saying the
    output is constant and what to do; distinct pairs calibrate as before."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    with pytest.raises(PrecondError) as e:
        precondfx.precondition(_Siamese(), (x, x))
    msg = str(e.value)
    assert "constant on the calibration batch" in msg and "target_std=None" in msg
    assert "please report" not in msg
    _, rep = precondfx.precondition(_Siamese(), (x, torch.randn(32, 8)))
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    assert not [w for w, _ in rep.skipped if "constant" in w]


class _IgnoresInput(nn.Module):
    """forward reads the wrong tensor: the output is the bias path for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.zeros_like(x)) + 1.0))


def test_output_that_ignores_the_input_is_said():
    """Before: calibrated silently (no note).  Now a note that every sample's output is the
    same; a model that reads its input gets none."""
    torch.manual_seed(0)
    _, rep = precondfx.precondition(_IgnoresInput(), torch.randn(32, 8), balance="none")
    said = [why for what, why in rep.skipped if what == "note: constant output"]
    assert len(said) == 1 and "does not depend on the inputs" in said[0]


# -- (e) two preconditions in two threads -------------------------------------------------------
_EVENTS: dict[str, threading.Event] = {}


class _Staged(nn.Module):
    """An MLP whose forwards wait on events, so that two threads' captures overlap in a known
    order: A's fx trace starts and waits (at most 0.5 s) for B's to start; B's first real
    forward waits for A's trace, and B's trace lasts 1 s, past A's end."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.role, self.first = role, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy):
            if self.role == "a":
                _EVENTS["a_in"].set()
                _EVENTS["b_in"].wait(0.5)
            else:
                _EVENTS["b_in"].set()
                time.sleep(1.0)
        elif self.role == "b" and self.first:
            self.first = False
            _EVENTS["a_in"].wait(30)
        return self.b(torch.relu(self.a(x)))


def test_two_threads_leave_no_warning_filter_or_stream_behind():
    """Thread A's capture starts first and ends first, thread B's overlaps it.  Before: B's
    warnings.catch_warnings() and redirect_stdout saved A's silenced state and put it back at
    its exit: warnings.filters kept an 'ignore everything' entry and sys.stdout stayed a
    StringIO (every later print and warning of the process lost).  Now the state is the one
    the process had."""
    filters, out, err = list(warnings.filters), sys.stdout, sys.stderr
    results: dict[str, object] = {}

    def work(name: str, model: nn.Module) -> None:
        try:
            torch.manual_seed(0)
            results[name] = precondfx.precondition(model, torch.randn(16, 8), balance="none",
                                                   lr=None)[1]
        except BaseException as e:          # pragma: no cover - reported below
            results[name] = e

    _EVENTS.update(a_in=threading.Event(), b_in=threading.Event())
    threads = [threading.Thread(target=work, args=(r, _Staged(r))) for r in ("a", "b")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        left = (list(warnings.filters) != filters, sys.stdout is not out, sys.stderr is not err)
    finally:
        warnings.filters[:] = filters
        sys.stdout, sys.stderr = out, err
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    assert left == (False, False, False)


# -- (a) normalizing flows returning (z, log_det) -----------------------------------------------
class _Coupling(nn.Module):
    """RealNVP's affine coupling: half the features scaled and shifted by a net of the other."""

    def __init__(self, d: int, flip: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, 32), nn.Tanh(), nn.Linear(32, d))
        self.flip = flip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, -1)
        if self.flip:
            a, b = b, a
        s, t = self.net(a).chunk(2, -1)
        s = torch.tanh(s)
        b = b * torch.exp(s) + t
        return torch.cat([b, a] if self.flip else [a, b], -1), s.sum(-1)


class _Flow(nn.Module):
    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Coupling(d, i % 2 == 1) for i in range(n)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_det = x.new_zeros(x.shape[0])
        for layer in self.layers:
            x, ld = layer(x)
            log_det = log_det + ld
        return x, log_det


def _true_log_det(model: nn.Module, x: torch.Tensor) -> float:
    """log|det dz_0/dx_0| by torch.autograd.functional.jacobian (independent of precondfx)."""
    rest = x[1:]
    jac = torch.autograd.functional.jacobian(
        lambda r: model(torch.cat([r[None], rest]))[0][0], x[0].clone())
    return float(torch.linalg.slogdet(jac.double())[1])


def test_flow_log_det_stays_the_log_det_of_its_z():
    """Before: the log-det accumulation ``log_det = log_det + ld`` was taken for residual joins
    and each ``ld`` scaled by s=1/sqrt(4): on the first sample the result returned log_det
    2.113 for a measured log|det dz/dx| of -5.024 (-7.138 with d log c = -9.251): its
    likelihood, and the likelihood's gradient, were not the flow's.  Now the joins are left
    alone and the only difference is the output scale's d log c."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result, rep = precondfx.precondition(_Flow(), x)
    assert not [r for r in rep.plan.residuals if r.s is not None]
    c = rep.output_scale
    assert c != pytest.approx(1.0, rel=1e-2)
    with torch.no_grad():
        returned = float(result(x)[1][0])
    assert returned + 8 * math.log(c) == pytest.approx(_true_log_det(result, x), abs=1e-3)


def test_flow_report_gives_the_log_det_offset():
    """Before: nothing said that log_det misses the output scale's d log c (reported NLL off
    by 9.25 nats per sample here).  Now a warning, a NOT APPLIED line and
    report.conditioning['flow']['offset'] = d log c."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    with pytest.warns(RuntimeWarning, match="normalizing flow"):
        _, rep = precondfx.precondition(_Flow(), x)
    flow = rep.conditioning["flow"]
    assert flow["dims"] == 8 and flow["output"] == 1
    assert flow["offset"] == pytest.approx(8 * math.log(rep.output_scale), rel=1e-12)
    assert any(w == "warning: flow log-determinant" for w, _ in rep.skipped)


def test_per_sample_second_output_that_is_no_log_det_gets_no_flow_note():
    """A model returning (prediction, per-sample penalty) of matching sizes: no flow entry."""

    class Penalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.a(x))
            return self.b(h), h.square().mean(-1)

    torch.manual_seed(0)
    _, rep = precondfx.precondition(Penalized(), torch.randn(64, 8))
    assert "flow" not in rep.conditioning


# -- hunt: eager-mode quantization stubs ----------------------------------------------------------
class _QuantMLP(nn.Module):
    """The eager-mode quantization tutorial's layout: QuantStub in, DeQuantStub out."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.dequant = torch.ao.quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def test_quant_stubs_stay_called_in_the_result():
    """Before: fx traced through QuantStub/DeQuantStub (the identity in float), so the result's
    forward no longer called them: after prepare_qat the input's fake-quantizer never ran
    (its observer's min_val stayed inf) and after prepare/convert a quantized Linear met a
    float tensor.  Now the stubs stay calls of the result (fold's model for convert)."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    result, rep = precondfx.precondition(_QuantMLP(), x)
    result.train()
    result.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    torch.ao.quantization.prepare_qat(result, inplace=True)
    result(x)
    seen = result.quant.activation_post_process.activation_post_process.min_val
    assert bool(torch.isfinite(seen).all())
    assert float(seen) == pytest.approx(float(x.min()), rel=1e-6)


def test_qat_prepared_model_without_its_layers_says_prepare_after():
    """A model already through prepare_qat, captured by torch.export (its Linear decomposed:
    the weight passes through weight_fake_quant).  Before: 'take a weight computed in forward
    ... as an equalized learning rate does ... write the layers as modules'.  Now it says the
    model was prepared for QAT and to precondition the float model before prepare_qat."""
    torch.manual_seed(0)
    m = _QuantMLP().train()
    m.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    torch.ao.quantization.prepare_qat(m, inplace=True)
    with pytest.raises(PrecondError, match="prepared for quantization-aware training") as e:
        precondfx.precondition(m, torch.randn(64, 8), capture=("export",))
    assert "then call torch.ao.quantization.prepare_qat on the result" in str(e.value)


# -- (d) an unreachable DKS target is refused before the solve ----------------------------------
def test_dks_unreachable_q_slope_refused_before_the_solve():
    """q_slope=3.5 on a 2-layer tanh MLP (local C'(1) = 1.5^(1/2) = 1.2247): a normalized
    activation's Q'(1) is at most 2 C'(1) + 1/2 = 2.95.  Before: 50 Newton starts, 16.8 s
    (softplus: 43 s), 'Failed to find transformation parameters'.  Now refused at once, and
    the scheme says what to do."""
    from precondfx.schemes.tat.transforms import solve_dks_local
    t = time.perf_counter()
    with pytest.raises(PrecondError, match=r"Q'\(1\) lies in \[-0.5, 2.9494"):
        solve_dks_local("tanh", 1.2247, 3.5)
    assert time.perf_counter() - t < 1.0
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 4))
    t = time.perf_counter()
    with pytest.raises(PrecondError) as e:
        precondfx.precondition(m, torch.randn(32, 8), scheme="dks",
                               scheme_options={"q_slope": 3.5})
    assert time.perf_counter() - t < 10.0
    assert "q_slope=3.5" in str(e.value) and "2 C'(1) + 1/2" in str(e.value)
    # the targets the reference's tests use are still solved
    assert solve_dks_local("tanh", 1.0378008872270585, 0.97).input_scale > 0
