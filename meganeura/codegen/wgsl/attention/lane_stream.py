"""The lane kernel's stream (``lane``): the description of the kernel being generated
(``_Kernel``), the loop over stream tiles and the merge of a row's lanes.

Each tile of the stream is copied cooperatively into workgroup memory (``_load_tile``, or the
prologue's rotating copy of key tiles, ``rope_prefill``; the forward of a short query block
issues every load of a tile at once), then each of a row's ``lanes`` threads takes entries
``t + lanes * u`` of the tile (``_entries``): its scores (f32, scaled, plus the mask) and the
mode's update, an online softmax with a running max and sum (``fwd``, ``stats``, ``lse``;
FlashAttention-2) or the gradients' accumulation (``dq``, ``dk``, ``dv``, ``dkv``). After the
last tile the lanes of each row merge pairwise in workgroup memory into lane 0 (``_merge``:
online-softmax rescaling for the forward, sums for gradients).

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
from .plan import (
    QUERY_ROW_MODES,
    SOFTMAX_MODES,
    SPLIT_MAX_LQ,
    Dims,
    Plan,
    Split,
    accumulators,
    extents,
)

# Query-row loops (fwd, stats, lse, dq) load each key tile into registers while the previous
# one is computed (``_prefetched``), when that takes at most PREFETCH_MAX_VEC4 vec4 registers
# a thread. PREFETCH is a bench A/B switch (``set_prefetch``), never changed by the compiler.
PREFETCH = [True]
PREFETCH_MAX_VEC4 = 8


def set_prefetch(on: bool) -> None:
    """Let query-row loops prefetch their next key tile (on, the default) or not, for
    programs compiled from now on."""
    PREFETCH[:] = [bool(on)]


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
    split: Split | None = None  # fwd only: this workgroup's key chunk, partials to scratch
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


def _load_tile(
    k: _Kernel,
    seg: str,
    src: Src,
    row: str,
    n: int,
    stores: list[str] | None = None,
    at: str = "s0",
    regs: list[str] | None = None,
    setup: list[str] | None = None,
) -> list[str]:
    """Cooperative copy of the current tile's segment ``seg`` (rows of ``n`` floats of
    ``src``; ``row`` is the stream entry's row index in ``src``) into workgroup memory.

    With ``stores`` (forwards of short query blocks, prefetching loops) the copy is unrolled:
    the returned statements load into registers and the workgroup-memory stores are appended
    to ``stores``, for the caller to place after every segment's loads. ``at`` is the tile's
    first stream entry (an expression); with ``regs`` the registers are variables the caller
    declares (their names are appended to ``regs``) and the returned statements assign them
    inside a block of their own, so the same loads can be emitted twice (``_prefetched``); the
    tile-independent indices they and the stores use are appended to ``setup`` (given with
    the first emission only), for the caller to place once before the loop."""
    off, stride = k.layout[seg]
    # with a runtime key count, reads stop at the last kept key (kvl >= 1 inside the loop), so
    # the tile's entries past it repeat finite data (0 * NaN in a stale slot would be NaN)
    last = "kvl - 1u" if k.kvlen is not None else u(k.n_stream - 1)
    step = u(k.plan.size)
    if seg == "st":
        return [
            f"    for (var e = lid; e < {u(k.plan.tile)}; e = e + {step}) {{",
            f"      let sr = min(s0 + e, {last});",
            f"      let base = ({row}) * 2u;",
            f"      let lse_delta = vec2<f32>({src.at('base')}, {src.at('base + 1u')});",
            f"      sh[{u(off)} + e] = vec4<f32>(lse_delta, 0.0, 0.0);",
            "    }",
        ]
    width = -(-n // 4)

    def vec4(base: str, c: str) -> str:
        if n % 4 == 0:
            return src.at4(base)
        comps = []
        for e in range(4):
            if n % 4 == 0:
                comps.append(src.at_offset(f"{base} + {u(e)}"))
            else:  # the row's last vec4 is partial: clamp the read, zero the value
                load = src.at_offset(f"min({base} + {u(e)}, {u(src.type.numel - 1)})")
                comps.append(f"select(0.0, {load}, {c} * 4u + {u(e)} < {u(n)})")
        return f"vec4<f32>({', '.join(comps)})"

    total = k.plan.tile * width
    if stores is not None:  # straight-line loads, all in flight at once
        lines = []
        for it in range(-(-total // k.plan.size)):
            e, guarded = f"{seg}e{it}", (it + 1) * k.plan.size > total
            first = f"lid + {u(it * k.plan.size)}"
            mine = [
                ("e", f"min({first}, {u(total - 1)})" if guarded else first),
                ("rr", f"{e}e / {u(width)}"),
                ("c", f"{e}e % {u(width)}"),
                ("sr", f"min({at} + {e}rr, {last})"),
                ("base", f"{src.row_offset(row.replace('sr', f'{e}sr'))} + {e}c * 4u"),
            ]
            lets = [f"    let {e}{name} = {expr};" for name, expr in mine]
            if regs is None:
                lines += [*lets, f"    let {e}v = {vec4(f'{e}base', f'{e}c')};"]
            else:  # the tile-independent indices once, before the loop; per tile the rest
                regs.append(f"{e}v")
                if setup is not None:
                    setup += [line.replace("    let", "  let", 1) for line in lets[:3]]
                load = f"    {e}v = {vec4(f'{e}base', f'{e}c')};"
                lines += ["    {", *lets[3:], load, "    }"]
            store = f"sh[{u(off)} + {e}rr * {u(stride)} + {e}c] = {e}v;"
            stores.append(
                f"    if ({first} < {u(total)}) {{ {store} }}" if guarded else f"    {store}"
            )
        return lines
    return [
        f"    for (var e = lid; e < {u(total)}; e = e + {step}) {{",
        f"      let rr = e / {u(width)};",
        f"      let c = e % {u(width)};",
        f"      let sr = min(s0 + rr, {last});",
        f"      let base = {src.row_offset(row)} + c * 4u;",
        f"      sh[{u(off)} + rr * {u(stride)} + c] = {vec4('base', 'c')};",
        "    }",
    ]


def _stream_loops(k: _Kernel) -> list[str]:
    """The loop over stream tiles: barrier, cooperative loads, barrier, this lane's entries."""
    d, dv, lq, lk, G = k.dims.d, k.dims.dv, k.dims.lq, k.dims.lk, k.dims.group
    R, BS = k.plan.rows, k.plan.tile
    if k.query_rows:
        row = f"bh * {u(lk)} + sr"
        # short query blocks (decoding) wait on each tile's loads: issue them all at once
        short = k.mode == "fwd" and k.dims.lq <= SPLIT_MAX_LQ
        stores = [] if short else None
        if hasattr(k.prologue, "key_tile"):
            loads = k.prologue.key_tile(k, k.src["k"], row)
        else:
            loads = _load_tile(k, "k", k.src["k"], row, d, stores)
        if k.mode in ("fwd", "dq"):
            loads += _load_tile(k, "v", k.src["v"], row, dv, stores)
        loads += stores or []
    else:
        row = f"(bh * {u(G)} + hg) * {u(lq)} + sr"
        loads = _load_tile(k, "q", k.src["q"], row, d)
        loads += _load_tile(k, "g", k.src["dout"], row, dv)
        loads += _load_tile(k, "st", k.src["st"], row, 2)
    body = ["    workgroupBarrier();", *loads, "    workgroupBarrier();", *_entries(k)]
    prefetched = _prefetched(k, row) if k.query_rows and not short else None
    if not k.query_rows:
        # keys j see queries i >= j only (causal): start at the tile's first key
        start = f"tile * {u(R)}" if k.causal else "0u"
        sb, sh, _, sj = k.mask_strides
        head = f"(hk * {u(G)} + hg)"
        return [
            f"  for (var hg = 0u; hg < {u(G)}; hg = hg + 1u) {{",
            f"  let mcol = {stride_sum([('b', sb), (head, sh), ('rowc', sj)])};",
            f"  for (var s0 = {start}; s0 < {u(lq)}; s0 = s0 + {u(BS)}) {{",
            *body,
            "  }",
            "  }",
        ]
    lines = key_end(k.kvlen, k.causal, R, k.n_rows, lq, lk)
    if k.split is not None:  # this workgroup's chunk of keys only
        c = u(k.split.length)
        lines += [f"  let s_begin = chunk * {c};", f"  let s_stop = min(s_end, s_begin + {c});"]
        # a chunk past the last key (decoding: most of the cache) stores only an empty state
        # (m lowest, l = 0; the merge ignores its output row) and leaves; s_stop is uniform
        lines += [
            "  if (s_begin >= s_stop) {",
            "    if (live && t == 0u) {" if k.plan.lanes > 1 else "    if (live) {",
            f"      let pb = (qrow * {u(k.split.chunks)} + chunk) * {u(k.dims.dv + 2)};",
            f"      {k.kb.store(k.out, 'pb', LOWEST)}",
            f"      {k.kb.store(k.out, 'pb + 1u', '0.0')}",
            "    }",
            "    return;",
            "  }",
        ]
        loop = f"  for (var s0 = s_begin; s0 < s_stop; s0 = s0 + {u(BS)}) {{"
    else:
        loop = f"  for (var s0 = 0u; s0 < s_end; s0 = s0 + {u(BS)}) {{"
        if prefetched is not None:
            return lines + prefetched[0] + [loop, *prefetched[1], "  }"]
    return lines + [loop, *body, "  }"]


