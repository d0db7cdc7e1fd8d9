"""The elementwise ops added in issue 3: their op-database entries run through the generic
runner (until ``tests/opinfo`` collects them itself), accuracy of the WGSL math helpers over
dense grids, torch's special values of ``pow``, overflow-free activations, the generated
WGSL, and the type rules and argument checks.
"""

from __future__ import annotations

import math
import re
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.ops import OPS
from meganeura.ops import elementwise as E
from meganeura.ops import functional as F

from ..opinfo.elementwise_extra import ENTRIES
from ..opinfo.runner import (
    grad_positions,
    graph_operands,
    host_args,
    torch_args,
    upstream,
)
from .harness import run

NEW_OPS = (
    "abs sign reciprocal rsqrt sin cos erf log1p expm1 pow clamp logical_and logical_or "
    "logical_xor logical_not silu silu_backward gelu gelu_backward softplus softplus_backward "
    "leaky_relu"
).split()
LIMITS = Limits(65535, 32768, 256, 2**27)


# The entries run here until tests/opinfo collects this family (then tests/test_opinfo.py does).
# ---- gradient rules, exactly: NumPy interpreter in float64 against torch.autograd ---------------
def _all_grad_cases() -> list:
    out = []
    for info in ENTRIES:
        if not info.differentiable:
            continue
        rng = np.random.default_rng(zlib.crc32(info.name.encode()))
        out += [pytest.param(info, s, id=f"{info.name}-{s.name}")
                for s in info.samples(rng) if grad_positions(s)]  # fmt: skip
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # log(negative) in unused pow branches
@pytest.mark.parametrize("info,sample", _all_grad_cases())
def test_gradient_rule_exact_in_float64(info, sample):
    """No GPU: each rule (and its backward op's reference) against torch to 1e-10."""
    args, positions = host_args(sample), grad_positions(sample)
    b = GraphBuilder()
    ops, feeds, leaf = graph_operands(b, args, mid=False)
    out = info.fn(*ops, **sample.kwargs)
    r = upstream(out.shape)
    loss = b.output("loss", F.sum(out * b.input("upstream", out.shape)))
    g, grads = differentiate(b.build_unverified(), loss.id, [leaf[p] for p in positions])
    feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    vals, _, _ = interpret(g, {**feeds, "upstream": r.astype(np.float64)}, float64=True)

    tops, tleaves = torch_args(args, positions)
    tloss = (info.ref(*tops, **sample.kwargs) * torch.from_numpy(r.astype(np.float64))).sum()
    tgrads = torch.autograd.grad(tloss, [tleaves[p] for p in positions], allow_unused=True)
    for p, tg in zip(positions, tgrads):
        want = np.zeros(args[p].shape) if tg is None else tg.numpy()
        got = vals[grads[leaf[p]]]
        scale = max(float(np.abs(want).max()), 1e-300)
        assert np.abs(got - want).max() <= 1e-10 * scale, (p, got, want)


# ---- accuracy of the WGSL math helpers over dense grids ----------------------------------------
def _gpu(fn, xs: np.ndarray, **kwargs) -> np.ndarray:
    b = GraphBuilder()
    out = b.output("out", fn(b.input("x", xs.shape), **kwargs))
    g = b.build()
    return run(g, {"x": xs}).values[out.id].astype(np.float64)


def _ulp_error(got: np.ndarray, ref: np.ndarray) -> float:
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return float((np.abs(got - ref) / ulp).max())


