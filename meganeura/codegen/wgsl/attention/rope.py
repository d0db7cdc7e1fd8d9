"""``apply_rotary_emb``: the rotary position embedding, one thread per (row, frequency) pair,
four pairs per thread; the first position is the attribute plus an optional i32 operand, one
value or one per batch row.

The angle ``pos * theta^(-2i/D)`` is reduced exactly before cos/sin: each frequency is baked
as its number of turns per position in 64-bit fixed point (hi, lo words of frac(f_i / 2pi),
computed on the host with 50 decimal digits); the kernel forms the turns of ``pos * f_i``
modulo 1 with u32 arithmetic (wrapping multiply plus a 32x32 high product), reads them as a
signed 32-bit fraction in [-1/2, 1/2) and scales to an angle in [-pi, pi). The angle error is
< 3e-7 rad at every position below 2^31 (f32 ``pos * inv_freq`` alone is off by ~5e-4 rad at
8192); what remains is the device's cos/sin on [-pi, pi].
"""

from __future__ import annotations

import math
from decimal import Context, Decimal

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import PER_THREAD, WG, element_slots
from ..core.literals import f32_literal, u

_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459")

ROPE_HELPERS = """
fn mul_hi(a: u32, b: u32) -> u32 {
  let a0 = a & 0xffffu;
  let a1 = a >> 16u;
  let b0 = b & 0xffffu;
  let b1 = b >> 16u;
  let mid = ((a0 * b0) >> 16u) + ((a0 * b1) & 0xffffu) + ((a1 * b0) & 0xffffu);
  return a1 * b1 + ((a0 * b1) >> 16u) + ((a1 * b0) >> 16u) + (mid >> 16u);
}

// vec2(cos, sin) of the angle pos * (turns.x * 2^-32 + turns.y * 2^-64) turns. The quadrant
// comes exactly from the fixed-point turn w (its top two bits, rounded); the rest, in
// [-pi/4, pi/4], goes through the Cephes sinf/cosf polynomials (as core.mathlib's sin_cos_f32).
// WGSL guarantees its cos/sin builtins only to 2^-11 absolute on [-pi, pi], and browsers use that
// latitude (Chromium's SwiftShader: 1.9e-4 measured), so the builtins would make the rotations
// backend-dependent; this is within 1.2e-7 everywhere.
fn rope_cos_sin(pos: u32, turns: vec2<u32>) -> vec2<f32> {
  let w = pos * turns.x + mul_hi(pos, turns.y);
  let q = (w + 0x20000000u) >> 30u;
  let r = f32(bitcast<i32>(w - (q << 30u))) * TWO_PI_2M32;
  let z = r * r;
  let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r;
  let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2)
          * z * z - 0.5 * z + 1.0;
  let v = select(vec2<f32>(c, s), vec2<f32>(-s, c), (q & 1u) == 1u);
  return select(v, -v, q >= 2u);
}
"""


def rope_turns(dim: int, theta: float) -> list[tuple[int, int]]:
    """Per frequency i < dim/2: frac(theta^(-2i/dim) / 2pi) as 64-bit fixed point (hi, lo)."""
    ctx = Context(prec=50)
    out = []
    for i in range(dim // 2):
        f = ctx.power(Decimal(theta), ctx.divide(Decimal(-2 * i), Decimal(dim)))
        turns = ctx.divide(f, 2 * _PI)
        fixed = int(ctx.multiply(turns - int(turns), Decimal(2**64))) % 2**64
        out.append((fixed >> 32, fixed & 0xFFFFFFFF))
    return out


def lower_rope(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``apply_rotary_emb``: one dispatch, four (row, frequency) pairs per thread."""
    node = graph[node_id]
    *_, length, dim = node.type.shape
    half = dim // 2
    pairs = node.type.numel // 2
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    out = kb.write(node_id, "out")
    base = u(node.attr("position_offset"))
    offset = kb.read(node.inputs[1], "offset") if len(node.inputs) > 1 else None
    # i32[B] (B > 1): one first position per batch row, row // (rows per batch row)
    per_row = offset is not None and offset.type.numel > 1
    rows_per_batch = node.type.numel // max(1, node.type.shape[0]) // dim

    def start(row: str) -> str:
        if offset is None:
            return base
        first = offset.at(f"{row} / {u(rows_per_batch)}" if per_row else "0u")
        return f"{base} + bitcast<u32>({first})"

    slots, groups, guard = element_slots(pairs)
    sign = "-" if node.attr("inverse") else ""
    lines = [slots] + ([] if per_row else [f"  let pos0 = {start('')};"])
    for e in range(PER_THREAD):
        lines += [f"  let row{e} = j{e} / {u(half)};", f"  let f{e} = j{e} % {u(half)};"]
        if per_row:
            lines.append(f"  let pos{e} = {start(f'row{e}')};")
        pos = f"pos{e}" if per_row else "pos0"
        lines += [
            f"  let a{e} = rope_cos_sin({pos} + row{e} % {u(length)}, TURNS[f{e}]);",
            f"  let o{e} = {x.row_offset(f'row{e}')} + f{e};",
            f"  let x{e}a = {x.at_offset(f'o{e}')};",
            f"  let x{e}b = {x.at_offset(f'o{e} + {u(half)}')};",
        ]
    for e in range(PER_THREAD):
        lines += [
            f"  let c{e} = a{e}.x;",
            f"  let s{e} = {sign}a{e}.y;",
            f"  let w{e} = {kb.row_offset(out, f'row{e}', dim)} + f{e};",
            "  " + guard(e, kb.store(out, f"w{e}", f"x{e}a * c{e} - x{e}b * s{e}", True)),
            "  "
            + guard(e, kb.store(out, f"w{e} + {u(half)}", f"x{e}b * c{e} + x{e}a * s{e}", True)),
        ]
    table = ", ".join(f"vec2<u32>({hi}u, {lo}u)" for hi, lo in rope_turns(dim, node.attr("theta")))
    helpers = (
        f"const TWO_PI_2M32 = {f32_literal(2 * math.pi / 2**32)};\n"
        f"const TURNS = array<vec2<u32>, {half}>({table});\n" + ROPE_HELPERS
    )
    flops = 40 * pairs
    return [kb.finish("", "\n".join(lines), WG, groups, helpers, flops, 2 * node.type.nbytes)]
