"""``matmul`` ``[..., M, K] @ [..., K, N]`` as a register-tiled kernel, any M, N, K.

Each workgroup of 16x16 threads computes a BM x BN output tile (64x64 with 4x4 outputs per
thread, or 128x128 with 8x8 for large products); each thread keeps its outputs in named vec4
accumulators. K advances in steps of BK: a BM x BK tile of A and a BK x BN tile of B are
staged in workgroup memory as vec4 along M and N (one vec4 per thread per operand), then the
BK inner steps are emitted unrolled, so no private array is indexed by a loop variable (the
H200 measurement in design.md: 1.0 vs 35.7 TFLOP/s). Loads past M, N or K read zero (checks
are emitted only for dims that do not divide evenly); stores past M or N are skipped.

Operands are read through baked strides: batch dims broadcast with stride 0, and an operand
that is a ``permute`` swapping only its last two dims is not materialized: the permute's input
is bound with its matrix strides swapped (``x @ w.mT`` reads ``w``). ``matmul_operands``
reports the values actually bound, for ``reads``. The logical grid is (N tiles, M tiles,
batch) flattened and folded by ``common.fold_grid``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ...graph.ir import Graph
from ..kernel import KernelSource, Limits
from .common import KernelBuilder, Src, broadcast_strides, coalesce, contiguous_strides, u
from .common import strided_index as _index
from .elementwise import lower_fill

THREADS = 16  # threads per tile side; 256 per workgroup


@dataclass(frozen=True)
class Tiling:
    """Per-thread outputs ``tm`` x ``tn`` (multiples of 4) and K step ``bk``."""

    tm: int
    tn: int
    bk: int

    @property
    def bm(self) -> int:
        return THREADS * self.tm

    @property
    def bn(self) -> int:
        return THREADS * self.tn


SMALL = Tiling(4, 4, 16)
LARGE = Tiling(8, 8, 8)


# 128x128 tiles need this many workgroups to pay off; with fewer, 64x64 tiles spread the work
# over more of the GPU's multiprocessors. Measured on the H200 (132 SMs), f32 TFLOP/s for
# 128x128 vs 64x64 tiles: 4096^3 30.1 vs 12.8 (1024 large tiles), 2048^3 27.7 vs 22.2 (256),
# 1024^3 11.4 vs 15.6 (64).
LARGE_MIN_TILES = 256


def choose_tiling(m: int, n: int, k: int, batch: int = 1) -> Tiling:
    """128x128 tiles only when there are enough of them to keep a large GPU busy."""
    tiles = -(-m // LARGE.bm) * -(-n // LARGE.bn) * batch
    return LARGE if m >= 128 and n >= 128 and tiles >= LARGE_MIN_TILES else SMALL


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

    ``bind`` binds what the epilogue reads and writes (after A and B); ``store(value, flat,
    col)`` returns the statements for one in-range output element, given WGSL expressions of
    the product, its flat row-major index in the output and its column.
    """

    helpers: str
    flops: int
    nbytes: int

    def bind(self, kb: KernelBuilder) -> None: ...

    def store(self, value: str, flat: str, col: str) -> str: ...


@dataclass(frozen=True)
class _Operand:
    src: Src
    batch: tuple[int, ...]  # strides over the output's batch dims
    rows: int  # stride along the operand's second-to-last logical dim (M for A, K for B)
    cols: int  # stride along its last logical dim (K for A, N for B)


def _operand(kb: KernelBuilder, vid: int, name: str, out_batch: tuple[int, ...]) -> _Operand:
    bound, swapped = fold_transpose(kb.graph, vid)
    src = kb.read(bound, name)
    stored = kb.graph[bound].type.shape
    st = contiguous_strides(stored)
    rows, cols = (st[-1], st[-2]) if swapped else (st[-2], st[-1])
    batch = broadcast_strides(stored[:-2], out_batch)
    # broadcast_strides assumes a contiguous batch block; scale to the matrix size.
    mat = stored[-1] * stored[-2]
    return _Operand(src, tuple(s * mat for s in batch), rows, cols)


