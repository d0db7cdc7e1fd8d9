"""Per-device tuning: matmul plans measured on the adapter at hand, kept for the next run.

``tune_matmuls`` times the candidate plans of a Program's products (or of given shapes) on a
device and records the winners in that device's file of the tuning cache (``cache``);
``training.device_limits`` loads them into ``Limits.matmul_plans``, which ``choose_plan``
reads ahead of the CPU plan and the static table. The same file may hold an ``attention`` table
of flash-attention lane plans (``bench/attention_plans.py --record``), loaded into
``Limits.attention_plans`` and read by ``attention.plan.choose_plan``. ``models`` compiles the
built-in models (the paper's workloads at their benchmark sizes) whose products ``meganeura tune
MODEL`` and ``--workloads`` tune. ``meganeura tune`` is the command line; docs/tuning.md the
user's guide.
"""

from .cache import (
    AttentionEntry,
    DeviceKey,
    MatmulEntry,
    TuningCache,
    TuningCacheWarning,
    cache_dir,
    cache_path,
    clear,
    default_cache_dir,
    device_key,
    load,
    parse_shape,
    save,
    set_cache_dir,
)
from .matmul import (
    MIN_GAIN,
    PLAN_SECONDS,
    ShapeResult,
    TuneReport,
    candidates,
    estimate_seconds,
    shapes_of,
    tune_matmuls,
)

__all__ = [
    "MIN_GAIN",
    "PLAN_SECONDS",
    "AttentionEntry",
    "DeviceKey",
    "MatmulEntry",
    "ShapeResult",
    "TuneReport",
    "TuningCache",
    "TuningCacheWarning",
    "cache_dir",
    "cache_path",
    "candidates",
    "clear",
    "default_cache_dir",
    "device_key",
    "estimate_seconds",
    "load",
    "parse_shape",
    "save",
    "set_cache_dir",
    "shapes_of",
    "tune_matmuls",
]
