"""Element types of the IR: item size, NumPy dtype, WGSL storage type and promotion.

Every value in a graph carries one DType. WGSL has no 8-bit or 64-bit storage in core, so
``bool`` is stored as a 32-bit ``u32`` (0 or 1) on the GPU; its NumPy dtype stays ``bool``.
"""

from __future__ import annotations

import enum

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


f32 = DType.f32
f16 = DType.f16
i32 = DType.i32
u32 = DType.u32
bool_ = DType.bool


def promote(a: DType, b: DType) -> DType:
    """Result dtype of a binary arithmetic op. meganeura does not promote implicitly: both
    operands must agree, as in a typed IR; mixing is an error raised by the caller."""
    if a is not b:
        raise TypeError(f"dtype mismatch: {a} vs {b} (cast one operand explicitly)")
    return a
