"""WGSL literals: exact f32 decimals, wrapped integers, u32 index constants.

Literals never spell inf or NaN (WGSL rejects them, and rejects const-expressions that evaluate
to them): f32 constants are printed as the exact decimal of their float32 value, integers with
an ``i``/``u`` suffix, so a constant inlined in a kernel is bit-identical to the value the graph
holds. A non-finite constant node (``masked_fill(mask, -inf)``) and a zero constant node are
spelled as a call of the ``f32_bits`` helper with their bit pattern, ORed with ``f32_opaque``,
a private variable ``main`` sets to ``nwg.z >> 31u`` (always 0, as no dispatch has 2^31
workgroups, but unknown to the compiler). Why: Mesa (lavapipe) and other drivers apply
"inexact" algebraic rules to SPIR-V from naga (``a * 0.0 -> 0.0``, ``a / 0.0 -> 0.0``), which
is wrong for inf and NaN operands (torch: ``inf * 0 = nan``, ``1 / 0 = inf``); a constant the
compiler cannot see cannot be folded. ``KernelBuilder.finish`` adds the helper and the
variable to every kernel that calls it.
"""

from __future__ import annotations

import math

import numpy as np

from ....dtypes import DType

# The bit pattern of f32 -inf, for tests by bits (compilers may assume floats are finite).
NEG_INF_BITS = "0xff800000u"

F32_BITS = "f32_bits"
F32_OPAQUE = "f32_opaque"
F32_BITS_HELPER = (
    f"var<private> {F32_OPAQUE}: u32;\n\n"
    f"fn {F32_BITS}(b: u32) -> f32 {{\n  return bitcast<f32>(b | {F32_OPAQUE});\n}}"
)
# First statement of ``main`` in kernels that call ``f32_bits``: 0 at run time, opaque to the
# shader compiler (num_workgroups is at most 65535 per dimension).
F32_OPAQUE_INIT = f"  {F32_OPAQUE} = nwg.z >> 31u;\n"


def f32_literal(value: float) -> str:
    """Exact WGSL literal of ``float32(value)``, e.g. ``1.0``, ``1e-06``, ``(-0.5)``.

    Raises:
        ValueError: for inf or NaN, which WGSL cannot spell.
    """
    with np.errstate(over="ignore"):
        v = float(np.float32(value))
    if not math.isfinite(v):
        raise ValueError(f"{value!r} is not a finite float32; WGSL has no inf/NaN literals")
    # repr of the float64 holding a float32 is its exact shortest decimal, so WGSL's
    # abstract-float -> f32 conversion is exact (no second rounding at the range edge).
    text = repr(abs(v))
    if "." not in text and "e" not in text:
        text += ".0"
    return f"(-{text})" if math.copysign(1.0, v) < 0 else text


def int_literal(value: int, dtype: DType) -> str:
    """WGSL literal of an integer in ``dtype`` (i32 wraps like NumPy's astype; bool -> 0u/1u)."""
    if dtype is DType.bool:
        return "1u" if value else "0u"
    if dtype is DType.u32:
        return f"{int(value) % 2**32}u"
    v = int(np.array(value).astype(np.int64).astype(np.int32))
    if v == -(2**31):
        return "(-2147483647i - 1i)"  # 2147483648i alone is out of range
    return f"(-{-v}i)" if v < 0 else f"{v}i"


def nonfinite_f32(value: float) -> str:
    """``f32_bits(0x...u)``: a run-time f32 of ``value``'s bit pattern (inf, -inf, NaN or a
    zero), opaque to the shader compiler."""
    bits = int(np.array(value, np.float32).view(np.uint32))
    return f"{F32_BITS}(0x{bits:08x}u)"


def literal(value: float | int | bool, dtype: DType) -> str:
    """The WGSL spelling of a constant node's value in its dtype (non-finite floats and zeros
    through ``nonfinite_f32``, so the compiler cannot fold ``x * 0.0`` or ``x / 0.0``)."""
    if dtype.is_floating:
        with np.errstate(over="ignore"):
            v = float(np.float32(value))
            if not math.isfinite(v) or v == 0.0:
                return nonfinite_f32(float(value))
        return f32_literal(float(value))
    return int_literal(int(value), dtype)


def zero(dtype: DType) -> str:
    return literal(0, dtype)


def u(n: int) -> str:
    """A u32 literal for index math."""
    return f"{n}u"
