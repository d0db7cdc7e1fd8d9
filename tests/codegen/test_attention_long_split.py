"""Split-key attention for long query blocks (``splits.choose_long_split``), the forward and the
query gradient: the rule on the H200's limits (its measured table and the thread-count rule),
where it never applies (CPU adapters, decode-sized blocks, short key streams, batches that
fill the GPU), and the split kernels against float64 torch SDPA and autograd over several
row tiles and chunks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention import splits as attention_splits
from meganeura.codegen.wgsl.attention.lowering import lower_attention
from meganeura.codegen.wgsl.attention.plan import Dims, Plan
from meganeura.codegen.wgsl.attention.splits import Split, choose_long_split
from meganeura.codegen.wgsl.attention.tuned import WHISPER
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops.attention import scaled_dot_product_attention

from ..opinfo.attention import _sdpa_ref
from .harness import run

CPU = replace(H200_LIMITS, cpu=True)


@pytest.fixture
def long_split():
    """Set ``LONG_SPLIT_OVERRIDE`` (True: split wherever two chunks exist); restored after."""
    saved = attention_splits.LONG_SPLIT_OVERRIDE

    def force(value):
        attention_splits.LONG_SPLIT_OVERRIDE = value

    yield force
    attention_splits.LONG_SPLIT_OVERRIDE = saved


# ---- the rule (no GPU) ------------------------------------------------------------------------
def test_whisper_takes_its_measured_plan_and_chunks():
    assert choose_long_split(WHISPER, H200_LIMITS) == Split(Plan(32, 1, 8), 3, 504)


def test_the_rule_without_the_table_fills_the_threads(monkeypatch):
    monkeypatch.setattr(attention_plan, "USE_TUNED", [False])
    s = choose_long_split(WHISPER, H200_LIMITS)
    plan = attention_plan.choose_plan("fwd", WHISPER, H200_LIMITS)
    threads = 6 * -(-1500 // plan.rows) * plan.size
    assert threads < attention_splits.LONG_SPLIT_THREADS
    assert s.plan == plan and s.chunks == -(-attention_splits.LONG_SPLIT_THREADS // threads)
    assert s.length % plan.tile == 0 and (s.chunks - 1) * s.length < 1500 <= s.chunks * s.length


@pytest.mark.parametrize(
    "dims, limits",
    [
        (WHISPER, CPU),  # a CPU adapter: the merge is pure cost
        (Dims(1, 3, 3, 1, 4096, 64, 64), H200_LIMITS),  # decode-sized: choose_split's domain
        (Dims(1, 6, 1, 1500, 512, 64, 64), H200_LIMITS),  # too few keys to split
        (Dims(8, 6, 1, 1500, 1500, 64, 64), H200_LIMITS),  # batch 8 fills the GPU already
    ],
    ids=["cpu", "decode", "short_keys", "batch_8"],
)
def test_no_long_split_where_it_cannot_help(dims, limits, monkeypatch):
    monkeypatch.setattr(attention_plan, "USE_TUNED", [dims is WHISPER])
    assert choose_long_split(dims, limits) is None


def test_whisper_query_gradient_splits_by_its_measured_plan_or_the_rule(monkeypatch):
    want = Split(Plan(32, 1, 8), 3, 504, prefetch=False)  # tuned.TUNED_SPLIT
    assert choose_long_split(WHISPER, H200_LIMITS, "dq") == want
    monkeypatch.setattr(attention_plan, "USE_TUNED", [False])
    plan = attention_plan.choose_plan("dq", WHISPER, H200_LIMITS)
    threads = 6 * -(-1500 // plan.rows) * plan.size
    s = choose_long_split(WHISPER, H200_LIMITS, "dq")
    assert s.plan == plan and s.chunks == -(-attention_splits.LONG_SPLIT_THREADS // threads) > 1
    with pytest.raises(ValueError, match="mode 'dkv' is not one of"):
        choose_long_split(WHISPER, H200_LIMITS, "dkv")


def test_forced_chunks_come_first(long_split, monkeypatch):
    long_split(False)
    monkeypatch.setitem(attention_splits.LONG_SPLIT_CHUNKS, "dq", 4)
    assert choose_long_split(WHISPER, CPU, "dq").chunks == 4
    monkeypatch.setitem(attention_splits.LONG_SPLIT_CHUNKS, "fwd", 1)  # one chunk: unsplit
    assert choose_long_split(WHISPER, H200_LIMITS) is None


def test_whisper_key_value_gradients_split_their_queries(long_split, monkeypatch):
    """dkv half (64 threads a 32-key tile: 18,048 at Whisper) splits each query head's rows by
    the long forward's rule; not on a CPU adapter, at short streams, with the switch off."""
    from meganeura.codegen.wgsl.attention import dkv_half

    with_sg = replace(H200_LIMITS, subgroups=True)
    assert dkv_half.choose_query_split(WHISPER, with_sg) == Split(Plan(32, 2, 16), 3, 512)
    assert dkv_half.choose_query_split(WHISPER, replace(with_sg, cpu=True)) is None
    assert dkv_half.choose_query_split(replace(WHISPER, lq=512), with_sg) is None
    monkeypatch.setattr(dkv_half, "QUERY_SPLIT", [False])
    assert dkv_half.choose_query_split(WHISPER, with_sg) is None
    monkeypatch.setattr(dkv_half, "QUERY_SPLIT_CHUNKS", [4])  # forced (benchmarks) first
    assert dkv_half.choose_query_split(WHISPER, with_sg).chunks == 4


