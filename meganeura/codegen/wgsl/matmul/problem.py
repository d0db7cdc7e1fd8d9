"""A matmul node as the kernels see it: operands, strides, transposes folded, vec4 bindings.

Operands are read through baked strides: batch dims broadcast with stride 0, and an operand
that is a ``permute`` swapping only its last two dims is not materialized: the permute's input
is bound with its matrix strides swapped (``x @ w.mT`` reads ``w``). ``matmul_operands``
reports the values actually bound, for ``reads``. An operand whose contiguous dim is a
multiple of 4 (and whose batch offsets are too) is bound as ``array<vec4<T>>``
(``bind_operands``); a value read both as A and B (``x @ x.mT``) shares one binding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ....graph.ir import Graph
from ..core.builder import KernelBuilder, Src, is_constant
from ..core.layout import broadcast_strides, coalesce, contiguous_strides
from ..core.layout import strided_index as _index
from ..core.literals import u


def _is_last_two_swap(dims: tuple[int, ...]) -> bool:
    n = len(dims)
    return n >= 2 and dims == tuple(range(n - 2)) + (n - 1, n - 2)


def fold_transpose(graph: Graph, vid: int) -> tuple[int, bool]:
    """(value to bind, whether its last two dims are swapped relative to the operand)."""
    src = vid
    while graph[src].op == "stop_gradient":
        src = graph[src].inputs[0]
    node = graph[src]
    if node.op == "permute" and _is_last_two_swap(tuple(node.attr("dims"))):
        return node.inputs[0], True
    return vid, False


def matmul_operands(graph: Graph, node_id: int) -> tuple[int, ...]:
    """The value ids a matmul kernel binds for reading (after transpose folding)."""
    node = graph[node_id]
    if node.type.numel == 0 or graph[node.inputs[0]].type.shape[-1] == 0:
        return ()
    return tuple(dict.fromkeys(fold_transpose(graph, v)[0] for v in node.inputs))


class Epilogue(Protocol):
    """Elementwise work done in the store stage instead of a plain store of the product.

    ``bind`` binds what the epilogue reads and writes (before A and B, so an operand the
    epilogue also reads keeps a scalar binding); ``store(value, flat, col)`` returns the
    statements for one in-range output element, given WGSL expressions of the product, its
    flat row-major index in the output and its column. With split-K, ``bind`` and ``store``
    are called for the second (summing) dispatch.
    """

    helpers: str
    flops: int
    nbytes: int

    def bind(self, kb: KernelBuilder) -> None: ...

    def store(self, value: str, flat: str, col: str) -> str: ...


@dataclass(frozen=True)
class Operand:
    """How a kernel reads A or B.

    Attributes:
        src: the bound value (``src.name`` its binding, or a literal for constants).
        value: the bound value's id (after transpose folding).
        batch: strides over the output's batch dims.
        rows: stride along the operand's second-to-last logical dim (M for A, K for B).
        cols: stride along its last logical dim (K for A, N for B).
        vec: the binding is ``array<vec4<T>>`` (scalar reads go through ``scalar``).
    """

    src: Src
    value: int
    batch: tuple[int, ...]
    rows: int
    cols: int
    vec: bool = False

    def scalar(self, kb: KernelBuilder, index: str) -> str:
        """f32 expression of element ``index`` (works on vec4 bindings too)."""
        if not self.vec:
            return self.src.at(index)
        i = index if index.isidentifier() else f"({index})"
        return _widen(kb, self.src.name, f"{self.src.name}[{i} / 4u][{i} % 4u]", 1)

    def vec4(self, kb: KernelBuilder, index: str) -> str:
        """vec4<f32> expression of elements ``index .. index + 3`` (``index`` % 4 == 0)."""
        i = index if index.isidentifier() else f"({index})"
        return _widen(kb, self.src.name, f"{self.src.name}[{i} / 4u]", 4)


def _widen(kb: KernelBuilder, var: str, expr: str, lanes: int) -> str:
    """f32 (vec4<f32> for lanes 4) of a load from binding ``var``, widening f16 storage."""
    if "f16" in kb.element_type(var):
        return f"f32({expr})" if lanes == 1 else f"vec4<f32>({expr})"
    return expr


def vec_ok(op: Operand, contiguous_extent: int, other_stride: int) -> bool:
    """Whether 4-element runs along the operand's contiguous dim start at multiples of 4."""
    aligned = other_stride % 4 == 0 and all(s % 4 == 0 for s in op.batch)
    return contiguous_extent % 4 == 0 and aligned


