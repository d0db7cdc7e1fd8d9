"""cumsum: inclusive prefix sums along one dim, forward or reversed (attr ``reverse``).

The input is viewed as [outer, n, inner]; each (outer, inner) pair is a row of ``n`` elements
with stride ``inner``, scanned in logical order ``j`` (element ``n - 1 - j`` when reversed).

  * Short rows (n <= SERIAL): one thread per row, a serial running sum (neighbouring rows on
    neighbouring lanes, so strided rows read coalesced).
  * Longer rows are scanned in tiles of TILE = WG * PER elements by one workgroup: the tile
    is loaded coalesced into workgroup memory, each thread scans its PER consecutive
    elements, the per-thread totals are scanned by Hillis-Steele doubling (log2(WG) levels),
    and ``carry + (exclusive + local)`` is written back coalesced. Rounding error therefore
    grows with log(position) inside a tile and with the number of tiles before it.
  * When rows span several tiles and there are few rows, the scan is blocked over three
    dispatches: (1) each tile's total into scratch, one workgroup per (row, tile); (2) an
    inclusive scan of those totals per row (the same tile kernel); (3) each tile scanned
    again with the preceding totals as its carry. Otherwise one workgroup per row walks its
    tiles, carrying the running total.
Integer scans wrap on overflow like the i32 add they are built from.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, compute_dtype
from ..core.layout import WG
from ..core.literals import u, zero

SERIAL = 64  # rows this short are summed by one thread
PER = 4  # consecutive elements each thread scans serially inside a tile
TILE = WG * PER
MANY_ROWS = 512  # enough rows to fill a GPU with one workgroup per row


def _tile(read: Callable[[str], str], n: int, zero_lit: str) -> str:
    """Scan the tile of logical elements ``t0 .. t0 + TILE - 1`` (those < n) of one row, given
    ``t0`` and ``carry``; leaves ``carry + prefix`` of element ``t0 + e`` in ``tile[e]`` and
    the tile's sum in ``total``. Ends with a barrier, so ``tot`` may be reused at once."""
    lines = []
    for k in range(PER):
        j = f"t0 + lid + {u(k * WG)}"
        lines.append(
            f"  {{ let j = {j}; tile[lid + {u(k * WG)}] = "
            f"select({zero_lit}, {read(f'min(j, {u(n - 1)})')}, j < {u(n)}); }}"
        )
    lines.append("  workgroupBarrier();")
    lines.append(f"  let v0 = tile[lid * {u(PER)}];")
    lines += [f"  let v{k} = v{k - 1} + tile[lid * {u(PER)} + {u(k)}];" for k in range(1, PER)]
    lines += [f"  tot[lid] = v{PER - 1};", "  workgroupBarrier();"]
    s = 1
    while s < WG:
        lines.append(f"  {{ let t = select({zero_lit}, tot[max(lid, {u(s)}) - {u(s)}], "
                     f"lid >= {u(s)}); workgroupBarrier(); tot[lid] = tot[lid] + t; "
                     "workgroupBarrier(); }")  # fmt: skip
        s *= 2
    lines.append(f"  let excl = select({zero_lit}, tot[max(lid, 1u) - 1u], lid > 0u);")
    lines += [f"  tile[lid * {u(PER)} + {u(k)}] = carry + (excl + v{k});" for k in range(PER)]
    lines += [f"  let total = tot[{u(WG - 1)}];", "  workgroupBarrier();"]
    return "\n".join(lines) + "\n"


def _store(write: Callable[[str, str], str], n: int) -> str:
    """Write the tile's results (coalesced), then let the tile's memory be reused."""
    lines = [
        f"  {{ let j = t0 + lid + {u(k * WG)}; if (j < {u(n)}) {{ "
        f"{write('j', f'tile[lid + {u(k * WG)}]')} }} }}"
        for k in range(PER)
    ]
    return "\n".join(lines) + "\n  workgroupBarrier();\n"


def _shared(ty: str) -> str:
    return f"var<workgroup> tile: array<{ty}, {TILE}>;\nvar<workgroup> tot: array<{ty}, {WG}>;\n"


