"""Split-key forward attention for short query blocks (flash-decoding: Dao, Haziza, Massa and
Sizov 2023): two dispatches.

1. The lane kernel (``lane.lower_flash`` with a ``splits.Split``): one workgroup per (batch, kv
   head, row tile, key chunk), every query row of the kv head's group in the tile; it keeps
   the online-softmax state of each row over its chunk's keys (the runtime ``kv_length``, the
   mask and the lower-right causal rule apply as in the plain kernel, so chunks past the last
   key stream nothing) and writes ``(m, l, o[0..Dv))`` per (row, chunk) to scratch, ``o``
   unnormalized; a workgroup whose chunk lies past the last key it may see (most of a decoding
   cache) stores only ``m`` = the lowest finite f32 and ``l = 0`` and returns at once.
2. The merge (``lower_merge``): one thread per output element; with ``M = max_c m_c`` it forms
   ``L = sum_c l_c exp(m_c - M)`` and ``out = (sum_c o_c exp(m_c - M)) / L`` over the chunks in
   ascending order (``o_c`` taken as 0 where ``l_c = 0``: an empty chunk's row is not
   written), a fixed order, so results do not depend on scheduling. A row with no
   unmasked key (every chunk has ``l = 0``) writes zeros, as the plain kernel does; an empty
   chunk holds ``m`` = the lowest finite f32, so its weight underflows to 0 beside any
   nonempty chunk.
"""

from __future__ import annotations

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import WG
from .common import LOWEST, PARTIALS, dims_of
from .lane import lower_flash
from .splits import Split


def lower_split(
    graph: Graph, node_id: int, limits: Limits, split: Split, lse_node: int | None = None
) -> list[KernelSource]:
    """The partial kernel and the merge kernel of forward attention node ``node_id``; with
    ``lse_node`` the merge also writes that ``..._lse`` node's rows."""
    return lower_flash(graph, node_id, limits, "fwd", split=split) + [
        lower_merge(graph, node_id, limits, split, lse_node)
    ]


def lower_merge(
    graph: Graph, node_id: int, limits: Limits, split: Split, lse_node: int | None = None
) -> KernelSource:
    """The second kernel: every chunk's partial state of each output row, combined in chunk
    order (see the module docstring). With ``lse_node`` the thread of each row's first
    element also stores the row's log-sum-exp ``M + log(L)`` (0 for a row with no unmasked
    key, as the unsplit ``fwd+lse`` kernel stores it)."""
    node = graph[node_id]
    dims = dims_of(graph, node, "fwd")
    dv, nc = dims.dv, split.chunks
    rows = node.type.numel // dv
    kb = KernelBuilder(graph, node, limits)
    part = kb.scratch(PARTIALS, rows * nc * (dv + 2), node.type.dtype, "part")
    out = kb.write(node_id, "out")
    lse = None if lse_node is None else kb.write(lse_node, "lse")
    n = node.type.numel
    stride = dv + 2

    def at(index: str) -> str:
        return kb.load(part, index)

    lines = [
        f"  let i = wg * {WG}u + lid;",
        f"  if (i < {n}u) {{",
        f"    let row = i / {dv}u;",
        f"    let col = i % {dv}u;",
        f"    let base = row * {nc * stride}u;",
    ]
    # unrolled over the chunks (at most splits.SPLIT_MAX_CHUNKS): every load in flight at once
    lines += [f"    let m{c} = {at(f'base + {c * stride}u')};" for c in range(nc)]
    mx = LOWEST
    for c in range(nc):
        mx = f"max({mx}, m{c})"
    lines.append(f"    let mx = {mx};")
    lines += [f"    let w{c} = exp(m{c} - mx);" for c in range(nc)]
    lines += [f"    let l{c} = {at(f'base + {c * stride + 1}u')};" for c in range(nc)]
    # an empty chunk (l = 0) stores no output row: select, never multiply, what it holds
    lines += [
        f"    let o{c} = select(0.0, {at(f'base + {c * stride + 2}u + col')}, l{c} > 0.0);"
        for c in range(nc)
    ]
    l_sum = " + ".join(f"l{c} * w{c}" for c in range(nc))
    o_sum = " + ".join(f"o{c} * w{c}" for c in range(nc))
    lines += [
        f"    let l = {l_sum};",
        f"    let o = {o_sum};",
        "    " + kb.store(out, "i", "o * select(0.0, 1.0 / l, l > 0.0)"),
    ]
    if lse is not None:
        lines += [
            "    if (col == 0u) {",
            "      " + kb.store(lse, "row", "select(0.0, mx + log(l), l > 0.0)"),
            "    }",
        ]
    lines.append("  }")
    groups = -(-n // WG)
    nbytes = 4 * rows * nc * (dv + 2) + node.type.nbytes + (0 if lse is None else 4 * rows)
    return kb.finish(f"merge {nc}", "\n".join(lines), WG, groups, flops=4 * n * nc, nbytes=nbytes)
