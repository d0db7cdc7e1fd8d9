"""Lowerings of the attention ops: each mode on the register-tiled kernel (``block``) when a
block plan is chosen, else on the lane kernel (``lane``).

Besides one kernel per attention op (``lower_attention``, one ``mode`` per op in the lowering
table), ``lower_key_value`` computes a key-gradient node and its value-gradient sibling in one
pass (``dkv`` mode), for the pairs that ``passes.fuse.plan_attention_key_value`` forms where
``plan.fuses_key_value`` says so.
"""

from __future__ import annotations

from dataclasses import replace

from ....graph.ir import Graph
from ....ops.attention import BWD_K, SDPA
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import WG
from . import plan as attention_plan
from .block import lower_block
from .common import dims_of, load4
from .decode import lower_split
from .dkv_half import choose_query_split, lower_dkv_half
from .dq_split import lower_dq_split
from .lane import lower_flash
from .plan import choose_block_plan, choose_plan, extents, fuses_key_value, uses_dkv_half
from .splits import LONG_SPLIT_MODES, choose_long_split, choose_split


def lower_attention(
    graph: Graph, node_id: int, limits: Limits, mode: str, deferred=None
) -> list[KernelSource]:
    """The forward of a short query block over several tiles of keys (``splits.choose_split``),
    or of a long one on a lane plan with too few threads to fill the GPU
    (``splits.choose_long_split``; a forward that also writes its log-sum-exp is lowered by
    ``lower_forward_lse``, which splits by the same rule): the split-key lane kernel and its
    merge (``decode``). A long query block's query gradient splits by that rule too: the
    split-key kernel and the sum of its parts (``dq_split``; a dq that computes its delta is
    lowered by ``dq_delta.lower_dq_delta``, which splits alike). Otherwise the
    register-tiled kernel (``block``) when a block plan fits the adapter, else the lane
    kernel (``lane``); ``plan.BLOCK_OVERRIDE`` forces either. ``deferred``: split-K
    products the lane forward reads as the sums of their partials (``attention.summed``
    plans them for it alone)."""
    if mode == "lse":  # the lane kernel only (the block kernel has no lse-only mode)
        return lower_flash(graph, node_id, limits, mode)
    dims = dims_of(graph, graph[node_id], mode)
    split = choose_split(dims, limits) if mode == "fwd" else None
    plan = None if split is not None else choose_block_plan(mode, dims, limits)
    if split is None and plan is None and mode in LONG_SPLIT_MODES and not deferred:
        split = choose_long_split(dims, limits, mode)
    if split is not None and mode == "dq":
        return lower_dq_split(graph, node_id, limits, split)
    if split is not None:
        return lower_split(graph, node_id, limits, split)
    if plan is None:
        return lower_flash(graph, node_id, limits, mode, deferred=deferred)
    return lower_block(graph, node_id, limits, mode, dims, plan)


def rope_attention_fusible(graph: Graph, node_id: int, limits: Limits) -> bool:
    """Whether attention ``node_id`` may take its rotations and cache writes into its kernel
    (``rope_attention``): its forward runs on the lane kernel (no key split, no block plan)
    with one row tile per (batch, kv head), so each workgroup reads only the cache rows it
    writes."""
    dims = dims_of(graph, graph[node_id], "fwd")
    if choose_split(dims, limits) is not None or choose_block_plan("fwd", dims, limits):
        return False
    return extents("fwd", dims)[0] <= choose_plan("fwd", dims, limits).rows


def rope_prefill_fusible(graph: Graph, node_id: int, limits: Limits) -> bool:
    """Whether attention ``node_id`` may rotate its queries and keys as it loads them
    (``rope_prefill``): its forward runs on the lane kernel (no key split, no block plan);
    ``plan.ROPE_PREFILL`` switches it off."""
    if not attention_plan.ROPE_PREFILL:
        return False
    dims = dims_of(graph, graph[node_id], "fwd")
    return choose_split(dims, limits) is None and choose_block_plan("fwd", dims, limits) is None


KEY_VALUE = f"{SDPA}_backward_key_value"  # the op token of dkv kernels' names (profiles)


def key_value_fusible(graph: Graph, key_node: int, limits: Limits) -> bool:
    """Whether one ``dkv`` kernel should compute key-gradient node ``key_node`` together with
    its value-gradient sibling on this adapter (``plan.fuses_key_value``)."""
    return fuses_key_value(dims_of(graph, graph[key_node], "dkv"), limits)


