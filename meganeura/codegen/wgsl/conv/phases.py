"""The stride phases of a strided input gradient as one dispatch (plus at most one split-K sum).

``lowering.lower_conv2d_backward_input`` splits a strided input gradient into one implicit
GEMM per stride phase (ry, rx) of the input (4 for stride 2), each over the taps reaching it,
so each with its own K (e.g. a 3x3 stride 2 has phases of 1, 2, 2 and 4 taps). Run apart,
each phase is a small, latency-bound dispatch. Here they share one dispatch, as
``matmul/tiled_group.py``'s segments do: phase p owns a contiguous range of the workgroups
(its M x N tiles x groups x splits; the phases with the longest K per workgroup first, as
the GPU starts workgroups about in id order), and a workgroup branches on its id (uniform:
derived from ``workgroup_id``, so the barriers inside each branch stay in uniform control
flow) into that phase's copy of the GEMM body (``gemm.gemm_lines``: its own K, operand
index math and output mapping). A phase no tap reaches (K = 0: a kernel smaller
than the stride, e.g. 1x1 stride 2) gets tiles storing zeros, so no separate zero pass runs.

Plan (``phase_plans``). One tiling for every phase: the one ``gemm.plan_gemm`` picks for the
phase with the most taps (the largest K; then N), with its prefetch mode (dropped for a
K = 0 phase). Split-K aims at ``gemm.TARGET_GROUPS`` workgroups for the phases together: one
chunk length ``per = max(MIN_SPLIT_K, work / TARGET_GROUPS)`` (work: sum over phases of
tiles x K; ``MIN_CHUNK`` replaces MIN_SPLIT_K when set), and each phase whose K >= 2
MIN_SPLIT_K cuts its K into about K / per chunks (at most K / MIN_SPLIT_K, ``MAX_SPLITS``),
so its workgroups run about equally long K chains; phases with few taps stay unsplit. No
phase splits when the tiles of the phases with K > 0 reach TARGET_GROUPS already. In a
kernel latency-bound by its chain of K steps, as the H200 sweep shows these, one wave of
workgroups with chains of ``per`` takes about as long as the per-phase kernels' one phase,
against four phases in series before. The partials of all split phases share one
scratch (phase by phase), summed by one dispatch whose workgroups branch on phase as well
(``gemm.sum_lines``). Under ``gemm.force_plan`` the forced tiling, prefetch and deep mode
hold for every phase, ``splits`` splits each phase as ``plan_gemm`` would (so results are
bit-identical with the per-phase kernels', ``MERGE_PHASES = False``), ``target_groups``
replaces ``TARGET_GROUPS`` above.

Each output element is the same sum in the same K order as in the per-phase kernel of the
same plan; with equal plans the bits are equal. Lowered on GPU adapters only
(``lowering.MERGE_PHASES``: a CPU adapter runs the phases apart, faster there).
"""

from __future__ import annotations

from ....dtypes import DType
from ...kernel import KernelSource
from ..core.builder import KernelBuilder, indent
from ..core.literals import u
from . import gemm as gm
from . import plan as cp
from .gemm import Gemm, Operand, Output, Plan
from .stage import THREADS

# The shortest K chunk of a split phase (None: ``gemm.MIN_SPLIT_K``, 256); a knob for the sweep
# (``bench/conv_sweep.py``'s ``chunk64`` variant sets 64). Only small problems reach it (work /
# TARGET_GROUPS under 256). H200 sweep of 2026-12-03 (third session), us, merged phases at the
# 256 floor -> at 64: U-Net small b2 3x3 stride 2 64 -> 64 25.5 -> 23.1, 128 -> 128 33.3 -> 22.2;
# ResNet-50 b4 within 1.6% either way (l2 3x3 79.2 -> 80.4, l3 downsample 63.2 -> 62.2). So 64.
MIN_CHUNK: int | None = 64


