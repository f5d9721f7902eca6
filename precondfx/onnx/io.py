"""Read and write ONNX files: lazy loading, the save policy, and calibration data.

``load`` reads a model with onnx-ir, which leaves external weights on disk (memory-mapped) until
they are touched.  ``save`` writes atomically: everything goes to a temporary folder inside the
output's directory and is moved into place with ``os.replace``; the input is never written over
(also when two spellings name the same file).  Weights go to one external data file
``<out>.data`` (``model.onnx`` -> ``model.onnx.data``) when the input had external data or the
weights exceed about 1.8 GB (protobuf's limit is 2 GB); otherwise they stay inline.  When the
model already at the output path reads ``<out>.data``, the new weights go to a name unique to
the write (``<out>.<8 hex digits>.data``): an interrupted write leaves the earlier output with
its own weights (``Staging``).

``load_calibration`` and ``resolve_feeds`` turn ``.npy``/``.npz`` files and ``--dim``/``--batch``
hints into the calibration feed: one array per model input, checked against the model's shapes.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import onnx_ir as ir

from precondfx.errors import PrecondError
from precondfx.core.arrays import positional_keys, read_npy, read_npz
from precondfx.core.calibration import is_additive_mask

#: errno values of a write that found no room (disk full, quota, file size limit)
_FULL = tuple(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n))
EXTERNAL_LIMIT = int(1.8 * 2**30)   # above this many bytes of weights, save externally
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def check_path_arg(path: Any, what: str) -> None:
    """Refuse a model object where a file path is expected (an ``onnx.ModelProto`` or an
    ``onnx_ir.Model`` in memory): the ONNX path reads and writes files."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        hint = " (save it first: onnx.save(model, 'model.onnx'), then pass 'model.onnx')" \
            if hasattr(path, "graph") else ""
        raise PrecondError(f"{what} must be a path to an .onnx file, got "
                           f"{type(path).__module__}.{type(path).__name__}{hint}")


