"""Optimizer update lowerings: ``sgd_update``, ``sgd_momentum_update``, ``adam_update``.

One thread per parameter element. Operands are ``(param, grad, hyper, clip, *state)``; the
param and state buffers are bound ``read_write`` and updated in place, and the op's token
value is never bound. ``hyper`` (learning rate, bias corrections) is read from its buffer so
schedules change without recompiling; ``clip`` is read, or inlined when it is a constant.

The statements mirror ``meganeura/ops/update.py`` (``_sgd_np``, ``_adam_np``) operation by
operation, with Python-float attributes rounded to f32 as NumPy does when it combines them
with float32 arrays, so results match torch.optim to float32 rounding.
"""

from __future__ import annotations

from ...graph.ir import Graph
from ..kernel import KernelSource, Limits
from .common import WG, KernelBuilder, f32_literal, u


def lower_update(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """SGD (plain or momentum/Nesterov) or Adam/AdamW step on one parameter tensor."""
    node = graph[node_id]
    a = node.attr_dict
    p_id, g_id, h_id, c_id, *state = node.inputs
    n = graph[p_id].type.numel
    if n == 0:
        return []
    kb = KernelBuilder(graph, node, limits)
    p = kb.write(p_id, "param")
    g = kb.read(g_id, "grad")
    hyper = kb.read(h_id, "hyper")
    clip = kb.read(c_id, "clip")
    st = [
        kb.write(s, name) for s, name in zip(state, ("state0", "state1")[: len(state)], strict=True)
    ]
    wd = float(a.get("weight_decay") or 0.0)
    lines = [
        f"  let i = wg * {u(WG)} + lid;",
        f"  if (i >= {u(n)}) {{ return; }}",
        f"  let lr = {hyper.at('0u')};",
        f"  var p = {p}[i];",
    ]
    if node.op == "adam_update":
        lines += _adam(a, wd, g.at("i"), clip.at("0u"), hyper, st)
    else:
        lines += _sgd(a, wd, g.at("i"), clip.at("0u"), hyper, st)
    lines.append(f"  {p}[i] = p;")
    nbytes = graph[p_id].type.nbytes * (2 + 2 * len(state))
    return [kb.finish("", "\n".join(lines), WG, -(-n // WG), flops=10 * n, nbytes=nbytes)]


def _sgd(a: dict, wd: float, g: str, clip: str, hyper, st: list[str]) -> list[str]:
    lines = [f"  var d = {g} * {clip};"]
    if a["maximize"]:
        lines.append("  d = -d;")
    if wd:
        lines.append(f"  d = d + {f32_literal(wd)} * p;")
    if st:
        mom = f32_literal(a["momentum"])
        lines += [
            f"  let first = {hyper.at('1u')} != 0.0;",
            f"  let buf = select({mom} * {st[0]}[i] + {f32_literal(1 - a['dampening'])} * d, d,"
            " first);",
            f"  {st[0]}[i] = buf;",
            f"  d = d + {mom} * buf;" if a["nesterov"] else "  d = buf;",
        ]
    lines.append("  p = p - lr * d;")
    return lines


def _adam(a: dict, wd: float, g: str, clip: str, hyper, st: list[str]) -> list[str]:
    b1, b2 = a["beta1"], a["beta2"]
    lines = [
        f"  let step_size = {hyper.at('1u')};",
        f"  let bc2_sqrt = {hyper.at('2u')};",
        f"  var g = {g} * {clip};",
    ]
    if a["maximize"]:
        lines.append("  g = -g;")
    if wd and a["decoupled"]:
        lines.append(f"  p = p * (1.0 - lr * {f32_literal(wd)});")
    elif wd:
        lines.append(f"  g = g + {f32_literal(wd)} * p;")
    m, v = st
    lines += [
        f"  let m = {m}[i] + {f32_literal(1 - b1)} * (g - {m}[i]);",
        f"  let v = {f32_literal(b2)} * {v}[i] + {f32_literal(1 - b2)} * g * g;",
        f"  {m}[i] = m;",
        f"  {v}[i] = v;",
        f"  p = p - step_size * m / (sqrt(v) / bc2_sqrt + {f32_literal(a['eps'])});",
    ]
    return lines
