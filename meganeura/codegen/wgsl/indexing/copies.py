"""WGSL lowerings of the shape/indexing family: ``slice`` (a strided copy), ``pad`` and
``slice_backward`` (one "embed" kernel: each output element reads its source or the fill),
``cat`` (one kernel per group of at most seven operands), and, from ``gather``, the gathers
and their deterministic scatter-add backward ops.

All are one-pass copies, ``PER_THREAD`` output elements per thread, loads before stores, u32
index math with shapes baked in. Every read is in bounds: invalid lanes read element 0 (or a
clamped index) and select the fill instead.
"""

from __future__ import annotations

import math

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, compute_dtype, guarded_read
from ..core.layout import PER_THREAD, WG, coalesce, contiguous_strides, element_slots, strided_index
from ..core.literals import literal, u

# WebGPU guarantees 8 storage buffers per shader stage: seven operands and the output.
MAX_CAT_OPERANDS = 7


def lower_slice(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``out[i] = x[base + strided offset of i]``: the start and steps folded into strides."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    st = contiguous_strides(x.type.shape)
    base = sum(s * k for s, k in zip(node.attr("start"), st))
    strides = tuple(k * p for k, p in zip(st, node.attr("step")))
    shape = node.type.shape
    cshape, (_, cst) = coalesce(shape, [contiguous_strides(shape), strides])
    out = kb.write(node_id, "out")
    slots, groups, guard = element_slots(node.type.numel)
    lines = [slots.rstrip()]
    for e in range(PER_THREAD):
        offset = strided_index(f"j{e}", cshape, cst)
        lines.append(f"  let v{e} = {x.at(f'{u(base)} + {offset}' if base else offset)};")
    lines += [f"  {guard(e, kb.store(out, f'i{e}', f'v{e}'))}" for e in range(PER_THREAD)]
    return [kb.finish("", "\n".join(lines), WG, groups, nbytes=2 * node.type.nbytes)]


def _embed_dims(out_shape, in_shape, lo, step) -> list[tuple[int, int, int, int, int]]:
    """(out size, in size, offset, step, in stride) per dim; size-1 dims that are not padded
    are dropped and neighbouring unpadded dims merged (fewer divisions per element)."""
    st = contiguous_strides(in_shape)
    dims: list[tuple[int, int, int, int, int]] = []
    for big, n, o, s, k in zip(out_shape, in_shape, lo, step, st):
        plain = o == 0 and big == n and (s == 1 or n == 1)
        if plain and big == 1:
            continue
        if plain and dims and _plain(dims[-1]):
            prev = dims[-1]
            dims[-1] = (prev[0] * big, prev[1] * n, 0, 1, k)
            continue
        dims.append((big, n, o, 1 if plain else s, k))
    return dims


def _plain(dim: tuple[int, int, int, int, int]) -> bool:
    big, n, o, s, _ = dim
    return o == 0 and s == 1 and big == n


def _lower_embed(graph, node_id, limits, lo, step, fill) -> list[KernelSource]:
    """``out[c] = x[(c - lo) / step]`` per dim where that is whole and in range, else fill."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    dims = _embed_dims(node.type.shape, x.type.shape, lo, step)
    total = node.type.numel
    out = kb.write(node_id, "out")
    slots, groups, guard = element_slots(total)
    lines = [slots.rstrip()]
    for e in range(PER_THREAD):
        terms, checks, inner = [], [], 1
        for k, dim in reversed(list(enumerate(dims))):
            big, n, o, s, stride = dim
            c = f"j{e}" if inner == 1 else f"(j{e} / {u(inner)})"
            if inner * big < total:
                c = f"({c} % {u(big)})"
            inner *= big
            if _plain(dim):
                terms.append(c if stride == 1 else f"{c} * {u(stride)}")
                continue
            # u32 wraps for coordinates before the data, so one comparison checks both ends
            shift = f"{c} - {u(o)}" if o > 0 else (f"{c} + {u(-o)}" if o < 0 else c)
            lines.append(f"  let t{e}_{k} = {shift};")
            checks.append(f"t{e}_{k} < {u(n * s)}")
            if s > 1:
                checks.append(f"t{e}_{k} % {u(s)} == 0u")
            src = f"t{e}_{k}" if s == 1 else f"(t{e}_{k} / {u(s)})"
            terms.append(src if stride == 1 else f"{src} * {u(stride)}")
        offset = " + ".join(reversed(terms)) or "0u"
        # `&` rather than `&&`: no short-circuit branches in the per-element path
        lines.append(f"  let ok{e} = {' & '.join(f'({c})' for c in checks) or 'true'};")
        lines.append(f"  let v{e} = {guarded_read(x.at, offset, f'ok{e}', fill)};")
    lines += [f"  {guard(e, kb.store(out, f'i{e}', f'v{e}'))}" for e in range(PER_THREAD)]
    nbytes = node.type.nbytes + x.type.nbytes
    return [kb.finish("", "\n".join(lines), WG, groups, nbytes=nbytes)]


def lower_pad(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Constant padding (negative amounts crop): each output reads its source or the value."""
    node = graph[node_id]
    lo = tuple(p[0] for p in node.attr("pad"))
    fill = literal(node.attr("value"), node.type.dtype)
    return _lower_embed(graph, node_id, limits, lo, (1,) * len(lo), fill)


def lower_slice_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """The gradient of a strided slice: output element c along a dim reads g[(c - start) /
    step] when that is whole and in range, else 0. A gather, so no scatter and no atomics."""
    node = graph[node_id]
    zero = literal(0, node.type.dtype)
    return _lower_embed(graph, node_id, limits, node.attr("start"), node.attr("step"), zero)


def lower_cat(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Each kernel fills the band of the output that a group of operands covers along ``dim``;
    element r of a band row picks its operand with a chain of comparisons on r."""
    node = graph[node_id]
    dim, shape = node.attr("dim"), node.type.shape
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    sizes = [graph[i].type.shape[dim] for i in node.inputs]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    kernels = []
    for first in range(0, len(sizes), MAX_CAT_OPERANDS):
        group = range(first, min(first + MAX_CAT_OPERANDS, len(sizes)))
        kb = KernelBuilder(graph, node, limits)
        xs = [kb.read(node.inputs[k], f"x{k}") for k in group]
        out = kb.write(node_id, "out")
        lo = offsets[group[0]]
        row = sum(sizes[k] for k in group) * inner
        total = outer * row
        slots, groups, guard = element_slots(total)
        lines = [slots.rstrip()]
        for e in range(PER_THREAD):
            o = f"(j{e} / {u(row)})" if outer > 1 else "0u"
            r = f"(j{e} % {u(row)})" if outer > 1 else f"j{e}"
            lines.append(f"  let o{e} = {o};\n  let r{e} = {r};")
            lines.append(f"  var v{e}: {compute_dtype(node.type.dtype).wgsl};")
            for pos, (k, x) in enumerate(zip(group, xs)):
                rel, n = (offsets[k] - lo) * inner, sizes[k] * inner
                src = f"o{e} * {u(n)} + r{e}" + (f" - {u(rel)}" if rel else "")
                load = f"{{ v{e} = {x.at(src)}; }}"
                cond = "" if pos == len(xs) - 1 else f"if (r{e} < {u(rel + n)}) "
                lines.append(f"  {'else ' if pos else ''}{cond}{load}")
        for e in range(PER_THREAD):
            dst = f"o{e} * {u(shape[dim] * inner)} + {u(lo * inner)} + r{e}"
            lines.append(f"  {guard(e, kb.store(out, dst, f'v{e}'))}")
        suffix = f"{group[0]}-{group[-1]}" if len(sizes) > MAX_CAT_OPERANDS else ""
        nbytes = 2 * total * node.type.dtype.itemsize
        kernels.append(kb.finish(suffix, "\n".join(lines), WG, groups, nbytes=nbytes))
    return kernels