def load(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX model lazily (external data stays on disk until read)."""
    check_path_arg(path, "the input model")
    path = os.fsdecode(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    if os.path.isdir(path):
        raise PrecondError(f"{path} is a directory, not an ONNX file")
    if os.path.getsize(path) == 0:
        raise PrecondError(f"{path} is empty: not an ONNX model")
    try:
        model = ir.load(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # protobuf DecodeError, truncated files, bad external references
        if type(e).__name__ == "SerdeError":      # parsed, but not representable
            inner: BaseException = e
            while inner.__cause__ is not None:
                inner = inner.__cause__
            what = " ".join(str(inner).split())[:300]
            raise PrecondError(f"{path} is an ONNX model that precondfx's reader (onnx-ir) "
                               f"cannot represent ({what}): map types, for example, are not "
                               f"supported; remove that part (e.g. a final ZipMap) and "
                               f"precondition the rest") from None
        msg = " ".join(str(e).split()) or type(e).__name__
        raise PrecondError(f"cannot read {path} as an ONNX model ({type(e).__name__}: "
                           f"{msg[:200]}); is the file complete and really ONNX?") from None
    if model.graph is None or (len(model.graph) == 0 and not model.graph.outputs):
        raise PrecondError(f"{path} holds no graph (an empty or truncated ONNX file)")
    if not model.graph.outputs:
        raise PrecondError(f"{path}: the graph has no outputs (a truncated ONNX file?)")
    check_external_data(model, path)
    check_defined(model, path)
    return model


def check_defined(model: ir.Model, path: str) -> None:
    """Refuse a graph whose nodes read a value that nothing defines (no node, graph input or
    initializer): a ``sparse_initializer``, which onnx-ir does not read (the rewritten file
    would lose it), or a broken file."""
    for node in model.graph:
        for v in node.inputs:
            if v is None or not v.name or v.producer() is not None or v.is_graph_input() \
                    or v.is_initializer():
                continue
            if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and \
                    v is node.inputs[1] and not all_initializers(model):
                raise PrecondError(f"{path}: node {node.name or node.op_type!r} reads its weight "
                                   f"{v.name!r}, which no node, graph input or initializer "
                                   f"defines, and the file holds no initializers at all: were "
                                   f"the weights left out (torch.onnx.export(..., "
                                   f"export_params=False))? Export with export_params=True (the "
                                   f"default) and precondition that file (a sparse initializer "
                                   f"is not supported either: store it as a dense one)")
            raise PrecondError(f"{path}: node {node.name or node.op_type!r} reads {v.name!r}, "
                               f"which no node, graph input or initializer defines (a sparse "
                               f"initializer? they are not supported: store it as a dense "
                               f"initializer, e.g. with onnx.numpy_helper)")


def check_external_data(model: ir.Model, path: str) -> None:
    """Refuse a model whose external data files are missing or shorter than the tensors they
    hold (a partial copy or download), before anything reads them: the weights the plan keeps
    (norm gains, embeddings it does not draw) would fail half-way through, or not at all when
    every weight is drawn anew.  Only file sizes are read."""
    base = os.path.dirname(os.path.abspath(path))
    sizes: dict[str, int] = {}
    for v in all_initializers(model):
        t = v.const_value
        if not isinstance(t, ir.ExternalTensor):
            continue
        check_inside(path, base, os.fspath(t.location), v.name)
        f = os.path.join(base, os.fspath(t.location))
        if f not in sizes:
            sizes[f] = os.path.getsize(f) if os.path.isfile(f) else -1
        if sizes[f] < 0:
            raise PrecondError(f"{path}: the external data file {t.location!r} of tensor "
                               f"{v.name!r} is missing (looked for {f}); copy it next to the "
                               f"model, as the model names it")
        end = (t.offset or 0) + (t.length if t.length is not None else t.nbytes)
        if end > sizes[f]:
            raise PrecondError(f"{path}: the external data file {t.location!r} holds "
                               f"{sizes[f]} bytes, but tensor {v.name!r} needs bytes up to "
                               f"{end} (a truncated or partial copy?); copy the complete file")


def check_inside(path: str, base: str, location: str, tensor: str) -> None:
    """Refuse an external data ``location`` that leads outside the model's folder ``base``:
    an absolute path, a ``..`` step above the folder, or a symbolic link inside the folder
    whose target is outside.  Only the folder's own entries are looked at (``os.lstat`` and
    ``os.readlink`` of the path's components inside it); nothing outside is opened or
    statted, so no byte or size from outside the folder reaches an output or a message."""
    def refuse(why: str) -> PrecondError:
        return PrecondError(f"{path}: the external data of tensor {tensor!r} is at {location!r}, "
                            f"{why}; precondfx reads external data only from the model's "
                            f"folder: copy the data file next to the model and name it "
                            f"relative to it")
    if not location or os.path.isabs(location) or os.path.splitdrive(location)[0] \
            or location.startswith(("/", "\\")):
        raise refuse("an absolute path")
    root = os.path.realpath(base)
    parts = [p for p in location.replace("\\", "/").split("/") if p not in ("", ".")]
    cur, hops = root, 0
    while parts:
        p = parts.pop(0)
        if p == "..":
            cur = os.path.dirname(cur)
        else:
            cur = os.path.join(cur, p)
        if cur != root and not cur.startswith(root + os.sep):
            raise refuse("outside the model's folder")
        if p != ".." and os.path.islink(cur):       # lstat of an entry inside the folder
            hops += 1
            if hops > 40:
                raise refuse("a loop of symbolic links")
            target = os.readlink(cur)
            if os.path.isabs(target):
                t = os.path.normpath(target)
                if t != root and not t.startswith(root + os.sep):
                    raise refuse(f"a symbolic link to {target!r}, outside the model's folder")
                cur, parts = root, [x for x in os.path.relpath(t, root).split(os.sep)
                                    if x not in ("", ".")] + parts
            else:
                cur = os.path.dirname(cur)
                parts = [x for x in target.replace("\\", "/").split("/")
                         if x not in ("", ".")] + parts


def all_initializers(model: ir.Model) -> list[ir.Value]:
    """The initializers of the main graph and of every subgraph (If branches, Loop and Scan
    bodies, nested): a subgraph's tensors live in the same file and data files as the main
    graph's."""
    out = list(model.graph.initializers.values())
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            graphs = [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else \
                list(attr.as_graphs()) if attr.type == ir.AttributeType.GRAPHS else []
            for g in graphs:
                out.extend(g.initializers.values())
    return out


def input_files(model: ir.Model, path: str | os.PathLike) -> list[str]:
    """The model file and every external data file it reads."""
    files = {os.path.realpath(path)}
    base = os.path.dirname(os.path.abspath(path))
    for v in all_initializers(model):
        t = v.const_value
        if isinstance(t, ir.ExternalTensor):
            files.add(os.path.realpath(os.path.join(t.base_dir or base, t.location)))
    return sorted(files)


def has_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in all_initializers(model))


def weight_bytes(model: ir.Model) -> int:
    """Bytes of all initializers, subgraphs' included (from their shapes and dtypes; nothing
    is read)."""
    total = 0
    for v in all_initializers(model):
        t = v.const_value
        if t is None:
            continue
        try:
            total += int(t.nbytes)
        except Exception:  # pragma: no cover - exotic tensor types
            pass
    return total


def data_path(out_path: str) -> str:
    """The external data file written next to ``out_path``."""
    return os.fspath(out_path) + ".data"


def check_output_name(out_path: str | os.PathLike) -> None:
    """Refuse an output that does not end in ``.onnx`` (``-o out.txt`` is almost always a slip,
    and the weights file beside it would be named ``out.txt.data``)."""
    check_path_arg(out_path, "the output")
    if not os.fsdecode(out_path).lower().endswith(".onnx"):
        raise PrecondError(f"output {os.fsdecode(out_path)}: the rewritten model is an ONNX file; "
                           f"give a name ending in .onnx (e.g. -o model_pc.onnx)")


def check_paths(in_path: str | os.PathLike, out_path: str | os.PathLike,
                model: ir.Model | None = None) -> None:
    """Refuse to write over the input (or any file it reads), or into a missing folder."""
    out_path = os.fspath(out_path)
    if os.path.isdir(out_path):
        raise PrecondError(f"output {out_path} is a directory: give a file name (out.onnx)")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"the output's folder does not exist: {out_dir}")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PrecondError(f"the output's folder {out_dir} is not writable: choose a folder "
                           f"you can write to")
    protected = input_files(model, in_path) if model is not None else \
        [os.path.realpath(in_path)]
    for target in (out_path, data_path(out_path)):
        real = os.path.realpath(target)
        for p in protected:
            same = real == p
            if not same and os.path.exists(target) and os.path.exists(p):
                try:
                    same = os.path.samefile(target, p)
                except OSError:
                    same = False
            if same:
                raise PrecondError(f"refusing to write {target}: it is the input model "
                                   f"({p}) or one of its data files; choose another output path")


