"""Index maps of the normalization kernels: which elements form a group, which weight each
element uses, and the transposed view (all elements of one channel) the weight gradient sums.

A ``Layout`` describes ``count`` sequences of ``length`` elements; WGSL helper functions
``<prefix>_off(grp, k)`` (flat offset of element k of sequence grp) and ``<prefix>_aux(grp, k)``
(the channel of that element for group layouts, its group for channel layouts) are emitted
with every shape baked in, so the kernels share one body for every norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ....ops.norm_ref import group_dims
from ..core.literals import u


@dataclass(frozen=True)
class Layout:
    """``count`` sequences of ``length`` elements.

    Attributes:
        offset: WGSL expression of the flat offset, in terms of u32 ``grp`` and ``k``.
        aux: WGSL expression (same variables) of the element's channel (group layouts) or of
            its statistics group (channel layouts).
        contiguous: whether consecutive ``k`` are (mostly) adjacent in memory, so one
            workgroup per sequence reads coalesced; else neighbouring sequences are adjacent.
    """

    count: int
    length: int
    offset: str
    aux: str
    contiguous: bool

    def helpers(self, prefix: str) -> str:
        return (
            f"fn {prefix}_off(grp: u32, k: u32) -> u32 {{ return {self.offset}; }}\n"
            f"fn {prefix}_aux(grp: u32, k: u32) -> u32 {{ return {self.aux}; }}\n"
        )


def _div(a: str, n: int) -> str:
    return a if n == 1 else f"({a} / {u(n)})"


def _mod(a: str, n: int) -> str:
    return "0u" if n == 1 else f"({a} % {u(n)})"


def _mul(a: str, n: int) -> str:
    if a == "0u" or n == 0:
        return "0u"
    return a if n == 1 else f"{a} * {u(n)}"


def _sum(*terms: str) -> str:
    kept = [t for t in terms if t != "0u"]
    return " + ".join(kept) if kept else "0u"


def _nchw(shape: tuple[int, ...]) -> tuple[int, int, int]:
    return shape[0], shape[1], math.prod(shape[2:])


def group_layout(shape: tuple[int, ...], kind: str, attrs) -> Layout:
    """The groups normalized together; ``aux`` is the element's channel (weight index)."""
    count, length, _ = group_dims(shape, kind, attrs)
    if kind in ("layer_norm", "rms_norm"):
        return Layout(count, length, _sum(_mul("grp", length), "k"), "k", True)
    n, c, s = _nchw(shape)
    if kind == "group_norm":
        cg = c // attrs["num_groups"]
        chan = _sum(_mul(_mod("grp", attrs["num_groups"]), cg), _div("k", s))
        return Layout(count, length, _sum(_mul("grp", length), "k"), chan, True)
    off = _sum(_mul(_div("k", s), c * s), _mul("grp", s), _mod("k", s))
    return Layout(count, length, off, "grp", s > 1)


def channel_layout(shape: tuple[int, ...], kind: str, attrs) -> Layout:
    """All elements of each channel; ``aux`` is the element's group (statistics index)."""
    _, _, wshape = group_dims(shape, kind, attrs)
    if kind in ("layer_norm", "rms_norm"):
        n = math.prod(wshape)
        rows = math.prod(shape) // n if n else 0
        return Layout(n, rows, _sum(_mul("k", n), "grp"), "k", n == 1)
    n, c, s = _nchw(shape)
    off = _sum(_mul(_div("k", s), c * s), _mul("grp", s), _mod("k", s))
    if kind == "group_norm":
        g = attrs["num_groups"]
        stat = _sum(_mul(_div("k", s), g), _div("grp", c // g))
        return Layout(c, n * s, off, stat, s > 1)
    return Layout(c, n * s, off, "grp", s > 1)
