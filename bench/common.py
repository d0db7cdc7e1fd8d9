"""Shared helpers for benchmarks: timing, machine description, result files.

Every benchmark times meganeura and PyTorch in the same process, reports the median (and
min) of at least ``repeats`` timed runs after warm-up with a device sync around each, and
writes ``bench/results/<name>.json`` as
``{"machine", "versions", "results": [{"case", "metric", "ours", "torch", "speedup"}]}``
where ``speedup > 1`` means meganeura is faster (torch/ours for times).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def timeit(
    fn: Callable[[], None], sync: Callable[[], None], warmup: int = 5, repeats: int = 20
) -> dict:
    """Median and min wall time of ``fn`` in milliseconds, synced before and after each run."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return {"median": statistics.median(times), "min": min(times), "n": repeats}


def machine(device) -> dict:
    import torch

    info = {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "adapter": device.name,
    }
    if torch.cuda.is_available():
        info["torch_device"] = torch.cuda.get_device_name(0)
    else:
        info["torch_device"] = "cpu"
    return info


def versions() -> dict:
    import numpy
    import torch
    import wgpu

    import meganeura

    return {
        "meganeura": meganeura.__version__,
        "wgpu": wgpu.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def write(name: str, device, results: list[dict], extra: dict | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {"machine": machine(device), "versions": versions(), "results": results, **(extra or {})}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
