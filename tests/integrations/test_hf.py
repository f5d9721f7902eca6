"""Hugging Face stack: the model's own loss sees the output scale; Trainer trains the result.

transformers models compute ``outputs.loss`` inside forward from ``labels``; precondfx's output
scale must act before that loss (issue 15).  Every check compares the model's loss with a loss
computed independently from the returned logits."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx import PrecondError

pytest.importorskip("transformers")
from tests import hf_tiny  # noqa: E402


@pytest.mark.parametrize("name", hf_tiny.NAMES)
def test_model_loss_sees_the_output_scale(name: str) -> None:
    model, batch = hf_tiny.build(name)
    fwd = hf_tiny.FORWARD[name]
    result, report = precondfx.precondition(model, batch, target_std=0.05, **fwd)
    assert abs(report.output_std_after - 0.05) < 5e-3  # measured balancing may move it a bit
    result.eval()
    with torch.no_grad():
        out = result(**batch, **fwd)
    own = float(out.loss)
    ref = float(hf_tiny.LOSS[name](out.logits, batch["labels"]))
    assert abs(own - ref) < 1e-5, (own, ref)
    # with logits of std ~0.05 the loss is close to log(number of classes)
    assert abs(ref - math.log(out.logits.shape[-1])) < 0.1


def test_labels_not_in_the_calibration_batch() -> None:
    """Preconditioned without labels, then trained with them: the loss still sees the scale."""
    model, batch = hf_tiny.build("gpt2")
    result, _ = precondfx.precondition(model, {"input_ids": batch["input_ids"]}, use_cache=False,
                                       target_std=0.05)
    with torch.no_grad():
        out = result.eval()(**batch, use_cache=False)
    assert float(out.logits.std()) < 0.2
    assert abs(float(out.loss) - float(hf_tiny.causal_lm_loss(out.logits, batch["labels"]))) < 1e-5


class _LossInside(nn.Module):
    """Computes its loss inside forward from logits, and returns a reshaped view of them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.fc2(torch.relu(self.fc1(x)))
        loss = F.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits.view(logits.shape[0], 2, 3)}


@pytest.mark.parametrize("method", ["fx", "eager"])
def test_loss_inside_forward_both_back_ends(method: str) -> None:
    torch.manual_seed(0)
    batch = {"x": torch.randn(32, 8), "labels": torch.randint(0, 6, (32,))}
    result, report = precondfx.precondition(_LossInside(), batch, capture=method,
                                            target_std=0.05)
    assert isinstance(result, torch.fx.GraphModule) == (method == "fx")
    with torch.no_grad():
        out = result(**batch)
    ref = F.cross_entropy(out["logits"].reshape(32, 6), batch["labels"])
    assert abs(float(out["loss"]) - float(ref)) < 1e-6
    assert abs(float(out["logits"].std(correction=0)) - 0.05) < 1e-4


