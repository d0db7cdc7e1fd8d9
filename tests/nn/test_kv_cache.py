"""A KV cache as PyTorch code writes it, through the whole pipeline on the GPU (lavapipe on CI):
a module whose cache Buffers ``index_copy_`` writes in place and whose attention reads the
written cache in the same program (``kv_length``, lower-right causal, GQA 9/3, D 64), compiled
for a prefill and a decode signature that share the cache; the cache read back against NumPy
and the attention against torch SDPA on the kept keys with an explicit lower-right mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import i32
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import Module
from meganeura.nn.compiled import SignatureError
from meganeura.ops.inplace import index_copy_
from meganeura.runtime import InputError, Session

pytestmark = pytest.mark.gpu

B, HQ, HKV, MAX_LEN, D = 2, 9, 3, 24, 64
rng = np.random.default_rng(7)


class CachedAttention(Module):
    """Writes this step's keys and values at ``pos`` and attends over the first
    ``kv_length[b]`` cache slots of each sequence, causally (lower-right)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", np.zeros((B, HKV, MAX_LEN, D), np.float32))
        self.register_buffer("v_cache", np.zeros((B, HKV, MAX_LEN, D), np.float32))

    def forward(self, q, k, v, pos, kv_length):
        self.k_cache.index_copy_(2, pos, k)  # PyTorch style: the result is not kept
        v_all = F.index_copy_(self.v_cache, 2, pos, v)  # functional style
        return F.scaled_dot_product_attention(
            q, self.k_cache, v_all, is_causal=True, enable_gqa=True, kv_length=kv_length
        )


def _reference(q, k_cache, v_cache, kv_length):
    """torch SDPA per sequence on its first kv_length[b] keys, lower-right causal mask."""
    lq = q.shape[2]
    out = []
    for b in range(B):
        n = int(kv_length[b])
        keep = torch.arange(n)[None, :] <= n - lq + torch.arange(lq)[:, None]
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q[b : b + 1]),
                torch.from_numpy(k_cache[b : b + 1, :, :n]),
                torch.from_numpy(v_cache[b : b + 1, :, :n]),
                attn_mask=keep,
                enable_gqa=True,
            )[0].numpy()
        )
    return np.stack(out)


def _step(t):
    return [rng.standard_normal((B, h, t, D)).astype(np.float32) for h in (HQ, HKV, HKV)]


def test_prefill_then_decode_share_the_cache(gpu_device):
    m = CachedAttention()
    c = mn.compile(m)
    k_ref = np.zeros((B, HKV, MAX_LEN, D), np.float32)
    v_ref = np.zeros_like(k_ref)

    prompt = 5
    q, k, v = _step(prompt)
    # int64 positions (np.arange's default) are accepted for the i32 input
    pos = np.arange(prompt)
    lengths = np.array([prompt, prompt], np.int32)
    out = c(q, k, v, pos, lengths)
    k_ref[:, :, :prompt], v_ref[:, :, :prompt] = k, v
    np.testing.assert_allclose(out, _reference(q, k_ref, v_ref, lengths), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(m.k_cache.numpy(), k_ref)
    np.testing.assert_array_equal(m.v_cache.numpy(), v_ref)

    for step in range(3):  # decode: one row per run, the write persisting across runs
        at = prompt + step
        q, k, v = _step(1)
        lengths = np.array([at + 1, at + 1], np.int32)
        out = c(q, k, v, np.array([at], np.int32), lengths)
        k_ref[:, :, at : at + 1], v_ref[:, :, at : at + 1] = k, v
        want = _reference(q, k_ref, v_ref, lengths)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
    assert c.cache_info().misses == 2  # one prefill and one decode program, one cache
    np.testing.assert_array_equal(m.k_cache.numpy(), k_ref)
    np.testing.assert_array_equal(m.v_cache.numpy(), v_ref)

    # the decode program binds the cache in place: no intermediate as large as one cache
    entry = c.precompile(q, k, v, np.array([0], np.int32), lengths)
    program = entry.runner.program
    cache_bytes = k_ref.nbytes
    intermediate = [b.size for b in program.buffers if b.role == "intermediate"]
    assert sum(intermediate) < cache_bytes, intermediate

    # a chunk after the cache (Lq 3 > 1), sequences of different lengths
    q, k, v = _step(3)
    lengths = np.array([prompt + 6, prompt + 4], np.int32)
    out = c(q, k, v, np.array([8, 9, 10], np.int32), lengths)
    k_ref[:, :, 8:11], v_ref[:, :, 8:11] = k, v
    np.testing.assert_allclose(out, _reference(q, k_ref, v_ref, lengths), rtol=2e-5, atol=2e-6)


def test_out_of_range_position_is_refused_before_anything_runs(gpu_device):
    m = CachedAttention()
    q, k, v = _step(1)
    lengths = np.array([1, 1], np.int32)
    m(q, k, v, np.array([0], np.int32), lengths)
    before = m.k_cache.numpy()
    with pytest.raises(InputError, match=r"'pos'.*index 24 .*outside \[0, 24\).*index_copy_"):
        m(q, k * 2, v, np.array([MAX_LEN], np.int32), lengths)
    with pytest.raises(SignatureError, match="pos: int64 values outside the int32 range"):
        m(q, k * 2, v, np.array([2**32]), lengths)
    np.testing.assert_array_equal(m.k_cache.numpy(), before)


def test_an_index_computed_on_the_gpu_out_of_range_writes_nothing(gpu_device):
    b = GraphBuilder()
    cache = b.state("cache", (2, 6, 3))
    pos = b.input("pos", (2,), i32)
    src = b.input("src", (2, 2, 3))
    # pos - 3 is computed in the graph: not range-checked on the host
    new = index_copy_(cache, 1, pos - b.constant(3, i32), src)
    b.output("y", new * 1.0)
    program = compile(b.build(), CompileOptions())
    start = rng.standard_normal((2, 6, 3)).astype(np.float32)
    with Session(program, gpu_device) as sess:
        sess.write("cache", start)
        src_v = rng.standard_normal((2, 2, 3)).astype(np.float32)
        # row 2 is written; -1 and 6 are out of range: nothing else changes
        y = sess.run({"pos": np.array([5, 2], np.int32), "src": src_v}, "y")["y"]
        want = start.copy()
        want[:, 2] = src_v[:, 0]
        np.testing.assert_array_equal(y, want)
        y = sess.run({"pos": np.array([9, 2], np.int32), "src": src_v}, "y")["y"]
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(sess.read("cache"), want)
