"""Attention stream loops that load the next tile into registers while computing the current
one (``attention.tile_loads.prefetch``): query-row loops (the forward, its log-sum-exp and the
query gradient: key and value tiles) and key-row loops (dk, dv, dkv and dkv half: query, dO
and stats tiles, all or a prefix of them) bit-identical to the plain loop (causal and not,
GQA, a float mask, head dims not a multiple of 4, a runtime key count including an empty
row) and against float64 torch autograd; where the prefetch applies (the WGSL) and where it
does not (one tile, a short query block, too many registers), on lavapipe and on the H200's
limits."""

from __future__ import annotations

import re

import numpy as np
import pytest

import meganeura.nn.functional as F
from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.attention import lane_stream, tile_loads
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention import splits as attention_splits
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops.attention import scaled_dot_product_attention
from meganeura.optim import HYPER_INPUT, SGD

from .attention_ab import graph, run_both
from .harness import compile_both, run_identical

# name: (q shape, k shape, v head dim, is_causal, mask); streams longer than one tile
CASES = {
    "mha": ((2, 2, 70, 16), (2, 2, 70, 16), 16, False, False),
    "gqa_causal": ((1, 4, 90, 8), (1, 2, 90, 8), 8, True, False),
    "mask_d6_dv12": ((1, 2, 37, 6), (1, 2, 81, 6), 12, False, True),
    # causal, more keys than queries: key tiles past the last query stream nothing
    "causal_cross": ((1, 2, 40, 8), (1, 2, 100, 8), 8, True, False),
}


@pytest.fixture(autouse=True)
def restore():
    yield
    lane_stream.set_prefetch(True)


def _prefetching(program) -> list[str]:
    """Names of the query-row dispatches whose WGSL declares prefetch registers."""
    return [d.name for d in program.dispatches if "var ke0v: vec4<f32>;" in d.wgsl]


def _segments(program) -> dict[str, str]:
    """{dispatch kind (its name's last words): the segments it prefetches, e.g. "k+v"} of the
    attention dispatches ("" where none)."""
    out = {}
    for d in program.dispatches:
        kind = d.name.split(" ", 2)[-1]
        if "scaled_dot_product_attention" in d.name:
            segs = re.findall(r"var (k|v|q|g|st)e0v: vec[24]<f32>;", d.wgsl)
            out[kind] = "+".join(segs)
    return out


