"""Edge semantics through the whole pipeline (compile + Session on the GPU where it runs).

What is pinned here, each against PyTorch float64 or an exact expectation:
  * softmax with an additive ``-inf`` mask: masked positions exactly 0 (log_softmax: -inf),
    no NaN anywhere, gradients finite and 0 at masked positions;
  * softmax of a row that is entirely ``-inf``: NaN for that row, like PyTorch (max-subtraction
    computes ``-inf - -inf``); other rows are unaffected. The guarantee that a fully masked
    row yields zeros belongs to attention, not to plain softmax;
  * logits of magnitude 30-100 in softmax, log_softmax and cross_entropy (and its gradient);
  * a sum of 2^21 values in [0, 1) within 1e-5 relative of float64 (pairwise accumulation);
  * reductions and softmax over zero elements rejected when the graph is built;
  * a value larger than the storage-binding limit, or with 2^31 elements or more (u32 index
    math), rejected by ``compile`` (no GPU touched) with a message naming the node and limit;
  * grids folded under ``max_workgroups_per_dimension = 8``, results unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.ir import Graph
from meganeura.ops import functional as F
from meganeura.runtime import Session
from meganeura.training import device_limits

from .opinfo.runner import forward_error

rng = np.random.default_rng(11)


def run(graph: Graph, feeds: dict, device, limits: Limits | None = None) -> dict:
    """Compile for ``device`` (or ``limits``), run once, fetch every output."""
    program = compile(graph, CompileOptions(), limits or device_limits(device))
    with Session(program, device) as s:
        return s.run(feeds, [name for name, _ in graph.outputs])


def t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float64)).requires_grad_(grad)


# ---- -inf masks -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,dim",
    [((5, 33), 1), ((4, 300), -1), ((70, 6), 0)],
    ids=["5x33-dim1", "4x300-dim-1", "70x6-dim0"],
)
def test_softmax_with_additive_neg_inf_mask(shape, dim, gpu_device):
    x = rng.normal(size=shape).astype(np.float32) * 4
    mask = np.where(rng.uniform(size=shape) < 0.4, -np.inf, 0.0).astype(np.float32)
    keep = np.zeros_like(mask)
    np.put_along_axis(keep, np.argmax(x, axis=dim, keepdims=True), 1.0, dim)
    mask[keep == 1.0] = 0.0  # every row keeps at least one position
    r = rng.normal(size=shape).astype(np.float32)

    b = GraphBuilder()
    xi, mi, ri = b.input("x", shape), b.input("mask", shape), b.input("r", shape)
    logits = xi + mi
    p = b.output("p", F.softmax(logits, dim))
    b.output("lp", F.log_softmax(logits, dim))
    loss = b.output("loss", F.sum(p * ri))
    g, grads = differentiate(b.build(), loss.id, [xi.id])
    gb = GraphBuilder(g)
    gb.output("dx", gb.tensor(grads[xi.id]))
    out = run(gb.build_unverified(), {"x": x, "mask": mask, "r": r}, gpu_device)

    masked = np.isneginf(mask)
    assert not np.isnan(out["p"]).any() and not np.isnan(out["lp"]).any()
    assert (out["p"][masked] == 0.0).all(), "masked positions must be exactly 0"
    assert np.isneginf(out["lp"][masked]).all(), "log_softmax of a masked position is -inf"
    tx = t64(x, True)
    tp = torch.softmax(tx + t64(mask), dim)
    (tp * t64(r)).sum().backward()
    assert forward_error(out["p"], tp.detach().numpy()) <= 1e-5
    lp_ref = torch.log_softmax(t64(x) + t64(mask), dim).numpy()
    assert forward_error(out["lp"], lp_ref) <= 1e-5
    assert np.isfinite(out["dx"]).all() and (out["dx"][masked] == 0.0).all()
    assert forward_error(out["dx"], tx.grad.numpy()) <= 1e-5


@pytest.mark.gpu
def test_softmax_of_a_fully_masked_row_is_nan_like_pytorch(gpu_device):
    """Documented behaviour: plain softmax of an all ``-inf`` row is NaN (``-inf - -inf``),
    exactly as ``torch.softmax``; the other rows are exact. Attention masks that can hide a
    whole row are the attention op's responsibility (it returns zeros there)."""
    x = rng.normal(size=(4, 70)).astype(np.float32)
    x[2] = -np.inf
    b = GraphBuilder()
    xi = b.input("x", x.shape)
    b.output("p", F.softmax(xi, 1))
    b.output("lp", F.log_softmax(xi, 1))
    out = run(b.build(), {"x": x}, gpu_device)
    ref = torch.softmax(t64(x), 1).numpy()
    assert np.isnan(ref[2]).all()  # the PyTorch behaviour we match
    for k in ("p", "lp"):
        assert np.isnan(out[k][2]).all(), f"{k}: a fully masked row is NaN"
        assert np.isfinite(out[k][[0, 1, 3]]).all()
    assert forward_error(out["p"], ref) <= 1e-5  # NaN in the same places, the rest exact


