"""One dispatch for a ``passes.rope_cache`` group: one or two ``apply_rotary_emb`` of the same
positions, the ``index_copy_`` cache writes of their results, and further ``index_copy_``
writes of the same slots (the values).

One thread per unit of work, the units laid end to end: the (row, frequency) pairs of each
rotation, then the elements of each further copy. A rotation thread computes its pair as
``rope.lower_rope`` does (the same exact angle reduction, ``rope.ROPE_HELPERS``), stores it
where the rotation is read outside the group and writes it into its cache at
``index[t]`` along the copy's dim; a copy thread moves one element. As ``index_copy_``'s own
kernel (``indexing.gather.lower_index_copy``), a row whose index is outside the cache is not
written.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ....graph.ir import Graph
from ....ops.inplace import INDEX_COPY
from ....passes.fuse import FusionGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src, check_numel
from ..core.layout import WG
from ..core.literals import f32_literal, u
from .rope import ROPE_HELPERS, rope_turns

OP_NAME = "rope_cache"  # the op token of the kernel's name (profiles)


def _collapse(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def _cache_store(
    kb: KernelBuilder, graph: Graph, copy: int, cache: str, index: Src, elem: str, val: str
) -> str:
    """Statement writing ``val``, element ``elem`` (a u32 expression) of copy ``copy``'s
    source, into its cache; skipped for an out-of-range index."""
    node = graph[copy]
    elem = f"({elem})"
    b_, c_, a_ = _collapse(graph[node.inputs[0]].type.shape, node.attr("dim"))
    k_ = graph[node.inputs[1]].type.numel
    t = elem if a_ == 1 else f"{elem} / {u(a_)}"
    if b_ > 1:
        t = f"({t} % {u(k_)})"
    row = "slot" if b_ == 1 else f"({elem} / {u(k_ * a_)}) * {u(c_)} + slot"
    dst = row if a_ == 1 else f"({row}) * {u(a_)} + {elem} % {u(a_)}"
    return (
        f"{{ let slot = u32({index.at(t)}); "
        f"if (slot < {u(c_)}) {{ {kb.store(cache, dst, val)} }} }}"
    )


def lower_rope_cache(
    graph: Graph, group: FusionGroup, limits: Limits, deferred=None
) -> list[KernelSource]:
    """The one dispatch of a ``plan_rope_cache`` group, named
    ``%<member>+<member>... rope_cache``; ``deferred``: split-K products (q, k, v) read as the
    sums of their partials (``attention.summed``).

    Raises:
        ValueError: for a bound value of 2^31 elements or more, or larger than one storage
            binding (as the members' own kernels would).
    """
    members = group.members
    for m in members:
        for i in graph[m].inputs:
            check_numel(graph, i, limits)
        check_numel(graph, m, limits)
    ropes = [m for m in members if graph[m].op != INDEX_COPY]
    copies = [m for m in members if graph[m].op == INDEX_COPY]
    own = {graph[c].inputs[2]: c for c in copies if graph[c].inputs[2] in ropes}
    extra = [c for c in copies if graph[c].inputs[2] not in ropes]
    first = graph[ropes[0]]
    dim = first.type.shape[-1]
    half = dim // 2
    kb = KernelBuilder(graph, graph[group.sink], limits, deferred)
    offset = kb.read(first.inputs[1], "offset") if len(first.inputs) > 1 else None
    base = u(first.attr("position_offset"))
    sign = "-" if first.attr("inverse") else ""

    lines = [f"  let gid = wg * {u(WG)} + lid;"]
    start = 0
    for k, r in enumerate(ropes):
        node = graph[r]
        length = node.type.shape[-2]
        pairs = node.type.numel // 2
        x = kb.read(node.inputs[0], f"x{k}")
        out = kb.write(r, f"rot{k}") if r in group.outputs else None
        if offset is None:
            pos = base
        elif offset.type.numel > 1:  # one first position per batch row
            rows_per_batch = node.type.numel // node.type.shape[0] // dim
            pos = f"{base} + bitcast<u32>({offset.at(f'row / {u(rows_per_batch)}')})"
        else:
            pos = f"{base} + bitcast<u32>({offset.at('0u')})"
        stores = []
        if out is not None:  # at a storage offset: the rotation may be placed in a permute's
            stores += [
                f"let io = {kb.row_offset(out, 'row', dim)} + f;",
                kb.store(out, "io", "ya", offset=True),
                kb.store(out, f"io + {u(half)}", "yb", offset=True),
            ]
        if r in own:
            c = own[r]
            cache = kb.write(graph[c].inputs[0], f"cache{k}")
            index = kb.read(graph[c].inputs[1], f"index{k}")
            stores += [
                _cache_store(kb, graph, c, cache, index, "ia", "ya"),
                _cache_store(kb, graph, c, cache, index, f"ia + {u(half)}", "yb"),
            ]
        cond = f"gid < {u(start + pairs)}"
        lines += [
            f"  {'if' if k == 0 else '} else if'} ({cond}) {{",
            f"    let p = gid - {u(start)};",
            f"    let row = p / {u(half)};",
            f"    let f = p % {u(half)};",
            f"    let a = rope_cos_sin({pos} + row % {u(length)}, TURNS[f]);",
            f"    let ia = row * {u(dim)} + f;",
            f"    let xo = {x.row_offset('row')} + f;",
            f"    let xa = {x.at_offset('xo')};",
            f"    let xb = {x.at_offset(f'xo + {u(half)}')};",
            "    let c = a.x;",
            f"    let s = {sign}a.y;",
            "    let ya = xa * c - xb * s;",
            "    let yb = xb * c + xa * s;",
            *[f"    {s}" for s in stores],
        ]
        start += pairs
    for k, c in enumerate(extra):
        node = graph[c]
        n = graph[node.inputs[2]].type.numel
        src = kb.read(node.inputs[2], f"source{k}")
        cache = kb.write(node.inputs[0], f"vcache{k}")
        index = kb.read(node.inputs[1], f"vindex{k}")
        lines += [
            f"  }} else if (gid < {u(start + n)}) {{",
            f"    let e = gid - {u(start)};",
            f"    {_cache_store(kb, graph, c, cache, index, 'e', src.at('e'))}",
        ]
        start += n
    lines.append("  }")
    table = ", ".join(f"vec2<u32>({hi}u, {lo}u)" for hi, lo in rope_turns(dim, first.attr("theta")))
    helpers = (
        f"const TWO_PI_2M32 = {f32_literal(2 * math.pi / 2**32)};\n"
        f"const TURNS = array<vec2<u32>, {half}>({table});\n" + ROPE_HELPERS
    )
    rot_pairs = sum(graph[r].type.numel // 2 for r in ropes)
    nbytes = sum(2 * graph[r].type.nbytes for r in ropes)
    nbytes += sum(2 * graph[graph[c].inputs[2]].type.nbytes for c in extra)
    groups = -(-start // WG)
    ks = kb.finish("", "\n".join(lines), WG, groups, helpers, 40 * rot_pairs, nbytes)
    name = "%" + "+".join(str(m) for m in members) + f" {OP_NAME}"
    return [replace(ks, name=name)]
