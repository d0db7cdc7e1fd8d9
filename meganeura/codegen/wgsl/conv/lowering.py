"""WGSL lowerings of the conv/pool family: convolutions as implicit GEMMs, pooling as gathers.

The three convolution ops are implicit GEMMs (``gemm``), batched over groups:

  conv2d                  C[oc, q=(n, oh, ow)] = sum_{k=(c, kh, kw)} W[oc, k] * im2col[k, q]
  conv2d_backward_input   per stride phase (ry, rx) of the input, over that phase's pixels:
                          C[c, q=(n, i, j)] = sum_{k=(oc, taps reaching the phase)}
                                              W[oc, c, kh, kw] * g[n, oc, i + o0 - a c, ...]
  conv2d_backward_weight  C[oc, k'=(c, kh, kw)] = sum_{q=(n, oh, ow)} g[n, oc, q] *
                                                   im2col[k', q]            (split-K)

so columns walk pixels (stores along NCHW rows) and no im2col buffer exists. The input
gradient is split by stride phase so that no work goes to the zeros a stride leaves: input
row ``ry + sh i`` is reached only by taps ``kh = kh0 + a step`` with ``(ry + ph - kh dh)``
divisible by ``sh``, from output row ``i + o0 - a c`` (``_taps``). On GPU adapters the
phases' GEMMs run as one dispatch (``phases``, ``MERGE_PHASES``). Padding is zero by
predication; bias is added in the GEMM's epilogue, and so is a fusion group reading a
forward conv alone (``epilogue``, ``passes.fuse_conv``). Pooling lowerings live in ``pool``.
Index math is u32 with shapes baked in; negative intermediate coordinates wrap and fail the
``< size`` tests (see ``gemm``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import PER_THREAD, WG, element_slots
from ..core.literals import u
from ..elementwise.maps import lower_fill
from .gemm import Epilogue, Gemm, Operand, Output, emit_gemm, plan_gemm
from .phases import emit_phases


def _div(e: str, n: int) -> str:
    return e if n == 1 else f"({e} / {u(n)})"


def _mod(e: str, n: int) -> str:
    return "0u" if n == 1 else f"({e} % {u(n)})"


def _mul(e: str, n: int) -> str:
    return "0u" if n == 0 else e if n == 1 else f"{e} * {u(n)}"


def _offset(e: str, o: int) -> str:
    """``e + o`` in u32 (wrapping below zero for negative ``o`` on purpose)."""
    return e if o == 0 else f"{e} + {u(o)}" if o > 0 else f"{e} - {u(-o)}"


@dataclass(frozen=True)
class _Conv:
    """Geometry of a convolution node (any of the three ops)."""

    n: int
    c: int
    h: int
    w: int
    oc: int
    cg: int
    kh: int
    kw: int
    oh: int
    ow: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    @staticmethod
    def of(graph: Graph, node_id: int) -> _Conv:
        node = graph[node_id]
        a, s0, s1 = node.attr_dict, graph[node.inputs[0]].type.shape, node.type.shape
        if node.op == "conv2d":
            x, wt, y = s0, graph[node.inputs[1]].type.shape, s1
        elif node.op == "conv2d_backward_input":
            x, wt, y = s1, graph[node.inputs[1]].type.shape, s0
        else:
            x, wt, y = s0, s1, graph[node.inputs[1]].type.shape
        return _Conv(
            *x, wt[0], wt[1], wt[2], wt[3], y[2], y[3],
            a["stride"], a["padding"], a["dilation"], a["groups"],
        )  # fmt: skip

    @property
    def ocg(self) -> int:
        return self.oc // self.groups

    @property
    def kk(self) -> int:
        return self.kh * self.kw

    @property
    def hw(self) -> int:
        return self.h * self.w

    @property
    def ohw(self) -> int:
        return self.oh * self.ow


def lower_conv2d(
    graph: Graph,
    node_id: int,
    limits: Limits,
    epilogue: Epilogue | None = None,
    deferred: Mapping | None = None,
    defer_sum: bool = False,
) -> list[KernelSource]:
    """Forward convolution (optional bias): one implicit GEMM (plus a split-K sum).

    Args:
        epilogue: code consuming each output element (bias added) instead of storing it (a
            fusion group anchored here, ``conv.epilogue``); run by the GEMM, or with split-K
            by the summing dispatch.
        deferred: split-K products the epilogue reads as sums of their partials
            (``KernelBuilder``'s ``deferred``; never the conv's own operands).
        defer_sum: with split-K, the partials dispatch alone: the norm reading the output
            sums them and adds the bias (``forward_partials``, ``norm.conv_prologue``).
    """
    node, v = graph[node_id], _Conv.of(graph, node_id)
    (sh, sw), (ph, pw), (dh, dw) = v.stride, v.padding, v.dilation
    kb = KernelBuilder(graph, node, limits, deferred)
    wt, x = kb.read(node.inputs[1], "w"), kb.read(node.inputs[0], "x")
    k = v.cg * v.kk
    a = Operand(
        wt,
        along_k=True,
        line=lambda j, e: [f"let a_p{j} = {_mul(f'(grp * {u(v.ocg)} + {e})', k)};"],
        kstep=lambda s, kv: [],
        element=lambda j, s: ([], f"a_p{j} + a_k{s}", []),
    )

    def b_line(j: int, e: str) -> list[str]:
        r = _mod(e, v.ohw)
        return [
            f"let b_h{j} = {_offset(_mul(_div(r, v.ow), sh), -ph)};",
            f"let b_w{j} = {_offset(_mul(_mod(r, v.ow), sw), -pw)};",
            f"let b_base{j} = {_mul(_div(e, v.ohw), v.c * v.hw)} + grp * {u(v.cg * v.hw)} + "
            f"{_mul(f'b_h{j}', v.w)} + b_w{j};",
        ]

    def b_kstep(s: str, kv: str) -> list[str]:
        kr = _mod(kv, v.kk)
        return [
            f"let b_dh{s} = {_mul(_div(kr, v.kw), dh)};",
            f"let b_dw{s} = {_mul(_mod(kr, v.kw), dw)};",
            f"let b_koff{s} = {_mul(_div(kv, v.kk), v.hw)} + {_mul(f'b_dh{s}', v.w)} + b_dw{s};",
        ]

    def b_element(j: int, s: str):
        conds = [f"b_h{j} + b_dh{s} < {u(v.h)}"] if ph else []
        conds += [f"b_w{j} + b_dw{s} < {u(v.w)}"] if pw else []
        return [], f"b_base{j} + b_koff{s}", conds

    b = Operand(x, False, b_line, b_kstep, b_element)

    def channel(r: str) -> str:
        return f"grp * {u(v.ocg)} + {r}"

    bias = None if len(node.inputs) != 3 else (node.inputs[2], channel)
    out = Output(
        col=lambda q: f"{_mul(_div(q, v.ohw), v.oc * v.ohw)} + {_mod(q, v.ohw)}",
        row=lambda r: _mul(f"(grp * {u(v.ocg)} + {r})", v.ohw),
        bias=bias,
        epilogue=epilogue,
        channel=channel,
    )
    return emit_gemm(kb, Gemm(v.ocg, v.n * v.ohw, k, v.groups), a, b, out, "", defer_sum)


def forward_partials(graph: Graph, node_id: int, limits: Limits):
    """(partials key, splits, elements per partial, WGSL GEMM index of output element ``i``)
    of a ``conv2d`` whose plan splits K, else None. Its GEMM C[grp, m, q = (n, oh, ow)] holds
    y[n, grp * ocg + m, oh, ow], so element i = (n, oc, pix) of y is GEMM element
    oc * (N * OH * OW) + n * OH * OW + pix (``sum_lines`` sums the partials, then adds the
    bias of channel oc)."""
    node, v = graph[node_id], _Conv.of(graph, node_id)
    if node.type.numel == 0 or v.cg * v.kk == 0:
        return None
    g = Gemm(v.ocg, v.n * v.ohw, v.cg * v.kk, v.groups)
    splits = plan_gemm(g, limits, node.op).splits
    if splits == 1:
        return None
    return "partials", splits, g.m * g.n * g.groups, _gemm_element(v.n, v.oc, v.ohw)


def _gemm_element(n: int, c: int, hw: int) -> str:
    """WGSL u32 expression: the implicit GEMM's element (channel-major: ``ch * (n * hw) +
    image * hw + pix``) holding flat NCHW element ``i`` of an ``[n, c, hw]`` value."""
    return (
        f"({_mod(_div('i', hw), c)}) * {u(n * hw)} + "
        f"{_mul(_div('i', c * hw), hw)} + {_mod('i', hw)}"
    )


@dataclass(frozen=True)
class _Taps:
    """Kernel taps reaching one input phase along one dim: taps ``first + a step`` for
    ``a < count``; input ``r + s i`` meets tap ``a`` at output ``i + o0 - a c``."""

    first: int
    step: int
    count: int
    o0: int
    c: int


def _taps(r: int, p: int, k: int, d: int, s: int) -> _Taps:
    """Taps of a kernel of size ``k`` (padding p, dilation d, stride s) reaching phase r."""
    taps = [t for t in range(k) if (r + p - t * d) % s == 0]
    if not taps:
        return _Taps(0, 1, 0, 0, 0)
    step = s // math.gcd(d, s)
    assert taps == list(range(taps[0], k, step))
    return _Taps(taps[0], step, len(taps), (r + p - taps[0] * d) // s, step * d // s)


# One dispatch for all stride phases of a strided input gradient (``phases.py``) on GPU
# adapters; False: one GEMM dispatch (and split-K sum) per phase plus a zero pass (benchmark
# A/B). Never on a CPU adapter (``Limits.cpu``): on lavapipe (16 threads) the U-Net's 3x3
# stride 2 64 -> 64 input gradient at batch 2 took 22.5-23.9 ms merged against 15.5-17.5 ms
# apart (``Session.profile``, medians of 5), as a dispatch costs little there.
MERGE_PHASES = True


def lower_conv2d_backward_input(
    graph: Graph, node_id: int, limits: Limits, defer_sum: bool = False
) -> list[KernelSource]:
    """Input gradient (a transposed convolution): an implicit GEMM per stride phase of the
    input over the taps that reach it (one for stride 1). Strided, with ``MERGE_PHASES`` on a
    GPU adapter, the phases run in one dispatch (plus one split-K sum; ``phases.emit_phases``),
    else one GEMM dispatch each (4 for stride 2) and a pass zeroing the phases no tap reaches.
    ``defer_sum`` (stride 1, split-K only): no summing dispatch (``backward_input_partials``)."""
    node, v = graph[node_id], _Conv.of(graph, node_id)
    (sh, sw), (ph, pw), (dh, dw) = v.stride, v.padding, v.dilation
    rows = {ry: _taps(ry, ph, v.kh, dh, sh) for ry in range(min(sh, v.h))}
    cols = {rx: _taps(rx, pw, v.kw, dw, sw) for rx in range(min(sw, v.w))}
    if MERGE_PHASES and not limits.cpu and sh * sw > 1 and node.type.numel:
        kb = KernelBuilder(graph, node, limits)
        phases = [((ry, rx), th, tw) for ry, th in rows.items() for rx, tw in cols.items()]
        gemms = [_phase_gemm(kb, v, r, th, tw) for r, th, tw in phases]
        return emit_phases(kb, gemms)
    kernels = []
    zero_rows = [ry for ry, t in rows.items() if t.count == 0]
    zero_cols = [rx for rx, t in cols.items() if t.count == 0]
    if zero_rows or zero_cols:
        kernels.append(_zero_phases(graph, node_id, limits, v, zero_rows, zero_cols))
    for ry, th in rows.items():
        for rx, tw in cols.items():
            if th.count and tw.count:
                kb = KernelBuilder(graph, node, limits)
                gemm = _phase_gemm(kb, v, (ry, rx), th, tw)
                suffix = "" if sh * sw == 1 else f" {ry},{rx}"
                kernels += emit_gemm(kb, *gemm, suffix, defer_sum)
    return kernels


def backward_input_partials(graph: Graph, node_id: int, limits: Limits):
    """(partials key, splits, elements per partial, WGSL GEMM index of output element ``i``)
    of a stride-1 ``conv2d_backward_input`` that splits K, else None. Stride 1 is one GEMM
    over every input pixel: C[grp, c, q = (n, h, w)] holds dx[n, grp * cg + c, h, w], so
    element i = (n, ch, pix) of dx is GEMM element ch * (N * H * W) + n * H * W + pix."""
    node, v = graph[node_id], _Conv.of(graph, node_id)
    if node.type.numel == 0 or v.stride != (1, 1):
        return None
    g = Gemm(v.cg, v.n * v.hw, v.ocg * v.kk, v.groups)
    splits = plan_gemm(g, limits, node.op).splits
    if splits == 1:
        return None
    return "partials", splits, g.m * g.n * g.groups, _gemm_element(v.n, v.c, v.hw)


def _zero_phases(graph, node_id, limits, v: _Conv, zero_rows, zero_cols) -> KernelSource:
    """Zeros at the input positions no kernel tap reaches (e.g. the odd rows and columns of
    a 1x1 stride-2 convolution), in one pass instead of empty GEMMs."""
    kb = KernelBuilder(graph, graph[node_id], limits)
    out = kb.write(node_id, "dx")
    (sh, sw), numel = v.stride, graph[node_id].type.numel
    slots, groups, guard = element_slots(numel)
    body = slots
    for e in range(PER_THREAD):
        conds = [f"(j{e} / {u(v.w)}) % {u(v.h)} % {u(sh)} == {u(r)}" for r in zero_rows]
        conds += [f"j{e} % {u(v.w)} % {u(sw)} == {u(r)}" for r in zero_cols]
        body += (
            "  "
            + guard(e, f"if ({' || '.join(conds)}) {{ {kb.store(out, f'i{e}', '0.0')} }}")
            + "\n"
        )
    return kb.finish("zero_phases", body, WG, groups)


def _phase_gemm(
    kb: KernelBuilder, v: _Conv, r: tuple[int, int], th: _Taps, tw: _Taps
) -> tuple[Gemm, Operand, Operand, Output]:
    """The GEMM of stride phase ``r`` = (ry, rx) of the input gradient (K = 0 when no tap
    reaches it): sizes, operands (bound in ``kb``) and output mapping."""
    node = kb.node
    wt, gout = kb.read(node.inputs[1], "w"), kb.read(node.inputs[0], "g")
    (ry, rx), (sh, sw) = r, v.stride
    hr, wr = -(-(v.h - ry) // sh), -(-(v.w - rx) // sw)  # this phase's pixels per plane
    nt = th.count * tw.count

    def tap(kv: str) -> tuple[str, str, str]:
        if nt == 0:  # no tap reaches this phase: K = 0, the loop never runs
            return "0u", "0u", "0u"
        return _div(kv, nt), _mod(_div(kv, tw.count), th.count), _mod(kv, tw.count)

    def a_kstep(s: str, kv: str) -> list[str]:
        o, ta, tb = tap(kv)
        koff = f"{_mul(o, v.cg * v.kk)} + {_mul(ta, th.step * v.kw)} + {_mul(tb, tw.step)}"
        return [f"let a_koff{s} = {_offset(koff, th.first * v.kw + tw.first)};"]

    a = Operand(
        wt,
        along_k=nt > 1,
        line=lambda j, e: [f"let a_p{j} = grp * {u(v.ocg * v.cg * v.kk)} + {_mul(e, v.kk)};"],
        kstep=a_kstep,
        element=lambda j, s: ([], f"a_p{j} + a_koff{s}", []),
    )

    def b_line(j: int, e: str) -> list[str]:
        rr = _mod(e, hr * wr)
        return [
            f"let b_i{j} = {_offset(_div(rr, wr), th.o0)};",
            f"let b_j{j} = {_offset(_mod(rr, wr), tw.o0)};",
            f"let b_base{j} = {_mul(_div(e, hr * wr), v.oc * v.ohw)} + grp * {u(v.ocg * v.ohw)};",
        ]

    def b_kstep(s: str, kv: str) -> list[str]:
        o, ta, tb = tap(kv)
        return [
            f"let b_dh{s} = {_mul(ta, th.c)};",
            f"let b_dw{s} = {_mul(tb, tw.c)};",
            f"let b_koff{s} = {_mul(o, v.ohw)};",
        ]

    def b_element(j: int, s: str):
        stmts = [f"let b_y{j} = b_i{j} - b_dh{s};", f"let b_x{j} = b_j{j} - b_dw{s};"]
        conds = [f"b_y{j} < {u(v.oh)}", f"b_x{j} < {u(v.ow)}"]
        return stmts, f"b_base{j} + b_koff{s} + {_mul(f'b_y{j}', v.ow)} + b_x{j}", conds

    b = Operand(gout, False, b_line, b_kstep, b_element)

    def col(q: str) -> str:
        rr = _mod(q, hr * wr)
        pix = f"{_mul(_div(rr, wr), sh * v.w)} + {_mul(_mod(rr, wr), sw)}"
        return f"{_mul(_div(q, hr * wr), v.c * v.hw)} + {_offset(pix, ry * v.w + rx)}"

    out = Output(col=col, row=lambda m: _mul(f"(grp * {u(v.cg)} + {m})", v.hw))
    return Gemm(v.cg, v.n * hr * wr, v.ocg * nt, v.groups), a, b, out


def lower_conv2d_backward_weight(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Weight gradient: one implicit GEMM reducing over (n, oh, ow), split along it."""
    node, v = graph[node_id], _Conv.of(graph, node_id)
    (sh, sw), (ph, pw), (dh, dw) = v.stride, v.padding, v.dilation
    if v.n == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    kb = KernelBuilder(graph, node, limits)
    gout, x = kb.read(node.inputs[1], "g"), kb.read(node.inputs[0], "x")
    a = Operand(
        gout,
        along_k=True,
        line=lambda j, e: [f"let a_p{j} = {_mul(f'(grp * {u(v.ocg)} + {e})', v.ohw)};"],
        kstep=lambda s, kv: [
            f"let a_koff{s} = {_mul(_div(kv, v.ohw), v.oc * v.ohw)} + {_mod(kv, v.ohw)};"
        ],
        element=lambda j, s: ([], f"a_p{j} + a_koff{s}", []),
    )

    def b_line(j: int, e: str) -> list[str]:
        kr = _mod(e, v.kk)
        return [
            f"let b_dh{j} = {_offset(_mul(_div(kr, v.kw), dh), -ph)};",
            f"let b_dw{j} = {_offset(_mul(_mod(kr, v.kw), dw), -pw)};",
            f"let b_p{j} = (grp * {u(v.cg)} + {_div(e, v.kk)}) * {u(v.hw)} + "
            f"{_mul(f'b_dh{j}', v.w)} + b_dw{j};",
        ]

    def b_kstep(s: str, kv: str) -> list[str]:
        r = _mod(kv, v.ohw)
        return [
            f"let b_oh{s} = {_mul(_div(r, v.ow), sh)};",
            f"let b_ow{s} = {_mul(_mod(r, v.ow), sw)};",
            f"let b_koff{s} = {_mul(_div(kv, v.ohw), v.c * v.hw)} + "
            f"{_mul(f'b_oh{s}', v.w)} + b_ow{s};",
        ]

    def b_element(j: int, s: str):
        conds = [f"b_oh{s} + b_dh{j} < {u(v.h)}"] if ph else []
        conds += [f"b_ow{s} + b_dw{j} < {u(v.w)}"] if pw else []
        return [], f"b_p{j} + b_koff{s}", conds

    b = Operand(x, True, b_line, b_kstep, b_element)
    out = Output(col=lambda q: q, row=lambda r: _mul(f"(grp * {u(v.ocg)} + {r})", v.cg * v.kk))
    return emit_gemm(kb, Gemm(v.ocg, v.cg * v.kk, v.n * v.ohw, v.groups), a, b, out)
