"""The vec4 path of elementwise maps (``maps.emit_map`` and unanchored fusion groups).

Four consecutive output elements form one vec4; each thread handles ``VEC_PER_THREAD`` vec4s
(strided by the workgroup size, so every load instruction of a warp reads consecutive 16-byte
words) and issues all of its loads before any store. Wider accesses cut the number of memory
instructions four-fold, which is what lets a memory-bound map approach copy bandwidth on large
GPUs; the arithmetic stays scalar (each component runs the same expression as the scalar path),
so results are bit-identical to it.

Taken only when it is exact: the element count is a multiple of 4 and, after coalescing, every
operand is either laid out like the output, or contiguous along the innermost dim (whose size is
a multiple of 4) with all outer strides multiples of 4 (a bias of the last dim, a row of a
matrix broadcast over rows), or constant along the innermost dim (a per-row scale: one scalar
load shared by the four components), or a literal. One value read in two different ways
(vec4 and splat) also falls back. Integer and bool values take the path too (vec4<i32>,
vec4<u32>); f16 storage is widened and narrowed by ``KernelBuilder.load``/``store``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ....dtypes import DType
from ..core.builder import KernelBuilder, Src, compute_dtype
from ..core.layout import coalesce, contiguous_strides, element_slots, strided_index

# vec4s per thread. Four (16 elements) keeps four 16-byte loads per operand in flight per
# thread; bench/bandwidth.py sweeps it.
VEC_PER_THREAD = 4
# Benchmarks set this False to measure the scalar path; kernels are identical otherwise.
ENABLED = True
_LANES = ("x", "y", "z", "w")


@dataclass(frozen=True)
class VecRead:
    """How one operand is read for vec4 q: ``kind`` is ``"vec"`` (a vec4 load at
    ``index(q)``), ``"splat"`` (one scalar at ``index(q)`` for all four components) or
    ``"literal"``."""

    kind: str
    index: Callable[[str], str] | None = None


def plan_vec4(
    shape: Sequence[int], srcs: Sequence[Src], strides: Sequence[Sequence[int]]
) -> list[VecRead] | None:
    """The vec4 reads of every operand of a map over ``shape``, or None when the scalar path
    must be used.

    Args:
        shape: the iteration (output) shape, row-major.
        srcs: the operands (bound, or literals).
        strides: per operand, its strides over ``shape`` (0 on broadcast dims).
    """
    n = math.prod(shape)
    if not ENABLED or n == 0 or n % 4 or any(s.summed is not None for s in srcs):
        return None  # (a sum of split-K partials is read element by element)
    live = [k for k, s in enumerate(srcs) if s.literal is None]
    cshape, cst = coalesce(shape, [contiguous_strides(shape)] + [strides[k] for k in live])
    if not cshape or cshape[-1] % 4:
        return None
    qshape = (*cshape[:-1], cshape[-1] // 4)
    ident = cst[0]
    reads: list[VecRead] = [VecRead("literal")] * len(srcs)
    kinds: dict[str, str] = {}
    for k, st in zip(live, cst[1:], strict=True):
        if st == ident:
            read = VecRead("vec", lambda q: q)
        elif st[-1] == 1 and all(s % 4 == 0 for s in st[:-1]):
            qst = (*(s // 4 for s in st[:-1]), 1)
            read = VecRead("vec", lambda q, qst=qst: strided_index(q, qshape, qst))
        elif st[-1] == 0:
            qst = (*st[:-1], 0)
            read = VecRead("splat", lambda q, qst=qst: strided_index(q, qshape, qst))
        else:
            return None
        name = srcs[k].name or ""
        if kinds.setdefault(name, read.kind) != read.kind:
            return None  # one binding cannot be both array<vec4<T>> and array<T>
        reads[k] = read
    return reads


def emit_vec4(
    kb: KernelBuilder,
    n: int,
    srcs: Sequence[Src],
    reads: Sequence[VecRead],
    compute: Callable[[list[str]], str],
    outs: Sequence[tuple[str, str, DType]],
) -> tuple[str, int]:
    """Body of a vec4 map over ``n`` elements (a multiple of 4), workgroups of ``WG``.

    Args:
        kb: the kernel's builder; operands and outputs must already be bound through it.
        srcs, reads: the operands and how each is read (from ``plan_vec4``).
        compute: given one WGSL expression per operand (one scalar component), statements
            defining the output values.
        outs: (output binding, name of its value in ``compute``'s statements, dtype).

    Returns:
        (statements, workgroup count).
    """
    n4 = n // 4
    for s, r in zip(srcs, reads, strict=True):
        if r.kind == "vec":
            kb.vectorize(s.name)
    for var, _, _ in outs:
        kb.vectorize(var)
    slots, groups, guard = element_slots(n4, VEC_PER_THREAD)
    lines = [slots.rstrip()]
    for k, (s, r) in enumerate(zip(srcs, reads, strict=True)):
        if r.kind == "literal":
            continue
        for e in range(VEC_PER_THREAD):
            idx = r.index(f"j{e}")
            load = kb.load(s.name, idx) if r.kind == "vec" else s.at(idx)
            lines.append(f"  let a{k}_{e} = {load};")
    for e in range(VEC_PER_THREAD):
        for o, (_, _, dt) in enumerate(outs):
            lines.append(f"  var r{o}_{e}: vec4<{compute_dtype(dt).wgsl}>;")
        for lane in _LANES:
            loads = []
            for k, (s, r) in enumerate(zip(srcs, reads, strict=True)):
                loads.append(
                    s.literal
                    if r.kind == "literal"
                    else f"a{k}_{e}" + (f".{lane}" * (r.kind == "vec"))
                )
            sets = " ".join(f"r{o}_{e}.{lane} = {v};" for o, (_, v, _) in enumerate(outs))
            lines.append(f"  {{ {compute(loads)} {sets} }}")
        stores = " ".join(kb.store(var, f"i{e}", f"r{o}_{e}") for o, (var, _, _) in enumerate(outs))
        lines.append("  " + guard(e, stores))
    return "\n".join(lines), groups
