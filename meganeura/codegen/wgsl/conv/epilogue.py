"""A fusion group anchored on a ``conv2d`` (``passes.fuse_conv``), run in the conv's store.

The conv's implicit GEMM (``gemm``) hands each output element, bias added, to the group's
per-element code (``elementwise.fused.GroupBody``) instead of storing it: in the GEMM's
store stage, or, when the conv splits K, in the dispatch summing its partials. GEMM element
(row m of group grp, column q) is output channel ``grp * OCg + m`` at the NCHW flat index the
conv's own store uses; the group's other operands are read at that index through their
broadcast strides, and a per-channel operand (``[C, 1, 1]`` BatchNorm statistics) at the
channel directly, once per output row of the thread's tile (with what is computed from such
operands alone), without dividing the flat index.

Invariants: the anchor's value is the f32 the conv would have stored, so in strict f32 the
group computes bit-identical values to the program without the epilogue (its expressions are
the fused group's, ``GroupBody``); with f16 storage (fast mode) the conv's value skips the one
rounding to f16 its store took. Only the group's outputs are bound for writing; the conv's
value is never stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ....graph.ir import Graph
from ....passes.fuse import FusionGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..elementwise.fused import GroupBody
from .lowering import lower_conv2d

_PER_CHANNEL = (0, 1, 0, 0)  # broadcast strides of a [C, 1, 1] operand over [N, C, H, W]


class ConvEpilogue:
    """``gemm.Epilogue`` running a conv-anchored group's per-element code on the conv's value.

    The operands read per channel, and the members computed from them and constants alone
    (the folded BatchNorm's ``rsqrt(var + eps) * gamma``), are loaded and computed once per
    output row (``row``), the rest per element (``store``): the same expressions on the same
    values, so the same f32 results.

    Args:
        body: the group's code, the conv its anchor.
    """

    def __init__(self, body: GroupBody) -> None:
        self.body = body
        self.helpers = "\n" + body.helpers if body.helpers else ""
        self.flops = self.nbytes = 0

    def bind(self, kb: KernelBuilder) -> None:
        self.kb = kb
        b = self.body
        b.bind(kb)
        self.flops, self.nbytes = b.flops, b.nbytes
        graph, members = b.graph, set(b.group.members)
        self.per_row = {  # operands read once per row: per-channel ones and literals
            k
            for k, src in enumerate(b.srcs)
            if src.literal is not None or b.strides(k) == _PER_CHANNEL
        }
        row_ids = {b.operand_ids[k] for k in self.per_row}
        hoisted: set[int] = set()
        computed = [m for m in b.group.members if m not in b.anchors]
        self.row_lets, self.element_lets = [], []
        for m, let in zip(computed, b.lets, strict=True):
            ins = graph[m].inputs
            if all(i in hoisted or (i not in members and i in row_ids) for i in ins):
                hoisted.add(m)
                self.row_lets.append(let)
            else:
                self.element_lets.append(let)

    def row(self, channel: str) -> str:
        b = self.body
        loads = [f"let x{k} = {b.srcs[k].at(channel)};" for k in sorted(self.per_row)]
        # (``Src.at`` of a literal is the literal itself)
        return " ".join(loads + self.row_lets)

    def store(self, value: str, flat: str, channel: str) -> str:
        b = self.body
        lets = [
            f"let x{k} = {s.at(b.index(k, 'oflat'))};"
            for k, s in enumerate(b.srcs)
            if k not in self.per_row
        ]
        lets.append(f"let {b.var(b.group.anchor)} = {value};")
        compute = " ".join(lets + self.element_lets)
        return f"{{ let oflat = {flat}; {compute} {b.stores('oflat', self.kb)} }}"


def conv_epilogue_fits(graph: Graph, group: FusionGroup, limits: Limits) -> bool:
    """Whether ``lower_conv_group`` can run ``group`` (anchored on a ``conv2d`` with the
    group's 4-d shape) in the conv's store: the anchor is a conv2d with elements."""
    conv = graph[group.anchor] if group.anchor is not None else None
    return conv is not None and conv.op == "conv2d" and conv.type.numel > 0


def lower_conv_group(
    graph: Graph, group: FusionGroup, limits: Limits, deferred: Mapping | None = None
) -> list[KernelSource]:
    """The conv's dispatch(es) computing ``group`` in its store (module docstring), named
    ``%<members> conv2d gemm`` (and ``... conv2d sum_splits``), so profiles grouped by kind
    keep the conv's rows.

    Raises:
        ValueError: as ``lower_conv2d`` (a tile over the workgroup-memory limit, a value
            too large for one binding).
    """
    body = GroupBody(graph, group)
    kernels = lower_conv2d(graph, group.anchor, limits, ConvEpilogue(body), deferred)
    ids = "+".join(str(m) for m in group.members)
    own = f"%{group.anchor} conv2d"
    return [replace(ks, name=ks.name.replace(own, f"%{ids} conv2d", 1)) for ks in kernels]
