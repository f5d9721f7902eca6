"""Carry a plan out on an ONNX graph (onnx-ir): the ONNX back end of
``precondfx.core.backend.Backend``, the contract ``apply/fx_apply.py`` and
``apply/eager_apply.py`` implement too.

* A scale is a ``Mul`` by a 0-d initializer in the dtype of the value it scales (bfloat16:
  float32 between two ``Cast`` nodes, as onnxruntime has no bfloat16 ``Mul``), inserted on the
  node's activation operand (alpha, residual s), after a graph input (input scale) or before a
  graph output (output scale).  Graph outputs keep their public names: the producer's value is
  renamed ``<name>.prescale`` and the ``Mul`` output takes the public name.
* A folded max-pool changes the convolution's ``strides`` and disappears; a replaced one becomes
  a ``Conv`` (C -> C, the pool's kernel/strides/pads/dilations, weight and bias initializers named
  as the plan's ``new_param``) or an ``AveragePool``; the new node keeps the pool's name, so the
  plan's later entries (the alpha of the replacement conv) find it.
* Shapes of values whose size changed are reset, and new values get the type and shape of the
  value they replace, so stale ``value_info`` cannot contradict shape inference.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx_ir as ir

from precondfx.core.outputs import bounded_producer, others_note, pick_main, scale_moves_up, \
    skip_bounded
from precondfx.core.backend import Records
from precondfx.core.backend import PREFIX
from precondfx.errors import PrecondError
from precondfx.onnx.capture import Captured
from precondfx.onnx.io import FLOAT_TYPES
from precondfx.onnx.pools import PoolSurgery
from precondfx.core.plan import Plan, Scale


def scalar_tensor(value: float, dtype: ir.DataType | None, name: str) -> ir.TensorProtocol:
    """A 0-d tensor in ``dtype`` (float32 when unknown or not floating point)."""
    if dtype not in FLOAT_TYPES:
        dtype = ir.DataType.FLOAT
    arr = np.array(value, dtype=np.float32).astype(dtype.numpy())
    return ir.tensor(arr, dtype=dtype, name=name)


def _single(v: ir.Value) -> bool:
    """Whether the value is declared as a single number (rank 0, or every dim 1): a loss
    returned next to the logits, which is not the output to scale."""
    if v.shape is None:
        return False
    return all(isinstance(d, int) and d == 1 for d in v.shape)


def _owners(graph: ir.Graph) -> dict[int, ir.Node]:
    """id(node inside an If branch or a Loop/Scan body, nested ones included) -> the node of
    ``graph`` that holds it."""
    out: dict[int, ir.Node] = {}
    for node in graph:
        for attr in node.attributes.values():
            subs = [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else \
                list(attr.as_graphs()) if attr.type == ir.AttributeType.GRAPHS else []
            for sub in subs:
                for inner in ir.traversal.RecursiveGraphIterator(sub):
                    out[id(inner)] = node
    return out


def _downstream_outputs(v: ir.Value, graph: ir.Graph | None = None) -> set[int]:
    """The ids of the graph outputs computed from ``v`` (``v`` itself included), through the
    main graph's nodes; a value an If branch or a Loop/Scan body reads (from the enclosing
    graph, by name) reaches every output of the node that holds that subgraph."""
    owners = _owners(graph) if graph is not None else {}
    seen: set[int] = set()
    out: set[int] = set()
    todo = [v]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.is_graph_output() and (graph is None or x.graph is graph):
            out.add(id(x))
        for use in x.uses():
            todo.extend(owners.get(id(use.node), use.node).outputs)
    return out


def _safe(s: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_.]", "_", s).strip("_") or "v"


class OnnxApplier(Records, PoolSurgery):
    """The ONNX back end: applies pools and scales to an onnx-ir model; records what was
    applied and what not.  Its samples are feeds (input name -> numpy array); it runs the
    in-memory model with onnxruntime (Dropout training off)."""

    name = "onnx"
    #: the output constant is a Mul on the graph output: its std scales exactly with it
    rerun_after_scale = False

    def __init__(self, model: ir.Model, cap: Captured, seed: int = 0) -> None:
        self.model = model
        self.g = model.graph
        self.cap = cap
        self.nodes: dict[str, ir.Node] = dict(cap.nodes)
        self._records()
        self.seed = seed
        #: shape of the main output on the calibration feed (``output_std``), for ``verify``
        self.calib_shape: tuple[int, ...] | None = None
        self.output_scale_name: str | None = None
        self.output_value: ir.Value | None = None
        #: masked (-inf) entries of the main output the last std measurement left out
        self.masked_entries, self.output_size = 0, 0
        #: the std rounding alone gives the main output, and whether it is the same for every
        #: sample (``core.calibration.constancy``), read by ``core.driver.calibrate``
        self.output_floor, self.same_rows = 0.0, False
        #: float graph inputs that are not data (name -> why): masks, weights the caller feeds;
        #: the input scale (Sec. 6.3) leaves them as they are
        self.not_data: dict[str, str] = {}
        self.new_params: list[str] = []
        #: calibration inputs filled with random N(0, 1) data (``io.Feeds.random``), named when
        #: the output is not finite on them
        self.random_inputs: list[str] = []
        #: mask inputs filled with ones (``io.Feeds.ones``), named with them
        self.ones_inputs: list[str] = []
        self._names = {n.name for n in self.g if n.name}
        self._values: set[str] = {v.name for v in self.g.initializers.values() if v.name}
        for n in self.g:
            for o in n.outputs:
                if o.name:
                    self._values.add(o.name)
        for v in self.g.inputs:
            self._values.add(v.name)

    # -- helpers -----------------------------------------------------------------------------
    def _fresh(self, base: str, pool: set[str]) -> str:
        name, i = base, 1
        while name in pool:
            name = f"{base}_{i}"
            i += 1
        pool.add(name)
        return name

    def _dtype(self, v: ir.Value) -> ir.DataType | None:
        """The element type of a tensor value (None for sequences, maps, optionals: no scale
        can multiply them)."""
        if v.type is not None and not isinstance(v.type, ir.TensorType):
            return None
        if v.dtype is not None:
            return v.dtype
        et = self.cap.dtypes.get(v.name or "")
        if et:
            try:
                return ir.DataType(et)
            except ValueError:
                return None
        return None

    def _const(self, base: str, value: float, like: ir.Value) -> ir.Value:
        name = self._fresh(base, self._values)
        dtype = self._dtype(like)
        if dtype == ir.DataType.BFLOAT16:    # multiplied in float32 (``_mul_nodes``)
            dtype = ir.DataType.FLOAT
        t = scalar_tensor(value, dtype, name)
        c = ir.Value(name=name, shape=ir.Shape([]), type=ir.TensorType(t.dtype), const_value=t)
        self.g.register_initializer(c)
        return c

    def _mul_nodes(self, x: ir.Value, c: ir.Value, out_name: str, node_name: str
                   ) -> list[ir.Node]:
        """``x * c`` as nodes to insert in order (the last one's output is the product): one
        ``Mul``, or for bfloat16 ``Cast`` to float32, ``Mul``, ``Cast`` back: onnxruntime's CPU
        provider has no bfloat16 ``Mul``, and this is how bfloat16 arithmetic rounds anyway."""
        shape = x.shape.copy() if x.shape is not None else None
        out = ir.Value(name=self._fresh(out_name, self._values), type=x.type, shape=shape)
        name = self._fresh(node_name, self._names)
        if self._dtype(x) != ir.DataType.BFLOAT16:
            return [ir.Node("", "Mul", [x, c], outputs=[out], name=name)]
        f32 = ir.TensorType(ir.DataType.FLOAT)
        up = ir.Value(name=self._fresh(f"{out_name}_f32", self._values), type=f32, shape=shape)
        prod = ir.Value(name=self._fresh(f"{out_name}_f32mul", self._values), type=f32,
                        shape=shape.copy() if shape is not None else None)
        return [ir.Node("", "Cast", [x], attributes=[ir.AttrInt64("to", ir.DataType.FLOAT)],
                        outputs=[up], name=self._fresh(f"{name}_to_f32", self._names)),
                ir.Node("", "Mul", [up, c], outputs=[prod], name=name),
                ir.Node("", "Cast", [prod],
                        attributes=[ir.AttrInt64("to", ir.DataType.BFLOAT16)], outputs=[out],
                        name=self._fresh(f"{name}_to_bf16", self._names))]

    def _insert_before(self, anchor: ir.Node | None, new: ir.Node) -> None:
        if anchor is None:
            nodes = list(self.g)
            if nodes:
                self.g.insert_before(nodes[0], new)
            else:
                self.g.append(new)
        else:
            self.g.insert_before(anchor, new)

    # -- scales ------------------------------------------------------------------------------
    def scale(self, sc: Scale) -> str | None:
        """Insert one scale; returns the constant's initializer name (None if not placed)."""
        node, key, what = self._scale_node(self.nodes, sc, "node not found in the ONNX graph")
        if node is None:
            return None
        base = f"{PREFIX}{sc.tag}_{_safe(sc.node)}"
        if sc.where in ("input", "operand"):
            slots = self.cap.act_index.get(sc.node, [])
            if sc.index >= len(slots):
                self._skip(key, what, f"activation operand {sc.index} not found")
                return None
            slot = slots[sc.index]
            x = node.inputs[slot]
            if x is None:
                self._skip(key, what, f"input {slot} is empty")
                return None
            c = self._const(base + (f"_{sc.index}" if sc.where == "operand" else ""), sc.value,
                            x)
            ms = self._mul_nodes(x, c, f"{x.name}_{sc.tag}", f"{base}_mul")
            for m in ms:
                self._insert_before(node, m)
            node.replace_input_with(slot, ms[-1].outputs[0])
        else:  # output of the node
            out = node.outputs[0]
            c = self._const(base, sc.value, out)
            ms = self._mul_nodes(out, c, f"{out.name}_{sc.tag}", f"{base}_mul")
            self.g.insert_after(node, ms)
            self._redirect(out, ms[-1].outputs[0], exclude=ms[0])
        self._done(key, f"{sc.tag} {sc.value:.4g} at {sc.where} of {sc.node} ({c.name})",
                   c.name)
        return c.name

    def _redirect(self, old: ir.Value, new: ir.Value, exclude: ir.Node | None = None) -> None:
        """Every use of ``old`` (except in ``exclude``) reads ``new``; graph outputs keep their
        public names."""
        for use in list(old.uses()):
            if use.node is not exclude:
                use.node.replace_input_with(use.idx, new)
        if old.is_graph_output():
            public = old.name
            for i, o in enumerate(self.g.outputs):
                if o is old:
                    self.g.outputs[i] = new
            if new.type is None:
                new.type = old.type
            old.name = self._fresh(f"{public}.prescale", self._values)
            new.name = public

    def input_scale(self, value: float) -> list[str]:
        names = []
        first = next(iter(self.g), None)
        for nname, v in self.cap.input_nodes.items():
            if self._dtype(v) not in FLOAT_TYPES:
                continue
            if not list(v.uses()):
                continue
            if v.name in self.not_data:      # a mask or a weight fed by the caller
                self._skip(None, "input scale", f"not on input {v.name!r}: "
                           f"{self.not_data[v.name]}")
                continue
            c = self._const(f"{PREFIX}input_{_safe(v.name)}", value, v)
            ms = self._mul_nodes(v, c, f"{v.name}_input_scale",
                                 f"{PREFIX}input_{_safe(v.name)}_mul")
            for m in ms:
                self._insert_before(first, m)
            for use in list(v.uses()):
                if use.node is not ms[0]:
                    use.node.replace_input_with(use.idx, ms[-1].outputs[0])
            names.append(c.name)
            self.applied.append(f"input scale {value:.4g} on {v.name} ({c.name})")
        if not names:
            self._skip("input", "input scale", "no floating-point input to scale")
        else:
            self._done("input", None, names[0])
        return names

    def main_output(self, path: list) -> tuple[int, ir.Value]:
        """The graph output the output scale applies to: ``path`` empty -> the rule of
        ``precondfx.core.outputs`` ('logits', else the first floating-point output); ``[key]`` -> by
        name or index."""
        outs = list(self.g.outputs)
        if path:
            key = path[0]
            names = [o.name for o in outs]
            if isinstance(key, int) and not 0 <= key < len(outs) and str(key) in names:
                key = str(key)      # '--output-key 12' for the legacy exporter's output '12'
            if isinstance(key, int) or (isinstance(key, str) and key.isdigit()
                                        and key not in names):
                k = int(key)
                if not 0 <= k < len(outs):
                    raise PrecondError(f"output_key={key!r}: the model has {len(outs)} "
                                       f"output(s)")
                return k, self._floating(key, outs[k], outs)
            for i, o in enumerate(outs):
                if o.name == key:
                    return i, self._floating(key, o, outs)
            raise PrecondError(f"output_key={key!r} names no graph output; the outputs are "
                               f"{[o.name for o in outs]}")
        name = pick_main((o.name, self._dtype(o) in FLOAT_TYPES, not _single(o)) for o in outs)
        if name is not None:
            i = next(i for i, o in enumerate(outs) if o.name == name)
            return i, outs[i]
        raise PrecondError(f"no floating-point graph output to scale (outputs "
                           f"{[o.name for o in outs]}); pass target_std=None")

    def others_note(self, scaled: ir.Value | None = None) -> str | None:
        """``core.outputs.others_note`` for the graph outputs beside the main one (floating
        point, not declared a single number), as the PyTorch back end says it; ``scaled``:
        the value the output scale multiplied, whose downstream outputs (a softmax of the
        logits) see the scale in the file."""
        i, main = self.main_output([])
        seen = _downstream_outputs(scaled, self.g) if scaled is not None else set()
        through, others = [], []
        for k, o in enumerate(self.g.outputs):
            if k != i and o is not main and self._dtype(o) in FLOAT_TYPES and not _single(o):
                (through if id(o) in seen else others).append(f"output {o.name!r}")
        return others_note(f"output {main.name!r}", others, through)

    def _floating(self, key: Any, o: ir.Value, outs: list[ir.Value]) -> ir.Value:
        """``o`` when the output scale can multiply it (a floating-point tensor, or one of
        unknown type); else the error naming the outputs that qualify."""
        if self._dtype(o) in FLOAT_TYPES or (o.type is None and o.dtype is None):
            return o
        what = o.type if o.type is not None else o.dtype
        ok = [x.name for x in outs if self._dtype(x) in FLOAT_TYPES]
        raise PrecondError(f"output_key={key!r} selects output {o.name!r} of type {what}: the "
                           f"output scale multiplies a floating-point tensor; choose one of "
                           f"{ok} or pass target_std=None")

    def output_scale(self, path: list) -> str | None:
        i, out = self.main_output(path)
        if out.is_graph_input() or out.is_initializer() or out.producer() is None:
            self._skip("output", "output scale", f"output {out.name!r} is a graph input or a "
                       f"constant, not computed by a node")
            return None
        bounded = bounded_producer(self.cap.graph, out.producer().name)
        if bounded is not None:
            skip_bounded(self, bounded)
            return None
        # where the main output is computed (core.outputs.scale_moves_up): every use in the
        # graph (a softmax, a loss computed from the logits) sees the scale, as on the PyTorch
        # back ends; graph outputs keep their public names
        at = self._scale_site(out)
        c = self._const(f"{PREFIX}output_scale", 1.0, at)
        ms = self._mul_nodes(at, c, f"{at.name}_scaled", f"{PREFIX}output_scale_mul")
        self.g.insert_after(at.producer(), ms)
        self._redirect(at, ms[-1].outputs[0], exclude=ms[0])
        self.output_scale_name = c.name
        self.output_value = ms[-1].outputs[0] if at is out else out
        self._done("output", None, c.name)
        # the outputs beside the main one: which see the scale, which not
        note = self.others_note(ms[-1].outputs[0]) if not path else \
            self._keyed_note(i, ms[-1].outputs[0])
        if note:
            self.cap.graph.notes.append(note)
        return c.name

    def _keyed_note(self, i: int, scaled: ir.Value) -> str | None:
        """With ``output_key=`` (graph output ``i``): the other graph outputs computed from
        the scaled value, which see the scale in the file too (None when there are none)."""
        seen = _downstream_outputs(scaled, self.g)
        through = [f"output {o.name!r}" for k, o in enumerate(self.g.outputs) if k != i and
                   id(o) in seen and self._dtype(o) in FLOAT_TYPES]
        if not through:
            return None
        return (f"output scale on output {self.g.outputs[i].name!r} (output_key=); "
                f"{', '.join(through)} "
                f"{'are' if len(through) > 1 else 'is'} computed from it in the model, so "
                f"{'they see' if len(through) > 1 else 'it sees'} the scale too")

    def _scale_site(self, out: ir.Value) -> ir.Value:
        """The value the output scale multiplies: ``out``, or up through the ops that
        ``core.outputs.scale_moves_up`` names (a final ``Reshape``/``Cast``, a sole slice) to
        the floating-point value a node computes."""
        v = out
        while True:
            node = v.producer()
            gn = self.cap.graph.get(node.name) if node is not None else None
            slots = self.cap.act_index.get(node.name, []) if node is not None else []
            src = node.inputs[slots[0]] if gn is not None and len(slots) == 1 else None
            if src is None or src.producer() is None or src.is_graph_input() or \
                    src.is_initializer() or self._dtype(src) not in FLOAT_TYPES or \
                    not scale_moves_up(gn.kind, len(slots), len(list(src.uses()))):
                return v
            v = src

    def replace(self, name: str, mod: Any, path: str | None = None,
                all_calls: bool = False) -> bool:
        """Module replacements (schemes) need the PyTorch model: never done here."""
        self._skip(f"replace:{name}", name, "replacement: a module replacement needs the PyTorch "
                   "model (schemes run on the PyTorch back ends only)")
        return False

    def input_module(self, name: str, mod: Any) -> bool:
        """A PyTorch module cannot run inside an ONNX graph: never done here."""
        self._skip(f"module:{name}", name, "a PyTorch module cannot be inserted into an ONNX "
                   "graph")
        return False

    def finish(self) -> None:
        """Nothing to recompile: the graph stays topologically sorted by construction."""
        return None

    def rollback(self) -> None:
        """Nothing to undo: the model is an in-memory copy of the file, which is not written
        until every stage has passed (``precondfx.onnx.io.Staging``)."""
        return None

    # -- re-initialization and runs ----------------------------------------------------------
    def reinit(self, plan: Plan, seed: int) -> list[str]:
        """``precondfx.onnx.reinit.reinit``: the plan's inits drawn with numpy."""
        from precondfx.onnx.reinit import reinit
        return reinit(self.model, plan, seed)

    def run(self, sample: Any, mode: str) -> dict[str, np.ndarray]:
        """Every graph output on the feed ``sample`` (name -> array); ``mode`` does not apply
        (an ONNX graph runs as exported, Dropout training off)."""
        from precondfx.onnx import calibrate as cal
        sess = cal.session_for_model(self.model)
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, cal.run(sess, sample, names)))

    def seeded_output_std(self, sample: Any, mode: str, key: Any, seed: int
                          ) -> tuple[float, bool]:
        """The output std; an ONNX graph's random ops (RandomNormal...) are not seeded here
        and not detected (exported models rarely keep them: dropout exports as identity)."""
        return self.output_std(sample, mode, key), False

    def output_std(self, sample: Any, mode: str, key: Any = None) -> float:
        """Std of the output the output constant scales (the main output)."""
        from precondfx.onnx import calibrate as cal
        name = self.output_value.name if self.output_value is not None else \
            self.main_output([key] if key is not None else [])[1].name
        std, self.calib_shape, self.masked_entries, const = cal.measure_model(
            self.model, sample, name)
        # the driver refuses an output constant to rounding, and notes one that is the same
        # for every sample (core.calibration.constancy, the PyTorch back end's rule)
        self.output_floor, self.same_rows = const
        self.output_size = int(np.prod(self.calib_shape))
        made_up = self.random_inputs + self.ones_inputs
        if not np.isfinite(std) and made_up:
            shapes = ", ".join(f"{n} {list(np.shape(sample[n]))}" for n in made_up)
            flags = " ".join(f"--calib-input {n}=FILE.npy" for n in made_up)
            what = " and ".join(w for w, names in (("random N(0,1) data", self.random_inputs),
                                                   ("ones (a mask)", self.ones_inputs)) if names)
            raise PrecondError(
                f"output {name!r} has NaN/inf values on the calibration batch, and the inputs "
                f"{shapes} were {what} (no calibration data was given for them): an "
                f"input the model reads as a mask, a probability or a positive quantity (log, "
                f"sqrt, a division) needs its real values; give them with {flags} or --calib "
                f"(from Python: feeds=), or pass target_std=None to skip the output scale")
        return std

    def set_constant(self, name: str, value: float) -> None:
        v = self.g.initializers[name]
        v.const_value = scalar_tensor(value, v.dtype, name)

    def set_output_scale(self, value: float) -> None:
        """The output constant (``output_scale``) set to ``value``."""
        if self.output_scale_name is not None:
            self.set_constant(self.output_scale_name, value)

    def probe(self, run: Any, names: list[str]) -> dict[str, np.ndarray]:
        """Values of the named nodes' (first) outputs while ``run(fn)`` calls ``fn(feeds)``:
        the model is run with those values as extra graph outputs (then removed again)."""
        from precondfx.onnx import calibrate as cal
        want = {n: self.nodes[n].outputs[0] for n in names if n in self.nodes}
        extra = [v for v in want.values() if not v.is_graph_output()]
        self.g.outputs.extend(extra)
        try:
            sess = cal.session_for_model(self.model)
        finally:
            for _ in extra:
                self.g.outputs.pop()
        got: dict[str, np.ndarray] = {}

        def fn(feeds: Any) -> Any:
            outs = cal.run(sess, feeds, [v.name for v in want.values()])
            got.update(zip(want, outs))
            return outs
        run(fn)
        return got

    def probe_sample(self, sample: Any, names: list[str], mode: str) -> dict[str, np.ndarray]:
        """``probe`` on one run of the feeds (an ONNX run has no gradients or side effects)."""
        return self.probe(lambda fn: fn(sample), names)

