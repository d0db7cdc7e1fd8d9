"""Tracing details the layers rely on."""

from __future__ import annotations

import numpy as np

import meganeura.nn as mnn
import meganeura.nn.functional as F
from meganeura.nn.compiled import trace_call

from .harness import interpret_forward


class _AddPositions(mnn.Module):
    def forward(self, x):
        return x + F.arange(x.shape[-1], dtype=x.dtype)


def test_ops_without_tensor_operands_find_the_traced_graph():
    m = _AddPositions()
    x = np.ones((2, 3), np.float32)
    got, _ = interpret_forward(m, [x])
    np.testing.assert_array_equal(got, x + np.arange(3))
    traced = trace_call(m, m.forward, [x], {})
    assert any(n.op == "arange" for n in traced.graph.nodes)
