"""Decode attention with its rotary embeddings and KV-cache writes in one kernel.

A decoding layer rotates its queries and new keys, writes the keys and values into its cache
and attends over the cache (``passes.rope_cache.attach_attention`` groups the five nodes).
``rope_cache`` alone makes that two dispatches; here the lane kernel (``lane.lower_flash``,
``fwd``) does both. Its workgroup owns one (batch, kv head) pair and all its query rows (the
fusion is only formed where the plan gives one row tile per pair), so the cache rows it streams
for that pair are exactly those it writes:

  1. its threads rotate the pair's new keys (``rope.lower_rope``'s exact angle reduction,
     ``rope.ROPE_HELPERS``) and write them, and the new values, into the caches at
     ``index[t]`` (a row whose index lies outside the cache is not written, as in
     ``index_copy_``'s own kernel);
  2. ``storageBarrier()``: those writes are visible to every thread of the workgroup;
  3. the lane kernel runs as usual, each query row loaded unrotated and rotated in registers
     (the same f32 formula per element as the separate kernels: ``x_a cos - x_b sin`` and
     ``x_b cos + x_a sin``).

No other workgroup reads or writes the pair's cache rows, so no ordering across workgroups is
needed. Saves one dispatch per layer and per decoded token (SmolLM2-135M: 30 of 194).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ....graph.ir import Graph
from ....ops.inplace import INDEX_COPY
from ....passes.fuse import FusionGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src
from ..core.literals import f32_literal, u
from .common import load4
from .lane import lower_flash
from .rope import ROPE_HELPERS, rope_turns
from .rope_cache import _cache_store

OP_NAME = "rope_attention"  # the op token of the kernel's name (profiles)


class QueryRotation:
    """The rotation a fused attention applies to its queries as it loads them: the
    unrotated query source, the rotation of a loaded row (lines of WGSL) and the helper
    functions (``rope.ROPE_HELPERS``, the frequency table). Shared by the decode step's
    ``RopePrologue`` and the prefill's ``rope_prefill.RopeLoads``.

    Args:
        graph: the graph.
        qrope: the query rotation (``apply_rotary_emb``); the key rotation has the same
            attributes and offset operand (``passes.rope_cache._rope_key``).
    """

    def __init__(self, graph: Graph, qrope: int) -> None:
        self.graph = graph
        self.qrope = qrope
        first = graph[qrope]
        self.dim = first.type.shape[-1]
        self.length = first.type.shape[-2]  # new positions per (batch, head)
        self.theta = first.attr("theta")
        self.base = u(first.attr("position_offset"))
        self.sign = "-" if first.attr("inverse") else ""
        self.offset_id = first.inputs[1] if len(first.inputs) > 1 else None
        self.offset: Src | None = None

    def cache_writes(self, kb: KernelBuilder, threads: int) -> list[str]:
        """Statements run before the row registers load (none here)."""
        return []

    def queries(self, kb: KernelBuilder) -> Src:
        """The query rotation's operand, bound in place of the rotated queries."""
        if self.offset_id is not None:
            self.offset = kb.read(self.offset_id, "offset")
        return kb.read(self.graph[self.qrope].inputs[0], "q")

    def _position(self, seq_index: str) -> str:
        if self.offset is None:
            return f"{self.base} + {seq_index}"
        batch = "b" if self.offset.type.numel > 1 else "0u"
        return f"{self.base} + bitcast<u32>({self.offset.at(batch)}) + {seq_index}"

    def load_queries(self, k) -> list[str]:
        """``q{c}``: the rotated query row ``qrow`` (``lane_stream._Kernel`` ``k``), each thread
        loading its row's ``qx{c}`` at storage offset ``qb`` and rotating it in registers."""
        src, d = k.src["q"], self.dim
        return [f"  let qx{c} = {load4(src, 'qb', c, d)};" for c in range(d // 4)] + (
            self.rotate_queries()
        )

    def rotate_queries(self) -> list[str]:
        """``q{c}`` from the loaded ``qx{c}`` of query row ``ri`` (its position in the
        sequence), four frequencies per vec4."""
        h4 = self.dim // 8
        pos = self._position("ri")
        lines = [f"  let qp = {pos};"]
        for c in range(h4):
            lines += [
                f"  let qa{c}_{e} = rope_cos_sin(qp, TURNS[{u(4 * c + e)}]);" for e in range(4)
            ]
            cos4 = ", ".join(f"qa{c}_{e}.x" for e in range(4))
            sin4 = ", ".join(f"qa{c}_{e}.y" for e in range(4))
            lines += [
                f"  let qc{c} = vec4<f32>({cos4});",
                f"  let qs{c} = {self.sign}vec4<f32>({sin4});",
                f"  let q{c} = qx{c} * qc{c} - qx{c + h4} * qs{c};",
                f"  let q{c + h4} = qx{c + h4} * qc{c} + qx{c} * qs{c};",
            ]
        return lines

    def helpers(self) -> str:
        table = ", ".join(f"vec2<u32>({hi}u, {lo}u)" for hi, lo in rope_turns(self.dim, self.theta))
        return (
            f"const TWO_PI_2M32 = {f32_literal(2 * math.pi / 2**32)};\n"
            f"const TURNS = array<vec2<u32>, {self.dim // 2}>({table});\n" + ROPE_HELPERS
        )


class RopePrologue(QueryRotation):
    """What ``lane.lower_flash`` asks of a fused decode group: the unrotated query source, the
    cache writes of step 1 and the rotation of step 3 (lines of WGSL), and their helper
    functions.

    Args:
        graph: the graph.
        group: a group of ``attach_attention``: the query and key rotations, the key and value
            ``index_copy_`` writes, then the attention (the sink).
    """

    def __init__(self, graph: Graph, group: FusionGroup) -> None:
        copies = [m for m in group.members if graph[m].op == INDEX_COPY]
        ropes = [m for m in group.members[:-1] if graph[m].op != INDEX_COPY]
        self.kcopy = next(c for c in copies if graph[c].inputs[2] in ropes)
        self.vcopy = next(c for c in copies if c != self.kcopy)
        self.krope = graph[self.kcopy].inputs[2]
        super().__init__(graph, next(r for r in ropes if r != self.krope))

    def cache_writes(self, kb: KernelBuilder, threads: int) -> list[str]:
        """Step 1 and 2: this workgroup's (``bh``) new keys, rotated, and values into their
        caches, then a storage barrier. ``lid`` is the thread (of ``threads``), ``b`` the
        batch row."""
        g = self.graph
        kc, vc = g[self.kcopy], g[self.vcopy]
        xk = kb.read(g[self.krope].inputs[0], "xk")
        vnew = kb.read(vc.inputs[2], "vnew")
        kcache = kb.write(kc.inputs[0], "kcache")
        vcache = kb.write(vc.inputs[0], "vcache")
        index = kb.read(kc.inputs[1], "slots")
        half, dv = self.dim // 2, g[vc.inputs[2]].type.shape[-1]
        size = u(threads)
        angle = f"rope_cos_sin({self._position('nr')}, TURNS[nf])"
        return [
            f"  for (var e = lid; e < {u(self.length * half)}; e = e + {size}) {{",
            f"    let nr = e / {u(half)};",
            f"    let nf = e % {u(half)};",
            f"    let nia = bh * {u(self.length * self.dim)} + nr * {u(self.dim)} + nf;",
            f"    let na = {angle};",
            f"    let nxa = {xk.at('nia')};",
            f"    let nxb = {xk.at(f'nia + {u(half)}')};",
            "    let nc = na.x;",
            f"    let ns = {self.sign}na.y;",
            "    let nya = nxa * nc - nxb * ns;",
            "    let nyb = nxb * nc + nxa * ns;",
            f"    {_cache_store(kb, g, self.kcopy, kcache, index, 'nia', 'nya')}",
            f"    {_cache_store(kb, g, self.kcopy, kcache, index, f'nia + {u(half)}', 'nyb')}",
            "  }",
            f"  for (var e = lid; e < {u(self.length * dv)}; e = e + {size}) {{",
            f"    let nie = bh * {u(self.length * dv)} + e;",
            f"    {_cache_store(kb, g, self.vcopy, vcache, index, 'nie', vnew.at('nie'))}",
            "  }",
            "  storageBarrier();",
        ]


def lower_rope_attention(
    graph: Graph, group: FusionGroup, limits: Limits, deferred=None
) -> list[KernelSource]:
    """The one dispatch of an ``attach_attention`` group, named
    ``%<member>+...+<attention> rope_attention fwd``; ``deferred``: split-K products (q, k,
    v) read as the sums of their partials (``attention.summed``)."""
    loads = RopePrologue(graph, group)
    kernels = lower_flash(graph, group.sink, limits, "fwd", prologue=loads, deferred=deferred)
    name = "%" + "+".join(str(m) for m in group.members) + f" {OP_NAME} fwd"
    return [replace(ks, name=name) for ks in kernels]