# --------------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------------
def no_room(e: BaseException, out_path: str, weights: bool = False) -> None:
    """Raise the ``PrecondError`` of a write of ``out_path`` that found no room (disk full,
    quota, file size limit) when ``e``, or an exception it was raised from, is one (torch.save
    wraps the ``OSError`` in a RuntimeError); otherwise return, for the caller to re-raise."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _FULL:
            raise PrecondError(f"cannot write the output into "
                               f"{os.path.dirname(os.path.abspath(out_path))} "
                               f"({cur.strerror or os.strerror(cur.errno)}): free space there, "
                               f"or choose an output folder with room for the model"
                               f"{' and its weights' if weights else ''}; nothing was "
                               f"written") from None
        cur = cur.__cause__ or cur.__context__


class Staging:
    """A temporary folder next to the output; ``commit`` moves the files into place.

    Every state on disk is a consistent model: the weights go to ``<out>.data``, unless the
    model already at the output path reads that file; then to ``<out>.<8 hex digits>.data``, a
    name unique to this write, so the earlier output keeps its own weights until the new model
    replaces it.  ``commit`` moves the data file first (under its new name, so nothing the
    earlier output reads changes), then the model with ``os.replace`` (the one step that
    switches), then removes the data files the earlier output read under these names.  Files
    in ``protected`` (the input's) are never removed."""

    def __init__(self, out_path: str | os.PathLike, protected: Iterable[str] = ()) -> None:
        self.out_path = os.path.abspath(os.fspath(out_path))
        out_dir = os.path.dirname(self.out_path)
        try:
            self.dir = tempfile.mkdtemp(prefix=".precondfx-", dir=out_dir)
        except OSError as e:
            raise PrecondError(f"cannot write into the output's folder {out_dir} "
                               f"({e.strerror or type(e).__name__}): choose a folder you can "
                               f"write to") from None
        self.path = os.path.join(self.dir, os.path.basename(self.out_path))
        self.external = False
        self.protected = {os.path.realpath(p) for p in protected}
        self.data_name = os.path.basename(data_path(self.out_path))
        if _reads_data(self.out_path, data_path(self.out_path)):
            while True:
                name = f"{os.path.basename(self.out_path)}.{secrets.token_hex(4)}.data"
                if not os.path.lexists(os.path.join(out_dir, name)):
                    break
            self.data_name = name

    @property
    def data(self) -> str:
        """The staged data file (its name is the one the output's model references)."""
        return os.path.join(self.dir, self.data_name)

    @property
    def target(self) -> str:
        """Where ``commit`` puts the data file."""
        return os.path.join(os.path.dirname(self.out_path), self.data_name)

    def save(self, model: ir.Model, external: bool) -> str:
        """Write the model into the staging folder; returns the staged model path."""
        self.external = external
        target = self.target
        if external and os.path.isdir(target):
            raise PrecondError(f"the weights go to {target} beside the output, and a folder has "
                               f"that name: remove or rename it, or choose another output name")
        for p in (self.path, self.data):
            if os.path.exists(p):
                os.remove(p)
        legacy_initializer_inputs(model)
        try:
            if external:
                ir.save(model, self.path, external_data=self.data_name,
                        size_threshold_bytes=1024)
            else:
                with inline_external(model):
                    ir.save(model, self.path)
        except OSError as e:
            no_room(e, self.out_path, weights=external)
            raise
        return self.path

    def adopt(self) -> None:
        """Take the model another writer (torch.onnx.export) put at ``path``, with its weights
        in ``<path>.data`` or inline: the data file is renamed to this write's name and the
        model's references to it rewritten (no weight is read)."""
        written = data_path(self.path)
        self.external = os.path.exists(written)
        if not self.external or written == self.data:
            return
        import onnx
        from onnx.external_data_helper import _get_all_tensors
        proto = onnx.load(self.path, load_external_data=False)
        old = os.path.basename(written)
        for t in _get_all_tensors(proto):
            for e in t.external_data:
                if e.key == "location" and e.value == old:
                    e.value = self.data_name
        onnx.save(proto, self.path)
        os.replace(written, self.data)

    def commit(self) -> list[str]:
        """Move the staged files into place (data first, then the model); returns the paths.
        The data files the earlier output read (``<out>.data``, ``<out>.<hex>.data``) are
        removed after the model is replaced: left beside the new model they would look like
        its weights.  If moving the model fails, the data file moved for it is removed again
        and the earlier output is as it was."""
        written = []
        target = self.target
        stale = [f for f in _own_data_files(self.out_path)
                 if f != target and os.path.realpath(f) not in self.protected]
        moved = None
        if self.external and os.path.exists(self.data):
            os.replace(self.data, target)
            written.append(target)
            moved = target
        try:
            os.replace(self.path, self.out_path)
        except BaseException:
            if moved is not None:
                try:
                    os.remove(moved)
                except OSError:
                    pass
            raise
        written.append(self.out_path)
        for f in stale:
            try:
                os.remove(f)
            except OSError:
                pass
        return written

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


@contextlib.contextmanager
def inline_external(model: ir.Model) -> Iterator[None]:
    """Within the block, every initializer the file keeps in external data (the main graph's
    and the subgraphs') holds its values in memory: ``ir.save`` without ``external_data``
    writes an external tensor as a reference to the input's data file, relative to the
    output's folder (the weights precondfx keeps: a Reshape's shape, a norm gain, an index
    table), so the inline file would read another folder's file or none.  Restored after."""
    swapped = []
    try:
        for v in all_initializers(model):
            t = v.const_value
            if isinstance(t, ir.ExternalTensor):
                swapped.append((v, t))
                v.const_value = ir.tensor(t.numpy(), dtype=t.dtype, name=v.name)
        yield
    finally:
        for v, t in swapped:
            v.const_value = t


def _reads_data(model_path: str, data: str) -> bool:
    """Whether the ONNX file at ``model_path`` (an earlier output) keeps weights in ``data``."""
    return os.path.abspath(data) in _own_data_files(model_path)


def data_file_names(out_path: str) -> "re.Pattern[str]":
    """The names ``Staging`` gives the data files of the output ``out_path``, beside it:
    ``<out>.data`` and ``<out>.<8 hex digits>.data`` (the hex digits drawn at write time)."""
    return re.compile(re.escape(os.path.basename(os.fspath(out_path))) + r"(\.[0-9a-f]{8})?\.data")


def _own_data_files(model_path: str) -> list[str]:
    """The external data files the ONNX file at ``model_path`` (an earlier output) reads under
    the names ``Staging`` gives (``<out>.data``, ``<out>.<8 hex digits>.data``, beside it),
    as absolute paths (a symbolic link by that name is the link, not its target); none when
    it is missing or not a readable ONNX file."""
    if not os.path.isfile(model_path) or not model_path.lower().endswith(".onnx"):
        return []       # none, or not an ONNX output (a state_dict .pt is not parsed)
    own = data_file_names(model_path)
    folder = os.path.dirname(os.path.abspath(model_path))
    try:
        model = ir.load(model_path)
    except Exception:       # not a readable ONNX file: leave the data files alone
        return []
    out = []
    for v in all_initializers(model):
        t = v.const_value
        if isinstance(t, ir.ExternalTensor) and own.fullmatch(os.fspath(t.location)):
            f = os.path.join(folder, os.fspath(t.location))
            if f not in out and os.path.isfile(f):
                out.append(f)
    return out


def legacy_initializer_inputs(model: ir.Model) -> int:
    """IR version < 4 requires every initializer to be a graph input too (onnx.checker refuses
    the file otherwise): the constants and weights precondfx adds are listed as inputs there,
    after the real ones, as the old exporters did.  Returns how many were added."""
    if model.ir_version is None or model.ir_version >= 4:
        return 0
    g = model.graph
    listed = {id(v) for v in g.inputs}
    added = 0
    for v in g.initializers.values():
        if id(v) not in listed:
            g.inputs.append(v)
            added += 1
    return added


def save(model: ir.Model, out_path: str | os.PathLike, external: bool) -> list[str]:
    """Save atomically (temporary folder in the output's directory, then ``os.replace``)."""
    with Staging(out_path) as st:
        st.save(model, external)
        return st.commit()


def save_policy(model: ir.Model, mode: str = "auto", had_external: bool | None = None) -> bool:
    """Whether to write external data: 'always', 'never', or 'auto' (the input had external
    data, or the weights exceed about 1.8 GB)."""
    if mode == "always":
        return True
    if mode == "never":
        if weight_bytes(model) > EXTERNAL_LIMIT:
            raise PrecondError("external_data='never' but the weights exceed 1.8 GB: protobuf "
                               "cannot hold more than 2 GB in one file")
        return False
    if mode != "auto":
        raise PrecondError(f"external_data={mode!r} is not one of 'auto', 'always', 'never'")
    had = has_external_data(model) if had_external is None else had_external
    return had or weight_bytes(model) > EXTERNAL_LIMIT


# --------------------------------------------------------------------------------------------
# model inputs and calibration feeds
# --------------------------------------------------------------------------------------------
@dataclass
class InputSpec:
    """One real model input: name, element type, dims (int, symbol name, or None)."""

    name: str
    dtype: ir.DataType | None
    dims: list[int | str | None] | None

    @property
    def np_dtype(self) -> np.dtype | None:
        return self.dtype.numpy() if self.dtype is not None else None

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES

    @property
    def is_int(self) -> bool:
        return self.dtype in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16,
                              ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.UINT16,
                              ir.DataType.UINT32, ir.DataType.UINT64)

    def describe(self) -> str:
        dims = "x".join("?" if d is None else str(d) for d in (self.dims or []))
        return f"{self.name}: {self.dtype.name if self.dtype else '?'}[{dims}]"


