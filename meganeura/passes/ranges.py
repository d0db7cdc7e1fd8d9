"""Range reasoning for the fast mode: which values may leave f16's range.

f16 stores magnitudes up to 65504 (normal ones down to 6.1e-5, subnormal ones to 6e-8).
Activations of ordinary models live well inside that range, but values computed *from* them
may not: the square of an activation of 800 is 640000, ``exp(12)`` is 162755. ``degrees``
gives every value a **degree**: how many factors of "an activation" its magnitude may hold,
counted the way a polynomial's degree is:

  * program inputs, integers cast to floats, and rows looked up in a table (``gather``,
    ``index_select``: an embedding's output) have degree 1 (an activation);
    parameters, optimizer state and integers have degree 0 (weights are O(1));
  * a constant factor ``c`` has degree 0 when ``|c| <= 2**8`` (or ``c`` is inf or NaN),
    otherwise ``log2|c| / 8`` (an activation counts as 2**8): scaling by 0.5, 2 or
    ``1/sqrt(d)`` is free, by 1e5 is not. Shrinking by a constant (``x * 1e-3``,
    ``g / 4096``, a mean's backward) is free too: it cannot overflow, and gradients that
    underflow are the documented cost of the fast mode without loss scaling;
  * ``mul``, ``matmul`` and ``conv2d`` add their operands' degrees; ``div`` subtracts them
    (division by a constant ``c`` is the constant factor ``1/c``);
    ``reciprocal`` negates, ``sqrt`` halves, ``rsqrt`` halves and negates, ``var`` doubles;
    ``pow`` by a constant ``p`` multiplies by ``|p|`` (a tensor exponent: unbounded);
  * a sum of ``n`` terms (``sum``, ``cumsum``) adds the degree of the constant ``n`` (0 up
    to 256 terms, 1.5 for 4096); ``mean``, extrema, ``logsumexp`` keep their operand's;
  * ``exp`` and ``expm1`` are unbounded (``inf``) unless their operand is known <= 0, when
    they lie in (-1, 1] (degree 0);
  * bounded ops reset the degree to 0 whatever their operand: ``sigmoid``, ``tanh``,
    ``softmax``, ``erf``, ``sin``, ``cos``, ``sign``, ``log``, ``log1p``, the
    normalizations (``layer_norm``, ``rms_norm``, ``group_norm``, ``batch_norm``: outputs
    of unit scale times an O(1) weight), and ``clamp`` with both bounds;
  * every other op (adds, activations, views, indexing, pooling, attention, the fused
    backward ops) is at most linear in each operand: the largest operand degree.

A value of degree ``d`` may be as large as an activation to the power ``d``; f16 holds
``|d| <= 1`` (an activation, or its reciprocal: 1/65504 and 1/6.1e-5 are both in range), so
``narrow_storage`` keeps values with ``|d| > 1`` in f32. The degree of a gradient follows from
the same rules applied to the backward graph (the loss's seed is the constant 1; a loss
scale's seed, the node marked ``seed=True`` by ``compile``, has degree 0: the scale exists to
bring the gradients into f16's range, and an overflow trips the non-finite guard).

For ``exp``, a sign analysis knows which values are <= 0: ``-relu``, ``-abs``, ``-x*x``,
``x * -x``, ``log_softmax``, ``clamp(max<=0)``, products and sums by the rule of signs, and
``x`` minus an upper bound of ``x`` (``amax``, ``max`` or ``logsumexp`` of ``x``, possibly
reshaped or broadcast), the max-subtraction of a stable softmax.
"""

from __future__ import annotations

import math

from ..graph.ir import Graph, Node

INF = math.inf

# Outputs of bounded magnitude whatever their operand.
BOUNDED_OPS = frozenset(
    {
        "sigmoid",
        "tanh",
        "softmax",
        "erf",
        "sin",
        "cos",
        "sign",
        "log",
        "log1p",
        "layer_norm",
        "rms_norm",
        "group_norm",
        "batch_norm",
    }
)
LOOKUP_OPS = frozenset({"index_select", "gather"})
PRODUCT_OPS = frozenset({"mul", "matmul", "conv2d", "conv2d_backward_input"})
SUMMING_OPS = frozenset({"sum", "cumsum"})
# Ops through which "is an upper bound of x" follows (views and broadcasts of the bound).
_SAME_VALUE_OPS = frozenset({"reshape", "stop_gradient", "broadcast_to"})
_UPPER_BOUND_OPS = frozenset({"amax", "max", "logsumexp"})

# A sign: (known >= 0, known <= 0); (False, False) is unknown, (True, True) is zero.
Sign = tuple[bool, bool]
_UNKNOWN: Sign = (False, False)


def _constant_degree(value: float) -> float:
    """Degree of a constant factor: 0 up to 2**8, ``log2|c| / 8`` beyond (module docstring)."""
    v = abs(float(value))
    if not math.isfinite(v) or v <= 2.0**8:
        return 0.0
    return math.log2(v) / 8


def _constant_value(graph: Graph, vid: int) -> float | None:
    e = graph[_through_views(graph, vid)]
    return float(e.attr("value")) if e.op == "constant" else None


def _through_views(graph: Graph, vid: int) -> int:
    while graph[vid].op in _SAME_VALUE_OPS:
        vid = graph[vid].inputs[0]
    return vid


