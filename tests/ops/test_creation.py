"""``arange`` beyond the op database (no GPU): its length and default dtype follow
torch.arange over a sweep of bounds, its builder comes from ``builder=`` or the current
builder, and each invalid call raises the error its docstring names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError, use_builder
from meganeura.graph.interpret import interpret
from meganeura.ops.creation import arange

CASES = {
    "n7": (7,),
    "n1": (1,),
    "ints_step3": (2, 20, 3),
    "ints_negative": (10, -11, -4),
    "float_end": (2.5,),
    "tenths": (0.0, 1.0, 0.1),
    "thirds_exclusive": (0, 1, 1 / 3),
    "negative_fraction": (1, 0.0, -0.3),
    "large_float": (1e6, 1e6 + 100, 7.5),
    "numpy_scalars": (np.int32(3), np.float32(4.5)),
}


def _values(t) -> np.ndarray:
    b = t.builder
    b.output("out", t)
    vals, _, _ = interpret(b.build(), {})
    return vals[t.id]


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_length_dtype_and_values_follow_torch(args):
    ref = torch.arange(*args)
    got = _values(arange(*args, builder=GraphBuilder()))
    assert got.shape == tuple(ref.shape)
    assert got.dtype == (np.float32 if ref.dtype.is_floating_point else np.int32)
    ref64 = torch.arange(*args, dtype=torch.float64).numpy()
    np.testing.assert_allclose(got, ref64, rtol=1e-6, atol=1e-6 * np.abs(ref64).max())


def test_f32_values_are_start_plus_i_times_step_in_f32():
    got = _values(arange(0.1, 3.0, 0.7, builder=GraphBuilder()))
    i = np.arange(got.size, dtype=np.float32)
    np.testing.assert_array_equal(got, np.float32(0.1) + i * np.float32(0.7))


def test_i32_range_next_to_the_top():
    got = _values(arange(2**31 - 1, 2**31 - 20, -6, builder=GraphBuilder()))
    np.testing.assert_array_equal(got, np.array([2**31 - 1, 2**31 - 7, 2**31 - 13, 2**31 - 19]))


def test_current_builder_is_used_without_builder_argument():
    b = GraphBuilder()
    with use_builder(b):
        t = arange(4, dtype=DType.f32)
    assert t.builder is b and t.dtype is DType.f32
    np.testing.assert_array_equal(_values(t), [0.0, 1.0, 2.0, 3.0])


def test_explicit_builder_wins_over_the_current_one():
    b, other = GraphBuilder(), GraphBuilder()
    with use_builder(other):
        assert arange(3, builder=b).builder is b


ERRORS = {
    "no_builder": ((3,), {}, ValueError, "no tensor operand"),
    "step_zero": ((0, 5, 0), {}, ValueError, "step must be nonzero"),
    "wrong_sign": ((0, 5, -1), {}, ValueError, "inconsistent with step sign"),
    "empty": ((3, 3), {}, ValueError, "empty"),
    "fractional_i32": ((0.5, 3), {"dtype": DType.i32}, TypeError, "integral bounds"),
    "u32": ((3,), {"dtype": DType.u32}, TypeError, "f32 or i32"),
    "bool_bound": ((True,), {}, TypeError, "must be a number"),
    "infinite": ((0, float("inf")), {}, ValueError, "finite"),
    "i32_overflow": ((2**31 - 2, 2**31 + 5), {}, GraphTypeError, "do not fit i32"),
    "f32_overflow": ((0.0, 1e300, 1e299), {}, GraphTypeError, "do not fit f32"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_invalid_calls_raise(case):
    args, kwargs, exc, text = case
    if text != "no tensor operand":
        kwargs = {**kwargs, "builder": GraphBuilder()}
    with pytest.raises(exc, match=text):
        arange(*args, **kwargs)