def real_inputs(model: ir.Model) -> list[InputSpec]:
    """The inputs a caller must feed (graph inputs that are not initializers)."""
    out = []
    inits = model.graph.initializers
    for v in model.graph.inputs:
        if v.name in inits:
            continue
        dims: list[int | str | None] | None = None
        if v.shape is not None:
            dims = []
            for d in v.shape:
                if isinstance(d, int):     # -1: some converters' spelling of unknown
                    dims.append(int(d) if d >= 0 else None)
                else:
                    dims.append(getattr(d, "value", None))
        out.append(InputSpec(v.name, v.dtype, dims))
    return out


@dataclass
class Feeds:
    """A resolved calibration feed and how it was obtained."""

    arrays: dict[str, np.ndarray]
    bindings: dict[str, int] = field(default_factory=dict)  # symbolic dim -> size
    random: list[str] = field(default_factory=list)         # inputs filled with random data
    ones: list[str] = field(default_factory=list)           # mask inputs filled with ones
    notes: list[str] = field(default_factory=list)


def load_calibration(inputs: list[InputSpec], calib: str | None = None,
                     calib_inputs: Mapping[str, str] | Iterable[str] | None = None
                     ) -> dict[str, np.ndarray]:
    """Arrays from ``--calib FILE`` (.npy: single-input models; .npz: keys are input names,
    or arr_0, arr_1... in input order) and ``--calib-input NAME=FILE`` (repeatable)."""
    names = [i.name for i in inputs]
    out: dict[str, np.ndarray] = {}
    if calib:
        if calib.endswith(".npz"):
            z = read_npz(calib, f"save one per model input ({names}) with np.savez")
            positional = positional_keys(list(z)) is not None
            for k, v in z.items():
                if k in names:
                    out[k] = v
                elif positional and int(k[4:]) < len(names):
                    out[names[int(k[4:])]] = v
                else:
                    raise PrecondError(f"{calib}: key {k!r} matches no model input; the "
                                       f"inputs are {names} (or use arr_0, arr_1... in "
                                       f"that order)")
        else:
            arr = read_npy(calib)
            if len(names) != 1:
                raise PrecondError(f"--calib {os.path.basename(calib)} (.npy) needs a "
                                   f"single-input model; inputs are {names}: use an .npz or "
                                   f"--calib-input NAME=FILE")
            out[names[0]] = arr
    if calib_inputs:
        items = calib_inputs.items() if isinstance(calib_inputs, Mapping) else \
            [_split_assign(s, "--calib-input") for s in calib_inputs]
        seen: set[str] = set()
        for name, path in items:
            if name in seen:
                raise PrecondError(f"--calib-input {name}=...: given twice; give each input's "
                                   f"data once")
            seen.add(name)
            if name not in names:
                raise PrecondError(f"--calib-input {name}=...: no model input named {name!r}; "
                                   f"the inputs are {names}")
            out[name] = read_npy(path)
    return out


