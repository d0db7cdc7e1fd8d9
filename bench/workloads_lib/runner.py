"""The parent: enumerates the configurations, runs each in a child process (or in this process
with ``--in-process``), and turns the children's documents into result rows.

Rows (``bench/results/workloads_<machine>.json``, one per cell, PyTorch mode and metric):
``case`` (``w1_smollm2_fwd_seq128_strict_vs_compile``), ``metric``, ``ours``, ``torch``,
``speedup`` (torch/ours; None when the gate fails: no speedup is claimed, the measured ratio
stays in ``speedup_unclaimed``), ``gate`` (PASS / FAIL / ERROR), ``gate_figures``,
``peak_bytes`` ({"ours", "torch"}), plus ``ours_min``, ``torch_min``, ``tflops``, ``compile_s``,
``paper_torch_ms``. Compile-time rows have metric ``s``
(``..._strict_compile_cold_vs_compile``). A run merges its rows into the file (same case ids
replaced), so a table filled over several GPU sessions accumulates.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import gpu_lock
from .registry import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
TORCH_MODES = ("eager", "compile", "reduce_overhead", "eager_bf16")
# rough seconds per child on the H200 (process start, weights, first call, 13 timed calls)
EST_OURS = {"w1": 45, "w2": 30, "w3": 35, "w4": 20, "w5": 20}
EST_EAGER = 15
EST_PREP = 20  # of each child's seconds: its CPU-only start, which --jobs overlaps


def modes_for(precision: str, modes: list[str]) -> list[str]:
    return [m for m in modes if m != "eager_bf16" or precision == "fast"]


def plan(args) -> list[tuple]:
    """[(workload, case, precision, [modes])] selected by the filters; missing workloads as
    (workload, None, reason, [])."""
    out = []
    for wid in args.workloads:
        wl = WORKLOADS[wid]
        reason = wl.missing()
        if reason:
            out.append((wl, None, reason, []))
            continue
        for case in wl.cases(args.quick):
            if args.cases and not any(_selects(c, wl.id, case.name) for c in args.cases):
                continue
            for p in args.precision:
                out.append((wl, case, p, modes_for(p, args.modes)))
    return sorted(out, key=priority)


def priority(item) -> tuple:
    """Run order: unavailable workloads first (no cost), then strict before fast, and in each
    the workloads.md headline cells (the forward and training step the paper's table gives)
    before the other cases, the Adam variants of the training step last, so a run stopped by
    ``--stop-after`` has the table's core."""
    wl, case, p, _ = item
    if case is None:
        return (0, 0, 0, wl.id)
    headline = case.name in wl.headline(False)
    return (1, p != "strict", not headline, case.name.startswith("train_adam"), wl.id)


def done_cells(path: Path, modes_by_cell: dict, commits: list[str | None] | None = None) -> set:
    """(workload, case, precision) whose rows in the result file at ``path`` cover every
    requested mode without an error (``--skip-done``); with ``commits`` (None in it: any),
    only rows measured at one of them count (a file holding an older run's rows is resumed,
    not skipped)."""
    if not path.exists():
        return set()
    import json

    seen: dict = {}
    for r in json.loads(path.read_text()).get("results", []):
        if r.get("metric") in ("n/a", "s") or r.get("gate") == "ERROR" or "torch_error" in r:
            continue
        if (
            commits
            and None not in commits
            and (r.get("measured") or {}).get("commit") not in commits
        ):
            continue
        seen.setdefault((r["workload"], r["cell"], r["precision"]), set()).add(r["mode"])
    return {k for k, modes in seen.items() if set(modes_by_cell.get(k, ())) <= modes}


def _selects(entry: str, wid: str, name: str) -> bool:
    """``--cases`` entry: ``w3:fwd_b1`` selects that case exactly; ``fwd`` any case whose name
    contains it."""
    if ":" in entry:
        return entry == f"{wid}:{name}"
    return entry in name


def estimate_seconds(items, args) -> float:
    """Rough wall seconds of ``items`` on the H200. With ``args.jobs`` > 1 each child's start
    (``EST_PREP``: imports, weights, CPU models; measured ~20 s of a ~40 s child on
    2026-12-03) is taken to overlap the others' work but for 1 / jobs of it."""
    total = 0.0
    children = 0
    for wl, case, _p, modes in items:
        if case is None:
            continue
        children += (1 + len(modes)) * (2 if args.warm else 1)
        first = wl.paper.get("first_s", 20)
        total += EST_OURS.get(wl.id, 30) * (1.5 if case.trains else 1.0)
        total += getattr(args, "warm_seconds", 0.0) * (1 + len(modes))
        for m in modes:
            if m in ("eager", "eager_bf16"):
                total += EST_EAGER
            else:
                compiling = first * (1.0 if case.trains else 0.6)
                if getattr(args, "overlap_compile", False):  # overlaps the other children's
                    compiling /= max(1, getattr(args, "jobs", 1))
                total += compiling + 20
                if args.warm:
                    total += first * 0.4 + 10
        if args.warm:
            total += 0.6 * EST_OURS.get(wl.id, 30)
    jobs = 1 if getattr(args, "in_process", False) else max(1, getattr(args, "jobs", 1))
    return total - children * EST_PREP * (jobs - 1) / jobs


class _Children:
    """The live children of one ``run_configs``, kept in the pid file their ``quiet`` sections
    read (``gpu_lock``); when one exits, every other is continued (``SIGCONT``), so a child
    that dies inside its quiet section leaves none stopped."""

    def __init__(self, path: str):
        import threading

        self.path, self.pids, self.lock = path, set(), threading.Lock()
        gpu_lock.write_pids(path, ())

    def add(self, pid: int) -> None:
        with self.lock:
            self.pids.add(pid)
            gpu_lock.write_pids(self.path, self.pids)

    def remove(self, pid: int) -> None:
        import signal

        with self.lock:
            self.pids.discard(pid)
            gpu_lock.write_pids(self.path, self.pids)
            gpu_lock.signal_all(self.pids, signal.SIGCONT)


_REGISTRY: dict[str | None, _Children] = {}  # pid file -> its registry (run_configs)


def child(cell: str, args, env: dict, compile_only: bool = False) -> dict:
    """Run one configuration; its document (``error`` set when the child failed)."""
    from .cell import main as cell_main

    if args.in_process:
        ns = _child_args(cell, args, compile_only)
        return cell_main(ns)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(ROOT / "bench" / "workloads.py"), "--cell", cell, "--child-out", out]
    cmd += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    cmd += ["--warm-seconds", str(args.warm_seconds)]
    cmd += ["--quick"] * args.quick + ["--profile"] * bool(args.profile and cell.endswith(":ours"))
    cmd += ["--compile-only"] * compile_only
    cmd += ["--prime"] * bool(getattr(args, "prime", False))
    cmd += ["--allow-cpu-compile"] * bool(args.allow_cpu_compile)
    cmd += ["--loss-scale", repr(args.loss_scale)] * (args.loss_scale != 1.0)
    cmd += ["--overlap-compile"] * bool(getattr(args, "overlap_compile", False))
    t = time.perf_counter()
    registry = _REGISTRY.get(env.get(gpu_lock.PIDS_ENV))
    try:
        # a session of its own: its process group (pgid = pid) holds the workers it starts
        # (torch.compile's compile pool), which the quiet sections stop with it
        p = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if registry is not None:
            registry.add(p.pid)
        try:
            _, stderr = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            gpu_lock.signal_all([p.pid], signal.SIGKILL)  # the child and its workers
            p.communicate()
            raise
        finally:
            if registry is not None:
                registry.remove(p.pid)
        doc = json.loads(Path(out).read_text()) if Path(out).stat().st_size else {}
        if p.returncode and "error" not in doc:
            doc["error"] = f"child exited {p.returncode}: {stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        doc = {"error": f"timed out after {args.timeout} s"}
    except (OSError, json.JSONDecodeError) as e:
        doc = {"error": f"{type(e).__name__}: {e}"}
    finally:
        Path(out).unlink(missing_ok=True)
    doc["process_wall_s"] = time.perf_counter() - t
    return doc