def _prefetched(k: _Kernel, row: str) -> tuple[list[str], list[str]] | None:
    """(statements before the loop, the loop's body) of a query-row loop that loads each tile
    into registers while the previous one is computed, or None where it does not apply
    (``PREFETCH`` off, a prologue's key copy, a split, a single tile, or more than
    ``PREFETCH_MAX_VEC4`` registers a thread).

    The first tile's loads are issued before the loop; each iteration stores the registers
    into workgroup memory between the two barriers, then issues the next tile's loads
    (``s0 + tile < s_end``: uniform) before computing its entries, so the loads' latency
    overlaps the entries' arithmetic. Each value read and each workgroup-memory slot written
    is the one the plain loop reads and writes (same clamped addresses), so the results are
    the plain loop's bit for bit."""
    BS = k.plan.tile
    segs = [("k", k.dims.d)] + ([("v", k.dims.dv)] if k.mode in ("fwd", "dq") else [])
    vec4s = sum(-(-(BS * -(-n // 4)) // k.plan.size) for _, n in segs)
    if (
        not PREFETCH[0]
        or hasattr(k.prologue, "key_tile")
        or k.split is not None
        or k.n_stream <= BS
        or vec4s > PREFETCH_MAX_VEC4
    ):
        return None
    first, stores, regs, setup, following = [], [], [], [], []
    for seg, n in segs:
        first += _load_tile(k, seg, k.src[seg], row, n, stores, "0u", regs, setup)
        following += _load_tile(k, seg, k.src[seg], row, n, [], f"s0 + {u(BS)}", [])
    before = [*setup, *(f"  var {r}: vec4<f32>;" for r in regs)]
    before += ["  if (0u < s_end) {", *first, "  }"]
    body = ["    workgroupBarrier();", *stores, "    workgroupBarrier();"]
    body += [f"    if (s0 + {u(BS)} < s_end) {{", *following, "    }", *_entries(k)]
    return before, body


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
