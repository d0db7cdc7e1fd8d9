"""The lane kernel's stream (``lane``): the description of the kernel being generated
(``_Kernel``), the loop over stream tiles (query rows: ``_stream_loops``; key rows:
``key_row_loops``, shared with ``dkv_half``) and the merge of a row's lanes.

Each tile of the stream is copied cooperatively into workgroup memory (``tile_loads.load_tile``,
or the prologue's rotating copy of key tiles, ``rope_prefill``; the forward of a short query
block issues every load of a tile at once; where ``tile_loads.prefetch`` applies, the next
tile's loads are in flight while the current one is computed), then each of a row's
``lanes`` threads takes entries ``t + lanes * u`` of the tile (``_entries``): its scores (f32,
scaled, plus the mask) and the mode's update, an online softmax with a running max and sum
(``fwd``, ``stats``, ``lse``; FlashAttention-2) or the gradients' accumulation (``dq``,
``dk``, ``dv``, ``dkv``). After the last tile the lanes of each row merge pairwise in
workgroup memory into lane 0 (``_merge``: online-softmax rescaling for the forward, sums for
gradients).

Masking never relies on inf arithmetic: an entry is masked when its mask value has the bit
pattern of -inf, when the causal rule excludes it (key j > query i) or when it lies past the
end; masked entries get probability 0 through ``select``, masked scores use the lowest finite
f32 as the running-max sentinel, and a row with no unmasked entry writes zeros (its stats row
writes lse = 0: ``lane``'s stores). Reads are clamped into range, so padding lanes and rows
compute on finite data and never store.

A runtime key count (the forward's trailing i32 ``kv_length`` operand, [] or [B]): the kernel
reads ``kvl = clamp(kv_length[b], 0, Lk)`` once per workgroup (uniform: one batch row per
workgroup) and its key loop stops at ``kvl`` (or at the lower-right causal limit of the tile's
last query, ``kvl - Lq + i + 1``); tile loads clamp to key ``kvl - 1``, so keys past it are
never read, whatever they hold; entries past it are masked, and with ``is_causal`` query i
sees keys ``j + Lq <= kvl + i`` (u32, no negative values).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.builder import KernelBuilder, Src
from ..core.literals import NEG_INF_BITS, u
from .common import LOWEST, key_end, stride_sum
from .plan import QUERY_ROW_MODES, SOFTMAX_MODES, Dims, Plan, accumulators, extents
from .splits import SPLIT_MAX_LQ, Split
from .tile_loads import SPLIT_PREFETCH, load_tile, prefetch
from .tile_loads import set_prefetch as set_prefetch  # the lever's switch, re-exported


@dataclass(frozen=True)
class _Kernel:
    """What the statement emitters need to know about the kernel being generated."""

    mode: str
    dims: Dims
    plan: Plan
    layout: dict[str, tuple[int, int]]
    src: dict[str, Src]
    mask: Src | None
    mask_strides: tuple[int, int, int, int]
    scale: str
    causal: bool
    kvlen: Src | None = None
    split: Split | None = None  # fwd, dq: this workgroup's key chunk, partials to scratch
    kb: KernelBuilder | None = None  # with split: stores of empty chunks' states to ``out``
    out: str = ""
    # fwd: ``rope_attention.RopePrologue`` (rotation, cache writes), ``rope_prefill.RopeLoads``
    prologue: object | None = None
    delta: bool = False  # dq: computes its rows' delta (``dq_delta``), no stats operand

    @property
    def accs(self) -> list[str]:
        """The row's vec4 accumulators: ``acc{c}`` for its output row (dkv: dk's), then
        ``vacc{c}`` for dv's row in dkv mode."""
        if self.mode == "dkv":
            d4, dv4 = self.dims.d4, self.dims.dv4
            return [f"acc{c}" for c in range(d4)] + [f"vacc{c}" for c in range(dv4)]
        return [f"acc{c}" for c in range(accumulators(self.mode, self.dims))]

    @property
    def query_rows(self) -> bool:
        return self.mode in QUERY_ROW_MODES

    @property
    def n_rows(self) -> int:
        return extents(self.mode, self.dims)[0]

    @property
    def n_stream(self) -> int:
        return extents(self.mode, self.dims)[1]

    def entry(self, seg: str, j: int) -> str:
        """Address of stream entry ``jj{j}``'s segment ``seg`` in workgroup memory."""
        off, stride = self.layout[seg]
        return f"{u(off)} + jj{j} * {u(stride)}" if stride != 1 else f"{u(off)} + jj{j}"


