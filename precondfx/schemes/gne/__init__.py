"""Chen et al.'s gradient norm equality / block dynamical isometry (BDI): ``scheme="gne"`` and
its maths.

Spec: ``shared/spec/chen-arpit-spec.md`` part A ([001]).  The maths is independent of the
graph pass: a pass that knows, per weighted layer, its type, fan-in/fan-out, kernel, padding and
the activation that follows can call these functions.

Conventions (spec, "Conventions"): ``J`` is the per-sample Jacobian ``d out / d in`` with ``m``
rows (output length) and ``n`` columns; ``phi = E[tr(J J^T)]`` with the *normalized* trace, and
``varphi = phi((J J^T)^2) - phi(J J^T)^2``.

Contents, by module

* :mod:`.moments`: :class:`Moments` and the components table (A.2.6 plus its listed
  extensions); serial / parallel / residual / concat composition rules (Thms 4.1, 4.2, eq. 42);
* :mod:`.gains`: activation-aware gains and the Table 4/5 block moments (A.2.9), Fixup-style
  branch scaling (A.2.14), the effective kernel size of zero-padded convolutions (A.2.7);
* :mod:`.selu`: SELU moments and the depth-aware SELU coefficients (A.2.11, Prop. 5.7, eq. 32);
* :mod:`.weights`: weight initializers :func:`gne_init_` / :func:`gne_layer_init_`;
* :mod:`.smn`: Second Moment Normalization :class:`SecondMomentNorm` and the weight-centering
  parametrization it is paired with (A.2.10, eq. 25-26, Algorithm 1);
* the scheme: :mod:`.blocks` (the activation after each layer, its gain), :mod:`.planning` (each
  layer's init), :mod:`.replacements` (ScaledSELU, SMN, weight centring), :mod:`.diagnostics`
  (per-block isometry estimates) and :mod:`.scheme` (:class:`GNE`).
"""
from precondfx.core.fans import effective_kernel_1d, effective_kernel_size
from precondfx.schemes.gne.gains import (activation_moments, conv_effective_kernel,
                                         fixup_branch_scale, gne_gain, gne_std,
                                         linear_act_block_moments)
from precondfx.schemes.gne.moments import (COMPONENTS, Moments, avg_pool_moments, concat_phi,
                                           conv_gaussian_moments, data_norm_moments,
                                           dense_gaussian_moments, dropout_moments,
                                           identity_moments, leaky_relu_moments, max_pool_moments,
                                           orthogonal_moments, parallel_moments, pointwise_moments,
                                           relu_moments, residual_moments, scale_moments,
                                           selu_moments, serial_moments, sprelu_moments,
                                           tanh_moments)
from precondfx.schemes.gne.selu import (ScaledSELU, normal_cdf, selu_block_phi, selu_coefficients,
                                        selu_epsilon_for_depth, selu_mean, selu_phi,
                                        selu_second_moment)
from precondfx.schemes.gne.smn import CenteredWeight, SecondMomentNorm, register_weight_centering
from precondfx.schemes.gne.weights import gne_init_, gne_layer_init_
from precondfx.schemes.gne.blocks import (ACTIVATION_KINDS, activation_gain, conv_effective_k,
                                         following_activation)
from precondfx.schemes.gne.diagnostics import block_diagnostics
from precondfx.schemes.gne.scheme import GNE

__all__ = [
    "GNE",
    "ACTIVATION_KINDS",
    "following_activation",
    "activation_gain",
    "conv_effective_k",
    "block_diagnostics",
    "Moments",
    "relu_moments",
    "leaky_relu_moments",
    "sprelu_moments",
    "tanh_moments",
    "selu_moments",
    "pointwise_moments",
    "dense_gaussian_moments",
    "conv_gaussian_moments",
    "orthogonal_moments",
    "data_norm_moments",
    "identity_moments",
    "scale_moments",
    "dropout_moments",
    "max_pool_moments",
    "avg_pool_moments",
    "COMPONENTS",
    "serial_moments",
    "parallel_moments",
    "residual_moments",
    "concat_phi",
    "activation_moments",
    "gne_gain",
    "gne_std",
    "linear_act_block_moments",
    "fixup_branch_scale",
    "effective_kernel_1d",
    "effective_kernel_size",
    "conv_effective_kernel",
    "normal_cdf",
    "selu_phi",
    "selu_second_moment",
    "selu_mean",
    "selu_block_phi",
    "selu_coefficients",
    "selu_epsilon_for_depth",
    "gne_init_",
    "gne_layer_init_",
    "CenteredWeight",
    "register_weight_centering",
    "SecondMomentNorm",
    "ScaledSELU",
]
