"""dk and dv in one pass with each key row split over two threads by head dim ("dkv half").

The lane kernel's ``dkv`` mode keeps a key row's k, v and both accumulators in one thread:
``2 (D/4 + Dv/4)`` vec4 registers, 64 at D = Dv = 64, which spills on NVIDIA (255 registers a
thread) and made the fused pass slower than separate dk and dv kernels at long query streams
(Whisper: 1319 us against 955 on the H200, ``plan.fuses_key_value``). Here thread ``h`` (0 or
1) of a pair owns half of the head dims: half of k, v, dk and dv (32 vec4s at D = Dv = 64, fewer
than the dk kernel's 48). Per query entry each thread forms half of ``s = q.k`` and of
``dp = dO.v`` and adds its partner's halves with one ``subgroupShuffleXor`` of a vec2 (the
pair is lids 2r, 2r + 1, in one subgroup), so both hold the full score, then
``p = exp(s * scale + mask - lse)``, ``ds = p (dp - delta)`` and update their halves:
``dk += ds q``, ``dv += p dO`` (FlashAttention-2's backward inner loop, Dao 2023, Algorithm 2,
with the reduction over the head dim split across two threads). 256 FMAs per (key, query)
pair, against the 320 of separate dk and dv kernels; the Q, dO and stats tiles are read once.

Layout: ``ROWS`` key rows per workgroup (64 threads), the query stream in tiles of ``TILE``
entries through workgroup memory (q, dO, stats; ``lane_stream.key_row_loops``, which
prefetches the next tile's q and dO into registers: 4 + 4 vec4s a thread at 16 entries,
``tile_loads.prefetch``'s budget, so the stats are copied in the loop), ``UNROLL`` entries per
unrolled step. Masks,
causality (a key sees queries from its own index on) and GQA (the stream runs over each head
of the kv head's group) as in ``lane``. Needs subgroups (``Limits.subgroups``, subgroup size
at least 2) and head dims that are multiples of 8. ``plan.uses_dkv_half`` selects it where
the lane kernel would not fuse dk and dv, or where its query split was measured faster
(``tuned.TUNED_QUERY_SPLIT``); ``plan.DKV_HALF`` forces it on or off.
"""

from __future__ import annotations

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import WG, broadcast_strides
from ..core.literals import NEG_INF_BITS, f32_literal, u
from . import plan as lane_plans  # its switches read at each call (tests patch them)
from . import splits
from .common import PARTIALS, dims_of, load4, read_extras, stride_sum
from .lane import _store
from .lane_stream import _Kernel, key_row_loops
from .plan import Dims, Plan
from .splits import Split, _chunked, split_by_rule

ROWS = 32  # key rows per workgroup, two threads each
# Long query streams split over workgroups (``choose_query_split``): the switch (a bench A/B
# lever, never changed by the compiler) and a forced chunk count (benchmarks; 1: unsplit).
QUERY_SPLIT = [True]
QUERY_SPLIT_CHUNKS: list[int | None] = [None]
# Query entries per workgroup-memory tile (``set_short_tiles``: a bench A/B knob). 16 lets q
# and dO both fit the prefetch budget (4 + 4 vec4s a thread) at twice the barriers of 32; on
# the H200, W4's training step took 11.28 ms with 16 against 12.54 with 32 (same process,
# interleaved: bench/results/lever_ab_h200_tile16.json).
TILE = 16
UNROLL = 4  # entries per unrolled step of the tile loop


def set_short_tiles(on: bool) -> None:
    """16-entry query tiles (on, the default) or 32 for programs compiled from now on (the
    gradients are the same bits either way). A bench A/B switch, never changed by the
    compiler."""
    global TILE
    TILE = 16 if on else 32


def _layout(dims: Dims) -> tuple[int, dict[str, tuple[int, int]]]:
    """(vec4s of workgroup memory, {segment: (offset, stride)}): q, dO (``g``), stats."""
    q, g = TILE * dims.d4, TILE * dims.dv4
    return q + g + TILE, {"q": (0, dims.d4), "g": (q, dims.dv4), "st": (q + g, 1)}


