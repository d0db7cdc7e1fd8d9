"""matmul: awkward shapes, both tilings, batch broadcasting, folded transposes."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.wgsl import matmul, reads
from meganeura.codegen.wgsl.matmul import LARGE, SMALL, choose_tiling
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from .harness import check

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(99)


def _randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(params=[SMALL, LARGE], ids=["64x64", "128x128"])
def tiling(request, monkeypatch):
    """Force one tiling, so both are tested on shapes small enough for lavapipe."""
    monkeypatch.setattr(matmul, "choose_tiling", lambda *args: request.param)
    return request.param


@pytest.mark.parametrize(
    "m,k,n", [(1, 1, 1), (3, 7, 5), (64, 784, 128), (257, 1000, 3), (300, 37, 260), (128, 8, 512)]
)
def test_matmul_shapes(m, k, n, tiling):
    b = GraphBuilder()
    x, w = b.input("x", (m, k)), b.input("w", (k, n))
    b.output("y", x @ w)
    check(b.build(), {"x": _randn(m, k), "w": _randn(k, n)})


def test_large_tiles_only_when_there_are_enough():
    assert choose_tiling(4096, 4096, 4096) is LARGE and choose_tiling(2048, 4096, 8) is LARGE
    assert choose_tiling(1024, 1024, 1024) is SMALL and choose_tiling(257, 3, 1000) is SMALL
    assert choose_tiling(1024, 1024, 64, batch=8) is LARGE


@pytest.mark.parametrize(
    "sa,sb",
    [((2, 3, 5, 6), (6, 4)), ((3, 1, 5, 6), (1, 4, 6, 7)), ((4, 9, 3), (4, 3, 70)),
     ((2, 1, 65, 17), (3, 17, 66)), ((1, 5, 6), (3, 6, 7))],
)  # fmt: skip
def test_batched_broadcast(sa, sb, tiling):
    b = GraphBuilder()
    x, w = b.input("x", sa), b.input("w", sb)
    b.output("y", x @ w)
    check(b.build(), {"x": _randn(*sa), "w": _randn(*sb)})


def test_batch_folds_into_rows_when_b_is_shared():
    b = GraphBuilder()
    x, w = b.input("x", (2, 3, 65, 17)), b.parameter("w", (66, 17))
    y = b.output("y", x @ w.mT)  # a linear layer over a [2, 3, 65] batch
    res = check(b.build(), {"x": _randn(2, 3, 65, 17)}, {"w": _randn(66, 17)})
    (k,) = [k for k in res.kernels if k.name.startswith(f"%{y.id} ")]
    assert k.grid == (7 * 2, 1, 1)  # ceil(390 / 64) x ceil(66 / 64) tiles, not 6 x 2 x 2


def test_transposed_operands_are_folded():
    b = GraphBuilder()
    x = b.input("x", (33, 20))
    w = b.parameter("w", (70, 20))  # PyTorch layout [out, in]
    g = b.input("g", (33, 70))
    y = b.output("y", x @ w.mT)  # linear layer
    gx = b.output("gx", g @ w)
    gw = b.output("gw", g.mT @ x)  # weight gradient: transposed left operand
    both = b.output("both", F.permute(w, (1, 0)).mT @ x.mT)  # (w^T)^T @ x^T = w @ x^T
    graph = b.build()
    assert reads(graph, y.id) == (x.id, w.id)
    assert reads(graph, gw.id) == (g.id, x.id)
    res = check(graph, {"x": _randn(33, 20), "g": _randn(33, 70)}, {"w": _randn(70, 20)})
    for k in res.kernels:
        if k.name.startswith(f"%{y.id} ") or k.name.startswith(f"%{gw.id} "):
            assert all(graph[r.node].op != "permute" for r in k.bindings)
    assert res.values[both.id].shape == (70, 33)
    del gx


def test_batched_transpose_fold_and_same_operand_twice():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 9, 5))
    gram = b.output("gram", x @ x.mT)  # the same value bound once, read two ways
    graph = b.build()
    assert reads(graph, gram.id) == (x.id,)
    res = check(graph, {"x": _randn(2, 3, 9, 5)})
    (k,) = [k for k in res.kernels if k.name.startswith(f"%{gram.id} ")]
    assert len(k.bindings) == 2
