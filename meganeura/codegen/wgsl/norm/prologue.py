"""A layer_norm / rms_norm that computes its input from a split-K matmul's partials: the
norm kernel runs the summing dispatch of the matmul-anchored fusion group producing x.

In a pre-norm transformer the residual stream ``h = x + o_proj(attn)`` (and ``h + down(mlp)``)
is the stored output of a fusion group anchored on a split-K matmul (``passes.fuse_matmul``)
whose second, summing dispatch adds the partials and runs the epilogue; an ``rms_norm`` reads h
next. On the H200 each dispatch costs ~7 us however small, and SmolLM2-135M's forward has 60 such
summing dispatches. Here the norm kernel computes each element of h itself: the group's summing
loop (``matmul.deferred.SplitPartials.helper``: the same f32 additions in the same order from
0.0, the anchor's value un-narrowed as the summing dispatch hands it to the epilogue), then the
epilogue's member ``let``s (``elementwise.fused.GroupBody``, the same text the summing dispatch
runs), stores h (narrowed to f16 where h is stored so; its other readers, the next residual add
and the backward, read it from memory) and normalizes h as read back from storage (f16-rounded
in the fast mode). Values are bit-identical to the two-kernel program. The group keeps its first
dispatch (the partials, at its sink as before, or in a ``split_group``); its partials scratch
(owned by the group's sink) is bound by the norm kernel, so the planner keeps it alive until
there.

Conditions (``plan_norm_prologues``): the group is a ``FusionGroup`` anchored on a ``matmul``
whose plan splits K, of the anchor's shape, storing one member h (not the anchor); the norm is
the first node reading h (through views), needs a kernel, is in no group, comes before every
other reader of h and every node of those readers' groups, and no op with in-place effects lies
between the group's sink and the norm; h is not written through a placed view, its dtype is
f32 or f16, and the epilogue's operands are not the norm's weight or bias (those are read as
vec4 rows). The norm runs the team kernel in register mode (``norm.team``: rows of up to 65536
elements read as vec4, 16384 as scalars); a longer row (chunked mode would compute h twice) or
a kernel over the adapter's storage-binding limit keeps the summing dispatch.
``set_enabled(False)`` compiles the old programs (A/B).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ....dtypes import DType
from ....graph.ir import Graph, resolve_view
from ....ops import OPS
from ....passes.fuse import FusionGroup
from ....passes.permute_views import write_view
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.literals import u
from ..elementwise.fused import GroupBody
from ..matmul.deferred import SplitPartials, _readers
from ..matmul.lowering import split_layout
from ..rowwise.team import Chunk, RowKernel
from .activation import as_stored
from .team import lower_norm_team

ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler
NORMS = ("layer_norm", "rms_norm")


def set_enabled(on: bool) -> None:
    """Let norms compute their input from a split-K group's partials (on, the default) or not,
    for programs compiled from now on (benchmarks and tests compare both)."""
    ENABLED[:] = [bool(on)]


def plan_norm_prologues(
    graph: Graph,
    needed: Sequence[bool],
    groups: Sequence,
    limits: Limits,
    deferred: Mapping | None = None,
) -> dict[int, FusionGroup]:
    """The norms that compute their input from a split-K group's partials (module docstring):
    norm node id -> the fusion group whose summing dispatch it replaces.

    Args:
        graph: a verified graph.
        needed: per node, whether it gets kernels (``schedule.needed_nodes``).
        groups: the schedule's fusion groups.
        limits: the adapter's limits (they choose the matmul plans and the norm's team).
        deferred: split-K products summed by their readers (``matmul.deferred``); the
            epilogue may read some.
    """
    if not ENABLED[0]:
        return {}
    group_of = {m: g for g in groups for m in g.members}
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    out: dict[int, FusionGroup] = {}
    for g in groups:
        if not isinstance(g, FusionGroup) or g.anchor is None or graph[g.anchor].op != "matmul":
            continue
        a, h = g.anchor, g.outputs[0]
        if len(g.outputs) != 1 or h == a or graph[h].type.dtype not in (DType.f32, DType.f16):
            continue
        if g.shape != graph[a].type.shape or graph[h].type.shape != g.shape:
            continue
        if write_view(graph, h) is not None or split_layout(graph, a, limits) is None:
            continue
        readers = sorted(set(_readers(graph, users, h)))
        if not readers or not needed[readers[0]] or readers[0] in group_of:
            continue
        norm = graph[readers[0]]
        if norm.op not in NORMS or resolve_view(graph, norm.inputs[0]) != h:
            continue
        later = [min(group_of[r].members) if r in group_of else r for r in readers[1:]]
        if any(r <= norm.id for r in later) or any(g.sink < e < norm.id for e in effects):
            continue
        params = {resolve_view(graph, v) for v in norm.inputs[1:]}
        operands = {resolve_view(graph, v) for m in g.members for v in graph[m].inputs}
        if params & operands:
            continue
        ks = lower_norm_prologue(graph, norm.id, g, limits, deferred)
        if ks is not None and all(
            len(k.bindings) <= limits.max_storage_buffers_per_shader_stage for k in ks
        ):
            out[norm.id] = g
    return out


class PartialsLoader:
    """x of a norm computed in the norm's kernel from split-K partials (``team._stats``'s
    loader): ``bind`` binds them in the norm's kernel, then calling it on a chunk emits
    ``a{i}`` (x as read back from storage) and stores x (when it has a binding). A vec4
    unit's four sums come from vec4 loads of the partials (``SplitPartials.helper`` with width
    4: the same lane-wise additions), then each element runs ``epi`` on its own sum.

    Subclasses define ``_epilogue``: the WGSL of element e of x from its sum of partials (a
    matmul group's epilogue here, a convolution's bias in ``conv_prologue``).

    Args:
        part: the partials (``owner``'s scratch).
        owner: the node whose scratch holds them (bound read-only, kept alive until here).
        dtype: x's storage dtype (f16: x is narrowed as stored, and normalized as read back).
    """

    def __init__(self, part: SplitPartials, owner: int, dtype: DType) -> None:
        self.part, self.owner = part, owner
        self.half = dtype is DType.f16

    def _epilogue(self, kb: KernelBuilder) -> tuple[str, str | None]:
        """(WGSL defining ``fn epi(e: u32, s: f32) -> f32``: element e of x in f32 from ``s``,
        its sum of partials; x's binding to store into, or None: x is not stored)."""
        raise NotImplementedError

    def bind(self, kb: KernelBuilder, rk: RowKernel) -> PartialsLoader:
        """Bind the partials and what ``_epilogue`` reads and writes; define the WGSL helpers
        ``epi`` and ``epi_x`` (element e as read back from storage)."""
        self.rk = rk
        epi, self.out = self._epilogue(kb)
        part, w = self.part, rk.plan.width
        var = kb.scratch(part.key, part.count, DType.f32, "part", owner=self.owner)
        if w == 4:  # a unit's four sums from vec4 loads
            kb.vectorize(var)
        # the sum as the summing dispatch hands it on (to the epilogue, the bias): not narrowed
        helper = part.helper("sum_part", var, DType.f32, w)
        stored = "f32(f16(v))" if self.half else "v"
        rk.extra_helpers += (
            helper + epi + "\n"
            f"fn epi_x(e: u32, s: f32) -> f32 {{ let v = epi(e, s); return {stored}; }}\n"
        )
        return self

    def _elem(self, unit: str, lane: int) -> str:
        w = self.rk.plan.width
        return f"{w}u * ({unit}) + {u(lane)}" if w > 1 else f"({unit})"

    def first(self, unit: str) -> str:
        """f32 expression: the first element of ``unit`` of x (as read back from storage)."""
        lane = ".x" if self.rk.plan.width == 4 else ""
        return f"epi_x({self._elem(unit, 0)}, sum_part({unit}){lane})"

    def __call__(self, ch: Chunk) -> None:
        rk, w = self.rk, self.rk.plan.width
        for i in range(ch.m):
            rk.line(f"let hu{i} = {rk.at(ch.unit(i))};")
            rk.line(f"let hs{i} = sum_part(hu{i});")
            sums = [f"hs{i}.{c}" for c in "xyzw"] if w == 4 else [f"hs{i}"]
            lanes = [f"epi({self._elem(f'hu{i}', c)}, {s})" for c, s in enumerate(sums)]
            value = "vec4<f32>(" + ", ".join(lanes) + ")" if w == 4 else lanes[0]
            rk.line(f"let h{i} = {value};")
            rk.line(f"let a{i} = {as_stored(f'h{i}', w) if self.half else f'h{i}'};")
        if self.out is not None:
            rk.store(ch, self.out, lambda i: f"h{i}")


class _Prologue(PartialsLoader):
    """h, the one stored output of a split-K matmul group, from the group's partials: the
    epilogue's member ``let``s on the anchor's sum (``GroupBody``), h stored."""

    def __init__(self, graph: Graph, group: FusionGroup, limits: Limits) -> None:
        self.graph, self.group = graph, group
        splits, _, total = split_layout(graph, group.anchor, limits)
        (self.h,) = group.outputs
        part = SplitPartials(group.anchor, splits, total)
        super().__init__(part, group.sink, graph[self.h].type.dtype)

    def _epilogue(self, kb: KernelBuilder) -> tuple[str, str | None]:
        body = GroupBody(self.graph, self.group)
        body.bind(kb)
        (out,) = body.outs
        n = self.graph[self.group.anchor].type.shape[-1]
        loads = [
            s.literal if s.literal is not None else s.at(body.index(k, "e", "col"))
            for k, s in enumerate(body.srcs)
        ]
        col = f"e % {u(n)}" if n > 1 else "0u"
        return (
            body.helpers + "\n"
            f"fn epi(e: u32, s: f32) -> f32 {{\n  let col = {col};\n"
            f"  {body.compute(loads, anchor='s')}\n"
            f"  return f32({body.var(self.h)});\n}}\n"
        ), out


def lower_norm_prologue(
    graph: Graph,
    norm_id: int,
    group: FusionGroup,
    limits: Limits,
    deferred: Mapping | None = None,
) -> list[KernelSource] | None:
    """The layer_norm / rms_norm ``norm_id`` computing and storing x, the one output of the
    split-K matmul group ``group``, from its partials and operands (module docstring); None
    when the team kernel cannot hold a row in registers.

    Raises:
        ValueError: as the norm's and the group's own kernels would (a value past 2^31
            elements or one storage binding).
    """
    ks = lower_norm_team(graph, norm_id, limits, prologue=_Prologue(graph, group, limits).bind,
                         deferred=deferred)  # fmt: skip
    if ks is None:
        return None
    ids = "+".join(str(m) for m in (*group.members, norm_id))
    return [replace(k, name=f"%{ids} {graph[norm_id].op}") for k in ks]
