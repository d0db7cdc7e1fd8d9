"""The CPU matmul kernel (``Plan.kernel == "simd"``): llvmpipe's (lavapipe's) shape, any M, N, K.

llvmpipe runs a workgroup on one CPU thread with its invocations as the lanes of one SIMD
register (8 on AVX2), and every storage or workgroup-memory load as a loop over the lanes
(Mesa 22.3): loads, not multiply-adds, set the time, and barriers and workgroup memory only add
loads. So the workgroup is one subgroup of ``SIMD`` = 8 invocations with no workgroup memory and
no barrier. It computes a ``bm`` x ``8 * TN`` output tile: lane ``l`` owns ``TN`` neighbouring
columns and all ``bm`` rows; per K position (a vec4 of four when both operands are contiguous
along K, ``problem.vec_ok``) each lane loads its ``TN`` B values and ``bm / 8`` rows of A, and
the A rows reach every lane through ``subgroupBroadcast`` (a register shuffle on llvmpipe), so
each loaded value feeds ``bm`` (B) or 8 * TN (A) multiply-adds instead of one or two.
Measured on lavapipe, [128, 576] x [1536, 576]^T: 17 ms of CPU time against 51-64 ms for the
tiled kernel's best plan (bench/cpu_matmul.py).

Where the subgroup is smaller than 8 lanes (a CPU without 256-bit vectors) a second copy of the
K loop loads each lane's A rows itself; the branch is uniform. Rows and columns past M and N
clamp their loads to row M - 1 / column N - 1 and skip the store.
"""

from __future__ import annotations

from ..core.builder import KernelBuilder
from ..core.literals import u
from .plan import Plan
from .problem import Problem, Store, bind_operands, vec_ok

SIMD = 8  # invocations per workgroup: one AVX2 register of f32 lanes
TN = 2  # columns per lane


def _times(expr: str, n: int) -> str:
    return expr if n == 1 else f"{expr} * {u(n)}"


def _quad(kb: KernelBuilder, op, index: str) -> str:
    """vec4<f32> of elements ``index .. index + 3``: one load from a vec4 binding, or four
    scalar loads where the value is bound as scalars."""
    if op.vec:
        return op.vec4(kb, index)
    return "vec4<f32>(" + ", ".join(op.scalar(kb, f"{index} + {u(t)}") for t in range(4)) + ")"


def emit_simd(
    kb: KernelBuilder, p: Problem, plan: Plan, splits: int, chunk: int, store: Store
) -> tuple[str, str, int]:
    """Bind A and B and emit the kernel body; returns (body, helpers, workgroups).

    Raises:
        ValueError: split-K was asked for (this kernel has none) or ``plan.lanes`` (the tile's
            rows) is not a multiple of 8.
    """
    bm = plan.lanes
    if splits != 1 or bm % SIMD:
        raise ValueError(f"simd matmul plan {plan.name}: no split-K, rows a multiple of {SIMD}")
    want_a = p.a.cols == 1 and vec_ok(p.a, p.k, p.a.rows)
    want_b = p.b.rows == 1 and vec_ok(p.b, p.k, p.b.cols)
    p = bind_operands(kb, p, want_a and want_b, want_a and want_b)
    a, b = p.a, p.b
    # dot products of 4 K positions whenever both operands allow it, also when one is bound as
    # scalars (the epilogue reads it element by element, ``linear(h, w) + h``): the sum then
    # rounds as the unfused product's does (four scalar loads make the vec4)
    vec = want_a and want_b
    bn = SIMD * TN
    blocks_n, blocks_m = -(-p.n // bn), -(-p.m // bm)
    per = bm // SIMD
    lines = [
        f"  let cb = wg % {u(blocks_n)};",
        f"  let rb = (wg / {u(blocks_n)}) % {u(blocks_m)};",
        f"  let bi = wg / {u(blocks_n * blocks_m)};",
        *p.offsets(),
        f"  let m0 = rb * {u(bm)};",
        f"  let n0 = cb * {u(bn)} + lid * {u(TN)};",
    ]
    lines += [
        f"  let ar{r} = a_off + {_times(f'min(m0 + {u(r * SIMD)} + lid, {u(p.m - 1)})', a.rows)};"
        for r in range(per)
    ]
    lines += [
        f"  let ao{i} = a_off + {_times(f'min(m0 + {u(i)}, {u(p.m - 1)})', a.rows)};"
        for i in range(bm)
    ]
    lines += [
        f"  let bc{j} = b_off + {_times(f'min(n0 + {u(j)}, {u(p.n - 1)})', b.cols)};"
        for j in range(TN)
    ]
    lines += [f"  var c{i}_{j} = 0.0;" for i in range(bm) for j in range(TN)]

    if vec:
        step, count = "q", p.k // 4

        def a_at(row: str) -> str:
            return _quad(kb, a, f"{row} + q * 4u")

        def b_at(j: int) -> str:
            return _quad(kb, b, f"bc{j} + q * 4u")

        def mac(x: str, y: str) -> str:
            return f"dot({x}, {y})"
    else:
        step, count = "q", p.k

        def a_at(row: str) -> str:
            return a.scalar(kb, f"{row} + {_times('q', a.cols)}")

        def b_at(j: int) -> str:
            return b.scalar(kb, f"bc{j} + {_times('q', b.rows)}")

        def mac(x: str, y: str) -> str:
            return f"{x} * {y}"

    def k_loop(broadcast: bool) -> list[str]:
        out = [f"    for (var {step} = 0u; {step} < {u(count)}; {step} = {step} + 1u) {{"]
        out += [f"      let bv{j} = {b_at(j)};" for j in range(TN)]
        if broadcast:
            out += [f"      let al{r} = {a_at(f'ar{r}')};" for r in range(per)]
        for i in range(bm):
            r, lane = divmod(i, SIMD)
            av = f"subgroupBroadcast(al{r}, {u(lane)})" if broadcast else a_at(f"ao{i}")
            out.append(f"      {{ let av = {av};")
            out += [f"        c{i}_{j} += {mac('av', f'bv{j}')};" for j in range(TN)]
            out.append("      }")
        return out + ["    }"]

    lines.append(f"  if (sgs >= {u(SIMD)}) {{")
    lines += k_loop(True)
    lines.append("  } else {")
    lines += k_loop(False)
    lines.append("  }")
    for i in range(bm):
        for j in range(TN):
            row, col = f"m0 + {u(i)}", f"n0 + {u(j)}"
            lines.append(
                f"  if ({row} < {u(p.m)} && {col} < {u(p.n)}) {{ let col = {col}; "
                + store(f"c{i}_{j}", f"c_off + ({row}) * {u(p.n)} + col", "col")
                + " }"
            )
    return "\n".join(lines), "", blocks_n * blocks_m * p.nb