def _is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or (hasattr(a, "detach") and hasattr(a, "cpu"))


def feeds_by_name(inputs: list[InputSpec], feeds: Any) -> dict[str, Any]:
    """``feeds`` of ``precondition_onnx`` as ``{input name: array}``: a mapping by input name, as
    the ``.npz`` does; one array (a numpy array or torch tensor) for a single-input model, as
    an ``.npy`` does; or a list/tuple of arrays in input order (``arr_0, arr_1...``)."""
    names = [i.name for i in inputs]
    if feeds is None:
        return {}
    if isinstance(feeds, Mapping):
        return dict(feeds)
    if _is_array(feeds):
        if len(names) != 1:
            raise PrecondError(f"feeds= is one array, which fits a single-input model; this "
                               f"model has inputs {names}: pass {{name: array}} or a list in "
                               f"that order")
        return {names[0]: feeds}
    if isinstance(feeds, (list, tuple)):
        if len(feeds) > len(names) or not all(_is_array(a) or isinstance(a, (list, tuple))
                                              for a in feeds):
            raise PrecondError(f"feeds= as a sequence holds one array per model input, in "
                               f"input order; got {len(feeds)} item(s) "
                               f"({', '.join(type(a).__name__ for a in feeds[:4])}) for inputs "
                               f"{names}: pass {{name: array}}")
        return dict(zip(names, feeds))
    raise PrecondError(f"feeds= must map input names to arrays ({{name: array}}), or be one "
                       f"array (single-input models) or a list of arrays in input order; got "
                       f"{type(feeds).__name__} (the inputs are {names})")


