"""quantized_linear kernels (``codegen/wgsl/matmul/quantized.py``) at SmolLM2-135M's shapes
(hidden 576, intermediate 1536) and an odd out_features, for decode (GEMV, M <= 8) and
prefill (tiled) row counts, and the input gradient through autodiff.

Bound: relative L2 error <= 1e-5 against ``x @ dequantize(W)^T`` in float64. Why that bound:
the kernels multiply exactly dequantized weights (f16 scale times a small integer) and add K
products in f32, so each output's error is a few f32 roundings of partial sums, ~sqrt(K) *
2^-24 relative for random data (~2.5e-6 at K = 1536); measured on lavapipe: <= 8e-7."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops import quant_formats as qf
from meganeura.ops.quantized import quantized_linear

from .harness import device_limits, has_subgroups, run

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(12)

RTOL = 1e-5
ROWS = [1, 3, 8, 33, 128]
SIZES = [(576, 576), (576, 1536), (1536, 576), (576, 577)]  # (in_features, out_features)


def _weights(out: int, n: int, qtype: str):
    """Packed (qweight, scales) of a random weight and its float64 dequantized value."""
    w = (rng.standard_normal((out, n)) / np.sqrt(n)).astype(np.float32)
    qweight, scales = qf.pack_blocks(qf.quantize_blocks(w, qtype), w.shape, qtype)
    return qweight, scales, qf.dequantize_packed(qweight, scales, qtype).astype(np.float64)


def _rel_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{n}x{o}" for n, o in SIZES])
@pytest.mark.parametrize("rows", ROWS, ids=[f"m{m}" for m in ROWS])
def test_forward(rows, size, qtype):
    n, out = size
    qweight, scales, w = _weights(out, n, qtype)
    b = GraphBuilder()
    x = b.input("x", (rows, n))
    q = b.input("q", qweight.shape, DType.u32)
    s = b.input("s", scales.shape, DType.u32)
    y = b.output("y", quantized_linear(x, q, s, qtype))
    xv = rng.standard_normal((rows, n)).astype(np.float32)
    r = run(b.build(), {"x": xv, "q": qweight, "s": scales})
    kernel = r.kernels[0].name
    assert kernel.endswith("gemv" if rows <= 8 else "tiled"), kernel
    assert _rel_l2(r.values[y.id], xv.astype(np.float64) @ w.T) <= RTOL


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize("size", [(64, 9), (160, 5), (1536, 70)], ids=["64x9", "160x5", "1536x70"])
def test_gemv_lane_reductions(size, subgroups, qtype):
    """Both lane reductions, for teams narrower and wider than a subgroup (1..32 lanes)."""
    if subgroups and not has_subgroups():
        pytest.skip("the adapter has no subgroups")
    limits = dataclasses.replace(device_limits(), subgroups=subgroups)
    n, out = size
    qweight, scales, w = _weights(out, n, qtype)
    for rows in (1, 5, 8):
        b = GraphBuilder()
        x = b.input("x", (rows, n))
        q = b.input("q", qweight.shape, DType.u32)
        s = b.input("s", scales.shape, DType.u32)
        y = b.output("y", quantized_linear(x, q, s, qtype))
        xv = rng.standard_normal((rows, n)).astype(np.float32)
        r = run(b.build(), {"x": xv, "q": qweight, "s": scales}, limits=limits)
        assert ("subgroupShuffleXor" in r.kernels[0].wgsl) == subgroups
        assert _rel_l2(r.values[y.id], xv.astype(np.float64) @ w.T) <= RTOL


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [3, 33], ids=["m3", "m33"])
@pytest.mark.parametrize("size", [(576, 1536), (96, 37)], ids=["576x1536", "96x37"])
def test_input_gradient_matches_torch(size, rows, qtype):
    """d sum(quantized_linear(x) * R) / dx against torch.autograd in float64 on the
    dequantized weight (x batched [2, rows, in]; out 37 exercises the partial K step)."""
    n, out = size
    qweight, scales, w = _weights(out, n, qtype)
    b = GraphBuilder()
    x = b.parameter("x", (2, rows, n))
    q = b.input("q", qweight.shape, DType.u32)
    s = b.input("s", scales.shape, DType.u32)
    y = quantized_linear(x, q, s, qtype)
    weights = b.input("r", y.shape)
    b.output("loss", F.sum(y * weights))
    graph, grads = differentiate(b.build(), "loss", ["x"])
    assert any(nd.op == "quantized_linear_backward" for nd in graph.nodes)
    xv = rng.standard_normal((2, rows, n)).astype(np.float32)
    rv = rng.standard_normal(y.shape).astype(np.float32)
    res = run(graph, {"q": qweight, "s": scales, "r": rv}, params={"x": xv})
    xt = torch.tensor(xv, dtype=torch.float64, requires_grad=True)
    (xt @ torch.from_numpy(w).T * torch.from_numpy(rv.astype(np.float64))).sum().backward()
    got = res.values[grads[graph.find("x").id]]
    assert _rel_l2(got, xt.grad.numpy()) <= RTOL


def test_wgsl_has_no_private_arrays():
    """The design rule: accumulators are named registers, never arrays indexed in loops."""
    qweight, scales, _ = _weights(64, 64, "q4_1")
    for rows in (8, 9):
        b = GraphBuilder()
        x = b.input("x", (rows, 64))
        q = b.input("q", qweight.shape, DType.u32)
        s = b.input("s", scales.shape, DType.u32)
        y = b.output("y", quantized_linear(x, q, s, "q4_1"))
        (k,) = lower(b.build(), y.id, Limits())
        assert "acc0" in k.wgsl and "var<private>" not in k.wgsl
        assert "array<" not in k.wgsl.split("fn main")[1]
