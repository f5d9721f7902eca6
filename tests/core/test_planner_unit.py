"""The planner on hand-built graphs: ``make_plan`` without any capture.

Each graph is written out node by node as a front end would hand it over (kinds, statuses,
parameters, shapes and the facts ``keep_reason`` / ``no_fold_reason``); expected values come
from the paper's formulas written out here: geometric init ``E[W^2] = 2/(k^2 sqrt(n_in n_out))``
(Sec. 6), alpha ``= (k^2)^(-1/4)`` (Sec. 5), ``s = 1/sqrt(joins)`` and ``s/sqrt(1+s^2)`` outside
the branches (App. E).
"""
import math

import pytest

from precondfx.core.graph import Graph, Node
from precondfx.core.options import Options
from precondfx.core.plan import ParamInfo, make_plan


def N(name, kind, inputs=(), status="preserves", params=None, attrs=None, module=None,
      in_shape=None, out_shape=None):
    return Node(name, kind, kind, list(inputs), dict(params or {}), dict(attrs or {}), module,
                0, tuple(out_shape) if out_shape else None,
                [tuple(in_shape)] if in_shape else [], 0, status)


def linear(name, src, n_in, n_out, module=None):
    m = module or name
    return N(name, "linear", [src], "weighted", {"weight": f"{m}.weight", "bias": f"{m}.bias"},
             {"in_features": n_in, "out_features": n_out}, m)


def conv(name, src, c_in, c_out, k=3, stride=1, pad=1, in_shape=None, out_shape=None, **attrs):
    a = {"kernel_size": (k, k), "stride": (stride, stride), "padding": (pad, pad),
         "dilation": (1, 1), "groups": 1, **attrs}
    return N(name, "conv", [src], "weighted", {"weight": f"{name}.weight", "bias": f"{name}.bias"},
             a, name, in_shape, out_shape)


def params_of(graph, shapes):
    return {p: ParamInfo(tuple(shapes[p])) for n in graph for p in n.params.values()}


def geometric_std(n_in, n_out, k2=1.0):
    return math.sqrt(2.0 / (k2 * math.sqrt(n_in * n_out)))


def mlp():
    g = Graph([N("x", "input", status="structural"), linear("fc1", "x", 64, 32),
               N("relu", "relu", ["fc1"]), linear("fc2", "relu", 32, 10),
               N("out", "output", ["fc2"], "structural")], "hand")
    shapes = {"fc1.weight": (32, 64), "fc1.bias": (32,), "fc2.weight": (10, 32),
              "fc2.bias": (10,)}
    return g, params_of(g, shapes)


def test_mlp_geometric_inits_and_no_alphas():
    g, params = mlp()
    plan = make_plan(g, params, Options(balance="analytic"))
    assert [(lay.node, lay.n_in, lay.n_out, lay.k2) for lay in plan.layers] == \
        [("fc1", 64, 32, 1), ("fc2", 32, 10, 1)]
    assert plan.inits["fc1.weight"].std == pytest.approx(geometric_std(64, 32), rel=1e-12)
    assert plan.inits["fc2.weight"].std == pytest.approx(geometric_std(32, 10), rel=1e-12)
    assert plan.inits["fc1.bias"].rule == "zeros" and plan.inits["fc2.bias"].rule == "zeros"
    assert all(lay.alpha == 1.0 for lay in plan.layers)
    # lr='auto' (the default): an lr multiplier at 1 on each trainable layer's output, set at
    # the optimizer's first step; nothing else
    assert [(s.tag, s.node, s.where, s.value) for s in plan.scales] == \
        [("lr", "fc1", "output", 1.0), ("lr", "fc2", "output", 1.0)]
    assert make_plan(g, params, Options(balance="analytic", lr=None)).scales == []
    # measured balancing needs a site at every layer (alpha 1 until measured)
    auto = make_plan(g, params_of(g, {p: i.shape for p, i in params.items()}), Options())
    assert [(s.tag, s.node, s.where, s.value) for s in auto.scales if s.tag != "lr"] == \
        [("alpha", "fc1", "input", 1.0), ("alpha", "fc2", "input", 1.0)]


@pytest.mark.parametrize("rule,second_moment", [
    ("fan_in", lambda i, o: 2.0 / i), ("fan_out", lambda i, o: 2.0 / o),
    ("xavier", lambda i, o: 4.0 / (i + o))])
def test_other_init_rules(rule, second_moment):
    g, params = mlp()
    plan = make_plan(g, params, Options(init=rule, balance="none"))
    assert plan.inits["fc1.weight"].std ** 2 == pytest.approx(second_moment(64, 32), rel=1e-12)


def test_frozen_weight_and_no_reinit():
    g, params = mlp()
    params["fc1.weight"] = ParamInfo((32, 64), trainable=False)
    plan = make_plan(g, params, Options(balance="analytic"))
    assert plan.inits["fc1.weight"].rule == "keep"
    assert "frozen" in plan.inits["fc1.weight"].reason