class _FunctionalHead(nn.Module):
    """Logits from a functional matmul with the (tied) embedding: no module produces them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = torch.tanh(self.fc(self.emb(ids))) @ self.emb.weight.T
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1))
        return out


def test_refuses_when_the_scale_cannot_reach_the_loss() -> None:
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(PrecondError, match="loss"):
        precondfx.precondition(_FunctionalHead(), {"ids": ids, "labels": ids}, capture="eager")
    # without labels the pass works, and a later call with labels fails loudly, not silently
    result, _ = precondfx.precondition(_FunctionalHead(), {"ids": ids}, capture="eager",
                                       target_std=0.05)
    with torch.no_grad():
        assert float(result(ids)["logits"].std()) < 0.2
    with pytest.raises(PrecondError, match="loss"):
        result(ids, labels=ids)


def _lm_data(n: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, hf_tiny.VOCAB, (n, 1), generator=g)
    ids = (start + torch.arange(hf_tiny.SEQ)) % hf_tiny.VOCAB   # learnable: next = this + 1
    labels = ids.clone()
    # the first token is never predicted: marking it ignored makes Trainer's token count
    # (labels != -100) equal to the number of predicted tokens, so its loss is the plain mean
    labels[:, 0] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def _plain_loop(model: nn.Module, data: list[dict], steps: int, bs: int, lr: float
                ) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for k in range(steps):
        rows = data[k * bs:(k + 1) * bs]
        batch = {key: torch.stack([r[key] for r in rows]) for key in rows[0]}
        out = model(**batch, use_cache=False)
        logits_loss = hf_tiny.causal_lm_loss(out.logits, batch["labels"])
        assert abs(float(out.loss.detach()) - float(logits_loss.detach())) < 1e-5
        losses.append(float(logits_loss))
        opt.zero_grad()
        logits_loss.float().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return losses


def run_trainer(model: nn.Module, data: list[dict], steps: int, bs: int, lr: float, out_dir: str,
                **args) -> tuple[list[float], object]:
    """Trainer with the plain loop's settings; returns the loss of each step and the trainer."""
    import transformers as tf

    losses: list[float] = []

    class Recording(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(loss[0] if isinstance(loss, tuple) else loss))
            return loss

    targs = tf.TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=bs, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        train_sampling_strategy="sequential", report_to=[], use_cpu=True, logging_steps=1,
        disable_tqdm=True, seed=0, **{"save_strategy": "no", **args})
    trainer = Recording(model=model, args=targs, train_dataset=data)
    return losses, trainer


@pytest.mark.slow
def test_trainer_matches_a_plain_loop(tmp_path) -> None:
    """20 Trainer steps on the preconditioned GPT-2 equal 20 steps of a plain loop (losses and
    final parameters), and the losses start where the output scale puts them (log V)."""
    pytest.importorskip("accelerate")
    model, batch = hf_tiny.build("gpt2", dropout=False)
    pre, _ = precondfx.precondition(model, {"input_ids": batch["input_ids"]}, use_cache=False,
                                    target_std=0.05)
    import copy
    a, b = copy.deepcopy(pre), copy.deepcopy(pre)
    data = _lm_data(20 * 4)
    plain = _plain_loop(a, data, 20, 4, 1e-2)
    losses, trainer = run_trainer(b, data, 20, 4, 1e-2, str(tmp_path))
    trainer.train()
    assert len(losses) == 20
    assert max(abs(x - y) for x, y in zip(losses, plain)) < 1e-4, (losses, plain)
    assert abs(losses[0] - math.log(hf_tiny.VOCAB)) < 0.05
    assert losses[-1] < losses[0] - 0.05, losses
    # AdamW divides by sqrt(v): float-rounding differences in near-zero gradients move a few
    # parameters by a fraction of lr; compare with how far training moved them.  The key third
    # of each c_attn bias has an exactly zero gradient (softmax ignores a shift of every
    # score), so AdamW's steps there are normalized rounding noise: left out of the comparison.
    n = pre.config.n_embd

    def kept(name: str, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:n], t[2 * n:]]) if name.endswith("attn.c_attn.bias") else t
    pa, pb, p0 = (dict(m.named_parameters()) for m in (a, b, pre))
    diff = max(float((kept(k, pa[k]) - kept(k, pb[k])).abs().max()) for k in pa)
    moved = max(float((kept(k, pa[k]) - kept(k, p0[k])).abs().max()) for k in pa)
    assert diff < 0.02 * moved, (diff, moved)


