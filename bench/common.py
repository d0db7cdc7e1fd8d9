"""Shared helpers for benchmarks: timing, machine description, result files.

Every benchmark times meganeura and PyTorch in the same process, reports the median (and
min) of at least ``repeats`` timed runs after warm-up with a device sync around each, and
writes ``bench/results/<name>.json`` as
``{"machine", "versions", "results": [{"case", "metric", "ours", "torch", "speedup"}]}``
where ``speedup > 1`` means meganeura is faster (torch/ours for times, ours/torch for rates:
``metric`` "ms" is a time, "TFLOP/s" and "TB/s" are rates). Rows may carry extra keys
(``ours_min``, ``rel_err``, ...); ``bench/report.py`` shows the five above.

Kernel-level benchmarks (matmul, bandwidth, attention, conv) time our side on the GPU with
``Session.profile`` (timestamp queries; see :func:`profile_ms`) and PyTorch with CUDA events
(:func:`time_torch`); both exclude host uploads. ``--quick`` runs (tiny sizes, few repeats,
for a smoke test on lavapipe) write under ``bench/results/quick/`` instead, so they never
overwrite the GPU machine's results.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
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
        "driver": device.adapter.info.get("description", ""),
        "backend": device.adapter.info.get("backend_type", ""),
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


def write(
    name: str, device, results: list[dict], extra: dict | None = None, quick: bool = False
) -> Path:
    """Write ``bench/results/<name>.json`` (``bench/results/quick/<name>.json`` when quick)."""
    path = (RESULTS / "quick" if quick else RESULTS) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(device), "versions": versions(), "results": results, **(extra or {})}
    return write_json(path, doc, indent=2)


def write_json(path: Path, doc: dict, indent: int = 1) -> Path:
    """Write ``doc`` to ``path`` as JSON through a temporary name and a rename, so that an
    interrupted run never leaves a half-written result file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=indent) + "\n")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# Helpers for the kernel-level benchmarks (matmul, bandwidth, attention, conv, dispatch).


def add_args(ap, name: str, repeats: int = 10, warmup: int = 3) -> None:
    """The options every kernel benchmark takes: --quick, --repeats, --warmup, --out-name,
    --adapter, --warm-seconds."""
    import os

    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=None, help=f"timed runs (default {repeats})")
    ap.add_argument("--warmup", type=int, default=None, help=f"warm-up runs (default {warmup})")
    ap.add_argument("--out-name", default=name)
    ap.add_argument("--adapter", default=os.environ.get("MEGANEURA_ADAPTER"))
    ap.add_argument(
        "--warm-seconds", type=float, default=None, help="GPU warm-up before the first case"
    )
    ap.add_argument(
        "--runtime-checks",
        choices=("on", "off"),
        default=None,
        help="naga's runtime checks in shader modules (default: the library's, "
        "meganeura.runtime.pipelines.default_runtime_checks: off on Vulkan)",
    )
    ap.set_defaults(_default_repeats=repeats, _default_warmup=warmup)


def resolve_args(args) -> None:
    """Fill in defaults that depend on --quick (3 repeats / 1 warm-up / 0.2 s when quick)."""
    if args.repeats is None:
        args.repeats = 3 if args.quick else args._default_repeats
    if args.warmup is None:
        args.warmup = 1 if args.quick else args._default_warmup
    if args.warm_seconds is None:
        args.warm_seconds = 0.2 if args.quick else 3.0
    if getattr(args, "runtime_checks", None) is not None:
        from meganeura.runtime import pipelines

        pipelines.RUNTIME_CHECKS = args.runtime_checks == "on"


def stats(times_ms: list[float]) -> dict:
    return {"median": statistics.median(times_ms), "min": min(times_ms), "n": len(times_ms)}


