"""The small-M matmul kernel (``Plan.kernel == "gemv"``): ``[M <= 8, K] @ [K, N]``, decode.

With so few rows the product is bound by reading B (the weight) once, so the kernel is built
around streaming B with every warp reading neighbouring addresses, and keeps all M rows'
sums in named registers (A is tiny and stays in cache). Two layouts of B:

  * B stored [N, K] (``x @ W.mT``, nn.Linear's weight): ``lanes`` threads share one output
    column, lane l reading K positions l, l + lanes, ... (vec4 runs when K % 4 == 0), so a
    warp reads one contiguous stretch of a weight row; 256 / lanes columns per workgroup.
    The lanes' sums are combined in workgroup memory (rows padded by one float against bank
    conflicts), in lane order.
  * B stored [K, N]: each thread owns 4 neighbouring columns (a vec4 of a B row) and one of
    ``lanes`` K slices; 1024 / lanes columns per workgroup; the slices are combined in
    workgroup memory in slice order.

With split-K (``Plan.splits``), chunk ``split`` covers K positions [k_begin, k_end) and the
store writes its partial sum (``lowering._sum_splits`` adds them up). Columns past N clamp
their loads to column N - 1 and skip the store, so the K loop has no bounds checks.
"""

from __future__ import annotations

from ..core.builder import KernelBuilder
from ..core.literals import u
from .plan import WG, Plan
from .problem import Problem, Store, bind_operands, vec_ok


