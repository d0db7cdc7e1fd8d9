"""Pair a group_norm with the SiLU that reads it, and the SiLU's gradient with the norm's input
gradient, for one kernel to compute each pair (the normalize-then-activate of a U-Net's or a
diffusion model's residual blocks).

The norm kernel stores ``silu(y)`` from its registers (``codegen.wgsl.norm.activation
.store_normalized``), and y itself only when something else reads it (in training the SiLU's
gradient does), so the pair costs one dispatch instead of two and the SiLU's read of y goes.
The input-gradient kernel computes its ``g = gy * silu_grad(y)`` from the SiLU gradient's
operands (``activation.GradIn``) and stores g only when read elsewhere (in training the
weight and bias gradients read it).
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
    accept: Callable[[int, int], bool] = lambda n, a: True,
) -> tuple[FusionGroup, ...]:
    """Groups (group_norm, silu) where the silu's operand is the norm's output itself, and
    (silu_backward, group_norm_backward) where the norm gradient's g is the SiLU gradient.

    A pair forms when both are needed and in no other group (``taken``), both have one shape
    (their storage dtypes may differ in the fast mode's storage plan),
    neither value is written through a placed view, every reader of the earlier member
    outside the pair comes after the later one (the kernel runs there), no op with in-place
    effects lies between them, and ``accept(norm node, other member)`` (the lowering serves
    it: ``codegen.wgsl.norm.lowering.norm_act_fusible``). A norm read by several silus pairs
    with the first.

    Returns:
        Groups ordered by their last member, anchored on the norm node; outputs: the later
        member, and the earlier one when it is a graph output or read outside the pair.
    """
    users = graph.users()
    outs = {v for _, v in graph.outputs}
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]

    def free(v: int) -> bool:
        return needed[v] and v not in taken and write_view(graph, v) is None

    groups = []
    for node in graph.nodes:
        if not free(node.id):
            continue
        if node.op == "group_norm":
            acts = [u for u in users[node.id] if graph[u].op in ACTIVATIONS and free(u)]
            if not acts or graph[acts[0]].inputs != (node.id,):
                continue
            first, last = node.id, acts[0]
        elif node.op == "group_norm_backward":
            g = node.inputs[2]
            if graph[g].op != "silu_backward" or not free(g) or g in node.inputs[:2]:
                continue
            first, last = g, node.id
        else:
            continue
        if graph[first].type.shape != graph[last].type.shape:
            continue
        if any(u != last and u < last for u in users[first]):
            continue
        if any(first < e < last for e in effects):
            continue
        if not accept(node.id, last if first == node.id else first):
            continue
        stored = first in outs or any(u != last for u in users[first])
        outputs = (first, last) if stored else (last,)
        groups.append(FusionGroup((first, last), outputs, graph[last].type.shape, node.id))
    return tuple(groups)
