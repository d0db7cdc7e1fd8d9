"""WGSL code generation: one node of a typed graph -> the compute dispatches that compute it.

``LOWERINGS`` is the explicit table from op name to lowering function (no registration by
import side effect); every non-leaf, non-view op of ``meganeura.ops.OPS`` has an entry, and
the completeness test checks it. ``lower`` returns the node's dispatches in order, each a
``KernelSource`` whose group-0 binding i is ``bindings[i]``; ``reads`` returns the values those
kernels bind for reading, which the scheduler uses for liveness and dead-node removal.

Invariants of every kernel (see ``common``): a value is bound once; views bind the value that
owns their buffer; constants are literals; shapes are baked; grids fold past the
per-dimension limit; a node's output is ``ValueRef(node_id, write=True)``, except effect ops
(optimizer updates), which write their param and state inputs in place and bind no output.
"""

from __future__ import annotations

from collections.abc import Callable

from ...graph.ir import LEAF_OPS, Graph
from ...ops import OPS
from ..kernel import KernelSource, Limits
from . import attention, conv, indexing, norm, reduce
from .common import VIEW_OPS, resolve_view
from .elementwise import BINARY, UNARY, lower_broadcast_to, lower_elementwise, lower_permute
from .matmul import lower_matmul, matmul_operands
from .nn import lower_cross_entropy, lower_cross_entropy_backward, lower_softmax
from .optim import lower_update

Lowering = Callable[[Graph, int, Limits], list[KernelSource]]

LOWERINGS: dict[str, Lowering] = {
    **{op: lower_elementwise for op in UNARY},
    **{op: lower_elementwise for op in BINARY},
    "where": lower_elementwise,
    "cast": lower_elementwise,
    "broadcast_to": lower_broadcast_to,
    "permute": lower_permute,
    "softmax": lower_softmax,
    "log_softmax": lower_softmax,
    "matmul": lower_matmul,
    "cross_entropy": lower_cross_entropy,
    "cross_entropy_backward": lower_cross_entropy_backward,
    "sgd_update": lower_update,
    "sgd_momentum_update": lower_update,
    "adam_update": lower_update,
    # Families added later keep their tables beside their emitters.
    **reduce.LOWERINGS,
    **indexing.LOWERINGS,
    **conv.LOWERINGS,
    **norm.LOWERINGS,
    **attention.LOWERINGS,
}

# Ops that write some operands in place (optimizer updates, running-stat updates).
EFFECT_OPS = frozenset(name for name, d in OPS.items() if d.writes)


def lower(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """The dispatches computing node ``node_id``, in the order they must run.

    Args:
        graph: a verified graph.
        node_id: the node to lower.
        limits: the adapter's limits (grid folding, binding sizes, workgroup memory).

    Returns:
        Kernels, possibly none: leaves and views (``reshape``, ``stop_gradient``) need none,
        nor do nodes with zero elements to write.

    Raises:
        KeyError: for an op with no lowering.
        ValueError: for a bound value of 2^31 elements or more, or one larger than the
            adapter's storage-binding limit (the message names the node).
        ValueError: also for an f16-stored value when ``limits.shader_f16`` is False.
    """
    node = graph[node_id]
    if node.op in LEAF_OPS or node.op in VIEW_OPS:
        return []
    if node.op not in LOWERINGS:
        raise KeyError(f"no WGSL lowering for op {node.op!r} (node %{node_id})")
    if node.type.numel == 0 and node.op not in EFFECT_OPS:
        return []
    return LOWERINGS[node.op](graph, node_id, limits)


def reads(graph: Graph, node_id: int) -> tuple[int, ...]:
    """The value ids that ``lower(graph, node_id, ...)``'s kernels bind for reading.

    Views report their operand (they read it by sharing its buffer); leaves report nothing.
    Other nodes report their operands with views resolved to the value owning the buffer,
    constants (inlined) left out, transposes folded into a matmul replaced by their input,
    and duplicates removed; effect ops include the param and state they update in place.
    """
    node = graph[node_id]
    if node.op in LEAF_OPS:
        return ()
    if node.op in VIEW_OPS:
        return (node.inputs[0],)
    if node.op == "matmul":
        ids = matmul_operands(graph, node_id)
    elif node.op in EFFECT_OPS:
        ids = () if graph[node.inputs[0]].type.numel == 0 else node.inputs
    elif node.type.numel == 0:
        ids = ()
    elif node.op == "cross_entropy" and graph[node.inputs[0]].type.numel == 0:
        ids = ()
    else:
        ids = node.inputs
    roots = (resolve_view(graph, i) for i in ids)
    return tuple(dict.fromkeys(r for r in roots if graph[r].op != "constant"))


__all__ = ["LOWERINGS", "lower", "reads", "Limits", "KernelSource"]
