"""One tiled dispatch for a right-shared ``passes.fuse_matmul.MatmulGroup`` (``shared ==
"right"``): products ``C_s = A_s @ B`` reading one right operand ``B`` [K, N], each its own
left operand ``A_s`` [M_s, K]. In a training step these are the weight gradients of
projections reading one input: ``dQ.mT @ x``, ``dK.mT @ x``, ``dV.mT @ x`` (``x`` the normed
input, K the token count) and the MLP's ``dG.mT @ h``, ``dU.mT @ h``; the left-shared
counterpart (forward q/k/v) is ``tiled_group.py``.

Layout: segments along M. The group runs one plan (``right_group_plan``), so one BM x BN tile
for every product. The ``NT = ceil(N / BN)`` column tiles are common to all products; the row
tiles of the products are laid one after another, product s owning a contiguous range of
``ceil(M_s / BM)`` of them. Workgroup ``wg`` takes row tile ``wg / NT`` and column tile ``wg %
NT``, and branches on its row tile (uniform control flow, so the barriers inside stay valid)
into its product's copy of ``tiled.emit_tiled``: that product's A binding, the one binding of
B shared by all. Each product keeps its own epilogue (``GroupBody``, the code of a
``plan_fusion`` epilogue) and every store stays row-major in its own output. Per product the
f32 operations and their K order are the unsplit tiled kernel's, whatever the tile, so values
equal the ungrouped program's bit for bit (only products whose own plan does not split K
join).

Why not the left-shared kernel on the transposed problem (``C_s.mT = B.mT @ A_s.mT``, the
products then sharing their left operand ``B.mT``): its outputs would be written transposed,
each thread's stores ``N`` elements apart instead of contiguous, and its N segments would
need a transposing store path; the M layout reuses ``emit_tiled`` unchanged and keeps the
stores coalesced.

Plan (``right_group_plan``): the plan of the product with the most rows (ties: the first),
unsplit. Each member's own plan does not split K (with K the token count, 50 or 128 in the
benchmarks, the H200's plans for these shapes are unsplit 64x64x16); products whose plan
splits K stay out, as in ``tiled_group`` (the H200 timed unsplit runs of split products
slower than the dispatches they saved). The tile is not widened for the group: each product
already fills the GPU with its own tile, and the M segments pad every product to BM.

``set_enabled(False)`` turns the grouping off for programs compiled from then on (A/B).
"""

from __future__ import annotations

import re
from dataclasses import replace

from ....graph.ir import Graph, resolve_view
from ....passes.fuse_matmul import MatmulGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent
from ..core.literals import u
from ..core.mathlib import helper_source
from ..elementwise.fused import GroupBody
from .plan import SMALL, WG, Plan, choose_plan, tiled_shared_bytes
from .problem import Problem, problem_of
from .tiled import emit_tiled
from .tiled_group import check_bindings, tiled_problem

ENABLED = [True]  # right-shared groups are planned (``set_enabled``)
TAG = "tiled_right"
_SHARED = re.compile(r"var<workgroup> (\w+): array<vec4<f32>, (\d+)>;")


def set_enabled(on: bool) -> None:
    """Group products sharing a right operand (on, the default) or leave them apart, for
    programs compiled from now on (benchmark A/B and tests)."""
    ENABLED[:] = [bool(on)]


def _member(graph: Graph, node_id: int, limits: Limits) -> Problem | None:
    """The problem of a matmul this kernel can join (tiled and unsplit), or None."""
    found = tiled_problem(graph, node_id, limits)
    return None if found is None or found[1].splits > 1 else found[0]


def right_key(graph: Graph, node_id: int, limits: Limits) -> tuple | None:
    """``plan_matmul_groups``'s key (``shared="right"``) for a matmul this kernel can join:
    (right operand's bound value, its row and column strides, N, K, ``"tiled_right"``), else
    None (grouping off, gemv, simd or batched products, constant operands, products whose
    plan splits K)."""
    if not ENABLED[0]:
        return None
    p = _member(graph, node_id, limits)
    if p is None:
        return None
    return (resolve_view(graph, p.b.value), p.b.rows, p.b.cols, p.n, p.k, TAG)


def is_right_group(group: MatmulGroup) -> bool:
    """Whether ``group`` is a right-shared group (this kernel's)."""
    return group.shared == "right"