@pytest.mark.gpu
def test_erf_within_one_ulp():
    xs = np.concatenate(
        [np.linspace(-7, 7, 140001), np.geomspace(1e-30, 1, 2001), -np.geomspace(1e-30, 1, 2001)]
    ).astype(np.float32)
    ref = np.vectorize(math.erf)(xs.astype(np.float64))
    got = _gpu(E.erf, xs)
    # measured 0.99 ulp on lavapipe (0.86 in a float32 NumPy model of the same code)
    assert _ulp_error(got, ref) <= 1.5
    assert np.abs(got - ref).max() <= 1e-7


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_accurate_and_finite_everywhere(approximate):
    xs = np.linspace(-12, 12, 24001).astype(np.float32)
    x64 = xs.astype(np.float64)
    if approximate == "none":  # erfc form: torch's float64 1 + erf(x) cancels below -6
        ref = x64 * 0.5 * np.vectorize(math.erfc)(-x64 / math.sqrt(2))
    else:
        u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)
        ref = x64 / (1 + np.exp(-2 * u))
    got = _gpu(E.gelu, xs, approximate=approximate)
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
    small = (np.abs(ref) > 1e-30) & (xs > -9)
    assert (np.abs(got - ref)[small] / np.abs(ref[small])).max() <= 2e-5  # tails relative too

    big = np.array([-3e38, -1e20, -1e13, -50, 50, 1e13, 1e20, 3e38], np.float32)
    b = GraphBuilder()
    x = b.input("x", big.shape)
    y = b.output("y", E.gelu(x, approximate=approximate))
    loss = b.output("loss", F.sum(y))
    g, grads = differentiate(b.build(), loss.id, [x.id])
    b2 = GraphBuilder(g)
    dx = b2.output("dx", b2.tensor(grads[x.id]))
    g2 = b2.build()
    vals = run(g2, {"x": big}).values
    np.testing.assert_array_equal(vals[y.id], np.where(big > 0, big, 0))
    np.testing.assert_array_equal(vals[dx.id], (big > 0).astype(np.float32))


@pytest.mark.gpu
def test_sin_cos_with_cephes_reduction():
    xs = np.linspace(-8192, 8192, 400001).astype(np.float32)
    for fn, ref in ((E.sin, np.sin), (E.cos, np.cos)):
        err = np.abs(_gpu(fn, xs) - ref(xs.astype(np.float64))).max()
        assert err <= 2.5e-7, (fn.__name__, err)  # measured 1.2e-7 on lavapipe


@pytest.mark.gpu
def test_log1p_expm1_relative_accuracy_near_zero():
    tiny = np.concatenate([np.geomspace(1e-30, 0.6, 3001), -np.geomspace(1e-30, 0.6, 3001)])
    tiny = tiny.astype(np.float32)
    for fn, ref in ((E.log1p, np.log1p), (E.expm1, np.expm1)):
        want = ref(tiny.astype(np.float64))
        rel = np.abs(_gpu(fn, tiny) - want) / np.abs(want)
        assert rel.max() <= 1e-6, (fn.__name__, rel.max())


@pytest.mark.gpu
def test_softplus_and_silu_do_not_overflow():
    xs = np.array([-3e38, -1e4, -100, -88, -20, 0, 19.9, 20.1, 88, 100, 1e4, 3e38], np.float32)
    x64 = torch.from_numpy(xs.astype(np.float64))
    got = _gpu(E.softplus, xs)
    np.testing.assert_allclose(got, TF.softplus(x64).numpy(), rtol=1e-6, atol=1e-37)
    want = TF.silu(x64[1:-1]).numpy()
    np.testing.assert_allclose(_gpu(E.silu, xs[1:-1]), want, rtol=1e-6, atol=1e-35)