def _prologue(p: Problem, cols: int, splits: int, chunk: int) -> tuple[list[str], int]:
    blocks = -(-p.n // cols)
    lines = [f"  let cb = wg % {u(blocks)};", f"  let bi = (wg / {u(blocks)}) % {u(p.nb)};"]
    lines += p.k_range(blocks * p.nb, splits, chunk)
    return lines + p.offsets(), blocks * p.nb * splits


def _times(expr: str, n: int) -> str:
    return expr if n == 1 else f"{expr} * {u(n)}"


def emit_gemv(
    kb: KernelBuilder, p: Problem, plan: Plan, splits: int, chunk: int, store: Store
) -> tuple[str, str, int]:
    """Bind A and B and emit the kernel body; returns (body, helpers, workgroups)."""
    if p.b.rows == 1 and p.b.cols != 1 or p.n == 1:
        return _rows_of_b(kb, p, plan.lanes, splits, chunk, store)
    return _cols_of_b(kb, p, plan.lanes, splits, chunk, store)


def _rows_of_b(kb, p: Problem, lanes: int, splits: int, chunk: int, store: Store):
    """B stored [N, K] (stride 1 along K): lanes split one column's K."""
    cols = WG // lanes
    want_b = p.b.rows == 1 and vec_ok(p.b, p.k, p.b.cols)
    want_a = want_b and p.a.cols == 1 and vec_ok(p.a, p.k, p.a.rows)
    p = bind_operands(kb, p, want_a, want_b)
    vb = p.b.vec and want_b
    va = vb and p.a.vec and want_a
    lines, groups = _prologue(p, cols, splits, chunk)
    lines += [
        f"  let lane = lid % {u(lanes)};",
        f"  let cl = lid / {u(lanes)};",
        f"  let colc = min(cb * {u(cols)} + cl, {u(p.n - 1)});",
        f"  let wrow = b_off + {_times('colc', p.b.cols)};",
    ]
    a, b = p.a, p.b

    def x_at(m: int, k: str) -> str:
        return a.scalar(kb, f"a_off + {u(m * a.rows)} + {_times(k, a.cols)}")

    if vb:
        lines += [f"  var acc{m} = vec4<f32>(0.0);" for m in range(p.m)]
        lines.append(f"  for (var q = k_begin / 4u + lane; q < k_end / 4u; q = q + {u(lanes)}) {{")
        lines.append(f"    let w = {b.vec4(kb, 'wrow + q * 4u')};")
        for m in range(p.m):
            if va:
                x = a.vec4(kb, f"a_off + {u(m * a.rows)} + q * 4u")
            else:
                x = "vec4<f32>(" + ", ".join(x_at(m, f"(q * 4u + {u(c)})") for c in range(4)) + ")"
            lines.append(f"    acc{m} += {x} * w;")
        lines.append("  }")
        sums = [f"acc{m}.x + acc{m}.y + acc{m}.z + acc{m}.w" for m in range(p.m)]
    else:
        lines += [f"  var acc{m} = 0.0;" for m in range(p.m)]
        lines.append(f"  for (var k = k_begin + lane; k < k_end; k = k + {u(lanes)}) {{")
        lines.append(f"    let w = {b.scalar(kb, 'wrow + ' + _times('k', b.rows))};")
        lines += [f"    acc{m} += {x_at(m, 'k')} * w;" for m in range(p.m)]
        lines.append("  }")
        sums = [f"acc{m}" for m in range(p.m)]
    row = lanes + 1
    lines += [
        f"  red[{u(m * cols * row)} + cl * {u(row)} + lane] = {s};" for m, s in enumerate(sums)
    ]
    lines += [
        "  workgroupBarrier();",
        # M * cols can exceed the 256 threads (few lanes): each thread takes every 256th sum.
        f"  for (var t = lid; t < {u(p.m * cols)}; t = t + {u(WG)}) {{",
        "    var s = 0.0;",
        f"    for (var l = 0u; l < {u(lanes)}; l = l + 1u) {{ s += red[t * {u(row)} + l]; }}",
        f"    let row = t / {u(cols)};",
        f"    let col = cb * {u(cols)} + t % {u(cols)};",
        f"    let o = c_off + row * {u(p.n)} + col;",
        f"    if (col < {u(p.n)}) {{ {store('s', 'o', 'col')} }}",
        "  }",
    ]
    helpers = f"var<workgroup> red: array<f32, {p.m * cols * row}>;\n"
    return "\n".join(lines), helpers, groups


def _cols_of_b(kb, p: Problem, lanes: int, splits: int, chunk: int, store: Store):
    """B stored [K, N] (stride 1 along N): each thread owns 4 columns and a K slice."""
    c4 = WG // lanes
    cols = 4 * c4
    want_b = p.b.cols == 1 and vec_ok(p.b, p.n, p.b.rows)
    p = bind_operands(kb, p, False, want_b)
    a, b = p.a, p.b
    vb = b.vec and want_b
    lines, groups = _prologue(p, cols, splits, chunk)
    lines += [
        f"  let c4 = lid % {u(c4)};",
        f"  let ks = lid / {u(c4)};",
        f"  let col0 = cb * {u(cols)} + c4 * 4u;",
    ]
    if vb:
        lines.append(f"  let wc = b_off + min(col0, {u(p.n - 4)});")
        w = b.vec4(kb, f"wc + {_times('k', b.rows)}")
    else:
        lines += [
            f"  let wc{c} = b_off + {_times(f'min(col0 + {u(c)}, {u(p.n - 1)})', b.cols)};"
            for c in range(4)
        ]
        w = (
            "vec4<f32>("
            + ", ".join(b.scalar(kb, f"wc{c} + {_times('k', b.rows)}") for c in range(4))
            + ")"
        )
    lines += [f"  var acc{m} = vec4<f32>(0.0);" for m in range(p.m)]
    lines.append(f"  for (var k = k_begin + ks; k < k_end; k = k + {u(lanes)}) {{")
    lines.append(f"    let w = {w};")
    lines += [
        f"    acc{m} += {a.scalar(kb, f'a_off + {u(m * a.rows)} + ' + _times('k', a.cols))} * w;"
        for m in range(p.m)
    ]
    lines.append("  }")
    for m in range(p.m):
        stores = " ".join(
            f"if (col0 + {u(c)} < {u(p.n)}) {{ "
            + store("s." + "xyzw"[c], f"o + {u(c)}", f"col0 + {u(c)}")
            + " }"
            for c in range(4)
        )
        lines += [
            f"  red[lid] = acc{m};",
            "  workgroupBarrier();",
            "  if (ks == 0u) {",
            "    var s = red[c4];",
            f"    for (var j = 1u; j < {u(lanes)}; j = j + 1u) {{ s += red[j * {u(c4)} + c4]; }}",
            f"    let o = c_off + {u(m * p.n)} + col0;",
            f"    {stores}",
            "  }",
            "  workgroupBarrier();",
        ]
    helpers = f"var<workgroup> red: array<vec4<f32>, {WG}>;\n"
    return "\n".join(lines), helpers, groups
