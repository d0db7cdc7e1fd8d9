"""The attention forward reading q, k and v as sums of their split-K partials.

In a transformer layer q, k and v are split-K products (``matmul.lowering``) whose partials
one dispatch computes (``matmul.split_group``), reshaped and permuted to the head layout
[B, H, S, D] and read in place by the attention kernel (``passes.permute_views``: the permutes
run no kernel). Without this module each product kept its summing dispatch (three merged into
one by ``matmul.summing``), a ~7 us launch per layer on the H200. Here the forward lane kernel
(``lane.lower_flash``, ``fwd``: a plain ``scaled_dot_product_attention``, the
``rope_prefill`` group, rotations in its loads, or the ``rope_attention`` group, cache writes
first), or the rotations with cache writes before it (``rope_cache``, a prefill into a KV
cache), binds the partials instead and reads element i
through ``matmul.deferred.SplitPartials.helper`` (``KernelBuilder.read``: a ``Src`` with the
permute's strides whose element is the summing loop over the partials at the product's storage
offset), so the product is never stored and the values are bit-identical: the helper runs the
summing dispatch's f32 additions in the same order (narrowed to f16 and back where the product
is stored as f16).

Cost: the query row is loaded once per row; in the lane forward every key and value row is
loaded by each of the kv head's row tiles (``reads``), each element ``splits`` loads instead
of one (from the cache, as the stored product's loads were).
``matmul.deferred.plan_deferred_sums`` counts the partials, and (``BOUNDED``, the default)
the loads the row tiles add, against ``MAX_EXTRA_BYTES``: at SmolLM2's widths (seq 128, 8
splits, 96 row tiles a kv head) k and v would add ~66 MB of cache reads each a layer, so they
keep their sum and q alone is summed by the attention (W1 fwd unchanged, 273 dispatches on the
H200's limits; unbounded 243); a prefill into a KV cache, whose rotations load each element
once, loses its sums either way (309 -> 279).

Only where the attention forward kernels are the product's only readers (a forward-only
program: in training the backward reads q, k and v too, and they keep their sum). Not covered:
the block and split-key forward kernels, a rotation in no group. ``set_enabled(False)``
compiles the programs before this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from ....graph.ir import VIEW_OPS, Graph
from ....ops.attention import SDPA
from ....ops.inplace import INDEX_COPY
from ....passes.fuse import FusionGroup
from ....passes.permute_views import ROPE, read_view
from ...kernel import Limits
from .common import dims_of
from .plan import choose_block_plan, choose_plan, extents
from .splits import choose_split

ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler


# True: a product is summed by the attention only while the loads that adds (each row tile of
# the kv head loading every key and value ``splits`` times instead of once, ``reads``) stay
# under ``deferred.MAX_EXTRA_BYTES``; False: however many (an A/B knob: untimed on the H200,
# where SmolLM2's k and v at seq 128 would cost ~66 MB of cache reads each a layer against the
# ~7 us dispatch saved).
BOUNDED = [True]


def set_enabled(on: bool) -> None:
    """Let the attention forward sum its operands' split-K partials (on, the default) or not,
    for programs compiled from now on (benchmarks and tests compare both)."""
    ENABLED[:] = [bool(on)]


def set_bounded(on: bool) -> None:
    """Bound the loads the attention adds by summing partials (on, the default; ``BOUNDED``)
    or not, for programs compiled from now on."""
    BOUNDED[:] = [bool(on)]


def _lane_forward(graph: Graph, sdpa: int, limits: Limits) -> bool:
    """Whether forward attention ``sdpa`` runs on the unsplit lane kernel."""
    dims = dims_of(graph, graph[sdpa], "fwd")
    return choose_split(dims, limits) is None and choose_block_plan("fwd", dims, limits) is None


def _row_tiles(graph: Graph, sdpa: int, limits: Limits) -> int:
    """Row tiles per (batch, kv head) of ``sdpa``'s forward: how often a key is loaded."""
    dims = dims_of(graph, graph[sdpa], "fwd")
    return -(-extents("fwd", dims)[0] // choose_plan("fwd", dims, limits).rows)


def reads(graph: Graph, reader: int, operand: int, group, limits: Limits) -> int | None:
    """How many times the kernel of ``reader`` loads each element of ``operand`` (a permute it
    reads in place), or None when that kernel cannot read it as sums of partials.

    Kernels that can: the lane forward of a ``scaled_dot_product_attention`` in no group
    (q once per row, k and v once per row tile of the kv head), and the groups anchored on a
    rotation (``passes.rope_cache``): the prefill attention rotating q and k as it loads them
    (``rope_prefill``, as the plain forward), the decode attention writing its new keys and
    values into the caches (``rope_attention``: one row tile per kv head, each element
    loaded once) and the rotations with cache writes (``rope_cache``: one thread per element
    or pair, each loaded once). Each reads its operands through ``Src.at`` alone.

    Args:
        graph: the graph.
        reader: a node reading ``operand`` directly.
        operand: the permute node.
        group: ``reader``'s fusion group or None.
        limits: the adapter's limits (they choose the attention kernel).
    """
    node = graph[reader]
    slots = [k for k, i in enumerate(node.inputs) if i == operand]
    if group is None:
        if node.op != SDPA or not _lane_forward(graph, reader, limits) or max(slots) > 2:
            return None  # not the lane forward, or a mask
        tiles = _row_tiles(graph, reader, limits)
        return sum(1 if k == 0 else tiles for k in slots)
    if not isinstance(group, FusionGroup) or group.anchor is None:
        return None
    if graph[group.anchor].op != ROPE:
        return None
    sink = graph[group.sink]
    prefill = sink.op == SDPA and not any(graph[m].op == INDEX_COPY for m in group.members)
    tiles = _row_tiles(graph, sink.id, limits) if prefill else 1
    if node.op == ROPE and slots == [0]:  # the unrotated q or k
        return tiles if prefill and sink.inputs[1] == node.id else 1
    if node.op == INDEX_COPY and slots == [2]:  # the new values written into the cache
        return 1
    if node.op == SDPA and prefill and slots == [2]:  # v
        return tiles
    return None


def in_place_readers(
    graph: Graph,
    users: list[list[int]],
    permute: int,
    product: int,
    needed: Sequence[bool],
    group_of: dict,
    limits: Limits,
) -> list[tuple[object, int]] | None:
    """The kernels reading split-K product ``product`` in place through ``permute`` (a
    permute that runs no kernel), as (kernel key, loads per element), when each is an
    attention forward that sums partials (``reads``); else None."""
    if not ENABLED[0] or graph[permute].op != "permute" or needed[permute]:
        return None
    view = read_view(graph, permute)
    if view is None or view[0] != product:
        return None
    out: list[tuple[object, int]] = []
    for r in dict.fromkeys(users[permute]):
        if graph[r].op in VIEW_OPS or not needed[r]:
            return None
        group = group_of.get(r)
        n = reads(graph, r, permute, group, limits)
        if n is None:
            return None
        out.append((r if group is None else id(group), n))
    return out or None