# ---- pow: torch's special values -----------------------------------------------------------------
@pytest.mark.gpu
def test_pow_special_values_match_torch():
    a = np.array([-2, -2, -2, -2, -0.0, -0.0, 0, 0, 0, -8, 1, 2, -1.5, 7, 0.5], np.float32)
    b = np.array([2, 3, -1, 0.5, 3, -1, 0, -2, 0.5, 1 / 3, 1e6, 200, 0, -3, 1e3], np.float32)
    bld = GraphBuilder()
    out = bld.output("out", E.pow(bld.input("a", a.shape), bld.input("b", b.shape)))
    g = bld.build()
    got = run(g, {"a": a, "b": b}).values[out.id]
    want = torch.pow(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    np.testing.assert_allclose(got[ok], want[ok], rtol=2e-6)


def test_pow_constant_exponents_lower_to_products():
    cases = [(2, "(v0 * v0)"), (3.0, "(v0 * v0 * v0)"), (0.5, "sqrt(v0)"), (-1, "(1.0 / v0)")]
    for e, text in cases:
        b = GraphBuilder()
        y = b.output("y", E.pow(b.input("x", (5,)), e))
        (k,) = lower(b.build(), y.id, LIMITS)
        assert text in k.wgsl and "pow_f32" not in k.wgsl
    b = GraphBuilder()
    y = b.output("y", E.pow(2.0, b.input("x", (5,))))
    (k,) = lower(b.build(), y.id, LIMITS)
    assert "exp2_f32(v1 * 1.0)" in k.wgsl


def test_no_inf_or_nan_literals_in_generated_wgsl():
    b = GraphBuilder()
    x = b.input("x", (33,))
    for k, op in enumerate(NEW_OPS):
        if op.endswith("_backward") or op.startswith("logical") or op in ("pow", "clamp"):
            continue
        b.output(f"o{k}", getattr(E, op)(x))
    b.output("pow", E.pow(x, x))
    b.output("clamp", E.clamp(x, -1e30, 1e30))
    g = b.build()
    for n in g.nodes:
        for kern in lower(g, n.id, LIMITS):
            assert not re.search(r"\b(inf|nan|infinity)\b", kern.wgsl, re.IGNORECASE), kern.name


# ---- gradients at the kinks, against torch -------------------------------------------------------
@pytest.mark.gpu
def test_clamp_and_abs_gradients_at_the_kinks():
    xs = np.array([-2.0, -1.0, -0.5, 0.0, 1.0, 1.5, 3.0], np.float32)
    b = GraphBuilder()
    x = b.input("x", xs.shape)
    loss = b.output("loss", F.sum(E.clamp(x, -1.0, 1.0) * 3.0 + E.abs(x)))
    g, grads = differentiate(b.build(), loss.id, [x.id])
    b2 = GraphBuilder(g)
    dx = b2.output("dx", b2.tensor(grads[x.id]))
    got = run(b2.build(), {"x": xs}).values[dx.id]
    t = torch.from_numpy(xs.astype(np.float64)).requires_grad_(True)
    (torch.clamp(t, -1.0, 1.0) * 3.0 + torch.abs(t)).sum().backward()
    np.testing.assert_array_equal(got, t.grad.numpy().astype(np.float32))


# ---- types, arguments, references ----------------------------------------------------------------
def test_type_rules_and_argument_checks():
    b = GraphBuilder()
    x = b.input("x", (3,))
    i = b.input("i", (3,), DType.i32)
    flag = b.input("flag", (3,), DType.bool)
    with pytest.raises(GraphTypeError, match="cast to f32"):
        E.pow(i, i)  # an integer result of a tensor exponent
    with pytest.raises(GraphTypeError, match="floating"):
        E.sin(i)
    with pytest.raises(GraphTypeError, match="dtype mismatch"):
        b.add("logical_and", [flag, x])
    assert E.logical_and(flag, x).dtype is DType.bool  # promoted, as torch
    with pytest.raises(GraphTypeError, match="bool"):
        E.abs(flag)
    with pytest.raises(ValueError, match="approximate"):
        E.gelu(x, approximate="fast")
    with pytest.raises(ValueError, match="at least one"):
        E.clamp(x)
    assert E.clamp(i, 0.5).dtype is DType.f32  # torch promotes an int tensor to a float bound
    with pytest.raises(ValueError, match="beta"):
        E.softplus(x, beta=0.0)
    with pytest.raises(TypeError):
        E.pow(2.0, 3.0)
    assert E.clamp(x, -math.inf, math.inf) is x
    assert E.clamp(i, 0, 5).node.attr_dict == {"min": 0, "max": 5}
    assert E.clamp(i, 0.0, 5).node.attr_dict == {"min": 0.0, "max": 5.0}
    assert E.sign(i).dtype is DType.i32 and E.logical_not(x).dtype is DType.bool


def test_references_keep_float64():
    """The interpreter's float64 mode (gradient checks) must not be forced back to f32."""
    b = GraphBuilder()
    x = b.input("x", (4,))
    ys = [getattr(E, op)(x) for op in ("abs", "sin", "erf", "log1p", "silu", "gelu", "softplus")]
    ys += [E.pow(x, x), E.clamp(x, 0.1, 0.4), E.leaky_relu(x), E.gelu(x, approximate="tanh")]
    for k, y in enumerate(ys):
        b.output(f"y{k}", y)
    xs = np.array([0.1, 0.2, 0.3, 0.4]) + 1e-12  # not representable in f32
    vals, _, _ = interpret(b.build(), {"x": xs}, float64=True)
    for y in ys:
        assert vals[y.id].dtype == np.float64
        assert not np.array_equal(vals[y.id], vals[y.id].astype(np.float32)), OPS[y.node.op].name