def phase_plans(gs: list[Gemm], limits) -> list[Plan]:
    """One plan per phase GEMM of ``gs`` (same M and groups; K may be 0), sharing a tiling
    (see the module docstring)."""
    f = cp._forced[-1] if cp._forced else {}
    big = max(gs, key=lambda g: (g.k, g.n))
    base = cp.plan_gemm(big, limits)
    t = base.tiling
    if f.get("splits") is not None or limits.cpu:
        plans = []
        # as ``plan_gemm`` splits each phase (never on a CPU adapter), the scratch cap shared
        share = max(1, sum(1 for g in gs if g.k))
        for g in gs:
            cap = 1 if limits.cpu else min(f["splits"], cp.MAX_SPLITS)
            cap = min(cap, cp._scratch_cap(g, limits) // share)
            splits, per = cp._chunks(g, t, max(1, cap)) if g.k else (1, t.bk)
            plans.append(Plan(t, splits, per, base.prefetch and g.k > 0, base.deep and g.k > 0))
        return plans
    target = f.get("target") or cp.TARGET_GROUPS
    splits = _phase_splits(gs, t, target, limits)
    plans = []
    for g, s in zip(gs, splits, strict=True):
        n, per = cp._chunks(g, t, s) if g.k else (1, t.bk)
        plans.append(Plan(t, n, per, base.prefetch and g.k > 0, base.deep and g.k > 0))
    return plans


def _phase_splits(gs: list[Gemm], t: cp.Tiling, target: int, limits) -> list[int]:
    """Chunks per phase for one common chunk length aiming at ``target`` workgroups in all,
    halving the count while the partials exceed ``MAX_SCRATCH`` or a storage binding."""
    # the tiles of K = 0 phases only store zeros: they do not count as filling the GPU
    tiles = [-(-g.m // t.bm) * -(-g.n // t.bn) * g.groups if g.k else 0 for g in gs]
    if sum(tiles) >= target:
        return [1] * len(gs)
    work = sum(n * g.k for n, g in zip(tiles, gs, strict=True))
    least = MIN_CHUNK or cp.MIN_SPLIT_K
    per = max(least, -(-work // target))
    cap = min(cp.MAX_SCRATCH, limits.max_storage_buffer_binding_size) // 4
    while True:
        splits = [
            1 if g.k < 2 * least else max(1, min(-(-g.k // per), g.k // least, cp.MAX_SPLITS))
            for g in gs
        ]
        scratch = sum(s * g.m * g.n * g.groups for s, g in zip(splits, gs, strict=True) if s > 1)
        if scratch <= cap or max(splits) == 1:
            return splits
        per *= 2


def _branches(parts: list[tuple[int, list[str]]]) -> list[str]:
    """``if``/``else if`` over the contiguous workgroup ranges of ``parts`` ((workgroups,
    body statements using ``wg`` numbered from 0) each), the last one ``else``."""
    lines, start = ["  let wg_all = wg;"], 0
    for i, (count, body) in enumerate(parts):
        if i == len(parts) - 1:
            head = "  else {" if i else "  {"
        else:
            head = f"  {'if' if i == 0 else 'else if'} (wg_all < {u(start + count)}) {{"
        lines += [head, f"    let wg = wg_all - {u(start)};" if start else "    let wg = wg_all;"]
        lines += [indent(s) for s in body if s]
        lines.append("  }")
        start += count
    return lines


def emit_phases(
    kb: KernelBuilder, gemms: list[tuple[Gemm, Operand, Operand, Output]]
) -> list[KernelSource]:
    """The dispatch computing every phase GEMM of ``gemms`` (operands bound in ``kb``, K = 0
    for phases no tap reaches), and the one summing the split phases' partials if any.
    Kernel names end in ``gemm phases`` and ``sum_splits phases``.

    Raises:
        ValueError: when one buffer of the tile exceeds the adapter's workgroup memory.
    """
    plans = phase_plans([g for g, *_ in gemms], kb.limits)
    # longest K chains first (the GPU starts workgroups about in id order), zero phases last
    order = sorted(range(len(gemms)), key=lambda i: -min(plans[i].per, gemms[i][0].k))
    gemms, plans = [gemms[i] for i in order], [plans[i] for i in order]
    gs = [g for g, *_ in gemms]
    t, prefetch = plans[0].tiling, any(p.prefetch for p in plans)
    for names in cp._record:
        names += [(kb.node.op, f"merged:{p.name}") for g, p in zip(gs, plans, strict=True) if g.k]
    for rows in cp._choices:  # Program.meta["convs"]: each phase GEMM, source "merged"
        rows += [
            {
                "node": kb.node.id,
                "op": kb.node.op,
                "m": g.m,
                "n": g.n,
                "k": g.k,
                "groups": g.groups,
                "plan": p.name,
                "source": "merged",
            }  # fmt: skip
            for g, p in zip(gs, plans, strict=True)
            if g.k
        ]
    offsets, total = [], 0
    for g, p in zip(gs, plans, strict=True):
        offsets.append(total)
        total += p.splits * g.m * g.n * g.groups if p.splits > 1 else 0
    part = kb.scratch("partials", total, DType.f32, "partials") if total else None
    dst = kb.write(kb.node.id, "dx") if any(p.splits == 1 for p in plans) else None
    parts, slots = [], (0, 0)
    for (g, a, b, out), p, off in zip(gemms, plans, offsets, strict=True):
        target = part if p.splits > 1 else dst
        body, slots = gm.gemm_lines(g, a, b, out, p, kb, target, None, off)
        parts.append((gm.gemm_groups(g, p), body))
    gm.check_shared(t, prefetch, kb.limits)
    flops = sum(2 * g.m * g.n * g.k * g.groups for g in gs)
    groups = sum(n for n, _ in parts)
    helpers = gm.workgroup_tiles(slots, prefetch)
    main = kb.finish("gemm phases", "\n".join(_branches(parts)), THREADS, groups, helpers,
                     flops=flops)  # fmt: skip
    if not total:
        return [main]
    return [main, _sum_phases(kb, gemms, plans, offsets, total)]


def _sum_phases(kb0: KernelBuilder, gemms, plans: list[Plan], offsets, total: int):
    """One dispatch summing every split phase's partials into the output (``gm.sum_lines``
    per phase, each over its own workgroup range)."""
    kb = KernelBuilder(kb0.graph, kb0.node, kb0.limits)
    part = kb.scratch("partials", total, DType.f32, "partials")
    dst = kb.write(kb.node.id, "dx")
    parts, red, flops = [], False, 0
    for (g, _, _, out), p, off in zip(gemms, plans, offsets, strict=True):
        if p.splits > 1:
            body, lanes = gm.sum_lines(kb, g, out, p.splits, part, dst, None, off)
            parts.append((gm.sum_groups(g, p.splits), body.splitlines()))
            red = red or lanes > 1
            flops += p.splits * g.m * g.n * g.groups
    helpers = f"var<workgroup> red: array<f32, {THREADS}>;\n" if red else ""
    groups = sum(n for n, _ in parts)
    body = "\n".join(_branches(parts))
    return kb.finish("sum_splits phases", body, THREADS, groups, helpers, flops=flops)
