"""Inputs real models take: a single dict or list argument, additive -inf attention masks,
inputs shared by the whole batch (a (T, T) mask, EmbeddingBag offsets), PackedSequence and
namedtuple samples; and bad inputs that must give a PrecondError saying what to do."""
from __future__ import annotations

import sys
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import precondfx
from precondfx.pytorch.capture.common import Sample, batch_layout, make_sample
from precondfx.errors import PrecondError


def out_std(model: nn.Module, *args) -> float:
    with torch.no_grad():
        return float(model(*args).double().std(correction=0))


class DictMLP(nn.Module):
    """``model(batch)`` with one dict argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.c(torch.relu(self.a(batch["x"]) + self.b(batch["z"])))


class ListMLP(DictMLP):
    def forward(self, batch: list) -> torch.Tensor:  # type: ignore[override]
        return self.c(torch.relu(self.a(batch[0]) + self.b(batch[1])))


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_single_dict_or_list_argument_is_measured_without_unpacking(kind):
    torch.manual_seed(0)
    x, z = torch.randn(24, 6), torch.randn(24, 4)
    m, batch = (DictMLP(), {"x": x, "z": z}) if kind == "dict" else (ListMLP(), [x, z])
    res = precondfx.precondition(m, (batch,), balance="hessian", balance_samples=4,
                                 target_std=0.05)
    h = res.report.conditioning["hessian"]
    assert h["applied"] is True or "decision" in h
    assert set(h["before"]) == {"a.weight", "b.weight", "c.weight"}
    assert all(v > 0 for v in h["before"].values())
    assert out_std(res.model, batch) == pytest.approx(0.05, rel=1e-4)


class CausalEncoder(nn.Module):
    """An encoder layer called with an additive float causal mask (0 / -inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, 5)

    def forward(self, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x), src_mask=mask))


def test_neg_inf_attention_mask_accepted_and_shared_by_per_sample_passes():
    torch.manual_seed(0)
    T = 6
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    assert bool(torch.isinf(mask).any())
    x = torch.randn(10, T, 8)
    s = make_sample((mask, x))
    b, batched = batch_layout(s)
    assert (b, batched) == (10, frozenset({"arg1"}))  # the mask is shared, x is batched
    one = s.take(3)
    assert one.args[0] is mask and torch.equal(one.args[1], x[3:4])
    res = precondfx.precondition(CausalEncoder(), (mask, x), balance="hessian",
                                 balance_samples=4, target_std=0.05)
    assert res.report.conditioning["hessian"]["before"]
    assert out_std(res.model, mask, x) == pytest.approx(0.05, rel=1e-4)


def test_nan_and_pos_inf_still_refused():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(8, 4)
        x[2, 1] = bad
        with pytest.raises(PrecondError, match="NaN/inf"):
            precondfx.precondition(m, x)
    x = torch.randn(8, 4)
    x[0, 0] = float("-inf")  # -inf among positive data is not a mask
    with pytest.raises(PrecondError, match="additive mask"):
        precondfx.precondition(m, x)


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 8, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids, offsets))


def test_embedding_bag_ids_offsets_layout_cannot_be_guessed_and_can_be_told():
    torch.manual_seed(0)
    ids = torch.randint(0, 30, (23,))
    offsets = torch.tensor([0, 3, 7, 12, 15, 20])
    s = make_sample((ids, offsets))
    with pytest.raises(PrecondError, match="batched="):
        batch_layout(s)
    # the default pipeline does not fail: measured balancing says why it was not measured
    res = precondfx.precondition(Bag(), (ids, offsets), target_std=0.05)
    assert res.report.conditioning["hessian"]["applied"] is False
    assert "batch dimension" in res.report.conditioning["hessian"]["decision"]
    assert out_std(res.model, ids, offsets) == pytest.approx(0.05, rel=1e-4)
    # told that nothing is batched: the whole bag batch is measured as one sample
    told = precondfx.Sample((ids, offsets), {}, batched=())
    res2 = precondfx.precondition(Bag(), told, balance="hessian", balance_samples=3)
    assert set(res2.report.conditioning["hessian"]["before"]) == {"bag.weight", "fc.weight"}


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(5, 12, batch_first=True)
        self.fc = nn.Linear(12, 3)

    def forward(self, packed) -> torch.Tensor:
        out, _ = self.gru(packed)
        pad, _ = pad_packed_sequence(out, batch_first=True)
        return self.fc(pad[:, 0])


