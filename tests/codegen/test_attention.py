"""Attention family: edge semantics of scaled_dot_product_attention (-inf masks, fully masked
rows, large logits), kernel plans and text, rotary embedding precision, shape errors, and the
NumPy references' gradients against torch.autograd (the last two need no GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention.lowering import lower_forward_lse
from meganeura.codegen.wgsl.attention.plan import (
    BLOCK_PLANS,
    BlockPlan,
    Dims,
    block_layout,
    check_plan,
    choose_block_plan,
    choose_plan,
    shared_layout,
)
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.ops import functional as F
from meganeura.ops.attention import SDPA, apply_rotary_emb, scaled_dot_product_attention

from ..ids import attention_dims_id, plan_id
from ..opinfo.attention import _rope_ref, _sdpa_ref
from .harness import check, device_limits, run

rng = np.random.default_rng(11)


def _normal(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _graph(qs, ks, vs, mask_shape=None, **kw):
    """Forward and gradients of ``sum(sdpa(q, k, v, mask) * w)``; returns (graph, ids)."""
    b = GraphBuilder()
    q, k, v = b.parameter("q", qs), b.parameter("k", ks), b.parameter("v", vs)
    mask = b.input("mask", mask_shape) if mask_shape is not None else None
    out = scaled_dot_product_attention(q, k, v, mask, **kw)
    w = b.input("w", out.shape)
    b.output("out", out)
    b.output("loss", F.sum(out * w))
    graph, grads = differentiate(b.build(), "loss", ["q", "k", "v"])
    ids = {"out": out.id, **{n: grads[graph.find(n).id] for n in "qkv"}}
    return graph, ids


def _torch(params, w, mask=None, **kw):
    """Reference output and gradients (float64, fully masked rows zeroed)."""
    t = {n: torch.tensor(params[n], dtype=torch.float64, requires_grad=True) for n in "qkv"}
    m = torch.tensor(mask, dtype=torch.float64) if mask is not None else None
    out = _sdpa_ref(t["q"], t["k"], t["v"], m, **kw)
    (out * torch.tensor(w, dtype=torch.float64)).sum().backward()
    return {"out": out.detach().numpy(), **{n: t[n].grad.numpy() for n in "qkv"}}


def _run_case(qs, ks, vs, mask=None, qscale=1.0, **kw):
    """Ours vs the float64 reference; causal with a mask folds the causal rule into the
    reference's mask (torch rejects the combination)."""
    graph, ids = _graph(qs, ks, vs, None if mask is None else mask.shape, **kw)
    ref_mask, ref_kw = mask, kw
    if mask is not None and kw.get("is_causal"):
        lq, lk = qs[2], ks[2]
        future = np.arange(lk)[None, :] > np.arange(lq)[:, None]
        ref_mask = np.where(future, -np.inf, np.broadcast_to(mask, mask.shape[:-2] + (lq, lk)))
        ref_kw = dict(kw, is_causal=False)
    params = {"q": _normal(*qs, scale=qscale), "k": _normal(*ks), "v": _normal(*vs)}
    feeds = {"w": _normal(*graph[ids["out"]].type.shape)}
    if mask is not None:
        feeds["mask"] = mask.astype(np.float32)
    res = run(graph, feeds, params)
    got = {n: res.values[i] for n, i in ids.items()}
    return got, _torch(params, feeds["w"], ref_mask, **ref_kw)


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ---- edge semantics (GPU) ---------------------------------------------------------------------
@pytest.mark.gpu
def test_inf_mask_entries_get_no_weight():
    mask = np.zeros((1, 1, 5, 40))
    mask[..., ::3] = -np.inf
    mask[..., 1] = -7.5  # finite entries are added, not treated as masked
    got, want = _run_case((1, 2, 5, 8), (1, 2, 40, 8), (1, 2, 40, 8), mask)
    assert _rel(got["out"], want["out"]) < 1e-5
    # keys masked for every query receive exactly zero gradient
    assert not got["k"][:, :, ::3].any() and not got["v"][:, :, ::3].any()
    for n in "qkv":
        assert _rel(got[n], want[n]) < 1e-5, n