def _run_both(gpu_device, case, precision, check_wgsl):
    """Compile ``case``'s training step with the prefetch on and off, ``check_wgsl(on, off)``,
    then run both: outputs and q, k, v gradients bit-identical, and within tolerance of
    float64 torch autograd (``attention_ab.run_both``)."""
    run_both(gpu_device, lane_stream.set_prefetch, case, precision, check_wgsl, out=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_forward_and_gradients_bit_identical_and_match_torch(gpu_device, case, precision):
    def check(on, off):
        # the forward and the query gradient prefetch their key and value tiles
        kinds = sorted(n.split()[-1] for n in _prefetching(on))
        assert kinds and set(kinds) <= {"fwd", "fwd+lse", "dq", "dq+delta"}, kinds
        assert any(k.startswith("fwd") for k in kinds) and any(k.startswith("dq") for k in kinds)
        assert not _prefetching(off)

    _run_both(gpu_device, case, precision, check)


# key-row kernel -> (plan.FUSE_KEY_VALUE, plan.DKV_HALF) forcing it
KEY_KERNELS = {"dkv": (True, False), "dk_dv": (False, False), "dkv_half": (True, True)}
# (case, kernel, budget) -> {key-row dispatch: the segments it prefetches}, on lavapipe's plans
# (64 threads; 32-entry query tiles, dkv half 16): q, dO, stats all where they fit, else a
# prefix
KEY_SEGMENTS = {
    ("mha", "dkv", 8): {"dkv": ""},
    ("mha", "dk_dv", 8): {"dk": "q+g+st", "dv": "q+g+st"},
    ("mha", "dkv_half", 8): {"dkv half": "q+g+st"},
    ("mha", "dkv", 2): {"dkv": ""},
    ("mha", "dk_dv", 2): {"dk": "q", "dv": "q"},
    ("mha", "dkv_half", 2): {"dkv half": "q+g"},
    ("gqa_causal", "dkv", 8): {"dkv": ""},
    ("gqa_causal", "dk_dv", 8): {"dk": "q+g+st", "dv": "q+g+st"},
    ("gqa_causal", "dkv_half", 8): {"dkv half": "q+g+st"},
    ("gqa_causal", "dkv", 2): {"dkv": ""},
    ("gqa_causal", "dk_dv", 2): {"dk": "q+g", "dv": "q+g"},
    ("gqa_causal", "dkv_half", 2): {"dkv half": "q+g"},
    ("mask_d6_dv12", "dkv", 8): {"dkv": ""},
    ("mask_d6_dv12", "dk_dv", 8): {"dk": "q+g+st", "dv": "q+g+st"},
    ("mask_d6_dv12", "dkv", 2): {"dkv": ""},
    ("mask_d6_dv12", "dk_dv", 2): {"dk": "q", "dv": "q"},
    ("causal_cross", "dkv", 8): {"dkv": ""},
    ("causal_cross", "dk_dv", 8): {"dk": "q+g+st", "dv": "q+g+st"},
    ("causal_cross", "dkv_half", 8): {"dkv half": "q+g+st"},
    ("causal_cross", "dkv", 2): {"dkv": ""},
    ("causal_cross", "dk_dv", 2): {"dk": "q+g", "dv": "q+g"},
    ("causal_cross", "dkv_half", 2): {"dkv half": "q+g"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [8, 2], ids=["budget8", "budget2"])
@pytest.mark.parametrize("kernel", KEY_KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_key_row_gradients_bit_identical_and_match_torch(
    gpu_device, monkeypatch, case, kernel, budget
):
    """dk, dv and dkv half stream query tiles: all three segments prefetched where they fit
    the budget, a prefix of them under a smaller budget (2: the rest copied between the
    barriers), the same bits as without prefetch; the lane dkv (k, v, dk and dv resident in
    one thread) prefetches nothing."""
    fuse, half = KEY_KERNELS[kernel]
    if (case, kernel, budget) not in KEY_SEGMENTS:
        pytest.skip("the dkv half kernel needs head dims divisible by 8")
    monkeypatch.setattr(attention_plan, "FUSE_KEY_VALUE", fuse)
    monkeypatch.setattr(attention_plan, "DKV_HALF", half)
    monkeypatch.setattr(tile_loads, "PREFETCH_MAX_VEC4", budget)

    def check(on, off):
        key_rows = {"dk", "dv", "dkv", "dkv half"}
        got = {n: s for n, s in _segments(on).items() if n in key_rows}
        assert got == KEY_SEGMENTS[case, kernel, budget]
        assert not any(_segments(off).values())

    _run_both(gpu_device, CASES[case], "strict", check)


def _kv_length_graph(lq, lk, causal):
    b = GraphBuilder()
    q = b.input("q", (2, 4, lq, 8))
    k, v = b.input("k", (2, 2, lk, 8)), b.input("v", (2, 2, lk, 8))
    kvl = b.input("kvl", (2,), DType.i32)
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, kv_length=kvl)
    b.output("out", out)
    return b.build()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_runtime_key_count_bit_identical(gpu_device, causal):
    """A forward whose key loop stops at a runtime count: 0 keys (the prefetch before the
    loop must not read), a count inside the first tile, one past several tiles."""
    from meganeura.training import device_limits

    lq, lk = 12, 100
    on, off = compile_both(lane_stream.set_prefetch, _kv_length_graph(lq, lk, causal),
                           CompileOptions(), device_limits(gpu_device))  # fmt: skip
    assert _prefetching(on) and not _prefetching(off)
    rng = np.random.default_rng(8)
    feeds = {"q": rng.standard_normal((2, 4, lq, 8)).astype(np.float32),
             "k": rng.standard_normal((2, 2, lk, 8)).astype(np.float32),
             "v": rng.standard_normal((2, 2, lk, 8)).astype(np.float32)}  # fmt: skip
    for lengths in ([0, 5], [lk, 77]):
        feeds["kvl"] = np.asarray(lengths, np.int32)
        got = run_identical(gpu_device, (on, off), feeds, ["out"])["out"]
        assert np.isfinite(got).all()
        if lengths[0] == 0:
            assert not got[0].any()  # a row with no key writes zeros


def test_where_it_applies():
    """Whisper's encoder self-attention (1500 keys, 16-entry tiles: 8 vec4 registers a
    thread) prefetches on the H200's limits, unsplit and in the chunks of its key split (the
    default there); SmolLM2's 128-token forward
    (32-entry tiles: 16 registers) and a one-tile stream do not; the switch turns it off."""

    def fwd(lq, lk, d):
        b = GraphBuilder()
        q, k, v = (b.input(n, (1, 6, n_, d)) for n, n_ in (("q", lq), ("k", lk), ("v", lk)))
        b.output("o", F.scaled_dot_product_attention(q, k, v))
        return compile(b.build(), CompileOptions(), H200_LIMITS)

    split = _prefetching(fwd(1500, 1500, 64))
    assert [n.split(" ", 1)[1] for n in split] == ["scaled_dot_product_attention fwd split 3x504"]
    attention_splits.set_long_split(False)
    try:
        assert _prefetching(fwd(1500, 1500, 64))
    finally:
        attention_splits.set_long_split(True)
    assert not _prefetching(fwd(128, 128, 64))
    assert not _prefetching(fwd(64, 16, 64))
    lane_stream.set_prefetch(False)
    assert not _prefetching(fwd(1500, 1500, 64))


def _training(qs, ks, causal):
    b = GraphBuilder()
    q, k, v = b.parameter("q", qs), b.parameter("k", ks), b.parameter("v", ks)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=qs[1] != ks[1])
    b.output("loss", F.sum(out * b.input("r", out.shape)))
    options = CompileOptions(loss="loss", optimizer=SGD(lr=0.0), output_grads=True)
    return compile(b.build(), options, H200_LIMITS)


# Whisper's forward and dq split their keys (splits.choose_long_split, tuned.TUNED_SPLIT): the
# forward's chunks prefetch, dq's do not (measured so)
WHISPER_FWD = {
    "fwd+lse split 3x504": "k+v",
    "merge 3": "",
    "dq+delta split 3x504": "",
    "dq+delta sum 3": "",
}
# (workload, plan.FUSE_KEY_VALUE, plan.DKV_HALF) -> {attention dispatch: prefetched segments}
# on the H200's limits, 8 vec4 registers a thread each (none for SmolLM2's dv)
H200_SEGMENTS = {
    # Whisper's encoder (1 x 6 x 1500 x 64): dk and dv 32 rows x 2 lanes, 16-entry tiles (4 +
    # 4 + 1 registers: the stats are copied between the barriers); dkv half's 16-entry tiles:
    # q and dO, also in the chunks of its query split (dkv_half.choose_query_split)
    ("whisper", None, None): {**WHISPER_FWD, "dkv half split 3x512": "q+g", "dkv half sum 3": ""},
    ("whisper", None, False): {**WHISPER_FWD, "dk": "q+g", "dv": "q+g"},
    # the lane dkv keeps k, v, dk and dv in one thread: no prefetch registers on top
    ("whisper", True, False): {**WHISPER_FWD, "dkv": ""},
    # SmolLM2 (9 / 3 heads x 128, causal): the tuned plans; dkv half's measured query split
    # (tuned.TUNED_QUERY_SPLIT: 8 chunks of 16 rows); dk 2 x 32 with 32-entry tiles (q: 8
    # registers), dv 4 x 16 with 64-entry tiles (q: 16, none); the lane dkv none
    ("smollm2", None, None): {
        "fwd+lse": "k+v",
        "dq+delta": "k+v",
        "dkv half split 8x16": "q+g",
        "dkv half sum 8": "",
    },
    ("smollm2", None, False): {"fwd+lse": "k+v", "dq+delta": "k+v", "dkv": ""},
    ("smollm2", False, None): {"fwd+lse": "k+v", "dq+delta": "k+v", "dk": "q", "dv": ""},
}


@pytest.mark.parametrize("key", H200_SEGMENTS, ids=lambda k: f"{k[0]}_{k[1]}_{k[2]}")
def test_which_training_kernels_prefetch_on_h200_limits(monkeypatch, key):
    """Compile only: the segments each attention kernel of Whisper's and SmolLM2's training
    steps prefetches on the H200 (default, dk and dv apart, lane dkv); none with the switch
    off."""
    workload, fuse, half = key
    monkeypatch.setattr(attention_plan, "FUSE_KEY_VALUE", fuse)
    monkeypatch.setattr(attention_plan, "DKV_HALF", half)
    shapes = {"whisper": ((1, 6, 1500, 64), (1, 6, 1500, 64), False),
              "smollm2": ((1, 9, 128, 64), (1, 3, 128, 64), True)}  # fmt: skip
    assert _segments(_training(*shapes[workload])) == H200_SEGMENTS[key]
    lane_stream.set_prefetch(False)
    assert not any(_segments(_training(*shapes[workload])).values())


@pytest.mark.gpu
def test_dkv_half_16_entry_tiles_same_bits(gpu_device, monkeypatch):
    """dkv half's 16-entry query tiles (the default since the H200 timed them faster) prefetch
    q and dO (4 + 4 registers) at Whisper's shape; 32-entry tiles (``set_short_tiles(False)``,
    the lever's switch) q only, as q and dO would take 16; the gradients are the same bits
    either way (the same entries, in steps of ``UNROLL``)."""
    from meganeura.codegen.wgsl.attention import dkv_half
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    monkeypatch.setattr(attention_plan, "DKV_HALF", True)
    monkeypatch.setattr(dkv_half, "QUERY_SPLIT", [False])  # one kernel at Whisper's shape
    whisper = ((1, 6, 1500, 64), (1, 6, 1500, 64), False)
    assert dkv_half.TILE == 16
    assert _segments(_training(*whisper))["dkv half"] == "q+g"
    monkeypatch.setattr(dkv_half, "TILE", 16)  # restored after the test
    dkv_half.set_short_tiles(False)  # the lever's switch (bench/lever_ab.py dkv_half_tile16)
    assert dkv_half.TILE == 32
    assert _segments(_training(*whisper))["dkv half"] == "q"
    qs, ks, dv, causal, masked = CASES["gqa_causal"]
    rng = np.random.default_rng(3)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in zip("qkv", (qs, ks, ks))}
    opt = SGD(lr=0.0)
    feeds = {"r": rng.standard_normal(qs).astype(np.float32), HYPER_INPUT: opt.hyper(0, opt.lr)}
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    got = []
    for tile in (32, 16):
        monkeypatch.setattr(dkv_half, "TILE", tile)
        program = compile(
            graph(qs, ks, dv, causal, masked, out=True), options, device_limits(gpu_device)
        )
        assert any(d.name.endswith("dkv half") for d in program.dispatches)
        with Session(program, gpu_device) as s:
            s.load_state_dict(params)
            got.append(s.run(feeds, ["k.grad", "v.grad"]))
    for name in ("k.grad", "v.grad"):
        np.testing.assert_array_equal(got[0][name], got[1][name], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gqa_causal", "causal_cross"])
def test_split_chunks_prefetch_bit_identical(gpu_device, case, monkeypatch):
    """With ``tile_loads.set_split_prefetch`` (on, the default) the chunks of the split
    forward and dq prefetch their next key tile within their chunk (k and v); outputs and
    gradients are the bits of the chunks that do not."""
    monkeypatch.setattr(attention_splits, "LONG_SPLIT_OVERRIDE", True)
    monkeypatch.setitem(attention_plan.LANE_OVERRIDE, "fwd", (8, 2, 8))
    monkeypatch.setitem(attention_plan.LANE_OVERRIDE, "dq", (8, 2, 8))

    def check(fetching, plain):
        for program, want in ((plain, ""), (fetching, "k+v")):
            split = {k: v for k, v in _segments(program).items() if " split " in k}
            assert len(split) == 2 and set(split.values()) == {want}, split

    run_both(gpu_device, tile_loads.set_split_prefetch, CASES[case], "strict", check, out=True)
    assert tile_loads.SPLIT_PREFETCH == [True]
