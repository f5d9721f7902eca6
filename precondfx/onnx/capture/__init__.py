"""ONNX graph -> the front-end neutral :class:`~precondfx.core.graph.Graph`.

Every ONNX node is looked up in the one op table (``optable.for_onnx``) and described with the
same operand markers the PyTorch capture methods use (``Act``, ``Param``, ``Const``), then turned
into a neutral node by ``capture.common.build_node``, so attributes are parsed as for a
functional PyTorch call: ONNX ``kernel_shape``/``strides``/``pads``/``dilations``/``group`` become
``kernel_size``/``stride``/``padding``/``dilation``/``groups``.

* ``Gemm`` with ``transB=1`` and a weight initializer is a ``linear`` layer (weight ``(out, in)``);
  ``Gemm`` with ``transB=0`` and ``MatMul`` with an initializer operand are ``matmul`` layers with
  ``weight_side`` (the side whose fans apply); an ``Add`` of an initializer right after such a
  ``MatMul`` is its bias; ``Gather`` of rows of a float initializer is an ``embedding``.
* Parameters are the float initializers (scalars and constants lifted from ``Constant`` nodes are
  constants unless they sit in a weight or bias slot); BatchNormalization's running statistics
  are buffers, not parameters.
* Values computed only from constants and shapes (``Shape`` -> ``Gather`` -> ``Concat``...) are
  constants: they do not make a join of two activations.
* Module paths are recovered from the exporters' metadata (dynamo: ``name_scopes`` and
  ``class_hierarchy``; TorchScript: ``/layer1/layer1.0/conv1/Conv`` node names; else the weight's
  name), so plans name the same parameters as on the PyTorch path.
* Shapes come from ONNX shape inference with the symbolic dims bound to the calibration sizes
  (``bindings``); a second inference with other sizes tells which spatial dims are symbolic: the
  max-pool fold is refused there (it only matches the pool's output size for some sizes).

The package, by concern: :mod:`.shapes` (shape inference, symbolic dims), :mod:`.scopes`
(module paths), :mod:`.attrs` (reading ONNX attributes), :mod:`.values` (activations,
parameters, weight views, operand markers), :mod:`.ops` (each node as a call, by op),
:mod:`.postpass` (biases after a MatMul, packed attention projections) and :mod:`.builder`
(one pass, :func:`to_graph`, :class:`Captured`).
"""
from precondfx.onnx.capture.builder import Captured, to_graph
from precondfx.onnx.capture.ops import SYMBOLIC_NO_FOLD
from precondfx.onnx.capture.shapes import call_stripped, infer_shapes, symbolic_values

__all__ = ["Captured", "to_graph", "infer_shapes", "symbolic_values", "call_stripped",
           "SYMBOLIC_NO_FOLD"]
