"""Split-key forward attention for short query blocks (flash-decoding, ``attention.decode``):
the split rule, and the two kernels (partials, merge) against float64 torch SDPA with explicit
masks: runtime key counts per sequence, GQA, float and bool masks, lower-right causal, rows
with no key; and bitwise repeatability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.codegen.wgsl.attention import splits as attention_splits
from meganeura.codegen.wgsl.attention.lowering import lower_attention
from meganeura.codegen.wgsl.attention.plan import Dims, choose_plan
from meganeura.codegen.wgsl.attention.splits import Split, choose_split
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops.attention import scaled_dot_product_attention

from ..opinfo.attention import _sdpa_kv_ref, _sdpa_ref
from .harness import run
from .test_attention_kv import H200

SMOLLM2_DECODE = Dims(1, 3, 3, 1, 512, 64, 64)


@pytest.fixture
def split():
    """Set ``SPLIT_OVERRIDE`` (True: split wherever two chunks exist, False: never); restored
    after the test."""
    saved = attention_splits.SPLIT_OVERRIDE

    def force(value):
        attention_splits.SPLIT_OVERRIDE = value

    yield force
    attention_splits.SPLIT_OVERRIDE = saved


# ---- the rule (no GPU) ------------------------------------------------------------------------
def test_smollm2_decode_splits_its_512_slots_only_past_the_key_threshold(monkeypatch):
    # At 512 slots the merge costs more than the split gains on the H200 (plan.py's note).
    assert choose_split(SMOLLM2_DECODE, H200) is None
    monkeypatch.setattr(attention_splits, "SPLIT_MIN_KEYS", 512)
    s = choose_split(SMOLLM2_DECODE, H200)
    plan = choose_plan("fwd", SMOLLM2_DECODE, H200)
    assert s == Split(plan, 16, 32) and plan.tile == 32  # 48 workgroups instead of 3


@pytest.mark.parametrize(
    "dims",
    [
        Dims(1, 3, 3, 128, 512, 64, 64),  # a prefill: Lq > SPLIT_MAX_LQ
        Dims(1, 3, 3, 1, 32, 64, 64),  # one tile of keys
        Dims(64, 3, 3, 1, 512, 64, 64),  # a large batch fills the GPU already
    ],
    ids=["prefill", "one_tile", "batch_64"],
)
def test_no_split_where_it_cannot_help(dims):
    assert choose_split(dims, H200) is None


def test_chunks_are_capped_and_cover_every_key():
    s = choose_split(Dims(1, 1, 1, 1, 100_000, 64, 64), H200)
    assert s.chunks <= attention_splits.SPLIT_MAX_CHUNKS
    assert s.length % s.plan.tile == 0
    assert (s.chunks - 1) * s.length < 100_000 <= s.chunks * s.length


def test_override_forbids_and_forces(split):
    split(False)
    assert choose_split(SMOLLM2_DECODE, H200) is None
    split(True)
    assert choose_split(Dims(1, 3, 3, 128, 512, 64, 64), H200) is not None


def _graph(qs, ks, vs, mask=None, kv_length=None, **kw):
    b = GraphBuilder()
    q, k, v = b.input("q", qs), b.input("k", ks), b.input("v", vs)
    m = None if mask is None else b.input("mask", mask.shape, DType.from_numpy(mask.dtype))
    n = None
    if kv_length is not None:
        n = b.input("n", np.shape(kv_length), DType.i32)
    out = scaled_dot_product_attention(q, k, v, m, kv_length=n, enable_gqa=True, **kw)
    b.output("out", out)
    return b.build(), out.id


def test_kernels_of_a_split_forward(monkeypatch):
    monkeypatch.setattr(attention_splits, "SPLIT_MIN_KEYS", 512)
    graph, nid = _graph((1, 9, 1, 64), (1, 3, 512, 64), (1, 3, 512, 64), None, 0, is_causal=True)
    parts, merge = lower_attention(graph, nid, H200, "fwd")
    assert parts.name.endswith("fwd split 16x32") and parts.grid == (48, 1, 1)
    assert merge.name.endswith("merge 16") and merge.grid == (3, 1, 1)  # 576 outputs
    assert parts.bindings[-1] == merge.bindings[0]  # the same scratch of partial states


# ---- values (GPU) -----------------------------------------------------------------------------
rng = np.random.default_rng(41)


def _pad_mask(b, lk, pads):
    m = np.ones((b, 1, 1, lk), bool)
    for i, p in enumerate(pads):
        m[i, ..., :p] = False
    return m


def _float_mask(shape):
    m = rng.standard_normal(shape)
    m[rng.random(shape) < 0.3] = -np.inf
    return m.astype(np.float32)


CASES = {
    # name: (B, Hq, Hkv, Lq, Lk, D, Dv, mask, kv_length, is_causal)
    "decode_lengths_per_sequence": (2, 9, 3, 1, 300, 64, 64, None, [37, 300], True),
    "decode_left_padded": (2, 9, 3, 1, 200, 64, 64, _pad_mask(2, 200, [5, 70]), [150, 121], True),
    "chunk_of_4_lower_right": (2, 9, 3, 4, 160, 64, 64, None, [100, 33], True),
    "chunk_of_8_not_causal": (1, 4, 2, 8, 129, 16, 8, None, [129], False),
    "lengths_zero_and_one": (2, 3, 3, 1, 96, 8, 8, None, [0, 1], True),
    "float_mask_no_kv_length": (1, 6, 2, 3, 130, 32, 24, _float_mask((1, 6, 3, 130)), None, False),
    "causal_no_kv_length": (1, 2, 1, 5, 70, 16, 16, None, None, True),
}


def _reference(q, k, v, mask, kv_length, causal):
    t = [torch.tensor(x, dtype=torch.float64) for x in (q, k, v)]
    if kv_length is not None:
        m = None if mask is None else torch.tensor(mask)
        n = torch.tensor(np.array(kv_length, np.int64))
        return _sdpa_kv_ref(*t, n, m, is_causal=causal, enable_gqa=True).numpy()
    m = None if mask is None else torch.tensor(mask, dtype=torch.float64)
    return _sdpa_ref(*t, m, is_causal=causal, enable_gqa=True).numpy()  # causal: top-left


def _run(case):
    b, hq, hkv, lq, lk, d, dv, mask, kv_length, causal = CASES[case]
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, lk, dv)).astype(np.float32)
    n = None if kv_length is None else np.array(kv_length, np.int32)
    graph, nid = _graph(q.shape, k.shape, v.shape, mask, n, is_causal=causal)
    feeds = {"q": q, "k": k, "v": v, **({} if mask is None else {"mask": mask})}
    if n is not None:
        feeds["n"] = n
    return run(graph, feeds).values[nid], _reference(q, k, v, mask, kv_length, causal), v


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_split_forward_matches_torch(case, split, gpu_device):
    split(True)
    got, want, v = _run(case)
    assert np.abs(got - want).max() <= 2e-6 * max(np.abs(want).max(), 1.0)
    if case == "lengths_zero_and_one":
        assert not got[0].any()  # no key: zeros
        assert np.array_equal(got[1, :, 0], v[1, :, 0])  # one key: its value, weight exactly 1


@pytest.mark.gpu
def test_split_forward_is_repeatable_bit_for_bit(split, gpu_device):
    split(True)
    state = rng.bit_generator.state
    a, _, _ = _run("decode_left_padded")
    rng.bit_generator.state = state
    b, _, _ = _run("decode_left_padded")
    assert a.tobytes() == b.tobytes()


@pytest.mark.gpu
def test_split_and_plain_kernels_agree(split, gpu_device):
    state = rng.bit_generator.state
    split(True)
    a, want, _ = _run("decode_lengths_per_sequence")
    rng.bit_generator.state = state
    split(False)
    b, _, _ = _run("decode_lengths_per_sequence")
    assert np.abs(a - b).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.gpu
def test_empty_chunks_ignore_whatever_their_scratch_held(split, gpu_device):
    """Chunks past the last key store no output row; their scratch keeps what the buffer
    held before (here NaN, from a value whose buffer the planner gives to the scratch) and
    the merge must not let it in."""
    from meganeura.compile import CompileOptions, compile
    from meganeura.nn import functional as F
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    split(True)
    b = GraphBuilder()
    junk = b.input("junk", (4096,))
    b.output("s", F.sum(junk * 2.0))  # junk * 2.0: an intermediate, dead before attention
    q, k, v = (
        b.input("q", (1, 4, 1, 16)),
        b.input("k", (1, 2, 200, 16)),
        b.input("v", (1, 2, 200, 16)),
    )
    n = b.input("n", (), DType.i32)
    b.output(
        "out", scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, kv_length=n)
    )
    graph = b.build()
    program = compile(graph, CompileOptions(), device_limits(gpu_device))
    (mul,) = [d for d in program.dispatches if d.name.endswith(" mul")]
    (parts,) = [d for d in program.dispatches if " split " in d.name]
    assert parts.bindings[-1] == mul.bindings[-1]  # the scratch reuses the NaN buffer
    feeds = {name: rng.standard_normal(graph[graph.find(name).id].type.shape).astype(np.float32)
             for name in "qkv"}  # fmt: skip
    feeds |= {"junk": np.full(4096, np.nan, np.float32), "n": np.array(20, np.int32)}
    with Session(program, gpu_device) as sess:
        got = sess.run(feeds, ["out"])["out"]
    want = _reference(feeds["q"], feeds["k"], feeds["v"], None, [20], True)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
