"""TAT and DKS: tailored activation transformations (``scheme="tat"``, ``scheme="dks"``).

The maths of

* **TAT**: Zhang, Botev, Martens, *Deep Learning without Shortcuts: Shaping the Kernel with
  Tailored Rectifiers* (ICLR 2022), and
* **DKS**: Martens et al., *Rapid training of deep neural networks without skip connections or
  normalization layers using Deep Kernel Shaping* (2021),

as written down in ``shared/spec/tat-dks-spec.md`` (cited as "spec §x.y"), and the graph pass
that applies it to a captured model.  The package, by concern:

The maths (numpy and torch only; no graph code):

* :mod:`.arch`: architecture expressions (``Act``, ``Affine``, ``Identity``, ``Seq``, ``Sum``,
  ``Concat``), the U_{f,r} evaluator (spec §2.5) and the subnetwork maximiser M_{f,r} (§2.6).
* :mod:`.trelu`: leaky-ReLU / TReLU closed-form Q and C maps and the TReLU slope for a target
  C_f(0) = eta (spec §2.3, §2.7, Alg. 1).
* :mod:`.local_maps`: transformed activations ``gamma*(phi(alpha*x+beta)+delta)``, their local
  Q/C maps by Gaussian quadrature, and the local targets (spec §2.2, §2.8).
* :mod:`.transforms`: solving for the transform parameters, TAT-smooth and DKS (spec §2.8).
* :mod:`.orthogonal`: scaled-uniform-orthogonal and Delta-orthogonal initializers (spec §2.9).
* :mod:`.pln`: per-location normalization (spec §2.10).

The scheme (the graph pass of spec §3):

* :mod:`.elements` and :mod:`.analysis`: the classified graph becomes the architecture
  expression; what the method does not cover is refused with the reason.
* :mod:`.targets`: the network-level targets over one or several outputs.
* :mod:`.replacements` and :mod:`.planning`: the activation replacements, the normalized-sum
  constants at the joins and the orthogonal inits the plan gets.
* :mod:`.step`: the scheme step on the calibration batch (checks, weight draws, input
  normalization, the q self-check).
* :mod:`.scheme`: :class:`TatScheme` and :class:`DksScheme`, and :func:`architecture`.

Typical use of the maths::

    p = solve_trelu_slope(resnet, eta=0.9)        # TReLUParams(negative_slope, output_scale)
    u_map(resnet, 0.0, lambda c: leaky_relu_c_map(c, p.negative_slope))   # predicted C_f(0)
    t = solve_tat_smooth("tanh", resnet, tau=0.3)  # ActivationTransform(alpha, beta, delta, gamma)
    d = solve_dks("softplus", resnet, zeta=1.5)
"""
from precondfx.schemes.activations import (ACTIVATIONS, NumpyActivation, gaussian_expectation,
                                           gaussian_rule, get_activation)
from precondfx.schemes.tat.analysis import Analysis, Join, analyze_graph
from precondfx.schemes.tat.arch import (Act, Affine, Arch, Concat, Identity, Seq, Sum,
                                        count_activations, make_subnet_max_func, plain_net,
                                        rescaled_resnet_v2, residual_block, subnet_max,
                                        subnetworks, u_map)
from precondfx.schemes.tat.local_maps import (ActivationTransform, LocalMaps, curvature_coefficient,
                                              local_c_map, local_curvature_target, local_maps,
                                              local_q_map, local_slope_target, max_curvature,
                                              max_slope)
from precondfx.schemes.tat.orthogonal import delta_orthogonal_, orthogonal_
from precondfx.schemes.tat import pln as _pln
from precondfx.schemes.tat.pln import per_location_normalization, per_location_normalize
from precondfx.schemes.tat.scheme import DksScheme, TatScheme, architecture
from precondfx.schemes.tat.targets import predicted_c_map
from precondfx.schemes.tat.transforms import (solve_dks, solve_dks_local, solve_tat_smooth,
                                              solve_tat_smooth_local)
from precondfx.schemes.tat.trelu import (TReLUParams, leaky_relu_c_map, leaky_relu_c_map_derivative,
                                         leaky_relu_q_map, max_c_value, max_reachable_eta,
                                         ode_limit_c_map, ode_time_for_eta, relu_c_map,
                                         solve_increasing, solve_trelu_slope, trelu_global_c_map,
                                         trelu_output_scale, trelu_q_map, trelu_slope_initial_guess)

#: the input hook of models preconditioned by earlier versions, where their pickles look for it
_pln_pre_hook = _pln._pln_pre_hook

__all__ = [
    # the schemes and the graph pass
    "TatScheme", "DksScheme", "Analysis", "Join", "analyze_graph", "architecture",
    "per_location_normalize", "predicted_c_map",
    # architecture expressions
    "Act", "Affine", "Identity", "Seq", "Sum", "Concat", "Arch", "plain_net", "residual_block",
    "rescaled_resnet_v2", "u_map", "subnetworks", "subnet_max", "make_subnet_max_func",
    "count_activations",
    # leaky ReLU / TReLU
    "TReLUParams", "trelu_output_scale", "leaky_relu_c_map", "leaky_relu_c_map_derivative",
    "relu_c_map", "trelu_q_map", "leaky_relu_q_map", "trelu_global_c_map", "max_c_value",
    "max_reachable_eta", "solve_increasing", "solve_trelu_slope", "trelu_slope_initial_guess",
    "ode_time_for_eta", "ode_limit_c_map",
    # smooth activations
    "NumpyActivation", "ACTIVATIONS", "get_activation", "gaussian_rule", "gaussian_expectation",
    "ActivationTransform", "LocalMaps", "local_maps", "local_q_map", "local_c_map",
    "curvature_coefficient", "max_slope", "max_curvature", "local_curvature_target",
    "local_slope_target", "solve_tat_smooth_local", "solve_tat_smooth", "solve_dks_local",
    "solve_dks",
    # initialisation / preprocessing
    "orthogonal_", "delta_orthogonal_", "per_location_normalization",
]