def test_override_forbids_and_forces(long_split):
    long_split(False)
    assert choose_long_split(WHISPER, H200_LIMITS) is None
    long_split(True)
    assert choose_long_split(Dims(1, 2, 1, 40, 70, 16, 16), CPU) is not None


def _graph(hq, hkv, lq, lk, d, dv, **kw):
    b = GraphBuilder()
    q, k = b.input("q", (1, hq, lq, d)), b.input("k", (1, hkv, lk, d))
    v = b.input("v", (1, hkv, lk, dv))
    out = scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv, **kw)
    b.output("out", out)
    return b, out


def _backward(hq, hkv, lq, lk, d, dv, **kw):
    """(graph, forward node): the forward of ``_graph`` with loss sum(out * go) and the
    gradients of q, k and v as outputs dq, dk, dv."""
    from meganeura.autodiff import differentiate
    from meganeura.nn import functional as F

    b, out = _graph(hq, hkv, lq, lk, d, dv, **kw)
    go = b.input("go", (1, hq, lq, dv))
    b.output("o", out)
    loss = F.sum(out * go)
    graph, grads = differentiate(b.build_unverified(), loss.id, ["q", "k", "v"])
    gb = GraphBuilder(graph)
    for n in "qkv":
        gb.output("d" + n, gb.tensor(grads[graph.find(n).id]))
    return gb.build_unverified(), out.id


