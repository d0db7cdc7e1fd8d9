"""Hoisting: an elementwise node moved up next to the fusion group it reads, so it can join.

Fusion (``passes.fuse``) lowers a group at its last member's position and refuses a member
that another node reads before then. In SwiGLU's backward that splits one kernel's worth of
work in two: the epilogue of the matmul giving ``dh`` computes ``dh * up`` and
``dh * silu(gate)``, the down projection's input-gradient matmul reads ``dh * silu(gate)``
next, and only after it comes ``silu_backward(dh * up, gate)``, which the autodiff emitted
later. That node cannot join the epilogue (the matmul in between reads a member first), so
it ran as a dispatch of its own: 30 a step in SmolLM2's training step and 16 in SmolVLA's, ~8.5
us each on the H200 (1.8% of both steps).

``hoist_fusible`` asks ``passes.fuse.plan_fusion`` for the groups of the graph as it stands
and moves a node ``c`` (an op of ``fusible``, no view, in no group) to just after the sink of a
group ``g`` that one of its operands belongs to, when

  * every operand of ``c`` is defined by then (none after ``g``'s sink),
  * an outside reader of a member of ``g`` lies between ``g``'s sink and ``c`` (what keeps
    ``c`` out of ``g``), and
  * no node with effects (an optimizer update, a running-statistics or cache write) lies
    between the two positions, so ``c`` reads the same values.

The scheduler's own ``plan_fusion`` then sees ``c`` before those readers and may take it into
``g`` (it still checks every rule: bindings, shapes, effects). At the H200's limits SmolLM2's
training step goes from 768 to 738 dispatches, SmolVLA's from 377 to 361, every
``silu_backward`` gone into its matmul's epilogue; ResNet-50's, whisper-tiny's and the
U-Net's are unchanged.

Nothing else changes: the same nodes, inputs and attributes, renumbered in the new order
(``passes.simplify.reorder``). The moved node's value lives a few nodes longer.

Switch: ``set_enabled`` (default on; ``bench/lever_ab.py`` lever ``fusion_hoist``).
"""

from __future__ import annotations

from collections.abc import Collection

from ..graph.ir import VIEW_OPS, Graph
from ..ops import OPS
from .simplify import reorder

ENABLED = True


def set_enabled(on: bool) -> None:
    """Hoist blocked elementwise nodes (True, the default) or keep the traced order."""
    global ENABLED
    ENABLED = bool(on)


def hoist_fusible(
    graph: Graph, fusible: Collection[str], max_bindings: int | None = None
) -> tuple[Graph, dict[int, int]]:
    """``graph`` with each blocked elementwise node moved up to just after the fusion group it
    reads (module docstring), and old id -> new id; the graph itself and the identity when
    nothing moves or hoisting is off. ``fusible`` and ``max_bindings`` are those the
    scheduler passes to ``plan_fusion``."""
    identity = {n.id: n.id for n in graph.nodes}
    if not ENABLED:
        return graph, identity
    from .fuse import plan_fusion

    groups = plan_fusion(graph, fusible, None, max_bindings)
    group_of = {m: g for g in groups for m in g.members}
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    after: dict[int, list[int]] = {}  # a group's sink -> nodes hoisted to just after it
    moved: set[int] = set()
    for c in graph.nodes:
        if c.op not in fusible or c.op in VIEW_OPS or c.id in group_of or not c.inputs:
            continue
        for g in dict.fromkeys(group_of[p] for p in c.inputs if p in group_of):
            sink = g.sink
            if max(c.inputs) > sink or sink + 1 == c.id or any(i in moved for i in c.inputs):
                continue
            members = set(g.members)
            blocked = any(sink < u < c.id for m in g.members for u in users[m] if u not in members)
            if not blocked or any(sink < e < c.id for e in effects):
                continue
            after.setdefault(sink, []).append(c.id)
            moved.add(c.id)
            break
    if not moved:
        return graph, identity
    order: list[int] = []
    for n in graph.nodes:
        if n.id in moved:
            continue
        order.append(n.id)
        order += after.get(n.id, [])
    return reorder(graph, order)
