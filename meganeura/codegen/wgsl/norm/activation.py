"""Activation epilogues and prologues of the normalization kernels (``passes.fuse_norm``):
a norm that stores ``silu(y)`` (and y only when read elsewhere), and a norm input gradient
whose ``g`` is the SiLU's gradient computed from its operands (``gy * silu_grad(y)``, the
elementwise ``silu_backward`` map lane by lane), stored only when read elsewhere.
"""

from __future__ import annotations

from ....dtypes import DType
from ..core.builder import KernelBuilder
from ..core.mathlib import helper_source
from ..rowwise.team import Chunk, RowKernel, sources_bound


def act_helpers(width: int) -> str:
    """WGSL ``act`` (SiLU, ``x * sigmoid_stable(x)`` as the elementwise ``silu`` map computes
    it) on a unit of ``width`` elements, for a norm's activation epilogue (``passes.fuse_norm``)."""
    h = helper_source(["sigmoid_stable"])
    h += "fn act_s(x: f32) -> f32 { return x * sigmoid_stable(x); }\n"
    return h + _lanes("act", "act_s", width)


def store_normalized(rk: RowKernel, ch: Chunk, outs, value) -> None:
    """Store ``value(i)`` (a normalized unit) to ``outs`` (``bind_outputs``): y as it is, the
    activation as ``act(y)`` of y rounded to y's storage type (f16 in the fast mode, stored or
    not), so the pair computes what the two kernels it replaces compute."""
    y, act, half = outs
    if act is None:
        rk.store(ch, y, value)
        return
    for i in range(ch.m):
        v = value(i)
        rk.line(f"let y{i} = {as_stored(v, rk.plan.width) if half else v};")
    if y is not None:
        rk.store(ch, y, lambda i: f"y{i}")
    rk.store(ch, act, lambda i: f"act(y{i})")


def bind_outputs(kb: KernelBuilder, node_id: int, act: int | None, store: bool):
    """(y binding or None, activation binding or None, whether y is stored as f16) of a norm
    with an optional SiLU epilogue ``act`` (the silu node; ``store``: whether y itself is
    stored)."""
    y = kb.write(node_id, "out") if store or act is None else None
    half = kb.graph[node_id].type.dtype is DType.f16
    return y, (None if act is None else kb.write(act, "act")), half


def as_stored(expr: str, width: int) -> str:
    """``expr`` (f32 or vec4<f32>) rounded to f16 and widened back: what a kernel reading
    an f16-stored value sees."""
    return f"vec4<f32>(vec4<f16>({expr}))" if width == 4 else f"f32(f16({expr}))"


def _lanes(name: str, scalar: str, width: int) -> str:
    """WGSL ``name`` on a unit of ``width`` elements, lane by lane with ``scalar``."""
    if width == 4:
        lanes = ", ".join(f"{scalar}(v.{c})" for c in "xyzw")
        return f"fn {name}(v: vec4<f32>) -> vec4<f32> {{ return vec4<f32>({lanes}); }}\n"
    return f"fn {name}(v: f32) -> f32 {{ return {scalar}(v); }}\n"


class GradIn:
    """How an input-gradient kernel gets ``g``: loaded from operand 2 of ``node``, or with
    ``pro`` (a ``silu_backward`` node, operands ``(gy, y)``) computed as ``gy * silu_grad(y)``
    (rounded to f16 when ``pro`` is stored so, as the unfused kernels read it) and, with
    ``store``, stored to ``pro``'s value. Calling it emits ``g{i}`` for a chunk."""

    def __init__(self, rk: RowKernel, node, pro: int | None, store: bool) -> None:
        self.rk, self.kb, self.pro, self._store = rk, rk.kb, pro, store
        self.out = None
        if pro is None:
            g = self.kb.read(node.inputs[2], "g")
            self.srcs = [g]
        else:
            sb = self.kb.graph[pro]
            self.srcs = [self.kb.read(sb.inputs[0], "gy"), self.kb.read(sb.inputs[1], "y")]
        self.bound = sources_bound(*self.srcs)
        if self.bound:
            self.vars = [rk.bind(s) for s in self.srcs]

    def bind_output(self) -> None:
        """Bind ``pro``'s value for writing (after the kernel's own output)."""
        if self.pro is not None and self._store:
            self.out = self.kb.write(self.pro, "g")

    def __call__(self, ch: Chunk) -> None:
        if self.pro is None:
            self.rk.load(ch, self.vars[0], "g")
            return
        self.rk.load(ch, self.vars[0], "gy")
        self.rk.load(ch, self.vars[1], "ay")
        half = self.kb.graph[self.pro].type.dtype is DType.f16
        for i in range(ch.m):
            g = f"gy{i} * act_grad(ay{i})"
            self.rk.line(f"let g{i} = {as_stored(g, self.rk.plan.width) if half else g};")

    def store(self, ch: Chunk) -> None:
        if self.out is not None:
            self.rk.store(ch, self.out, lambda i: f"g{i}")

    def helpers(self) -> str:
        if self.pro is None:
            return ""
        return helper_source(["silu_grad"]) + _lanes("act_grad", "silu_grad", self.rk.plan.width)