@pytest.mark.gpu
@pytest.mark.parametrize("lk", [3, 129])
def test_fully_masked_rows_give_zeros_forward_and_backward(lk):
    mask = rng.standard_normal((2, 3, 4, lk))
    mask[0, 1, 2, :] = -np.inf  # one row
    mask[1, :, 0, :] = -np.inf  # the first query of every head of batch 1
    mask[1, 2, 3, ::2] = -np.inf
    got, want = _run_case((2, 3, 4, 8), (2, 3, lk, 8), (2, 3, lk, 8), mask)
    for n, g in got.items():
        assert np.isfinite(g).all(), f"{n} has NaN/inf"
    assert not got["out"][0, 1, 2].any() and not got["out"][1, :, 0].any()
    assert not got["q"][0, 1, 2].any() and not got["q"][1, :, 0].any()
    for n in ("out", "q", "k", "v"):
        assert _rel(got[n], want[n]) < 1e-5, n


@pytest.mark.gpu
def test_every_row_masked_gives_all_zeros():
    mask = np.full((1, 1, 1, 7), -np.inf)
    got, _ = _run_case((1, 2, 3, 8), (1, 2, 7, 8), (1, 2, 7, 4), mask)
    assert all(not g.any() for g in got.values())


@pytest.mark.gpu
@pytest.mark.parametrize("qscale", [30.0, 100.0])
def test_large_logits_stay_accurate(qscale):
    """|logits| of 30-100 (and far beyond 88, where exp overflows without max-subtraction):
    the result is finite and within the error f32 scores carry (~|s| * 2^-24 relative)."""
    got, want = _run_case((1, 2, 9, 8), (1, 2, 33, 8), (1, 2, 33, 8), qscale=qscale,
                          is_causal=True)  # fmt: skip
    assert all(np.isfinite(g).all() for g in got.values())
    assert _rel(got["out"], want["out"]) < 2e-6 * qscale
    for n in "qkv":
        g, w = got[n].ravel(), want[n].ravel()
        assert g @ w / np.linalg.norm(g) / np.linalg.norm(w) > 1 - 1e-6, n


@pytest.mark.gpu
@pytest.mark.parametrize("storage", [1024, 4096, 16384], ids=lambda n: f"smem{n}")
def test_small_workgroup_memory_plans_agree(storage):
    """Plans with fewer lanes and shorter tiles (forced by small workgroup memory) compute
    the same values; the NumPy interpreter checks every node, backward ops included."""
    graph, _ = _graph((1, 6, 7, 12), (1, 2, 19, 12), (1, 2, 19, 10), (1, 1, 7, 19),
                      is_causal=True, enable_gqa=True)  # fmt: skip
    mask = rng.standard_normal((1, 1, 7, 19)).astype(np.float32)
    mask[0, 0, 3, 5:] = -np.inf
    lim = Limits(
        max_workgroup_storage_size=storage,
        max_storage_buffer_binding_size=device_limits().max_storage_buffer_binding_size,
    )
    params = {"q": _normal(1, 6, 7, 12), "k": _normal(1, 2, 19, 12), "v": _normal(1, 2, 19, 10)}
    check(graph, {"mask": mask, "w": _normal(1, 6, 7, 10)}, params, limits=lim)


@pytest.fixture
def force_plan():
    """Set ``BLOCK_OVERRIDE`` for every attention kernel; restored after the test."""
    saved = dict(attention_plan.BLOCK_OVERRIDE)

    def force(plan):
        attention_plan.BLOCK_OVERRIDE.update({m: plan for m in ("fwd", "stats", "dq", "dk", "dv")})

    yield force
    attention_plan.BLOCK_OVERRIDE.clear()
    attention_plan.BLOCK_OVERRIDE.update(saved)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [None, *BLOCK_PLANS], ids=plan_id)
def test_every_kernel_plan_agrees(plan, force_plan):
    """Each register-tiled plan (and the lane kernel, None) on causal GQA with a mask, odd
    lengths spanning several tiles and heads per tile, Lq != Lk, D and Dv not multiples of
    4 and Dv below the lanes' column split; float64 torch is the reference."""
    force_plan(plan)
    mask = rng.standard_normal((1, 1, 37, 41))
    mask[0, 0, 5] = -np.inf  # a fully masked row
    mask[..., 3::7] = -np.inf
    got, want = _run_case((2, 6, 37, 12), (2, 2, 41, 12), (2, 2, 41, 6), mask,
                          is_causal=True, enable_gqa=True)  # fmt: skip
    for n in ("out", "q", "k", "v"):
        assert _rel(got[n], want[n]) < 2e-6, n
    assert not got["out"][:, :, 5].any() and not got["q"][:, :, 5].any()


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [(64, 32, 16, 8), (16, 16, 4, 4)], ids=plan_id)
def test_block_plans_full_and_cross(plan, force_plan):
    """Unmasked full attention with D = Dv = 64 (the issue's head dim) and Lk < one tile."""
    force_plan(plan)
    for qs, ks in [((1, 2, 70, 64), (1, 2, 70, 64)), ((2, 3, 19, 64), (2, 3, 5, 64))]:
        got, want = _run_case(qs, ks, ks)
        for n in ("out", "q", "k", "v"):
            assert _rel(got[n], want[n]) < 2e-6, (qs, n)


