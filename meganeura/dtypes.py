"""Element types of the IR: item size, NumPy dtype, WGSL storage type and promotion.

Every value in a graph carries one DType. WGSL has no 8-bit or 64-bit storage in core, so
``bool`` is stored as a 32-bit ``u32`` (0 or 1) on the GPU; its NumPy dtype stays ``bool``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np


class DType(enum.Enum):
    """A tensor element type. Values are the names PyTorch and NumPy use."""

    f32 = "float32"
    f16 = "float16"
    i32 = "int32"
    u32 = "uint32"
    bool = "bool"

    @property
    def itemsize(self) -> int:
        """Bytes per element in GPU storage (bool is stored as u32)."""
        return 2 if self is DType.f16 else 4

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.value)

    @property
    def wgsl(self) -> str:
        """The WGSL scalar type used for storage of this dtype."""
        return {"float32": "f32", "float16": "f16", "int32": "i32", "uint32": "u32", "bool": "u32"}[
            self.value
        ]

    @property
    def is_floating(self) -> bool:
        return self in (DType.f32, DType.f16)

    @property
    def is_integer(self) -> bool:
        return self in (DType.i32, DType.u32)

    def __repr__(self) -> str:
        return f"meganeura.{self.name}"

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def from_numpy(dtype: np.dtype | type | str) -> DType:
        """Map a NumPy dtype to a DType.

        Raises:
            TypeError: for dtypes meganeura does not store (float64, int64, ...).
        """
        d = np.dtype(dtype)
        for t in DType:
            if t.numpy == d:
                return t
        raise TypeError(
            f"dtype {d} has no meganeura equivalent (supported: f32, f16, i32, u32, bool)"
        )


def as_dtype(dtype) -> DType:
    """A DType from a DType, a NumPy dtype or its name (``"float32"``); float64 and int64 map
    to f32 and i32, as arrays of them are fed.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(dtype, DType):
        return dtype
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{dtype!r} is not a dtype") from None
    wide = {np.dtype(np.float64): DType.f32, np.dtype(np.int64): DType.i32}
    return wide.get(d) or DType.from_numpy(d)


f32 = DType.f32
f16 = DType.f16
i32 = DType.i32
u32 = DType.u32
bool_ = DType.bool


def _category(t: DType) -> int:
    return 0 if t is DType.bool else 2 if t.is_floating else 1


def promote_types(a: DType, b: DType) -> DType:
    """``torch.promote_types`` on meganeura's dtypes: the higher of the categories bool <
    integer < floating wins (``i32`` with ``f16`` is ``f16``); within floating, ``f32``.

    Raises:
        TypeError: for ``i32`` with ``u32`` (torch gives int64, which meganeura does not
            store).
    """
    if a is b:
        return a
    ca, cb = _category(a), _category(b)
    if ca != cb:
        return a if ca > cb else b
    if ca == 2:
        return DType.f32
    raise TypeError(
        f"{a} and {b} have no common dtype here (torch promotes them to int64, which meganeura "
        "does not store); cast one operand explicitly"
    )


def result_type(
    dims: Sequence[DType] = (), zero_dims: Sequence[DType] = (), scalars: Sequence[DType] = ()
) -> DType:
    """The dtype of an elementwise op on operands of these dtypes, by PyTorch's type
    promotion (https://pytorch.org/docs/stable/tensor_attributes.html#type-promotion-doc):
    tensors with dims, 0-d tensors and Python scalars (``bool_``, ``i32`` for an int, ``f32``
    for a float) are each promoted among themselves; a lower group changes the result only
    when it is of a higher category (``i32`` tensor * 0.5 is ``f32``, ``f16`` tensor * 0.5
    stays ``f16``, a bool tensor + 1 is ``i32``; torch's int64 for Python ints is ``i32``).
    This is ``combine_categories`` of torch's ``ResultTypeState``.

    Raises:
        ValueError: no operand. TypeError: operands without a common dtype (``promote_types``).
    """

    def fold(ts: Sequence[DType]) -> DType | None:
        out = None
        for t in ts:
            out = t if out is None else promote_types(out, t)
        return out

    def combine(higher: DType | None, lower: DType | None) -> DType | None:
        if higher is None or lower is None:
            return lower if higher is None else higher
        if higher.is_floating:
            return higher
        if higher is DType.bool or lower.is_floating:
            return promote_types(higher, lower)
        return higher

    out = combine(fold(dims), combine(fold(zero_dims), fold(scalars)))
    if out is None:
        raise ValueError("result_type of no operand")
    return out
