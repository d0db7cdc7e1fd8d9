"""Elementwise lowerings: unary math and activations (and their one-kernel backward ops), binary
arithmetic, ``pow``, comparisons, logical ops, ``where``, ``cast``, the strided copies
``broadcast_to`` and ``permute``, and the operand-free ``arange``.

Vec4 loads and stores where every operand allows them (``vector``), else four scalar output
elements per thread (``core.layout.element_slots``); workgroups of 256. Every operand is
read through baked strides (0 on broadcast dims, NumPy's rule), with size-1 dims dropped and
contiguous runs merged first; an operand laid out exactly like the output is read at the flat
index with no index math. Semantics follow each op's NumPy reference: integer ops wrap, i32
division truncates toward zero (as ``astype`` truncates NumPy's true division), comparisons
yield bool stored as u32 0/1 (IEEE with NaN, tested by bit pattern), maximum/minimum/relu
propagate NaN (docs/ops.md, "Non-finite values"), and ``tanh``/``sigmoid`` use formulas
that cannot overflow.
Math WGSL lacks or specifies loosely (erf, sin/cos, log1p, expm1, pow, the gelu forms) comes
from ``core.mathlib`` helper functions, emitted per kernel for the ops it computes; op attributes
(slopes, bounds, beta) are baked in as literals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ....dtypes import DType
from ....graph.ir import Graph, Node, resolve_view
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src, compute_dtype
from ..core.layout import (
    PER_THREAD,
    WG,
    broadcast_strides,
    coalesce,
    contiguous_strides,
    element_slots,
    strided_index,
)
from ..core.literals import NEG_INF_BITS, f32_literal, literal, nonfinite_f32, zero
from ..core.mathlib import helper_source
from .vector import emit_vec4, plan_vec4

# expr(operand names, operand dtype, node attrs) -> WGSL expression of one output element.
Expr = Callable[[Sequence[str], DType, dict], str]


def _neg(x: Sequence[str], t: DType, a: dict) -> str:
    return f"(0u - {x[0]})" if t is DType.u32 else f"(-{x[0]})"


def _sign(x: Sequence[str], t: DType, a: dict) -> str:
    # (x > 0) - (x < 0), as torch.sign: 0 for +-0 and for NaN.
    if t is DType.u32:
        return f"select(0u, 1u, {x[0]} > 0u)"
    one, z = literal(1, t), zero(t)
    return f"(select({z}, {one}, {x[0]} > {z}) - select({z}, {one}, {x[0]} < {z}))"


def _clamp(x: Sequence[str], t: DType, a: dict) -> str:
    # Two selects (min > max gives max, torch.clamp), and NaN kept by bit pattern: NVIDIA's
    # compiler turns select(x, lo, x < lo) into a max that drops NaN (torch: clamp(NaN) = NaN).
    out = x[0]
    if a.get("min") is not None:
        lo = literal(a["min"], t)
        out = f"select({out}, {lo}, {out} < {lo})"
    if a.get("max") is not None:
        hi = literal(a["max"], t)
        out = f"select({out}, {hi}, {out} > {hi})"
    if t.is_floating and out != x[0]:
        out = f"select({out}, {x[0]}, is_nan_f32({x[0]}))"
    return out


def _softplus(x: str, g: str, a: dict) -> str:
    """softplus(x) (``g`` empty) or its gradient times ``g``: linear above the threshold."""
    beta, thr = f32_literal(a["beta"]), f32_literal(a["threshold"])
    t = x if a["beta"] == 1.0 else f"({x} * {beta})"
    inside = f"({g} * sigmoid_stable({t}))" if g else f"softplus_f32({t})"
    if not g and a["beta"] != 1.0:
        inside = f"({inside} / {beta})"
    return f"select({inside}, {g or x}, {t} > {thr})"


def _gelu(x: str, a: dict, grad: bool) -> str:
    form = "gelu_tanh" if a["approximate"] == "tanh" else "gelu_erf"
    return f"{form}{'_grad' if grad else ''}({x})"


def _truth(x: str, t: DType) -> str:
    """``x != 0`` as a WGSL bool; a NaN is true (IEEE ``!=``), tested by bit pattern because
    Mesa folds ``NaN != 0.0`` to false."""
    if t.is_floating:
        return f"({x} != 0.0 || is_nan_f32({x}))"
    return f"({x} != {zero(t)})"


def _logical(sym: str) -> Expr:
    return lambda x, t, a: f"select(0u, 1u, {_truth(x[0], t)} {sym} {_truth(x[1], t)})"


UNARY: dict[str, Expr] = {
    "neg": _neg,
    "exp": lambda x, t, a: f"exp({x[0]})",
    "log": lambda x, t, a: f"log({x[0]})",
    "sqrt": lambda x, t, a: f"sqrt({x[0]})",
    "relu": lambda x, t, a: f"max_nan({x[0]}, 0.0)",  # relu(NaN) = NaN, as torch
    "tanh": lambda x, t, a: f"tanh_stable({x[0]})",
    "sigmoid": lambda x, t, a: f"sigmoid_stable({x[0]})",
    "abs": lambda x, t, a: f"abs({x[0]})",
    "floor": lambda x, t, a: f"floor({x[0]})",
    "sign": _sign,
    "reciprocal": lambda x, t, a: f"(1.0 / {x[0]})",
    "rsqrt": lambda x, t, a: f"(1.0 / sqrt({x[0]}))",  # inf at 0, as torch.rsqrt
    "sin": lambda x, t, a: f"sin_cos_f32({x[0]}, false)",
    "cos": lambda x, t, a: f"sin_cos_f32({x[0]}, true)",
    "erf": lambda x, t, a: f"erf_f32({x[0]})",
    "log1p": lambda x, t, a: f"log1p_f32({x[0]})",
    "expm1": lambda x, t, a: f"expm1_f32({x[0]})",
    "silu": lambda x, t, a: f"({x[0]} * sigmoid_stable({x[0]}))",
    "gelu": lambda x, t, a: _gelu(x[0], a, grad=False),
    "softplus": lambda x, t, a: _softplus(x[0], "", a),
    "leaky_relu": lambda x, t, a: (
        f"select({x[0]} * {f32_literal(a['negative_slope'])}, {x[0]}, {x[0]} > 0.0)"
    ),
    "clamp": _clamp,
    "logical_not": lambda x, t, a: f"select(0u, 1u, {x[0]} == {zero(t)})",
    # by bit pattern: a compiler assuming finite floats may fold a comparison with -inf
    "isneginf": lambda x, t, a: f"select(0u, 1u, bitcast<u32>({x[0]}) == {NEG_INF_BITS})",
}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {
    "greater": ">",
    "greater_equal": ">=",
    "less": "<",
    "less_equal": "<=",
    "eq": "==",
    "ne": "!=",
}


# An f32 1.0 the shader compiler cannot see (``core.literals``): Mesa folds ``x - x`` and
# ``x + -x`` to 0, which is wrong where x is inf or NaN (torch: NaN). Multiplying the second
# operand of a float add or sub by it is exact for every value and hides the identity.
OPAQUE_ONE = nonfinite_f32(1.0)
OPAQUE_NEG_ZERO = nonfinite_f32(-0.0)  # x + -0.0 is x for every f32, -0.0 included


def _infix(sym: str) -> Expr:
    if sym in ("+", "-"):
        return lambda x, t, a: (
            f"({x[0]} {sym} {x[1]} * {OPAQUE_ONE})" if t.is_floating else f"({x[0]} {sym} {x[1]})"
        )
    return lambda x, t, a: f"({x[0]} {sym} {x[1]})"


def _compare(sym: str) -> Expr:
    """IEEE comparisons: false with a NaN operand, except ``!=`` (true). The NaN test is by bit
    pattern: drivers fold ``x == x`` to true and ``x != x`` to false."""

    def expr(x: Sequence[str], t: DType, a: dict) -> str:
        cmp = f"{x[0]} {sym} {x[1]}"
        if not t.is_floating:
            return f"select(0u, 1u, {cmp})"
        nan = f"is_nan_f32({x[0]}) || is_nan_f32({x[1]})"
        if sym == "!=":
            return f"select(0u, 1u, ({cmp}) || {nan})"
        return f"select(0u, 1u, ({cmp}) && !({nan}))"

    return expr


def _extremum(fn: str) -> Expr:
    """torch.maximum / minimum: NaN when either operand is NaN (WGSL's max/min is maxNum)."""
    return lambda x, t, a: f"{fn}{'_nan' if t.is_floating else ''}({x[0]}, {x[1]})"


BINARY: dict[str, Expr] = {
    **{op: _infix(sym) for op, sym in _INFIX.items()},
    **{op: _compare(sym) for op, sym in _COMPARE.items()},
    "maximum": _extremum("max"),
    "minimum": _extremum("min"),
    "pow": lambda x, t, a: f"pow_f32({x[0]}, {x[1]})",
    "logical_and": _logical("&&"),
    "logical_or": _logical("||"),
    "logical_xor": _logical("!="),
    # backward ops: operand 0 is the output gradient, operand 1 the forward input
    "silu_backward": lambda x, t, a: f"({x[0]} * silu_grad({x[1]}))",
    "gelu_backward": lambda x, t, a: f"({x[0]} * {_gelu(x[1], a, grad=True)})",
    "softplus_backward": lambda x, t, a: _softplus(x[1], x[0], a),
}
# Ops ``node_expr`` computes per element: the ones a fused kernel may chain.
FUSIBLE = frozenset(UNARY) | frozenset(BINARY) | {"where", "cast", "broadcast_to"}
# WGSL helper functions (``core.mathlib``) each op's expression calls.
HELPERS: dict[str, tuple[str, ...]] = {
    "relu": ("max_nan",),
    "maximum": ("max_nan",),
    "minimum": ("max_nan",),
    **{op: ("is_nan_f32",) for op in (*_COMPARE, "logical_and", "logical_or", "logical_xor")},
    "clamp": ("is_nan_f32",),
    "tanh": ("tanh_stable",),
    "sigmoid": ("sigmoid_stable",),
    "silu": ("sigmoid_stable",),
    "sin": ("sin_cos_f32",),
    "cos": ("sin_cos_f32",),
    "erf": ("erf_f32",),
    "log1p": ("log1p_f32",),
    "expm1": ("expm1_f32",),
    "gelu": ("gelu",),
    "softplus": ("softplus_f32",),
    "pow": ("pow_f32",),
    "silu_backward": ("silu_grad",),
    "gelu_backward": ("gelu",),
    "softplus_backward": ("sigmoid_stable",),
}


def pow_expr(
    graph: Graph, node: Node, names: Sequence[str] = ("v0", "v1")
) -> tuple[str, tuple[str, ...]]:
    """(expression, helpers) of ``pow`` with the exponent or base baked in when constant.

    A constant exponent in {0, 1, 2, 3, -1, -2, 0.5, -0.5} becomes products, ``sqrt`` or a
    division, as torch's pow kernels special-case them (exact for negative bases); a positive
    constant base c gives ``exp2(b * log2(c))`` with log2(c) computed in float64 here.
    ``names`` are the WGSL names of the base and the exponent.
    """
    x, y = names
    base, expo = (graph[resolve_view(graph, i)] for i in node.inputs)
    if expo.op == "constant":
        special = {
            0.0: "1.0",
            1.0: x,
            2.0: f"({x} * {x})",
            3.0: f"({x} * {x} * {x})",
            -1.0: f"(1.0 / {x})",
            -2.0: f"(1.0 / ({x} * {x}))",
            0.5: f"sqrt({x})",
            -0.5: f"(1.0 / sqrt({x}))",
        }
        e = float(expo.attr("value"))
        if e in special:
            return special[e], ()
    if base.op == "constant" and math.isfinite(c := float(base.attr("value"))) and c > 0.0:
        log2c = math.log2(float(np.float32(base.attr("value"))))
        return f"exp2_f32({y} * {f32_literal(log2c)})", ("exp2_f32",)
    return f"pow_f32({x}, {y})", ("pow_f32",)


def cast_expr(x: str, src: DType, dst: DType) -> str:
    """WGSL conversion matching NumPy ``astype`` (i32 <-> u32 reinterpret bits, float -> int
    truncates toward zero, negative float -> u32 wraps as NumPy does on x86, anything -> bool
    is ``!= 0``). Out-of-range float -> int conversions saturate (undefined in NumPy)."""
    if src is dst or (src is DType.bool and dst is DType.u32):
        return x  # bool is already stored as u32 0/1
    if dst is DType.bool:
        return f"select(0u, 1u, {_truth(x, src)})"  # NaN -> True, as torch
    if src.is_floating and dst is DType.u32:
        # NumPy (C, on x86) wraps negative floats through int64; WGSL's u32() would clamp to 0.
        return f"select(u32({x}), u32(i32({x})), {x} < 0.0)"
    if dst is DType.f16:
        return f"f32(f16({x}))"  # rounded to f16, carried in the f32 compute type
    return f"{compute_dtype(dst).wgsl}({x})"


def emit_map(
    kb: KernelBuilder,
    out_vid: int,
    operands: Sequence[tuple[Src, Sequence[int]]],
    expr: str,
    helpers: str = "",
    suffix: str = "",
) -> KernelSource:
    """``out[i] = expr`` for every element of ``out_vid``, where ``expr`` names operand k as
    ``v{k}``, read through ``strides`` (aligned to the output shape). Vec4 loads and stores
    (``vector``) when every operand allows them, else ``PER_THREAD`` scalar elements per
    thread. All loads of a thread come before its stores.

    Args:
        kb: the kernel's builder; operands must already be bound through it.
        out_vid: the written value (its type gives the iteration shape).
        operands: (source, strides over the output's dims) per operand.
        expr: WGSL expression of the result in terms of ``v0``, ``v1``, ...
    """
    shape = kb.graph[out_vid].type.shape
    n = math.prod(shape)
    out = kb.write(out_vid, "out")
    nbytes = kb.graph[out_vid].type.nbytes + sum(
        s.type.nbytes for s, _ in operands if s.literal is None
    )
    reads = plan_vec4(shape, [s for s, _ in operands], [st for _, st in operands])
    if reads is not None:

        def compute(loads: list[str]) -> str:
            return " ".join(f"let v{k} = {v};" for k, v in enumerate(loads)) + f" let res = {expr};"

        outs = [(out, "res", kb.graph[out_vid].type.dtype)]
        body, groups = emit_vec4(kb, n, [s for s, _ in operands], reads, compute, outs)
        return kb.finish(suffix, body, WG, groups, helpers, flops=n, nbytes=nbytes)
    live = [k for k, (s, _) in enumerate(operands) if s.literal is None]
    cshape, cstrides = coalesce(shape, [contiguous_strides(shape)] + [operands[k][1] for k in live])
    identity = cstrides[0]
    slots, groups, guard = element_slots(n)
    lines = [slots.rstrip()]
    for k, (src, _) in enumerate(operands):
        if src.literal is not None:
            lines.append(f"  let v{k} = {src.literal};")
            continue
        st = cstrides[1 + live.index(k)]
        for e in range(PER_THREAD):
            index = f"j{e}" if st == identity else strided_index(f"j{e}", cshape, st)
            lines.append(f"  let v{k}_{e} = {src.at(index)};")
    for e in range(PER_THREAD):
        lets = " ".join(f"let v{k} = v{k}_{e};" for k in live)
        lines.append(f"  {{ {lets} {guard(e, kb.store(out, f'i{e}', expr))} }}")
    return kb.finish(suffix, "\n".join(lines), WG, groups, helpers, flops=n, nbytes=nbytes)


def node_expr(graph: Graph, node: Node, names: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """(WGSL expression of one element of ``node``, ``core.mathlib`` helpers it calls).

    Args:
        graph: the graph holding ``node`` (operand dtypes, constant operands of ``pow``).
        node: an op of ``UNARY`` or ``BINARY``, ``where``, ``cast`` or ``broadcast_to``.
        names: WGSL expressions of the node's operands, in order (identifiers or literals).

    Raises:
        KeyError: for any other op.
    """
    dtype = graph[node.inputs[0]].type.dtype
    if node.op == "pow":
        return pow_expr(graph, node, names)
    if node.op in UNARY:
        return UNARY[node.op](names, dtype, node.attr_dict), HELPERS.get(node.op, ())
    if node.op in BINARY:
        return BINARY[node.op](names, dtype, node.attr_dict), HELPERS.get(node.op, ())
    if node.op == "where":
        return f"select({names[2]}, {names[1]}, {names[0]} != 0u)", ()
    if node.op == "cast":
        nan = dtype.is_floating and node.type.dtype is DType.bool
        return cast_expr(names[0], dtype, node.type.dtype), ("is_nan_f32",) if nan else ()
    if node.op == "broadcast_to":
        return names[0], ()
    raise KeyError(f"no elementwise lowering for {node.op!r}")


def lower_elementwise(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Every op of ``UNARY`` and ``BINARY``, ``where`` and ``cast`` (NumPy broadcasting)."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    shape = node.type.shape
    srcs = [kb.read(i, f"x{k}") for k, i in enumerate(node.inputs)]
    ops = [(s, broadcast_strides(s.type.shape, shape)) for s in srcs]
    expr, helpers = node_expr(graph, node, [f"v{k}" for k in range(len(srcs))])
    return [emit_map(kb, node_id, ops, expr, helper_source(helpers))]


def lower_broadcast_to(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Materialize a broadcast (stride 0 on the broadcast dims)."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    return [emit_map(kb, node_id, [(x, broadcast_strides(x.type.shape, node.type.shape))], "v0")]


def lower_permute(
    graph: Graph, node_id: int, limits: Limits, deferred: Mapping | None = None
) -> list[KernelSource]:
    """Strided copy: output dim d reads input dim ``dims[d]`` (``deferred``: a split-K
    product read as the sum of its partials, ``matmul.deferred``)."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits, deferred)
    x = kb.read(node.inputs[0], "x")
    st = contiguous_strides(x.type.shape)
    strides = tuple(st[d] for d in node.attr("dims"))
    return [emit_map(kb, node_id, [(x, strides)], "v0")]


def lower_fill(graph: Graph, node_id: int, limits: Limits, value: float) -> list[KernelSource]:
    """Write ``value`` everywhere (matmul with K = 0, cross_entropy over no rows)."""
    kb = KernelBuilder(graph, graph[node_id], limits)
    return [emit_map(kb, node_id, [], f32_literal(value), suffix="fill")]


def lower_arange(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``out[i] = start + i * step`` in the result dtype (``ops.creation``); reads nothing.
    i32 products wrap, which still gives the right sum: the builder checked every value
    fits."""
    node = graph[node_id]
    dtype, n = node.type.dtype, node.type.numel
    kb = KernelBuilder(graph, node, limits)
    out = kb.write(node_id, "out")
    slots, groups, guard = element_slots(n)
    start, step = (literal(node.attr(k), dtype) for k in ("start", "step"))
    lines = [slots.rstrip()]
    for e in range(PER_THREAD):
        value = f"({start} + {dtype.wgsl}(i{e}) * {step})"
        lines.append("  " + guard(e, kb.store(out, f"i{e}", value)))
    return [kb.finish("", "\n".join(lines), WG, groups, flops=2 * n, nbytes=node.type.nbytes)]
