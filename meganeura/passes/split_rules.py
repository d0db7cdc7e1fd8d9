"""Rules of ``split_bindings`` for gathers, matmul and cross-entropy: ops whose row blocks are
not those of one operand (see ``split_bindings``'s module docstring for the design; each rule
returns True when it rewrote node ``n``).

``matmul(A [M, K], B [K, N]) -> C [M, N]`` is tiled by up to three partitions: ``M`` when A
is split into row blocks or C is big (C is then made in row blocks), ``K`` when A is the
transpose of a split ``X [K, M]`` or B is split (the products of the K blocks are added in
block order), ``N`` when B is the transpose of a split ``W [N, K]`` (the tied LM head: the
output column blocks are concatenated). Each tile reads a block of a split operand, sliced to
the tile, or a slice of a small operand (under its transpose, so that the matmul kernel still
folds the transpose). An A with batch dims is flattened to ``[M, K]`` when it is split or C
is big; C is then kept as row blocks of the flattened ``[M, N]`` (``unflat``), which a reshape
back to 2-D (``cross_entropy``'s ``reshape(logits, (-1, V))``) takes as they are.

``cross_entropy(logits, target)`` over split logits is the per-block loss with
``reduction="sum"`` (or ``"none"``), added, divided for ``"mean"`` by the count of rows not
ignored (at least 1, as the op); ``cross_entropy_backward`` is per block with
``reduction="sum"`` and the upstream gradient divided by that count once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes import DType
from ..graph.ir import Node


@dataclass
class _Operand:
    """A 2-D matmul operand: its row blocks, or the row blocks of ``X`` when it is ``X^T``,
    or how to get it (or ``X``) whole."""

    rows: list[int] | None = None
    t_rows: list[int] | None = None
    whole: object = None  # () -> new id
    t_whole: object = None  # () -> new id of X, for a small transposed operand


def _operand(s, v: int, n: Node, flat_rows: list[int] | None = None) -> _Operand:
    t = s.g[v].type
    x = s.transposed(v)
    if flat_rows is not None:
        return _Operand(rows=flat_rows)
    if t.ndim == 2 and s.splittable(v):
        return _Operand(rows=s.blocks(v, n))
    if x is not None and s.g[x].type.ndim == 2:
        if s.splittable(x):
            return _Operand(t_rows=s.blocks(x, n))
        if x in s.new:
            return _Operand(t_whole=lambda: s.new[x])
    return _Operand(whole=lambda: s.whole(v, n))


def _piece(s, op: _Operand, r: tuple, c: tuple, ri: int, ci: int, n: Node) -> int:
    """Rows ``r`` and columns ``c`` (index ``ri``, ``ci`` in their partitions) of ``op``."""
    if op.rows is not None:
        return s.slice(op.rows[ri], 1, *c, n)
    if op.t_rows is not None:
        return s.emit("permute", [s.slice(op.t_rows[ci], 1, *r, n)], {"dims": (1, 0)}, n)
    if op.t_whole is not None:
        x = s.slice(s.slice(op.t_whole(), 0, *c, n), 1, *r, n)
        return s.emit("permute", [x], {"dims": (1, 0)}, n)
    v = op.whole()
    nd = s.nodes[v].type.ndim
    return s.slice(s.slice(v, nd - 2, *r, n), nd - 1, *c, n)


def matmul(s, n: Node) -> bool:
    a, b = n.inputs
    ta, tb, tc = s.g[a].type, s.g[b].type, n.type
    c_big = n.id in s.big
    flat = ta.ndim > 2 and tb.ndim == 2 and (a in s.unflat or c_big)
    if flat:
        m = math.prod(ta.shape[:-1])
        if a in s.unflat:
            A = _operand(s, a, n, flat_rows=s.unflat[a])
        else:
            A = _Operand(
                whole=lambda: s.emit("reshape", [s.whole(a, n)], {"shape": (m, ta.shape[-1])}, n)
            )  # noqa: E501
    else:
        m = ta.shape[-2]
        A = _operand(s, a, n)
    B = _operand(s, b, n)
    if A.rows is None and A.t_rows is None and B.rows is None and B.t_rows is None and not c_big:
        return False
    if (A.rows is not None or c_big) and not (tc.ndim == 2 or flat):
        return False  # row blocks of C are blocks of its dim 0: M only when C is 2-D (or flat)
    if (B.rows is not None or B.t_rows is not None) and tb.ndim != 2:
        return False
    k, cols = ta.shape[-1], tb.shape[-1]
    split_m = A.rows is not None or c_big
    row_bytes, out = cols * tc.dtype.itemsize, n.id in s.output_roots
    ms = s.part(m, row_bytes, aligned=out, value=n) if split_m else ((0, m),)
    ks = s.part(k) if A.t_rows is not None or B.rows is not None else ((0, k),)
    ns = s.part(cols) if B.t_rows is not None else ((0, cols),)
    last = 1 if flat else tc.ndim - 1
    rows_out = []
    for mi, mr in enumerate(ms):
        tiles = []
        for ni, nr in enumerate(ns):
            # Partial products of a split contraction are kept f32 (fast mode stores the
            # product as f16 once, after the sum).
            partial = DType.f32 if len(ks) > 1 else None
            terms = [
                s.emit(
                    "matmul",
                    [_piece(s, A, mr, kr, mi, ki, n), _piece(s, B, kr, nr, ki, ni, n)],
                    {},
                    n,
                    partial,
                )
                for ki, kr in enumerate(ks)
            ]
            tiles.append(s.add_all(terms, n, tc.dtype))
        rows_out.append(s.cat(tiles, last, n))
    if flat and split_m:
        s.unflat[n.id] = rows_out
    elif split_m:
        s.blocked[n.id] = rows_out
    elif flat:
        s.new[n.id] = s.emit("reshape", [rows_out[0]], {"shape": tc.shape}, n)
    else:
        s.new[n.id] = rows_out[0]
    return True


def _count(s, n: Node, target: int) -> int:
    """f32[] count of the rows of ``target`` not equal to ``ignore_index``, at least 1."""
    ii = n.attr("ignore_index")
    rows = s.g[target].type.shape[0]
    if ii is None:
        return s.const(float(max(rows, 1)), DType.f32)
    valid = s.emit("ne", [s.whole(target, n), s.const(ii, DType.i32)], {}, n)
    valid = s.emit("cast", [valid], {"dtype": DType.f32.value}, n)
    count = s.emit("sum", [valid], {"dims": (0,), "keepdim": False}, n)
    return s.emit("maximum", [count, s.const(1.0, DType.f32)], {}, n)


def cross_entropy(s, n: Node) -> bool:
    logits, target = n.inputs
    if not s.splittable(logits):
        return False
    rows, reduction = s.g[logits].type.shape[0], n.attr("reduction")
    attrs = {**n.attr_dict, "reduction": "none" if reduction == "none" else "sum"}
    parts = [
        s.emit("cross_entropy", [blk, s.block(target, i, rows, n)], attrs, n)
        for i, blk in enumerate(s.blocks(logits, n))
    ]
    if reduction == "none":
        s.blocked[n.id] = parts
        return True
    total = s.add_all(parts, n)
    if reduction == "mean":
        total = s.emit("div", [total, _count(s, n, target)], {}, n)
    s.new[n.id] = total
    return True


def cross_entropy_backward(s, n: Node) -> bool:
    logits, target, g = n.inputs
    if not s.splittable(logits):
        return False
    rows, reduction = s.g[logits].type.shape[0], n.attr("reduction")
    attrs = {**n.attr_dict, "reduction": "none" if reduction == "none" else "sum"}
    grad = None if reduction == "none" else s.whole(g, n)
    if reduction == "mean":
        grad = s.emit("div", [grad, _count(s, n, target)], {}, n)
    out = []
    for i, blk in enumerate(s.blocks(logits, n)):
        gi = s.block(g, i, rows, n) if grad is None else grad
        out.append(
            s.emit("cross_entropy_backward", [blk, s.block(target, i, rows, n), gi], attrs, n)
        )
    s.blocked[n.id] = out
    return True


def index_select(s, n: Node) -> bool:
    x, idx = n.inputs
    if n.attr("dim") != 0 or not s.splittable(x) or n.id in s.big:
        return False
    rows = s.g[x].type.shape[0]
    ids, dt = s.whole(idx, n), s.g[idx].type.dtype
    out = None
    for b, (start, end) in enumerate(s.part(rows)):
        local = s.emit("clamp", [ids], {"min": start, "max": end - 1}, n)
        if start:
            local = s.emit("sub", [local, s.const(start, dt)], {}, n)
        sel = s.emit("index_select", [s.block(x, b, rows, n), local], {"dim": 0}, n)
        if out is None:
            out = sel
            continue
        # Later blocks override: a token in block b has idx >= start_b and < start_(b+1).
        mine = s.emit("greater_equal", [ids, s.const(start, dt)], {}, n)
        shape = _mine_shape(s.nodes[sel].type.ndim, s.g[idx].type.shape[0])
        mine = s.emit("reshape", [mine], {"shape": shape}, n)
        out = s.emit("where", [mine, sel, out], {}, n)
    s.new[n.id] = out
    return True


def index_select_backward(s, n: Node) -> bool:
    g, idx = n.inputs
    if n.attr("dim") != 0 or n.id not in s.big or s.splittable(g):
        return False
    rows = n.type.shape[0]
    grad, ids, dt = s.whole(g, n), s.whole(idx, n), s.g[idx].type.dtype
    gt = s.g[g].type.dtype
    zero = s.const(0.0, DType.f32 if gt is DType.f16 else gt)  # constants are computed types
    shape = _mine_shape(s.g[g].type.ndim, s.g[idx].type.shape[0])
    out = []
    for start, end in s.part(rows):
        lo = s.emit("greater_equal", [ids, s.const(start, dt)], {}, n)
        hi = s.emit("less", [ids, s.const(end, dt)], {}, n)
        mine = s.emit("logical_and", [lo, hi], {}, n)
        mine = s.emit("reshape", [mine], {"shape": shape}, n)
        part = s.emit("where", [mine, grad, zero], {}, n)
        local = s.emit("clamp", [ids], {"min": start, "max": end - 1}, n)
        if start:
            local = s.emit("sub", [local, s.const(start, dt)], {}, n)
        attrs = {"dim": 0, "size": end - start}
        out.append(s.emit("index_select_backward", [part, local], attrs, n))
    s.blocked[n.id] = out
    return True


def _mine_shape(ndim: int, n: int) -> tuple[int, ...]:
    """Shape of a per-index mask broadcast over an ``ndim``-d gather result: ``[n, 1, ...]``."""
    return (n,) + (1,) * (ndim - 1)
