"""The paper's evaluation (issue 14): the five workloads of ``docs/workloads.md`` x their
inference cases and training step x strict / fast, meganeura against PyTorch eager,
``torch.compile`` and ``torch.compile(mode="reduce-overhead")`` (plus bf16 autocast in fast
mode), with correctness gates, compile times, peak memory and achieved TFLOP/s.

One process per configuration: this script is the parent; it runs
``python bench/workloads.py --cell W:CASE:PRECISION:SIDE`` children (``--in-process`` runs them
here, for the CI smoke test) and merges their rows into
``bench/results/workloads_<machine>.json`` (``--quick``: ``bench/results/quick/``).

Usage:
  python bench/workloads.py [--workloads w1,w3] [--cases fwd,train] [--precision strict]
      [--modes eager,compile] [--repeats 10] [--warmup 3] [--no-warm] [--profile]
      [--machine h200] [--fresh] [--dry-run] [--jobs 3 [--gpu-overlap]]
  python bench/workloads.py --plot [--machine h200]     # docs/workloads_speedup_<machine>.png
  python bench/workloads.py --quick --in-process --modes eager   # lavapipe smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workloads_lib import rows as R  # noqa: E402
from bench.workloads_lib.registry import WORKLOADS  # noqa: E402
from bench.workloads_lib.runner import RESULTS, ROOT, TORCH_MODES, estimate_seconds, plan  # noqa: E402


def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=_csv, default=list(WORKLOADS), help="w1,w2,w3,w4,w5")
    ap.add_argument(
        "--cases",
        type=_csv,
        default=[],
        help="case names: substrings (fwd,train) or exact w3:fwd_b1",
    )
    ap.add_argument("--precision", type=_csv, default=["strict", "fast"])
    ap.add_argument("--modes", type=_csv, default=list(TORCH_MODES), help=",".join(TORCH_MODES))
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (default 10; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3; quick 1)")
    ap.add_argument(
        "--warm-seconds",
        type=float,
        default=None,
        help="calls before the warm-up runs, for this long (default 2; quick 0): GPU clocks",
    )
    ap.add_argument("--quick", action="store_true", help="CPU-sized models (smoke test)")
    ap.add_argument(
        "--loss-scale",
        type=float,
        default=1.0,
        help="a static loss scale (power of two) for our fast-mode gradient and training cells "
        "(CompileOptions.loss_scale; recorded in the rows); default 1: none",
    )
    ap.add_argument("--in-process", action="store_true", help="no child processes (smoke test)")
    ap.add_argument("--no-warm", dest="warm", action="store_false", help="skip warm compile runs")
    ap.add_argument("--profile", action="store_true", help="per-kernel profile of slow cells")
    ap.add_argument("--machine", default=None, help="result-file suffix (default: detected)")
    ap.add_argument("--out", type=Path, default=None, help="result file (default: by machine)")
    ap.add_argument("--fresh", action="store_true", help="replace the result file, not merge")
    ap.add_argument(
        "--commit",
        default=None,
        help="the commit measured, stamped on every row (default: git rev-parse --short HEAD;"
        " pass it where the checkout's .git is not the tree's, as on the GPU machine)",
    )
    ap.add_argument("--timeout", type=int, default=600, help="seconds per child")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="children alive at once: their CPU-only start (imports, weights, CPU models)"
        " overlaps another's measurement; GPU phases take turns under a lock (default 1)",
    )
    ap.add_argument(
        "--gpu-overlap",
        action="store_true",
        help="with --jobs: no GPU lock, only quiet measured sections (each still stops every"
        " other child), so the children's device set-up, profiles, gates and exit overlap too;"
        " untimed on the H200: compare cells with and without it before a matrix run",
    )
    ap.add_argument(
        "--overlap-compile",
        action="store_true",
        help="with --jobs: torch.compile's first call (the compilation) runs outside the quiet"
        " section, overlapping the other children's work; its time is then not a compile figure"
        " (rows: compile_s.torch_cold_overlapped, no compile rows). For the matrix, whose"
        " compile figures the headline cells give",
    )
    ap.add_argument(
        "--compile-warm",
        action="store_true",
        help="only the warm-cache first-call figures of the cells asked, for rows the result"
        " file has: per compiling side a child that fills fresh caches (outside the quiet"
        " sections, no figure) then a compile-only child on them; eager modes skipped",
    )
    ap.add_argument(
        "--skip-done",
        action="store_true",
        help="skip cells the result file already has for every requested mode (resume)",
    )
    ap.add_argument(
        "--done-commits",
        default=None,
        help="with --skip-done: comma-separated commits whose rows count as done (default: "
        "--commit's only); for resuming the matrix across sessions whose code changed",
    )
    ap.add_argument(
        "--stop-after",
        type=float,
        default=None,
        help="minutes: start no new cell after this (a GPU session's budget); rerun with "
        "--skip-done to continue",
    )
    ap.add_argument("--dry-run", action="store_true", help="list the configurations and estimate")
    ap.add_argument("--plot", action="store_true", help="only draw the chart from the JSON")
    # child options
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prime", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--allow-cpu-compile",
        action="store_true",
        help="run torch.compile modes on the CPU too (tests the code path; default: skipped)",
    )
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 10
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.warm_seconds is None:
        args.warm_seconds = 0.0 if args.quick else 2.0
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    unknown += [m for m in args.modes if m not in TORCH_MODES]
    unknown += [p for p in args.precision if p not in ("strict", "fast")]
    if unknown:
        ap.error(f"unknown workloads, modes or precisions: {unknown}")
    if args.in_process:
        args.warm = False
    return args


def machine_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return "h200" if "H200" in name else name.lower().replace(" ", "_")
    except ImportError:
        pass
    return "lavapipe"


def result_path(args) -> Path:
    if args.out is not None:
        return args.out
    folder = RESULTS / "quick" if args.quick else RESULTS
    return folder / f"workloads_{args.machine}.json"


def header(args) -> dict:
    from bench.common import machine, versions
    from meganeura.runtime import get_device

    return {
        "machine": machine(get_device()),
        "versions": versions(),
        "protocol": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "warm_seconds": args.warm_seconds,
            "one_process_per_configuration": not args.in_process,
            "quick": args.quick,
        },
    }


def measured_stamp(args) -> dict:
    """``{"commit", "date"}`` stamped on every row (and ``jobs`` when children overlapped): a
    file filled over several GPU sessions says which commit each cell was measured at, and
    how."""
    import datetime
    import subprocess

    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    stamp = {"commit": commit, "date": datetime.datetime.now(datetime.UTC).date().isoformat()}
    if not args.in_process and args.jobs > 1:
        stamp["jobs"] = args.jobs  # overlapped children, measured sections quiet (gpu_lock)
        if getattr(args, "gpu_overlap", False):
            stamp["gpu_overlap"] = True  # and no GPU lock outside the measured sections
        if getattr(args, "overlap_compile", False):
            stamp["overlap_compile"] = True  # torch's first compiled call outside quiet
    return stamp


def run(args) -> Path:
    from bench.workloads_lib.runner import done_cells

    items = plan(args)
    if args.compile_warm:  # the compiling sides only; the figures attach to existing rows
        if args.in_process or args.skip_done:
            raise SystemExit("--compile-warm runs children (no --in-process) and resumes nothing")
        compiling = ("compile", "reduce_overhead")
        items = [(w, c, p, [m for m in ms if m in compiling]) for w, c, p, ms in items]
    if args.skip_done:
        want = {(wl.id, c.name, p): m for wl, c, p, m in items if c is not None}
        commits = args.done_commits.split(",") if args.done_commits else [args.commit]
        done = done_cells(result_path(args), want, commits)
        items = [it for it in items if it[1] is None or (it[0].id, it[1].name, it[2]) not in done]
        print(f"--skip-done: {len(done)} cells already measured", flush=True)
    est = estimate_seconds(items, args)
    n = sum(1 + len(m) for _, c, _, m in items if c is not None)
    jobs = "" if args.in_process or args.jobs == 1 else f" with --jobs {args.jobs}"
    print(f"{n} configurations, estimated {est / 60:.0f} min on the H200{jobs}", flush=True)
    if args.dry_run:
        for wl, case, p, modes in items:
            print(f"  {wl.id} {case.name if case else '-'} {p} {modes}")
        return result_path(args)
    path = result_path(args)
    stamp = measured_stamp(args)
    t0 = time.perf_counter()
    first = True

    def write(rows):
        nonlocal first
        for r in rows:
            r.setdefault("measured", stamp)  # --compile-warm's copies keep their own
        R.merge_write(path, rows, header(args), fresh=args.fresh and first)
        first = False

    for wl, case, p, _ in items:
        if case is None:
            print(f"{wl.id} {wl.title}: not available ({p})", flush=True)
            write([R.missing_row(wl, p)])
    from bench.workloads_lib.runner import run_configs

    deadline = None if args.stop_after is None else t0 + 60 * args.stop_after
    cells = [it for it in items if it[1] is not None]
    n_done = 0
    for (wl, case, p, _), docs in run_configs(
        cells, args, lambda s: print(s, flush=True), deadline
    ):
        n_done += 1
        if args.compile_warm:
            existing = json.loads(path.read_text())["results"] if path.exists() else []
            write(R.warm_rows(wl, case, p, docs, existing, args.quick))
            continue
        rows = R.rows_for(wl, case, p, docs, args.quick)
        if args.profile:
            prof = R.write_profiles(
                path.parent / f"workloads_{args.machine}_profiles", wl, case, p, docs
            )
            if prof:
                print(f"  profile: {prof}", flush=True)
        write(rows)
    if n_done < len(cells):
        print(
            f"--stop-after {args.stop_after} min reached after {n_done} of {len(cells)} cells;"
            " rerun with --skip-done",
            flush=True,
        )
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def main(argv=None) -> None:
    args = parse(argv)
    if args.cell:  # a child: one configuration
        from bench.workloads_lib import gpu_lock

        gpu_lock.started()
        from bench.workloads_lib.cell import main as cell_main

        doc = cell_main(args)
        from bench.workloads_lib.rows import _clean

        Path(args.child_out).write_text(json.dumps(_clean(doc)))
        return
    if args.machine is None:
        args.machine = "lavapipe" if args.quick else machine_name()
    if args.plot:
        from bench.workloads_lib.plot import plot

        png = ROOT / "docs" / f"workloads_speedup_{args.machine}.png"
        print(plot(result_path(args), png))
        return
    run(args)


if __name__ == "__main__":
    main()
