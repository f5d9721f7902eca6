"""Per-layer conditioning statistics of Defazio & Bottou, measured on any ``nn.Module``.

The package, by concern: :mod:`.results` (what a measurement returns: estimates, per-layer
statistics, the block matrix, the spread), :mod:`.inputs` (layer specs, the batch cut into
samples, the model state kept while measuring), :mod:`.records` (the per-layer hooks and the
per-sample records), :mod:`.hessian` (the random quadratic loss, Hessian-vector products and
the GGN expectation), :mod:`.estimates` (means, the GR formula, the block matrix with their
errors), :mod:`.api` (:func:`measure_conditioning`, :func:`hessian_block_matrix`) and
:mod:`.benchmark` (the precision table below).

What is measured
----------------
Everything is measured at **batch size 1** (the paper's setting, Sec. 3.1): each sample of the
batch gets its own forward pass, under the paper's random quadratic loss
``L = y^T R y / 2`` over the flattened main output ``y`` of that sample, with a fresh ``R`` per
sample.  ``R = (A + A^T)/2`` with ``A`` i.i.d. N(0, 1) (off-diagonal variance 1/2, diagonal 1).
Outputs larger than ``dense_max`` (4096) elements use a random rank-64 ``R = V diag(s) V^T /
sqrt(2*64)`` (``V``, ``s`` i.i.d. N(0, 1)), scaled so that ``E[(R y)_i^2] ~ ||y||^2/2`` as for
the dense ``R``; ``quadratic="diagonal"`` gives ``R = sqrt(n/2) diag(d)`` instead.  ``E[X^2]``
is the element-wise non-central second moment, averaged over samples, ``R`` and probes.

``hessian``  ``E[(G_l r)^2]``: mean square of the Hessian-vector product restricted to layer l's
    weight block, for a probe ``r`` on that block (Sec. 3, Fig. 1/2; App. A).  Per sample it equals
    ``||H_ll||_F^2 / numel``.  The same HVPs give the whole block matrix
    ``B[m, l] = E[||H_ml r_l||^2] / numel_m`` (the heat map of Fig. 1; ``B[l, l]`` is ``hessian``).
``ratio``    ``nu_l = E[dW^2] / E[W^2]`` (Sec. 4) with ``dW`` the per-sample gradient of L and
    ``E[W^2]`` the current weights' second moment.
``gr``       the GR scaling (Eq. 1) from second moments captured by hooks on the weight's module:
    ``gamma_l = alpha^4 * n_in * k2 * rho2 * E[x^2]^2 * E[dy^2] / E[y^2]`` and for the bias
    ``gamma_b = rho2_bias * E[dy^2] / E[y^2]``; ``x`` is the module input, ``y`` its output
    (including the bias) and ``dy = dL/dy``.  Geometry (``b = 1``, per sample):

    * ``nn.Linear``: ``n_in = in_features``, ``k2 = 1``, ``rho2 =`` number of positions the weight
      is applied at (``y.numel() / out_features``: 1 for a plain vector, T for a sequence).
    * ``nn.ConvNd``: ``n_in = in_channels / groups`` (per group), ``k2 = prod(kernel_size)``,
      ``rho2 = prod(output spatial dims)``.  ``n_in * k2`` is the fan-in.
    * ``nn.ConvTransposeNd``: ``n_in = in_channels / groups``, ``k2 = prod(kernel)/prod(stride)``
      (kernel taps reaching one output), ``rho2 = prod(input spatial dims)`` (times each weight is
      used), ``rho2_bias = prod(output spatial dims)``.  In all cases
      ``n_in * k2 * rho2 = (non-zeros per row of J_l) * (non-zeros per column of J_l)``, which is
      what App. A's derivation uses.
    * A module called several times pools its calls: moments over all calls, ``rho2`` summed.
    * ``alpha`` (from the layer spec, default 1) multiplies by ``alpha^4``.  Set it only when the
      hooked module's own output already includes alpha (``y = alpha * W x``); when alpha is a
      separate multiplication after the module, the hooked ``dy``/``y`` already carry ``alpha^4``.

Every statistic is an :class:`Estimate`: mean, standard error and a 95% interval.  ``hessian``
and ``ratio`` are means of per-sample values (probe noise is inside the per-sample value), so the
standard error across samples covers sample, ``R`` and probe noise; the interval is
mean +- t_{0.975, n-1} * SE.  ``gr`` is a ratio of means; its SE and interval come from a
bootstrap over samples (2000 resamples, percentile interval).

Estimators and cost (per sample; L = number of layers)
------------------------------------------------------
``method="hvp"`` (default; the true Hessian, any twice-differentiable model):
    1 forward + 1 backward with ``create_graph`` + ``L * n_probes`` double-backward HVPs
    (each ~2-3 backward passes); the graph is built once per sample and reused by all probes.
    Probes are Rademacher (default) or Gaussian; both are unbiased for ``||H_ml||_F^2``;
    Rademacher's variance is never higher (lower when ``H^2`` is diagonally dominant).  A block with ``numel <= n_probes`` uses its basis vectors
    (exact, ``numel`` HVPs).  ``ratio`` and ``gr`` come free from the first backward.
    Batched HVPs (``is_grads_batched``, vmap) were 4x slower than a loop on CPU (40x with
    2 threads on a loaded machine), so we loop.
``method="ggn"`` (Rao-Blackwellized over R; dense R only; outputs <= ``ggn_max_outputs``):
    1 forward + ``n_out`` backward passes (one per output element), no double backward.
    With ``K_l = J_l J_l^T`` (``J_l`` = Jacobian of the output w.r.t. ``W_l``) the expectation
    over the symmetrized Gaussian R is exact:
    ``E_R ||G_l||_F^2 = (||K_l||_F^2 + tr(K_l)^2)/2``,
    ``E_R ||dW_l||^2 = (||y||^2 tr K_l + y^T K_l y)/2`` (same for ``dy`` with the Jacobian w.r.t.
    the layer output), ``B[m, l] = (tr(K_m K_l) + tr K_m tr K_l)/(2 numel_m)``.  No probe and no R
    noise; only sample noise remains.  It gives the Gauss-Newton block, which *equals* the Hessian
    diagonal block when the network above layer l is piecewise linear in the layer's output
    (ReLU/LeakyReLU, linear, conv, average/max pooling, no normalization, gating or softmax
    above, no weight sharing) -- the paper's setting (App. A.1).  Off-diagonal blocks are GGN
    blocks (the Hessian's cross blocks have extra terms even for ReLU nets).

Measured precision of ``hessian`` on a small strided conv net (3 convs + linear, 10 outputs,
16x16 inputs; ``python -m precondfx.pytorch.measure.conditioning`` reruns it).  Relative SE = median
over layers of ``rel_stderr``, mean of 3 seeds; "passes" per sample are for the 4 layers;
times with ``torch.set_num_threads(1)`` on a shared CPU core (with 2 threads on an oversubscribed
machine the same runs were 3-10x slower: tiny per-sample ops do not parallelize):

| method | probe | n_probes | passes/sample | rel SE, n=8 | rel SE, n=32 | ms/sample |
|---|---|---|---|---|---|---|
| hvp | gaussian | 1 | 1 + 4 HVP | 0.220 | 0.130 | 5 |
| hvp | rademacher | 1 | 1 + 4 HVP | 0.201 | 0.118 | 5 |
| hvp | gaussian | 4 | 1 + 16 HVP | 0.151 | 0.072 | 15 |
| hvp | rademacher | 4 | 1 + 16 HVP | 0.154 | 0.080 | 14 |
| hvp | rademacher | 16 | 1 + 64 HVP | 0.100 | 0.060 | 51 |
| ggn | - | - | 10 backward | 0.076 | 0.031 | 8 |

Decomposition (same net, per sample, relative std): one probe ~0.65 (Gaussian 0.61-0.72,
Rademacher 0.61-0.69: little gain, as ``H_ll`` has rank <= 10 and is not diagonally dominant);
the draw of R ~0.28; the input x ~0.16.  So ``rel var per sample ~ 0.65^2/P + 0.28^2 + 0.16^2``:
beyond P ~ 4-6 probes, more samples buy more precision than more probes (default P = 4).
``ggn`` removes the probe and R terms (0.16 left): for a 10-output model it costs about one
probe per layer and its SE is 2-2.6x below ``hvp`` with 4 probes (4-7x fewer samples for the
same SE).
On the 100-384-64-10 MLP, ``ratio`` alone (1 forward + 1 backward per sample) reaches ~5%
relative SE per layer with 256 samples (``hvp``) and ~2% with 1024 samples (either method).

Agreement of the proxies with ``hessian`` (gr/hessian per layer, measured): geometric-init
100-384-64-10 MLP 0.83-0.96 (spread <= 1.2x; ``gr``/``ratio`` 0.92-0.98 there, Prop. 4);
default-init conv net above 2.5, 2.6, 3.3 for the convs vs 0.99 for the final linear layer
(spread 3.4x): on convolutions the GR formula is a guide, not a measurement (Sec. 5).

Model state
-----------
The user's train/eval flags are kept, except that dropout modules (``_DropoutNd`` and classes
named ``*Dropout*``) are put in eval for the measurement; every buffer (BatchNorm running
statistics included) is snapshotted and restored, ``requires_grad`` of the measured parameters is
restored, and no ``.grad`` is written.  A train-mode BatchNorm sees batch statistics of one
sample (BatchNorm1d on a 2-D input then fails: measure such models in eval mode).
"""
from precondfx.pytorch.measure.conditioning.api import hessian_block_matrix, measure_conditioning
from precondfx.pytorch.measure.conditioning.inputs import (default_output_fn, measurement_state,
                                                           per_sample, resolve_layers, run_sample,
                                                           sample_failed)
from precondfx.pytorch.measure.conditioning.results import (STATS, BlockMatrix, ConditioningResult,
                                                            Estimate, LayerConditioning, LayerRef,
                                                            spread)

__all__ = [
    "LayerRef",
    "Estimate",
    "LayerConditioning",
    "BlockMatrix",
    "ConditioningResult",
    "measure_conditioning",
    "hessian_block_matrix",
    "resolve_layers",
    "default_output_fn",
    "spread",
    "STATS",
    # shared with the other measurements (measure.sketch)
    "measurement_state",
    "per_sample",
    "run_sample",
    "sample_failed",
]