def test_packed_sequence_sample_kept_and_sliced_per_sample():
    torch.manual_seed(0)
    x = torch.randn(6, 7, 5)
    lengths = torch.tensor([7, 3, 5, 2, 6, 4])
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    s = make_sample(packed)
    assert len(s.args) == 1 and isinstance(s.args[0], type(packed))
    assert s.batch_size() == 6
    one = s.take(2)
    pad, ln = pad_packed_sequence(one.args[0], batch_first=True)
    assert ln.tolist() == [5] and torch.equal(pad[0], x[2, :5])
    cp = s.copy().args[0]
    assert isinstance(cp, type(packed)) and torch.equal(cp.data, packed.data)
    assert cp.data.data_ptr() != packed.data.data_ptr()
    m = GRUNet()
    with torch.no_grad():  # sequences are independent: each slice gives its row of the batch
        full = m(packed)
        for i in range(6):
            assert torch.allclose(m(*s.take(i).args), full[i:i + 1], atol=1e-6)
    from precondfx.pytorch.measure.sketch import hessian_sketch
    sk = hessian_sketch(m, s, ["gru.weight_ih_l0", "fc.weight"], n_samples=6)
    assert all(v > 0 for v in sk.means().values())
    res = precondfx.precondition(m, packed, target_std=0.05)
    assert out_std(res.model, packed) == pytest.approx(0.05, rel=1e-4)


Batch = namedtuple("Batch", ["x", "z"])


class NTNet(DictMLP):
    def forward(self, b: Batch) -> torch.Tensor:  # type: ignore[override]
        assert isinstance(b, Batch), type(b)
        return self.c(torch.relu(self.a(b.x) + self.b(b.z)))


def test_namedtuple_sample_is_one_argument_and_stays_a_namedtuple():
    torch.manual_seed(0)
    b = Batch(torch.randn(12, 6), torch.randn(12, 4))
    s = make_sample(b)
    assert len(s.args) == 1 and isinstance(s.args[0], Batch)
    assert isinstance(s.take(0, 3).args[0], Batch) and s.take(0, 3).args[0].x.shape == (3, 6)
    res = precondfx.precondition(NTNet(), b, balance="hessian", balance_samples=4,
                                 target_std=0.05)
    assert out_std(res.model, b) == pytest.approx(0.05, rel=1e-4)
    assert set(res.report.conditioning["hessian"]["before"]) == {"a.weight", "b.weight",
                                                                 "c.weight"}


def test_batched_option_checks_names_and_sizes():
    x, m = torch.randn(8, 3), torch.randn(5, 3)
    with pytest.raises(PrecondError, match="no input 'y'"):
        batch_layout(Sample((x,), {"m": m}, batched=("y",)))
    with pytest.raises(PrecondError, match="different leading sizes"):
        batch_layout(Sample((x,), {"m": m}, batched=("arg0", "m")))
    assert batch_layout(Sample((x,), {"m": m}, batched=("m",))) == (5, frozenset({"m"}))
    # position ids broadcast over the batch (leading size 1) are shared, not a second batch
    pos = torch.arange(3)[None]
    assert batch_layout(make_sample((x, pos))) == (8, frozenset({"arg0"}))


# -- bad inputs: a PrecondError that says what to do ----------------------------------------
def _mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 3))


