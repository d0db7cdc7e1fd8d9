"""Creation ops: tensors made from attributes alone, with no tensor operand (PyTorch's
"creation ops"); so far ``arange``.

``arange`` (attrs ``start``, ``step``, ``size``, ``dtype``) is ``out[i] = start + i * step``
for ``0 <= i < size``, computed in the result's dtype, as PyTorch's CUDA kernel does:
  * i32: exact integer arithmetic (the builder rejects ranges whose values leave i32);
  * f32: ``f32(start) + f32(i) * f32(step)``, rounded after the product and after the sum
    (a backend may fuse them into one rounding). PyTorch's CPU kernel accumulates in double
    and rounds once; the two agree exactly when ``i * step`` and the sum are exact in f32
    (integer-valued ranges below 2^24, steps like 0.5), and otherwise differ by at most
    ``ulp(max(|start|, |i * step|))``.
The length follows torch.arange: ``ceil((end - start) / step)`` in float64. The op has one
elementwise kernel that reads nothing, and no gradient (there is nothing to differentiate).
Its values stay f32 in the fast precision mode (``passes.precision``): indices and
coordinates past 2048 are not integers in f16.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import DType
from ..graph.builder import GraphBuilder, Tensor, current_builder
from ..graph.ir import TensorType
from .registry import OpDef, ShapeError

ARANGE_DTYPES = (DType.f32, DType.i32)
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_F32_MAX = float(np.finfo(np.float32).max)


def _arange_type(types, attrs):
    if types:
        raise ShapeError(f"takes no operands, got {len(types)}")
    dtype, size = DType(attrs["dtype"]), attrs["size"]
    if dtype not in ARANGE_DTYPES:
        raise ShapeError(f"dtype must be f32 or i32, got {dtype}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ShapeError(f"size must be a positive int, got {size!r}")
    start, step = attrs["start"], attrs["step"]
    if dtype is DType.f32:
        if not all(type(v) is float and math.isfinite(v) for v in (start, step)):
            raise ShapeError(f"f32 start and step must be finite floats, got {start!r}, {step!r}")
        last = start + (size - 1) * step
        if max(abs(start), abs(step), abs(last)) > _F32_MAX:
            raise ShapeError(f"values {start} .. {last} (step {step}) do not fit f32")
    else:
        if not all(type(v) is int for v in (start, step)):
            raise ShapeError(f"i32 start and step must be ints, got {start!r}, {step!r}")
        last = start + (size - 1) * step
        if not (_I32_MIN <= min(start, last) and max(start, last) <= _I32_MAX):
            raise ShapeError(f"values {start} .. {last} do not fit i32")
    return TensorType((size,), dtype)


def arange_np(attrs) -> np.ndarray:
    """The NumPy reference of ``arange``, in the same arithmetic as the kernel."""
    dtype, n = DType(attrs["dtype"]), attrs["size"]
    if dtype is DType.i32:
        return (attrs["start"] + np.arange(n, dtype=np.int64) * attrs["step"]).astype(np.int32)
    i = np.arange(n, dtype=np.float32)
    return np.float32(attrs["start"]) + i * np.float32(attrs["step"])


DEFS = [
    OpDef("arange", _arange_type, lambda xs, a: arange_np(a), differentiable=False, arity=0),
]


def _length(start: float, end: float, step: float) -> int:
    """torch.arange's element count, ``ceil((end - start) / step)`` in float64."""
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    if (end - start) * step < 0:
        raise ValueError(
            f"arange: upper bound and lower bound inconsistent with step sign "
            f"(start={start}, end={end}, step={step})"
        )
    if all(isinstance(v, int) for v in (start, end, step)):
        return -((start - end) // step)
    return math.ceil((float(end) - float(start)) / float(step))


def arange(
    start: float = 0,
    end: float | None = None,
    step: float = 1,
    *,
    dtype: DType | None = None,
    builder: GraphBuilder | None = None,
) -> Tensor:
    """``[start, start + step, ...]`` up to but excluding ``end`` (torch.arange).

    ``arange(n)`` is ``0 .. n - 1``. The values are computed on the GPU by the op's kernel
    (see the module docstring for the f32 arithmetic); nothing is uploaded.

    Args:
        start: first value (or, with ``end`` None, the end and start 0).
        end: exclusive bound.
        step: nonzero increment, negative for a decreasing range.
        dtype: ``f32`` or ``i32``; default, as torch's: f32 when any of start, end, step is a
            float, else i32 (meganeura's integer type; torch would give int64). An i32 range
            needs integral bounds (``2.0`` is accepted): with fractional ones torch's length
            and values depend on the integer width (``arange(-2.7, 3, 1.9)`` has 4 elements
            as int32 and 5 as int64), so there is no behaviour to match.
        builder: the graph to add the op to; default ``current_builder()`` (set by a tracing
            layer with ``meganeura.graph.builder.use_builder``).

    Returns:
        1-D tensor of ``ceil((end - start) / step)`` elements.

    Raises:
        ValueError: step 0, a step whose sign points away from ``end``, an empty range
            (meganeura has no empty tensors), or no builder.
        TypeError: a dtype other than f32/i32, non-numeric bounds, or fractional bounds for
            i32.
        GraphTypeError: values outside the dtype's range.
    """
    if end is None:
        start, end = 0, start
    for name, v in (("start", start), ("end", end), ("step", step)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise TypeError(f"arange: {name} must be a number, got {v!r}")
    start, end, step = (v.item() if isinstance(v, np.generic) else v for v in (start, end, step))
    if dtype is None:
        dtype = DType.f32 if any(isinstance(v, float) for v in (start, end, step)) else DType.i32
    if dtype not in ARANGE_DTYPES:
        raise TypeError(f"arange: dtype must be f32 or i32, got {dtype!r}")
    if not all(math.isfinite(v) for v in (start, end, step)):
        raise ValueError(f"arange: bounds must be finite, got {start}, {end}, {step}")
    if dtype is DType.i32:
        if not all(float(v).is_integer() for v in (start, end, step)):
            raise TypeError(
                f"arange: an i32 range needs integral bounds, got {start}, {end}, {step}"
            )
        start, end, step = int(start), int(end), int(step)
    size = _length(start, end, step)
    if size < 1:
        raise ValueError(f"arange({start}, {end}, {step}) is empty; empty tensors are unsupported")
    if dtype is DType.f32:
        start, step = float(start), float(step)
    b = builder if builder is not None else current_builder()
    if b is None:
        raise ValueError(
            "arange has no tensor operand to take its graph from: pass builder=, or call it "
            "where a builder is current (meganeura.graph.builder.use_builder)"
        )
    attrs = {"start": start, "step": step, "size": size, "dtype": dtype.value}
    return b.add("arange", [], attrs)
