"""Attention without a KV cache (prefill, a no-cache forward) with the rotary embeddings of its
queries and keys in its kernel.

A layer rotates its queries and keys by the same positions and attends::

    q_rot = apply_rotary_emb(q, theta, off)
    k_rot = apply_rotary_emb(k, theta, off)
    out = scaled_dot_product_attention(q_rot, k_rot, v, ...)

``rope_cache`` makes the two rotations one dispatch, then the attention another. Where
``passes.rope_cache.attach_prefill_attention`` groups the three nodes (the rotations read by
nothing but this attention), the lane kernel (``lane.lower_flash``, ``fwd``) does all of it:

  * the workgroup's query rows are loaded unrotated and rotated once each, one
    (row, 4 frequencies) per thread, into workgroup memory, from which each of the row's
    lanes reads its registers (``RopeLoads.load_queries``);
  * each key tile is rotated as the workgroup copies it into workgroup memory: a thread loads
    the vec4 of frequencies 4c..4c+3 of a key row and its partner vec4 (D/2 further), and stores
    both rotated halves (``RopeLoads.key_tile``).

The rotation is the same f32 arithmetic per element as ``rope.lower_rope``'s kernel (the exact
angle reduction of ``rope.ROPE_HELPERS``, then ``x_a cos - x_b sin`` and
``x_b cos + x_a sin``), and the rotated values are f32 as the stored rotations would be (the
pass fuses only f32 rotations), so the attention sees the same operands bit for bit. Keys are
rotated once per workgroup that streams them (each (batch, kv head)'s row tiles all read
them): a few hundred extra flops per key row and tile, against one dispatch and the stores and
loads of q_rot and k_rot. Saves one dispatch per layer (SmolLM2-135M's 128-token forward: 30).
"""

from __future__ import annotations

from dataclasses import replace

from ....graph.ir import Graph
from ....passes.fuse import FusionGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src
from ..core.literals import u
from .lane import lower_flash
from .plan import shared_layout
from .rope_attention import QueryRotation

OP_NAME = "rope_prefill_attention"  # the op token of the kernel's name (profiles)