def half_fits(dims: Dims, limits: Limits) -> bool:
    """Whether the adapter and the head dims allow this kernel."""
    return (
        limits.subgroups
        and dims.d % 8 == 0
        and dims.dv % 8 == 0
        and 2 * ROWS <= limits.max_invocations_per_workgroup
        and 16 * _layout(dims)[0] <= limits.max_workgroup_storage_size
    )


def set_query_split(on: bool) -> None:
    """Let long query streams split over workgroups (on, the default: ``choose_query_split``)
    or never (off), for programs compiled from now on (bench/lever_ab.py's
    ``attention_dkv_split``)."""
    QUERY_SPLIT[:] = [bool(on)]


def measured_query_split(dims: Dims, limits: Limits) -> int | None:
    """The chunk count ``tuned.TUNED_QUERY_SPLIT`` measured for these sizes, where it applies:
    a GPU adapter, the query split and the tuned tables on (``QUERY_SPLIT``,
    ``plan.USE_TUNED``), ``splits.LONG_SPLIT_OVERRIDE`` not False; else None. Sizes with such
    an entry run dkv half even where the lane kernel would fuse dk and dv
    (``plan.uses_dkv_half``)."""
    from .tuned import TUNED_QUERY_SPLIT

    on = QUERY_SPLIT[0] and lane_plans.USE_TUNED[0] and splits.LONG_SPLIT_OVERRIDE is not False
    return TUNED_QUERY_SPLIT.get(dims) if on and not limits.cpu else None