def _split_assign(s: str, flag: str) -> tuple[str, str]:
    name, sep, val = s.partition("=")
    if not sep or not name or not val:
        raise PrecondError(f"{flag} expects NAME=VALUE, got {s!r}")
    return name, val


def parse_dims(items: Iterable[str] | Mapping[str, int] | None) -> dict[str, int]:
    """``['batch=4', 'seq=128']`` -> ``{'batch': 4, 'seq': 128}``."""
    if not items:
        return {}
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = [_split_assign(s, "--dim") for s in items]
    out = {}
    for k, v in pairs:
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise PrecondError(f"--dim {k}={v}: the size must be an integer") from None
        if n < 1:
            raise PrecondError(f"--dim {k}={v}: the size must be at least 1")
        out[k] = n
    return out


def check_batch(batch: Any) -> None:
    """``batch`` (the size of a symbolic leading dim) is None or a positive integer."""
    if batch is None:
        return
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise PrecondError(f"batch={batch!r}: give a positive integer (the size of a symbolic "
                           f"leading dim for generated calibration inputs)")


def check_dims(inputs: list[InputSpec], dims: Mapping[str, int]) -> None:
    """Refuse a ``--dim`` naming a symbol that no model input has (a typo would otherwise be
    ignored and the input generated with another size)."""
    symbols = [d for spec in inputs for d in (spec.dims or ()) if isinstance(d, str) and d]
    unnamed = [f"{spec.name} dim {i}" for spec in inputs for i, d in enumerate(spec.dims or ())
               if i > 0 and not isinstance(d, int) and not d]
    unknown = [k for k in dims if k not in symbols]
    if unknown:
        have = ", ".join(dict.fromkeys(symbols)) or "none"
        if unnamed:
            have += f" (dims without a name, which only calibration data can size: " \
                    f"{', '.join(unnamed[:4])})"
        elif not symbols:
            have += " (every input dim is fixed)"
        raise PrecondError(f"--dim {unknown[0]}={dims[unknown[0]]}: the model has no input dim "
                           f"named {unknown[0]!r}; its symbolic input dims are: {have}")


