"""Pair a group_norm with the SiLU that reads it, for one kernel to compute both (the
normalize-then-activate of a U-Net's or a diffusion model's residual blocks).

The norm kernel stores ``silu(y)`` from its registers (``codegen.wgsl.norm.team
.store_normalized``), and y itself only when something else reads it (in training the SiLU's
gradient does), so the pair costs one dispatch instead of two and the SiLU's read of y goes.
The graph is not rewritten: as ``passes.fuse`` groups, the pair is a ``FusionGroup`` anchored
on the norm, lowered at the SiLU's position.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ..graph.ir import Graph
from ..ops import OPS
from .fuse import FusionGroup
from .permute_views import write_view

ACTIVATIONS = ("silu",)


def plan_norm_activation(
    graph: Graph,
    needed: Sequence[bool],
    taken: Collection[int] = (),
    accept: Callable[[int], bool] = lambda _: True,
) -> tuple[FusionGroup, ...]:
    """Groups (group_norm, silu) where the silu's operand is the norm's output itself.

    A pair forms when both are needed and in no other group (``taken``), the silu has the
    norm's shape and dtype, neither value is written through a placed view, every other
    reader of the norm comes after the silu (the kernel runs there), no op with in-place
    effects lies between them, and ``accept(norm)`` (the lowering serves it:
    ``codegen.wgsl.norm.lowering.norm_act_fusible``). A norm read by several silus pairs with
    the first.

    Returns:
        Groups ordered by their last member; outputs: the silu, and the norm when it is a
        graph output or read by anything besides the silu.
    """
    users = graph.users()
    outs = {v for _, v in graph.outputs}
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    groups = []
    for node in graph.nodes:
        if node.op != "group_norm" or not needed[node.id] or node.id in taken:
            continue
        acts = [
            u for u in users[node.id] if graph[u].op in ACTIVATIONS and needed[u] and u not in taken
        ]
        if not acts:
            continue
        a = acts[0]
        if graph[a].type != node.type or graph[a].inputs != (node.id,):
            continue
        if write_view(graph, a) is not None or write_view(graph, node.id) is not None:
            continue
        if any(u != a and u < a for u in users[node.id]):
            continue
        if any(node.id < e < a for e in effects) or not accept(node.id):
            continue
        stored = node.id in outs or any(u != a for u in users[node.id])
        outputs = (node.id, a) if stored else (a,)
        groups.append(FusionGroup((node.id, a), outputs, node.type.shape, node.id))
    return tuple(groups)