def lower_key_value(
    graph: Graph, key_node: int, value_node: int, limits: Limits
) -> list[KernelSource]:
    """One dispatch writing dk (node ``key_node``, a ``..._backward_key``) and dv (node
    ``value_node``, the ``..._backward_value`` of the same attention): the block kernel
    when a ``dkv`` block plan fits, else the half-head-dim kernel (``dkv_half``) where
    ``plan.uses_dkv_half`` says so (a long query stream split over workgroups where
    ``dkv_half.choose_query_split`` says so: ``dkv half split CxL`` and ``dkv half sum C``),
    else the lane kernel. Named
    ``%<key>+<value> scaled_dot_product_attention_backward_key_value ...``."""
    dims = dims_of(graph, graph[key_node], "dkv")
    plan = choose_block_plan("dkv", dims, limits)
    if plan is None and uses_dkv_half(dims, limits):
        split = choose_query_split(dims, limits)
        kernels = lower_dkv_half(graph, key_node, value_node, limits, split)
    elif plan is None:
        kernels = lower_flash(graph, key_node, limits, "dkv", value_node)
    else:
        kernels = lower_block(graph, key_node, limits, "dkv", dims, plan, value_node)
    head = f"%{key_node} {BWD_K}"
    name = f"%{key_node}+{value_node} {KEY_VALUE}"
    return [replace(ks, name=name + ks.name.removeprefix(head)) for ks in kernels]


def lse_fusible(graph: Graph, forward_node: int, limits: Limits) -> bool:
    """Whether forward attention ``forward_node``'s kernel may also write the log-sum-exp of
    its rows (an ``..._lse`` node, ``passes.fuse.plan_attention_lse``): it runs on the lane
    kernel (no key split, no block plan), whose rows keep their softmax state to the end;
    ``plan.SAVE_LSE`` switches it off."""
    if not attention_plan.SAVE_LSE:
        return False
    dims = dims_of(graph, graph[forward_node], "fwd")
    return choose_split(dims, limits) is None and choose_block_plan("fwd", dims, limits) is None


def lower_forward_lse(
    graph: Graph, forward_node: int, lse_node: int, limits: Limits
) -> list[KernelSource]:
    """One dispatch writing the forward's output (node ``forward_node``) and the log-sum-exp
    of its rows (node ``lse_node``), at the forward's position. Named
    ``%<forward>+<lse> scaled_dot_product_attention fwd+lse``. A long forward that
    ``splits.choose_long_split`` splits is two: ``fwd+lse split CxL`` (the chunks' partial
    states) and ``merge C`` (the output and the lse)."""
    split = choose_long_split(dims_of(graph, graph[forward_node], "fwd"), limits)
    if split is None:
        kernels = lower_flash(graph, forward_node, limits, "fwd", lse_node=lse_node)
    else:  # the partial kernel, and the merge writing the output and the lse
        kernels = lower_split(graph, forward_node, limits, split, lse_node)
    head = f"%{forward_node} {SDPA} "
    name = f"%{forward_node}+{lse_node} {SDPA} "
    return [
        replace(ks, name=name + ks.name.removeprefix(head).replace("fwd", "fwd+lse", 1))
        for ks in kernels
    ]


def lower_delta(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``..._delta(lse, out, g)``: one thread per query row writes ``(lse, sum(g * out))``
    (FlashAttention-2's D = rowsum(dO o O), Dao 2023, Algorithm 2 line 4), reading out and g
    through their views (rows stay contiguous: ``permute_views``)."""
    node = graph[node_id]
    if node.type.numel == 0:
        return []
    lse_id, out_id, g_id = node.inputs
    kb = KernelBuilder(graph, node, limits)
    lse, o, g = kb.read(lse_id, "lse"), kb.read(out_id, "o"), kb.read(g_id, "dout")
    out = kb.write(node_id, "out")
    rows, dv = graph[lse_id].type.numel, graph[out_id].type.shape[3]
    lines = [
        f"  let row = wg * {WG}u + lid;",
        f"  if (row < {rows}u) {{",
        f"    let ob = {o.row_offset('row')};",
        f"    let gb = {g.row_offset('row')};",
        "    var delta = 0.0;",
    ]
    for c in range(-(-dv // 4)):
        lines.append(f"    delta = delta + dot({load4(g, 'gb', c, dv)}, {load4(o, 'ob', c, dv)});")
    lines += [
        "    " + kb.store(out, "row * 2u", lse.at("row")),
        "    " + kb.store(out, "row * 2u + 1u", "delta"),
        "  }",
    ]
    nbytes = 2 * graph[out_id].type.nbytes + 12 * rows
    return [
        kb.finish("delta", "\n".join(lines), WG, -(-rows // WG), flops=2 * rows * dv, nbytes=nbytes)
    ]