def resolve_feeds(inputs: list[InputSpec], given: Mapping[str, Any] | None = None, *,
                  dims: Mapping[str, int] | None = None, batch: int | None = None,
                  seed: int = 0, allow_random: bool = True,
                  weights: Mapping[str, str] | None = None,
                  masks: Mapping[str, str] | None = None) -> Feeds:
    """Check given arrays against the model inputs and fill the missing ones with N(0, 1) data
    of the model's shape (symbolic dims from the data, then ``dims``, then ``batch`` for a
    leading dim).  ``weights`` (input name -> the layer that reads it as its weight) are
    never filled: N(0, 1) data is not a weight's scale, and the output scale would be fitted
    to it.  ``masks`` (input name -> why it is a mask) are filled with ones: nothing
    masked, as a batch of unpadded sequences has it."""
    given = dict(given or {})
    names = [i.name for i in inputs]
    for k in given:
        if k not in names:
            raise PrecondError(f"calibration data for {k!r}, which is not a model input; the "
                               f"inputs are {names}")
    bindings: dict[str, int] = {}
    arrays: dict[str, np.ndarray] = {}
    feeds = Feeds(arrays, bindings)
    for spec in inputs:
        if spec.name not in given:
            continue
        a = given[spec.name]
        if hasattr(a, "detach") and hasattr(a, "cpu"):     # a torch tensor
            a = a.detach().cpu().numpy()
        a = np.asarray(a)
        if spec.dims is not None:
            if a.ndim != len(spec.dims):
                raise PrecondError(f"input {spec.name!r}: calibration data has rank {a.ndim} "
                                   f"(shape {list(a.shape)}), the model expects rank "
                                   f"{len(spec.dims)} ({spec.describe()}): give data of "
                                   f"that rank (a batch of samples, batch dim first)")
            for i, (d, n) in enumerate(zip(spec.dims, a.shape)):
                if isinstance(d, int) and d != n:
                    raise PrecondError(
                        f"input {spec.name!r} dim {i}: calibration {n} vs model {d} (the file "
                        f"fixes {spec.describe()}): give calibration data of that shape, or "
                        f"export the model with that dim dynamic (torch.onnx.export's "
                        f"dynamic_axes=, or dynamic_shapes= with dynamo=True)")
                if isinstance(d, str) and d:
                    if d in bindings and bindings[d] != n:
                        raise PrecondError(f"symbolic dim {d!r} bound to {bindings[d]} and {n} "
                                           f"by the calibration data")
                    bindings[d] = int(n)
        if a.size == 0:
            raise PrecondError(f"input {spec.name!r}: the calibration data is empty (shape "
                               f"{list(a.shape)})")
        arrays[spec.name] = _cast(spec, a)
    for k, v in (dims or {}).items():
        if k in bindings and bindings[k] != v:
            raise PrecondError(f"--dim {k}={v} contradicts the calibration data ({k}="
                               f"{bindings[k]})")
        bindings.setdefault(k, int(v))
    rng = np.random.default_rng(seed)
    for spec in inputs:
        if spec.name in arrays:
            continue
        if not allow_random:
            raise PrecondError(f"no calibration data for input {spec.name!r}")
        if weights and spec.name in weights:
            raise PrecondError(f"input {spec.name!r} is read as the weight of "
                               f"{weights[spec.name]}: random N(0,1) data cannot stand in for a "
                               f"weight (the output scale would be fitted to that scale, not "
                               f"to the weights the caller feeds); give the values it is run "
                               f"with: --calib-input {spec.name}=FILE.npy or --calib")
        if not spec.is_float and not (masks and spec.name in masks):
            kind = spec.dtype.name if spec.dtype is not None else "unknown type"
            raise PrecondError(f"input {spec.name!r} is {kind}: random normal data cannot stand "
                               f"in for it (token ids, masks...); give its data with --calib "
                               f"or --calib-input {spec.name}=FILE.npy")
        if spec.dims is None:
            raise PrecondError(f"input {spec.name!r} has no declared shape: give its data with "
                               f"--calib or --calib-input")
        shape = []
        for i, d in enumerate(spec.dims):
            if isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str) and d and d in bindings:
                shape.append(bindings[d])
            elif i == 0:
                n = int(batch) if batch is not None else 32
                if isinstance(d, str) and d:
                    bindings[d] = n
                shape.append(n)
            elif d:
                raise PrecondError(f"input {spec.name!r} dim {i} is symbolic ({d}): give "
                                   f"--dim {d}=N, or calibration data")
            else:
                raise PrecondError(f"input {spec.name!r} dim {i} has neither a size nor a name "
                                   f"in the model, so --dim cannot set it: give calibration "
                                   f"data (--calib, or --calib-input {spec.name}=FILE.npy)")
        if masks and spec.name in masks:
            arrays[spec.name] = _cast(spec, np.ones(shape, dtype=spec.np_dtype or np.float32))
            feeds.ones.append(spec.name)
            continue
        arrays[spec.name] = _cast(spec, rng.standard_normal(shape, dtype=np.float32))
        feeds.random.append(spec.name)
    if feeds.ones:
        feeds.notes.append("calibration used ones (nothing masked) for the mask input(s) " +
                           ", ".join(f"{n} {list(arrays[n].shape)} ({masks[n]})"
                                     for n in feeds.ones) +
                           ": the output scale assumes unpadded data (pass --calib-input "
                           "NAME=FILE.npy for real masks)")
    if feeds.random:
        feeds.notes.append("calibration used random N(0,1) inputs for " +
                           ", ".join(f"{n} {list(arrays[n].shape)}" for n in feeds.random) +
                           ": the output scale assumes that input distribution (pass --calib "
                           "for real data)")
    for name, a in arrays.items():
        if np.issubdtype(a.dtype, np.floating) or a.dtype.kind == "V":
            f = a.astype(np.float32, copy=False)
            bad = int((~np.isfinite(f)).sum())
            if bad and not is_additive_mask(f):
                raise PrecondError(f"calibration input {name!r} has {bad} NaN/inf value(s): "
                                   f"clean the calibration batch first (-inf is accepted only "
                                   f"in an additive mask: -inf where masked, 0 or negative "
                                   f"finite values elsewhere)")
    return feeds