# ---- large logits -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("magnitude", [30.0, 100.0])
def test_large_logits(magnitude, gpu_device):
    n, c = 37, 101
    x = (rng.uniform(-1, 1, (n, c)) * magnitude).astype(np.float32)
    x[:, 5] = magnitude  # the largest logit sits at the top of the range
    target = rng.integers(0, c, n).astype(np.int32)
    b = GraphBuilder()
    xi, ti = b.input("x", (n, c)), b.input("t", (n,), DType.i32)
    b.output("p", F.softmax(xi, 1))
    b.output("lp", F.log_softmax(xi, 0))
    loss = b.output("ce", F.cross_entropy(xi, ti))
    g, grads = differentiate(b.build(), loss.id, [xi.id])
    gb = GraphBuilder(g)
    gb.output("dx", gb.tensor(grads[xi.id]))
    out = run(gb.build_unverified(), {"x": x, "t": target}, gpu_device)

    tx = t64(x, True)
    ce = torch.nn.functional.cross_entropy(tx, torch.from_numpy(target.astype(np.int64)))
    ce.backward()
    assert forward_error(out["p"], torch.softmax(t64(x), 1).numpy()) <= 1e-5
    assert forward_error(out["lp"], torch.log_softmax(t64(x), 0).numpy()) <= 1e-5
    assert forward_error(out["ce"], ce.detach().numpy()) <= 1e-5
    assert forward_error(out["dx"], tx.grad.numpy()) <= 1e-5


