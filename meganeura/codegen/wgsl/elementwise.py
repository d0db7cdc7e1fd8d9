"""Elementwise lowerings: unary math, binary arithmetic, comparisons, ``where``, ``cast``, and the
strided copies ``broadcast_to`` and ``permute``.

Four output elements per thread (``common.element_slots``), workgroups of 256. Every operand is
read through baked strides (0 on broadcast dims, NumPy's rule), with size-1 dims dropped and
contiguous runs merged first; an operand laid out exactly like the output is read at the flat
index with no index math. Semantics follow each op's NumPy reference: integer ops wrap, i32
division truncates toward zero (as ``astype`` truncates NumPy's true division), comparisons
yield bool stored as u32 0/1, and ``tanh``/``sigmoid`` use formulas that cannot overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ...dtypes import DType
from ...graph.ir import Graph
from ..kernel import KernelSource, Limits
from .common import (
    PER_THREAD,
    WG,
    KernelBuilder,
    Src,
    broadcast_strides,
    coalesce,
    contiguous_strides,
    element_slots,
    f32_literal,
    strided_index,
)

# tanh: Cephes' tanhf polynomial below |x| = 0.625 (where 1 - 2e/(1+e) would cancel), and
# exp(-2|x|), which only underflows, above it; drivers' tanh can return NaN past |x| ~ 44.
TANH_HELPER = """
fn tanh_stable(x: f32) -> f32 {
  let a = abs(x);
  let z = x * x;
  let p = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
            + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x;
  let e = exp(-2.0 * a);
  let r = 1.0 - 2.0 * e / (1.0 + e);
  return select(select(r, -r, x < 0.0), p, a < 0.625);
}
"""
# sigmoid: exp of a non-positive number never overflows; pick the form by sign.
SIGMOID_HELPER = """
fn sigmoid_stable(x: f32) -> f32 {
  let e = exp(-abs(x));
  return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
"""

Expr = Callable[[Sequence[str], DType], str]


def _neg(x: Sequence[str], t: DType) -> str:
    return f"(0u - {x[0]})" if t is DType.u32 else f"(-{x[0]})"


UNARY: dict[str, Expr] = {
    "neg": _neg,
    "exp": lambda x, t: f"exp({x[0]})",
    "log": lambda x, t: f"log({x[0]})",
    "sqrt": lambda x, t: f"sqrt({x[0]})",
    "relu": lambda x, t: f"max({x[0]}, 0.0)",
    "tanh": lambda x, t: f"tanh_stable({x[0]})",
    "sigmoid": lambda x, t: f"sigmoid_stable({x[0]})",
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


def _infix(sym: str) -> Expr:
    return lambda x, t: f"({x[0]} {sym} {x[1]})"


def _compare(sym: str) -> Expr:
    return lambda x, t: f"select(0u, 1u, {x[0]} {sym} {x[1]})"


BINARY: dict[str, Expr] = {
    **{op: _infix(sym) for op, sym in _INFIX.items()},
    **{op: _compare(sym) for op, sym in _COMPARE.items()},
    "maximum": lambda x, t: f"max({x[0]}, {x[1]})",
    "minimum": lambda x, t: f"min({x[0]}, {x[1]})",
}
HELPERS = {"tanh": TANH_HELPER, "sigmoid": SIGMOID_HELPER}


def cast_expr(x: str, src: DType, dst: DType) -> str:
    """WGSL conversion matching NumPy ``astype`` (i32 <-> u32 reinterpret bits, float -> int
    truncates toward zero, negative float -> u32 wraps as NumPy does on x86, anything -> bool
    is ``!= 0``). Out-of-range float -> int conversions saturate (undefined in NumPy)."""
    if src is dst or (src is DType.bool and dst is DType.u32):
        return x  # bool is already stored as u32 0/1
    if dst is DType.bool:
        zero = "0.0" if src.is_floating else ("0i" if src is DType.i32 else "0u")
        return f"select(0u, 1u, {x} != {zero})"
    if src.is_floating and dst is DType.u32:
        # NumPy (C, on x86) wraps negative floats through int64; WGSL's u32() would clamp to 0.
        return f"select(u32({x}), u32(i32({x})), {x} < 0.0)"
    return f"{dst.wgsl}({x})"


def emit_map(
    kb: KernelBuilder,
    out_vid: int,
    operands: Sequence[tuple[Src, Sequence[int]]],
    expr: str,
    helpers: str = "",
    suffix: str = "",
) -> KernelSource:
    """``out[i] = expr`` for every element of ``out_vid``, ``PER_THREAD`` elements per thread,
    where ``expr`` names operand k as ``v{k}``, read through ``strides`` (aligned to the output
    shape). All loads of a thread come before its stores.

    Args:
        kb: the kernel's builder; operands must already be bound through it.
        out_vid: the written value (its type gives the iteration shape).
        operands: (source, strides over the output's dims) per operand.
        expr: WGSL expression of the result in terms of ``v0``, ``v1``, ...
    """
    shape = kb.graph[out_vid].type.shape
    n = math.prod(shape)
    out = kb.write(out_vid, "out")
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
        lines.append(f"  {{ {lets} {guard(e, f'{out}[i{e}] = {expr};')} }}")
    nbytes = kb.graph[out_vid].type.nbytes + sum(
        s.type.nbytes for s, _ in operands if s.literal is None
    )
    return kb.finish(suffix, "\n".join(lines), WG, groups, helpers, flops=n, nbytes=nbytes)


def lower_elementwise(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Unary, binary, comparison, ``where`` and ``cast`` nodes (NumPy broadcasting)."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    shape = node.type.shape
    srcs = [kb.read(i, f"x{k}") for k, i in enumerate(node.inputs)]
    ops = [(s, broadcast_strides(s.type.shape, shape)) for s in srcs]
    names = [f"v{k}" for k in range(len(srcs))]
    dtype = srcs[0].dtype
    if node.op in UNARY:
        expr = UNARY[node.op](names, dtype)
    elif node.op in BINARY:
        expr = BINARY[node.op](names, dtype)
    elif node.op == "where":
        expr = "select(v2, v1, v0 != 0u)"
    elif node.op == "cast":
        expr = cast_expr("v0", dtype, node.type.dtype)
    else:
        raise KeyError(f"no elementwise lowering for {node.op!r}")
    return [emit_map(kb, node_id, ops, expr, HELPERS.get(node.op, ""))]


def lower_broadcast_to(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Materialize a broadcast (stride 0 on the broadcast dims)."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    return [emit_map(kb, node_id, [(x, broadcast_strides(x.type.shape, node.type.shape))], "v0")]


def lower_permute(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Strided copy: output dim d reads input dim ``dims[d]``."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    st = contiguous_strides(x.type.shape)
    strides = tuple(st[d] for d in node.attr("dims"))
    return [emit_map(kb, node_id, [(x, strides)], "v0")]


def lower_fill(graph: Graph, node_id: int, limits: Limits, value: float) -> list[KernelSource]:
    """Write ``value`` everywhere (matmul with K = 0, cross_entropy over no rows)."""
    kb = KernelBuilder(graph, graph[node_id], limits)
    return [emit_map(kb, node_id, [], f32_literal(value), suffix="fill")]
