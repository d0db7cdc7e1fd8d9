"""Elementwise kernels of the loss/dropout family: ``dropout`` (counter-based hash mask) and
``binary_cross_entropy_with_logits``. Their entries are in ``lowering.LOWERINGS``.

dropout mirrors ``meganeura/ops/dropout.py`` bit for bit: element i is kept when
``pcg(pcg(i) ^ pcg(seed)) >= threshold`` (u32 wrapping arithmetic, the same in WGSL and NumPy)
and then multiplied by the f32 scale ``1 / (1 - p)``; a dropped element is ``x * 0`` (torch's
``x * mask * scale``: a dropped NaN or +-inf is NaN, so a bad batch still reaches the loss and
the training guard), the zero opaque to the compiler (``core.literals``).

binary_cross_entropy_with_logits is ``max(x, 0) - x * t + log1p(exp(-|x|))``. WGSL has no
``log1p``; ``log(1 + u)`` would lose every digit of ``u = exp(-|x|)`` below 2^-24, so it is
``2 * atanh(s)`` with ``s = u / (2 + u)`` in [0, 1/3], summed as its odd series to s^15
(truncation < 2e-9 relative), which involves no cancellation.
"""

from __future__ import annotations

from ....graph.ir import Graph
from ....ops.dropout import PCG_INC, PCG_MUL, PCG_OUT, threshold
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import PER_THREAD, WG, contiguous_strides, element_slots
from ..core.literals import f32_literal, nonfinite_f32
from .maps import emit_map

PCG_HELPER = f"""
fn pcg(v: u32) -> u32 {{
  let st = v * {PCG_MUL}u + {PCG_INC}u;
  let w = ((st >> ((st >> 28u) + 4u)) ^ st) * {PCG_OUT}u;
  return (w >> 22u) ^ w;
}}
"""

LOG1P_EXP_HELPER = (
    "fn log1p_exp_neg(a: f32) -> f32 {\n"
    "  let e = exp(-a);\n"
    "  let s = e / (2.0 + e);\n"
    "  let z = s * s;\n"
    "  var p = "
    + f32_literal(1 / 15)
    + ";\n"
    + "".join(f"  p = p * z + {f32_literal(1 / k)};\n" for k in (13, 11, 9, 7, 5, 3))
    + "  p = p * z + 1.0;\n"
    "  return 2.0 * s * p;\n"
    "}\n"
)


def lower_dropout(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``out[i] = keep(seed, i) ? x[i] * scale : x[i] * 0``; ``PER_THREAD`` elements per
    thread."""
    node = graph[node_id]
    n = node.type.numel
    p = node.attr("p")
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    seed = kb.read(node.inputs[1], "seed")
    out = kb.write(node_id, "out")
    slots, groups, guard = element_slots(n)
    scale = f32_literal(1.0 / (1.0 - p))
    drop = nonfinite_f32(0.0)  # x * 0.0 with a literal zero is folded to 0 by Mesa
    lines = [slots.rstrip(), f"  let key = pcg({seed.at('0u')});"]
    for e in range(PER_THREAD):
        lines.append(f"  let v{e} = {x.at(f'j{e}')};")
        lines.append(f"  let keep{e} = pcg(pcg(i{e}) ^ key) >= {threshold(p)}u;")
    for e in range(PER_THREAD):
        lines.append(
            "  "
            + guard(e, kb.store(out, f"i{e}", f"select(v{e} * {drop}, v{e} * {scale}, keep{e})"))
        )
    return [kb.finish("", "\n".join(lines), WG, groups, PCG_HELPER, 12 * n, 2 * node.type.nbytes)]


def lower_bce_with_logits(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Elementwise ``max(x, 0) - x * t + log1p(exp(-|x|))``."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    st = contiguous_strides(node.type.shape)
    ops = [(kb.read(i, name), st) for i, name in zip(node.inputs, ("x", "t"), strict=True)]
    expr = "max(v0, 0.0) - v0 * v1 + log1p_exp_neg(abs(v0))"
    return [emit_map(kb, node_id, ops, expr, LOG1P_EXP_HELPER)]
