"""vec4 loads in reductions over one contiguous run (``reduce._vec4_fold``): which reductions
take them, and their values against float64 NumPy for short rows, long rows, whole tensors split
into chunks (two dispatches), integer sums and maxima."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from ..ids import dims_id, flag_id, shape_id
from .harness import run

RNG = np.random.default_rng(9)


VEC4_REDUCTIONS = [
    ((7, 8), -1, "sum", True),  # 2 units per row: one thread per row
    ((5, 1028), -1, "mean", True),  # workgroup per row, partial unit loop
    ((3, 4, 20), (1, 2), "amax", True),  # two reduced dims merge into one run of 80
    ((2**21,), None, "sum", True),  # whole tensor: chunks, then a combining pass
    ((6, 6), -1, "sum", False),  # run of 6
    ((8, 16), 0, "sum", False),  # strided rows
]


@pytest.mark.parametrize(
    "shape,dim,op,vec",
    VEC4_REDUCTIONS,
    ids=[
        f"{op}-{shape_id(s)}-{dims_id(d)}-{flag_id('vec4', v)}" for s, d, op, v in VEC4_REDUCTIONS
    ],
)
def test_vec4_reductions(shape, dim, op, vec):
    b = GraphBuilder()
    x = b.input("x", shape)
    y = getattr(F, op)(x, dim)
    b.output("y", y)
    g = b.build()
    ks = lower(g, y.id, Limits())
    assert ("fn h4" in ks[0].wgsl) is vec
    xs = (RNG.standard_normal(shape) + 0.25).astype(np.float32)
    got = run(g, {"x": xs}).values[y.id]
    axis = None if dim is None else dim
    ref = {"sum": np.sum, "mean": np.mean, "amax": np.max}[op](xs.astype(np.float64), axis=axis)
    tol = 1e-6 * np.abs(xs.astype(np.float64)).sum(axis=axis).max() / max(1, xs.size / ref.size)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=max(tol, 1e-6))


def test_integer_sum_and_max_exact():
    b = GraphBuilder()
    x = b.input("x", (9, 64), DType.i32)
    s, m = F.sum(x, -1), F.amax(x, -1)
    b.output("s", s)
    b.output("m", m)
    g = b.build()
    assert "vec4<i32>" in lower(g, s.id, Limits())[0].wgsl
    xs = RNG.integers(-(10**6), 10**6, (9, 64)).astype(np.int32)
    got = run(g, {"x": xs})
    np.testing.assert_array_equal(got.values[s.id], xs.sum(-1))
    np.testing.assert_array_equal(got.values[m.id], xs.max(-1))
