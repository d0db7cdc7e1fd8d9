"""The attention backward's ``delta`` pass inside the query-gradient kernel.

``..._delta(lse, out, g)`` (``lowering.lower_delta``) is a whole dispatch for one dot product
per query row, and the lane kernel's ``dq`` mode (rows are queries) needs each row's delta
anyway. Where ``passes.fuse.plan_attention_delta`` pairs them, the dq kernel computes each of
its rows' ``delta = sum(g * out)`` itself, in lower_delta's f32 order (a sequential sum of the
row's vec4 dots from 0.0, one thread per row, so the values are bit-identical), uses it, and
stores the ``(lse, delta)`` pair where lower_delta stores it, for the key/value gradients that
read it later; the delta node gets no kernel. ``set_enabled`` switches it off (benchmarks and
tests compare both).
"""

from __future__ import annotations

from dataclasses import replace

from ....graph.ir import Graph
from ....ops.attention import BWD_Q, DELTA
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src
from .common import dims_of, load4
from .plan import choose_block_plan
from .splits import choose_long_split

ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler
# the fused dq kernel's storage bindings besides the mask / key count: q k v dO lse out | dq pairs
BINDINGS = 8


def set_enabled(on: bool) -> None:
    """Let the dq kernel compute its rows' delta (on, the default) or not, for programs
    compiled from now on."""
    ENABLED[:] = [bool(on)]


def delta_fusible(graph: Graph, delta_node: int, dq_node: int, limits: Limits) -> bool:
    """Whether query-gradient node ``dq_node`` (``..._backward_query(q, k, v, g, stats,
    mask?)``) may compute delta node ``delta_node`` (``..._delta(lse, out, g)``, its stats
    operand) in its kernel: the switch is on, both read the same ``g``, the dq runs on the lane
    kernel (no block plan) and the kernel's bindings fit the adapter."""
    if not ENABLED[0]:
        return False
    delta, dq = graph[delta_node], graph[dq_node]
    if delta.op != DELTA or dq.op != BWD_Q or dq.inputs[4] != delta_node:
        return False
    if dq.inputs[3] != delta.inputs[2] or delta.type.numel == 0 or dq.type.numel == 0:
        return False
    if choose_block_plan("dq", dims_of(graph, dq, "dq"), limits) is not None:
        return False
    return BINDINGS + len(dq.inputs) - 5 <= limits.max_storage_buffers_per_shader_stage


def delta_sources(kb: KernelBuilder, graph: Graph, delta_node: int) -> dict[str, Src]:
    """The delta node's operands the dq kernel reads besides its own: ``lse``, ``o``."""
    lse_id, out_id, _ = graph[delta_node].inputs
    return {"lse": kb.read(lse_id, "lse"), "o": kb.read(out_id, "o")}


def delta_registers(k) -> list[str]:
    """The row's ``lse`` and ``delta``, after its ``g{c}`` registers (loaded exactly as
    ``lower_delta`` loads g): delta summed in lower_delta's order."""
    dv = k.dims.dv
    lines = [f"  let lse = {k.src['lse'].at('qrow')};"]
    lines.append(f"  let dob = {k.src['o'].row_offset('qrow')};")
    lines.append("  var delta = 0.0;")
    for c in range(k.dims.dv4):
        lines.append(f"  delta = delta + dot(g{c}, {load4(k.src['o'], 'dob', c, dv)});")
    return lines


def delta_stores(kb: KernelBuilder, out: str) -> list[str]:
    """Lane 0 of a live row stores its ``(lse, delta)`` pair (``lower_delta``'s layout)."""
    return [
        "    " + kb.store(out, "qrow * 2u", "lse"),
        "    " + kb.store(out, "qrow * 2u + 1u", "delta"),
    ]


def lower_dq_delta(
    graph: Graph, delta_node: int, dq_node: int, limits: Limits
) -> list[KernelSource]:
    """One dispatch writing dq (node ``dq_node``) and the ``(lse, delta)`` pairs of node
    ``delta_node``, at dq's position. Named ``%<delta>+<dq> ..._backward_query dq+delta``.
    A long query block that ``splits.choose_long_split`` splits is two: ``dq+delta split CxL``
    (the chunks' parts of dq, the pairs) and ``dq+delta sum C`` (``dq_split``)."""
    from .dq_split import lower_dq_split  # both import lane, which imports this module
    from .lane import lower_flash

    split = choose_long_split(dims_of(graph, graph[dq_node], "dq"), limits, "dq")
    if split is None:
        kernels = lower_flash(graph, dq_node, limits, "dq", delta_node=delta_node)
    else:
        kernels = lower_dq_split(graph, dq_node, limits, split, delta_node)
    head = f"%{dq_node} {BWD_Q} dq"
    name = f"%{delta_node}+{dq_node} {BWD_Q} dq+delta"
    return [replace(ks, name=name + ks.name.removeprefix(head)) for ks in kernels]