def _dot(regs: str, count: int, addr: str) -> str:
    return " + ".join(f"dot({regs}{c}, sh[{addr} + {u(c)}])" for c in range(count))


def _sum(terms: list[str]) -> str:
    return " + ".join(terms)


def _stream_loops(k: _Kernel) -> list[str]:
    """The loop over stream tiles: barrier, cooperative loads, barrier, this lane's entries
    (with the next tile's loads in flight where ``tile_loads.prefetch`` applies)."""
    d, dv, lq, lk = k.dims.d, k.dims.dv, k.dims.lq, k.dims.lk
    R, BS = k.plan.rows, k.plan.tile
    if not k.query_rows:
        # the lane dkv already holds k, v, dk and dv (2 (D/4 + Dv/4) vec4s, 64 at D = 64: it
        # spills on NVIDIA, plan.fuses_key_value): no prefetch registers on top
        return key_row_loops(k, _entries(k), prefetching=k.mode != "dkv")
    row = f"bh * {u(lk)} + sr"
    # short query blocks (decoding) wait on each tile's loads: issue them all at once
    short = k.mode == "fwd" and k.dims.lq <= SPLIT_MAX_LQ
    stores = [] if short else None
    if hasattr(k.prologue, "key_tile"):
        loads = k.prologue.key_tile(k, k.src["k"], row)
    else:
        loads = load_tile(k, "k", k.src["k"], row, d, stores)
    if k.mode in ("fwd", "dq"):
        loads += load_tile(k, "v", k.src["v"], row, dv, stores)
    loads += stores or []
    body = ["    workgroupBarrier();", *loads, "    workgroupBarrier();", *_entries(k)]
    # a prologue's key copy, a split measured faster without (or SPLIT_PREFETCH off) or a
    # single tile: no prefetch; both segments or none
    segs = [("k", d)] + ([("v", dv)] if k.mode in ("fwd", "dq") else [])
    start, end = ("0u", "s_end") if k.split is None else ("s_begin", "s_stop")
    fetch = None
    split_off = k.split is not None and not (SPLIT_PREFETCH[0] and k.split.prefetch)
    if not (short or hasattr(k.prologue, "key_tile") or split_off or lk <= BS):
        fetch = prefetch(k, segs, k.src, row, start, end, partial=False)
    lines = key_end(k.kvlen, k.causal, R, k.n_rows, lq, lk)
    if k.split is not None:  # this workgroup's chunk of keys only
        c = u(k.split.length)
        lines += [f"  let s_begin = chunk * {c};", f"  let s_stop = min(s_end, s_begin + {c});"]
        # a chunk past the last key (decoding: most of the cache; a causal dq tile's later
        # chunks) stores only an empty state and leaves; s_stop is uniform
        lines += [
            "  if (s_begin >= s_stop) {",
            "    if (live && t == 0u) {" if k.plan.lanes > 1 else "    if (live) {",
            *_empty_chunk(k),
            "    }",
            "    return;",
            "  }",
        ]
    loop = f"  for (var s0 = {start}; s0 < {end}; s0 = s0 + {u(BS)}) {{"
    if fetch is not None:
        decls, first, copies, following = fetch
        body = ["    workgroupBarrier();", *copies, "    workgroupBarrier();", *following]
        return lines + decls + first + [loop, *body, *_entries(k), "  }"]
    return lines + [loop, *body, "  }"]


def _empty_chunk(k: _Kernel) -> list[str]:
    """Stores of a split chunk with no key to stream: the forward's state m = lowest, l = 0
    (the merge ignores its output row), or a zero part of dq. Chunk 0, which stores a dq's
    delta pairs, is never empty there: a gradient has no runtime key count, so every row
    tile streams key 0."""
    store = k.kb.store
    if k.mode == "fwd":
        return [
            f"      let pb = (qrow * {u(k.split.chunks)} + chunk) * {u(k.dims.dv + 2)};",
            f"      {store(k.out, 'pb', LOWEST)}",
            f"      {store(k.out, 'pb + 1u', '0.0')}",
        ]
    d = k.dims.d
    return [
        f"      let pb = (qrow * {u(k.split.chunks)} + chunk) * {u(d)};",
        f"      for (var c = 0u; c < {u(d)}; c = c + 1u) {{ {store(k.out, 'pb + c', '0.0')} }}",
    ]


