"""Grid folding: every lowering under a tiny per-dimension limit, and a real > 65535-group grid."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from .harness import check, device_limits, run

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(3)


def test_every_lowering_folds_under_a_tiny_limit():
    b = GraphBuilder()
    x = b.input("x", (70, 600))
    row = b.input("row", (600,))
    t = b.input("t", (300,), DType.i32)
    logits = b.input("logits", (300, 100))
    hyper = b.input("hyper", (2,))
    outs = {
        "tanh": F.tanh(x) + row,
        "permute": F.permute(x, (1, 0)),
        "broadcast": F.broadcast_to(row, (70, 600)),
        "rowsum": F.sum(x, 1),
        "colmean": F.mean(x, 0, keepdim=True),
        "amax": F.amax(x),
        "softmax1": F.softmax(x, 1),
        "softmax0": F.log_softmax(x, 0),
        "bmm": b.input("a", (300, 5, 5)) @ b.input("w", (5, 7)),
        "mm": F.permute(x, (1, 0)) @ x,
        "ce": F.cross_entropy(logits, t),
    }
    for k, v in outs.items():
        b.output(k, v)
    g1 = b.constant(1.0)
    attrs = {"ignore_index": -100, "reduction": "mean"}
    b.output("ce_grad", b.add("cross_entropy_backward", [logits, t, g1], attrs))
    p = b.parameter("p", (70, 600))
    sgd = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    b.add("sgd_update", [p, x, hyper, g1], sgd)
    graph = b.build_unverified()
    target = rng.integers(0, 100, 300).astype(np.int32)
    target[::5] = -100
    feeds = {
        "x": rng.standard_normal((70, 600)).astype(np.float32),
        "row": rng.standard_normal(600).astype(np.float32),
        "t": target,
        "logits": rng.standard_normal((300, 100)).astype(np.float32),
        "hyper": np.array([0.1, 1.0], np.float32),
        "a": rng.standard_normal((300, 5, 5)).astype(np.float32),
        "w": rng.standard_normal((5, 7)).astype(np.float32),
    }
    # 7: vec4 maps over the 42000 elements of x use only 11 workgroups
    limits = dataclasses.replace(device_limits(), max_workgroups_per_dimension=7)
    res = check(graph, feeds, {"p": rng.standard_normal((70, 600)).astype(np.float32)},
                rtol=1e-4, limits=limits)  # fmt: skip
    assert all(max(k.grid) <= 7 for k in res.kernels)
    folded = {k.name.split()[1] for k in res.kernels if k.grid[1] > 1}
    assert folded >= {
        "add",
        "tanh",
        "permute",
        "broadcast_to",
        "sum",
        "softmax",
        "log_softmax",
        "matmul",
        "cross_entropy",
        "cross_entropy_backward",
        "sgd_update",
    }
    assert any(k.grid[2] > 1 for k in res.kernels)  # three-dimensional folds too


def test_more_than_65535_workgroups():
    # One thread per output row: 65539 workgroups of 256 (elementwise kernels take 4 elements
    # per thread, so they would need a tensor over lavapipe's 128 MiB binding limit).
    n = 65535 * 256 + 1000
    b = GraphBuilder()
    x = b.input("x", (n, 1))
    s = b.output("s", F.sum(x, 1))
    y = b.output("y", x * 2.0 + 1.0)
    graph = b.build()
    xs = (np.arange(n, dtype=np.float32) % 1024).reshape(n, 1)
    res = run(graph, {"x": xs})
    (k,) = [k for k in res.kernels if k.name.startswith(f"%{s.id} ")]
    assert k.grid == (65535, 2, 1)
    np.testing.assert_array_equal(res.values[s.id], xs[:, 0])
    np.testing.assert_array_equal(res.values[y.id], xs * 2 + 1)