class RopeLoads(QueryRotation):
    """What ``lane.lower_flash`` asks of a fused prefill group: the unrotated query and key
    sources, the query rotation and the rotating key-tile copy (lines of WGSL).

    Args:
        graph: the graph.
        group: a group of ``attach_prefill_attention``: the two rotations, then the attention
            (the sink), which reads the query rotation as its operand 0 and the key rotation as
            its operand 1.
    """

    def __init__(self, graph: Graph, group: FusionGroup) -> None:
        att = graph[group.sink]
        super().__init__(graph, att.inputs[0])
        self.krope = att.inputs[1]

    def keys(self, kb: KernelBuilder) -> Src:
        """The key rotation's operand, bound in place of the rotated keys."""
        return kb.read(self.graph[self.krope].inputs[0], "k")

    def load_queries(self, k) -> list[str]:
        """``q{c}``: the rotated query row of thread row ``r`` (``lane_stream._Kernel`` ``k``). The
        ``lanes`` threads of a row all hold it, so rather than each rotating it (D/2 angles a
        thread), the workgroup rotates its rows once, one (row, vec4 of the first half) per
        thread, into workgroup memory, and each thread reads its row back after a barrier
        (the stream loop's first barrier keeps the tile loads from overwriting it early).
        Where the rows do not fit the workgroup memory, each thread rotates its own row."""
        R, h4, d4 = k.plan.rows, self.dim // 8, self.dim // 4
        if R * d4 > shared_layout(k.mode, k.dims, k.plan)[0]:
            return super().load_queries(k)
        lq, G, src = k.dims.lq, k.dims.group, k.src["q"]
        xa, xb = src.at4("qo"), src.at4("qo", self.dim // 2)
        angles = [f"rope_cos_sin(qp, TURNS[qc * 4u + {u(e)}])" for e in range(4)]
        return [
            f"  for (var e = lid; e < {u(R * h4)}; e = e + {u(k.plan.size)}) {{",
            f"    let qr = e / {u(h4)};",
            f"    let qc = e % {u(h4)};",
            f"    let qrc = min(tile * {u(R)} + qr, {u(k.n_rows - 1)});",
            f"    let qo = {src.row_offset(f'bh * {u(G * lq)} + qrc')} + qc * 4u;",
            f"    let qxa = {xa};",
            f"    let qxb = {xb};",
            f"    let qp = {self._position(f'qrc % {u(lq)}')};",
            *[f"    let qa{e} = {a};" for e, a in enumerate(angles)],
            "    let qcos = vec4<f32>(qa0.x, qa1.x, qa2.x, qa3.x);",
            f"    let qsin = {self.sign}vec4<f32>(qa0.y, qa1.y, qa2.y, qa3.y);",
            f"    sh[qr * {u(d4)} + qc] = qxa * qcos - qxb * qsin;",
            f"    sh[qr * {u(d4)} + qc + {u(h4)}] = qxb * qcos + qxa * qsin;",
            "  }",
            "  workgroupBarrier();",
            *[f"  let q{c} = sh[r * {u(d4)} + {u(c)}];" for c in range(d4)],
        ]

    def key_tile(self, k, src: Src, row: str) -> list[str]:
        """Cooperative copy of the current key tile into workgroup segment ``k``, rotated:
        one thread per (entry, vec4 of the first half); ``row`` is the key's row index in
        ``src`` in terms of ``sr``, the key's index in the sequence (its position past the
        first). ``k`` is ``lane_stream._Kernel``; reads clamp to the last key (``kvl - 1`` with a
        runtime key count), as ``tile_loads.load_tile``'s do."""
        off, stride = k.layout["k"]
        h4, half = self.dim // 8, self.dim // 2
        last = "kvl - 1u" if k.kvlen is not None else u(k.n_stream - 1)
        xa, xb = src.at4("kb"), src.at4("kb", half)
        angles = [f"rope_cos_sin(kp, TURNS[c * 4u + {u(e)}])" for e in range(4)]
        return [
            f"    for (var e = lid; e < {u(k.plan.tile * h4)}; e = e + {u(k.plan.size)}) {{",
            f"      let rr = e / {u(h4)};",
            f"      let c = e % {u(h4)};",
            f"      let sr = min(s0 + rr, {last});",
            f"      let kb = {src.row_offset(row)} + c * 4u;",
            f"      let kxa = {xa};",
            f"      let kxb = {xb};",
            f"      let kp = {self._position('sr')};",
            *[f"      let ka{e} = {a};" for e, a in enumerate(angles)],
            "      let kc = vec4<f32>(ka0.x, ka1.x, ka2.x, ka3.x);",
            f"      let ks = {self.sign}vec4<f32>(ka0.y, ka1.y, ka2.y, ka3.y);",
            f"      let kw = {u(off)} + rr * {u(stride)} + c;",
            "      sh[kw] = kxa * kc - kxb * ks;",
            f"      sh[kw + {u(h4)}] = kxb * kc + kxa * ks;",
            "    }",
        ]


def lower_rope_prefill(
    graph: Graph, group: FusionGroup, limits: Limits, deferred=None
) -> list[KernelSource]:
    """The one dispatch of an ``attach_prefill_attention`` group, named
    ``%<q rotation>+<k rotation>+<attention> rope_prefill_attention fwd``; ``deferred``:
    split-K products (q, k, v) read as the sums of their partials (``attention.summed``)."""
    loads = RopeLoads(graph, group)
    kernels = lower_flash(graph, group.sink, limits, "fwd", prologue=loads, deferred=deferred)
    name = "%" + "+".join(str(m) for m in group.members) + f" {OP_NAME} fwd"
    return [replace(ks, name=name) for ks in kernels]
