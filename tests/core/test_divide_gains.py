"""core.plan.divide_gains: the one rule, for every front end, for a parameter the forward
multiplies by a fixed factor before its layer reads it (an equalized learning rate's
``self.weight * c``, a Gemm's ``alpha``, ONNX ``Mul(g, 3)``)."""
import pytest

from precondfx.core.plan import ParamInit, divide_gains


def _inits():
    return {"w": ParamInit("w", "geometric", 0.5, "E[W^2]"),
            "o": ParamInit("o", "orthogonal", 2.0, "orthogonal"),
            "g": ParamInit("g", "ones", None, "normalization scale starts at 1"),
            "c": ParamInit("c", "constant", 0.3, "a constant"),
            "b": ParamInit("b", "zeros", None, "biases start at zero"),
            "k": ParamInit("k", "keep", None, "kept"),
            "s": ParamInit("s", "scale", 0.25, "reinit=False"),
            "t": ParamInit("t", "match", None, "a token", match="fc")}


def test_each_rule_is_stored_so_that_the_layer_applies_the_planned_value():
    inits = _inits()
    divide_gains(inits, {n: -4.0 if n == "o" else 3.0 for n in inits} | {"absent": 2.0})
    assert inits["w"].std == pytest.approx(0.5 / 3)         # 3 * W has std 0.5
    assert inits["o"].std == pytest.approx(2.0 / 4)         # |-4| * W: the draw is symmetric
    assert (inits["g"].rule, inits["g"].std) == ("constant", pytest.approx(1 / 3))   # 3 * g = 1
    assert inits["c"].std == pytest.approx(0.1)
    for name, rule, std in (("b", "zeros", None), ("k", "keep", None), ("s", "scale", 0.25),
                            ("t", "match", None)):   # match: divided when measured
        assert (inits[name].rule, inits[name].std) == (rule, std)
        assert "gain" not in inits[name].reason
    assert inits["w"].reason.endswith("divided by the gain 3 the forward multiplies it by")


def test_a_gain_of_one_changes_nothing():
    inits = _inits()
    divide_gains(inits, {n: 1.0 for n in inits})
    assert {n: (p.rule, p.std, p.reason) for n, p in inits.items()} == \
        {n: (p.rule, p.std, p.reason) for n, p in _inits().items()}