def choose_query_split(dims: Dims, limits: Limits) -> Split | None:
    """The query split of a dkv half kernel, or None for one workgroup per key tile:
    ``QUERY_SPLIT_CHUNKS`` (benchmarks) first; else, with ``QUERY_SPLIT`` on, the chunks
    measured for these sizes (``measured_query_split``), else the long forward's thread rule
    over each head's query rows (``splits.split_by_rule``)."""
    plan = Plan(ROWS, 2, TILE)
    if QUERY_SPLIT_CHUNKS[0] is not None:
        return _chunked(plan, dims.lq, QUERY_SPLIT_CHUNKS[0])
    if not QUERY_SPLIT[0]:
        return None
    measured = measured_query_split(dims, limits)
    if measured is not None:
        return _chunked(plan, dims.lq, measured)
    threads = dims.b * dims.hkv * -(-dims.lk // ROWS) * 2 * ROWS
    return split_by_rule(plan, dims.lq, threads, limits)


def lower_dkv_half(
    graph: Graph, key_node: int, value_node: int, limits: Limits, split: Split | None = None
) -> list[KernelSource]:
    """One dispatch writing dk (``key_node``) and dv (``value_node``), see the module
    docstring; with ``split`` (``choose_query_split``) two: each query head's rows cut into
    ``split.chunks`` chunks of ``split.length``, one workgroup per (key tile, chunk) writing
    its rows' parts of dk (unscaled) and dv to the scratch ``PARTIALS``, then
    ``lower_dkv_sum``.

    Raises:
        ValueError: where ``half_fits`` does not hold.
    """
    node = graph[key_node]
    ins = node.inputs
    dims = dims_of(graph, node, "dkv")
    if not half_fits(dims, limits):
        raise ValueError(f"dkv half: needs subgroups and head dims divisible by 8, got {dims}")
    b, hkv, G, lq, lk, d, dv = dims.b, dims.hkv, dims.group, dims.lq, dims.lk, dims.d, dims.dv
    hq = hkv * G
    d4h, dv4h = dims.d4 // 2, dims.dv4 // 2
    tiles = -(-lk // ROWS)
    kb = KernelBuilder(graph, node, limits)
    src = {n: kb.read(v, n) for n, v in zip(("q", "k", "v", "dout", "st"), ins[:5], strict=True)}
    mask, _ = read_extras(kb, graph, ins[5:])
    strides = broadcast_strides(mask.type.shape, (b, hq, lq, lk)) if mask else (0, 0, 0, 0)
    total, layout = _layout(dims)
    causal = bool(node.attr("is_causal"))
    scale = f32_literal(node.attr("scale"))
    # _Kernel for lane's tile loads: 64 threads (plan.size), TILE entries, query stream
    k = _Kernel("dkv", dims, Plan(ROWS, 2, TILE), layout, src, mask, strides, scale, causal)
    chunks = 1 if split is None else split.chunks
    if split is None:
        out, dv_out = kb.write(key_node, "out"), kb.write(value_node, "dv")
    else:  # per (key row, chunk): its part of dk, then of dv
        out = kb.scratch(PARTIALS, b * hkv * lk * chunks * (d + dv), node.type.dtype, "part")

    lines = [] if split is None else [f"  let chunk = wg % {u(chunks)};"]
    wgt = "wg" if split is None else f"(wg / {u(chunks)})"
    lines += [
        f"  let tile = {wgt} % {u(tiles)};",
        f"  let bh = {wgt} / {u(tiles)};",
        f"  let b = bh / {u(hkv)};",
        f"  let hk = bh % {u(hkv)};",
        "  let h = lid & 1u;",
        f"  let row = tile * {u(ROWS)} + (lid >> 1u);",
        f"  let live = row < {u(lk)};",
        f"  let rowc = min(row, {u(lk - 1)});",
        f"  let krow = bh * {u(lk)} + rowc;",
        f"  let ko = {src['k'].row_offset('krow')} + h * {u(d // 2)};",
        f"  let vo = {src['v'].row_offset('krow')} + h * {u(dv // 2)};",
    ]
    lines += [f"  let k{c} = {load4(src['k'], 'ko', c, d // 2)};" for c in range(d4h)]
    lines += [f"  let v{c} = {load4(src['v'], 'vo', c, dv // 2)};" for c in range(dv4h)]
    lines += [f"  var acc{c} = vec4<f32>(0.0);" for c in range(d4h)]
    lines += [f"  var vacc{c} = vec4<f32>(0.0);" for c in range(dv4h)]

    loop = [f"    for (var e0 = 0u; e0 < {u(TILE)}; e0 = e0 + {u(UNROLL)}) {{"]
    span = None
    if split is not None:  # a causal chunk before the tile's first key streams nothing: zeros
        c = u(split.length)
        lines += [f"  let s_begin = chunk * {c};", f"  let s_stop = min({u(lq)}, s_begin + {c});"]
        span = ("s_begin", "s_stop")
    lines += key_row_loops(k, [*loop, *_entries(k, d4h, dv4h), "    }"], span=span)
    lines.append("  if (live) {")
    if split is None:
        lines += [
            f"    let kob = {kb.row_offset(out, 'krow', d)} + h * {u(d // 2)};",
            *_store(kb, out, "kob", d // 2, d4h, f" * {scale}", offset=True),
            f"    let vob = {kb.row_offset(dv_out, 'krow', dv)} + h * {u(dv // 2)};",
            *_store(kb, dv_out, "vob", dv // 2, dv4h, acc="vacc", offset=True),
        ]
    else:
        lines += [
            f"    let pb = (krow * {u(chunks)} + chunk) * {u(d + dv)};",
            *_store(kb, out, f"pb + h * {u(d // 2)}", d // 2, d4h),
            *_store(kb, out, f"pb + {u(d)} + h * {u(dv // 2)}", dv // 2, dv4h, acc="vacc"),
        ]
    lines.append("  }")
    helpers = f"var<workgroup> sh: array<vec4<f32>, {total}>;\n"
    flops = 2 * b * hq * lq * lk * (2 * d + 2 * dv) // (2 if causal else 1)
    groups = b * hkv * tiles * chunks
    suffix = "dkv half" if split is None else f"dkv half split {chunks}x{split.length}"
    kernel = kb.finish(suffix, "\n".join(lines), 2 * ROWS, groups, helpers, flops=flops)
    if split is None:
        return [kernel]
    return [kernel, lower_dkv_sum(graph, key_node, value_node, limits, split)]


def lower_dkv_sum(
    graph: Graph, key_node: int, value_node: int, limits: Limits, split: Split
) -> KernelSource:
    """The second kernel of a split dkv half: per element, ``dk = scale * sum_c dk_c`` and
    ``dv = sum_c dv_c`` over the chunks in chunk order (a fixed order: results do not depend
    on scheduling), one thread per element of a key row's (dk, dv) pair."""
    node = graph[key_node]
    dims = dims_of(graph, node, "dkv")
    d, dv, nc = dims.d, dims.dv, split.chunks
    rows = node.type.numel // d
    n, width = rows * (d + dv), d + dv
    kb = KernelBuilder(graph, node, limits)
    part = kb.scratch(PARTIALS, rows * nc * width, node.type.dtype, "part")
    out, dv_out = kb.write(key_node, "out"), kb.write(value_node, "dv")
    total = " + ".join(kb.load(part, f"base + {u(c * width)}") for c in range(nc))
    scale = f32_literal(node.attr("scale"))
    kob, vob = kb.row_offset(out, "row", d), kb.row_offset(dv_out, "row", dv)
    lines = [
        f"  let i = wg * {WG}u + lid;",
        f"  if (i < {u(n)}) {{",
        f"    let row = i / {u(width)};",
        f"    let col = i % {u(width)};",
        f"    let base = row * {u(nc * width)} + col;",
        f"    let total = {total};",
        f"    if (col < {u(d)}) {{",
        "      " + kb.store(out, f"{kob} + col", f"total * {scale}", True),
        "    } else {",
        "      " + kb.store(dv_out, f"{vob} + col - {u(d)}", "total", True),
        "    }",
        "  }",
    ]
    nbytes = 4 * rows * nc * width + node.type.nbytes + graph[value_node].type.nbytes
    body = "\n".join(lines)
    return kb.finish(f"dkv half sum {nc}", body, WG, -(-n // WG), flops=n * nc, nbytes=nbytes)


def _entries(k: _Kernel, d4h: int, dv4h: int) -> list[str]:
    """``UNROLL`` entries of the tile: half dot products, the pair's exchange, the updates."""
    (q_off, q_stride), (g_off, g_stride), (st_off, _) = (k.layout[s] for s in ("q", "g", "st"))
    lq = k.dims.lq
    ragged = lq % TILE != 0 or k.causal
    lines = []
    for j in range(UNROLL):
        lines += [
            f"      let jj{j} = e0 + {u(j)};",
            f"      let j{j} = s0 + jj{j};",
            f"      let a{j} = {u(q_off)} + jj{j} * {u(q_stride)} + h * {u(d4h)};",
            f"      let b{j} = {u(g_off)} + jj{j} * {u(g_stride)} + h * {u(dv4h)};",
        ]
        sp = " + ".join(f"dot(k{c}, sh[a{j} + {u(c)}])" for c in range(d4h))
        dp = " + ".join(f"dot(v{c}, sh[b{j} + {u(c)}])" for c in range(dv4h))
        lines.append(f"      let x{j} = vec2<f32>({sp}, {dp});")
    # every thread of the subgroup reaches the shuffles (trip counts are uniform)
    lines += [f"      let y{j} = x{j} + subgroupShuffleXor(x{j}, 1u);" for j in range(UNROLL)]
    for j in range(UNROLL):
        conds = [f"j{j} < {u(lq)}"] if ragged else []
        if k.causal:
            conds.append(f"rowc <= j{j}")
        score = f"y{j}.x * {k.scale}"
        if k.mask is not None:
            idx = stride_sum([("mcol", 1), (f"min(j{j}, {u(lq - 1)})", k.mask_strides[2])])
            lines.append(f"      let mv{j} = {k.mask.at(idx)};")
            if k.mask.literal is None:
                conds.append(f"bitcast<u32>(mv{j}) != {NEG_INF_BITS}")
            score += f" + mv{j}"
        lines += [
            f"      let ok{j} = {' && '.join(conds) if conds else 'true'};",
            f"      let st{j} = sh[{u(st_off)} + jj{j}];",
            f"      let p{j} = select(0.0, exp({score} - st{j}.x), ok{j});",
            f"      let ds{j} = p{j} * (y{j}.y - st{j}.y);",
        ]
    for c in range(d4h):
        terms = " + ".join(f"ds{j} * sh[a{j} + {u(c)}]" for j in range(UNROLL))
        lines.append(f"      acc{c} = acc{c} + {terms};")
    for c in range(dv4h):
        terms = " + ".join(f"p{j} * sh[b{j} + {u(c)}]" for j in range(UNROLL))
        lines.append(f"      vacc{c} = vacc{c} + {terms};")
    return lines
