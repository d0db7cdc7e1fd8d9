"""Split-K without the summing dispatch: readers of the product sum its partials themselves.

A split-K matmul (``lowering``) writes ``splits`` partial products to scratch ``[split][flat]``
and a second dispatch sums them in split order and stores the product. On the H200 every
dispatch costs ~6-7 us of GPU time however small (bench/results/llm_profile_h200.txt: 120 of
SmolLM2-135M's 669 prefill dispatches were such sums), so where every kernel reading the
product can instead read the partials, the product is never stored: its own lowering emits
the first dispatch alone (``lower_matmul(defer_sum=True)``) and each reader binds the
partials (a ``ScratchRef`` owned by the matmul, alive until the last reader) and reads
element i through ``SplitPartials.helper``: the summing dispatch's loop (same f32 additions,
same order, from 0.0; narrowed to f16 and back where the product is stored as f16), so values
are bit-identical to the two-dispatch program.

The same holds for the input gradient of a stride-1 convolution (``conv.gemm``: one implicit
GEMM whose partials are in GEMM order, ``SplitPartials.index`` maps an output element there, and
whose summing kernel adds two accumulators per lane, ``SplitPartials.lanes``), and for a
forward ``conv2d``'s partials read by the norm after it (``conv_partials``, used by
``norm.conv_prologue``, which adds the conv's bias to the sum).

Readers that can (``plan_deferred_sums``): kernels that read operands only through ``Src.at``:
members of an elementwise fusion group (``elementwise.fused``, scalar path), the epilogue of a
matmul- or conv-anchored group (run in its store stage or its own summing dispatch), and
``permute``; and, through a permute read in place (``passes.permute_views``), the attention
forward and the rotations before it (``attention.summed``: q, k and v).
Every reader of the product (through views) must be one of those, the product no graph output,
and not the left or right operand of the group's matmul.

Why not the summing in the matmul itself ("the last workgroup of a tile to finish sums the
partials", CUDA's threadfence reduction): WGSL gives no way to make one workgroup's storage
writes visible to another within a dispatch. ``storageBarrier`` has workgroup memory scope and
atomics are relaxed (WGSL spec, sync built-ins and memory model; gpuweb issues 2297, 2980 and
3774: "workgroupBarrier and storageBarrier cannot be used to synchronize memory accesses between
different workgroups"), so the last workgroup could read stale partials. Not done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ....dtypes import DType
from ....graph.ir import VIEW_OPS, Graph, resolve_view
from ....passes.fuse import FusionGroup
from ...kernel import Limits
from ..conv.gemm import LANES_FROM_SPLITS
from ..conv.lowering import backward_input_partials, forward_partials
from ..core.literals import u
from .lowering import split_layout

KEY = "splitk"  # the scratch key of the partials (``lowering.lower_matmul``)
SPLIT_OPS = ("matmul", "conv2d_backward_input")
ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler
# The cost model of deferral: it saves one dispatch (~7 us of GPU time on the H200,
# bench/results/llm_profile_h200.txt) and costs the extra reads of a product summed by more
# than one kernel (``extra_bytes``). Defer while those stay below what the H200 reads in
# ~4 us (16 MiB at our copy kernel's 3.95 TB/s, bench/results/bandwidth_h200.json), a margin
# under the dispatch they replace. Not measured on the GPU as a choice; SmolLM2-135M's
# deferred products have one reading kernel each but up (two: its backward too, 2.4 MB).
MAX_EXTRA_BYTES = 16 << 20


def set_enabled(on: bool) -> None:
    """Turn deferred split-K sums, and the grouping of split-K products (``split_group``), on
    or off for programs compiled from now on (benchmarks and tests compare against the
    two-dispatch programs)."""
    ENABLED[:] = [bool(on)]


@dataclass(frozen=True)
class SplitPartials:
    """The partial products of split-K node ``node``: ``splits`` x ``total`` f32 in scratch
    ``key``, partial t of element e at ``t * total + e``.

    Attributes:
        index: WGSL expression of e for the product's flat element ``i`` (``"i"``: the same
            order; a convolution's GEMM order differs from its output's).
        lanes: 0: summed in split order from 0.0 (``matmul.lowering._sum_splits``); n >= 1:
            as ``conv.gemm._sum_splits`` with n lanes: lane l sums chunks l, l + 2n, ... and
            l + n, l + 3n, ... into two accumulators, then the lanes' totals add in order.
    """

    node: int
    splits: int
    total: int
    key: str = KEY
    index: str = "i"
    lanes: int = 0

    @property
    def count(self) -> int:
        return self.splits * self.total

    def helper(
        self, fn: str, var: str, dtype: DType, width: int = 1, lanes_of_vec4: bool = False
    ) -> str:
        """WGSL function ``fn(i) -> f32``: element i of the product from binding ``var``, as
        the summing dispatch computes it (and stores it, as f16 for an f16 product).

        ``width`` 4 (``total`` a multiple of 4, ``var`` an ``array<vec4<f32>>``): ``fn(q) ->
        vec4<f32>``, elements 4q .. 4q + 3, each lane the same additions in the same order
        (vec4 adds are lane-wise f32 adds), a quarter of the loads. With an ``index`` other
        than ``"i"`` the caller guarantees that ``index`` maps elements 4q .. 4q + 3 to four
        consecutive partial elements starting at a multiple of 4 (a convolution's output
        whose planes have a multiple of 4 pixels).

        ``lanes_of_vec4`` (width 1, ``total`` a multiple of 4, index ``"i"``): ``var`` is an
        ``array<vec4<f32>>`` (bound for a width-4 helper too) and the scalar loads read lane
        ``e % 4`` of its vectors: the same values in the same order."""
        if width not in (1, 4) or (width == 4 and self.total % 4):
            raise ValueError(f"%{self.node}: no vec4 sum over these partials")
        if lanes_of_vec4 and (width != 1 or self.total % 4 or self.index != "i" or self.lanes):
            raise ValueError(f"%{self.node}: no scalar sum over vec4 partials")
        ty = "f32" if width == 1 else "vec4<f32>"
        zero = "0.0" if width == 1 else "vec4<f32>(0.0)"
        ret = f"{ty}(vec4<f16>(v))" if width == 4 else "f32(f16(v))"
        ret = ret if dtype is DType.f16 else "v"
        total = u(self.total // width)
        if width == 1 or self.index == "i":
            lines = [f"fn {fn}(i: u32) -> {ty} {{", f"  let e = {self.index};"]
        else:  # unit q: its first element's partial, in vec4 units
            lines = [
                f"fn {fn}(q: u32) -> {ty} {{",
                "  let i = 4u * q;",
                f"  let e = ({self.index}) / 4u;",
            ]
        if self.lanes == 0:
            load = f"{var}[t * {total} + e]"
            if lanes_of_vec4:
                load = f"{var}[t * {u(self.total // 4)} + e / 4u][e % 4u]"
            lines += [
                f"  var s = {zero};",
                f"  for (var t = 0u; t < {u(self.splits)}; t = t + 1u) {{",
                f"    s += {load};",
                "  }",
                "  let v = s;",
            ]
        else:
            n, splits = self.lanes, u(self.splits)
            for lane in range(n):
                lines += [
                    f"  var s0_{lane} = {zero};",
                    f"  var s1_{lane} = {zero};",
                    f"  for (var t = {u(lane)}; t < {splits}; t = t + {u(2 * n)}) {{",
                    f"    s0_{lane} += {var}[t * {total} + e];",
                    f"    let t1 = t + {u(n)};",
                    f"    if (t1 < {splits}) {{ s1_{lane} += {var}[t1 * {total} + e]; }}",
                    "  }",
                ]
            terms = [f"(s0_{lane} + s1_{lane})" for lane in range(n)]
            lines.append(f"  let v = {' + '.join(terms)};")
        lines += [f"  return {ret};", "}", ""]
        return "\n".join(lines)


def split_partials(graph: Graph, node_id: int, limits: Limits) -> SplitPartials | None:
    """The partials of ``node_id`` (a matmul, or a stride-1 ``conv2d_backward_input``) when its
    lowering splits K, else None."""
    if graph[node_id].op == "conv2d_backward_input":
        found = backward_input_partials(graph, node_id, limits)
        if found is None:
            return None
        key, splits, total, index = found
        lanes = 4 if splits > LANES_FROM_SPLITS else 1
        return SplitPartials(node_id, splits, total, key, index, lanes)
    layout = split_layout(graph, node_id, limits)
    if layout is None:
        return None
    splits, _, total = layout
    return SplitPartials(node_id, splits, total)


def conv_partials(graph: Graph, node_id: int, limits: Limits) -> SplitPartials | None:
    """The partials of forward ``conv2d`` ``node_id`` (``conv.lowering.forward_partials``:
    GEMM order, summed as ``conv.gemm.sum_lines`` does, before its bias) when its plan splits
    K, else None."""
    found = forward_partials(graph, node_id, limits)
    if found is None:
        return None
    key, splits, total, index = found
    lanes = 4 if splits > LANES_FROM_SPLITS else 1
    return SplitPartials(node_id, splits, total, key, index, lanes)


def _readers(graph: Graph, users: list[list[int]], vid: int) -> list[int]:
    out = []
    for r in users[vid]:
        out.extend(_readers(graph, users, r) if graph[r].op in VIEW_OPS else [r])
    return out


def plan_deferred_sums(
    graph: Graph, needed: Sequence[bool], groups: Sequence, limits: Limits
) -> dict[int, SplitPartials]:
    """The split-K matmuls whose readers all sum the partials (module docstring), by node id.

    Args:
        graph: a verified graph.
        needed: per node, whether it gets kernels (``schedule.needed_nodes``).
        groups: the schedule's fusion groups (``FusionGroup``, ``MatmulGroup``, ...).
        limits: the adapter's limits (they choose the matmul plans).
    """
    if not ENABLED[0]:
        return {}
    group_of = {m: g for g in groups for m in g.members}
    users = graph.users()
    outputs = {resolve_view(graph, v) for _, v in graph.outputs}
    out: dict[int, SplitPartials] = {}
    for node in graph.nodes:
        nid = node.id
        if node.op not in SPLIT_OPS or not needed[nid] or nid in group_of or nid in outputs:
            continue
        if node.type.dtype not in (DType.f32, DType.f16):  # the helper returns f32
            continue
        part = split_partials(graph, nid, limits)
        if part is None:
            continue
        kernels = _summing_kernels(graph, users, part, needed, group_of, limits)
        if kernels is not None and extra_bytes(part, kernels) <= MAX_EXTRA_BYTES:
            out[nid] = part
    return out


def _summing_kernels(
    graph: Graph,
    users: list[list[int]],
    part: SplitPartials,
    needed: Sequence[bool],
    group_of: dict,
    limits: Limits,
) -> int | None:
    """How many kernels read product ``part.node`` when every one of them can sum its
    partials, else None: kernels reading through ``Src.at`` (``_sums``) and the attention
    forward reading it in place through a permute (``attention.summed``). The attention
    kernel loads each key and value once per row tile of its kv head (``summed.reads``),
    re-reads that hit the cache as those of the stored product did; so it counts as one
    kernel, and the partials it re-reads must stay small (``MAX_EXTRA_BYTES`` in all)."""
    from ..attention.summed import BOUNDED, in_place_readers  # attention imports the builder

    kernels: set = set()
    for r in _readers(graph, users, part.node):
        if _sums(graph, r, needed, group_of.get(r)):
            kernels.add(id(group_of[r]) if r in group_of else r)
            continue
        found = in_place_readers(graph, users, r, part.node, needed, group_of, limits)
        if found is None or 4 * part.count > MAX_EXTRA_BYTES:
            return None
        if BOUNDED[0] and 4 * part.total * (part.splits - 1) * sum(n for _, n in found) > (
            MAX_EXTRA_BYTES
        ):  # the loads each row tile adds (``summed.BOUNDED``)
            return None
        kernels.update(key for key, _ in found)
    return len(kernels) or None


def extra_bytes(part: SplitPartials, kernels: int) -> int:
    """Bytes that ``kernels`` reading kernels summing the partials read beyond what the
    summing dispatch and those kernels read and write without deferral: each reads ``splits``
    values per element instead of one, and the summing dispatch (all partials read, the
    product written) is gone. Negative for one reader."""
    deferred = kernels * part.splits * part.total
    summed = part.splits * part.total + part.total + kernels * part.total
    return 4 * (deferred - summed)


def _sums(graph: Graph, reader: int, needed: Sequence[bool], group) -> bool:
    """Whether ``reader``'s kernel reads its operands through ``Src.at`` alone (and so can
    be given the partials)."""
    if not needed[reader]:
        return False  # e.g. a transpose folded into a matmul, which binds the product itself
    if group is None:
        return graph[reader].op == "permute"
    if not isinstance(group, FusionGroup) or reader == group.anchor:
        return False
    return group.anchor is None or graph[group.anchor].op in ("matmul", "conv2d")
