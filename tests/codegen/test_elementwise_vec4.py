"""The vec4 path of elementwise and fused maps (``codegen/wgsl/elementwise/vector.py``): which
operand layouts take it (and which fall back to scalar), and its values against float64 NumPy
for each kind of read (same layout, vec4 broadcast of the last dim, per-row splat, literal),
integer and bool dtypes, partial last blocks, and fused chains with several outputs."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.elementwise import vector
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from ..ids import flag_id, shapes_id
from .harness import check

RNG = np.random.default_rng(5)


def _binary(sa, sb, op="add", dtype=DType.f32):
    b = GraphBuilder()
    x, y = b.input("a", sa, dtype), b.input("b", sb, dtype)
    out = {"add": lambda: x + y, "mul": lambda: x * y, "gt": lambda: F.greater(x, y)}[op]()
    b.output("y", out)
    return b.build(), out


def _data(shape, dtype=DType.f32):
    if dtype is DType.f32:
        return RNG.standard_normal(shape).astype(np.float32)
    return RNG.integers(-1000, 1000, shape).astype(dtype.numpy)


VEC4_CASES = [
    ((4096,), (4096,), True),  # same layout
    ((7, 12), (12,), True),  # bias of a last dim that is a multiple of 4
    ((5, 8, 3), (1, 8, 3), True),  # coalesced inner run of 24
    ((6, 16), (6, 1), True),  # per-row scale: one scalar per vec4
    ((3, 4, 8), (3, 1, 8), True),  # broadcast over a middle dim, inner run of 8
    ((7, 10), (10,), False),  # last dim 10: vec4s would straddle rows
    ((5, 7), (5, 7), False),  # 35 elements: not a multiple of 4
]


@pytest.mark.parametrize(
    "sa,sb,vec",
    VEC4_CASES,
    ids=[f"{shapes_id(sa, sb)}-{flag_id('vec4', v)}" for sa, sb, v in VEC4_CASES],
)
def test_vec4_path_taken_exactly_when_exact(sa, sb, vec):
    g, out = _binary(sa, sb)
    (k,) = lower(g, out.id, Limits())
    assert ("vec4<" in k.wgsl) is vec, k.wgsl
    check(g, {"a": _data(sa), "b": _data(sb)}, rtol=0)


def test_transposed_read_falls_back_to_scalar():
    b = GraphBuilder()
    x = b.input("x", (8, 8))
    t = F.permute(x, (1, 0))
    y = x + t
    b.output("y", y)
    g = b.build()
    assert "vec4<" not in lower(g, t.id, Limits())[0].wgsl  # strided gather
    assert "vec4<" in lower(g, y.id, Limits())[0].wgsl  # both operands now contiguous
    check(g, {"x": _data((8, 8))}, rtol=0)


def test_one_value_read_as_vec4_and_as_splat_falls_back():
    b = GraphBuilder()
    x = b.input("x", (8,))
    y = F.reshape(x, (8, 1)) * x  # x along rows (splat) and along columns (vec4)
    b.output("y", y)
    g = b.build()
    (k,) = lower(g, y.id, Limits())
    assert "vec4<" not in k.wgsl
    check(g, {"x": _data((8,))}, rtol=0)


@pytest.mark.parametrize("n", [4, 1024, 4 * 1024 + 4, 4 * 4096 * 3 + 12])
def test_partial_last_block(n):
    # blocks of VEC_PER_THREAD * 256 vec4s: n / 4 not a multiple of it leaves a partial block
    g, _ = _binary((n,), (n,), "mul")
    a, b = _data((n,)), _data((n,))
    got = check(g, {"a": a, "b": b}, rtol=0)
    np.testing.assert_array_equal(got.values[-1], a * b)


@pytest.mark.parametrize("dtype", [DType.i32, DType.u32])
def test_integer_dtypes_wrap_as_numpy(dtype):
    g, out = _binary((9, 8), (8,), "mul", dtype)
    (k,) = lower(g, out.id, Limits())
    assert f"vec4<{dtype.wgsl}>" in k.wgsl
    check(g, {"a": _data((9, 8), dtype), "b": _data((8,), dtype)})


def test_bool_result_stored_as_vec4_u32():
    g, out = _binary((3, 16), (3, 1), "gt")
    (k,) = lower(g, out.id, Limits())
    assert "vec4<u32>" in k.wgsl
    check(g, {"a": _data((3, 16)), "b": _data((3, 1))})


def test_literal_operands_and_scalar_operands():
    b = GraphBuilder()
    x = b.input("x", (12, 4))
    s = b.input("s", ())
    y = F.where(F.greater(x, 0.25), x * s + 1.5, x - 2.0)
    b.output("y", y)
    check(b.build(), {"x": _data((12, 4)), "s": np.float32(3.0)}, rtol=1e-6)


def test_scalar_path_when_disabled(monkeypatch):
    monkeypatch.setattr(vector, "ENABLED", False)
    g, out = _binary((64,), (64,))
    (k,) = lower(g, out.id, Limits())
    assert "vec4<" not in k.wgsl
    check(g, {"a": _data((64,)), "b": _data((64,))}, rtol=0)


@pytest.mark.parametrize("per_thread", [1, 2, 8])
def test_vec_per_thread_variants(monkeypatch, per_thread):
    monkeypatch.setattr(vector, "VEC_PER_THREAD", per_thread)
    g, _ = _binary((3, 1000), (1000,))
    check(g, {"a": _data((3, 1000)), "b": _data((1000,))}, rtol=0)


# ---- fused chains (through the runtime, which runs passes.fuse) ---------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,vec",
    [pytest.param((16, 64), True, id="16x64-vec4"), pytest.param((5, 9), False, id="5x9-no_vec4")],
)
def test_fused_chain_with_two_outputs(gpu_device, shape, vec):
    from meganeura.training import compile_for

    b = GraphBuilder()
    x = b.input("x", shape)
    bias = b.input("bias", shape[-1:])
    s = b.input("rowscale", (shape[0], 1))
    h = F.relu(x + bias)
    b.output("h", h)
    b.output("y", F.tanh(h * s) - 0.5)
    prog, sess = compile_for(b.build(), device=gpu_device)
    fused = [d for d in prog.dispatches if "+" in d.name]
    assert len(fused) == 1
    xs, bs, ss = _data(shape), _data(shape[-1:]), _data((shape[0], 1))
    out = sess.run({"x": xs, "bias": bs, "rowscale": ss}, ["h", "y"])
    h64 = np.maximum(xs.astype(np.float64) + bs, 0)
    np.testing.assert_allclose(out["h"], h64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["y"], np.tanh(h64 * ss) - 0.5, rtol=1e-5, atol=1e-6)
    assert ("vec4<" in fused[0].wgsl) is vec
    sess.close()
