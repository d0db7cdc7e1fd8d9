"""scaled_dot_product_attention with ``dropout_p > 0`` beyond the op database (no GPU): the
graph it builds, its argument checks, and its value on the NumPy interpreter in float64
against PyTorch's math formula with the same keep mask, including unbatched input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.ops.attention import SDPA, scaled_dot_product_attention

from ..opinfo.attention import sdpa_dropout_math

SEED = 4242


def _build(shapes, **kw):
    b = GraphBuilder()
    qkv = [b.input(n, s) for n, s in zip("qkv", shapes)]
    seed = b.input("seed", (), DType.u32)
    out = scaled_dot_product_attention(*qkv, seed=seed, **kw)
    b.output("out", out)
    return b, out


def test_dropout_builds_the_explicit_path_and_no_dropout_the_fused_op():
    shapes = [(1, 2, 3, 4)] * 3
    ops = {n.op for n in _build(shapes, dropout_p=0.25)[0].build().nodes}
    assert "dropout" in ops and "softmax" in ops and SDPA not in ops
    b = GraphBuilder()
    q = b.input("q", (1, 2, 3, 4))
    b.output("out", scaled_dot_product_attention(q, q, q, dropout_p=0.0))
    assert SDPA in {n.op for n in b.build().nodes}


CASES = {
    "plain": ([(2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3)], {}),
    "causal_gqa": (
        [(1, 4, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4)],
        dict(is_causal=True, enable_gqa=True),
    ),
    "unbatched_scale": ([(2, 3, 4), (2, 5, 4), (2, 5, 4)], dict(scale=0.7)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_interpreted_value_matches_torch_math_with_the_same_mask(case):
    shapes, kw = case
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s) for s in shapes]
    b, out = _build(shapes, dropout_p=0.4, **kw)
    feeds = dict(zip("qkv", arrays), seed=np.uint32(SEED))
    vals, _, _ = interpret(b.build(), feeds, float64=True)
    tq, tk, tv = (torch.from_numpy(a) for a in arrays)
    unbatched = tq.ndim == 3
    if unbatched:
        tq, tk, tv = (t[None] for t in (tq, tk, tv))
    causal, scale = kw.get("is_causal", False), kw.get("scale")
    ref = sdpa_dropout_math(tq, tk, tv, None, 0.4, causal, scale, SEED).numpy()
    np.testing.assert_allclose(vals[out.id], ref[0] if unbatched else ref, rtol=1e-12, atol=1e-12)


def test_missing_seed_names_the_argument():
    b = GraphBuilder()
    q = b.input("q", (1, 1, 2, 4))
    with pytest.raises(ValueError, match="needs seed="):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="needs seed="):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1, seed=b.input("s", (), DType.i32))


def test_dropout_p_outside_unit_interval_raises():
    b = GraphBuilder()
    q = b.input("q", (1, 1, 2, 4))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        scaled_dot_product_attention(q, q, q, dropout_p=1.5)


def test_bad_shapes_raise_the_fused_ops_error():
    b = GraphBuilder()
    q, k = b.input("q", (1, 2, 3, 4)), b.input("k", (1, 2, 5, 8))
    seed = b.input("seed", (), DType.u32)
    with pytest.raises(GraphTypeError, match="key must be"):
        scaled_dot_product_attention(q, k, k, dropout_p=0.5, seed=seed)