def lower_matmul(
    graph: Graph, node_id: int, limits: Limits, epilogue: Epilogue | None = None
) -> list[KernelSource]:
    """Batched, broadcast matmul; one dispatch.

    Args:
        epilogue: computes and stores the values derived from the product (a fusion group
            anchored here); None stores the product itself. The caller excludes K = 0.
    """
    node = graph[node_id]
    *out_batch, m, n = node.type.shape
    out_batch = tuple(out_batch)
    k = graph[node.inputs[0]].type.shape[-1]
    if node.type.numel == 0:
        return []
    if k == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    kb = KernelBuilder(graph, node, limits)
    a = _operand(kb, node.inputs[0], "a", out_batch)
    b = _operand(kb, node.inputs[1], "b", out_batch)
    if epilogue is None:
        out = kb.write(node_id, "c")

        def store(value: str, flat: str, col: str) -> str:
            return kb.store(out, flat, value)
    else:
        epilogue.bind(kb)
        store = epilogue.store
    nb = math.prod(out_batch)
    if nb > 1 and not any(b.batch) and a.cols == 1 and a.rows == k:
        # [..., M, K] @ [K, N] with a row-major A is one [nb * M, K] @ [K, N]: bigger tiles
        # stay full (a batched linear layer), and the output layout is the same.
        full = tuple(s * m * k for s in contiguous_strides(out_batch))
        if tuple(s for s, d in zip(a.batch, out_batch, strict=True) if d > 1) == tuple(
            s for s, d in zip(full, out_batch, strict=True) if d > 1
        ):
            m, nb, out_batch = m * nb, 1, ()
            a, b = _Operand(a.src, (), a.rows, a.cols), _Operand(b.src, (), b.rows, b.cols)
    t = choose_tiling(m, n, k, nb)
    tiles_m, tiles_n = -(-m // t.bm), -(-n // t.bn)

    lines = [
        f"  let tile_n = wg % {u(tiles_n)};",
        f"  let tile_m = (wg / {u(tiles_n)}) % {u(tiles_m)};",
        f"  let bi = wg / {u(tiles_n * tiles_m)};",
    ]
    bshape, (bs_a, bs_b) = coalesce(out_batch, [a.batch, b.batch])
    lines += [
        f"  let a_off = {_index('bi', bshape, bs_a)};",
        f"  let b_off = {_index('bi', bshape, bs_b)};",
        f"  let c_off = bi * {u(m * n)};",
        f"  let tx = lid % {u(THREADS)};",
        f"  let ty = lid / {u(THREADS)};",
    ]
    lines += _load_setup(a, "a", t.bm, t.bk, m, "tile_m")
    lines += _load_setup(b, "b", t.bn, t.bk, n, "tile_n")
    acc = [
        (g, i, h)
        for g in range(t.tm // 4)
        for i in range(4)
        for h in range(t.tn // 4)
    ]  # fmt: skip
    lines += [f"  var acc{g}{i}{h} = vec4<f32>(0.0);" for g, i, h in acc]
    lines.append(f"  for (var k0 = 0u; k0 < {u(k)}; k0 = k0 + {u(t.bk)}) {{")
    lines += _load_tile(a, "a", "As", t.bm, t.bk, k, m)
    lines += _load_tile(b, "b", "Bs", t.bn, t.bk, k, n)
    lines.append("    workgroupBarrier();")
    for kk in range(t.bk):
        step = ["    {"]
        step += [
            f"      let a{g} = As[{u(kk * t.bm // 4 + g * THREADS)} + ty];"
            for g in range(t.tm // 4)
        ]
        step += [
            f"      let b{h} = Bs[{u(kk * t.bn // 4 + h * THREADS)} + tx];"
            for h in range(t.tn // 4)
        ]
        step += [f"      acc{g}{i}{h} += a{g}.{'xyzw'[i]} * b{h};" for g, i, h in acc]
        lines += step + ["    }"]
    lines += ["    workgroupBarrier();", "  }"]
    lines += _store(store, t, m, n, acc)

    helpers = (
        f"var<workgroup> As: array<vec4<f32>, {t.bk * t.bm // 4}>;\n"
        f"var<workgroup> Bs: array<vec4<f32>, {t.bk * t.bn // 4}>;\n"
    )
    shared = 4 * t.bk * (t.bm + t.bn)
    if shared > limits.max_workgroup_storage_size:
        raise ValueError(f"matmul tile needs {shared} B of workgroup memory; limit is lower")
    groups = tiles_m * tiles_n * nb
    nbytes = a.src.type.nbytes + b.src.type.nbytes
    flops = 2 * nb * m * n * k
    if epilogue is None:
        nbytes += node.type.nbytes
    else:
        helpers += epilogue.helpers
        nbytes, flops = nbytes + epilogue.nbytes, flops + epilogue.flops
    return [kb.finish("", "\n".join(lines), THREADS * THREADS, groups, helpers,
                      flops=flops, nbytes=nbytes)]  # fmt: skip


def _load_setup(op: _Operand, p: str, span: int, bk: int, extent: int, tile: str) -> list[str]:
    """Which (k, 4-wide run along M or N) this thread loads, and the 4 row base offsets.

    Consecutive threads walk the operand's contiguous dim, so each load instruction of a
    warp reads neighbouring addresses whichever way the operand is laid out.
    """
    runs = span // 4  # vec4 runs per k; runs * bk == 256
    along_k = (op.cols if p == "a" else op.rows) == 1
    if along_k:
        lines = [f"  let l{p}_k = lid % {u(bk)};", f"  let l{p}_r = lid / {u(bk)};"]
    else:
        lines = [f"  let l{p}_r = lid % {u(runs)};", f"  let l{p}_k = lid / {u(runs)};"]
    stride = op.rows if p == "a" else op.cols  # step along M (for A) or N (for B)
    lines.append(f"  let {p}_first = {tile} * {u(span)} + l{p}_r * 4u;")
    for j in range(4):
        row = f"{p}_first" if j == 0 else f"({p}_first + {u(j)})"
        lines.append(f"  let {p}_p{j} = {p}_off + {_times(row, stride)};")
        if extent % span:
            lines.append(f"  let {p}_in{j} = {p}_first + {u(j)} < {u(extent)};")
    return lines


def _load_tile(op: _Operand, p: str, shared: str, span: int, bk: int, k: int, extent: int):
    """Statements staging this thread's vec4 of the current K step, zero past the edges."""
    kstride = op.cols if p == "a" else op.rows
    lines = [f"    let {p}_k = k0 + l{p}_k;"]
    vals = []
    for j in range(4):
        load = op.src.at(f"{p}_p{j} + {_times(f'{p}_k', kstride)}")
        conds = []
        if extent % span:
            conds.append(f"{p}_in{j}")
        if k % bk:
            conds.append(f"{p}_k < {u(k)}")
        vals.append(f"select(0.0, {load}, {' && '.join(conds)})" if conds else load)
    lines.append(f"    {shared}[l{p}_k * {u(span // 4)} + l{p}_r] = vec4<f32>({', '.join(vals)});")
    return lines


def _times(expr: str, n: int) -> str:
    return expr if n == 1 else f"{expr} * {u(n)}"


def _store(store: Callable[[str, str, str], str], t: Tiling, m: int, n: int, acc) -> list[str]:
    lines = []
    for g, i, h in acc:
        row = f"tile_m * {u(t.bm)} + {u(g * 64 + i)} + ty * 4u"
        col = f"tile_n * {u(t.bn)} + {u(h * 64)} + tx * 4u"
        lines.append("  {")
        lines.append(f"    let row = {row};")
        lines.append(f"    let col = {col};")
        lines.append(f"    let o = c_off + row * {u(n)} + col;")
        stores = []
        for c in range(4):
            s = store(f"acc{g}{i}{h}.{'xyzw'[c]}", f"o + {u(c)}", f"col + {u(c)}")
            stores.append(f"if (col + {u(c)} < {u(n)}) {{ {s} }}" if n % t.bn else s)
        body = " ".join(stores)
        lines.append(f"    if (row < {u(m)}) {{ {body} }}" if m % t.bm else f"    {body}")
        lines.append("  }")
    return lines