def right_group_plan(graph: Graph, group: MatmulGroup, limits: Limits) -> Plan | None:
    """The group's plan (module docstring), or None when a segment holds several products
    (epilogues linking them: not this kernel's layout), a member no longer plans tiled and
    unsplit, or even 64x64x16 without prefetch exceeds the adapter's workgroup memory."""
    if group.norm is not None or any(len(seg.anchors) != 1 for seg in group.segments):
        return None
    probs = [problem_of(graph, seg.anchors[0]) for seg in group.segments]
    big = max(probs, key=lambda q: q.m)  # the first of the largest
    plan = choose_plan(big.m, big.k, big.n, 1, big.layout, limits)
    if plan.kernel != "tiled" or plan.splits > 1:
        return None
    for fallback in (plan, replace(plan, prefetch=False), Plan("tiled", SMALL, prefetch=False)):
        if tiled_shared_bytes(fallback.tiling, fallback.prefetch) <= (
            limits.max_workgroup_storage_size
        ):
            return fallback
    return None


def right_group_fits(graph: Graph, group: MatmulGroup, limits: Limits) -> bool:
    """Whether the group's kernel can run (``right_group_plan``)."""
    return right_group_plan(graph, group, limits) is not None


def lower_right_group(graph: Graph, group: MatmulGroup, limits: Limits) -> list[KernelSource]:
    """The one dispatch computing every member of ``group`` (see the module docstring).

    Raises:
        ValueError: as the members' own lowerings would, for a value too large to bind, or
            when no plan fits (``right_group_plan`` None: ``right_group_fits`` was not asked).
    """
    check_bindings(graph, group, limits)  # a right-shared group has no norm
    plan = right_group_plan(graph, group, limits)
    if plan is None:
        raise ValueError(
            f"right-shared matmul group {group.members}: no plan (one product per segment, "
            f"unsplit, within {limits.max_workgroup_storage_size} B of workgroup memory)"
        )
    t = plan.tiling
    kb = KernelBuilder(graph, graph[group.anchor], limits)
    bodies = []
    for seg in group.segments:
        body = GroupBody(graph, seg.as_fusion_group(graph[seg.anchors[0]].type.shape), seg.anchors)
        body.bind(kb)  # before A and B, as tiled_group: an operand it reads stays scalar
        bodies.append(body)
    probs = [problem_of(graph, seg.anchors[0]) for seg in group.segments]
    n, k = probs[0].n, probs[0].k
    nt = -(-n // t.bn)
    tiles = [-(-p.m // t.bm) for p in probs]
    lines = [f"  let tile_mg = wg / {u(nt)};", f"  let tile_ng = wg % {u(nt)};"]
    shared: dict[str, int] = {}
    flops = start = 0
    nbytes = probs[0].b.src.type.nbytes
    for s, (p, body) in enumerate(zip(probs, bodies, strict=True)):

        def store(value, flat: str, col: str, body=body) -> str:
            loads = [
                src.literal if src.literal is not None else src.at(body.index(i, flat, col))
                for i, src in enumerate(body.srcs)
            ]
            return f"{{ {body.compute(loads, anchor=[value])} {body.stores(flat, kb)} }}"

        # B is bound by the first product's emit_tiled; the others find the binding
        text, decls, _ = emit_tiled(kb, p, plan, 1, k, store)
        for name, size in _SHARED.findall(decls):
            shared[name] = max(shared.get(name, 0), int(size))
        lines.append(f"  {'if' if s == 0 else 'else if'} (tile_mg < {u(start + tiles[s])}) {{")
        lines.append(f"    let wg = (tile_mg - {u(start)}) * {u(nt)} + tile_ng;")
        lines.append(indent(text))
        lines.append("  }")
        start += tiles[s]
        flops += 2 * p.m * n * k + body.flops
        nbytes += p.a.src.type.nbytes + body.nbytes
    decls = "".join(f"var<workgroup> {v}: array<vec4<f32>, {z}>;\n" for v, z in shared.items())
    helpers = decls + helper_source(dict.fromkeys(h for b in bodies for h in b.helper_names))
    ks = kb.finish("", "\n".join(lines), WG, start * nt, helpers, flops=flops, nbytes=nbytes)
    ids = "+".join(str(i) for i in group.members)
    return [replace(ks, name=f"%{ids} matmul")]
