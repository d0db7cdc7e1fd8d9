"""Readable, deterministic pytest ids for parameters pytest cannot name itself.

Without ``ids=`` pytest names a tuple, list, dict or function parameter ``argname<index>``
(``shape0``, ``<lambda>3``), which says nothing, and it names bytes by their content, which for
random bytes differs between collections (pytest-xdist then refuses to run). These helpers
name such values by what they are: ``shape_id((3, 1, 5)) == "3x1x5"``.
"""

from __future__ import annotations

from collections.abc import Iterable


def shape_id(shape: Iterable[int]) -> str:
    """``(3, 1, 5)`` -> ``"3x1x5"``; ``()`` -> ``"scalar"``."""
    dims = [str(d) for d in shape]
    return "x".join(dims) if dims else "scalar"


def shapes_id(*shapes: Iterable[int]) -> str:
    """Two or more shapes joined by ``_``: ``((3, 1), (4,))`` -> ``"3x1_4"``."""
    return "_".join(shape_id(s) for s in shapes)


def dims_id(dims: int | Iterable[int] | None) -> str:
    """The dims a reduction or scan runs over: ``1`` and ``(1,)`` -> ``"dim1"``, ``-1`` ->
    ``"dim-1"``, ``(0, 2)`` -> ``"dims0_2"``, ``None`` -> ``"all"``."""
    if dims is None:
        return "all"
    if isinstance(dims, int):
        return f"dim{dims}"
    dims = [str(d) for d in dims]
    return f"dim{dims[0]}" if len(dims) == 1 else "dims" + "_".join(dims)


def plan_id(plan: Iterable[int] | None) -> str:
    """An attention block plan tuple (rows, tile, row_threads, lanes): ``(64, 32, 16, 8)`` ->
    ``"block64x32x16x8"``; ``None`` (the lane kernel) -> ``"lane"``."""
    return "lane" if plan is None else "block" + "x".join(str(p) for p in plan)


def attention_dims_id(dims) -> str:
    """An attention ``Dims``: ``b1-hkv6x1-l1500x1500-d64x64`` (batch, kv heads x query heads
    per kv head, query x key lengths, head dims of q/k x v)."""
    return f"b{dims.b}-hkv{dims.hkv}x{dims.group}-l{dims.lq}x{dims.lk}-d{dims.d}x{dims.dv}"


def flag_id(name: str, on: bool) -> str:
    """A boolean parameter by name: ``flag_id("causal", True) == "causal"``, else
    ``"no_causal"`` (pytest would write a bare ``True``/``False``)."""
    return name if on else f"no_{name}"
