"""Elementwise, cast, where, broadcast_to and permute kernels against the NumPy oracle."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from ..ids import shape_id
from .harness import check

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


def test_unary_ops_and_scalar_constants():
    b = GraphBuilder()
    x = b.input("x", (5, 7))
    pos = b.input("pos", (5, 7))
    outs = {
        "neg": -x,
        "exp": F.exp(x),
        "log": F.log(pos),
        "sqrt": F.sqrt(pos),
        "relu": F.relu(x),
        "tanh": F.tanh(x),
        "sigmoid": F.sigmoid(x),
        "affine": x * 2.5 - 1e-6,  # constants inlined as literals
        "rsub": 1.0 - x,
        "rdiv": 3.0 / pos,
    }
    for k, v in outs.items():
        b.output(k, v)
    xs = rng.standard_normal((5, 7)).astype(np.float32) * 3
    ps = rng.uniform(0.1, 10, (5, 7)).astype(np.float32)
    res = check(b.build(), {"x": xs, "pos": ps})
    assert not any("constant" in str(r) for k in res.kernels for r in k.bindings)


def test_non_finite_constants_are_built_from_bits_at_run_time():
    # WGSL has no inf/NaN literal and rejects const-expressions giving one: the kernel calls
    # f32_bits(bits), whose argument is a run-time value (masked_fill(mask, -inf) needs it).
    b = GraphBuilder()
    x = b.input("x", (8,))
    keep = F.greater(x, 0.0)
    b.output("fill", F.where(keep, x, b.constant(-math.inf)))
    b.output("softmax", F.softmax(F.where(keep, x, b.constant(-math.inf)), -1))
    b.output("nan", x + b.constant(math.nan))
    b.output("inf", x * b.constant(math.inf))
    g = b.build()
    xs = np.array([1, -1, 2, -3, 0.5, -0.1, 4, -2], np.float32)
    res = check(g, {"x": xs})
    out = {k: res.values[v] for k, v in g.outputs}
    assert (out["fill"][xs <= 0] == -np.inf).all() and (out["softmax"][xs <= 0] == 0.0).all()
    assert np.isnan(out["nan"]).all() and (out["inf"] == np.where(xs > 0, np.inf, -np.inf)).all()
    code = "".join(k.wgsl for k in res.kernels)
    assert "f32_bits(0xff800000u)" in code and "fn f32_bits(b: u32)" in code
    assert not re.search(r"\b(inf|nan|infinity)\b", re.sub(r"//[^\n]*", "", code), re.I)


def test_tanh_sigmoid_are_stable_at_large_magnitude():
    b = GraphBuilder()
    x = b.input("x", (12,))
    b.output("t", F.tanh(x))
    b.output("s", F.sigmoid(x))
    xs = np.array([-100, -50, -44.5, -20, -1, -1e-4, 0, 1e-4, 0.5, 0.7, 50, 100], np.float32)
    res = check(b.build(), {"x": xs})
    t = res.values[b.build().output_dict["t"]]
    assert np.all(np.isfinite(t)) and t[0] == -1.0 and t[-1] == 1.0
    # small arguments keep full relative accuracy (no 1 - (1 - x) cancellation)
    np.testing.assert_allclose(t[5], np.tanh(np.float64(-1e-4)), rtol=1e-6)


@pytest.mark.parametrize(
    "sa,sb",
    [((3, 1, 5), (4, 5)), ((4, 5), ()), ((), (2, 3)), ((2, 1, 3, 1), (1, 4, 1, 6)), ((7,), (7,))],
    ids=shape_id,
)
def test_binary_broadcasting(sa, sb):
    b = GraphBuilder()
    x, y = b.input("x", sa), b.input("y", sb)
    for op in ("add", "sub", "mul", "div", "maximum", "minimum"):
        b.output(op, getattr(F, op)(x, y))
    for op in ("greater", "greater_equal", "less", "less_equal", "eq", "ne"):
        b.output(op, getattr(F, op)(x, y))
    xs = rng.integers(-3, 4, sa).astype(np.float32)  # small ints: comparisons hit equality
    ys = rng.integers(1, 4, sb).astype(np.float32)
    check(b.build(), {"x": xs, "y": ys})


def test_same_value_twice_is_bound_once():
    b = GraphBuilder()
    x = b.input("x", (10,))
    sq = x * x
    b.output("sq", sq)
    b.output("v", F.reshape(x, (2, 5)) + F.reshape(x, (2, 5)))
    res = check(b.build(), {"x": rng.standard_normal(10).astype(np.float32)})
    assert all(len(k.bindings) == 2 for k in res.kernels)


def test_integer_ops_wrap_and_truncate_like_numpy():
    b = GraphBuilder()
    i = b.input("i", (6,), DType.i32)
    j = b.input("j", (6,), DType.i32)
    w = b.input("w", (6,), DType.u32)
    b.output("div", i / j)
    b.output("neg", -i)
    b.output("wrap", i * 1000000)
    b.output("uneg", -w)
    b.output("usub", w - 7)
    iv = np.array([7, -7, 2**31 - 1, -5, 0, 9], np.int32)
    jv = np.array([2, 2, 3, 3, 5, -4], np.int32)
    check(b.build(), {"i": iv, "j": jv, "w": np.arange(6, dtype=np.uint32)})


def test_where_and_casts():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    y = b.input("y", (6,))
    cond = x > y
    b.output("where", F.where(cond, x, y))
    b.output("where_const", F.where(cond, x, 0.5))
    for dt in (DType.i32, DType.u32, DType.bool):
        c = F.cast(x, dt)
        b.output(f"to_{dt}", c)
        b.output(f"back_{dt}", F.cast(c, DType.f32))
    b.output("bool_to_i32", F.cast(cond, DType.i32))
    b.output("bool_to_u32", F.cast(cond, DType.u32))
    b.output("i32_to_u32", F.cast(F.cast(x, DType.i32), DType.u32))
    b.output("u32_to_bool", F.cast(F.cast(F.relu(x), DType.u32), DType.bool))
    xs = (rng.standard_normal((4, 6)) * 4).astype(np.float32)
    xs[0, :3] = 0.0
    check(b.build(), {"x": xs, "y": rng.standard_normal(6).astype(np.float32)})


PERMUTES = [((3, 4), (1, 0)), ((2, 3, 4), (2, 0, 1)), ((2, 3, 4, 5), (0, 2, 1, 3)),
            ((2, 3, 4, 5), (3, 1, 0, 2)), ((1, 5, 1, 3), (3, 2, 1, 0))]  # fmt: skip


@pytest.mark.parametrize(
    "shape,dims",
    PERMUTES,
    ids=[f"{shape_id(s)}-perm{''.join(map(str, d))}" for s, d in PERMUTES],
)
def test_permute(shape, dims):
    b = GraphBuilder()
    x = b.input("x", shape)
    b.output("y", F.permute(x, dims))
    check(b.build(), {"x": rng.standard_normal(shape).astype(np.float32)})


@pytest.mark.parametrize(
    "src,dst",
    [((5,), (3, 5)), ((3, 1), (3, 4)), ((1, 4, 1), (2, 3, 4, 5)), ((), (2, 2))],
    ids=shape_id,
)
def test_broadcast_to(src, dst):
    b = GraphBuilder()
    x = b.input("x", src)
    b.output("y", F.broadcast_to(x, dst))
    check(b.build(), {"x": rng.standard_normal(src).astype(np.float32)})


def test_views_share_their_operand():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    y = F.stop_gradient(F.reshape(x, (6, 4)))
    b.output("z", F.exp(y))
    res = check(b.build(), {"x": rng.standard_normal((4, 6)).astype(np.float32)})
    (k,) = res.kernels
    assert k.bindings[0].node == 0  # the view's root, not the view node
