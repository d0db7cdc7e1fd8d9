"""A train-mode batch_norm or a group_norm (alone or with its SiLU) that computes its input from
a convolution's split-K partials: the norm kernel runs the conv's summing dispatch.

A forward ``conv2d`` whose GEMM plan splits K (``conv.gemm``: too few M x N tiles for the GPU,
long K) writes ``splits`` partial products in GEMM order (``[split][grp][m][n]``) and a second
dispatch sums them and adds the bias (``conv.gemm.sum_lines``). On the H200 every dispatch costs
~7 us however small; ResNet-50's training step has 26 such sums read by train-mode batch_norm,
the W5 U-Net's forward and training step 9 read by ``group_norm+silu``. Here the norm kernel
(``norm.team``, register mode) computes each element of x itself: the summing kernel's loop
(``matmul.deferred.SplitPartials.helper`` with the conv's GEMM index and lanes: the same f32
additions in the same order, vec4 loads of four neighbouring pixels when 4 divides a plane),
plus the bias of its channel as the summing kernel adds it, then stores x (narrowed to f16
where x is stored so) when anything else reads it (in training the norm's backward, its weight
gradient, the running statistics, a skip connection) and normalizes x as read back (f16-rounded
in the fast mode). Values are bit-identical to the two-dispatch program. The conv keeps its
partials dispatch (``conv.lowering.lower_conv2d(defer_sum=True)``); the norm binds the
partials (a ``ScratchRef`` owned by the conv), so the planner keeps them alive until there.

Why the norm stores x rather than every reader summing: the backward's readers (the norm's
input and weight gradients, the running statistics) would each read ``splits`` values per
element and keep the partials alive through the whole forward; storing x from the norm removes
the same one dispatch per conv with one reader of the partials.

Conditions (``plan_conv_norms``): the conv is needed, in no fusion group (no epilogue anchored
on it), its output x f32 or f16, not written through a placed view; the first reader of x
(through views, by kernel position) is a train-mode ``batch_norm`` in no group, or a
``group_norm`` alone or in a ``passes.fuse_norm`` group with its SiLU, reading x (of x's shape)
as its input; every other reader's kernel runs after the norm's, and no op with in-place effects
lies between the conv and the norm's kernel; the norm is lowered by the one-team kernel in
register mode without this (not ``norm.split``, not chunked, not the general kernels) and with
it within the adapter's storage-binding limit. Else the conv keeps its summing dispatch.
``set_enabled(False)`` compiles the old programs (A/B).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ....dtypes import DType
from ....graph.ir import Graph, resolve_view
from ....ops import OPS
from ....passes.fuse import FusionGroup
from ....passes.permute_views import write_view
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.literals import u
from ..matmul.deferred import _readers, conv_partials
from .prologue import PartialsLoader
from .split import lower_group_norm_split
from .team import lower_norm_team

ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler


def set_enabled(on: bool) -> None:
    """Let batch_norm / group_norm compute their input from a conv's split-K partials (on, the
    default) or not, for programs compiled from now on (benchmarks and tests compare both)."""
    ENABLED[:] = [bool(on)]


@dataclass(frozen=True)
class ConvNorm:
    """A norm computing conv ``conv``'s output from its partials.

    Attributes:
        conv: the ``conv2d`` node (its summing dispatch goes).
        norm: the ``batch_norm`` / ``group_norm`` node.
        act: the ``silu`` node of a ``group_norm+silu`` group, or None.
        store_y: whether the norm's own output is stored (``act`` set: read elsewhere).
        store_x: whether x is stored (read by other kernels, or a graph output).
        position: the node at whose position the norm's kernel runs (the group's sink).
    """

    conv: int
    norm: int
    act: int | None
    store_y: bool
    store_x: bool
    position: int


class _ConvLoader(PartialsLoader):
    """x = the conv's sum of partials plus the bias of its channel, stored when ``store``."""

    def __init__(self, graph: Graph, conv: int, limits: Limits, store: bool) -> None:
        part = conv_partials(graph, conv, limits)
        if part is None:  # pragma: no cover - plan_conv_norms checked
            raise ValueError(f"%{conv}: the conv's plan does not split K")
        super().__init__(part, conv, graph[conv].type.dtype)
        self.graph, self.conv, self.store = graph, conv, store

    def bind(self, kb: KernelBuilder, rk) -> _ConvLoader:
        _, oc, *spatial = self.graph[self.conv].type.shape
        plane = 1
        for d in spatial:
            plane *= d
        if rk.plan.width == 4 and plane % 4:  # pragma: no cover - width 4 aligns on planes
            raise ValueError(f"%{self.conv}: vec4 units straddle a plane of {plane} pixels")
        self.plane, self.oc = plane, oc
        return super().bind(kb, rk)

    def _epilogue(self, kb: KernelBuilder) -> tuple[str, str | None]:
        node = self.graph[self.conv]
        out = kb.write(self.conv, "xconv") if self.store else None
        expr = "s"
        if len(node.inputs) == 3:  # sum_lines: (the partials' sum) + bias[channel]
            bias = kb.read(node.inputs[2], "cbias")
            expr = f"s + {bias.at(f'(e / {u(self.plane)}) % {u(self.oc)}')}"
        return f"fn epi(e: u32, s: f32) -> f32 {{ return {expr}; }}\n", out