def _child_args(cell, args, compile_only):
    return argparse.Namespace(
        cell=cell,
        quick=args.quick,
        repeats=args.repeats,
        warmup=args.warmup,
        warm_seconds=args.warm_seconds,
        profile=bool(args.profile and cell.endswith(":ours")),
        compile_only=compile_only,
        allow_cpu_compile=args.allow_cpu_compile,
        loss_scale=args.loss_scale,
        overlap_compile=getattr(args, "overlap_compile", False),
        prime=getattr(args, "prime", False),
    )


def _env(cache: str, side: str) -> dict:
    """The child's environment: fresh (cold) or reused (warm) caches under ``cache``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if side == "ours":
        env["__GL_SHADER_DISK_CACHE_PATH"] = os.path.join(cache, "nv")
        env["__GL_SHADER_DISK_CACHE"] = "1"
        env["__GL_SHADER_DISK_CACHE_SKIP_CLEANUP"] = "1"
        env["MESA_SHADER_CACHE_DIR"] = os.path.join(cache, "mesa")
    else:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    for k in (
        "__GL_SHADER_DISK_CACHE_PATH",
        "MESA_SHADER_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
    ):
        if k in env and env[k].startswith(cache):
            os.makedirs(env[k], exist_ok=True)
    return env


def _side(wl, case, precision, side, args, lock: str | None) -> dict:
    """One side of a cell: its child, then (``args.warm``, a compiling side) a compile-only
    child on the same caches for the warm first-call figure."""
    cell = f"{wl.id}:{case.name}:{precision}:{side}"
    with tempfile.TemporaryDirectory(prefix="mn-bench-") as cache:
        env = _env(cache, side)
        if lock is not None:
            if not getattr(args, "gpu_overlap", False):
                env[gpu_lock.ENV] = lock  # GPU phases take turns, not only measured sections
            env[gpu_lock.PIDS_ENV] = lock + ".pids"
        if getattr(args, "compile_warm", False):
            # the cold child only fills the caches (outside the quiet sections, no figure);
            # the compile-only child after it gives the warm figure
            primed = child(cell, argparse.Namespace(**{**vars(args), "prime": True}), env, True)
            if "error" in primed or "skipped" in primed:
                return primed
            doc = {"primed_first_call_s": primed.get("first_call_s")}
            w = child(cell, args, env, compile_only=True)
            doc["warm_first_call_s"] = w.get("first_call_s")
            for k in ("error", "skipped"):
                if k in w:
                    doc[k] = w[k]
            return doc
        doc = child(cell, args, env)
        if args.warm and not args.in_process and side not in ("eager", "eager_bf16"):
            if "error" not in doc and "skipped" not in doc:
                w = child(cell, args, env, compile_only=True)
                doc["warm_first_call_s"] = w.get("first_call_s")
                if "error" in w:
                    doc["warm_error"] = w["error"]
    return doc


def run_config(wl, case, precision, modes, args, log) -> dict:
    """Every side of one cell, one child at a time: {side: document}."""
    docs = {}
    for side in ["ours", *modes]:
        docs[side] = _side(wl, case, precision, side, args, None)
        log(_line(f"{wl.id}:{case.name}:{precision}:{side}", docs[side]))
    return docs


def run_configs(items, args, log, deadline: float | None = None):
    """Run the cells of ``items`` ([(workload, case, precision, modes)], no missing ones) and
    yield ``(item, {side: document})`` as each cell completes. No cell starts after
    ``deadline`` (``time.perf_counter()`` value); a started cell runs all its sides.

    ``args.jobs`` > 1 (not in-process) keeps up to that many children alive, started in
    ``items`` order, whose CPU-only start overlaps another child's unmeasured work
    (``gpu_lock``: GPU phases take turns under one lock, and each measured section stops
    every other child; with ``args.gpu_overlap`` there is no lock, so the GPU work outside
    measured sections (device set-up, profiles, gates, exit) overlaps too). ``lock_wait_s``
    in each document is the time a child waited for the GPU, outside every figure. A child's
    ``--timeout`` then covers its wait too: it is multiplied by ``jobs``.
    """
    jobs = 1 if args.in_process else max(1, getattr(args, "jobs", 1))
    if jobs == 1:
        for item in items:
            if deadline is not None and time.perf_counter() > deadline:
                return
            yield item, run_config(*item, args, log)
        return
    import copy
    import threading
    from concurrent.futures import ThreadPoolExecutor

    cargs = copy.copy(args)
    cargs.timeout = args.timeout * jobs
    slots = threading.BoundedSemaphore(jobs)
    pending: list[tuple] = []  # (item, {side: future}) in start order

    def task(wl, case, p, side, lock):
        try:
            doc = _side(wl, case, p, side, cargs, lock)
            log(_line(f"{wl.id}:{case.name}:{p}:{side}", doc))
            return doc
        finally:
            slots.release()

    def finished():
        done = [(it, fs) for it, fs in pending if all(f.done() for f in fs.values())]
        for it, fs in done:
            pending.remove((it, fs))
        return [(it, {s: f.result() for s, f in fs.items()}) for it, fs in done]

    with tempfile.TemporaryDirectory(prefix="mn-bench-lock-") as d:
        lock = os.path.join(d, "gpu.lock")
        _REGISTRY[lock + ".pids"] = _Children(lock + ".pids")
        try:
            with ThreadPoolExecutor(jobs) as ex:
                for item in items:
                    wl, case, p, modes = item
                    if deadline is not None and time.perf_counter() > deadline:
                        break
                    futures = {}
                    for side in ["ours", *modes]:
                        slots.acquire()
                        futures[side] = ex.submit(task, wl, case, p, side, lock)
                        yield from finished()
                    pending.append((item, futures))
                    yield from finished()
                for item, futures in list(pending):
                    yield item, {s: f.result() for s, f in futures.items()}
        finally:
            _REGISTRY.pop(lock + ".pids", None)


def _line(cell, doc) -> str:
    if "skipped" in doc:
        return f"{cell:48s} skipped: {doc['skipped']}"
    if "error" in doc:
        tb = doc.get("traceback", "").strip().splitlines()[-6:]
        return f"{cell:48s} ERROR {doc['error'][:300]}" + "".join(f"\n    {x}" for x in tb)
    nan = float("nan")
    if "warm_first_call_s" in doc and "metrics" not in doc:  # --compile-warm
        return (
            f"{cell:48s} warm first call {doc['warm_first_call_s'] or nan:.2f} s"
            f" (priming run {doc.get('primed_first_call_s') or nan:.2f} s, not quiet)"
        )
    ms = doc.get("metrics", {})
    m = next(iter(ms.values()), {})
    gate = f" gate {doc['gate']}" if "gate" in doc else ""
    return (
        f"{cell:48s} {m.get('median', nan):10.4g} ms (min {m.get('min', nan):.4g})"
        f" first {doc.get('first_call_s', float('nan')):.2f} s{gate}"
    )