def test_old_style_weight_norm_and_prune_refused_with_the_fix():
    import warnings
    import torch.nn.utils.prune as prune
    x = torch.randn(8, 10)
    m = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.utils.weight_norm(m[0])
    with pytest.raises(PrecondError, match=r"parametrizations\.weight_norm.*remove_weight_norm"):
        precondfx.precondition(m, x)
    with pytest.raises(PrecondError, match="old-style"):
        precondfx.analyze(m, x)
    m = _mlp()
    nn.utils.spectral_norm(m[0])
    with pytest.raises(PrecondError, match=r"parametrizations\.spectral_norm"):
        precondfx.precondition(m, x)
    m = _mlp()
    prune.l1_unstructured(m[0], "weight", 0.3)
    with pytest.raises(PrecondError, match=r"prune\.remove"):
        precondfx.precondition(m, x)
    # the supported spelling works and keeps the parametrization
    m = _mlp()
    nn.utils.parametrizations.weight_norm(m[0])
    res = precondfx.precondition(m, x, target_std=0.05)
    assert "0.parametrizations.weight.original1" in res.model.state_dict()
    assert out_std(res.model, x) == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize("shape", [(10, 0), (0, 4)])
def test_zero_width_layer_refused(shape):
    a, b = shape
    if a == 0:
        m = nn.ModuleDict({"z": nn.Linear(0, 4), "f": nn.Linear(10, 4)})

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.z, self.f = m["z"], m["f"]

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.f(x) + self.z(x[:, :0])
        model: nn.Module = M()
    else:
        model = nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(4, 0))
    with pytest.raises(PrecondError, match="no elements.*non-zero width"):
        precondfx.precondition(model, torch.randn(8, 10))


def test_deeply_nested_modules_give_the_recursion_limit_to_set():
    m: nn.Module = nn.Linear(10, 10)
    for _ in range(300):
        m = nn.Sequential(m)
    with pytest.raises(PrecondError, match=r"sys\.setrecursionlimit"):
        precondfx.precondition(m, torch.randn(4, 10))


def test_vanishing_signal_refused_and_large_scale_warned():
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(10, 16), nn.ReLU()]
    for _ in range(499):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    deep = nn.Sequential(*layers, nn.Linear(16, 3))
    x = torch.randn(64, 10)
    with pytest.raises(PrecondError, match=r"vanishes.*output scale would be"):
        precondfx.precondition(deep, x, balance="none")
    # a scale outside 1e-4..1e4 but inside 1e-8..1e8 is applied, warned about and reported
    from precondfx.pytorch import calibrate as cal
    with pytest.raises(PrecondError, match="explodes"):
        cal.solve_output_scale(1e8, 0.05)
    assert cal.scale_warning(0.05 / 3e5, 3e5) is not None
    assert cal.scale_warning(1.0, 0.05) is None


def _cli(*argv: str, block_onnx: bool = False, cwd: str | None = None
         ) -> "subprocess.CompletedProcess[str]":
    import subprocess
    import sys
    pre = "sys.modules['onnx'] = None; " if block_onnx else ""
    code = f"import sys; {pre}from precondfx.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _cli_in_process(capfd, *argv: str) -> tuple[int, str]:
    """``precondfx.cli.main(argv)`` here (what ``python -m precondfx`` exits with): its exit
    code and everything written to stderr, file-descriptor level included."""
    from precondfx.cli import main
    capfd.readouterr()
    code = main(list(argv))
    return code, capfd.readouterr().err


