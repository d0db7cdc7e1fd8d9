"""Attention with a runtime key count (``kv_length``): every kernel plan (the lane kernel and
each register-tiled block plan) against torch SDPA on the kept keys with an explicit
lower-right mask; the key loop's runtime bound in the WGSL; the type rule, the argument
errors and the refused gradient (the last three need no GPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention.plan import BLOCK_PLANS
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.nn.attention import causal_lower_right, causal_upper_left
from meganeura.ops import functional as F
from meganeura.ops.attention import scaled_dot_product_attention

from ..ids import plan_id
from ..opinfo.attention import _sdpa_kv_ref
from .harness import run

rng = np.random.default_rng(29)
B, HQ, HKV, D = 2, 9, 3, 64


def _graph(lq, lk, causal, mask_shape=None):
    b = GraphBuilder()
    q = b.input("q", (B, HQ, lq, D))
    k, v = b.input("k", (B, HKV, lk, D)), b.input("v", (B, HKV, lk, D))
    kvl = b.input("kvl", (B,), DType.i32)
    mask = b.input("mask", mask_shape, DType.bool) if mask_shape else None
    out = scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, enable_gqa=True, kv_length=kvl
    )
    b.output("out", out)
    return b.build(), out.id


@pytest.fixture
def force_plan():
    saved = dict(attention_plan.BLOCK_OVERRIDE)
    yield lambda plan: attention_plan.BLOCK_OVERRIDE.update({"fwd": plan})
    attention_plan.BLOCK_OVERRIDE.clear()
    attention_plan.BLOCK_OVERRIDE.update(saved)


CASES = {
    # name: (Lq, Lk, causal, lengths, left padding of sequence 0 or None)
    "decode": (1, 70, True, [33, 70], None),
    "decode_no_causal": (1, 70, False, [1, 45], None),
    "chunk_causal": (6, 70, True, [40, 19], None),
    "chunk_left_pad": (4, 40, True, [12, 30], 3),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("plan", [None, *BLOCK_PLANS], ids=plan_id)
def test_kernels_against_torch_on_the_kept_keys(case, plan, force_plan):
    force_plan(plan)
    lq, lk, causal, lengths, pad = CASES[case]
    mask = None
    if pad is not None:  # sequence 0's first slots are padding: masked by a bool mask
        mask = np.ones((B, 1, 1, lk), bool)
        mask[0, ..., :pad] = False
    graph, out = _graph(lq, lk, causal, None if mask is None else mask.shape)
    feeds = {
        "q": rng.standard_normal((B, HQ, lq, D)).astype(np.float32),
        "k": rng.standard_normal((B, HKV, lk, D)).astype(np.float32),
        "v": rng.standard_normal((B, HKV, lk, D)).astype(np.float32),
        "kvl": np.array(lengths, np.int32),
    }
    # keys past the lengths hold NaN: a kernel that read them would give NaN
    for b, n in enumerate(lengths):
        feeds["k"][b, :, n:] = np.nan
        feeds["v"][b, :, n:] = np.nan
    if mask is not None:
        feeds["mask"] = mask
    got = run(graph, feeds).values[out]
    t = {n: torch.from_numpy(feeds[n]).double() for n in "qkv"}
    m = None if mask is None else torch.from_numpy(mask)
    want = _sdpa_kv_ref(t["q"], t["k"], t["v"], torch.tensor(lengths), m, is_causal=causal)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-5, atol=2e-6)


def test_the_key_loop_stops_at_the_runtime_length():
    graph, out = _graph(1, 4096, True)
    (ks,) = lower(graph, out, _limits())
    assert "let kvl = min(u32(max(g_kvlen[b], 0i)), 4096u);" in ks.wgsl
    assert "s0 < s_end" in ks.wgsl and "4096u);" in ks.wgsl


def _limits():
    from meganeura.codegen.kernel import Limits

    return Limits(max_workgroup_storage_size=32768, max_invocations_per_workgroup=256,
                  max_storage_buffer_binding_size=2**27)  # fmt: skip


def test_kv_length_type_rule_and_argument_errors():
    b = GraphBuilder()
    q, k = b.input("q", (2, 4, 3, 8)), b.input("k", (2, 2, 9, 8))
    with pytest.raises(GraphTypeError, match=r"kv_length must be i32\[\] or i32\[2\]"):
        scaled_dot_product_attention(
            q, k, k, enable_gqa=True, kv_length=b.input("n3", (3,), DType.i32)
        )
    with pytest.raises(GraphTypeError, match=r"kv_length must be i32, got f32\[2\]"):
        scaled_dot_product_attention(q, k, k, enable_gqa=True, kv_length=b.input("nf", (2,)))
    seed = b.constant(1, DType.u32)
    with pytest.raises(ValueError, match="kv_length is not supported with dropout_p > 0"):
        scaled_dot_product_attention(q, k, k, None, 0.5, enable_gqa=True, kv_length=4, seed=seed)
    with pytest.raises(ValueError, match="takes the place of is_causal and kv_length"):
        scaled_dot_product_attention(q, k, k, causal_lower_right(3, 9), is_causal=True,
                                     enable_gqa=True)  # fmt: skip
    with pytest.raises(ValueError, match="for Lq=3 and Lk=9"):
        scaled_dot_product_attention(q, k, k, causal_lower_right(3, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="lengths must be positive"):
        causal_lower_right(0, 4)


def test_causal_biases_match_torch():
    from torch.nn.attention.bias import causal_lower_right as torch_lr
    from torch.nn.attention.bias import causal_upper_left as torch_ul

    for lq, lk in [(3, 9), (9, 3), (4, 4)]:
        ours = causal_lower_right(lq, lk).to_bool()
        with warnings.catch_warnings():  # torch warns of NaN rows for Lq > Lk (ours: zeros)
            warnings.simplefilter("ignore", UserWarning)
            theirs = torch_lr(lq, lk)._materialize().numpy()
        np.testing.assert_array_equal(ours, theirs)
        ours = np.asarray(causal_upper_left(lq, lk))
        np.testing.assert_array_equal(ours, torch_ul(lq, lk)._materialize().numpy())


def test_causal_lower_right_becomes_a_constant_kv_length():
    b = GraphBuilder()
    q, k = b.input("q", (1, 2, 3, 8)), b.input("k", (1, 2, 9, 8))
    out = scaled_dot_product_attention(q, k, k, causal_lower_right(3, 9))
    node = b.nodes[out.id]
    assert node.attr("is_causal") is True and len(node.inputs) == 4
    kvl = b.nodes[node.inputs[3]]
    assert kvl.op == "constant" and kvl.attr("value") == 9
    upper = scaled_dot_product_attention(q, k, k, causal_upper_left(3, 9))
    assert len(b.nodes[upper.id].inputs) == 3 and b.nodes[upper.id].attr("is_causal") is True


def test_differentiating_attention_with_kv_length_is_refused():
    b = GraphBuilder()
    q = b.parameter("q", (1, 2, 1, 8))
    k = b.parameter("k", (1, 2, 5, 8))
    n = b.input("n", (), DType.i32)
    out = scaled_dot_product_attention(q, k, k, is_causal=True, kv_length=n)
    b.output("loss", F.sum(out))
    with pytest.raises(ValueError, match="attention with kv_length= has no gradient"):
        differentiate(b.build(), "loss", ["q", "k"])
