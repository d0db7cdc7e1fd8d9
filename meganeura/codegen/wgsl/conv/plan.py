"""Conv GEMM plans: the tiling, split-K and prefetch of each implicit GEMM (``gemm.py``).

``plan_gemm`` picks them per GEMM, in this order (``plan_source``): ``force_plan`` (sweeps,
``bench/conv_sweep.py``, and tests) overrides the rules; on a GPU adapter the plan measured
best on the H200 for this (kind of op, m, n, k, groups), ``tuned.TUNED``; else the rules
(``choose_tiling``, ``plan_splits``, ``PREFETCH``, ``DEEP``), which also cover CPU adapters.
``record_plans`` lists what was picked, ``record_choices`` that with the GEMM sizes and the
source (``Program.meta["convs"]``).

Tilings: 64x64 (16x16 threads, 4x4 outputs each), 128x128 (8x8 each) when there are enough
such tiles to fill a large GPU, and 16x256 (4x64 threads) when M <= 16 (depthwise and
few-channel convolutions). Split-K: when the M x N tiles are too few to fill a GPU and K is
long, K is cut into ``splits`` chunks of whole K steps (``plan_splits``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..matmul.plan import LARGE_MIN_TILES
from .tuned import KIND, TUNED

# Split K while fewer workgroups than this would run, keeping at least MIN_SPLIT_K of K
# (a multiple of the K step) per chunk and the partials within MAX_SCRATCH bytes.
TARGET_GROUPS = 264
MIN_SPLIT_K = 256
MAX_SPLITS = 128
MAX_SCRATCH = 64 << 20


@dataclass(frozen=True)
class Tiling:
    """``ty x tx`` threads (256), each computing ``tm x tn`` outputs (multiples of 4);
    K advances by ``bk``."""

    ty: int
    tx: int
    tm: int
    tn: int
    bk: int

    @property
    def bm(self) -> int:
        return self.ty * self.tm

    @property
    def bn(self) -> int:
        return self.tx * self.tn


@dataclass(frozen=True)
class Gemm:
    """Sizes of the product: ``groups`` independent [m, k] @ [k, n]."""

    m: int
    n: int
    k: int
    groups: int


SMALL = Tiling(16, 16, 4, 4, 16)
LARGE = Tiling(16, 16, 8, 8, 8)
NARROW = Tiling(4, 64, 4, 4, 8)
TILINGS = {"small": SMALL, "large": LARGE, "narrow": NARROW}


def choose_tiling(g: Gemm, cpu: bool = False) -> Tiling:
    """128x128 tiles only when there are enough of them to keep a large GPU busy (the matmul
    measurement), or on a CPU adapter (``Limits.cpu``, where the work counts, not filling a
    GPU: ``matmul.plan.cpu_plan``) whenever M and N reach 128; 16-row tiles when M <= 16."""
    if g.m <= NARROW.bm:
        return NARROW
    tiles = -(-g.m // LARGE.bm) * -(-g.n // LARGE.bn) * g.groups
    enough = cpu or tiles >= LARGE_MIN_TILES
    return LARGE if g.m >= 128 and g.n >= 128 and enough else SMALL


def plan_splits(g: Gemm, t: Tiling, limits, target_groups: int | None = None) -> tuple[int, int]:
    """(splits, K per split, a multiple of ``t.bk``); never split on a CPU adapter
    (``Limits.cpu``: the partials and second dispatch are pure overhead there).
    ``target_groups``: aim at this many workgroups instead of ``TARGET_GROUPS``."""
    if g.k == 0:
        return 1, t.bk
    target = TARGET_GROUPS if target_groups is None else target_groups
    tiles = -(-g.m // t.bm) * -(-g.n // t.bn) * g.groups
    splits = 1
    if tiles < target and g.k >= 2 * MIN_SPLIT_K and not limits.cpu:
        splits = min(-(-target // tiles), g.k // MIN_SPLIT_K, MAX_SPLITS)
        splits = max(1, min(splits, _scratch_cap(g, limits)))
    return _chunks(g, t, splits)


def _scratch_cap(g: Gemm, limits) -> int:
    """The most splits whose partials fit MAX_SCRATCH and one storage binding."""
    numel = max(g.m * g.n * g.groups, 1)
    return min(MAX_SCRATCH, limits.max_storage_buffer_binding_size) // (4 * numel)


def _chunks(g: Gemm, t: Tiling, splits: int) -> tuple[int, int]:
    """(splits, K per split) for about ``splits`` chunks of whole K steps, none empty."""
    per = -(-max(g.k, 1) // max(splits, 1))
    per = -(-per // t.bk) * t.bk
    return -(-max(g.k, 1) // per), per


def shared_bytes(t: Tiling, prefetch: bool) -> int:
    """Workgroup memory of the GEMM kernel: one ``bk``-deep tile of each operand (two with
    prefetch)."""
    return (2 if prefetch else 1) * 4 * t.bk * (t.bm + t.bn)


@dataclass(frozen=True)
class Plan:
    """How one implicit GEMM runs: tiling, split-K (``splits`` chunks of ``per`` of K),
    register prefetch with double-buffered workgroup tiles, two-deep (``deep``) or not
    (``stage.k_loop``)."""

    tiling: Tiling
    splits: int
    per: int
    prefetch: bool
    deep: bool = False

    @property
    def name(self) -> str:
        """``"64x64x16/s4/pf"``: tile, splits (when > 1), ``pf`` (prefetch), ``d2`` (two-deep
        prefetch) or ``np`` (none)."""
        t = self.tiling
        split = f"/s{self.splits}" if self.splits > 1 else ""
        mode = ("d2" if self.deep else "pf") if self.prefetch else "np"
        return f"{t.bm}x{t.bn}x{t.bk}{split}/{mode}"


def parse_plan(name: str, g: Gemm) -> Plan:
    """The plan named ``name`` (``Plan.name``'s grammar: ``"64x64x16/s4/d2"``, ``"128x128x8/pf"``,
    ``"16x256x8/np"``) for GEMM ``g``: K cut into about ``splits`` chunks of whole K steps
    (``_chunks``; the name a plan gives round-trips).

    Raises:
        ValueError: for a name outside that grammar or a tile not in ``TILINGS``.
    """
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:/s(\d+))?/(pf|np|d2)", name)
    if m is None:
        raise ValueError(f"bad conv GEMM plan name {name!r}; expected e.g. '64x64x16/s4/d2'")
    bm, bn, bk = (int(v) for v in m.group(1, 2, 3))
    tiles = [t for t in TILINGS.values() if (t.bm, t.bn, t.bk) == (bm, bn, bk)]
    if not tiles:
        known = sorted(f"{t.bm}x{t.bn}x{t.bk}" for t in TILINGS.values())
        raise ValueError(f"unknown conv GEMM tile in {name!r}; known: {known}")
    splits, per = _chunks(g, tiles[0], int(m.group(4) or 1)) if g.k else (1, tiles[0].bk)
    return Plan(tiles[0], splits, per, m.group(5) != "np", m.group(5) == "d2")


# Register prefetch of the next K step (``stage.k_loop``) on GPU adapters; never on a CPU
# adapter (``Limits.cpu``: a second workgroup buffer and more live registers buy nothing there,
# as ``matmul.plan.cpu_plan`` found), nor where the doubled tiles exceed workgroup memory.
# Two register sets (``stage._deep_loop``) where prefetch runs. The H200 sweep (2026-12-03,
# ``bench/conv_sweep.py``, bench/results/conv_sweep_h200.json: ResNet-50 b4 and the U-Net
# small b2, forward / grad-input / grad-weight of 40 shapes, the default plans' tilings and
# splits): one-deep prefetch beat none in 104 of 117 products, two-deep beat one-deep in 93;
# weighted network conv time, U-Net 2.222 ms without prefetch, 2.133 one-deep, 2.091 two-deep.
PREFETCH = True
DEEP = True  # not for LARGE tiles: ``plan_gemm``

_forced: list[dict] = []
_record: list[list[tuple[str, str]]] = []
_choices: list[list[dict]] = []


@contextmanager
def force_plan(
    tiling: Tiling | str | None = None,
    prefetch: bool | None = None,
    splits: int | None = None,
    target_groups: int | None = None,
    deep: bool | None = None,
) -> Iterator[None]:
    """Within the block, every conv GEMM lowered uses the given tiling / prefetch / split-K
    (None: the default choice). For benchmark sweeps and tests. ``splits``: that many chunks
    (1: no split-K; rounded to whole K steps, so possibly fewer); ``target_groups``: the
    default split rule aiming at that many workgroups; ``deep``: two-deep prefetch (where
    prefetch runs). Prefetch that does not fit the
    adapter's workgroup memory still falls back to one buffer (``plan_gemm``).

    ``tiling`` may be named: ``"small"``, ``"large"``, ``"narrow"``.

    Raises:
        ValueError: a tiling that is not SMALL, LARGE or NARROW, splits < 1, or both
            ``splits`` and ``target_groups``.
    """
    if isinstance(tiling, str):
        if tiling not in TILINGS:
            raise ValueError(f"conv tiling must be one of {sorted(TILINGS)}, got {tiling!r}")
        tiling = TILINGS[tiling]
    if tiling is not None and tiling not in TILINGS.values():
        raise ValueError(f"conv tiling must be SMALL, LARGE or NARROW, got {tiling}")
    if splits is not None and splits < 1:
        raise ValueError(f"conv force_plan splits must be >= 1, got {splits}")
    if splits is not None and target_groups is not None:
        raise ValueError("conv force_plan takes splits or target_groups, not both")
    _forced.append(
        dict(tiling=tiling, prefetch=prefetch, splits=splits, target=target_groups, deep=deep)
    )
    try:
        yield
    finally:
        _forced.pop()


@contextmanager
def record_plans() -> Iterator[list[tuple[str, str]]]:
    """Within the block, (op, plan name) of every conv GEMM lowered, in order."""
    names: list[tuple[str, str]] = []
    _record.append(names)
    try:
        yield names
    finally:
        _record[:] = [r for r in _record if r is not names]


@contextmanager
def record_choices() -> Iterator[list[dict]]:
    """Within the block, every conv GEMM lowered, in order: ``{"node", "op", "m", "n", "k",
    "groups", "plan", "source"}`` (``source`` as ``plan_source`` gives it, or ``"merged"``
    for the phases of a merged strided input gradient, ``phases.py``)."""
    rows: list[dict] = []
    _choices.append(rows)
    try:
        yield rows
    finally:
        _choices[:] = [r for r in _choices if r is not rows]


# Where a plan came from (``plan_source``; "merged": a stride phase of a strided input
# gradient, planned with the other phases by ``phases.phase_plans``).
SOURCES = ("forced", "tuned", "cpu", "heuristic", "merged")


def plan_gemm(g: Gemm, limits, op: str | None = None) -> Plan:
    """The plan of one GEMM of op ``op`` (``"conv2d"``, ``"conv2d_backward_input"``,
    ``"conv2d_backward_weight"``; None: no table look-up), from ``plan_source``."""
    return plan_source(g, limits, op)[0]


def plan_source(g: Gemm, limits, op: str | None = None) -> tuple[Plan, str]:
    """``plan_gemm``'s plan and its source, one of ``SOURCES``. Without an enclosing
    ``force_plan``, on a GPU adapter, ``tuned.TUNED[(KIND[op], m, n, k, groups)]`` when it has the
    GEMM (prefetch dropped where the doubled tiles exceed workgroup memory, splits capped by
    the scratch limit, as the rules do; a tile that does not fit at all is passed over);
    otherwise ``choose_tiling``, ``plan_splits``, ``PREFETCH`` and ``DEEP``, each overridden
    by an enclosing ``force_plan`` (which the table yields to: sweeps force against the
    rules)."""
    key = (KIND.get(op), g.m, g.n, g.k, g.groups)
    name = None if _forced or limits.cpu else TUNED.get(key)
    p = None if name is None else parse_plan(name, g)
    room = limits.max_workgroup_storage_size
    if p is not None and shared_bytes(p.tiling, False) <= room:
        splits, per = _chunks(g, p.tiling, min(p.splits, max(1, _scratch_cap(g, limits))))
        pf = p.prefetch and g.k > 0 and shared_bytes(p.tiling, True) <= room
        return Plan(p.tiling, splits, per, pf, pf and p.deep), "tuned"
    source = "forced" if _forced else "cpu" if limits.cpu else "heuristic"
    return _rule_plan(g, limits), source


def _rule_plan(g: Gemm, limits) -> Plan:
    """``choose_tiling``, ``plan_splits``, ``PREFETCH`` and ``DEEP``, each overridden by an
    enclosing ``force_plan``."""
    f = _forced[-1] if _forced else {}
    t = f.get("tiling") or choose_tiling(g, limits.cpu)
    if f.get("splits") is not None:
        cap = max(1, min(f["splits"], MAX_SPLITS, _scratch_cap(g, limits)))
        splits, per = _chunks(g, t, cap) if g.k else (1, t.bk)
    else:
        splits, per = plan_splits(g, t, limits, f.get("target"))
    pf = f.get("prefetch")
    prefetch = (PREFETCH and not limits.cpu) if pf is None else pf
    # the prefetch loop gathers its first K step unconditionally: K must not be empty
    prefetch = prefetch and g.k > 0
    if shared_bytes(t, prefetch) > limits.max_workgroup_storage_size:
        prefetch = False
    # two-deep where the sweep timed it (the 64x64 and 16x256 tiles; 128x128 keeps 64
    # accumulators a thread and was not tried with a second register set)
    deep = (DEEP and t != LARGE) if f.get("deep") is None else f["deep"]
    return Plan(t, splits, per, prefetch, prefetch and deep)
