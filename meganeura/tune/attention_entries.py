"""The tuning cache's ``attention`` table: keys and entries of flash-attention lane plans.

A key is a lane kernel's mode and problem sizes, ``(mode, b, hkv, group, lq, lk, d, dv)``
(``codegen.wgsl.attention.plan``'s ``LANE_MODES`` and ``Dims`` fields in order), written
``"fwd,1,3,3,128,128,64,64"`` in the file; ``fwd`` also covers the forward that stores its
log-sum-exp, ``dq`` the query gradient that computes its rows' delta (one mode, one plan, as
in ``LANE_OVERRIDE``). A plan is ``(rows, lanes, tile)``, written ``"8x16x32"``. Whether the
adapter can run a plan (``plan.check_plan``) is decided at compile time, not here.
"""

from __future__ import annotations

import datetime
import numbers
from dataclasses import dataclass, field

# (mode, b, hkv, group, lq, lk, d, dv)
AttentionKey = tuple[str, int, int, int, int, int, int, int]
KEY_FIELDS = ("b", "hkv", "group", "lq", "lk", "d", "dv")


def _lane_modes() -> tuple[str, ...]:
    from ..codegen.wgsl.attention.plan import LANE_MODES

    return LANE_MODES


def format_attention_key(key: AttentionKey) -> str:
    """``("fwd", 1, 3, 3, 128, 128, 64, 64)`` -> ``"fwd,1,3,3,128,128,64,64"``."""
    return ",".join(map(str, key))


def parse_attention_key(text: str) -> AttentionKey:
    """``"mode,b,hkv,group,lq,lk,d,dv"`` -> an attention key.

    Raises:
        ValueError: not eight fields, a mode outside the lane modes (fwd, stats, lse, dq, dk,
            dv, dkv), a size that is not an integer or is < 1.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 8:
        raise ValueError(
            f"an attention key is mode,{','.join(KEY_FIELDS)} (8 fields), got {text!r}"
        )
    mode, *sizes = parts
    modes = _lane_modes()
    if mode not in modes:
        raise ValueError(f"mode must be one of {', '.join(modes)}, got {mode!r} in {text!r}")
    try:
        dims = [int(s) for s in sizes]
    except ValueError:
        raise ValueError(f"{', '.join(KEY_FIELDS)} must be integers in {text!r}") from None
    if min(dims) < 1:
        raise ValueError(f"{', '.join(KEY_FIELDS)} must be >= 1 in {text!r}")
    return (mode, *dims)  # type: ignore[return-value]


def format_lane_plan(plan) -> str:
    """``(8, 16, 32)`` (or a ``plan.Plan``) -> ``"8x16x32"``."""
    rows, lanes, tile = (plan.rows, plan.lanes, plan.tile) if hasattr(plan, "rows") else plan
    return f"{rows}x{lanes}x{tile}"


def parse_lane_plan(text: str) -> tuple[int, int, int]:
    """``"ROWSxLANESxTILE"`` -> ``(rows, lanes, tile)``.

    Raises:
        ValueError: not three positive integers joined by ``x``.
    """
    parts = str(text).split("x")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"a lane plan is ROWSxLANESxTILE with positive integers, got {text!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class PlanEntry:
    """One measured plan of a tuning cache table (``cache.MatmulEntry``, ``AttentionEntry``).

    Attributes:
        plan: the plan to use, in its kernel's plan grammar.
        gpu_us: its time, microseconds (median of the repeats).
        default_plan: the plan chosen without the cache when it was measured.
        heuristic_us: that plan's time, microseconds.
        timing: ``"timestamps"`` (GPU time from timestamp queries) or ``"wall"`` (host clock
            around synchronized runs, where the device has no timestamp queries).
        measured: ISO date of the measurement.
    """

    plan: str
    gpu_us: float
    default_plan: str
    heuristic_us: float
    timing: str = "timestamps"
    measured: str = field(default_factory=lambda: datetime.date.today().isoformat())

    @property
    def gain(self) -> float:
        """``heuristic_us / gpu_us``: how much faster than the default."""
        return self.heuristic_us / self.gpu_us if self.gpu_us > 0 else 1.0


@dataclass(frozen=True)
class AttentionEntry(PlanEntry):
    """One tuned lane kernel: a ``PlanEntry`` whose plans are ``"ROWSxLANESxTILE"``
    (``parse_lane_plan``), the default the automatic rule's.

    Raises:
        ValueError: a plan or default plan ``parse_lane_plan`` refuses, or a time that is not
            a positive number.
    """

    def __post_init__(self):
        parse_lane_plan(self.plan)
        parse_lane_plan(self.default_plan)
        for name in ("gpu_us", "heuristic_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
                raise ValueError(f"{name} must be a positive number of microseconds, got {value!r}")
