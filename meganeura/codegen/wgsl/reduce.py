"""Reductions ``sum`` / ``mean`` / ``amax`` over any set of dims, with ``keepdim``.

The input is viewed as kept dims x reduced dims, each coalesced (size-1 dims dropped,
neighbours merged), so output element ``o`` reduces ``x[base(o) + off(r)]`` for r < R, with
both offsets baked index math. The workgroup shape comes from ``rows.plan_rows``. Accuracy:
no thread sums a long serial chain. Large groups are split over ``P`` chunks (one workgroup
each, partials into scratch, then a second dispatch combines them), each thread sums a
strided slice in blocks, and threads combine pairwise, so a 2^21-element sum keeps f32
accuracy. ``amax`` starts from a real element of the group (never from an infinite literal);
``mean`` divides by the group size once, at the end, as NumPy does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ...dtypes import DType
from ...graph.ir import Graph
from ..kernel import KernelSource, Limits
from .common import (
    KernelBuilder,
    contiguous_strides,
    f32_literal,
    strided_index,
    u,
    zero,
)
from .rows import RowPlan, plan_rows, shared_decl, strided_loop, thread_coords, tree

# Aim for this many workgroups before splitting groups into chunks (fills a large GPU), but
# give each thread at least MIN_PER_THREAD elements so the extra pass stays cheap.
TARGET_GROUPS = 1024
MIN_PER_THREAD = 32
MAX_CHUNKS = 1024

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # coalesced (sizes, strides)


def _layout(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[Layout, Layout]:
    """Coalesced (kept, reduced) dims of a contiguous tensor of ``shape``: size-1 dims are
    dropped and neighbouring dims of the same kind merge (their strides chain)."""
    st = contiguous_strides(shape)
    groups: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    prev = None
    for d, n in enumerate(shape):
        if n == 1:
            continue
        red = d in dims
        if prev == red:
            groups[red][-1] = (groups[red][-1][0] * n, st[d])
        else:
            groups[red].append((n, st[d]))
        prev = red
    kept, red = groups[False], groups[True]
    return (
        (tuple(g[0] for g in kept), tuple(g[1] for g in kept)),
        (tuple(g[0] for g in red), tuple(g[1] for g in red)),
    )


def _plan(kept: Layout, red: Layout) -> RowPlan:
    contiguous = bool(red[1]) and red[1][-1] == 1
    return plan_rows(math.prod(kept[0]), math.prod(red[0]), contiguous)


def _combine(op: str) -> Callable[[str, str], str]:
    if op == "amax":
        return lambda a, b: f"max({a}, {b})"
    return lambda a, b: f"{a} + {b}"


def _finalize(op: str, value: str, count: int, dtype: DType) -> str:
    if op != "mean":
        return value
    if dtype.is_floating:
        return f"{value} / {f32_literal(float(count))}"
    return f"{value} / {count}{'i' if dtype is DType.i32 else 'u'}"


def _pass(
    kb: KernelBuilder,
    read: Callable[[str], str],
    kept: Layout,
    red: Layout,
    op: str,
    dtype: DType,
    chunks: int,
    store: Callable[[str], str],
    suffix: str,
) -> KernelSource:
    """One dispatch: for each output row (and chunk of its group) reduce into ``total`` and
    run ``store(total)`` on the one thread per row that owns the result."""
    n_out = math.prod(kept[0])
    n_red = math.prod(red[0])
    plan = _plan(kept, red)
    row_groups = -(-n_out // plan.ox)
    chunk = -(-n_red // chunks)
    wgsl_t = dtype.wgsl
    body = ""
    if chunks == 1:
        body += thread_coords(plan, "wg", n_out) + "  let r_begin = 0u;\n"
        body += f"  let r_end = {u(n_red)};\n"
    else:
        body += f"  let p = wg / {u(row_groups)};\n"
        body += thread_coords(plan, f"(wg % {u(row_groups)})", n_out)
        body += f"  let r_begin = p * {u(chunk)};\n"
        body += f"  let r_end = min(r_begin + {u(chunk)}, {u(n_red)});\n"
    body += f"  let base = {strided_index('rowc', *kept)};\n"

    def elem(r: str) -> str:
        return read(f"base + {strided_index(r, *red)}")

    combine = _combine(op)
    if op == "amax":
        # Start from an element this thread will see again (max is idempotent): no -inf needed.
        body += f"  var acc = {elem('min(r_begin + y, r_end - 1u)')};\n"
        zero_lit = None
    else:
        zero_lit = zero(dtype)
        body += f"  var acc = {zero_lit};\n"
    per_thread = -(-chunk // plan.ry)
    body += strided_loop(plan, "r_begin", "r_end", elem, combine, per_thread, zero_lit)
    body += tree(plan, "red", "acc", combine, "total")
    body += f"  if (live && y == 0u) {{\n    {store('total')}\n  }}\n"
    helpers = shared_decl(plan, "red", wgsl_t)
    groups = row_groups * chunks
    nbytes = (n_out * n_red + n_out * chunks) * dtype.itemsize
    return kb.finish(suffix, body, plan.size, groups, helpers, n_out * n_red, nbytes)


def lower_reduce(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``sum``, ``mean`` and ``amax`` over ``dims``; one or two dispatches."""
    node = graph[node_id]
    x_node = graph[node.inputs[0]]
    dtype = node.type.dtype
    op = node.op
    kept, red = _layout(x_node.type.shape, tuple(node.attr("dims")))
    n_out = node.type.numel
    n_red = math.prod(red[0])
    if n_out == 0:
        return []
    plan = _plan(kept, red)
    row_groups = -(-n_out // plan.ox)
    chunks = 1
    if row_groups < TARGET_GROUPS and n_red >= plan.ry * MIN_PER_THREAD * 2:
        chunks = min(
            -(-TARGET_GROUPS // row_groups), n_red // (plan.ry * MIN_PER_THREAD), MAX_CHUNKS
        )
        chunk = -(-n_red // chunks)
        chunks = -(-n_red // chunk)  # no empty chunk

    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    if chunks == 1:
        out = kb.write(node_id, "out")
        store = lambda t: f"{out}[row] = {_finalize(op, t, n_red, dtype)};"  # noqa: E731
        return [_pass(kb, x.at, kept, red, op, dtype, 1, store, "")]

    scratch = kb.scratch("partial", chunks * n_out, dtype, "partial")
    first = _pass(
        kb, x.at, kept, red, op, dtype, chunks,
        lambda t: f"{scratch}[p * {u(n_out)} + row] = {t};", "partial",
    )  # fmt: skip
    kb2 = KernelBuilder(graph, node, limits)
    scratch2 = kb2.scratch("partial", chunks * n_out, dtype, "partial")
    out = kb2.write(node_id, "out")
    # Partials are laid out [chunks, n_out]: reduce the leading dim.
    second = _pass(
        kb2, lambda i: f"{scratch2}[{i}]", ((n_out,), (1,)), ((chunks,), (n_out,)), op, dtype, 1,
        lambda t: f"{out}[row] = {_finalize(op, t, n_red, dtype)};", "combine",
    )  # fmt: skip
    return [first, second]
