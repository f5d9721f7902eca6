"""What ``scheme="gne"`` swaps in the model: every SELU for the depth-aware :class:`ScaledSELU`
(eq. 32), every BatchNorm module for Second Moment Normalization (eq. 25), and the weight
centring of the conv/linear feeding each SMN (eq. 26)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from precondfx.core.graph import Graph, Node
from precondfx.core.plan import Plan
from precondfx.core.scheme import SchemeContext
from precondfx.errors import PrecondError
from precondfx.schemes.activations import activation_of
from precondfx.schemes.gne.selu import ScaledSELU
from precondfx.schemes.gne.smn import SecondMomentNorm, register_weight_centering


def selu_replacements(graph: Graph, coef: tuple[float, float]
                      ) -> list[tuple[str, nn.Module, str]]:
    """Every SELU node becomes a ScaledSELU (one module per module path)."""
    out: list[tuple[str, nn.Module, str]] = []
    made: dict[str, nn.Module] = {}
    for n in graph:
        if n.kind == "exp_linear" and activation_of(n)[0] == "selu":
            path = n.module or f"precondfx_selu_{n.name}"
            mod = made.setdefault(path, ScaledSELU(*coef))
            out.append((n.name, mod, path))
    return out


def smn_replacements(graph: Graph, plan: Plan, model: nn.Module | None,
                     smn_rows: list[dict[str, Any]]) -> list[tuple[str, nn.Module, str]]:
    """Every BatchNorm module becomes a SecondMomentNorm; what happened to each goes to
    ``smn_rows``."""
    out: list[tuple[str, nn.Module, str]] = []
    for n in graph:
        if n.kind != "normalization":
            continue
        cls = str(n.attrs.get("class", ""))
        if not cls.startswith("BatchNorm") and "batch_norm" not in n.target:
            continue
        if n.module is None:
            smn_rows.append({"node": n.name, "replaced": False, "why": "functional "
                             "batch_norm (its running statistics are arguments): no "
                             "module to swap"})
            continue
        smn, how = _smn_for(n, plan, model)
        smn_rows.append({"node": n.name, "module": n.module, "replaced": True,
                         "built_from": how})
        out.append((n.name, smn, n.module))
    return out


def _smn_for(n: Node, plan: Plan, model: nn.Module | None) -> tuple[nn.Module, str]:
    """A SecondMomentNorm with the BN's num_features/eps/momentum/affine."""
    bn = None
    if model is not None and n.module:
        try:
            bn = model.get_submodule(n.module)
        except AttributeError:
            bn = None
    if isinstance(bn, nn.modules.batchnorm._BatchNorm):
        return SecondMomentNorm.from_batchnorm(bn), "the BatchNorm module's attributes"
    w = plan.inits.get(n.params.get("weight", ""))
    nf = int(n.out_shape[1]) if n.out_shape and len(n.out_shape) > 1 else \
        (int(w.shape[0]) if w is not None and w.shape else 0)
    if nf <= 0:
        raise PrecondError(f"gne norm='smn': number of features of {n.name} unknown")
    affine = "weight" in n.params
    return SecondMomentNorm(nf, affine=affine), (
        f"the graph: num_features={nf}, affine={affine}; eps=1e-5 and momentum=0.1 (PyTorch "
        f"defaults: the normalization module was not found)")


def center_weights(ctx: SchemeContext, smn_rows: list[dict[str, Any]], smn_center: bool
                   ) -> None:
    """eq. 26: the conv/linear feeding each SMN gets a per-output-channel mean removal."""
    calls: dict[str, int] = {}
    for n in ctx.graph:
        if n.module:
            calls[n.module] = calls.get(n.module, 0) + 1
    for row in smn_rows:
        if not row.get("replaced"):
            continue
        bn = ctx.graph[row["node"]]
        prod = ctx.graph.get(bn.inputs[0]) if bn.inputs else None
        if not smn_center:
            row["centered"] = "no (smn_center=False)"
        elif prod is None or prod.kind not in ("conv", "linear") or prod.module is None \
                or "weight" not in prod.params:
            row["centered"] = "no: the SMN's input does not come from a conv/linear module"
        elif calls.get(prod.module, 0) != 1:
            row["centered"] = f"no: {prod.module} is called more than once"
        elif ctx.opts.balance in ("hessian", "auto"):
            row["centered"] = ("no: measured balancing rescales the plain weight parameter, "
                               "which a parametrization would hide")
        else:
            mod = ctx.model.get_submodule(prod.module)
            if torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
                row["centered"] = f"no: {prod.module}.weight is already parametrized"
                continue
            register_weight_centering(mod)
            row["centered"] = (f"{prod.module}.weight centred per output channel (eq. 26; "
                               f"now {prod.module}.parametrizations.weight.original; a "
                               f"parametrized model saves through state_dict, not pickle)")