def test_conv_kernel_alpha_and_effective_taps():
    # 3x3 conv, pad 1, on a 4x4 map: per dim (3*4 - 2)/4 = 2.5 taps reach the input on average
    g = Graph([N("x", "input", status="structural"),
               conv("c", "x", 8, 16, in_shape=(2, 8, 4, 4), out_shape=(2, 16, 4, 4)),
               N("r", "relu", ["c"])], "hand")
    params = params_of(g, {"c.weight": (16, 8, 3, 3), "c.bias": (16,)})
    plan = make_plan(g, params, Options(balance="analytic"))
    lay = plan.layers[0]
    alpha = 9 ** -0.25
    assert lay.k2 == 9 and lay.k2_eff == pytest.approx(6.25)
    assert lay.alpha == pytest.approx(alpha, rel=1e-12)
    assert plan.inits["c.weight"].std == pytest.approx(geometric_std(8, 16, 6.25) / alpha,
                                                       rel=1e-12)
    assert [(s.tag, s.value) for s in plan.scales if s.tag != "lr"] == \
        [("alpha", pytest.approx(alpha))]
    # a front end that knows the spatial size varies states it: nominal taps are used
    g["c"].attrs["symbolic_spatial"] = True
    plan = make_plan(g, params, Options(balance="analytic"))
    assert plan.layers[0].k2_eff is None
    assert plan.inits["c.weight"].std == pytest.approx(geometric_std(8, 16, 9) / alpha)


def test_residual_joins_and_appendix_e_alphas():
    """x -> stem -> [fc_a -> relu] + stem -> [fc_b -> relu] + ... -> head: two joins whose
    branches have no normalization, so s = 1/sqrt(2) on each branch operand."""
    nodes = [N("x", "input", status="structural"), linear("stem", "x", 16, 16)]
    prev = "stem"
    for i in range(2):
        nodes += [linear(f"b{i}", prev, 16, 16), N(f"r{i}", "relu", [f"b{i}"]),
                  N(f"add{i}", "add", [prev, f"r{i}"])]
        prev = f"add{i}"
    nodes.append(linear("head", prev, 16, 4))
    g = Graph(nodes, "hand")
    shapes = {f"{m}.{p}": ((16, 16) if p == "weight" else (16,))
              for m in ("stem", "b0", "b1") for p in ("weight", "bias")}
    shapes.update({"head.weight": (4, 16), "head.bias": (4,)})
    plan = make_plan(g, params_of(g, shapes), Options(balance="analytic"))
    s = 1 / math.sqrt(2)
    assert [(r.node, r.branch_index, r.branch_layers, r.s) for r in plan.residuals] == \
        [("add0", 1, ["b0"], pytest.approx(s)), ("add1", 1, ["b1"], pytest.approx(s))]
    res = [(sc.node, sc.where, sc.index, sc.value) for sc in plan.scales if sc.tag == "residual"]
    assert res == [("add0", "operand", 1, pytest.approx(s)), ("add1", "operand", 1,
                                                              pytest.approx(s))]
    alpha = {lay.node: lay.alpha for lay in plan.layers}
    out = s / math.sqrt(1 + s * s)
    assert alpha == {"stem": pytest.approx(out), "b0": 1.0, "b1": 1.0, "head": pytest.approx(out)}
    none = make_plan(g, params_of(g, shapes), Options(residual="none", balance="none",
                                                      lr=None))
    assert [r.s for r in none.residuals] == [None, None] and none.scales == []


def pool_graph(conv_attrs=None, pool_attrs=None):
    """conv(3x3, pad 1) -> relu -> maxpool(2, 2) on 8x8."""
    c = conv("c", "x", 3, 4, in_shape=(1, 3, 8, 8), out_shape=(1, 4, 8, 8), **(conv_attrs or {}))
    p = N("p", "maxpool", ["r"], "breaks", {}, {"kernel_size": 2, "stride": 2, "padding": 0,
                                                "dilation": 1, "ceil_mode": False,
                                                **(pool_attrs or {})},
          "p", (1, 4, 8, 8), (1, 4, 4, 4))
    g = Graph([N("x", "input", status="structural"), c, N("r", "relu", ["c"]), p], "hand")
    return g, params_of(g, {"c.weight": (4, 3, 3, 3), "c.bias": (4,)})


def test_pool_folds_into_the_conv():
    g, params = pool_graph()
    plan = make_plan(g, params, Options(balance="none"))
    (pc,) = plan.pools
    assert (pc.action, pc.into, pc.geometry["conv_stride"]) == ("fold", "c", [2, 2])


def test_front_end_facts_no_fold_and_keep():
    g, params = pool_graph(conv_attrs={"no_fold_reason": "spatial dims are symbolic"})
    (pc,) = make_plan(g, params, Options(balance="none")).pools
    assert pc.action == "conv" and "not folded: spatial dims are symbolic" in pc.reason
    assert pc.new_param == "p.weight" and "p.weight" in params     # the planned replacement
    g, params = pool_graph(pool_attrs={"keep_reason": "kept: its indices output is used"})
    (pc,) = make_plan(g, params, Options(balance="none")).pools
    assert (pc.action, pc.reason) == ("keep", "kept: its indices output is used")
    g, params = pool_graph()
    (pc,) = make_plan(g, params, Options(maxpool="avgpool", balance="none")).pools
    assert pc.action == "avgpool" and pc.geometry["kernel"] == (2, 2)
