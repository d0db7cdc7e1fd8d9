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
from .block import lower_block
from .decode import lower_split
from .lane import dims_of, lower_flash
from .plan import choose_block_plan, choose_plan, choose_split, extents, fuses_key_value


def lower_attention(graph: Graph, node_id: int, limits: Limits, mode: str) -> list[KernelSource]:
    """The forward of a short query block over several tiles of keys (``plan.choose_split``):
    the split-key lane kernel and its merge (``decode``). Otherwise the register-tiled kernel
    (``block``) when a block plan fits the adapter, else the lane kernel (``lane``);
    ``plan.BLOCK_OVERRIDE`` forces either."""
    dims = dims_of(graph, graph[node_id], mode)
    split = choose_split(dims, limits) if mode == "fwd" else None
    if split is not None:
        return lower_split(graph, node_id, limits, split)
    plan = choose_block_plan(mode, dims, limits)
    if plan is None:
        return lower_flash(graph, node_id, limits, mode)
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
    when a ``dkv`` block plan fits, else the lane kernel. Named
    ``%<key>+<value> scaled_dot_product_attention_backward_key_value ...``."""
    dims = dims_of(graph, graph[key_node], "dkv")
    plan = choose_block_plan("dkv", dims, limits)
    if plan is None:
        kernels = lower_flash(graph, key_node, limits, "dkv", value_node)
    else:
        kernels = lower_block(graph, key_node, limits, "dkv", dims, plan, value_node)
    head = f"%{key_node} {BWD_K}"
    name = f"%{key_node}+{value_node} {KEY_VALUE}"
    return [replace(ks, name=name + ks.name.removeprefix(head)) for ks in kernels]
