"""WGSL lowerings of the integer-index gathers and their deterministic scatter-adds.

Forward (``gather``, ``index_select``): one output element per lane, ``PER_THREAD`` per
thread; an index outside ``[0, size)`` (negative i32 values wrap to large u32) reads as zero,
and the load itself uses a clamped index, so nothing is ever read out of bounds.

Backward, without float atomics (so results are bitwise deterministic):
  * ``index_select_backward`` (g [B, K, A] collapsed around ``dim``, index [K] -> [B, C, A];
    also the embedding weight gradient) has two schedules, picked from the shape. Both flag
    matching indices in a workgroup bitmask, a chunk of TW at a time, and let every lane walk
    its set bits in ascending order, summing its columns of those rows of g (``MAX_ACC``
    named accumulators per lane, so one pass covers ``MAX_ACC * TW`` columns; wider rows loop
    over column blocks). A chunk costs TW/32 word reads plus one step per match.
      - C <= K, by target: one workgroup per target c scans all K indices. Cost: C*K index
        tests per column block, plus B*C*A writes and reads of the matched rows of g.
      - C > K (an embedding: large vocabulary, few tokens), by first occurrence: a zero fill
        of the output, then one workgroup per index position t; it returns unless t is the
        first occurrence of its value (a scan of the t earlier indices), then sums the rows
        of all later occurrences into its row. Cost: B*C*A writes (the fill) and at most
        K^2/2 + K^2/2 index tests. W1 (128 tokens, vocabulary 49152, E 576): 113 MB written
        by the fill, ~16K index tests, reads of g once per token.
  * ``gather_backward`` (index varies per element): one output element per lane, looping over
    the ``index.shape[dim]`` entries of its fiber. Cost: numel(out) * index.shape[dim].
Workgroup memory is initialized explicitly, never assumed zero: lavapipe (Mesa 22.3, through
wgpu-native 0.32) hands out workgroup memory holding the previous workgroup's values.
Sums of repeated indices run in index order in f32 (sequentially, not pairwise: a repeat
count is small next to the sizes the pairwise rule is for).
"""

from __future__ import annotations

import math

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent
from ..core.layout import PER_THREAD, WG, coalesce, contiguous_strides, element_slots, strided_index
from ..core.literals import u, zero
from ..elementwise.maps import lower_fill

MAX_ACC = 4  # named accumulators per lane in index_select_backward (columns per block: 4 * TW)


