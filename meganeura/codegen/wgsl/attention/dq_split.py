"""The query gradient with its keys split over workgroups, for long query blocks that give the
plain lane kernel too few threads (``splits.choose_long_split``, mode ``dq``): two dispatches.

1. The lane kernel in ``dq`` mode with a ``splits.Split`` (``lane.lower_flash``): one workgroup
   per (batch, kv head, row tile, key chunk); each row sums its chunk's keys' part of
   ``dq_i = sum_j ds_ij k_j`` (FlashAttention-2's backward, Dao 2023, Algorithm 2 line 11,
   restricted to the chunk) and writes it, unscaled, to the scratch ``PARTIALS`` at
   ``(row, chunk)``; a chunk with no key to stream (causal tiles' later chunks) writes zeros.
   A dq that computes its rows' delta (``dq_delta``) computes it in every chunk (one dot of
   the row's dO and output) and stores the pairs from chunk 0 only.
2. The sum (``lower_dq_sum``): one thread per element of dq adds the chunks' parts in chunk
   order (a fixed order: results do not depend on scheduling) and scales by the softmax scale,
   as the plain kernel scales its accumulator.
"""

from __future__ import annotations

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import WG
from ..core.literals import f32_literal, u
from .common import PARTIALS, dims_of
from .lane import lower_flash
from .splits import Split


def lower_dq_split(
    graph: Graph, dq_node: int, limits: Limits, split: Split, delta_node: int | None = None
) -> list[KernelSource]:
    """The partial kernel (``dq split CxL``) and the sum (``dq sum C``) of query-gradient
    node ``dq_node``; with ``delta_node`` the partial kernel computes that ``..._delta``
    node's pairs too (``dq_delta``)."""
    parts = lower_flash(graph, dq_node, limits, "dq", split=split, delta_node=delta_node)
    return parts + [lower_dq_sum(graph, dq_node, limits, split)]


def lower_dq_sum(graph: Graph, dq_node: int, limits: Limits, split: Split) -> KernelSource:
    """The second kernel: ``dq = scale * (part_0 + ... + part_{C-1})`` per element, the
    parts of each row read from the scratch ``PARTIALS`` in chunk order."""
    node = graph[dq_node]
    d, nc = dims_of(graph, node, "dq").d, split.chunks
    n = node.type.numel
    rows = n // d
    kb = KernelBuilder(graph, node, limits)
    part = kb.scratch(PARTIALS, rows * nc * d, node.type.dtype, "part")
    out = kb.write(dq_node, "out")
    total = " + ".join(kb.load(part, f"base + {u(c * d)}") for c in range(nc))
    lines = [
        f"  let i = wg * {WG}u + lid;",
        f"  if (i < {u(n)}) {{",
        f"    let row = i / {u(d)};",
        f"    let col = i % {u(d)};",
        f"    let base = row * {u(nc * d)} + col;",
        f"    let ob = {kb.row_offset(out, 'row', d)};",
        "    " + kb.store(out, "ob + col", f"({total}) * {f32_literal(node.attr('scale'))}", True),
        "  }",
    ]
    nbytes = 4 * rows * nc * d + node.type.nbytes
    body = "\n".join(lines)
    return kb.finish(f"dq sum {nc}", body, WG, -(-n // WG), flops=n * nc, nbytes=nbytes)