# ---- long sums --------------------------------------------------------------------------------
@pytest.mark.gpu
def test_sum_of_two_million_values_within_1e_5_of_float64(gpu_device):
    n = 2**21
    x = np.random.default_rng(0).uniform(0, 1, n).astype(np.float32)
    b = GraphBuilder()
    xi = b.input("x", (n,))
    b.output("s", F.sum(xi))
    b.output("m", F.mean(F.reshape(xi, (4, n // 4)), 1))
    out = run(b.build(), {"x": x}, gpu_device)
    ref = x.astype(np.float64)
    assert abs(float(out["s"]) - ref.sum()) / ref.sum() <= 1e-5
    assert forward_error(out["m"], ref.reshape(4, -1).mean(1)) <= 1e-5
    # A serial f32 loop would be off by ~1e-4 here; pairwise sums stay near 1e-7.
    assert abs(float(out["s"]) - ref.sum()) / ref.sum() <= 1e-6


# ---- empty reductions -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,make",
    [
        pytest.param((0,), lambda x: F.sum(x), id="sum-0-all"),
        pytest.param((3, 0), lambda x: F.mean(x, 1), id="mean-3x0-dim1"),
        pytest.param((0, 4), lambda x: F.amax(x, 0, keepdim=True), id="amax-0x4-dim0"),
        pytest.param((2, 0, 3), lambda x: F.sum(x, (0, 1)), id="sum-2x0x3-dims0_1"),
        pytest.param((3, 0), lambda x: F.softmax(x, 1), id="softmax-3x0-dim1"),
        pytest.param((0, 5), lambda x: F.log_softmax(x, 0), id="log_softmax-0x5-dim0"),
    ],
)
def test_reduction_over_zero_elements_is_rejected_at_build(shape, make):
    b = GraphBuilder()
    x = b.input("x", shape)
    with pytest.raises(GraphTypeError, match="empty|zero elements"):
        make(x)


@pytest.mark.gpu
def test_reduction_of_an_empty_tensor_over_a_non_empty_dim_is_empty(gpu_device):
    b = GraphBuilder()
    x = b.input("x", (0, 3))
    b.output("s", F.sum(x, 1))
    b.output("m", F.softmax(x, 1))
    out = run(b.build(), {"x": np.zeros((0, 3), np.float32)}, gpu_device)
    assert out["s"].shape == (0,) and out["m"].shape == (0, 3)


# ---- size limits ------------------------------------------------------------------------------
def test_value_over_the_storage_binding_limit_is_rejected_naming_it():
    # Values over the limit are bound in row blocks (passes.split_bindings); what cannot be
    # split is refused naming the value, its bytes, the limit and the op.
    limits = Limits(max_storage_buffer_binding_size=1024)
    b = GraphBuilder()
    x = b.input("x", (200,))  # 800 bytes: fits
    y = F.broadcast_to(x, (2, 200))  # 1600 bytes: does not, nor do rows at aligned offsets
    b.output("y", F.exp(y))
    with pytest.raises(
        ValueError,
        match=rf"%{y.id} \(broadcast_to: f32\[2,200\]\) of 1600 bytes.*\b1024\b.*rows cannot",
    ):
        compile(b.build(), CompileOptions(), limits)
    b = GraphBuilder()
    b.output("y", F.softmax(b.input("big", (300,)), 0))
    with pytest.raises(
        ValueError, match=r"%0 'big' \(input: f32\[300\]\) of 1200 bytes.*\b1024\b.*op softmax"
    ):
        compile(b.build(), CompileOptions(), limits)


def test_oversized_input_error_names_the_leaf():
    b = GraphBuilder()
    b.output("y", F.softmax(b.input("big", (300,)), 0))
    with pytest.raises(ValueError, match="'big'|\\bbig\\b"):
        compile(b.build(), CompileOptions(), Limits(max_storage_buffer_binding_size=1024))


_HUGE = dataclasses.replace(Limits(), max_storage_buffer_binding_size=2**40)


@pytest.mark.parametrize(
    "make,culprit",
    [
        (lambda b: F.exp(b.input("x", (2**16, 2**15))), "input"),
        (lambda b: F.broadcast_to(b.input("x", (1, 2**15)), (2**16, 2**15)) * 2.0, "broadcast_to"),
        (lambda b: F.matmul(b.input("a", (2**16, 1)), b.input("w", (1, 2**15))), "matmul"),
        (lambda b: F.sum(F.cast(b.input("m", (2**31,), DType.bool), DType.i32)), "input"),
    ],
    ids=["input", "broadcast", "matmul_output", "bool_input"],
)
def test_two_to_the_31_elements_is_rejected_before_allocation(make, culprit):
    b = GraphBuilder()
    b.output("y", make(b))
    graph = b.build()
    bad = next(n for n in graph.nodes if n.op == culprit and n.type.numel >= 2**31)
    # compile touches no GPU: raising here means nothing was allocated.
    with pytest.raises(ValueError, match=rf"%{bad.id}( '\w+')? \({culprit}: .*2\^31"):
        compile(graph, CompileOptions(), _HUGE)


# ---- grid folding -----------------------------------------------------------------------------
@pytest.mark.gpu
def test_grids_fold_under_eight_workgroups_per_dimension(gpu_device):
    limits = dataclasses.replace(device_limits(gpu_device), max_workgroups_per_dimension=8)
    feeds = {
        "v": rng.normal(size=70_000).astype(np.float32),
        "x": rng.normal(size=(100, 300)).astype(np.float32),
        "s": rng.normal(size=(5000, 7)).astype(np.float32),
        "a": rng.normal(size=(3, 130, 65)).astype(np.float32),
        "w": rng.normal(size=(65, 129)).astype(np.float32),
    }
    b = GraphBuilder()
    v, x, s = (b.input(k, feeds[k].shape) for k in ("v", "x", "s"))
    a, w = b.input("a", feeds["a"].shape), b.input("w", feeds["w"].shape)
    b.output("tanh", F.tanh(v) * 3.0)
    b.output("rows", F.sum(x, 1))
    b.output("cols", F.amax(x, 0))
    b.output("short", F.mean(s, 1))
    b.output("softmax", F.softmax(x, 1))
    b.output("softmax0", F.log_softmax(x, 0))
    b.output("mm", F.matmul(a, w))
    b.output("mmT", F.matmul(F.permute(x, (1, 0)), x))
    graph = b.build()
    program = compile(graph, CompileOptions(), limits)
    assert all(max(d.grid) <= 8 for d in program.dispatches)
    assert any(d.grid[2] > 1 for d in program.dispatches), "expected a 3-D fold"
    out = run(graph, feeds, gpu_device, limits)

    t = {k: t64(val) for k, val in feeds.items()}
    ref = {
        "tanh": torch.tanh(t["v"]) * 3.0,
        "rows": t["x"].sum(1),
        "cols": t["x"].amax(0),
        "short": t["s"].mean(1),
        "softmax": torch.softmax(t["x"], 1),
        "softmax0": torch.log_softmax(t["x"], 0),
        "mm": t["a"] @ t["w"],
        "mmT": t["x"].T @ t["x"],
    }
    for k, r in ref.items():
        assert forward_error(out[k], r.numpy()) <= 1e-5, k