def _collapse(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def _checked(idx: str, size: int) -> tuple[str, str]:
    """(validity test, clamped u32 index) of a raw index expression."""
    return f"{idx} < {u(size)}", f"min({idx}, {u(size - 1)})"


def lower_gather(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``out[i] = x[offset of i's coordinates with dim replaced by index[i]]``."""
    node = graph[node_id]
    dim = node.attr("dim")
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    index = kb.read(node.inputs[1], "index")
    xs = contiguous_strides(x.type.shape)
    base = tuple(0 if d == dim else s for d, s in enumerate(xs))
    shape = node.type.shape
    cshape, (_, cbase) = coalesce(shape, [contiguous_strides(shape), base])
    size = x.type.shape[dim]
    out = kb.write(node_id, "out")
    slots, groups, guard = element_slots(node.type.numel)
    lines = [slots.rstrip()]
    fill = zero(node.type.dtype)
    for e in range(PER_THREAD):
        ok, k = _checked(f"k{e}", size)
        src = f"{strided_index(f'j{e}', cshape, cbase)} + {k} * {u(xs[dim])}"
        lines.append(f"  let k{e} = u32({index.at(f'j{e}')});")
        lines.append(f"  let v{e} = select({fill}, {x.at(src)}, {ok});")
    lines += [f"  {guard(e, kb.store(out, f'i{e}', f'v{e}'))}" for e in range(PER_THREAD)]
    nbytes = 3 * node.type.nbytes
    return [kb.finish("", "\n".join(lines), WG, groups, nbytes=nbytes)]


def lower_gather_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Each output element sums the g entries of its index fiber that point at it."""
    node = graph[node_id]
    dim = node.attr("dim")
    g_t = graph[node.inputs[0]].type
    if g_t.numel == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    kb = KernelBuilder(graph, node, limits)
    g = kb.read(node.inputs[0], "g")
    index = kb.read(node.inputs[1], "index")
    out = kb.write(node_id, "out")
    shape, ishape = node.type.shape, g_t.shape
    ist = contiguous_strides(ishape)
    total = node.type.numel
    lines, terms, inb, inner = [], [], [], 1
    for d in reversed(range(len(shape))):
        c = "i" if inner == 1 else f"(i / {u(inner)})"
        if inner * shape[d] < total:
            c = f"({c} % {u(shape[d])})"
        inner *= shape[d]
        if shape[d] == 1:
            c = "0u"
        lines.append(f"  let c{d} = {c};")
        if d != dim:
            if ishape[d] < shape[d]:
                inb.append(f"c{d} < {u(ishape[d])}")
            if ist[d] and ishape[d] > 1:
                terms.append(f"c{d} * {u(ist[d])}" if ist[d] != 1 else f"c{d}")
    base = " + ".join(reversed(terms)) or "0u"
    # the last group's extra lanes work on a clamped element and store nothing
    body = f"  let lane = wg * {u(WG)} + lid;\n  let i = min(lane, {u(total - 1)});\n"
    body += "\n".join(reversed(lines)) + f"\n  let base = {base};\n  var acc = 0.0;\n"
    loop = (
        f"for (var j = 0u; j < {u(ishape[dim])}; j = j + 1u) {{\n"
        f"  let p = base + j * {u(ist[dim])};\n"
        f"  if (u32({index.at('p')}) == c{dim}) {{ acc = acc + {g.at('p')}; }}\n"
        f"}}\n"
    )
    if inb:
        loop = f"if ({' && '.join(inb)}) {{\n{indent(loop)}}}\n"
    body += indent(loop) + f"  if (lane < {u(total)}) {{ {kb.store(out, 'i', 'acc')} }}\n"
    nbytes = node.type.nbytes + 2 * g_t.nbytes
    flops = total * ishape[dim]
    return [kb.finish("", body, WG, -(-total // WG), flops=flops, nbytes=nbytes)]


def lower_index_select(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``out[b, j, a] = x[b, index[j], a]`` with x collapsed to [B, C, A] around ``dim``."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    index = kb.read(node.inputs[1], "index")
    out = kb.write(node_id, "out")
    b_, c_, a_ = _collapse(x.type.shape, node.attr("dim"))
    k_ = graph[node.inputs[1]].type.numel
    slots, groups, guard = element_slots(node.type.numel)
    lines = [slots.rstrip()]
    fill = zero(node.type.dtype)
    for e in range(PER_THREAD):
        j = f"j{e}" if a_ == 1 else f"(j{e} / {u(a_)})"
        if b_ > 1:
            j = f"({j} % {u(k_)})"
        ok, k = _checked(f"k{e}", c_)
        row = k if b_ == 1 else f"(j{e} / {u(k_ * a_)}) * {u(c_)} + {k}"
        src = row if a_ == 1 else f"({row}) * {u(a_)} + j{e} % {u(a_)}"
        lines.append(f"  let k{e} = u32({index.at(j)});")
        lines.append(f"  let v{e} = select({fill}, {x.at(src)}, {ok});")
    lines += [f"  {guard(e, kb.store(out, f'i{e}', f'v{e}'))}" for e in range(PER_THREAD)]
    nbytes = 2 * node.type.nbytes
    return [kb.finish("", "\n".join(lines), WG, groups, nbytes=nbytes)]


def lower_index_select_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Sum the rows of g whose index is c into row c of the output, deterministically.

    Two schedules (see the module docstring for the costs): when the targets are no more than
    the indices, one workgroup per target c; otherwise (an embedding: a large vocabulary, few
    tokens) a zero fill, then one workgroup per index position t that owns the row of its
    value when t is that value's first occurrence.
    """
    node = graph[node_id]
    dim, c_ = node.attr("dim"), node.attr("size")
    g_t = graph[node.inputs[0]].type
    if g_t.numel == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    b_, k_, a_ = _collapse(g_t.shape, dim)
    by_target = c_ <= k_
    kernels = [] if by_target else lower_fill(graph, node_id, limits, 0.0)
    kb = KernelBuilder(graph, node, limits)
    g = kb.read(node.inputs[0], "g")
    index = kb.read(node.inputs[1], "index")
    out = kb.write(node_id, "out")
    cols = b_ * a_
    tw = 256 if max(cols, k_) > 64 else 64
    acc = min(MAX_ACC, -(-cols // tw))
    blocks = -(-cols // (tw * acc))

    def column(m: int) -> str:
        """Lane column m of block cb: its g offset ``gc{m}`` and output offset ``oc{m}``."""
        col = f"min(cb * {u(tw * acc)} + {u(m * tw)} + lid, {u(cols - 1)})"
        if b_ == 1:
            return f"let col{m} = {col};\nlet gc{m} = col{m};\nlet oc{m} = col{m} + c * {u(a_)};\n"
        split = f"(col{m} / {u(a_)})", f"(col{m} % {u(a_)})"
        return (
            f"let col{m} = {col};\n"
            f"let gc{m} = {split[0]} * {u(k_ * a_)} + {split[1]};\n"
            f"let oc{m} = {split[0]} * {u(c_ * a_)} + c * {u(a_)} + {split[1]};\n"
        )

    # A chunk of TW indices is flagged as a bitmask of TW/32 words (integer atomicOr, exact),
    # and each lane walks the set bits in ascending order: iterations = words + matches.
    # Chunks alternate between two mask buffers, so clearing one after use needs no barrier.
    words = tw // 32
    adds = "".join(f"  acc{m} = acc{m} + {g.at(f'gc{m} + r')};\n" for m in range(acc))
    walk = "".join(
        f"var m{w} = atomicLoad(&mask[base + {u(w)}]);\n"
        f"while (m{w} != 0u) {{\n"
        f"  let r = (t0 + {u(32 * w)} + firstTrailingBit(m{w})) * {u(a_)};\n"
        f"  m{w} = m{w} & (m{w} - 1u);\n{adds}}}\n"
        for w in range(words)
    )
    chunk = (
        "let s = t0 + lid;\n"
        f"if (s < {u(k_)} && u32({index.at(f'min(s, {u(k_ - 1)})')}) == c) {{\n"
        "  atomicOr(&mask[base + (lid >> 5u)], 1u << (lid & 31u));\n}\n"
        "workgroupBarrier();\n" + walk + "workgroupBarrier();\n"
        f"if (lid < {u(words)}) {{ atomicStore(&mask[base + lid], 0u); }}\n"
        f"base = {u(words)} - base;\n"
    )
    per_block = "".join(column(m) for m in range(acc))
    per_block += "".join(f"var acc{m} = 0.0;\n" for m in range(acc))
    start = "0u" if by_target else "t"
    per_block += f"for (var t0 = {start}; t0 < {u(k_)}; t0 = t0 + {u(tw)}) {{\n{indent(chunk)}}}\n"
    per_block += "".join(
        f"if (cb * {u(tw * acc)} + {u(m * tw)} + lid < {u(cols)}) "
        f"{{ {kb.store(out, f'oc{m}', f'acc{m}')} }}\n"
        for m in range(acc)
    )
    # workgroup memory is zeroed explicitly: lavapipe does not zero it
    helpers = f"var<workgroup> mask: array<atomic<u32>, {2 * words}>;\n"
    clear = f"if (lid < {u(2 * words)}) {{ atomicStore(&mask[lid], 0u); }}\n"
    if by_target:
        body = "let c = wg;\n" + clear + "workgroupBarrier();\n"
    else:
        # c and "an earlier index has the same value" are made workgroup-uniform through
        # workgroupUniformLoad, so the early returns keep later barriers in uniform control flow
        helpers += "var<workgroup> wc: u32;\nvar<workgroup> dup: atomic<u32>;\n"
        helpers += "var<workgroup> dupw: u32;\n"
        body = (
            f"let t = wg;\n"
            f"if (lid == 0u) {{ wc = u32({index.at('t')}); atomicStore(&dup, 0u); }}\n{clear}"
            f"let c = workgroupUniformLoad(&wc);\n"
            f"if (c >= {u(c_)}) {{ return; }}\n"
            f"for (var s = lid; s < t; s = s + {u(tw)}) {{\n"
            f"  if (u32({index.at('s')}) == c) {{ atomicOr(&dup, 1u); }}\n"
            f"}}\n"
            f"workgroupBarrier();\n"
            f"if (lid == 0u) {{ dupw = atomicLoad(&dup); }}\n"
            f"if (workgroupUniformLoad(&dupw) != 0u) {{ return; }}\n"
        )
    body += f"var base = 0u;\nfor (var cb = 0u; cb < {u(blocks)}; cb = cb + 1u) {{\n"
    body += indent(per_block) + "}\n"
    groups = c_ if by_target else k_
    nbytes = g_t.nbytes + (node.type.nbytes if by_target else 0)
    flops = groups * k_ * blocks
    kernels.append(kb.finish("", indent(body), tw, groups, helpers, flops=flops, nbytes=nbytes))
    return kernels


def lower_index_copy(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``index_copy_``: ``x[b, index[t], a] = source[b, t, a]`` in place, with x collapsed to
    [B, C, A] around ``dim``; one source element per lane. A row whose index is outside
    [0, C) (a negative i32 wraps to a large u32) is not written."""
    node = graph[node_id]
    x_id, index_id, source_id = node.inputs
    if graph[source_id].type.numel == 0:
        return []
    kb = KernelBuilder(graph, node, limits)
    x = kb.write(x_id, "x")  # operand 0's storage (the state buffer): the op's value
    index = kb.read(index_id, "index")
    source = kb.read(source_id, "source")
    b_, c_, a_ = _collapse(graph[x_id].type.shape, node.attr("dim"))
    k_ = graph[index_id].type.numel
    n = graph[source_id].type.numel
    slots, groups, guard = element_slots(n)
    lines = [slots.rstrip()]
    for e in range(PER_THREAD):
        t = f"j{e}" if a_ == 1 else f"(j{e} / {u(a_)})"
        if b_ > 1:
            t = f"({t} % {u(k_)})"
        row = f"k{e}" if b_ == 1 else f"(j{e} / {u(k_ * a_)}) * {u(c_)} + k{e}"
        dst = row if a_ == 1 else f"({row}) * {u(a_)} + j{e} % {u(a_)}"
        lines += [
            f"  let k{e} = u32({index.at(t)});",
            f"  let v{e} = {source.at(f'j{e}')};",
            f"  let d{e} = {dst};",
        ]
    for e in range(PER_THREAD):
        store = f"if (k{e} < {u(c_)}) {{ {kb.store(x, f'd{e}', f'v{e}')} }}"
        lines.append(f"  {guard(e, store)}")
    nbytes = 2 * graph[source_id].type.nbytes
    return [kb.finish("", "\n".join(lines), WG, groups, nbytes=nbytes)]