@pytest.mark.gpu
def test_large_head_dims_and_single_entries():
    for qs, ks, vs in [((1, 1, 3, 130), (1, 1, 5, 130), (1, 1, 5, 66)),
                       ((1, 1, 1, 4), (1, 1, 1, 4), (1, 1, 1, 1))]:  # fmt: skip
        got, want = _run_case(qs, ks, vs)
        for n in ("out", "q", "k", "v"):
            assert np.abs(got[n] - want[n]).max() <= 1e-5 * max(np.abs(want[n]).max(), 1), (qs, n)


# ---- plans and kernel text (no GPU) -----------------------------------------------------------
@pytest.mark.parametrize("storage", [16384, 32768, 49152], ids=lambda n: f"smem{n}")
@pytest.mark.parametrize(
    "dims",
    [Dims(1, 3, 3, 128, 128, 64, 64), Dims(1, 6, 1, 1500, 1500, 64, 64),
     Dims(2, 3, 3, 1, 129, 64, 64), Dims(1, 1, 1, 3, 7, 6, 3), Dims(1, 1, 1, 2, 2, 256, 256)],
    ids=attention_dims_id,
)  # fmt: skip
def test_plans_fit_the_adapter(dims, storage):
    limits = Limits(max_workgroup_storage_size=storage)
    for mode in ("fwd", "stats", "dq", "dk", "dv"):
        plan = choose_plan(mode, dims, limits)
        assert 16 * shared_layout(mode, dims, plan)[0] <= storage
        assert check_plan(mode, dims, plan, limits) == plan  # tuned plans: up to 128 threads


@pytest.mark.parametrize("mode", ["fwd", "stats", "dq", "dk", "dv"])
def test_block_plans_fit_or_fall_back(mode):
    """The automatic choice fits the adapter; Whisper-sized problems get a block plan with
    enough workgroups, and head dims too large for any block plan fall back (None)."""
    lim = Limits(max_workgroup_storage_size=49152, max_invocations_per_workgroup=1024)
    whisper = Dims(1, 6, 1, 1500, 1500, 64, 64)
    plan = choose_block_plan(mode, whisper, lim, by_groups=True)
    assert plan is not None and 16 * block_layout(mode, whisper, plan)[0] <= 49152
    assert plan.rows == 4 * plan.row_threads and plan.tile % plan.lanes == 0
    big = Dims(1, 1, 1, 8, 8, 4096, 4096)
    assert choose_block_plan(mode, big, lim, by_groups=True) is None
    tiny = Dims(1, 1, 1, 3, 7, 6, 3)
    assert isinstance(choose_block_plan(mode, tiny, lim, by_groups=True), BlockPlan)
    # the measured default (trusted shader modules): the lane kernel everywhere
    assert choose_block_plan(mode, whisper, lim) is None
    assert choose_block_plan(mode, Dims(1, 3, 3, 128, 128, 64, 64), lim) is None


def test_kernel_text_has_no_private_arrays_or_inf_literals():
    graph, ids = _graph((1, 6, 7, 8), (1, 2, 9, 8), (1, 2, 9, 8), (7, 9), enable_gqa=True)
    kernels = [k for n in graph.nodes if "attention" in n.op for k in lower(graph, n.id, Limits())]
    fwd, lse = (next(n.id for n in graph.nodes if n.op == op) for op in (SDPA, f"{SDPA}_lse"))
    kernels += lower_forward_lse(graph, fwd, lse, Limits())
    assert len(kernels) == 7  # fwd, lse, delta, dq, dk, dv, and the forward writing its lse
    for k in kernels:
        assert "var<private>" not in k.wgsl and "array<f32," not in k.wgsl
        assert "inf" not in k.wgsl.replace("info", "") and "nan" not in k.wgsl.lower()
        if "delta" not in k.name:  # one thread per row: no workgroup memory
            assert k.wgsl.count("workgroupBarrier") >= 2


