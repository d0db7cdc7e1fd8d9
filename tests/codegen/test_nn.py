"""softmax / log_softmax along any dim, cross_entropy and its backward (ops/loss.py refs)."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import ValueRef
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.loss import cross_entropy_backward_np, cross_entropy_np

from ..ids import dims_id, shape_id
from .harness import check, run

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(5)


@pytest.mark.parametrize("shape", [(7, 300), (300, 7), (3, 80, 5), (2, 3, 4)], ids=shape_id)
@pytest.mark.parametrize("dim", [0, 1, -1], ids=dims_id)
def test_softmax_large_logits(shape, dim):
    b = GraphBuilder()
    x = b.input("x", shape)
    b.output("p", F.softmax(x, dim))
    b.output("lp", F.log_softmax(x, dim))
    xs = (rng.standard_normal(shape) * 100).astype(np.float32)
    res = check(b.build(), {"x": xs})
    assert all(np.isfinite(v).all() for v in res.values)


def _ce_graph(n, c, ignore_index, reduction, g_value=None):
    b = GraphBuilder()
    logits = b.input("logits", (n, c))
    target = b.input("target", (n,), DType.i32)
    loss = b.output("loss", F.cross_entropy(logits, target, ignore_index, reduction))
    g = b.constant(g_value) if g_value is not None else b.input("g", ())
    attrs = {"ignore_index": ignore_index, "reduction": reduction}
    grad = b.output("grad", b.add("cross_entropy_backward", [logits, target, g], attrs))
    return b.build(), loss.id, grad.id


@pytest.mark.parametrize("n,c", [(8, 10), (5, 300), (3, 1)], ids=["8x10", "5x300", "3x1"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [None, -100, 2], ids=["no_ignore", "ignore-100", "ignore2"])
def test_cross_entropy_and_backward(n, c, reduction, ignore):
    graph, loss, grad = _ce_graph(n, c, ignore, reduction)
    logits = (rng.standard_normal((n, c)) * 30).astype(np.float32)
    target = rng.integers(0, c, n).astype(np.int32)
    target[1] = -100 if ignore == -100 else target[1]
    if ignore == 2:
        target[: n // 2] = 2
    feeds = {"logits": logits, "target": target, "g": np.float32(0.75)}
    res = check(graph, feeds)
    attrs = {"ignore_index": ignore, "reduction": reduction}
    np.testing.assert_allclose(
        res.values[loss], cross_entropy_np([logits, target], attrs), rtol=1e-5
    )
    want = cross_entropy_backward_np([logits, target, np.float32(0.75)], attrs)
    np.testing.assert_allclose(res.values[grad], want, rtol=1e-5, atol=1e-7)


def test_all_rows_ignored_gives_zero_loss_and_gradient():
    graph, loss, grad = _ce_graph(4, 6, -100, "mean", g_value=1.0)
    feeds = {"logits": rng.standard_normal((4, 6)).astype(np.float32),
             "target": np.full(4, -100, np.int32)}  # fmt: skip
    res = check(graph, feeds)
    assert res.values[loss] == 0.0 and not res.values[grad].any()
    # g is a constant: inlined, so the row kernel binds only logits, target and its output
    rows = [k for k in res.kernels if k.name == f"%{grad} cross_entropy_backward rows"]
    assert {r.node for r in rows[0].bindings if isinstance(r, ValueRef)} == {0, 1, grad}


def test_many_rows_vocab_sized_classes():
    graph, loss, grad = _ce_graph(40, 5000, -100, "mean", g_value=1.0)
    target = rng.integers(0, 5000, 40).astype(np.int32)
    target[::7] = -100
    logits = (rng.standard_normal((40, 5000)) * 5).astype(np.float32)
    res = run(graph, {"logits": logits, "target": target})
    attrs = {"ignore_index": -100, "reduction": "mean"}
    ref = cross_entropy_np([logits.astype(np.float64), target], attrs)
    np.testing.assert_allclose(res.values[loss], ref, rtol=1e-5)
    want = cross_entropy_backward_np([logits.astype(np.float64), target, 1.0], attrs)
    np.testing.assert_allclose(res.values[grad], want, rtol=1e-4, atol=1e-9)
