"""Op-database entries for the creation family (``meganeura/ops/creation.py``): ``arange``.

arange has no tensor operand, so the entry adds its result to a zero ``x`` of shape [1]
(int or float, which also picks the dtype the addition runs in): the checked value is the
range itself, broadcast through an elementwise kernel (and, mid-graph, produced before it).
The reference is torch.arange in float64 (int64 for integer ranges), so f32 rounding of
non-representable steps is measured, not mirrored.

Samples: one element; 1025 elements (a partial last block of the 1024 a workgroup writes);
the tenths 0.0 .. 0.9 (inexact steps); a negative fractional step; integral float arguments
with an i32 dtype and int arguments with f32; i32 values next to 2^31 with a negative step;
4099 half-integers in f32, the default dtype for float bounds.
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.dtypes import DType
from meganeura.ops.creation import arange

from . import OpInfo, Sample


def _arange(x, start, end, step, dtype=None):
    dt = None if dtype is None else DType(dtype)
    return x + arange(start, end, step, dtype=dt, builder=x.builder)


def _arange_ref(x, start, end, step, dtype=None):
    integer = dtype == "int32" or (dtype is None and not x.is_floating_point())
    return x + torch.arange(start, end, step, dtype=torch.int64 if integer else torch.float64)


def _arange_samples(rng):
    i, f = np.zeros(1, np.int64), np.zeros(1)
    return [
        Sample((i, 0, 1, 1), name="one"),
        Sample((i, -5, 2045, 2), name="i32_1025"),
        Sample((f, 0.0, 1.0, 0.1), name="tenths"),
        Sample((f, 5, -3.5, -0.75), name="negative_step"),
        Sample((i, -3.0, 3, 2.0), {"dtype": "int32"}, name="i32_integral_floats"),
        Sample((f, -3, 4, 2), {"dtype": "float32"}, name="f32_int_args"),
        Sample((i, 2**31 - 2, 2**31 - 3000, -7), name="i32_near_max"),
        Sample((f, 0.5, 4099.5, 1), name="f32_4099"),
    ]


ENTRIES = [
    OpInfo("arange", _arange, _arange_ref, _arange_samples, ("arange",), differentiable=False),
]
