"""Storage precision for the fast mode: which floating values are stored as f16.

``narrow_storage`` is the last rewrite before scheduling. It changes the ``TensorType`` of
chosen values from f32 to f16 and nothing else: the ops, their order and their operands stay
as they were. The kernels read an f16 value widened to f32 and narrow on store
(``codegen.wgsl.core.builder.KernelBuilder``), so every operation and every accumulation still
runs in f32 and only the bytes moved through memory are halved (the "f16 storage, f32
accumulation" scheme of mixed-precision training, Micikevicius et al., "Mixed Precision
Training", ICLR 2018; with a static loss scale when ``CompileOptions.loss_scale`` asks).

Because operands of one op may now differ in dtype, the rewritten graph is a storage plan,
not a graph the type rules would accept: it must not be passed to the builder, the
verifier or another pass; only ``schedule`` (and through it the lowerings) consumes it.

What stays f32 (the rules, in order):
  * leaves other than parameters: program inputs (fed by the host), optimizer state and
    constants (inlined as literals);
  * parameters, unless ``parameters=True`` (forward-only programs); in a training program
    they are the f32 master weights the optimizer updates in place;
  * every operand of an op with in-place effects (optimizer updates, running-statistics
    updates), which covers parameters, their gradients and optimizer state;
  * the values named in ``keep`` (the compiler passes each parameter's gradient and every
    node of the optimizer tail: gradient clipping's sums of squares and norm);
  * values whose storage is fetched as a graph output;
  * values that may leave f16's range (magnitude above 65504 or below its normal range):
    those whose degree, counted by ``passes.ranges`` (squares, products of activations,
    ``pow``, ``exp`` of a value not known to be <= 0, sums of more than 256 terms, and their
    consumers until a bounded op such as ``tanh``, ``softmax``, ``log`` or a normalization),
    exceeds one activation;
  * values of ``WIDE_OPS``: reductions that sum (their result can exceed f16's range of
    65504 or need more than its 11 significant bits: sums, means, variances, log-sum-exp,
    prefix sums), losses, attention's log-sum-exp statistics, and ``arange`` (positions and
    coordinates past 2048 are not integers in f16);
    the extrema ``amax``, ``amin``, ``max`` and ``min`` too: their gradients find the
    extremal elements by ``x == amax(x)``, which an f16-rounded extremum of an f32 ``x``
    (an input) never equals;
  * every non-floating value.
Everything else floating (activations, activation gradients and, when allowed, parameters)
becomes f16. A view (``reshape``, ``stop_gradient``) always takes its storage owner's dtype,
since it shares that value's buffer; so does an in-place write returning its storage
(``index_copy_``: a state, which stays f32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from ..dtypes import DType
from ..graph.ir import ALIAS_OPS, VIEW_OPS, Graph, TensorType, resolve_view
from ..ops import OPS
from .ranges import degrees, fits_f16

WIDE_OPS = frozenset(
    {
        "sum",
        "mean",
        "var",
        "logsumexp",
        "cumsum",
        "cross_entropy",
        "binary_cross_entropy_with_logits",
        "scaled_dot_product_attention_stats",
        "scaled_dot_product_attention_lse",
        "scaled_dot_product_attention_delta",
        "arange",
        "amax",
        "amin",
        "max",
        "min",
    }
)
NARROW_LEAVES = frozenset({"parameter"})


def half_candidates(
    graph: Graph, keep: Collection[int] = (), parameters: bool = False, ranges: bool = True
) -> frozenset[int]:
    """The storage owners (non-view values) that ``narrow_storage`` stores as f16.

    Args:
        graph: a verified graph (the last one before scheduling).
        keep: node ids that must stay f32 (a view keeps its storage owner f32).
        parameters: allow parameters too (forward-only programs).
        ranges: keep values that may leave f16's range in f32 (``passes.ranges``); False
            only to measure what the range rule costs.

    Returns:
        Ids of f32 values, none of them a view, leaf other than a parameter, or output.
    """
    deg = degrees(graph) if ranges else {}
    wide = {resolve_view(graph, v) for v in keep}
    wide |= {resolve_view(graph, v) for _, v in graph.outputs}
    for node in graph.nodes:
        d = OPS.get(node.op)
        if d is not None and d.writes:
            wide |= {resolve_view(graph, i) for i in node.inputs}
    out = []
    for node in graph.nodes:
        if node.type.dtype is not DType.f32 or node.id in wide or node.op in VIEW_OPS:
            continue
        if node.op in ALIAS_OPS:  # in-place writes (index_copy_) are their state's storage
            continue
        if node.op in WIDE_OPS or node.op == "constant" or not fits_f16(deg.get(node.id, 0.0)):
            continue
        if node.op in ("input", "state"):
            continue
        if node.op == "parameter" and not parameters:
            continue
        out.append(node.id)
    return frozenset(out)


def narrow_storage(
    graph: Graph, keep: Collection[int] = (), parameters: bool = False, ranges: bool = True
) -> tuple[Graph, frozenset[int]]:
    """Store the floating values chosen by the rules above as f16.

    Args:
        graph: a verified graph, after every type-checked pass.
        keep: node ids that must stay f32 (views resolve to their storage owner).
        parameters: store parameters as f16 too; only for programs without an optimizer.
        ranges: apply the range rule (``half_candidates``).

    Returns:
        (the storage plan: the same nodes with f16 types where chosen, the ids of the values
        now stored as f16, views included). The plan keeps node ids, inputs and outputs.
    """
    half = set(half_candidates(graph, keep, parameters, ranges))
    nodes = []
    for node in graph.nodes:
        is_view = node.op in VIEW_OPS
        if is_view and resolve_view(graph, node.id) in half and node.type.dtype is DType.f32:
            half.add(node.id)
        if node.id in half:
            node = dataclasses.replace(node, type=TensorType(node.type.shape, DType.f16))
        nodes.append(node)
    return Graph(tuple(nodes), graph.outputs), frozenset(half)
