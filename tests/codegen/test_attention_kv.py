"""Attention's key and value gradients in one pass (``dkv``): which pairs the fusion planner
forms, the kernel plans, and the fused kernels against float64 torch through the whole
pipeline (compile with fusion, Session), for every case the separate kernels support."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention.lowering import KEY_VALUE, lower_key_value
from meganeura.codegen.wgsl.attention.plan import (
    BLOCK_PLANS,
    BlockPlan,
    Dims,
    block_layout,
    choose_block_plan,
    choose_plan,
    fuses_key_value,
    shared_layout,
)
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.attention import BWD_K, BWD_V, scaled_dot_product_attention
from meganeura.passes.fuse import plan_attention_key_value
from meganeura.runtime import Session
from meganeura.training import device_limits

from ..ids import attention_dims_id, plan_id
from .test_attention import _graph, _rel, _torch

rng = np.random.default_rng(23)
# The H200's workgroup and binding-size limits, the other fields at their defaults (not
# ``kernel.H200_LIMITS``: no subgroups, no f16, 8 bindings); test_attention_decode uses it too.
H200 = Limits(max_workgroup_storage_size=49152, max_invocations_per_workgroup=1024,
              max_storage_buffer_binding_size=2**31 - 4)  # fmt: skip
WHISPER = Dims(1, 6, 1, 1500, 1500, 64, 64)


@pytest.fixture
def override():
    """Set ``FUSE_KEY_VALUE`` and ``BLOCK_OVERRIDE``; both restored after the test."""
    saved = dict(attention_plan.BLOCK_OVERRIDE), attention_plan.FUSE_KEY_VALUE

    def force(fuse, plans=None):
        attention_plan.FUSE_KEY_VALUE = fuse
        attention_plan.BLOCK_OVERRIDE.update(plans or {})

    yield force
    attention_plan.BLOCK_OVERRIDE.clear()
    attention_plan.BLOCK_OVERRIDE.update(saved[0])
    attention_plan.FUSE_KEY_VALUE = saved[1]


def _attention_kernels(program) -> list[str]:
    return [d.name.split()[1] for d in program.dispatches if "attention" in d.name]


def _run_fused(device, qs, ks, vs, mask=None, seed=0, **kw):
    """(ours, reference, attention kernel ops): output and q/k/v gradients of
    ``sum(sdpa * w)`` through compile (fusion on) and a Session, and float64 torch; the
    operands are drawn from ``seed``."""
    gen = np.random.default_rng(seed)
    graph, ids = _graph(qs, ks, vs, None if mask is None else mask.shape, **kw)
    b = GraphBuilder(graph)
    for n in "qkv":
        b.output("d" + n, b.tensor(ids[n]))
    graph = b.build_unverified()
    params = {n: gen.standard_normal(s, np.float32) for n, s in zip("qkv", (qs, ks, vs))}
    feeds = {"w": gen.standard_normal(graph[ids["out"]].type.shape, np.float32)}
    ref_mask, ref_kw = mask, kw
    if mask is not None:
        feeds["mask"] = mask.astype(np.float32)
        if kw.get("is_causal"):  # torch rejects causal with a mask: fold the rule into it
            future = np.arange(ks[2])[None, :] > np.arange(qs[2])[:, None]
            ref_mask = np.where(future, -np.inf, np.broadcast_to(mask, (*mask.shape[:-2],
                                                                        qs[2], ks[2])))  # fmt: skip
            ref_kw = dict(kw, is_causal=False)
    program = compile(graph, CompileOptions(), device_limits(device))
    with Session(program, device) as sess:
        sess.load_state_dict(params)
        res = sess.run(feeds, ("out", "dq", "dk", "dv"))
    got = {"out": res["out"], **{n: res["d" + n] for n in "qkv"}}
    return got, _torch(params, feeds["w"], ref_mask, **ref_kw), _attention_kernels(program)


def _mask(lq, lk, full_row=None):
    m = rng.standard_normal((1, 1, lq, lk))
    m[..., 2::5] = -np.inf
    if full_row is not None:
        m[0, 0, full_row] = -np.inf
    return m


CASES = {
    # name: (q, k, v shapes, mask, kwargs)
    "causal_gqa_mask": ((2, 6, 37, 12), (2, 2, 41, 12), (2, 2, 41, 6), _mask(37, 41, 5),
                        {"is_causal": True, "enable_gqa": True}),
    "full_d64": ((1, 2, 70, 64), (1, 2, 70, 64), (1, 2, 70, 64), None, {}),
    "cross_lk_short": ((2, 3, 19, 8), (2, 3, 5, 8), (2, 3, 5, 3), None, {}),
    "cross_lk_long_causal": ((1, 2, 7, 8), (1, 2, 129, 8), (1, 2, 129, 8), None,
                             {"is_causal": True}),
    "gqa_9_3_mask_per_head": ((1, 9, 33, 16), (1, 3, 33, 16), (1, 3, 33, 20),
                              rng.standard_normal((1, 9, 33, 33)), {"enable_gqa": True}),
    "single_entries": ((1, 1, 1, 4), (1, 1, 1, 4), (1, 1, 1, 1), None, {}),
}  # fmt: skip


# ---- the fused kernels on the GPU -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("plan", [None, *BLOCK_PLANS], ids=plan_id)
@pytest.mark.parametrize("case", CASES)
def test_fused_key_value_gradients_match_torch(case, plan, gpu_device, override):
    """Each case with the lane kernel (None) and each block plan (a plan that does not fit
    the adapter falls back to the lane kernel); dk and dv come from one dispatch."""
    override(True, {"dkv": plan})
    qs, ks, vs, mask, kw = CASES[case]
    got, want, kernels = _run_fused(gpu_device, qs, ks, vs, mask, **kw)
    assert KEY_VALUE in kernels and BWD_K not in kernels and BWD_V not in kernels
    for n in ("out", "q", "k", "v"):
        if want[n].any():
            assert _rel(got[n], want[n]) < 2e-6, n
        else:  # one key: dq is zero in exact arithmetic, f32 rounding of dP - delta (~1e-9 on
            # the H200, whose compiler contracts into FMAs) may leave it off by a few ulps of 1
            assert np.abs(got[n]).max() < 1e-6, n
    if case == "causal_gqa_mask":
        # keys no query sees (masked for all of them) get exactly zero gradient
        assert not got["k"][..., 2::5, :].any() and not got["v"][..., 2::5, :].any()


@pytest.mark.gpu
def test_fused_and_separate_kernels_agree(gpu_device, override):
    """The same program with dk and dv fused and separate: the same values (the same f32
    sums in the same order, up to the shader compiler's contractions), one attention
    dispatch fewer."""
    qs, ks, vs, mask, kw = CASES["causal_gqa_mask"]
    override(False)
    sep, want, sep_kernels = _run_fused(gpu_device, qs, ks, vs, mask, seed=5, **kw)
    override(True)
    fused, _, fused_kernels = _run_fused(gpu_device, qs, ks, vs, mask, seed=5, **kw)
    assert len(sep_kernels) == len(fused_kernels) + 1
    assert {BWD_K, BWD_V} <= set(sep_kernels) and KEY_VALUE not in sep_kernels
    for n in ("out", "q", "k", "v"):
        assert _rel(fused[n], sep[n]) < 1e-6 and _rel(sep[n], want[n]) < 2e-6, n


# ---- planning (no GPU) ------------------------------------------------------------------------
def _backward(causal=False, hq=4, hkv=2, d=8, dv=8, length=64):
    graph, ids = _graph((1, hq, length, d), (1, hkv, length, d), (1, hkv, length, dv),
                        is_causal=causal, enable_gqa=hq != hkv)  # fmt: skip
    return graph, ids


def test_planner_pairs_the_key_and_value_gradients_of_each_attention():
    b = GraphBuilder()
    q, k, v = (b.parameter(n, (1, 2, 9, 8)) for n in "qkv")
    o1 = scaled_dot_product_attention(q, k, v)
    o2 = scaled_dot_product_attention(q, k, v, is_causal=True)  # same operands, other attrs
    b.output("loss", F.sum(o1 * o2))
    graph, _ = differentiate(b.build(), "loss", ["q", "k", "v"])
    groups = plan_attention_key_value(graph, [True] * len(graph.nodes))
    assert len(groups) == 2
    for grp in groups:
        dk, dv = (graph[m] for m in grp.members)
        assert (dk.op, dv.op) == (BWD_K, BWD_V) and grp.anchor == dk.id
        assert grp.outputs == grp.members and dk.attrs == dv.attrs
        assert dv.inputs == dk.inputs[:2] + dk.inputs[3:]  # the same attention's gradients
    assert groups[0].members != groups[1].members
    # the kernel's veto and unneeded nodes leave the pair apart
    assert plan_attention_key_value(graph, [True] * len(graph.nodes), lambda _: False) == ()
    needed = [graph[i].op != BWD_V for i in range(len(graph.nodes))]
    assert plan_attention_key_value(graph, needed) == ()


def test_planner_refuses_a_pair_whose_first_member_is_read_before_the_second():
    graph, ids = _backward()
    dk, dv = ids["k"], ids["v"]
    assert graph[dk].op == BWD_K and graph[dv].op == BWD_V and dk < dv
    # a graph where dk is consumed (through a view) before dv is computed
    b = GraphBuilder()
    q, k, v = (b.parameter(n, (1, 2, 9, 8)) for n in "qkv")
    g, stats = b.input("g", (1, 2, 9, 8)), b.input("stats", (1, 2, 9, 2))
    attrs = {"is_causal": False, "scale": 0.5}
    dk = b.add(BWD_K, [q, k, v, g, stats], attrs)
    early = F.sum(F.reshape(dk, (2, 72)))
    dv = b.add(BWD_V, [q, k, g, stats], attrs)
    b.output("early", early)
    b.output("dv", dv)
    graph = b.build()
    assert plan_attention_key_value(graph, [True] * len(graph.nodes)) == ()


def _whisper_sized(lq):
    b = GraphBuilder()
    q, k, v, go = (b.parameter(n, (1, 6, lq, 64)) for n in ("q", "k", "v", "go"))
    o = scaled_dot_product_attention(q, k, v)
    b.output("o", o)
    loss = F.sum(o * go)
    graph, grads = differentiate(b.build_unverified(), loss.id, ["q", "k", "v"])
    gb = GraphBuilder(graph)
    for n in "qkv":
        gb.output("d" + n, gb.tensor(grads[graph.find(n).id]))
    return gb.build_unverified()


def test_attention_backward_dispatches_on_h200_limits():
    """D = 64 (6 heads): at 256 rows the forward writes the log-sum-exp too (fwd+lse), then
    dq computing delta (``dq_delta``) and one lane dkv (without fusion: fwd, lse, delta, dq,
    dk, dv); at Whisper's 1500 rows dk and dv stay apart (measured faster), so that pair is
    not fused, and the forward is split over its keys."""
    graph = _whisper_sized(256)
    fused = compile(graph, CompileOptions(), H200)
    names = [d.name for d in fused.dispatches if "attention" in d.name]
    assert [n.split()[2] for n in names] == ["fwd+lse", "dq+delta", "dkv"]
    assert names[-1].split()[1] == KEY_VALUE and "block" not in names[-1]
    separate = compile(graph, CompileOptions(fuse=False), H200)
    assert len(_attention_kernels(separate)) == 6
    whisper = compile(_whisper_sized(1500), CompileOptions(), H200)
    names = [d.name.split()[2] for d in whisper.dispatches if "attention" in d.name]
    # ... and the forward splits its keys (splits.choose_long_split): a merge writes out and lse;
    # so does dq: its partial kernel (with the delta pairs), then the sum of its parts
    assert names == ["fwd+lse", "merge", "dq+delta", "dq+delta", "dk", "dv"]


@pytest.mark.parametrize("storage", [16384, 32768, 49152], ids=lambda n: f"smem{n}")
@pytest.mark.parametrize(
    "dims",
    [Dims(1, 3, 3, 128, 128, 64, 64), WHISPER, Dims(2, 3, 3, 1, 129, 64, 64),
     Dims(1, 1, 1, 3, 7, 6, 3), Dims(1, 1, 1, 2, 2, 256, 256)],
    ids=attention_dims_id,
)  # fmt: skip
def test_dkv_plans_fit_the_adapter(dims, storage):
    lim = Limits(max_workgroup_storage_size=storage, max_invocations_per_workgroup=1024)
    plan = choose_plan("dkv", dims, lim)
    assert 16 * shared_layout("dkv", dims, plan)[0] <= storage
    block = choose_block_plan("dkv", dims, lim, by_groups=True)
    if block is not None:
        assert 16 * block_layout("dkv", dims, block)[0] <= storage


def test_dkv_block_layout_holds_probabilities_and_score_gradients_apart():
    plan = BlockPlan(*BLOCK_PLANS[1])
    total, layout = block_layout("dkv", WHISPER, plan)
    dk_total, dk_layout = block_layout("dk", WHISPER, plan)
    assert set(layout) == set(dk_layout) | {"ds"}
    assert total == dk_total + plan.tile * plan.rows // 4
    p, ds = layout["p"][0], layout["ds"][0]
    assert abs(p - ds) >= plan.tile * plan.rows // 4  # no overlap


def test_fusion_rule():
    """The lane kernel fuses within its register budget (D = Dv = 32), or at D = 64 when each
    key row streams over few query rows (SmolLM2: 128 x 3) but not many (Whisper: 1500);
    the override wins."""
    assert choose_block_plan("dkv", WHISPER, H200) is None
    assert not fuses_key_value(WHISPER, H200)
    smollm2 = Dims(1, 3, 3, 128, 128, 64, 64)
    assert choose_block_plan("dkv", smollm2, H200) is None
    assert fuses_key_value(smollm2, H200)
    assert not fuses_key_value(Dims(1, 3, 3, 256, 256, 64, 64), H200)
    assert fuses_key_value(Dims(1, 6, 1, 1500, 1500, 32, 32), H200)
    assert fuses_key_value(Dims(1, 6, 1, 1500, 1500, 32, 32), Limits())


def test_fusion_override(override):
    smollm2 = Dims(1, 3, 3, 128, 128, 64, 64)
    override(True)
    assert fuses_key_value(WHISPER, H200)
    override(False)
    assert not fuses_key_value(smollm2, H200)


@pytest.mark.parametrize("plan", [None, BLOCK_PLANS[0]], ids=plan_id)
def test_dkv_kernel_text(plan, override):
    """One kernel binding dk and dv for writing, unrolled (no private arrays), no inf/NaN
    literals; the lane and the block variant."""
    override(True, {"dkv": plan})
    graph, ids = _graph((1, 6, 7, 8), (1, 2, 9, 8), (1, 2, 9, 4), (7, 9), enable_gqa=True)
    (ks,) = lower_key_value(graph, ids["k"], ids["v"], H200)
    writes = [r.node for r in ks.bindings if getattr(r, "write", False)]
    assert writes == [ids["k"], ids["v"]]
    assert ks.name.startswith(f"%{ids['k']}+{ids['v']} {KEY_VALUE} dkv")
    assert ("block" in ks.name) == (plan is not None)
    assert "var<private>" not in ks.wgsl and "array<f32," not in ks.wgsl
    assert "inf" not in ks.wgsl.replace("info", "") and "nan" not in ks.wgsl.lower()