def _norm_of(graph: Graph, reader: int, group_of: Mapping) -> tuple | None:
    """(act, store_y, position) when ``reader`` is a norm this module serves, else None."""
    node = graph[reader]
    group = group_of.get(reader)
    if node.op == "batch_norm" and node.attr("training") and group is None:
        return None, True, reader
    if node.op != "group_norm":
        return None
    if group is None:
        return None, True, reader
    if not isinstance(group, FusionGroup) or group.anchor != reader or len(group.members) != 2:
        return None
    (act,) = (m for m in group.members if m != reader)
    if graph[act].op != "silu":
        return None
    return act, reader in group.outputs, group.sink


def plan_conv_norms(
    graph: Graph,
    needed: Sequence[bool],
    groups: Sequence,
    limits: Limits,
    deferred: Mapping | None = None,
) -> dict[int, ConvNorm]:
    """The norms that compute their input from a conv's split-K partials (module docstring),
    keyed by the node at whose position the norm's kernel runs.

    Args:
        graph: a verified graph.
        needed: per node, whether it gets kernels (``schedule.needed_nodes``).
        groups: the schedule's fusion groups.
        limits: the adapter's limits (they choose the conv plans and the norm's team).
        deferred: split-K products summed by their readers (``matmul.deferred``).
    """
    if not ENABLED[0]:
        return {}
    group_of = {m: g for g in groups for m in g.members}
    users = graph.users()
    outputs = {resolve_view(graph, v) for _, v in graph.outputs}
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    out: dict[int, ConvNorm] = {}
    for node in graph.nodes:
        x = node.id
        if node.op != "conv2d" or not needed[x] or x in group_of:
            continue
        if node.type.dtype not in (DType.f32, DType.f16) or write_view(graph, x) is not None:
            continue
        if conv_partials(graph, x, limits) is None:
            continue
        readers = sorted(set(_readers(graph, users, x)))
        if not readers or not needed[readers[0]]:
            continue
        norm = graph[readers[0]]
        found = _norm_of(graph, norm.id, group_of)
        if found is None or resolve_view(graph, norm.inputs[0]) != x:
            continue
        act, store_y, pos = found
        if graph[norm.inputs[0]].type.shape != node.type.shape:
            continue
        if x in {resolve_view(graph, v) for v in norm.inputs[1:]}:
            continue
        later = [min(group_of[r].members) if r in group_of else r for r in readers[1:]]
        if any(r <= pos for r in later) or any(x < e < pos for e in effects):
            continue
        cn = ConvNorm(x, norm.id, act, store_y, bool(readers[1:]) or x in outputs, pos)
        ks = lower_conv_norm(graph, cn, limits, deferred)
        if ks is not None and all(
            len(k.bindings) <= limits.max_storage_buffers_per_shader_stage for k in ks
        ):
            out[pos] = cn
    return out


def lower_conv_norm(
    graph: Graph, cn: ConvNorm, limits: Limits, deferred: Mapping | None = None
) -> list[KernelSource] | None:
    """The norm ``cn.norm`` (with its SiLU) computing x from conv ``cn.conv``'s partials and
    bias (module docstring), storing x with ``cn.store_x``; None when the program without this
    would not lower the norm with the one-team kernel in register mode.

    Raises:
        ValueError: as the norm's and the conv's own kernels would (a value past 2^31
            elements or one storage binding).
    """
    if graph[cn.norm].op == "group_norm":
        split = lower_group_norm_split(graph, cn.norm, limits, cn.act, cn.store_y)
        if split is not None:  # the program without this splits the groups: keep it
            return None
    loader = _ConvLoader(graph, cn.conv, limits, cn.store_x)
    ks = lower_norm_team(
        graph, cn.norm, limits, cn.act, cn.store_y, prologue=loader.bind, deferred=deferred
    )
    if ks is None:
        return None
    op = graph[cn.norm].op
    name = f"conv2d+{op}" + ("+silu" if cn.act is not None else "")
    members = (cn.conv, cn.norm) + (() if cn.act is None else (cn.act,))
    ids = "+".join(str(m) for m in members)
    return [replace(k, name=f"%{ids} {name}") for k in ks]
