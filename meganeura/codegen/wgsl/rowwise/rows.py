"""Row-parallel reduction scaffolding shared by reductions, softmax and cross-entropy.

A "row" is one group of elements reduced together (a reduction's group, a softmax row). A
``RowPlan`` assigns ``ox`` rows to each workgroup, on consecutive lanes, and ``ry`` threads to
each row; workgroup size is ``ox * ry``. Thread ``lid`` handles row lane ``x = lid % ox`` and
element slice ``y = lid / ox`` (elements y, y + ry, ...), then the ``ry`` partial results of a
row are combined pairwise in workgroup memory. Three shapes cover the cases:
  * contiguous rows of >= 64 elements: one workgroup per row (``ox = 1``), coalesced along it;
  * strided rows (reduced dim not innermost): 32 neighbouring rows per workgroup, so each load
    instruction reads 32 neighbouring addresses (``narrowed``: long strided rows too few to
    fill ``STRIDED_TARGET_GROUPS`` workgroups that way take fewer, down to 8, and more threads
    each, for kernels that do not split rows into chunks);
  * short rows (< 64 elements): one thread per row, no workgroup memory.
Threads whose row lies past the end still run every barrier (barriers must stay in uniform
control flow); they read a clamped, valid row and never store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.builder import indent
from ..core.layout import WG, next_pow2
from ..core.literals import u

SHORT_ROW = 64  # below this a row is summed serially by one thread
UNROLL = 4  # loads in flight per thread in reduction loops
BLOCK = 16  # elements per partial sum when a thread sums many
STRIDED_LANES = 32
# Long strided rows, few of them (a layer norm's weight gradient: 384 channels x 1500 rows took
# 27 us a channel sum on the H200 in 12 workgroups of 32 channels x 8 threads): ``narrowed``
# gives fewer rows per workgroup, down to STRIDED_MIN_LANES (8 rows: 32-byte runs, a full
# memory sector), and more threads per row, until STRIDED_TARGET_GROUPS workgroups.
# NARROW_STRIDED: the bench A/B switch (``set_narrow_strided``; lever narrow_strided_rows),
# never changed by the compiler.
STRIDED_MIN_LANES = 8
STRIDED_LONG_ROW = 512  # elements a strided row has before it narrows
STRIDED_TARGET_GROUPS = 64
NARROW_STRIDED = [True]


def set_narrow_strided(on: bool) -> None:
    """Let ``narrowed`` give long strided rows fewer rows per workgroup (on, the default) or
    leave plans as they are (off), for programs compiled from now on."""
    NARROW_STRIDED[:] = [bool(on)]


@dataclass(frozen=True)
class RowPlan:
    """``ox`` rows per workgroup, ``ry`` threads per row."""

    ox: int
    ry: int

    @property
    def size(self) -> int:
        return self.ox * self.ry


def plan_rows(n_rows: int, row_len: int, contiguous: bool) -> RowPlan:
    """Pick the workgroup shape for ``n_rows`` rows of ``row_len`` elements each.

    Args:
        contiguous: whether consecutive elements of a row are adjacent in memory.
    """
    if row_len < SHORT_ROW:
        return RowPlan(min(WG, max(32, next_pow2(n_rows))), 1)
    if contiguous:
        return RowPlan(1, min(WG, next_pow2(row_len)))
    ox = min(STRIDED_LANES, next_pow2(n_rows))
    return RowPlan(ox, WG // ox)


def narrowed(plan: RowPlan, n_rows: int, row_len: int) -> RowPlan:
    """``plan`` (strided rows, from ``plan_rows``) with fewer rows per workgroup, down to
    ``STRIDED_MIN_LANES``, while fewer than ``STRIDED_TARGET_GROUPS`` workgroups cover the
    ``n_rows`` rows, for rows of at least ``STRIDED_LONG_ROW`` elements; else ``plan``. For
    kernels that sum each row in one workgroup (no split into chunks): the norms' channel
    sums."""
    ox = plan.ox
    if NARROW_STRIDED[0] and plan.ry > 1 and row_len >= STRIDED_LONG_ROW:
        while ox > STRIDED_MIN_LANES and -(-n_rows // ox) < STRIDED_TARGET_GROUPS:
            ox //= 2
    return RowPlan(ox, WG // ox) if ox != plan.ox else plan


def thread_coords(plan: RowPlan, row_group: str, n_rows: int) -> str:
    """Statements defining ``x``, ``y``, ``row`` (may be past the end), ``live`` and
    ``rowc`` (the row clamped into range, safe to read)."""
    x = "0u" if plan.ox == 1 else f"lid % {u(plan.ox)}"
    y = "lid" if plan.ox == 1 else f"lid / {u(plan.ox)}"
    if plan.ry == 1:
        y = "0u"
    return (
        f"  let x = {x};\n  let y = {y};\n"
        f"  let row = {row_group} * {u(plan.ox)} + x;\n"
        f"  let live = row < {u(n_rows)};\n"
        f"  let rowc = min(row, {u(n_rows - 1)});\n"
    )


def strided_loop(
    plan: RowPlan,
    begin: str,
    end: str,
    value: Callable[[str], str],
    combine: Callable[[str, str], str],
    per_thread: int,
    zero: str | None = None,
    acc: str = "acc",
    branch: bool = False,
) -> str:
    """Fold this thread's elements ``begin + y, begin + y + ry, ... < end`` into ``acc``.

    Loads come ``UNROLL`` at a time (indices clamped into range, so always valid), before
    they are combined, so several memory requests are in flight per thread; out-of-range
    ones are then dropped by a select.

    Args:
        value: WGSL expression of the element at a given index expression.
        combine: how two partial results combine (``a + b``, ``max(a, b)``).
        per_thread: the most elements one thread sees (decides unrolling and blocking).
        zero: the additive identity; when given and a thread sees many elements, they are
            summed in blocks of ``BLOCK`` into a fresh partial first, so the rounding error of
            the running sum grows with count / BLOCK rather than count (f32 accuracy for
            groups of millions). Leave None for idempotent combines (max).
        acc: the accumulator variable, declared by the caller.
        branch: drop out-of-range loads with an ``if`` rather than ``select`` (needed for
            struct accumulators, which ``select`` cannot pick between).
    """
    ry = plan.ry
    if per_thread <= 2:
        return (
            f"  for (var r = {begin} + y; r < {end}; r = r + {u(ry)}) {{\n"
            f"    {acc} = {combine(acc, value('r'))};\n  }}\n"
        )

    def unrolled(target: str, first: str, pad: str) -> str:
        lines = [f"{pad}let r{k} = {first} + {u(k * ry)};" for k in range(UNROLL)]
        lines += [f"{pad}let e{k} = {value(f'min(r{k}, {end} - 1u)')};" for k in range(UNROLL)]
        if branch:
            lines += [
                f"{pad}if (r{k} < {end}) {{ {target} = {combine(target, f'e{k}')}; }}"
                for k in range(UNROLL)
            ]
        else:
            lines += [
                f"{pad}{target} = select({target}, {combine(target, f'e{k}')}, r{k} < {end});"
                for k in range(UNROLL)
            ]
        return "\n".join(lines) + "\n"

    step = u(UNROLL * ry)
    if zero is None or per_thread <= SHORT_ROW:
        return (
            f"  for (var q = {begin} + y; q < {end}; q = q + {step}) {{\n"
            f"{unrolled(acc, 'q', '    ')}  }}\n"
        )
    return (
        f"  for (var q0 = {begin} + y; q0 < {end}; q0 = q0 + {u(BLOCK * ry)}) {{\n"
        f"    var part = {zero};\n"
        f"    for (var q = q0; q < min(q0 + {u(BLOCK * ry)}, {end}); q = q + {step}) {{\n"
        f"{unrolled('part', 'q', '      ')}    }}\n"
        f"    {acc} = {acc} + part;\n"
        f"  }}\n"
    )


def for_each(plan: RowPlan, begin: str, end: str, body: str) -> str:
    """Run ``body`` for each of this thread's elements ``r`` (no accumulation), ``UNROLL``
    elements per loop trip so their loads can be issued together."""
    ry = plan.ry
    lines = [f"  for (var q = {begin} + y; q < {end}; q = q + {u(UNROLL * ry)}) {{"]
    for k in range(UNROLL):
        r = "q" if k == 0 else f"q + {u(k * ry)}"
        lines.append(f"    {{\n      let r = {r};\n      if (r < {end}) {{")
        lines.append(indent(body, 4).rstrip("\n") + "\n      }\n    }")
    return "\n".join(lines) + "\n  }\n"


def tree(
    plan: RowPlan, shared: str, value: str, combine: Callable[[str, str], str], result: str
) -> str:
    """Combine the ``ry`` per-thread values of each row pairwise; every thread of the row gets
    the total in ``result``. Ends with a barrier so ``shared`` can be reused at once."""
    if plan.ry == 1:
        return f"  let {result} = {value};\n"
    lines = [f"  {shared}[lid] = {value};", "  workgroupBarrier();"]
    s = plan.ry // 2
    while s >= 1:
        other = f"{shared}[lid + {u(s * plan.ox)}]"
        lines.append(f"  if (y < {u(s)}) {{ {shared}[lid] = {combine(f'{shared}[lid]', other)}; }}")
        lines.append("  workgroupBarrier();")
        s //= 2
    lines += [f"  let {result} = {shared}[x];", "  workgroupBarrier();"]
    return "\n".join(lines) + "\n"


def shared_decl(plan: RowPlan, name: str, ty: str) -> str:
    """Module-scope workgroup array for ``tree`` (empty when rows need no tree)."""
    if plan.ry == 1:
        return ""
    return f"var<workgroup> {name}: array<{ty}, {plan.size}>;\n"
