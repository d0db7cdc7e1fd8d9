"""Cooperative copies of a lane kernel's stream tiles into workgroup memory (``load_tile``)
and their register prefetch (``prefetch``), for ``lane_stream`` and ``dkv_half``.

Prefetch: the stream loop loads the next tile's segments into registers while the current tile
is computed. The first tile's loads are issued before the loop; each iteration stores the
registers into workgroup memory between its two barriers, then issues the next tile's loads
(guarded by a uniform condition, the next tile's first entry below the stream's end) before
computing its entries, so the loads' latency overlaps the entries' arithmetic. Which loops
prefetch (``prefetch``'s rule, at most ``PREFETCH_MAX_VEC4`` vec4 registers a thread, each
thread's share of a segment's vec4s rounded up, a stats entry counting one):

- query-row loops (``fwd``, ``stats``, ``lse``, ``dq``; ``lane_stream._stream_loops``): their
  key (and value) tiles, all or nothing, in a split kernel's chunks too (``SPLIT_PREFETCH``
  and ``Split.prefetch``); not a prologue's key copy, a short query block or a single key
  tile;
- key-row loops (``dk``, ``dv``, ``dkv half``; ``lane_stream.key_row_loops``): within each
  query head's stream of at least two query tiles, the longest prefix of (q, dO, stats) that
  fits; the segments past it are copied as before, between the barriers. Not the lane
  ``dkv``, which already keeps k, v, dk and dv in one thread (64 vec4s at D = 64, past what
  NVIDIA holds without spilling).

On the H200's limits that is Whisper's (1 x 6 x 1500 x 64) fwd+lse and dq+delta (k, v: 4 + 4
registers), its dk or dv (q, dO: 4 + 4; the stats, 1 more, copied in the loop) and its dkv
half (q and dO: 4 + 4 of its 16-entry tiles); SmolLM2's fwd+lse, dq+delta
(k, v) and dk (q only), not its dv (64-entry tiles: q alone takes 16) or dkv. The key-row
prefetch is timed in docs/attention.md.

Each value read and each workgroup-memory slot written is the plain loop's (same clamped
addresses, same entries), so the results are the plain loop's bit for bit
(tests/codegen/test_attention_prefetch.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.builder import Src
from ..core.literals import u

if TYPE_CHECKING:
    from .lane_stream import _Kernel

# PREFETCH is a bench A/B switch (``set_prefetch``; lever attention_prefetch), never changed
# by the compiler. The budget: vec4 registers a thread may hold for the next tile.
PREFETCH = [True]
PREFETCH_MAX_VEC4 = 8
# The chunks of a split query-row kernel (``splits.Split``: fwd, dq) prefetch too, unless their
# split says not (``Split.prefetch``, from ``tuned.TUNED_SPLIT``). Measured on the H200
# (bench/attention_split.py, eighth session): the rule's dq plan at Whisper (32x2x16, 3 chunks)
# 872 us without, 468 with; 32x1x8: dq 355 without, 367 with; the forward 224 without, 216
# with. A bench A/B switch (``set_split_prefetch``; lever attention_split_prefetch).
SPLIT_PREFETCH = [True]


def set_prefetch(on: bool) -> None:
    """Let the lane stream loops prefetch their next tile (on, the default) or not, for
    programs compiled from now on."""
    PREFETCH[:] = [bool(on)]


def set_split_prefetch(on: bool) -> None:
    """Let the chunks of split query-row kernels prefetch their next key tile within their
    chunk where their split allows (on, the default) or never (off), for programs compiled
    from now on."""
    SPLIT_PREFETCH[:] = [bool(on)]


def load_tile(
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
    ``src``; ``row`` is the stream entry's row index in ``src``) into workgroup memory. The
    ``st`` segment (key-row modes) holds each entry's (lse, delta) pair in a vec4's x, y.

    With ``stores`` (forwards of short query blocks, prefetching loops) the copy is unrolled:
    the returned statements load into registers and the workgroup-memory stores are appended
    to ``stores``, for the caller to place after every segment's loads. ``at`` is the tile's
    first stream entry (an expression); with ``regs`` the registers are variables the caller
    declares (their declarations, ``name: type``, are appended to ``regs``) and the returned
    statements assign them inside a block of their own, so the same loads can be emitted twice
    (``prefetch``); the tile-independent indices they and the stores use are appended to
    ``setup`` (given with the first emission only), for the caller to place once before the
    loop."""
    off, stride = k.layout[seg]
    # with a runtime key count, reads stop at the last kept key (kvl >= 1 inside the loop), so
    # the tile's entries past it repeat finite data (0 * NaN in a stale slot would be NaN)
    last = "kvl - 1u" if k.kvlen is not None else u(k.n_stream - 1)
    step = u(k.plan.size)
    st = seg == "st"
    if st:
        width = 1

        def value(base: str, c: str) -> str:
            return f"vec2<f32>({src.at(base)}, {src.at(f'{base} + 1u')})"

    else:
        width = -(-n // 4)

        def value(base: str, c: str) -> str:
            if n % 4 == 0:
                return src.at4(base)
            comps = []
            for e in range(4):  # the row's last vec4 is partial: clamp the read, zero the value
                load = src.at_offset(f"min({base} + {u(e)}, {u(src.type.numel - 1)})")
                comps.append(f"select(0.0, {load}, {c} * 4u + {u(e)} < {u(n)})")
            return f"vec4<f32>({', '.join(comps)})"

    total = k.plan.tile * width
    if stores is not None:  # straight-line loads, all in flight at once
        lines = []
        for it in range(-(-total // k.plan.size)):
            e, guarded = f"{seg}e{it}", (it + 1) * k.plan.size > total
            first = f"lid + {u(it * k.plan.size)}"
            mine = [("e", f"min({first}, {u(total - 1)})" if guarded else first)]
            row_e = row.replace("sr", f"{e}sr")
            if st:
                mine += [("sr", f"min({at} + {e}e, {last})"), ("base", f"({row_e}) * 2u")]
                slot = f"{e}e"
            else:
                mine += [
                    ("rr", f"{e}e / {u(width)}"),
                    ("c", f"{e}e % {u(width)}"),
                    ("sr", f"min({at} + {e}rr, {last})"),
                    ("base", f"{src.row_offset(row_e)} + {e}c * 4u"),
                ]
                slot = f"{e}rr * {u(stride)} + {e}c"
            lets = [f"    let {e}{name} = {expr};" for name, expr in mine]
            if regs is None:
                lines += [*lets, f"    let {e}v = {value(f'{e}base', f'{e}c')};"]
            else:  # the tile-independent indices once, before the loop; per tile the rest
                regs.append(f"{e}v: {'vec2' if st else 'vec4'}<f32>")
                fixed = len(mine) - 2
                if setup is not None:
                    setup += [line.replace("    let", "  let", 1) for line in lets[:fixed]]
                load = f"    {e}v = {value(f'{e}base', f'{e}c')};"
                lines += ["    {", *lets[fixed:], load, "    }"]
            v = f"vec4<f32>({e}v, 0.0, 0.0)" if st else f"{e}v"
            store = f"sh[{u(off)} + {slot}] = {v};"
            stores.append(
                f"    if ({first} < {u(total)}) {{ {store} }}" if guarded else f"    {store}"
            )
        return lines
    if st:
        return [
            f"    for (var e = lid; e < {u(k.plan.tile)}; e = e + {step}) {{",
            f"      let sr = min(s0 + e, {last});",
            f"      let base = ({row}) * 2u;",
            f"      let lse_delta = vec2<f32>({src.at('base')}, {src.at('base + 1u')});",
            f"      sh[{u(off)} + e] = vec4<f32>(lse_delta, 0.0, 0.0);",
            "    }",
        ]
    return [
        f"    for (var e = lid; e < {u(total)}; e = e + {step}) {{",
        f"      let rr = e / {u(width)};",
        f"      let c = e % {u(width)};",
        f"      let sr = min(s0 + rr, {last});",
        f"      let base = {src.row_offset(row)} + c * 4u;",
        f"      sh[{u(off)} + rr * {u(stride)} + c] = {value('base', 'c')};",
        "    }",
    ]


def registers(k: _Kernel, segs: list[tuple[str, int]]) -> int:
    """vec4 registers a thread holds to prefetch segments ``segs`` ((name, floats per entry),
    the stats ``st`` counting one per entry) of one tile: its share of each segment's
    vec4s, rounded up."""
    tile, size = k.plan.tile, k.plan.size
    return sum(-(-(tile * (1 if s == "st" else -(-n // 4))) // size) for s, n in segs)


def prefetch(
    k: _Kernel,
    segs: list[tuple[str, int]],
    srcs: dict[str, Src],
    row: str,
    start: str,
    end: str,
    partial: bool = True,
) -> tuple[list[str], list[str], list[str], list[str]] | None:
    """The pieces of a stream loop ``for (s0 = start; s0 < end; s0 += tile)`` over tiles of
    segments ``segs`` ((name, floats per entry), read from ``srcs[name]``) that prefetches the
    longest prefix of ``segs`` taking at most ``PREFETCH_MAX_VEC4`` registers a thread
    (``registers``; without ``partial``: all of them), or None where none fits or
    ``PREFETCH`` is off: (declarations, once
    before the loop and outside any loop the stream is nested in; the first tile's loads,
    right before the loop; the copies between the loop's two barriers: the registers' stores,
    then the plain copies of the segments not prefetched; the next tile's loads, after the
    second barrier). ``start`` and ``end`` must be uniform."""
    if not PREFETCH[0]:
        return None
    pre = []
    while len(pre) < len(segs) and registers(k, segs[: len(pre) + 1]) <= PREFETCH_MAX_VEC4:
        pre.append(segs[len(pre)])
    if not pre or (not partial and len(pre) < len(segs)):
        return None
    BS = k.plan.tile
    first, stores, regs, setup, following = [], [], [], [], []
    for seg, n in pre:
        first += load_tile(k, seg, srcs[seg], row, n, stores, start, regs, setup)
        following += load_tile(k, seg, srcs[seg], row, n, [], f"s0 + {u(BS)}", [])
    rest = [line for seg, n in segs[len(pre) :] for line in load_tile(k, seg, srcs[seg], row, n)]
    decls = [*setup, *(f"  var {r};" for r in regs)]
    return (
        decls,
        [f"  if ({start} < {end}) {{", *first, "  }"],
        stores + rest,
        [f"    if (s0 + {u(BS)} < {end}) {{", *following, "    }"],
    )