def torch_setup():
    """Import torch in strict f32 (no TF32 in matmul or cuDNN); returns (torch, device str)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if not torch.cuda.is_available():
        # On the CPU sandbox, PyTorch's OpenMP threads contend with lavapipe's for two cores
        # (small matmuls took 16 ms instead of 10 us); one thread gives stable numbers.
        torch.set_num_threads(1)
        return torch, "cpu"
    return torch, "cuda"


def torch_sync(dev: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if dev == "cuda" else (lambda: None)


def time_torch(fn: Callable[[], object], dev: str, warmup: int = 3, repeats: int = 10) -> dict:
    """GPU time of ``fn`` in ms: CUDA events around each call on CUDA, wall time on the CPU.

    Each call is synced before and after. On CUDA a short ``torch.cuda._sleep`` is queued
    ahead of the start event, so the host's launch latency hides behind it and the events
    bracket the kernels alone (as ``Session.profile``'s timestamps do for ours).
    """
    import torch

    if dev != "cuda":
        return timeit(fn, lambda: None, warmup=warmup, repeats=repeats)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if sleep is not None:
            sleep(200_000)  # ~0.1 ms of GPU spin while the host launches what follows
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return stats(times)


@contextmanager
def kernels_apart():
    """Every kernel its own dispatch while inside (``meganeura.schedule.pack`` off, restored
    after): the per-kernel benchmarks time each kernel by its dispatch's name, which a packed
    dispatch would share with its neighbours."""
    from meganeura.schedule import pack

    was = pack.ENABLED
    pack.set_enabled(False)
    try:
        yield
    finally:
        pack.set_enabled(was)


def dispatch_op(name: str) -> str:
    """The op of a dispatch name: ``"%10 conv2d_backward_input gemm 0,0"`` -> the op token."""
    parts = name.split()
    if parts and parts[0].startswith("%") and len(parts) > 1:
        return parts[1]
    return parts[0] if parts else name


def profile_ms(
    session,
    feeds: dict,
    warmup: int = 3,
    repeats: int = 10,
    groups: dict[str, Callable[[str], bool]] | None = None,
) -> dict[str, dict]:
    """GPU time per step of ``session`` from ``Session.profile`` (timestamp queries), in ms.

    Inputs are uploaded once, before the warm-up; the profiled steps re-upload nothing.

    Args:
        groups: label -> predicate on the dispatch name; each label gets the per-step sum of
            the matching dispatches. Always includes ``"all"`` (every dispatch).

    Returns:
        {label: {"median", "min", "n"}}.
    """
    prof = session.profile(feeds, repeats=repeats, warmup=warmup)
    groups = {"all": lambda _n: True, **(groups or {})}
    sums = {label: [0.0] * prof.repeats for label in groups}
    for t in prof.timings:
        for label, pred in groups.items():
            if pred(t.name):
                sums[label][t.repeat] += t.duration_ns / 1e6
    return {label: stats(v) for label, v in sums.items()}


def result(case: str, metric: str, ours: float, theirs: float, **extra) -> dict:
    """One result row; ``speedup`` is torch/ours for times ("ms"), ours/torch for rates."""
    if metric == "ms":
        speedup = theirs / ours if ours > 0 else float("nan")
    else:
        speedup = ours / theirs if theirs > 0 else float("nan")
    return {
        "case": case,
        "metric": metric,
        "ours": ours,
        "torch": theirs,
        "speedup": speedup,
        **extra,
    }


def ms_result(case: str, ours: dict, theirs: dict, **extra) -> dict:
    """One "ms" row from two :func:`timeit` dicts: the medians as ``ours``/``torch``, the
    minima as ``ours_min``/``torch_min``, then ``extra``."""
    return result(
        case,
        "ms",
        ours["median"],
        theirs["median"],
        ours_min=ours["min"],
        torch_min=theirs["min"],
        **extra,
    )


def rel_err(ours, ref) -> float:
    """Relative L2 error ||ours - ref|| / ||ref|| (float64)."""
    import numpy as np

    a = np.asarray(ours, np.float64).ravel()
    b = np.asarray(ref, np.float64).ravel()
    den = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (den if den > 0 else 1.0)


def to_numpy(t):
    return t.detach().to("cpu").numpy()


def warm_gpu(device, dev: str, seconds: float) -> dict:
    """Keep both sides busy for ``seconds`` before the first case (a cold H200 inflated the
    first case 5x): cuBLAS matmuls on CUDA, then a meganeura matmul, half the time each.

    Returns what ran, for the result file.
    """
    import numpy as np

    import meganeura as mn
    from meganeura.training import compile_for

    done = {"seconds": seconds, "torch_runs": 0, "ours_runs": 0}
    if seconds <= 0:
        return done
    if dev == "cuda":
        import torch

        a = torch.randn(4096, 4096, device="cuda")
        t = time.perf_counter()
        while time.perf_counter() - t < seconds / 2:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
            done["torch_runs"] += 10
        del a
    n = 2048 if dev == "cuda" else 64
    g = mn.GraphBuilder()
    x = g.parameter("x", (n, n))
    g.output("y", x @ x)
    _, sess = compile_for(g.build(), device=device)
    sess.load_state_dict({"x": np.full((n, n), 1.0 / n, np.float32)})
    budget = seconds if dev != "cuda" else seconds / 2
    t = time.perf_counter()
    while time.perf_counter() - t < budget:
        for _ in range(5):
            sess.run({})
        sess.synchronize()
        done["ours_runs"] += 5
    sess.close()
    return done


def start(args):
    """What every kernel benchmark does first: the device (``--adapter``), torch on its GPU,
    ``--warm-seconds`` of warm-up, and a Recorder noting both.

    Returns:
        (device, torch, torch device string, Recorder).
    """
    from meganeura.runtime import get_device

    device = get_device(args.adapter)
    torch, dev = torch_setup()
    warm = warm_gpu(device, dev, args.warm_seconds)
    return device, torch, dev, Recorder(args, device, {"torch_device": dev, "gpu_warmup": warm})


class Recorder:
    """Collects result rows and rewrites the result file after each one, so a run cut short
    (a time limit on the GPU machine) keeps what it measured; ``finish`` marks it complete."""

    def __init__(self, args, device, extra: dict | None = None):
        self.args, self.device, self.rows = args, device, []
        self.extra = {
            "quick": bool(args.quick),
            "repeats": args.repeats,
            "warmup": args.warmup,
            **(extra or {}),
        }
        self.t0 = time.perf_counter()

    def add(self, row: dict, line: str | None = None) -> dict:
        self.rows.append(row)
        if line is None:
            line = (
                f"{row['case']:<44} {row['metric']:>7}  ours {row['ours']:10.4g}  "
                f"torch {row['torch']:10.4g}  speedup {row['speedup']:6.3f}x"
            )
        print(line, flush=True)
        self._write(complete=False)
        return row

    def _write(self, complete: bool) -> Path:
        extra = {
            **self.extra,
            "complete": complete,
            "wall_seconds": round(time.perf_counter() - self.t0, 2),
        }
        return write(self.args.out_name, self.device, self.rows, extra, quick=self.args.quick)

    def finish(self) -> Path:
        path = self._write(complete=True)
        print(f"wrote {path} ({len(self.rows)} rows, {time.perf_counter() - self.t0:.1f} s)")
        return path