def key_row_loops(
    k: _Kernel, entries: list[str], prefetching: bool = True, span: tuple[str, str] | None = None
) -> list[str]:
    """The key-row modes' stream (``dk``, ``dv``, ``dkv``; ``dkv_half``): each query head of
    the kv head's group in turn (``hg``), its query tiles from the workgroup's first key on
    when causal (keys j see queries i >= j only), the q, dO and stats segments of each tile,
    then ``entries``. Within each head's query loop the tiles' segments are prefetched
    (``tile_loads.prefetch``: the longest prefix of q, dO, stats that fits the budget) when
    that loop has at least two tiles and ``prefetching`` is True. ``span``: (first, stop),
    uniform u32 expressions of the query rows of each head this workgroup streams (a split
    chunk, ``dkv_half``); all of them without."""
    d, dv, lq, G = k.dims.d, k.dims.dv, k.dims.lq, k.dims.group
    BS = k.plan.tile
    row = f"(bh * {u(G)} + hg) * {u(lq)} + sr"
    start = f"tile * {u(k.plan.rows)}" if k.causal else "0u"
    stop = u(lq)
    if span is not None:
        start = span[0] if start == "0u" else f"max({start}, {span[0]})"
        stop = span[1]
    segs = [("q", d), ("g", dv), ("st", 2)]
    srcs = {"q": k.src["q"], "g": k.src["dout"], "st": k.src["st"]}
    fetch = prefetch(k, segs, srcs, row, start, stop) if prefetching and lq > BS else None
    if fetch is None:
        decls, first, following = [], [], []
        copies = [line for seg, n in segs for line in load_tile(k, seg, srcs[seg], row, n)]
    else:
        decls, first, copies, following = fetch
    sb, sh, _, sj = k.mask_strides
    head = f"(hk * {u(G)} + hg)"
    return [
        *decls,
        f"  for (var hg = 0u; hg < {u(G)}; hg = hg + 1u) {{",
        f"  let mcol = {stride_sum([('b', sb), (head, sh), ('rowc', sj)])};",
        *first,
        f"  for (var s0 = {start}; s0 < {stop}; s0 = s0 + {u(BS)}) {{",
        "    workgroupBarrier();",
        *copies,
        "    workgroupBarrier();",
        *following,
        *entries,
        "  }",
        "  }",
    ]