def test_whisper_forward_splits_with_and_without_its_log_sum_exp():
    b, out = _graph(6, 6, 1500, 1500, 64, 64)
    graph = b.build()
    parts, merge = lower_attention(graph, out.id, H200_LIMITS, "fwd")
    assert parts.name.endswith("fwd split 3x504") and merge.name.endswith("merge 3")
    assert parts.grid[0] == 6 * -(-1500 // 32) * 3  # (head, row tile, chunk)
    # training: the forward also writes its log-sum-exp for the backward; the merge stores it
    graph, _ = _backward(6, 6, 1500, 1500, 64, 64)
    names = [d.name for d in compile(graph, CompileOptions(), H200_LIMITS).dispatches]
    sdpa = [n.split(" ", 1)[1] for n in names if "attention" in n]
    assert sdpa[:2] == [
        "scaled_dot_product_attention fwd+lse split 3x504",
        "scaled_dot_product_attention merge 3",
    ]
    assert not any(n.endswith(" fwd+lse") or "_lse" in n for n in sdpa)  # no lse pass of its own
    # its query gradient splits its keys too, computing the delta pairs in the partial kernel
    dq = "scaled_dot_product_attention_backward_query dq+delta"
    assert sdpa[2:4] == [f"{dq} split 3x504", f"{dq} sum 3"]


# ---- values (GPU) -----------------------------------------------------------------------------
CASES = {
    # name: (Hq, Hkv, Lq, Lk, D, Dv, is_causal, float mask)
    "gqa_not_causal": (4, 2, 70, 90, 16, 8, False, False),
    "causal": (2, 2, 100, 100, 32, 32, True, False),
    "float_mask": (3, 1, 45, 130, 8, 16, False, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_long_split_forward_matches_torch(case, long_split, gpu_device):
    hq, hkv, lq, lk, d, dv, causal, masked = CASES[case]
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((1, hkv, lk, d)).astype(np.float32)
    v = rng.standard_normal((1, hkv, lk, dv)).astype(np.float32)
    mask = None
    if masked:
        mask = rng.standard_normal((1, hq, lq, lk)).astype(np.float32)
        mask[rng.random(mask.shape) < 0.3] = -np.inf
    b = GraphBuilder()
    ins = [b.input(n, x.shape) for n, x in (("q", q), ("k", k), ("v", v))]
    m = None if mask is None else b.input("mask", mask.shape)
    out = scaled_dot_product_attention(*ins, m, is_causal=causal, enable_gqa=hq != hkv)
    b.output("out", out)
    graph = b.build()
    long_split(True)
    parts = lower_attention(graph, out.id, CPU, "fwd")
    assert len(parts) == 2 and " split " in parts[0].name  # several chunks and row tiles
    feeds = {"q": q, "k": k, "v": v, **({} if mask is None else {"mask": mask})}
    got = run(graph, feeds).values[out.id]
    t = [torch.tensor(x, dtype=torch.float64) for x in (q, k, v)]
    tm = None if mask is None else torch.tensor(mask, dtype=torch.float64)
    want = _sdpa_ref(*t, tm, is_causal=causal, enable_gqa=hq != hkv).numpy()
    assert np.abs(got - want).max() <= 2e-6 * max(np.abs(want).max(), 1.0)
    long_split(False)
    plain = run(graph, feeds).values[out.id]
    assert np.abs(got - plain).max() <= 2e-6 * max(np.abs(want).max(), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("delta", [True, False], ids=["dq_delta", "dq_alone"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradients_through_split_kernels_match_float64_autograd(
    causal, delta, long_split, gpu_device, monkeypatch
):
    """The backward recomputes probabilities from the lse the merge wrote, and its query
    gradient splits its keys too (4 chunks of 16 keys; causal: the first row tiles' later
    chunks are empty and write zeros): its gradients, and the forward's output, against
    torch autograd in float64, with the dq kernel computing its delta or reading it."""
    hq, hkv, lq, lk, d = 4, 2, 50, 70, 16
    from meganeura.codegen.wgsl.attention import dq_delta
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    monkeypatch.setattr(dq_delta, "ENABLED", [delta])
    monkeypatch.setitem(attention_plan.LANE_OVERRIDE, "dq", (8, 2, 16))
    graph, _ = _backward(hq, hkv, lq, lk, d, d, is_causal=causal)
    long_split(True)
    program = compile(graph, CompileOptions(), device_limits(gpu_device))
    names = [x.name.split(" ", 1)[1] for x in program.dispatches]
    assert any("fwd+lse split" in n for n in names), names
    dq = "dq+delta" if delta else "dq"
    assert f"scaled_dot_product_attention_backward_query {dq} split 5x16" in names, names
    assert f"scaled_dot_product_attention_backward_query {dq} sum 5" in names, names
    rng = np.random.default_rng(11)
    feeds = {
        "q": rng.standard_normal((1, hq, lq, d)),
        "k": rng.standard_normal((1, hkv, lk, d)),
        "v": rng.standard_normal((1, hkv, lk, d)),
        "go": rng.standard_normal((1, hq, lq, d)),
    }
    feeds = {n: x.astype(np.float32) for n, x in feeds.items()}
    with Session(program, gpu_device) as sess:
        got = sess.run(feeds, ["o", "dq", "dk", "dv"])
    t = {n: torch.tensor(feeds[n], dtype=torch.float64, requires_grad=True) for n in "qkv"}
    o = _sdpa_ref(t["q"], t["k"], t["v"], None, is_causal=causal, enable_gqa=True)
    (o * torch.tensor(feeds["go"], dtype=torch.float64)).sum().backward()
    want = {"o": o.detach().numpy(), **{"d" + n: t[n].grad.numpy() for n in "qkv"}}
    for n in want:
        scale = max(np.abs(want[n]).max(), 1.0)
        assert np.abs(got[n] - want[n]).max() <= 1e-5 * scale, n