def _onnx_file(tmp_path) -> str:
    import warnings
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    path = str(tmp_path / "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 4),), path, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "b"}})
    return path


def test_cli_without_onnx_extra_hints_it(tmp_path):
    src = _onnx_file(tmp_path)
    r = _cli("precondition", src, "-o", str(tmp_path / "out.onnx"), block_onnx=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'precondfx[onnx]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_cli_huge_batch_is_one_line_exit_2(tmp_path, capfd):
    src = _onnx_file(tmp_path)
    code, err = _cli_in_process(capfd, "precondition", src, "-o", str(tmp_path / "out.onnx"),
                                "--batch", str(10**14), "--quiet")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0] and "--batch" in lines[0], err
    assert not (tmp_path / "out.onnx").exists()


def test_lazy_module_and_sparse_input():
    torch.manual_seed(0)
    x = torch.randn(8, 10)
    lazy = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 3))
    res = precondfx.precondition(lazy, x, target_std=0.05)
    assert out_std(res.model, x) == pytest.approx(0.05, rel=1e-4)
    # the user's lazy module was not materialized (the pass runs on a copy)
    assert isinstance(lazy[0].weight, nn.parameter.UninitializedParameter)
    xs = x.to_sparse()
    m = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    res = precondfx.precondition(m, xs, balance="hessian", balance_samples=4,
                                 target_std=0.05)
    assert out_std(res.model, xs) == pytest.approx(0.05, rel=1e-4)
    one = make_sample(xs).take(2).args[0]
    assert torch.equal(one.to_dense(), x[2:3])


def test_onnx_calibration_accepts_the_same_neg_inf_mask(tmp_path):
    pytest.importorskip("onnxruntime")
    import warnings

    import numpy as np
    import onnxruntime as ort
    from precondfx.onnx import precondition_onnx

    class Att(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.v, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            a = torch.softmax(self.q(x) @ x.transpose(1, 2) + mask, -1)
            return self.o(a @ self.v(x))

    torch.manual_seed(0)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    x = torch.randn(4, 5, 8)
    src, out, calib = (str(tmp_path / n) for n in ("a.onnx", "b.onnx", "c.npz"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Att(), (mask, x), src, dynamo=False, input_names=["mask", "x"])
    np.savez(calib, mask=mask.numpy(), x=x.numpy())
    precondition_onnx(src, out, calib=calib, target_std=0.05)
    y = ort.InferenceSession(out).run(None, {"mask": mask.numpy(), "x": x.numpy()})[0]
    assert float(np.std(y.astype(np.float64))) == pytest.approx(0.05, rel=1e-4)
    bad = mask.clone()
    bad[0, 0] = float("nan")
    np.savez(calib, mask=bad.numpy(), x=x.numpy())
    with pytest.raises(PrecondError, match="NaN/inf"):
        precondition_onnx(src, str(tmp_path / "d.onnx"), calib=calib)


def test_model_that_cannot_be_copied_asks_for_inplace():
    import threading

    class Locked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.lock = nn.Linear(4, 8), nn.Linear(8, 2), threading.Lock()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with self.lock:
                return self.b(torch.relu(self.a(x)))

    x = torch.randn(8, 4)
    with pytest.raises(PrecondError, match="inplace=True"):
        precondfx.precondition(Locked(), x)
    m = Locked()
    res = precondfx.precondition(m, x, inplace=True, target_std=0.05)
    assert out_std(res.model, x) == pytest.approx(0.05, rel=1e-4)


def test_cli_torch_model_huge_sample_shape_is_one_line_exit_2(tmp_path, capfd, monkeypatch):
    (tmp_path / "tinymods.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 2))\n")
    monkeypatch.chdir(tmp_path)                        # the CLI imports MODULE:FN from here
    monkeypatch.setattr(sys, "path", list(sys.path))   # and puts the folder on sys.path
    monkeypatch.delitem(sys.modules, "tinymods", raising=False)
    code, err = _cli_in_process(capfd, "precondition", "tinymods:build", "--sample-shape",
                                f"{10**12}x3x4", "-o", str(tmp_path / "out.pt"), "--quiet")
    sys.modules.pop("tinymods", None)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0], err


def test_large_output_scale_applied_with_a_warning_and_a_report_line():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(10, 16), nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x))) * 1e-6  # the signal shrinks a millionfold

    torch.manual_seed(0)
    x = torch.randn(32, 10)
    with pytest.warns(RuntimeWarning, match="output scale"):
        res = precondfx.precondition(Tiny(), x, balance="none", target_std=0.05)
    assert 1e4 < res.report.output_scale < 1e8
    assert any(k == "warning: output scale" for k, _ in res.report.skipped)
    assert out_std(res.model, x) == pytest.approx(0.05, rel=1e-4)
