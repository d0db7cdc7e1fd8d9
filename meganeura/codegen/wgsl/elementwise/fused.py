"""Fused kernels: one dispatch computing a whole ``passes.fuse.FusionGroup``.

A pair of attention key and value gradients is ``attention.lowering.lower_key_value``'s one pass.
A group of elementwise nodes becomes one map over the group's iteration shape: each element
loads the group's external operands (each through its own baked broadcast strides relative
to that shape), evaluates every member in program order as a WGSL ``let`` with the same
expression its own kernel would use (``maps.node_expr``), and stores the members the
group marks as outputs (vec4 loads and stores when every operand allows them, see
``vector``). A group anchored on a ``matmul`` runs the same per-element code in
the matmul's store stage, with the accumulator as the anchor's value.

Invariants: the f32 operations and their order are those of the unfused kernels (a stored
f32 value reloaded is the same f32 value), so results are bit-identical unless the shader
compiler contracts a multiply and a later add into one fused multiply-add across what were
two kernels; each value is bound once (``KernelBuilder``), constants are literals, members
that are not outputs are never bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from ....graph.ir import Graph, resolve_view
from ....ops.attention import BWD_K
from ....passes.fuse import FusionGroup
from ...kernel import KernelSource, Limits
from ..attention.lowering import lower_key_value
from ..core.builder import KernelBuilder, Src, check_numel, is_constant
from ..core.layout import (
    PER_THREAD,
    WG,
    broadcast_strides,
    coalesce,
    contiguous_strides,
    element_slots,
    strided_index,
)
from ..core.mathlib import helper_source
from ..matmul.lowering import lower_matmul
from .maps import OPAQUE_NEG_ZERO, node_expr
from .vector import emit_vec4, plan_vec4


class GroupBody:
    """The per-element code of a group: external operands, member ``let``s and stores.

    Operand k (a value outside the group, or a constant) is ``x{k}``; the group's member of
    position j (in ``group.members``) is ``t{j}``: names local to the group, so the same
    fused code at another place of the graph (the next layer, the next step of an unrolled
    loop) is the same WGSL text and the same pipeline.

    Args:
        graph: the graph.
        group: the fusion group.
        anchors: the members whose values the caller supplies (``compute``'s ``anchor``);
            default the group's anchor. A horizontal matmul segment supplies several.
    """

    def __init__(
        self, graph: Graph, group: FusionGroup, anchors: tuple[int, ...] | None = None
    ) -> None:
        self.graph, self.group = graph, group
        if anchors is None:
            anchors = () if group.anchor is None else (group.anchor,)
        self.anchors = anchors
        members = set(group.members)
        self.local = {m: j for j, m in enumerate(group.members)}
        self.operand_ids: list[int] = []
        for m in group.members:
            if m not in anchors:
                for i in graph[m].inputs:
                    if i not in members and i not in self.operand_ids:
                        self.operand_ids.append(i)
        self.srcs: list[Src] = []
        self.outs: list[str] = []
        helpers: dict[str, None] = {}
        self.lets: list[str] = []
        for m in group.members:
            if m in anchors:
                continue
            names = [self.var(i) if i in members else self.operand(i) for i in graph[m].inputs]
            expr, used = node_expr(graph, graph[m], names)
            helpers.update(dict.fromkeys(used))
            if graph[m].type.dtype.is_floating:
                # An opaque identity between the ops of a chain: Mesa's inexact algebra
                # otherwise rewrites across them (exp(log a) -> a, sqrt(a) * sqrt(a) -> |a|,
                # (a + b) - b -> a), which is wrong for negative, inf and NaN inputs.
                expr = f"({expr} + {OPAQUE_NEG_ZERO})"
            self.lets.append(f"let {self.var(m)} = {expr};")
        self.helper_names = tuple(helpers)  # for kernels running several bodies
        self.helpers = helper_source(helpers)

    def var(self, member: int) -> str:
        """The WGSL name of a member's value."""
        return f"t{self.local[member]}"

    def operand(self, vid: int) -> str:
        return f"x{self.operand_ids.index(vid)}"

    def bind(self, kb: KernelBuilder) -> None:
        """Bind the operands for reading, then the outputs for writing."""
        self.srcs = [kb.read(i, f"x{k}") for k, i in enumerate(self.operand_ids)]
        self.outs = [kb.write(m, f"y{k}") for k, m in enumerate(self.group.outputs)]

    def strides(self, k: int) -> tuple[int, ...]:
        return broadcast_strides(self.srcs[k].type.shape, self.group.shape)

    def index(self, k: int, flat: str, col: str | None = None) -> str:
        """Index into operand k of the element at flat output index ``flat`` (column ``col``
        when the output is a matrix and ``col`` is already computed)."""
        shape, st = self.group.shape, self.strides(k)
        if col is not None and len(st) >= 1 and st[-1] == 1 and not any(st[:-1]):
            return col
        cshape, (ident, cst) = coalesce(shape, [contiguous_strides(shape), st])
        return flat if cst == ident else strided_index(flat, cshape, cst)

    def compute(self, loads: list[str], anchor: str | list[str] | None = None) -> str:
        """Statements defining every member from the operand expressions ``loads`` and the
        anchors' values ``anchor`` (one expression per anchor, or one for a single anchor)."""
        lets = [f"let x{k} = {v};" for k, v in enumerate(loads)]
        if anchor is not None:
            values = [anchor] if isinstance(anchor, str) else anchor
            lets += [f"let {self.var(a)} = {v};" for a, v in zip(self.anchors, values, strict=True)]
        return " ".join(lets + self.lets)

    def stores(self, flat: str, kb: KernelBuilder) -> str:
        outs = zip(self.outs, self.group.outputs, strict=True)
        return " ".join(kb.store(out, flat, self.var(m)) for out, m in outs)

    @property
    def nbytes(self) -> int:
        read = sum(s.type.nbytes for s in self.srcs if s.literal is None)
        return read + sum(self.graph[m].type.nbytes for m in self.group.outputs)

    @property
    def flops(self) -> int:
        return math.prod(self.group.shape) * len(self.lets)

    @property
    def name(self) -> str:
        """``%6+7+8 matmul`` for an anchored group (the epilogue is the matmul's store stage,
        so profiles grouped by op keep one matmul row), ``%24+25 greater+where`` otherwise."""
        g, ops = self.group, (self.graph[m].op for m in self.group.members)
        ids = "+".join(str(m) for m in g.members)
        return f"%{ids} {'matmul' if g.anchor is not None else '+'.join(ops)}"


class _MatmulEpilogue:
    """``matmul.problem.Epilogue`` running a group's per-element code on the accumulator."""

    def __init__(self, body: GroupBody) -> None:
        self.body = body
        self.helpers = "\n" + body.helpers if body.helpers else ""

    def bind(self, kb: KernelBuilder) -> None:
        self.kb = kb
        self.body.bind(kb)
        self.flops, self.nbytes = self.body.flops, self.body.nbytes

    def store(self, value: str, flat: str, col: str) -> str:
        b = self.body
        loads = [
            s.literal if s.literal is not None else s.at(b.index(k, flat, col))
            for k, s in enumerate(b.srcs)
        ]
        return f"{{ {b.compute(loads, anchor=value)} {b.stores(flat, self.kb)} }}"


_NORM_ANCHORS = ("group_norm", "group_norm_backward", "layer_norm_backward", "rms_norm_backward")


def _lower_norm_pair(graph: Graph, group: FusionGroup, limits: Limits) -> list[KernelSource]:
    """A ``passes.fuse_norm`` group: group_norm + silu, or group_norm_backward with its
    silu_backward and / or group_norm_weight_backward (and the bias gradient's sum), or a
    layer_norm / rms_norm input gradient with its weight gradient (and layer_norm's bias
    gradient's sum) and / or the residual add reading it."""
    from ..norm.lowering import lower_norm_act, lower_norm_backward_act  # norm imports maps

    norm = group.anchor
    role = {graph[m].op: m for m in group.members if m != norm}
    if graph[norm].op == "group_norm":
        ks = lower_norm_act(graph, norm, role["silu"], norm in group.outputs, limits)
    else:
        pro = role.get("silu_backward")
        wgrad = role.get(graph[norm].op.replace("_backward", "_weight_backward"))
        bias = role.get("sum")
        res = role.get("add")
        ks = lower_norm_backward_act(
            graph, norm, pro, pro in group.outputs, wgrad, limits, bias, res
        )
    if ks is None:  # pragma: no cover - plan_norm_activation asked norm_act_fusible
        raise ValueError(f"{graph[norm].op} %{norm} + {role}: no fused lowering")
    ops = [graph[m].op for m in group.members if graph[m].op in ("silu", "silu_backward")]
    ops.insert(0 if graph[norm].op == "group_norm" else len(ops), graph[norm].op)
    ops += ["add"] * ("add" in role)
    joined = "+".join(ops)
    return [replace(k, name=k.name.replace(graph[norm].op, joined, 1)) for k in ks]


def lower_group(
    graph: Graph,
    group: FusionGroup,
    limits: Limits,
    deferred: Mapping | None = None,
    sum_only: bool = False,
    defer_sum: bool = False,
) -> list[KernelSource]:
    """The one dispatch computing every member of ``group`` and storing its outputs
    (``deferred``: split-K products read as sums of their partials, ``matmul.deferred``;
    ``sum_only``: a split-K anchor's summing dispatch alone, ``matmul.split_group``;
    ``defer_sum``: a split-K anchor's partials dispatch alone, the summing dispatch and the
    epilogue run by a norm reading the group's output, ``norm.prologue``; both: none).

    Raises:
        ValueError: as ``lower`` would for the members one by one: for the first value (in
            program order) with 2^31 elements or more or larger than one storage binding,
            even a member the fused kernel never stores (errors do not depend on fusion).
    """
    for m in group.members:
        for i in graph[m].inputs:
            if i not in group.members and not is_constant(graph, i):
                check_numel(graph, resolve_view(graph, i), limits)
        check_numel(graph, m, limits)
    if group.anchor is not None and graph[group.anchor].op in _NORM_ANCHORS:
        return _lower_norm_pair(graph, group, limits)
    if group.anchor is not None and graph[group.anchor].op == BWD_K:
        (value,) = (m for m in group.members if m != group.anchor)
        return lower_key_value(graph, group.anchor, value, limits)
    body = GroupBody(graph, group)
    if group.anchor is not None and defer_sum:
        kernels = [] if sum_only else lower_matmul(graph, group.anchor, limits, defer_sum=True)
        return [replace(ks, name=body.name) for ks in kernels]
    if group.anchor is not None:
        epilogue = _MatmulEpilogue(body)
        kernels = lower_matmul(graph, group.anchor, limits, epilogue, deferred, sum_only=sum_only)
        return [replace(ks, name=body.name) for ks in kernels]
    kb = KernelBuilder(graph, graph[group.sink], limits, deferred)
    body.bind(kb)
    n = math.prod(group.shape)
    reads = plan_vec4(group.shape, body.srcs, [body.strides(k) for k in range(len(body.srcs))])
    if reads is not None:
        outs = [(v, body.var(m), graph[m].type.dtype) for v, m in zip(body.outs, group.outputs)]
        src, groups = emit_vec4(kb, n, body.srcs, reads, body.compute, outs)
        ks = kb.finish("", src, WG, groups, body.helpers, body.flops, body.nbytes)
        return [replace(ks, name=body.name)]
    slots, groups, guard = element_slots(n)
    lines = [slots.rstrip()]
    live = [(k, src) for k, src in enumerate(body.srcs) if src.literal is None]
    for k, src in live:
        lines += [f"  let x{k}_{e} = {src.at(body.index(k, f'j{e}'))};" for e in range(PER_THREAD)]
    for e in range(PER_THREAD):
        loads = [f"x{k}_{e}" if s.literal is None else s.literal for k, s in enumerate(body.srcs)]
        lines.append(f"  {{ {body.compute(loads)} {guard(e, body.stores(f'i{e}', kb))} }}")
    ks = kb.finish("", "\n".join(lines), WG, groups, body.helpers, body.flops, body.nbytes)
    return [replace(ks, name=body.name)]