def _cast(spec: InputSpec, a: np.ndarray) -> np.ndarray:
    want = spec.np_dtype
    if want is None:
        return a
    if spec.is_float:
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)
                or a.dtype == want):
            raise PrecondError(f"input {spec.name!r}: calibration data of dtype {a.dtype} "
                               f"cannot feed a {spec.dtype.name} input")
        return np.ascontiguousarray(a.astype(want, copy=False))
    if spec.is_int:
        if not np.issubdtype(a.dtype, np.integer):
            raise PrecondError(f"input {spec.name!r} is {spec.dtype.name}: calibration data must "
                               f"be integers, got {a.dtype}")
        return np.ascontiguousarray(a.astype(want, copy=False))
    if spec.dtype == ir.DataType.BOOL:
        if a.dtype != np.bool_:
            # 0/1 numbers are a mask; anything else (random normal data, token ids) would all
            # turn True without a word
            numeric = np.issubdtype(a.dtype, np.number)
            if not numeric or not np.isin(a, (0, 1)).all():
                raise PrecondError(f"input {spec.name!r} is BOOL (a mask): calibration data must "
                                   f"be booleans or 0/1 numbers, got {a.dtype}"
                                   f"{' with other values' if numeric else ''}")
        return np.ascontiguousarray(a.astype(bool, copy=False))
    return a
