"""Optimizer update lowerings: ``sgd_update``, ``sgd_momentum_update``, ``adam_update``.

Four parameter elements per thread (``common.element_slots``). Operands are ``(param, grad,
hyper, clip, *state)``; the param and state buffers are bound ``read_write`` and updated in
place, and the op's token value is never bound. ``hyper`` (learning rate, bias corrections) is
read from its buffer so schedules change without recompiling; ``clip`` is read, or inlined when
it is a constant.

The statements mirror ``meganeura/ops/update.py`` (``_sgd_np``, ``_adam_np``) operation by
operation, with Python-float attributes rounded to f32 as NumPy does when it combines them with
float32 arrays, so results match torch.optim to float32 rounding.
"""

from __future__ import annotations

from ...graph.ir import Graph
from ..kernel import KernelSource, Limits
from .common import PER_THREAD, WG, KernelBuilder, element_slots, f32_literal


def lower_update(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """SGD (plain or momentum/Nesterov) or Adam/AdamW step on one parameter tensor.

    ``PER_THREAD`` elements per thread: every load first, then per element the update and
    its guarded stores (see ``common.element_slots``).
    """
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
    names = ("state0", "state1")[: len(state)]
    st = [kb.write(s, name) for s, name in zip(state, names, strict=True)]
    wd = float(a.get("weight_decay") or 0.0)
    slots, groups, guard = element_slots(n)
    lines = [slots.rstrip(), f"  let lr = {hyper.at('0u')};", f"  let clip = {clip.at('0u')};"]
    if node.op == "adam_update":
        lines += [f"  let step_size = {hyper.at('1u')};", f"  let bc2_sqrt = {hyper.at('2u')};"]
    elif st:
        lines.append(f"  let first = {hyper.at('1u')} != 0.0;")
    for e in range(PER_THREAD):
        lines.append(f"  let p_{e} = {p}[j{e}];")
        lines.append(f"  let g_{e} = {g.at(f'j{e}')};")
        lines += [f"  let s{k}_{e} = {b}[j{e}];" for k, b in enumerate(st)]
    for e in range(PER_THREAD):
        state_in = [f"s{k}_{e}" for k in range(len(st))]
        if node.op == "adam_update":
            body = _adam(a, wd, f"g_{e}", state_in)
        else:
            body = _sgd(a, wd, f"g_{e}", state_in)
        stores = [f"{p}[i{e}] = p;"] + [f"{b}[i{e}] = s{k};" for k, b in enumerate(st)]
        lines.append(f"  {{\n    var p = p_{e};")
        lines += ["  " + line for line in body]
        lines.append("    " + guard(e, " ".join(stores)) + "\n  }")
    nbytes = graph[p_id].type.nbytes * (2 + 2 * len(state))
    return [kb.finish("", "\n".join(lines), WG, groups, flops=10 * n, nbytes=nbytes)]


def _sgd(a: dict, wd: float, g: str, state: list[str]) -> list[str]:
    """Update ``p`` (and ``s0``, the momentum buffer) as ``_sgd_np`` does."""
    lines = [f"  var d = {g} * clip;"]
    if a["maximize"]:
        lines.append("  d = -d;")
    if wd:
        lines.append(f"  d = d + {f32_literal(wd)} * p;")
    if state:
        mom = f32_literal(a["momentum"])
        damp = f32_literal(1 - a["dampening"])
        lines += [
            f"  let s0 = select({mom} * {state[0]} + {damp} * d, d, first);",
            f"  d = d + {mom} * s0;" if a["nesterov"] else "  d = s0;",
        ]
    lines.append("  p = p - lr * d;")
    return lines


def _adam(a: dict, wd: float, g: str, state: list[str]) -> list[str]:
    """Update ``p``, ``s0`` (first moment) and ``s1`` (second moment) as ``_adam_np`` does."""
    b1, b2 = a["beta1"], a["beta2"]
    lines = [f"  var g = {g} * clip;"]
    if a["maximize"]:
        lines.append("  g = -g;")
    if wd and a["decoupled"]:
        lines.append(f"  p = p * (1.0 - lr * {f32_literal(wd)});")
    elif wd:
        lines.append(f"  g = g + {f32_literal(wd)} * p;")
    m, v = state
    lines += [
        f"  let s0 = {m} + {f32_literal(1 - b1)} * (g - {m});",
        f"  let s1 = {f32_literal(b2)} * {v} + {f32_literal(1 - b2)} * g * g;",
        f"  p = p - step_size * s0 / (sqrt(s1) / bc2_sqrt + {f32_literal(a['eps'])});",
    ]
    return lines
