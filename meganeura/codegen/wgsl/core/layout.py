"""Index math shared by the emitters: strides, coalescing, flat offsets, grids, thread slots.

All index math is u32 with shapes and strides baked in (divisions by constants). A 1-D logical
grid of G workgroups is folded into up to three dimensions of at most
``limits.max_workgroups_per_dimension`` each; shaders rebuild the linear id and drop the
padding groups (``linear_workgroup``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ...kernel import Limits
from .literals import u

WG = 256  # default workgroup size: WebGPU guarantees 256 invocations per workgroup
# Elements per thread in one-thread-per-element kernels. Issuing the loads of several elements
# before any store lets each thread keep more memory requests in flight: a 64M-element f32
# add ran at 0.81 TB/s with one element per thread and 1.43 TB/s with four (H200, Vulkan).
PER_THREAD = 4


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def broadcast_strides(src: Sequence[int], out: Sequence[int]) -> tuple[int, ...]:
    """Strides to read a contiguous ``src`` broadcast (NumPy rule) to ``out``; 0 on new dims."""
    st = contiguous_strides(src)
    pad = len(out) - len(src)
    return tuple(0 if d < pad or src[d - pad] == 1 else st[d - pad] for d in range(len(out)))


def coalesce(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop size-1 dims and merge neighbours that every stride list walks contiguously.

    Fewer dims means fewer divisions per element; the flat iteration order is unchanged.
    """
    dims = [(n, [s[d] for s in strides]) for d, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            if all(p == q * n for p, q in zip(pst, st, strict=True)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    out_shape = tuple(n for n, _ in merged)
    return out_shape, [tuple(st[k] for _, st in merged) for k in range(len(strides))]


def strided_index(flat: str, shape: Sequence[int], strides: Sequence[int]) -> str:
    """u32 expression of the offset of flat row-major index ``flat`` over ``shape``, read
    with ``strides`` (shape and strides baked in, so divisions are by constants)."""
    terms, inner, total = [], 1, math.prod(shape)
    flat = flat if flat.isidentifier() else f"({flat})"
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and s != 0:
            coord = flat if inner == 1 else f"({flat} / {u(inner)})"
            if inner * n < total:
                coord = f"({coord} % {u(n)})"
            terms.append(coord if s == 1 else f"{coord} * {u(s)}")
        inner *= n
    return " + ".join(reversed(terms)) or "0u"


# ---- grid -------------------------------------------------------------------------------------
def fold_grid(groups: int, limits: Limits) -> tuple[int, int, int]:
    """Spread ``groups`` workgroups over (x, y, z) within the per-dimension limit.

    Raises:
        ValueError: when even three dimensions cannot hold them.
    """
    m = limits.max_workgroups_per_dimension
    x = max(1, min(groups, m))
    y = max(1, min(-(-groups // x), m))
    z = -(-groups // (x * y))
    if z > m:
        raise ValueError(f"{groups} workgroups exceed a {m}^3 grid")
    return (x, y, max(z, 1))


def linear_workgroup(groups: int, grid: tuple[int, int, int]) -> str:
    """Statements defining ``wg``, the linear workgroup id, and dropping padding groups.

    The early return depends only on workgroup-uniform builtins, so barriers after it stay in
    uniform control flow.
    """
    x, y, z = grid
    if y == 1 and z == 1:
        return "  let wg = wid.x;\n"
    expr = "wid.x + nwg.x * wid.y" if z == 1 else "wid.x + nwg.x * (wid.y + nwg.y * wid.z)"
    check = "" if x * y * z == groups else f"  if (wg >= {u(groups)}) {{ return; }}\n"
    return f"  let wg = {expr};\n{check}"


def element_slots(
    n: int, per_thread: int = PER_THREAD
) -> tuple[str, int, Callable[[int, str], str]]:
    """Scaffolding for kernels that map ``per_thread`` elements (or vec4s) to each thread.

    Element ``e`` of a thread is ``i{e}`` (block of ``per_thread * WG`` per workgroup, strided
    by ``WG`` so each load instruction of a warp stays coalesced); ``j{e}`` is the same id
    clamped into range, safe to read from even in the last, partial block.

    Returns:
        (statements defining i0.. and j0.., workgroup count, guard) where
        ``guard(e, stmt)`` wraps a store of element e so it is skipped past the end.
    """
    block = per_thread * WG
    tail = n % block != 0
    lines = [f"  let i0 = wg * {u(block)} + lid;"]
    lines += [f"  let i{e} = i0 + {u(e * WG)};" for e in range(1, per_thread)]
    for e in range(per_thread):
        lines.append(f"  let j{e} = min(i{e}, {u(n - 1)});" if tail else f"  let j{e} = i{e};")

    def guard(e: int, stmt: str) -> str:
        return f"if (i{e} < {u(n)}) {{ {stmt} }}" if tail else stmt

    return "\n".join(lines) + "\n", -(-n // block), guard


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