def lower_cumsum(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``cumsum`` along attr ``dim`` (reversed when attr ``reverse``): one dispatch, or three
    for few long rows (see the module docstring)."""
    node = graph[node_id]
    shape = node.type.shape or (1,)
    dim = node.attr("dim")
    dtype = compute_dtype(node.type.dtype)
    n = shape[dim]
    inner = math.prod(shape[dim + 1 :])
    rows = node.type.numel // n
    z = zero(dtype)
    ty = dtype.wgsl
    reverse = node.attr("reverse")

    def addr(row: str, j: str) -> str:
        pos = f"({u(n - 1)} - {j})" if reverse else j
        if inner == 1:
            return f"{row} * {u(n)} + {pos}"
        return f"({row} / {u(inner)}) * {u(n * inner)} + {row} % {u(inner)} + {pos} * {u(inner)}"

    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    flops, nbytes = node.type.numel, 2 * node.type.nbytes
    if n <= SERIAL:
        out = kb.write(node_id, "out")
        body = (
            f"  let row = wg * {u(WG)} + lid;\n  if (row >= {u(rows)}) {{ return; }}\n"
            f"  var acc = {z};\n"
            f"  for (var j = 0u; j < {u(n)}; j = j + 1u) {{\n"
            f"    acc = acc + {x.at(addr('row', 'j'))};\n"
            f"    {kb.store(out, addr('row', 'j'), 'acc')}\n"
            "  }\n"
        )
        return [kb.finish("", body, WG, -(-rows // WG), "", flops, nbytes)]

    tiles = -(-n // TILE)
    if tiles == 1 or rows >= MANY_ROWS:
        out = kb.write(node_id, "out")
        body = f"  let row = wg;\n  var carry = {z};\n"
        body += f"  for (var t0 = 0u; t0 < {u(n)}; t0 = t0 + {u(TILE)}) {{\n"
        body += _tile(lambda j: x.at(addr("row", j)), n, z)
        body += _store(lambda j, v: kb.store(out, addr("row", j), v), n)
        body += "  carry = carry + total;\n  }\n"
        return [kb.finish("", body, WG, rows, _shared(ty), flops, nbytes)]

    # Blocked: tile totals, their per-row scan, then every tile again with its offset.
    sums = kb.scratch("tiles", rows * tiles, dtype, "tile_sums")
    body = f"  let row = wg / {u(tiles)};\n  let t0 = (wg % {u(tiles)}) * {u(TILE)};\n"
    body += f"  let carry = {z};\n" + _tile(lambda j: x.at(addr("row", j)), n, z)
    body += f"  if (lid == 0u) {{ {sums}[wg] = total; }}\n"
    first = kb.finish("tiles", body, WG, rows * tiles, _shared(ty), flops, node.type.nbytes)

    kb2 = KernelBuilder(graph, node, limits)
    s2 = kb2.scratch("tiles", rows * tiles, dtype, "tile_sums")
    o2 = kb2.scratch("offsets", rows * tiles, dtype, "offsets")
    body = f"  let row = wg;\n  var carry = {z};\n"
    body += f"  for (var t0 = 0u; t0 < {u(tiles)}; t0 = t0 + {u(TILE)}) {{\n"
    body += _tile(lambda j: f"{s2}[row * {u(tiles)} + {j}]", tiles, z)
    body += _store(lambda j, v: f"{o2}[row * {u(tiles)} + {j}] = {v};", tiles)
    body += "  carry = carry + total;\n  }\n"
    second = kb2.finish("offsets", body, WG, rows, _shared(ty))

    kb3 = KernelBuilder(graph, node, limits)
    x3 = kb3.read(node.inputs[0], "x")
    o3 = kb3.scratch("offsets", rows * tiles, dtype, "offsets")
    out = kb3.write(node_id, "out")
    body = f"  let row = wg / {u(tiles)};\n  let t0 = (wg % {u(tiles)}) * {u(TILE)};\n"
    body += f"  let carry = select({z}, {o3}[max(wg, 1u) - 1u], wg % {u(tiles)} > 0u);\n"
    body += _tile(lambda j: x3.at(addr("row", j)), n, z)
    body += _store(lambda j, v: kb3.store(out, addr("row", j), v), n)
    third = kb3.finish("scan", body, WG, rows * tiles, _shared(ty), flops, nbytes)
    return [first, second, third]
