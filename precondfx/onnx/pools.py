"""The ONNX back end's max-pool surgery: fold a stride into the producing Conv, or replace a
MaxPool by a strided Conv or an AveragePool, as ``plan.pools`` says.  A mixin of
:class:`~precondfx.onnx.apply.OnnxApplier`, which holds the graph and the records it edits.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from precondfx.core.backend import PREFIX
from precondfx.core.plan import Plan, PoolChange
from precondfx.errors import PrecondError


class PoolSurgery:
    """The pool half of the ONNX back end (``OnnxApplier`` mixes it in)."""

    def pools(self, plan: Plan) -> None:
        for pc in plan.pools:
            if pc.action == "keep":
                continue
            node = self.nodes.get(pc.node)
            if node is None:
                self._skip(f"pool:{pc.node}", f"maxpool {pc.node}", "node not in the ONNX graph")
                self.pool_notes[pc.node] = "NOT APPLIED: node not found"
                continue
            if pc.action == "fold":
                self._fold(pc, node)
            elif pc.action == "conv":
                self._replace_conv(pc, node)
            elif pc.action == "avgpool":
                self._replace_avg(pc, node)

    def _fold(self, pc: PoolChange, pool: ir.Node) -> None:
        conv = self.nodes[pc.into]
        x = pool.inputs[0]
        out = pool.outputs[0]
        conv.attributes["strides"] = ir.AttrInt64s("strides", list(pc.geometry["conv_stride"]))
        # the conv's output and the elementwise chain up to the pool now have the pool's shape
        v = x
        while v is not None:
            prod = v.producer()
            targets = [v] if prod is None or prod is conv else list(prod.outputs)  # + masks
            for t in targets:
                t.shape = out.shape.copy() if out.shape is not None else None
            if prod is None or prod is conv:
                break
            v = prod.inputs[0] if prod.inputs else None
        conv.outputs[0].shape = out.shape.copy() if out.shape is not None else None
        if out.is_graph_output():
            self._replace_output_value(out, x)
        else:
            self._redirect(out, x)
        self.g.remove(pool, safe=True)
        self._done(f"pool:{pc.node}", f"maxpool {pc.node} folded into {pc.into} (strides "
                   f"{list(pc.geometry['conv_stride'])})")

    def _replace_output_value(self, old: ir.Value, new: ir.Value) -> None:
        """``old`` is a graph output produced by a node that goes away: ``new`` takes its
        place (through an Identity when ``new`` is itself public)."""
        for use in list(old.uses()):
            use.node.replace_input_with(use.idx, new)
        public = old.name
        if new.is_graph_input() or new.is_graph_output() or new.is_initializer():
            ident = ir.Node("", "Identity", [new], outputs=[ir.Value(type=old.type,
                            shape=old.shape)], name=self._fresh(f"{public}_identity",
                                                                self._names))
            self.g.append(ident)
            new = ident.outputs[0]
        for i, o in enumerate(self.g.outputs):
            if o is old:
                self.g.outputs[i] = new
        if new.type is None:
            new.type = old.type
        if new.shape is None and old.shape is not None:
            new.shape = old.shape.copy()
        old.name = self._fresh(f"{public}.removed", self._values)
        new.name = public

    def _swap_node(self, old: ir.Node, new: ir.Node) -> None:
        out, nout = old.outputs[0], new.outputs[0]
        nout.type = out.type
        nout.shape = out.shape.copy() if out.shape is not None else None
        self.g.insert_before(old, new)
        extra = [o for o in old.outputs[1:] if list(o.uses()) or o.is_graph_output()]
        if extra:
            raise PrecondError(f"{old.name}: its indices output is used; it cannot be replaced")
        if out.is_graph_output():
            self._replace_output_value(out, nout)
        else:
            for use in list(out.uses()):
                use.node.replace_input_with(use.idx, nout)
            public = out.name
            out.name = None
            nout.name = public
        old_name = old.name
        self.g.remove(old, safe=True)
        new.name = old_name
        new.metadata_props.update(old.metadata_props)
        self.nodes[old_name] = new

    def _replace_conv(self, pc: PoolChange, pool: ir.Node) -> None:
        geo = pc.geometry
        x = pool.inputs[0]
        dtype = self._dtype(x) or ir.DataType.FLOAT
        c, k = int(geo["channels"]), [int(v) for v in geo["kernel"]]
        wname = pc.new_param or f"{PREFIX}pool_{pool.name}.weight"
        bname = wname[: -len("weight")] + "bias" if wname.endswith("weight") else wname + ".bias"
        kind = getattr(pc, "conv", "full")
        cin = 1 if kind == "depthwise" else c            # input channels per group
        fan_in = cin * math.prod(k)
        bound = 1.0 / math.sqrt(fan_in)
        # PyTorch's default init of a new Conv (uniform +-1/sqrt(fan_in)); re-init replaces it
        rng = np.random.default_rng([self.seed, len(self.new_params)])
        w = rng.uniform(-bound, bound, size=(c, cin, *k)).astype(np.float32)
        b = rng.uniform(-bound, bound, size=(c,)).astype(np.float32)
        if kind == "avg":       # average pooling (kept by the plan's init, divided by alpha)
            w = np.zeros((c, c, *k), np.float32)
            w[np.arange(c), np.arange(c)] = 1.0 / math.prod(k)
            b = np.zeros((c,), np.float32)
        vals = []
        for name, arr in ((wname, w), (bname, b)):
            if name in self.g.initializers:
                raise PrecondError(f"cannot add the replacement conv's parameter {name!r}: an "
                                   f"initializer of that name exists")
            t = ir.tensor(arr.astype(dtype.numpy()), dtype=dtype, name=name)
            v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(dtype),
                         const_value=t)
            self.g.register_initializer(v)
            self._values.add(name)
            vals.append(v)
            self.new_params.append(name)
        pads = [int(p) for p in geo["padding"]] * 2
        attrs = [ir.AttrInt64s("kernel_shape", k),
                 ir.AttrInt64s("strides", [int(s) for s in geo["stride"]]),
                 ir.AttrInt64s("pads", pads),
                 ir.AttrInt64s("dilations", [int(d) for d in geo["dilation"]]),
                 ir.AttrInt64("group", c if kind == "depthwise" else 1)]
        new = ir.Node("", "Conv", [x, vals[0], vals[1]], attributes=attrs,
                      outputs=[ir.Value()], name=self._fresh(f"{pool.name}.conv", self._names))
        self._swap_node(pool, new)
        self._done(f"pool:{pc.node}", f"maxpool {pc.node} replaced by a strided Conv {c}->{c} "
                   f"(weight {wname})")

    def _replace_avg(self, pc: PoolChange, pool: ir.Node) -> None:
        geo = pc.geometry
        if any(int(d) != 1 for d in geo["dilation"]):
            raise PrecondError(f"{pc.node}: average pooling has no dilation; use maxpool='conv'")
        attrs = [ir.AttrInt64s("kernel_shape", [int(v) for v in geo["kernel"]]),
                 ir.AttrInt64s("strides", [int(s) for s in geo["stride"]]),
                 ir.AttrInt64s("pads", [int(p) for p in geo["padding"]] * 2),
                 ir.AttrInt64("ceil_mode", int(bool(geo["ceil_mode"]))),
                 ir.AttrInt64("count_include_pad", 1)]
        new = ir.Node("", "AveragePool", [pool.inputs[0]], attributes=attrs,
                      outputs=[ir.Value()], name=self._fresh(f"{pool.name}.avg", self._names))
        self._swap_node(pool, new)
        self._done(f"pool:{pc.node}", f"maxpool {pc.node} replaced by AveragePool")