# -- checkpoints: save_pretrained / from_pretrained, Trainer checkpoint and resume -------------
def _logits(model: nn.Module, batch: dict, fwd: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch, **fwd).logits.double()


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_save_pretrained_from_pretrained_keeps_the_function(name: str, tmp_path) -> None:
    """The preconditioned model and its fold both save as plain checkpoints: transformers
    alone reloads them with the same logits, and the config records the preconditioning."""
    model, batch = hf_tiny.build(name)
    fwd = hf_tiny.FORWARD[name]
    pre, _ = precondfx.precondition(model, batch, **fwd)
    ref = _logits(pre, batch, fwd)
    pre.save_pretrained(tmp_path / "pre")
    back = type(model).from_pretrained(tmp_path / "pre")
    assert not any("precondfx" in n for n, _ in back.named_buffers())
    assert float((_logits(back, batch, fwd) - ref).abs().max()) < 1e-6 * float(ref.abs().max())
    assert back.config.precondfx["checkpoints"] == "folded"
    assert set(back.config.precondfx["constants"]) == \
        {n for n, _ in pre.named_buffers() if "precondfx" in n}
    folded = precondfx.fold(pre)
    folded.save_pretrained(tmp_path / "folded")
    assert "precondfx" not in (tmp_path / "folded" / "config.json").read_text()
    back = type(model).from_pretrained(tmp_path / "folded")
    assert float((_logits(back, batch, fwd) - ref).abs().max()) < 1e-6 * float(ref.abs().max())


def test_reattach_restores_the_preconditioned_parametrization(tmp_path) -> None:
    from precondfx.integrations.hf import reattach
    model, batch = hf_tiny.build("gpt2", dropout=False)
    pre, _ = precondfx.precondition(model, batch, use_cache=False)
    pre.save_pretrained(tmp_path)
    back = reattach(type(model).from_pretrained(tmp_path))
    consts = {n: float(b) for n, b in pre.named_buffers() if "precondfx" in n}
    assert consts == {n: float(b) for n, b in back.named_buffers() if "precondfx" in n}
    for (n, p), (_, q) in zip(pre.named_parameters(), back.named_parameters()):
        assert float((p - q).norm()) <= 1e-6 * float(p.norm()), n
    for m in (pre, back):
        m.train().zero_grad()
        m(**batch, use_cache=False).loss.backward()
    for (n, p), (_, q) in zip(pre.named_parameters(), back.named_parameters()):
        assert float((p.grad - q.grad).norm()) <= 1e-5 * float(p.grad.norm()) + 1e-12, n
    with pytest.raises(PrecondError, match="already carries"):
        reattach(back)


class _StopAt:
    """Build a TrainerCallback that stops training after ``step`` steps (an interruption)."""

    def __new__(cls, step: int):
        import transformers as tf

        class Stop(tf.TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if state.global_step >= step:
                    control.should_training_stop = True
                    control.should_save = True
        return Stop()


def _trained(model: nn.Module, data: list[dict], out: str, callbacks=(), resume=None,
             **args) -> tuple[list[float], nn.Module]:
    losses, trainer = run_trainer(model, data, 20, 4, 1e-2, out, **args)
    for cb in callbacks:
        trainer.add_callback(cb)
    trainer.train(resume_from_checkpoint=resume)
    return losses, trainer.model


def _gap(a: nn.Module, b: nn.Module) -> float:
    """The largest parameter difference between two GPT-2s, leaving out the key third of each
    c_attn bias: its gradient is exactly zero (softmax ignores a shift of every score), so
    AdamW's steps there are normalized float-rounding noise of lr's size, whatever the run
    (``test_trainer_matches_a_plain_loop`` explains it)."""
    n = a.config.n_embd

    def kept(name: str, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:n], t[2 * n:]]) if name.endswith("attn.c_attn.bias") else t
    pb = dict(b.named_parameters())
    return max(float((kept(k, p) - kept(k, pb[k])).abs().max())
               for k, p in a.named_parameters())


def _gpt2_pre() -> tuple[nn.Module, nn.Module]:
    model, _ = hf_tiny.build("gpt2", dropout=False)
    first = _lm_data(4)
    batch = {k: torch.stack([r[k] for r in first]) for k in first[0]}
    return model, precondfx.precondition(copy.deepcopy(model), batch, use_cache=False,
                                         target_std=0.05)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[nn.Module, nn.Module, list[float], nn.Module]:
    """(plain GPT-2, preconditioned copy, losses and model of its uninterrupted 20-step Trainer
    run): the reference both resume tests compare with, trained once (the tests copy the
    models they train)."""
    pytest.importorskip("accelerate")
    plain, pre = _gpt2_pre()
    losses, model = _trained(copy.deepcopy(pre), _lm_data(20 * 4),
                             str(tmp_path_factory.mktemp("uninterrupted")))
    return plain, pre, losses, model


