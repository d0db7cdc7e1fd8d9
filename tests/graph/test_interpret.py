"""The NumPy interpreter: float64 mode keeps float64 through every floating op (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.dtypes import f16, f32
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.ops import functional as F


def test_float64_mode_keeps_float64():
    b = GraphBuilder()
    x = b.input("x", (3,))
    y = F.exp(x) * 3.0
    b.output("y", y)
    xv = np.array([0.1, 0.2, 0.3]) + 1e-12
    vals, _, _ = interpret(b.build(), {"x": xv}, float64=True)
    assert vals[y.id].dtype == np.float64
    np.testing.assert_array_equal(vals[y.id], np.exp(xv) * 3.0)
    vals32, _, _ = interpret(b.build(), {"x": xv})
    assert vals32[y.id].dtype == np.float32


@pytest.mark.parametrize("dtype", [f32, f16])
def test_float64_mode_floating_cast_keeps_float64(dtype):
    b = GraphBuilder()
    x = b.input("x", (3,))
    c = b.add("cast", [x], {"dtype": dtype.value})
    b.output("c", c)
    xv = np.array([0.1, 0.2, 0.3]) + 1e-12
    vals, _, _ = interpret(b.build(), {"x": xv}, float64=True)
    np.testing.assert_array_equal(vals[c.id], xv)