# ---- rotary embedding -------------------------------------------------------------------------
def _rope_graph(shape, theta, offset, tensor_offset=False):
    b = GraphBuilder()
    x = b.parameter("x", shape)
    off = b.input("offset", (), DType.i32) if tensor_offset else offset
    y = apply_rotary_emb(x, theta, off)
    b.output("y", y)
    attrs = {"theta": float(theta), "position_offset": y.node.attr("position_offset"),
             "inverse": True}  # fmt: skip
    back = b.output("back", b.add("apply_rotary_emb", [y, off] if tensor_offset else [y], attrs))
    return b.build(), y.id, back.id


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 8000, 100_000, 2**31 - 64])
def test_rope_precise_at_far_positions(offset):
    shape = (1, 2, 64, 64)
    graph, y, back = _rope_graph(shape, 100000.0, offset)
    x = _normal(*shape)
    res = run(graph, {}, {"x": x})
    want = _rope_ref(torch.tensor(x, dtype=torch.float64), 100000.0, offset).numpy()
    assert _rel(res.values[y], want) < 2e-6
    # the inverse rotation undoes it (the gradient rule relies on this)
    assert _rel(res.values[back], x) < 2e-6


@pytest.mark.gpu
def test_rope_tensor_offset_matches_static_offset():
    static, y1, _ = _rope_graph((2, 3, 5, 8), 10000.0, 4097)
    dynamic, y2, _ = _rope_graph((2, 3, 5, 8), 10000.0, 0, tensor_offset=True)
    x = _normal(2, 3, 5, 8)
    a = run(static, {}, {"x": x}).values[y1]
    b = run(dynamic, {"offset": np.array(4097, np.int32)}, {"x": x}).values[y2]
    np.testing.assert_array_equal(a, b)


# ---- shape errors and references (no GPU) -----------------------------------------------------
def test_shape_errors():
    b = GraphBuilder()
    q, k, v = b.input("q", (1, 6, 3, 8)), b.input("k", (1, 4, 5, 8)), b.input("v", (1, 4, 5, 8))
    with pytest.raises(GraphTypeError, match="multiple of key/value heads"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(GraphTypeError, match="does not broadcast"):
        scaled_dot_product_attention(q, q, q, b.input("m", (3, 4)))
    with pytest.raises(GraphTypeError, match="key must be"):
        scaled_dot_product_attention(q, b.input("k2", (1, 6, 3, 4)), q)
    with pytest.raises(GraphTypeError, match="D even"):
        apply_rotary_emb(b.input("x", (2, 3, 5)))
    q3 = F.reshape(q, (6, 3, 8))  # 3-d inputs: [H, L, D]
    assert scaled_dot_product_attention(q3, q3, q3).shape == (6, 3, 8)


@pytest.mark.parametrize(
    "causal,gqa,masked",
    [
        pytest.param(False, False, False, id="plain"),
        pytest.param(True, True, False, id="causal-gqa"),
        pytest.param(False, True, True, id="gqa-masked"),
    ],
)
def test_reference_gradients_match_torch_in_float64(causal, gqa, masked):
    """The NumPy references and the gradient rule, run by the interpreter in float64."""
    hkv = 2 if gqa else 4
    mask = None
    if masked:
        mask = rng.standard_normal((1, 1, 5, 6))
        mask[..., 1::2] = -np.inf
        mask[0, 0, 2] = -np.inf
    graph, ids = _graph((2, 4, 5, 8), (2, hkv, 6, 8), (2, hkv, 6, 3),
                        None if mask is None else mask.shape, is_causal=causal,
                        enable_gqa=gqa)  # fmt: skip
    params = {"q": rng.standard_normal((2, 4, 5, 8)), "k": rng.standard_normal((2, hkv, 6, 8)),
              "v": rng.standard_normal((2, hkv, 6, 3))}  # fmt: skip
    feeds = {"w": rng.standard_normal((2, 4, 5, 3))}
    if mask is not None:
        feeds["mask"] = mask
    vals, _, _ = interpret(graph, feeds, params, float64=True)
    want = _torch(params, feeds["w"], mask, is_causal=causal, enable_gqa=gqa)
    for n, i in ids.items():
        np.testing.assert_allclose(vals[i], want[n], rtol=1e-10, atol=1e-12, err_msg=n)
