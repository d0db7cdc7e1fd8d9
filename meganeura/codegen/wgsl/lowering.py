"""The lowering table: every op of ``meganeura.ops.OPS`` -> the function emitting its kernels.

``LOWERINGS`` is written out here, family by family, in one place (no registration by import
side effect); every non-leaf, non-view op has an entry, and ``tests/test_completeness.py``
checks it. ``lower`` returns one node's dispatches in order, each a ``KernelSource`` whose
group-0 binding i is ``bindings[i]``; ``reads`` returns the values those kernels bind for
reading, which the scheduler uses for liveness and dead-node removal.

Invariants of every kernel (``core.builder``): a value is bound once; views bind the value that
owns their buffer (``graph.ir.resolve_view``); constants are literals; shapes are baked; grids
fold past the per-dimension limit; a node's output is ``ValueRef(node_id, write=True)``, except
effect ops (optimizer updates), which write their param and state inputs in place and bind no
output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

from ...graph.ir import LEAF_OPS, PLACED_OPS, SUBRANGE_OPS, VIEW_OPS, Graph, resolve_view
from ...ops import OPS
from ...ops.attention import BWD_K, BWD_Q, BWD_V, DELTA, LSE, SDPA, STATS
from ...passes import broadcast_views
from ...passes.permute_views import placed_source, view_reads
from ..kernel import KernelSource, Limits
from .attention.lowering import lower_attention, lower_delta
from .attention.rope import lower_rope
from .conv.lowering import (
    lower_conv2d,
    lower_conv2d_backward_input,
    lower_conv2d_backward_weight,
)
from .conv.pool import (
    lower_adaptive_avg_pool2d,
    lower_adaptive_avg_pool2d_backward,
    lower_avg_pool2d,
    lower_avg_pool2d_backward,
    lower_max_pool2d,
    lower_max_pool2d_backward,
)
from .elementwise.loss import lower_bce_with_logits, lower_dropout
from .elementwise.maps import (
    BINARY,
    UNARY,
    lower_arange,
    lower_broadcast_to,
    lower_elementwise,
    lower_permute,
)
from .indexing.copies import lower_cat, lower_pad, lower_slice, lower_slice_backward
from .indexing.gather import (
    lower_gather,
    lower_gather_backward,
    lower_index_copy,
    lower_index_select,
    lower_index_select_backward,
)
from .matmul.lowering import lower_matmul
from .matmul.problem import matmul_operands
from .matmul.quantized import lower_quantized_linear, lower_quantized_linear_backward
from .norm.lowering import (
    lower_norm,
    lower_norm_backward,
    lower_norm_weight_backward,
    lower_update_stats,
    lower_update_stats_into,
)
from .optim import (
    lower_accumulate,
    lower_found_inf,
    lower_guard_clip,
    lower_guard_count,
    lower_update,
)
from .reduce.reductions import lower_reduce
from .reduce.scan import lower_cumsum
from .rowwise.softmax import lower_cross_entropy, lower_cross_entropy_backward, lower_softmax

Lowering = Callable[[Graph, int, Limits], list[KernelSource]]

_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "logsumexp")
_NORMS = ("layer_norm", "rms_norm", "group_norm", "batch_norm")

LOWERINGS: dict[str, Lowering] = {
    # elementwise (elementwise/)
    **{op: lower_elementwise for op in UNARY},
    **{op: lower_elementwise for op in BINARY},
    "where": lower_elementwise,
    "cast": lower_elementwise,
    "broadcast_to": lower_broadcast_to,
    "permute": lower_permute,
    "arange": lower_arange,
    "dropout": lower_dropout,
    "binary_cross_entropy_with_logits": lower_bce_with_logits,
    # rows: softmax and cross-entropy (rowwise/)
    "softmax": lower_softmax,
    "log_softmax": lower_softmax,
    "cross_entropy": lower_cross_entropy,
    "cross_entropy_backward": lower_cross_entropy_backward,
    # reductions and scans (reduce/)
    **{op: lower_reduce for op in _REDUCTIONS},
    "cumsum": lower_cumsum,
    # normalizations (norm/)
    **{op: lower_norm for op in _NORMS},
    **{f"{op}_backward": lower_norm_backward for op in _NORMS},
    **{f"{op}_weight_backward": lower_norm_weight_backward for op in _NORMS},
    "batch_norm_update_stats": lower_update_stats,
    "batch_norm_stats": lower_update_stats,
    "batch_norm_update_stats_into": lower_update_stats_into,
    # matmul (matmul/)
    "matmul": lower_matmul,
    "quantized_linear": lower_quantized_linear,
    "quantized_linear_backward": lower_quantized_linear_backward,
    # attention and rotary embedding (attention/)
    SDPA: partial(lower_attention, mode="fwd"),
    STATS: partial(lower_attention, mode="stats"),
    LSE: partial(lower_attention, mode="lse"),
    DELTA: lower_delta,
    BWD_Q: partial(lower_attention, mode="dq"),
    BWD_K: partial(lower_attention, mode="dk"),
    BWD_V: partial(lower_attention, mode="dv"),
    "apply_rotary_emb": lower_rope,
    # convolution and pooling (conv/)
    "conv2d": lower_conv2d,
    "conv2d_backward_input": lower_conv2d_backward_input,
    "conv2d_backward_weight": lower_conv2d_backward_weight,
    "max_pool2d": lower_max_pool2d,
    "max_pool2d_backward": lower_max_pool2d_backward,
    "avg_pool2d": lower_avg_pool2d,
    "avg_pool2d_backward": lower_avg_pool2d_backward,
    "adaptive_avg_pool2d": lower_adaptive_avg_pool2d,
    "adaptive_avg_pool2d_backward": lower_adaptive_avg_pool2d_backward,
    # copies and gathers (indexing/)
    "slice": lower_slice,
    "slice_backward": lower_slice_backward,
    "pad": lower_pad,
    "cat": lower_cat,
    "gather": lower_gather,
    "gather_backward": lower_gather_backward,
    "index_select": lower_index_select,
    "index_select_backward": lower_index_select_backward,
    "index_copy_": lower_index_copy,
    # optimizer updates (optim.py); update groups lower through optim.lower_update_group
    "sgd_update": lower_update,
    "sgd_momentum_update": lower_update,
    "adam_update": lower_update,
    "accumulate": lower_accumulate,
    "found_inf": lower_found_inf,
    "guard_clip": lower_guard_clip,
    "guard_count": lower_guard_count,
}

# Ops that write some operands in place (optimizer updates, gradient accumulation, running-stat
# updates).
EFFECT_OPS = frozenset(name for name, d in OPS.items() if d.writes)


def lower(
    graph: Graph, node_id: int, limits: Limits, deferred: Mapping | None = None
) -> list[KernelSource]:
    """The dispatches computing node ``node_id``, in the order they must run.

    Args:
        graph: a verified graph.
        node_id: the node to lower.
        limits: the adapter's limits (grid folding, binding sizes, workgroup memory).
        deferred: split-K products never stored, read as the sums of their partials
            (``matmul.deferred``; a ``permute`` and the attention forward read them among
            single-node kernels).

    Returns:
        Kernels, possibly none: leaves, views (``reshape``, ``stop_gradient``), row-block
        aliases (``row_block``) and placed concatenations (``row_concat``) need none, nor do
        nodes with zero elements to write.

    Raises:
        KeyError: for an op with no lowering.
        ValueError: for a bound value of 2^31 elements or more, or one larger than the
            adapter's storage-binding limit (the message names the node).
        ValueError: also for an f16-stored value when ``limits.shader_f16`` is False.
    """
    node = graph[node_id]
    if node.op in LEAF_OPS or node.op in VIEW_OPS or node.op in SUBRANGE_OPS:
        return []
    if node.op in PLACED_OPS:  # its operands' kernels write it
        return []
    if node.op == "permute" and placed_source(graph, node_id) is not None:
        return []  # its operand's kernel writes it in its layout (``passes.permute_views``)
    if node.op not in LOWERINGS:
        raise KeyError(f"no WGSL lowering for op {node.op!r} (node %{node_id})")
    if node.type.numel == 0 and node.op not in EFFECT_OPS:
        return []
    if node.op == "permute" and deferred:
        return lower_permute(graph, node_id, limits, deferred)
    if node.op == SDPA and deferred:  # the forward reading q/k/v's partials (attention.summed)
        return lower_attention(graph, node_id, limits, "fwd", deferred)
    return LOWERINGS[node.op](graph, node_id, limits)


def reads(graph: Graph, node_id: int) -> tuple[int, ...]:
    """The value ids that ``lower(graph, node_id, ...)``'s kernels bind for reading.

    Views report their operand (they read it by sharing its buffer); leaves report nothing.
    Other nodes report their operands with views resolved to the value owning the buffer,
    constants (inlined) left out, transposes folded into a matmul replaced by their input,
    permutes read in place by attention and rotary kernels replaced by the value whose buffer
    they read, a permute written by its operand's kernel reporting that operand
    (``passes.permute_views``), broadcasts read in place by ``cat`` replaced by the value
    broadcast (``passes.broadcast_views``), and duplicates removed; effect ops include the param and
    state they update in place.
    """
    node = graph[node_id]
    if node.op in LEAF_OPS or node.op in SUBRANGE_OPS:  # an alias is storage, as a leaf is
        return ()
    if node.op in VIEW_OPS:
        return (node.inputs[0],)
    if node.op == "matmul":
        ids = matmul_operands(graph, node_id)
    elif node.op in EFFECT_OPS:
        ids = () if graph[node.inputs[0]].type.numel == 0 else node.inputs
        ids = view_reads(graph, node_id, ids)
    elif node.type.numel == 0:
        ids = ()
    elif node.op == "cross_entropy" and graph[node.inputs[0]].type.numel == 0:
        ids = ()
    else:
        ids = view_reads(graph, node_id, node.inputs)
        ids = broadcast_views.view_reads(graph, node_id, ids)
    roots = (resolve_view(graph, i) for i in ids)
    return tuple(dict.fromkeys(r for r in roots if graph[r].op != "constant"))