def _entries(k: _Kernel) -> list[str]:
    """This lane's ``per_lane`` entries of the current tile: scores, then the mode's update."""
    T, NJ = k.plan.lanes, k.plan.per_lane
    ragged = k.n_stream % k.plan.tile != 0 or (k.causal and not k.query_rows)
    mstride = k.mask_strides[3] if k.query_rows else k.mask_strides[2]
    lines = []
    for j in range(NJ):
        lines.append(f"    let jj{j} = t + {u(T * j)};" if T > 1 else f"    let jj{j} = {u(j)};")
        lines.append(f"    let j{j} = s0 + jj{j};")
        conds = [f"j{j} < {u(k.n_stream)}"] if ragged else []
        if k.kvlen is not None:  # the forward only: rows are queries
            conds = [f"j{j} < kvl"]
            if k.causal:
                conds.append(f"j{j} + {u(k.dims.lq)} <= kvl + ri")
        elif k.causal:
            conds.append(f"j{j} <= ri" if k.query_rows else f"rowc <= j{j}")
        seg, regs = ("k", "q") if k.query_rows else ("q", "k")
        lines.append(f"    let a{j} = {k.entry(seg, j)};")
        score = f"({_dot(regs, k.dims.d4, f'a{j}')}) * {k.scale}"
        if k.mask is not None:
            base = "mrow" if k.query_rows else "mcol"
            idx = stride_sum([(base, 1), (f"min(j{j}, {u(k.n_stream - 1)})", mstride)])
            lines.append(f"    let mv{j} = {k.mask.at(idx)};")
            if k.mask.literal is None:
                conds.append(f"bitcast<u32>(mv{j}) != {NEG_INF_BITS}")
            score += f" + mv{j}"
        lines.append(f"    let ok{j} = {' && '.join(conds) if conds else 'true'};")
        lines.append(f"    let sc{j} = {score};")
    ps = [f"p{j}" for j in range(NJ)]
    if k.mode in SOFTMAX_MODES:
        lines += [f"    let x{j} = select({LOWEST}, sc{j}, ok{j});" for j in range(NJ)]
        mt = "x0"
        for j in range(1, NJ):
            mt = f"max({mt}, x{j})"
        lines += [f"    let mn = max(m, {mt});", "    let alpha = exp(m - mn);"]
        lines += [f"    let p{j} = select(0.0, exp(x{j} - mn), ok{j});" for j in range(NJ)]
        lines.append(f"    l = l * alpha + {_sum(ps)};")
        if k.mode == "fwd":
            lines += [f"    let b{j} = {k.entry('v', j)};" for j in range(NJ)]
            for c in range(k.dims.dv4):
                terms = [f"p{j} * sh[b{j} + {u(c)}]" for j in range(NJ)]
                lines.append(f"    acc{c} = acc{c} * alpha + {_sum(terms)};")
        return lines + ["    m = mn;"]
    for j in range(NJ):
        if k.query_rows:
            lse, delta = "lse", "delta"
        else:
            lines.append(f"    let st{j} = sh[{k.entry('st', j)}];")
            lse, delta = f"st{j}.x", f"st{j}.y"
        lines.append(f"    let p{j} = select(0.0, exp(sc{j} - {lse}), ok{j});")
        if k.mode != "dv":
            # dp = dO_i . v_j: dO in registers (dq) or in the tile (dk, dkv), v the other way
            lines.append(f"    let b{j} = {k.entry('v' if k.mode == 'dq' else 'g', j)};")
            dp = _dot("g" if k.mode == "dq" else "v", k.dims.dv4, f"b{j}")
            lines.append(f"    let ds{j} = p{j} * (({dp}) - {delta});")
        else:
            lines.append(f"    let b{j} = {k.entry('g', j)};")
    # dq += ds k_j, dk += ds q_i (the a{j} entries); dv += p dO_i (the b{j} entries)
    if k.mode == "dkv":
        updates = [("acc", "ds", "a", k.dims.d4), ("vacc", "p", "b", k.dims.dv4)]
    elif k.mode == "dv":
        updates = [("acc", "p", "b", k.dims.dv4)]
    else:
        updates = [("acc", "ds", "a", k.dims.d4)]
    for acc, coef, addr, n in updates:
        for c in range(n):
            terms = [f"{coef}{j} * sh[{addr}{j} + {u(c)}]" for j in range(NJ)]
            lines.append(f"    {acc}{c} = {acc}{c} + {_sum(terms)};")
    return lines


def _merge(k: _Kernel) -> list[str]:
    """Pairwise merge of the lanes of each row into lane 0, halving the lanes each round."""
    T = k.plan.lanes
    softmax = k.mode in SOFTMAX_MODES
    acc = k.accs
    slot = len(acc) + (1 if softmax else 0)
    first = 1 if softmax else 0
    lines = []
    s = T // 2
    while s >= 1:
        lines += [
            "  workgroupBarrier();",
            f"  if (t >= {u(s)} && t < {u(2 * s)}) {{",
            f"    let base = (r * {u(s)} + t - {u(s)}) * {u(slot)};",
            *(["    sh[base] = vec4<f32>(m, l, 0.0, 0.0);"] if softmax else []),
            *[f"    sh[base + {u(first + c)}] = {a};" for c, a in enumerate(acc)],
            "  }",
            "  workgroupBarrier();",
            f"  if (t < {u(s)}) {{",
            f"    let base = (r * {u(s)} + t) * {u(slot)};",
        ]
        if softmax:
            lines += [
                "    let other = sh[base];",
                "    let mn = max(m, other.x);",
                "    let a1 = exp(m - mn);",
                "    let a2 = exp(other.x - mn);",
                "    l = l * a1 + other.y * a2;",
                "    m = mn;",
            ]
            lines += [
                f"    {a} = {a} * a1 + sh[base + {u(c + 1)}] * a2;" for c, a in enumerate(acc)
            ]
        else:
            lines += [f"    {a} = {a} + sh[base + {u(c)}];" for c, a in enumerate(acc)]
        lines.append("  }")
        s //= 2
    return lines