def _negation_of(graph: Graph, a: int, b: int) -> bool:
    na, nb = graph[a], graph[b]
    return (na.op == "neg" and na.inputs[0] == b) or (nb.op == "neg" and nb.inputs[0] == a)


def _sign(graph: Graph, node: Node, sign: dict[int, Sign]) -> Sign:
    op, ins = node.op, [sign.get(i, _UNKNOWN) for i in node.inputs]
    if op == "constant":
        v = float(node.attr("value"))
        return (v >= 0, v <= 0) if not math.isnan(v) else _UNKNOWN
    if op in ("abs", "relu", "exp", "sigmoid", "softmax", "sqrt", "rsqrt", "softplus"):
        return (True, False)
    if op == "log_softmax":
        return (False, True)
    if op == "neg":
        return (ins[0][1], ins[0][0])
    if op in ("expm1", "reshape", "stop_gradient", "broadcast_to", "permute", "slice"):
        return ins[0]
    if op == "clamp":
        lo, hi = node.attr("min"), node.attr("max")
        return (
            ins[0][0] or (lo is not None and lo >= 0),
            ins[0][1] or (hi is not None and hi <= 0),
        )
    if op in ("mul", "div"):
        a, b = node.inputs
        if a == b:
            return (True, False)
        if op == "mul" and _negation_of(graph, a, b):
            return (False, True)  # x * -x <= 0 (erf's gradient: exp(-x * x))
        (ap, an), (bp, bn) = ins[0], ins[1]
        return ((ap and bp) or (an and bn), (ap and bn) or (an and bp))
    if op in ("add", "maximum", "minimum", "cat"):
        return (all(s[0] for s in ins), all(s[1] for s in ins))
    if op == "where":
        return (ins[1][0] and ins[2][0], ins[1][1] and ins[2][1])
    if op == "sub":
        (ap, an), (bp, bn) = ins
        a, bound = (
            _through_views(graph, node.inputs[0]),
            graph[_through_views(graph, node.inputs[1])],
        )
        if bound.op in _UPPER_BOUND_OPS and _through_views(graph, bound.inputs[0]) == a:
            return (False, True)  # x - amax(x) <= 0
        return (ap and bn, an and bp)
    return _UNKNOWN


def _degree(graph: Graph, node: Node, deg: dict[int, float], sign: dict[int, Sign]) -> float:
    op = node.op
    floats = [deg[i] for i in node.inputs if graph[i].type.dtype.is_floating]
    top = max(floats, default=0.0)
    if not node.type.dtype.is_floating:
        return 0.0
    if op == "input":
        return 1.0
    if op in ("parameter", "state"):
        return 0.0
    if op == "constant":
        return _constant_degree(node.attr("value"))
    if op == "arange":
        return 1.0
    if op in LOOKUP_OPS:  # rows of an embedding table are the network's input: activations
        return max(top, 1.0)
    if op == "cast":
        return deg[node.inputs[0]] if graph[node.inputs[0]].type.dtype.is_floating else 1.0
    if op in BOUNDED_OPS:
        return 0.0
    if op == "clamp" and node.attr("min") is not None and node.attr("max") is not None:
        return 0.0
    if op in PRODUCT_OPS:
        return sum(floats)
    if op == "div":
        c = _constant_value(graph, node.inputs[1])
        if c is not None:  # x / c scales by 1/c, like a constant factor
            return floats[0] + (_constant_degree(1 / c) if c != 0 else INF)
        return floats[0] - floats[1]
    if op == "reciprocal":
        return -floats[0]
    if op == "sqrt":
        return floats[0] / 2
    if op == "rsqrt":
        return -floats[0] / 2
    if op == "var":
        return 2 * floats[0]
    if op == "pow":
        p = _constant_value(graph, node.inputs[1])
        return INF if p is None or not math.isfinite(p) else abs(p) * floats[0]
    if op in SUMMING_OPS:  # a sum of n terms scales like a constant factor n
        n = graph[node.inputs[0]].type.numel / max(node.type.numel, 1)
        if op == "cumsum":
            n = node.type.shape[node.attr("dim")]
        return floats[0] + _constant_degree(n)
    if op in ("exp", "expm1"):
        return 0.0 if sign[node.inputs[0]][1] else INF
    if any(math.isinf(d) for d in floats):
        return INF
    return top


def degrees(graph: Graph) -> dict[int, float]:
    """The magnitude degree of every value of ``graph`` (module docstring: the rules).

    Args:
        graph: a verified graph.

    Returns:
        ``{node id: degree}``; ``math.inf`` for unbounded values, 0 for non-floating ones.
        A value with ``abs(degree) > 1`` may leave f16's range.
    """
    deg: dict[int, float] = {}
    sign: dict[int, Sign] = {}
    for node in graph.nodes:
        sign[node.id] = _sign(graph, node, sign)
        if node.attr("seed"):  # a loss scale's seed: its gradients are meant for f16
            deg[node.id] = 0.0
            continue
        d = _degree(graph, node, deg, sign)
        deg[node.id] = INF if math.isnan(d) else d
    return deg


def fits_f16(degree: float) -> bool:
    """Whether a value of this degree is stored as f16 in the fast mode."""
    return abs(degree) <= 1.0 + 1e-9
