"""The one op table: what every operation does to the paper's scaling, for every front end.

Defazio & Bottou's Table 1 says which operations preserve the GR scaling of a preconditioned
network (Sec. 7: an inserted op preserves it when it keeps the activation-gradient second-moment
product ``E[dx^2] E[x^2]`` and the spatial size).  This module extends that table to what real
models contain and gives each operation a *kind* (its role), a *status* and a one-sentence
*reason*.  The PyTorch front ends (fx, torch.export, the eager tracer) and the ONNX front end all
look operations up here, so one set of rules serves them all.

Statuses:

* ``weighted``   – a layer with a weight that precondfx re-initializes and may scale (alpha).
* ``preserves``  – keeps the scaling (Table 1 ticks, positively homogeneous degree-1 maps...).
* ``breaks``     – changes the scaling; precondfx corrects it (max-pool replacement, residual s,
  measured alphas) or reports it.
* ``structural`` – moves or selects elements without changing second moments (reshape, index...).
* ``unknown``    – not in this table; measured balancing still applies, analytic constants may
  be off.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

WEIGHTED = "weighted"
PRESERVES = "preserves"
BREAKS = "breaks"
STRUCTURAL = "structural"
UNKNOWN = "unknown"
STATUSES = (WEIGHTED, PRESERVES, BREAKS, STRUCTURAL, UNKNOWN)


@dataclass(frozen=True)
class OpSpec:
    """One row of the op table: a kind of operation and how each front end spells it."""

    kind: str
    status: str
    reason: str
    modules: tuple[str, ...] = ()    # torch.nn class names (fx call_module, eager tracer, export)
    functions: tuple[str, ...] = ()  # dotted callables: ``F.relu``, ``torch.add``, ``operator.add``
    methods: tuple[str, ...] = ()  # Tensor method names (fx call_method, eager tracer)
    aten: tuple[str, ...] = ()   # ATen overload-packet names (torch.export graphs)
    onnx: tuple[str, ...] = ()   # ONNX op_type names
    homogeneous: bool = False    # positively homogeneous of degree 1: f(c x) = c f(x), c > 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)


def _fns(*names: str) -> tuple[str, ...]:
    """Dotted callable names (``F.relu``, ``torch.relu``, ``T.view``, ``operator.add``); the
    PyTorch back end resolves the ones its torch version has (``precondfx.pytorch.ops``)."""
    return names


def _mods(*names: str) -> tuple[str, ...]:
    """``torch.nn`` class names (resolved by ``precondfx.pytorch.ops``)."""
    return names


_HOMOG = "positively homogeneous of degree 1 (Table 1: any such function preserves scaling)"

OPS: tuple[OpSpec, ...] = (
    # ---- weighted layers -------------------------------------------------------------------
    OpSpec("conv", WEIGHTED,
           "convolution: preserves scaling when initialized geometrically and all kernel sizes "
           "match (Table 1, Remark 6); other kernel sizes are corrected with alpha (Sec. 5)",
           modules=_mods("Conv1d", "Conv2d", "Conv3d"),
           functions=_fns("F.conv1d", "F.conv2d", "F.conv3d", "torch.conv1d", "torch.conv2d",
                          "torch.conv3d"),
           aten=("conv1d", "conv2d", "conv3d", "convolution", "_convolution"),
           onnx=("Conv",)),
    OpSpec("conv_transpose", WEIGHTED,
           "transposed convolution: a linear map like conv, fans defined on the transposed "
           "weight (see precondfx.core.fans)",
           modules=_mods("ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"),
           functions=_fns("F.conv_transpose1d", "F.conv_transpose2d", "F.conv_transpose3d"),
           aten=("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
           onnx=("ConvTranspose",)),
    OpSpec("linear", WEIGHTED,
           "linear layer: preserves scaling, well-conditioned against other layers under "
           "geometric initialization (Table 1, Sec. 6)",
           modules=_mods("Linear", "Bilinear", "LazyLinear"),
           functions=_fns("F.linear", "torch.addmm"),
           aten=("linear", "addmm"),
           onnx=("Gemm",)),
    OpSpec("matmul", WEIGHTED,
           "matrix product: weighted when one operand is a parameter (a linear layer); a product "
           "of two activations (attention scores) is degree-2 homogeneous and breaks scaling",
           functions=_fns("torch.matmul", "torch.mm", "torch.bmm", "torch.einsum",
                          "operator.matmul", "T.__matmul__", "T.__rmatmul__"),
           methods=("matmul", "mm", "bmm", "__matmul__", "__rmatmul__"),
           aten=("matmul", "mm", "bmm", "einsum", "baddbmm"),
           onnx=("MatMul", "Einsum")),
    OpSpec("embedding", WEIGHTED,
           "embedding lookup: a linear map of one-hot inputs (fan-in 1, fan-out dim)",
           modules=_mods("Embedding", "EmbeddingBag"),
           functions=_fns("F.embedding", "F.embedding_bag"),
           aten=("embedding", "embedding_bag", "_embedding_bag"),
           onnx=()),
    OpSpec("recurrent", WEIGHTED,
           "recurrent cell, treated as an opaque weighted module: input weights get geometric "
           "init, recurrent weights orthogonal init (a repeated map must preserve norm over time), "
           "no alpha is inserted",
           modules=_mods("LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"),
           aten=("lstm", "gru", "rnn_tanh", "rnn_relu"),
           onnx=("LSTM", "GRU", "RNN")),
    OpSpec("attention", WEIGHTED,
           "multi-head attention module, opaque: its input and output projections are "
           "re-initialized as linear layers; softmax of products inside breaks scaling",
           modules=_mods("MultiheadAttention"),
           aten=("_native_multi_head_attention",),
           onnx=("Attention", "MultiHeadAttention")),
    # ---- activations -----------------------------------------------------------------------
    OpSpec("relu", PRESERVES, "ReLU: " + _HOMOG,
           modules=_mods("ReLU"), functions=_fns("F.relu", "F.relu_", "torch.relu", "torch.relu_"),
           methods=("relu", "relu_"), aten=("relu", "relu_"), onnx=("Relu",), homogeneous=True),
    OpSpec("leaky_relu", PRESERVES, "leaky ReLU: " + _HOMOG,
           modules=_mods("LeakyReLU"), functions=_fns("F.leaky_relu", "F.leaky_relu_"),
           aten=("leaky_relu", "leaky_relu_"), onnx=("LeakyRelu",), homogeneous=True),
    OpSpec("prelu", PRESERVES, "PReLU: " + _HOMOG + " (its slope parameter is left as is)",
           modules=_mods("PReLU"), functions=_fns("F.prelu", "torch.prelu"), aten=("prelu",
           "_prelu_kernel"), onnx=("PRelu",), homogeneous=True),
    OpSpec("clipped_relu", BREAKS,
           "clipped ReLU (ReLU6/Hardtanh): ReLU-like for small inputs, but the clip is not "
           "homogeneous",
           modules=_mods("ReLU6", "Hardtanh"), functions=_fns("F.relu6", "F.hardtanh",
           "F.hardtanh_"), aten=("hardtanh", "hardtanh_", "relu6"), onnx=("Clip",)),
    OpSpec("exp_linear", BREAKS,
           "ELU/SELU/CELU: linear for positive inputs but exponential below zero, not homogeneous",
           modules=_mods("ELU", "SELU", "CELU"), functions=_fns("F.elu", "F.selu", "F.celu",
           "torch.selu", "F.elu_"), aten=("elu", "selu", "celu", "elu_"),
           onnx=("Elu", "Selu", "Celu")),
    OpSpec("smooth_gate", BREAKS,
           "smooth gated activation (GELU/SiLU/Mish/Hardswish/Softplus): close to ReLU for large "
           "inputs but not homogeneous near zero, where pre-activations sit at initialization",
           modules=_mods("GELU", "SiLU", "Mish", "Hardswish", "Softplus", "Softsign", "Tanhshrink",
                         "Softshrink", "Hardshrink"),
           functions=_fns("F.gelu", "F.silu", "F.mish", "F.hardswish", "F.softplus",
                          "F.softsign"),
           methods=("gelu",),
           aten=("gelu", "silu", "silu_", "mish", "hardswish", "hardswish_", "softplus"),
           onnx=("Gelu", "Mish", "HardSwish", "Softplus", "Softsign")),
    OpSpec("saturating", BREAKS,
           "saturating activation (tanh/sigmoid): Table 1, breaks scaling (only the linear regime "
           "of tanh preserves it)",
           modules=_mods("Tanh", "Sigmoid", "Hardsigmoid", "LogSigmoid"),
           functions=_fns("torch.tanh", "torch.sigmoid", "F.tanh", "F.sigmoid", "F.hardsigmoid",
                          "F.logsigmoid"),
           methods=("tanh", "sigmoid"), aten=("tanh", "sigmoid", "hardsigmoid", "log_sigmoid"),
           onnx=("Tanh", "Sigmoid", "HardSigmoid")),
    OpSpec("gating", BREAKS,
           "GLU-style gating: product of two halves of its input, not homogeneous",
           modules=_mods("GLU"), functions=_fns("F.glu"), aten=("glu",)),
    OpSpec("softmax", BREAKS,
           "softmax: normalizes to a probability vector, its output scale does not follow its "
           "input's",
           modules=_mods("Softmax", "LogSoftmax", "Softmin"),
           functions=_fns("F.softmax", "F.log_softmax", "torch.softmax", "torch.log_softmax"),
           methods=("softmax", "log_softmax"), aten=("softmax", "_softmax", "log_softmax",
           "_log_softmax", "_safe_softmax"), onnx=("Softmax", "LogSoftmax")),
    OpSpec("sdpa", BREAKS,
           "scaled dot-product attention: softmax of a product of activations, breaks scaling "
           "(the value path is linear)",
           functions=_fns("F.scaled_dot_product_attention"),
           aten=("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"),
           onnx=()),
    # ---- pooling ---------------------------------------------------------------------------
    OpSpec("maxpool", BREAKS,
           "max pooling breaks scaling (Table 1): replaced by striding (Sec. 7)",
           modules=_mods("MaxPool1d", "MaxPool2d", "MaxPool3d"),
           functions=_fns("F.max_pool1d", "F.max_pool2d", "F.max_pool3d", "torch.max_pool1d",
                          "torch.max_pool2d", "torch.max_pool3d", "F.max_pool1d_with_indices",
                          "F.max_pool2d_with_indices", "F.max_pool3d_with_indices"),
           aten=("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                 "max_pool3d_with_indices", "max_pool1d_with_indices"),
           onnx=("MaxPool",)),
    OpSpec("adaptive_maxpool", BREAKS,
           "adaptive, global or fractional max pooling, or LP pooling (a p-norm over each "
           "window, max pooling as p grows): breaks scaling (Table 1, max pooling); it has no "
           "fixed stride to fold, so it is reported and left",
           modules=_mods("AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
                         "FractionalMaxPool2d", "FractionalMaxPool3d", "LPPool1d", "LPPool2d",
                         "LPPool3d"),
           functions=_fns("F.adaptive_max_pool1d", "F.adaptive_max_pool2d",
                          "F.adaptive_max_pool3d", "F.fractional_max_pool2d",
                          "F.fractional_max_pool3d", "F.lp_pool1d", "F.lp_pool2d",
                          "F.lp_pool3d"),
           aten=("adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
                 "fractional_max_pool2d", "fractional_max_pool3d"),
           onnx=("GlobalMaxPool", "LpPool", "GlobalLpPool")),
    OpSpec("avgpool", PRESERVES,
           "average pooling preserves scaling (Table 1): it lowers the forward second moment and "
           "the spatial size together",
           modules=_mods("AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
                         "AdaptiveAvgPool2d", "AdaptiveAvgPool3d"),
           functions=_fns("F.avg_pool1d", "F.avg_pool2d", "F.avg_pool3d", "F.adaptive_avg_pool1d",
                          "F.adaptive_avg_pool2d", "F.adaptive_avg_pool3d", "torch.avg_pool1d",
                          "torch.adaptive_avg_pool1d"),
           aten=("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                 "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
                 "_adaptive_avg_pool3d"),
           onnx=("AveragePool", "GlobalAveragePool"), homogeneous=True),
    OpSpec("dropout", PRESERVES, "dropout preserves scaling (Table 1); it is turned off during "
           "calibration so that the output scale is deterministic",
           modules=_mods("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                         "FeatureAlphaDropout"),
           functions=_fns("F.dropout", "F.dropout1d", "F.dropout2d", "F.dropout3d",
                          "F.alpha_dropout", "torch.dropout"),
           aten=("dropout", "native_dropout", "feature_dropout", "alpha_dropout"),
           onnx=("Dropout",), homogeneous=True),
    # ---- normalization ---------------------------------------------------------------------
    OpSpec("normalization", BREAKS,
           "normalization re-scales its input to unit variance: the scale of the layer before it "
           "no longer reaches the loss, so that layer's Hessian block depends on its own weight "
           "scale; not covered by the paper's theory (measured balancing still applies); affine "
           "parameters are reset to 1 and 0",
           modules=_mods("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm",
                         "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "RMSNorm",
                         "LocalResponseNorm", "SyncBatchNorm", "LazyBatchNorm2d"),
           functions=_fns("F.batch_norm", "F.layer_norm", "F.group_norm", "F.instance_norm",
                          "F.rms_norm", "F.local_response_norm", "torch.batch_norm",
                          "torch.layer_norm", "torch.group_norm", "torch.rms_norm",
                          "F.normalize"),
           aten=("batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                 "_native_batch_norm_legit_no_training", "native_batch_norm", "layer_norm",
                 "native_layer_norm", "group_norm", "native_group_norm", "instance_norm",
                 "rms_norm", "_fused_rms_norm", "cudnn_batch_norm"),
           onnx=("BatchNormalization", "LayerNormalization", "GroupNormalization",
                 "InstanceNormalization", "RMSNormalization", "LpNormalization",
                 "SimplifiedLayerNormalization", "SkipLayerNormalization", "LRN")),
    # ---- arithmetic --------------------------------------------------------------------------
    OpSpec("add", BREAKS,
           "sum of two activations: a skip connection breaks scaling (Table 1), corrected with "
           "the residual branch scale s (App. E); an added parameter or constant is a bias",
           functions=_fns("operator.add", "operator.iadd", "torch.add", "T.__add__", "T.__radd__",
                          "T.__iadd__", "T.add", "T.add_"),
           methods=("add", "add_", "__add__", "__radd__", "__iadd__"),
           aten=("add", "add_"), onnx=("Add", "Sum")),
    OpSpec("sub", BREAKS,
           "difference of two activations: like a skip connection it breaks scaling; with a "
           "constant it is a bias",
           functions=_fns("operator.sub", "operator.isub", "torch.sub", "T.__sub__",
                          "T.__rsub__", "T.sub", "T.sub_", "torch.rsub"),
           methods=("sub", "sub_", "__sub__", "__rsub__"),
           aten=("sub", "sub_", "rsub"), onnx=("Sub",)),
    OpSpec("mul", BREAKS,
           "product (also addcmul, a + v*b*c): by a constant it is a scaling layer and preserves "
           "scaling (Sec. 7); a product of two activations (gating) or by a learned parameter "
           "breaks it",
           functions=_fns("operator.mul", "operator.imul", "torch.mul", "T.__mul__",
                          "T.__rmul__", "T.mul", "T.mul_", "operator.truediv",
                          "operator.itruediv", "torch.div", "T.__truediv__", "T.div",
                          "T.div_", "torch.true_divide", "T.true_divide", "T.true_divide_",
                          "torch.divide", "T.divide", "T.divide_", "torch.multiply",
                          "T.multiply", "T.multiply_", "torch.addcmul", "T.addcmul"),
           methods=("mul", "mul_", "__mul__", "__rmul__", "div", "div_", "__truediv__",
                    "true_divide", "true_divide_", "divide", "divide_", "multiply",
                    "multiply_", "addcmul", "addcmul_"),
           aten=("mul", "mul_", "div", "div_", "true_divide", "true_divide_", "divide",
                 "divide_", "multiply", "multiply_", "addcmul", "addcmul_"),
           onnx=("Mul", "Div")),
    OpSpec("neg", PRESERVES, "negation/absolute value: " + _HOMOG,
           functions=_fns("operator.neg", "torch.neg", "T.__neg__", "torch.abs", "T.abs",
                          "T.__abs__"),
           methods=("neg", "__neg__", "abs"), aten=("neg", "abs"), onnx=("Neg", "Abs"),
           homogeneous=True),
    OpSpec("elementwise", BREAKS,
           "non-linear elementwise function (power, exp, log, sqrt, clamp, ...): breaks scaling",
           functions=_fns("torch.pow", "operator.pow", "T.__pow__", "T.pow", "torch.exp",
                          "torch.log", "torch.sqrt", "torch.rsqrt", "torch.clamp", "torch.clip",
                          "T.clamp", "torch.sin", "torch.cos", "torch.erf", "torch.square",
                          "torch.reciprocal", "torch.where", "torch.maximum", "torch.minimum"),
           methods=("pow", "exp", "log", "sqrt", "rsqrt", "clamp", "clip", "square", "sin", "cos",
                    "__pow__", "reciprocal"),
           aten=("pow", "exp", "log", "sqrt", "rsqrt", "clamp", "clamp_min", "clamp_max",
                 "clip", "sin", "cos", "erf", "square", "reciprocal", "where", "maximum",
                 "minimum"),
           onnx=("Pow", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Erf", "Where",
                 "Max", "Min")),
    OpSpec("mean", PRESERVES,
           "mean over positions: like average pooling it preserves scaling",
           functions=_fns("torch.mean", "T.mean"), methods=("mean",), aten=("mean",),
           onnx=("ReduceMean",), homogeneous=True),
    OpSpec("sum", BREAKS,
           "sum over elements: multiplies the forward scale by the count, breaks scaling",
           functions=_fns("torch.sum", "T.sum"), methods=("sum",), aten=("sum",),
           onnx=("ReduceSum",)),
    OpSpec("reduce_other", BREAKS,
           "other reduction (max/min/norm/var/logsumexp): breaks scaling",
           functions=_fns("torch.amax", "torch.amin", "torch.max", "torch.min", "torch.norm",
                          "torch.var", "torch.std", "torch.logsumexp", "torch.cumsum",
                          "torch.topk"),
           methods=("max", "min", "amax", "amin", "norm", "var", "std", "logsumexp", "cumsum",
                    "topk"),
           aten=("amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std",
                 "logsumexp", "cumsum", "var_mean", "topk"),
           onnx=("ReduceMax", "ReduceMin", "ReduceL2", "ReduceL1", "ReduceLogSumExp",
                 "CumSum", "ReduceSumSquare", "TopK")),
    OpSpec("distance", BREAKS,
           "distance between two sets of vectors (cdist, pairwise_distance): a norm of a "
           "difference, so a reduction over features like norm: breaks scaling",
           functions=_fns("torch.cdist", "F.pairwise_distance", "torch.pairwise_distance"),
           aten=("cdist", "_cdist_forward", "_euclidean_dist", "pairwise_distance")),
    OpSpec("loss", BREAKS,
           "a loss computed inside forward: an objective, not a layer; the output scale acts on "
           "the predictions it reads (a single-number output is not the main output)",
           modules=_mods("CrossEntropyLoss", "MSELoss", "L1Loss", "NLLLoss", "BCELoss",
                         "BCEWithLogitsLoss", "SmoothL1Loss", "HuberLoss", "KLDivLoss",
                         "CosineEmbeddingLoss", "MarginRankingLoss", "TripletMarginLoss"),
           functions=_fns("F.cross_entropy", "F.mse_loss", "F.l1_loss", "F.nll_loss",
                          "F.binary_cross_entropy", "F.binary_cross_entropy_with_logits",
                          "F.smooth_l1_loss", "F.huber_loss", "F.kl_div",
                          "F.cosine_embedding_loss", "F.margin_ranking_loss",
                          "F.triplet_margin_loss"),
           aten=("cross_entropy_loss", "mse_loss", "l1_loss", "nll_loss", "nll_loss_forward",
                 "nll_loss2d", "nll_loss2d_forward", "nll_loss_nd", "binary_cross_entropy",
                 "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "kl_div",
                 "cosine_embedding_loss", "margin_ranking_loss", "triplet_margin_loss"),
           onnx=("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")),
    OpSpec("fft", PRESERVES,
           "discrete Fourier transform (fft/rfft/irfft...): a fixed linear map, an isometry up to "
           "a constant factor set by its norm, and a product with a constant keeps the "
           "activation-gradient product (Sec. 7): " + _HOMOG,
           functions=_fns("torch.fft.fft", "torch.fft.ifft", "torch.fft.rfft", "torch.fft.irfft",
                          "torch.fft.fft2", "torch.fft.ifft2", "torch.fft.rfft2",
                          "torch.fft.irfft2", "torch.fft.fftn", "torch.fft.ifftn",
                          "torch.fft.rfftn", "torch.fft.irfftn", "torch.fft.hfft",
                          "torch.fft.ihfft"),
           aten=("fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_fft2", "fft_ifft2",
                 "fft_rfft2", "fft_irfft2", "fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn",
                 "fft_hfft", "fft_ihfft", "_fft_r2c", "_fft_c2r", "_fft_c2c"),
           onnx=("DFT",), homogeneous=True),
    OpSpec("scatter", BREAKS,
           "writes or adds the rows of one tensor at indexed positions of another (scatter, "
           "index_add, index_put: a mixture of experts' combine): the result mixes both "
           "tensors' scales and sums where indices repeat, so it breaks scaling",
           functions=_fns("torch.scatter", "torch.scatter_add", "torch.scatter_reduce",
                          "torch.index_add", "torch.index_put", "torch.index_copy",
                          "torch.masked_scatter"),
           methods=("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                    "scatter_reduce_", "index_add", "index_add_", "index_put", "index_put_",
                    "index_copy", "index_copy_", "masked_scatter", "masked_scatter_"),
           aten=("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                 "scatter_reduce_", "index_add", "index_add_", "index_put", "index_put_",
                 "_index_put_impl_", "index_copy", "index_copy_", "masked_scatter",
                 "masked_scatter_"),
           onnx=("ScatterND", "ScatterElements", "Scatter")),
    # ---- structure -------------------------------------------------------------------------
    OpSpec("concat", STRUCTURAL,
           "concatenation: each part keeps its own scale; parts at different scales feed the next "
           "layer unevenly, which measured balancing corrects",
           functions=_fns("torch.cat", "torch.concat", "torch.concatenate", "torch.stack",
                          "torch.hstack", "torch.vstack"),
           aten=("cat", "concat", "stack"), onnx=("Concat",)),
    OpSpec("reshape", STRUCTURAL,
           "rearranges elements without changing their second moments (a flatten of spatial "
           "positions into features changes the next layer's fan-in, which its init accounts for)",
           modules=_mods("Flatten", "Unflatten", "Identity", "ChannelShuffle", "PixelShuffle",
                         "PixelUnshuffle"),
           functions=_fns("torch.flatten", "torch.reshape", "torch.permute", "torch.transpose",
                          "torch.squeeze", "torch.unsqueeze", "torch.movedim", "torch.t",
                          "torch.swapaxes", "torch.adjoint", "torch.unflatten",
                          "F.pixel_shuffle",
                          "F.pixel_unshuffle", "F.channel_shuffle", "torch.broadcast_to",
                          "torch.repeat_interleave", "torch.view_as_complex",
                          "torch.view_as_real"),
           methods=("view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze",
                    "contiguous", "expand", "expand_as", "repeat", "repeat_interleave",
                    "unflatten", "movedim", "t", "T", "mT", "H", "mH", "adjoint",
                    "view_as", "reshape_as", "swapaxes", "clone", "detach", "detach_",
                    "unfold"),
           aten=("view", "_unsafe_view", "reshape", "flatten", "permute", "transpose", "t",
                 "numpy_T", "mT", "matrix_H", "mH", "adjoint",
                 "squeeze", "unsqueeze", "expand", "repeat", "clone", "contiguous", "alias",
                 "unflatten", "movedim", "pixel_shuffle", "pixel_unshuffle", "detach",
                 "lift_fresh_copy", "_to_copy", "to", "unfold", "channel_shuffle",
                 "native_channel_shuffle", "expand_as", "reshape_as", "view_as",
                 "repeat_interleave", "view_as_complex", "view_as_real", "detach_"),
           onnx=("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Identity",
                 "Tile", "DepthToSpace", "SpaceToDepth")),
    OpSpec("select", STRUCTURAL,
           "selects elements (slice/index/split): second moments of what is kept are unchanged",
           functions=_fns("operator.getitem", "T.__getitem__", "torch.split", "torch.chunk",
                          "torch.narrow", "torch.index_select", "torch.gather", "torch.unbind",
                          "torch.select", "torch.roll", "torch.flip", "torch.tensor_split",
                          "torch.sort", "torch._pack_padded_sequence"),
           methods=("__getitem__", "split", "chunk", "narrow", "index_select", "gather",
                    "unbind", "select", "roll", "flip", "sort"),
           aten=("slice", "select", "index", "split", "split_with_sizes", "chunk", "narrow",
                 "index_select", "gather", "unbind", "roll", "flip", "getitem", "unsafe_split",
                 "tensor_split", "sort", "_pack_padded_sequence"),
           onnx=("Slice", "Split", "Gather", "GatherElements", "GatherND")),
    OpSpec("pad", STRUCTURAL,
           "padding adds zeros (or copies) at the border; the paper ignores padding",
           modules=_mods("ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
                         "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReplicationPad2d",
                         "CircularPad2d"),
           functions=_fns("F.pad", "torch.constant_pad_nd", "torch._pad_packed_sequence"),
           aten=("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
                 "replication_pad2d", "_pad_circular", "circular_pad2d",
                 "_pad_packed_sequence"),
           onnx=("Pad",)),
    OpSpec("resize", BREAKS,
           "upsampling (also max-unpooling, which puts each value back at its max's position "
           "and zeros elsewhere) changes the spatial size without the matching change in "
           "second moments that striding or average pooling gives, so it breaks scaling",
           modules=_mods("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d",
                         "MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d"),
           functions=_fns("F.interpolate", "F.upsample", "F.upsample_nearest",
                          "F.upsample_bilinear", "F.max_unpool1d", "F.max_unpool2d",
                          "F.max_unpool3d"),
           aten=("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                 "upsample_bilinear2d", "upsample_linear1d", "upsample_bicubic2d",
                 "upsample_trilinear3d", "_upsample_nearest_exact2d", "_upsample_bilinear2d_aa",
                 "interpolate", "max_unpool2d", "max_unpool3d"),
           onnx=("Resize", "Upsample", "MaxUnpool")),
    OpSpec("cast", STRUCTURAL, "dtype or device conversion: values are unchanged",
           functions=_fns("T.to", "T.float", "T.half", "T.double", "T.type_as", "T.bfloat16",
                          "T.type"),
           methods=("to", "float", "half", "double", "type_as", "bfloat16", "type", "cpu",
                    "cuda", "long", "int", "bool", "short", "byte", "char"),
           aten=("_to_copy", "type_as", "convert_element_type"), onnx=("Cast", "CastLike")),
    OpSpec("constant", STRUCTURAL,
           "builds a constant, reads a shape or attribute, or compares: no activation (and no "
           "gradient) flows through it",
           functions=_fns("builtins.getattr", "operator.eq", "operator.ne", "operator.lt",
                          "operator.le", "operator.gt", "operator.ge", "operator.floordiv",
                          "operator.mod", "torch._assert", "torch.arange", "torch.zeros", "torch.ones", "torch.full",
                          "torch.zeros_like", "torch.ones_like", "torch.full_like",
                          "torch.empty", "torch.tensor", "torch.triu", "torch.tril",
                          "torch.randn", "torch.rand", "torch.eye", "torch.ones_like",
                          "torch.randn_like", "torch.rand_like", "torch.empty_like",
                          "operator.invert", "operator.not_", "torch.meshgrid", "F.one_hot",
                          "torch.any", "torch.all", "torch.logical_not", "torch.isnan",
                          "torch.isinf", "torch.isfinite", "torch.sym_ite", "torch.sym_max",
                          "torch.sym_min", "torch.sym_not", "torch.sym_int", "torch.sym_float",
                          "torch.argmax", "torch.argmin", "torch.bernoulli"),
           methods=("size", "dim", "numel", "argmax", "argmin", "new_zeros", "new_ones", "new_full", "new_empty",
                    "new_tensor", "zero_", "any", "all", "logical_not", "isnan", "isinf",
                    "isfinite", "masked_fill", "masked_fill_", "fill_diagonal_", "bernoulli",
                    "bernoulli_"),
           aten=("arange", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
                 "empty", "scalar_tensor", "sym_size", "sym_numel", "lift_fresh", "triu", "tril",
                 "_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range_for_size",
                 "_local_scalar_dense", "eye", "empty_like", "empty_permuted", "item",
                 "randn", "rand", "randn_like", "rand_like", "bernoulli", "bernoulli_", "copy_",
                 "fill_",
                 "masked_fill",
                 "masked_fill_", "fill_diagonal_", "eq", "ne", "lt", "le", "gt", "ge",
                 "logical_not",
                 "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or",
                 "ge", "expand_copy", "sym_stride", "sym_storage_offset", "_assert_async",
                 "lift", "scalar_tensor", "_check_is_size", "new_zeros", "new_ones",
                 "new_full", "new_empty", "zero_", "zero", "meshgrid", "one_hot", "any", "all",
                 "isnan", "isinf", "isfinite", "logical_xor", "bitwise_xor", "argmax",
                 "argmin"),
           onnx=("Constant", "ConstantOfShape", "Shape", "Size", "Range", "Equal", "Less",
                 "Greater", "Not", "And", "Or", "Trilu", "EyeLike", "RandomNormal",
                 "RandomNormalLike", "RandomUniform", "RandomUniformLike", "ArgMax", "ArgMin",
                 "Bernoulli")),
)

# Pseudo-kinds for graph boundaries, not operations.
INPUT_SPEC = OpSpec("input", STRUCTURAL, "model input")
OUTPUT_SPEC = OpSpec("output", STRUCTURAL, "model output")
PARAM_SPEC = OpSpec("parameter", STRUCTURAL, "reads a parameter or buffer")
UNKNOWN_SPEC = OpSpec("unknown", UNKNOWN,
                      "not in the op table: its effect on scaling is not known; the output scale "
                      "and measured balancing still apply, analytic constants may be off")

BY_KIND: dict[str, OpSpec] = {s.kind: s for s in OPS + (INPUT_SPEC, OUTPUT_SPEC, PARAM_SPEC,
                                                         UNKNOWN_SPEC)}
_BY_ATEN: dict[str, OpSpec] = {a: s for s in OPS for a in s.aten}
_BY_ONNX: dict[str, OpSpec] = {o: s for s in OPS for o in s.onnx}
_BY_NN_NAME: dict[str, OpSpec] = {m: s for s in OPS for m in s.modules}

#: Modules of other libraries known by class name (torchvision, timm), so that no import of
#: those libraries is needed: stochastic-depth variants behave as dropout.
BY_CLASS_NAME: dict[str, str] = {"StochasticDepth": "dropout", "DropPath": "dropout",
                                 "DropBlock2d": "dropout", "FrozenBatchNorm2d": "normalization",
                                 "LayerNorm2d": "normalization",
                                 # torch.ao.quantization's stubs: the identity in float
                                 "QuantStub": "reshape", "DeQuantStub": "reshape"}

#: Class-name fragments of stochastic layers (timm's DropPath, torchvision's StochasticDepth,
#: DropBlock, a user's ``MyDropPath``) and the attribute that names a drop probability (a
#: user's stochastic-depth class named otherwise, ``SD(drop_prob=0.1)``): random in train
#: mode, the identity in eval mode; a parameter-free one is dropout.
STOCHASTIC_NAMES = ("Dropout", "DropPath", "StochasticDepth", "DropBlock")
STOCHASTIC_ATTRS = ("drop_prob",)


def stochastic_layer(class_name: str, attrs: Collection[str] = ()) -> bool:
    """Whether a parameter-free module of this class, with these attributes, is a stochastic
    layer that behaves as dropout (one rule for the op table, the fx tracer and calibration)."""
    return any(k in class_name for k in STOCHASTIC_NAMES) or \
        any(a in attrs for a in STOCHASTIC_ATTRS)


def for_module_class_name(qualname: str) -> OpSpec | None:
    """Spec of a ``torch.nn`` class given by its qualified name
    (``'torch.nn.modules.conv.Conv2d'``: torch.export metadata, ONNX exporter scopes)."""
    if not qualname.startswith("torch.nn."):
        return None
    return _BY_NN_NAME.get(qualname.rsplit(".", 1)[-1])


def for_aten(packet_name: str) -> OpSpec | None:
    """The spec of an ATen op given by its overload-packet name (``'conv2d'``)."""
    return _BY_ATEN.get(packet_name)


def for_onnx(op_type: str) -> OpSpec | None:
    """The spec of an ONNX op type (``'Conv'``)."""
    return _BY_ONNX.get(op_type)


def table_rows() -> list[dict]:
    """The table as plain rows (kind, status, reason, spellings) for docs and the CLI."""
    rows = []
    for s in OPS:
        rows.append({
            "kind": s.kind, "status": s.status, "reason": s.reason,
            "modules": list(s.modules),
            "aten": list(s.aten), "onnx": list(s.onnx),
        })
    return rows