@dataclass(frozen=True)
class Problem:
    """One matmul after batch folding: ``nb`` products [m, k] @ [k, n] over ``bshape``."""

    m: int
    n: int
    k: int
    nb: int
    bshape: tuple[int, ...]
    a: Operand
    b: Operand

    @property
    def layout(self) -> str:
        return ("t" if self.a.cols != 1 else "n") + ("t" if self.b.cols != 1 else "n")

    def k_range(self, groups: int, splits: int, chunk: int) -> list[str]:
        """Statements defining this workgroup's ``k_begin`` and ``k_end``: chunk ``wg /
        groups`` of ``chunk`` when K is split, else all of K (``groups``: the workgroups of one
        split)."""
        if splits == 1:
            return ["  let k_begin = 0u;", f"  let k_end = {u(self.k)};"]
        return [
            f"  let split = wg / {u(groups)};",
            f"  let k_begin = split * {u(chunk)};",
            f"  let k_end = min(k_begin + {u(chunk)}, {u(self.k)});",
        ]

    def offsets(self) -> list[str]:
        """Statements defining ``a_off``, ``b_off``, ``c_off`` from batch index ``bi``."""
        shape, (bs_a, bs_b) = coalesce(self.bshape, [self.a.batch, self.b.batch])
        return [
            f"  let a_off = {_index('bi', shape, bs_a)};",
            f"  let b_off = {_index('bi', shape, bs_b)};",
            f"  let c_off = bi * {u(self.m * self.n)};",
        ]


def _layout(graph: Graph, vid: int, out_batch: tuple[int, ...]):
    bound, swapped = fold_transpose(graph, vid)
    stored = graph[bound].type.shape
    st = contiguous_strides(stored)
    rows, cols = (st[-1], st[-2]) if swapped else (st[-2], st[-1])
    # broadcast_strides assumes a contiguous batch block; scale to the matrix size.
    mat = stored[-1] * stored[-2]
    batch = tuple(s * mat for s in broadcast_strides(stored[:-2], out_batch))
    return bound, batch, rows, cols


def problem_of(graph: Graph, node_id: int) -> Problem:
    """Strides of both operands, with [..., M, K] @ [K, N] folded into one [nb * M, K] @ [K, N]
    when A is row-major and B shared (bigger tiles stay full; the output layout is the same).
    Operands are not bound yet (``src`` is a placeholder)."""
    node = graph[node_id]
    *out_batch, m, n = node.type.shape
    out_batch = tuple(out_batch)
    k = graph[node.inputs[0]].type.shape[-1]
    ops = []
    for vid in node.inputs:
        bound, batch, rows, cols = _layout(graph, vid, out_batch)
        ops.append(Operand(Src(graph[bound].type), bound, batch, rows, cols))
    a, b = ops
    nb = math.prod(out_batch)
    if nb > 1 and not any(b.batch) and a.cols == 1 and a.rows == k:
        full = tuple(s * m * k for s in contiguous_strides(out_batch))
        if tuple(s for s, d in zip(a.batch, out_batch, strict=True) if d > 1) == tuple(
            s for s, d in zip(full, out_batch, strict=True) if d > 1
        ):
            m, nb, out_batch = m * nb, 1, ()
            a, b = replace(a, batch=()), replace(b, batch=())
    return Problem(m, n, k, nb, out_batch, a, b)


def bind_operands(kb: KernelBuilder, p: Problem, vec_a: bool, vec_b: bool) -> Problem:
    """Bind A then B; ``vec_*`` asks for a vec4 binding, given only if the value is unbound
    (a value read as both A and B, or also by the epilogue, keeps its first binding)."""
    return replace(p, a=bind_operand(kb, p.a, vec_a, "a"), b=bind_operand(kb, p.b, vec_b, "b"))


def bind_operand(kb: KernelBuilder, op: Operand, vec: bool, name: str) -> Operand:
    """Bind one operand (``bind_operands``): as vec4 when asked and the value is unbound."""
    if vec and not kb.is_bound(op.value) and not is_constant(kb.graph, op.value):
        var = kb.read_vec4(op.value, name)
        return replace(op, src=Src(op.src.type, name=var), vec=True)
    src = kb.read(op.value, name)
    is_vec = src.name is not None and kb.element_type(src.name).startswith("vec4")
    return replace(op, src=src, vec=is_vec)


# (binding variable, flat output index, value expression) -> the WGSL statement storing it
Store = Callable[[str, str, str], str]