@pytest.mark.slow
def test_trainer_checkpoint_and_resume_ends_where_an_uninterrupted_run_does(
        tmp_path, uninterrupted) -> None:
    pytest.importorskip("accelerate")
    data = _lm_data(20 * 4)
    _, pre, full_losses, full = uninterrupted
    # interrupted after 10 steps (checkpoint written), resumed on a model preconditioned the
    # same way in a new "process"
    _trained(copy.deepcopy(pre), data, str(tmp_path / "b"), [_StopAt(10)],
             save_strategy="steps", save_steps=10)
    ckpt = tmp_path / "b" / "checkpoint-10"
    assert "precondfx" not in "".join(p.name for p in ckpt.iterdir())
    _, fresh = _gpt2_pre()
    res_losses, resumed = _trained(fresh, data, str(tmp_path / "b"), resume=str(ckpt))
    assert len(res_losses) == 10
    assert max(abs(a - b) for a, b in zip(res_losses, full_losses[10:])) < 1e-4
    diff, moved = _gap(full, resumed), _gap(full, pre)
    assert diff < 0.02 * moved, (diff, moved)


@pytest.mark.slow
def test_trainer_callback_preconditions_on_the_first_batch_and_resumes(
        tmp_path, uninterrupted) -> None:
    pytest.importorskip("accelerate")
    from precondfx.integrations.hf import precondition_callback
    data = _lm_data(20 * 4)
    plain, pre, ref_losses, ref = uninterrupted
    cb = precondition_callback(use_cache=False, target_std=0.05)
    losses, model = _trained(copy.deepcopy(plain), data, str(tmp_path / "c"), [cb])
    assert cb.report is not None and cb.report.output_scale is not None
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4
    # interrupted, then resumed on a fresh plain model with the callback
    _trained(copy.deepcopy(plain), data, str(tmp_path / "d"),
             [precondition_callback(use_cache=False, target_std=0.05), _StopAt(10)],
             save_strategy="steps", save_steps=10)
    res_losses, resumed = _trained(copy.deepcopy(plain), data, str(tmp_path / "d"),
                                   [precondition_callback(use_cache=False, target_std=0.05)],
                                   resume=str(tmp_path / "d" / "checkpoint-10"))
    assert max(abs(a - b) for a, b in zip(res_losses, ref_losses[10:])) < 1e-4
    diff, moved = _gap(ref, resumed), _gap(ref, pre)
    assert diff < 0.02 * moved, (diff, moved)


def test_unfoldable_constants_keep_raw_checkpoints_and_warn(tmp_path) -> None:
    """An input scale cannot fold: the checkpoint keeps the constants as buffers, says so in
    the config, and warns that from_pretrained would drop them."""
    from precondfx.integrations.hf import reattach
    model, batch = hf_tiny.build("vit")
    pre, _ = precondfx.precondition(model, batch, input_scale=0.5)
    assert pre.config.precondfx["checkpoints"] == "raw"
    assert any("input scale" in p for p in pre.config.precondfx["problems"])
    with pytest.warns(UserWarning, match="from_pretrained drops"):
        sd = pre.state_dict()
    assert "precondfx_input_scale" in sd
    # the same rewrite loads it back exactly
    again, _ = precondfx.precondition(hf_tiny.build("vit", seed=3)[0], batch, input_scale=0.5)
    again.load_state_dict(sd)
    assert float((_logits(again, batch, {}) - _logits(pre, batch, {})).abs().max()) < 1e-6
    with pytest.warns(UserWarning):
        pre.save_pretrained(tmp_path)
    with pytest.raises(PrecondError, match="unfolded"):
        reattach(type(model).from_pretrained(tmp_path))
