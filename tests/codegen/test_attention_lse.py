"""The attention forward that saves its log-sum-exp: the ``..._lse`` and ``..._delta`` ops of
the backward, the forward + lse pair the fusion planner forms (``plan_attention_lse``), and
forward values and gradients through the whole pipeline (compile with fusion, Session)
against float64 torch autograd at a Whisper-like shape scaled down (2 heads, 300 or 150 rows
of 64, neither a multiple of any tile), with and without causality and a padding mask, strict and
fast."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from meganeura.codegen.wgsl.attention import dkv_half as dkv_half_module
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention import splits as attention_splits
from meganeura.codegen.wgsl.attention.dkv_half import choose_query_split, half_fits
from meganeura.codegen.wgsl.attention.plan import Dims, fuses_key_value, uses_dkv_half
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops.attention import DELTA, LSE, SDPA
from meganeura.passes.fuse import plan_attention_lse
from meganeura.runtime import Session
from meganeura.schedule.schedule import needed_nodes
from meganeura.training import device_limits

from .test_attention import _graph, _rel, _torch
from .test_attention_kv import H200, _whisper_sized

# Whisper-tiny's encoder attention (6 x 1500 x 64) scaled down; neither length is a multiple
# of a tile. On lavapipe with a cold shader cache compiling the kernels costs far more than
# running them, so two cases; the unfused kernels run at a small size below.
# The long case also runs dk and dv through the half-head-dim kernel (plan.DKV_HALF) at D = 64;
# the fast case runs at D = 32 (f16 storage changes the loads and stores, not the tiling).
LONG, SHORT = (1, 2, 300, 64), (1, 2, 150, 32)


def _padding_mask(lk: int, keep: int) -> np.ndarray:
    """HF-style key padding: 0 for the first ``keep`` keys, -inf after."""
    m = np.zeros((1, 1, 1, lk))
    m[..., keep:] = -np.inf
    return m


def _ops(program) -> list[str]:
    return [d.name.split()[1] for d in program.dispatches if "attention" in d.name]


def test_backward_reads_lse_and_delta_nodes():
    """The gradient of an attention builds lse(q, k, mask) and delta(lse, out, g), not the
    one-pass stats op; the planner pairs the forward with the lse node only."""
    graph = _whisper_sized(64)
    ops = [n.op for n in graph.nodes]
    assert LSE in ops and DELTA in ops and f"{SDPA}_stats" not in ops
    (group,) = plan_attention_lse(graph, needed_nodes(graph))
    fwd, lse = group.members
    assert graph[fwd].op == SDPA and graph[lse].op == LSE and group.anchor == fwd
    assert plan_attention_lse(graph, needed_nodes(graph), taken={fwd}) == ()


def test_forward_writes_lse_at_its_position_on_h200_limits():
    """Whisper's encoder shape (6 x 1500 x 64): the forward kernel writes the log-sum-exp
    (one pass over the keys fewer), placed before everything that reads the forward's
    output; the dq kernel computes delta (``dq_delta``); dk and dv stay two kernels there
    (the lane dkv spills: plan.fuses_key_value). The forward splits its keys there
    (``splits.choose_long_split``): its merge, right after it, writes the output and the lse;
    so does dq."""
    graph = _whisper_sized(1500)
    program = compile(graph, CompileOptions(), H200)
    names = [d.name for d in program.dispatches]
    att = [n.split()[2] for n in names if "attention" in n]
    # delta in dq's (dq_delta); dq splits its keys too: its partial kernel, then their sum
    assert att == ["fwd+lse", "merge", "dq+delta", "dq+delta", "dk", "dv"]
    assert names[0].split()[1:3] == [SDPA, "fwd+lse"]  # the forward's position: first


def _values(device, shape, mask, precision="strict", **kw):
    qs = ks = vs = shape
    gen = np.random.default_rng(7)
    graph, ids = _graph(qs, ks, vs, None if mask is None else mask.shape, **kw)
    b = GraphBuilder(graph)
    for n in "qkv":
        b.output("d" + n, b.tensor(ids[n]))
    graph = b.build_unverified()
    params = {n: gen.standard_normal(s, np.float32) for n, s in zip("qkv", (qs, ks, vs))}
    feeds = {"w": gen.standard_normal(graph[ids["out"]].type.shape, np.float32)}
    ref_mask = mask
    if mask is not None:
        feeds["mask"] = mask.astype(np.float32)
        if kw.get("is_causal"):  # torch rejects causal with a mask: fold the rule into it
            future = np.arange(ks[2])[None, :] > np.arange(qs[2])[:, None]
            ref_mask = np.where(future, -np.inf, np.broadcast_to(mask, (1, 1, qs[2], ks[2])))
            kw = dict(kw, is_causal=False)
    program = compile(graph, CompileOptions(precision=precision), device_limits(device))
    with Session(program, device) as sess:
        sess.load_state_dict(params)
        res = sess.run(feeds, ("out", "dq", "dk", "dv"))
    got = {"out": res["out"], **{n: res["d" + n] for n in "qkv"}}
    names = [d.name for d in program.dispatches if "attention" in d.name]
    return got, _torch(params, feeds["w"], ref_mask, **kw), names


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,causal,padded,precision",
    [(LONG, False, True, "strict"), (SHORT, True, True, "fast")],
    ids=["padded_300_dkv_half", "causal_padded_fast_150_d32"],
)  # fmt: skip
def test_whisper_like_values_and_gradients_match_torch(
    shape, causal, padded, precision, gpu_device
):
    keep = shape[2] * 4 // 5  # HF pads the keys past the real frames
    mask = _padding_mask(shape[2], keep) if padded else None
    half = shape == LONG and device_limits(gpu_device).subgroups
    saved, attention_plan.DKV_HALF = attention_plan.DKV_HALF, half
    try:
        got, want, names = _values(gpu_device, shape, mask, precision, is_causal=causal)
    finally:
        attention_plan.DKV_HALF = saved
    ops = [n.split()[1] for n in names]
    assert ops[0] == SDPA and LSE not in ops  # lse written by the forward
    assert DELTA not in ops and any(n.endswith("dq+delta") for n in names)  # delta by dq's
    assert any(n.endswith("dkv half") for n in names) == half
    tol = 2e-6 if precision == "strict" else 5e-3  # fast: f16 storage of q, k, v, out, g
    for n in ("out", "q", "k", "v"):
        assert _rel(got[n], want[n]) < tol, n
    if padded:  # padded keys get no weight, so no key or value gradient
        assert not got["k"][..., keep:, :].any() and not got["v"][..., keep:, :].any()


@pytest.mark.gpu
def test_unfused_lse_and_delta_kernels_match_torch(gpu_device):
    """Without fusion the lse node is its own lane-kernel pass (mode ``lse``)."""
    qs, ks, vs = (1, 3, 45, 16), (1, 3, 37, 16), (1, 3, 37, 8)
    gen = np.random.default_rng(3)
    graph, ids = _graph(qs, ks, vs, (1, 1, 45, 37), is_causal=True)
    b = GraphBuilder(graph)
    for n in "qkv":
        b.output("d" + n, b.tensor(ids[n]))
    graph = b.build_unverified()
    params = {n: gen.standard_normal(s, np.float32) for n, s in zip("qkv", (qs, ks, vs))}
    mask = np.where(gen.random((1, 1, 45, 37)) < 0.2, -np.inf, gen.standard_normal((1, 1, 45, 37)))
    mask[..., 0, :] = -np.inf  # a fully masked row: lse 0, zero gradients
    feeds = {"w": gen.standard_normal((1, 3, 45, 8), np.float32), "mask": mask.astype(np.float32)}
    program = compile(graph, CompileOptions(fuse=False), device_limits(gpu_device))
    assert _ops(program)[:3] == [SDPA, LSE, DELTA]
    with Session(program, gpu_device) as sess:
        sess.load_state_dict(params)
        res = sess.run(feeds, ("out", "dq", "dk", "dv"))
    future = np.arange(37)[None, :] > np.arange(45)[:, None]
    want = _torch(params, feeds["w"], np.where(future, -np.inf, mask))
    for n, w in zip(("out", "dq", "dk", "dv"), ("out", "q", "k", "v")):
        assert _rel(res[n], want[w]) < 2e-6, n


def test_delta_type_errors_name_the_operands():
    b = GraphBuilder()
    o = b.parameter("o", (1, 2, 5, 4))
    lse = b.parameter("lse", (1, 2, 6))
    with pytest.raises(Exception, match="lse must be f32"):
        b.add(DELTA, [lse, o, o])
    g = b.parameter("g", (1, 2, 5, 3))
    with pytest.raises(Exception, match="out and its gradient"):
        b.add(DELTA, [b.parameter("l2", (1, 2, 5)), o, g])


# ---- dk and dv over half head dims (``dkv_half``, opt-in through plan.DKV_HALF) ----------------
@pytest.fixture
def dkv_half():
    saved = attention_plan.DKV_HALF
    attention_plan.DKV_HALF = True
    yield
    attention_plan.DKV_HALF = saved


@pytest.mark.gpu
@pytest.mark.parametrize(
    "qs,ks,vs,masked,kw",
    [((1, 2, 45, 16), (1, 2, 45, 16), (1, 2, 45, 8), True, {"is_causal": True}),
     ((2, 6, 37, 8), (2, 2, 41, 8), (2, 2, 41, 16), False, {"enable_gqa": True})],
    ids=["causal_mask", "gqa_cross"],
)  # fmt: skip
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_dkv_half_gradients_match_torch(
    qs, ks, vs, masked, kw, split, gpu_device, dkv_half, monkeypatch
):
    """dk and dv of the half kernel against float64 torch; ``split``: each query head's rows
    in 3 chunks of 16 over workgroups, then their sum (``dkv_half.choose_query_split``; the
    causal case's second key tile finds its first chunk empty)."""
    monkeypatch.setattr(attention_splits, "LONG_SPLIT_OVERRIDE", True if split else False)
    if not device_limits(gpu_device).subgroups:
        pytest.skip("the dkv half kernel needs subgroups")
    gen = np.random.default_rng(5)
    mshape = (1, 1, qs[2], ks[2])
    graph, ids = _graph(qs, ks, vs, mshape if masked else None, **kw)
    b = GraphBuilder(graph)
    for n in "qkv":
        b.output("d" + n, b.tensor(ids[n]))
    graph = b.build_unverified()
    params = {n: gen.standard_normal(s, np.float32) for n, s in zip("qkv", (qs, ks, vs))}
    feeds = {"w": gen.standard_normal(graph[ids["out"]].type.shape, np.float32)}
    mask = None
    if masked:
        mask = np.where(gen.random(mshape) < 0.2, -np.inf, gen.standard_normal(mshape))
        feeds["mask"] = mask.astype(np.float32)
        if kw.get("is_causal"):
            future = np.arange(ks[2])[None, :] > np.arange(qs[2])[:, None]
            mask = np.where(future, -np.inf, mask)
    program = compile(graph, CompileOptions(), device_limits(gpu_device))
    kinds = [d.name.split(" ", 2)[2] for d in program.dispatches if "key_value" in d.name]
    assert kinds == (["dkv half split 3x16", "dkv half sum 3"] if split else ["dkv half"])
    with Session(program, gpu_device) as sess:
        sess.load_state_dict(params)
        res = sess.run(feeds, ("out", "dq", "dk", "dv"))
    want = _torch(params, feeds["w"], mask, **{k: v for k, v in kw.items() if k != "is_causal"})
    for n, w in zip(("dk", "dv", "dq"), "kvq"):
        assert _rel(res[n], want[w]) < 2e-6, n


def test_dkv_half_plan_rule(dkv_half, monkeypatch):
    """With DKV_HALF, Whisper's pair fuses onto the half kernel where subgroups exist; without
    subgroups (or head dims not divisible by 8) the lane rule stands (dk and dv apart)."""
    whisper = Dims(1, 6, 1, 1500, 1500, 64, 64)
    with_sg = replace(H200, subgroups=True)
    assert half_fits(whisper, with_sg) and fuses_key_value(whisper, with_sg)
    assert not half_fits(whisper, H200) and not fuses_key_value(whisper, H200)
    assert not half_fits(Dims(1, 6, 1, 1500, 1500, 60, 60), with_sg)
    graph = _whisper_sized(1500)
    names = [d.name for d in compile(graph, CompileOptions(), with_sg).dispatches]
    att = [n.split(" ", 2)[2] for n in names if "attention" in n]
    # each query head's 1500 rows split over 3 workgroups a key tile (choose_query_split)
    assert att[-2:] == ["dkv half split 3x512", "dkv half sum 3"]
    # auto (None): where the lane dkv would spill, and at SmolLM2's short streams only through
    # the measured query split (tuned.TUNED_QUERY_SPLIT): not with the tables or the split off,
    # nor on a CPU adapter, nor at SmolVLA's self attention (no entry)
    attention_plan.DKV_HALF = None
    assert uses_dkv_half(whisper, with_sg)
    smollm2 = Dims(1, 3, 3, 128, 128, 64, 64)
    assert uses_dkv_half(smollm2, with_sg)
    assert choose_query_split(smollm2, with_sg).chunks == 8
    assert not uses_dkv_half(Dims(1, 5, 3, 50, 50, 64, 64), with_sg)
    assert not uses_dkv_half(smollm2, replace(with_sg, cpu=True))
    monkeypatch.setattr(attention_plan, "USE_TUNED", [False])
    assert not uses_dkv_half(smollm2, with_sg)
    monkeypatch.setattr(attention_plan, "USE_TUNED", [True])
    monkeypatch.setattr(dkv_half_module, "QUERY_SPLIT", [False])
    assert not uses_dkv_half(smollm2, with_sg)


@pytest.mark.gpu
def test_one_pass_stats_op_matches_torch(gpu_device):
    """``..._stats(q, k, out, g, mask)``, no longer emitted by the gradient rule, still gives
    (logsumexp of the masked scaled scores, rowsum(g * out)) per query row."""
    import torch

    gen = np.random.default_rng(9)
    q, k = gen.standard_normal((1, 2, 20, 8)), gen.standard_normal((1, 2, 23, 8))
    out, g = gen.standard_normal((1, 2, 20, 5)), gen.standard_normal((1, 2, 20, 5))
    mask = np.where(gen.random((1, 1, 20, 23)) < 0.25, -np.inf, gen.standard_normal((1, 1, 20, 23)))
    b = GraphBuilder()
    ins = [
        b.input(n, a.shape) for n, a in zip(("q", "k", "out", "g", "mask"), (q, k, out, g, mask))
    ]
    b.output("stats", b.add(f"{SDPA}_stats", ins, {"is_causal": False, "scale": 0.25}))
    program = compile(b.build(), CompileOptions(), device_limits(gpu_device))
    feeds = {
        n: a.astype(np.float32)
        for n, a in zip(("q", "k", "out", "g", "mask"), (q, k, out, g, mask))
    }
    with Session(program, gpu_device) as sess:
        got = sess.run(feeds, ("stats",))["stats"]
    s = torch.tensor(q) @ torch.tensor(k).transpose(-1, -2) * 0.25 + torch.tensor(mask)
    assert _rel(got[..., 0], torch.logsumexp(s, -1).numpy()) < 2e-6
    assert _rel(got[..., 1], (g * out).sum(-1)) < 2e-6
