"""Why the matmul tuner's times differ from the same products' in the workloads' profiles.

The tenth H200 session found the tuner's times 3.8-4.7x the in-step profiles' (1500 x 384 x
384 nt: 183.7 us tuned, 39.2 us in W4 fwd's step; SmolLM2's LM head 850 against 224). This
script times one product several ways in one process, the default plan each time:

- ``tuner``: ``meganeura.tune.matmul._time_plan``, exactly as ``tune_matmuls`` times a plan
  (a heater kick first, ``Session.profile`` with ``REPLAYS`` steps a submission);
- ``profile_<method>_r<replays>``: ``Session.profile`` of the same Session, per-step GPU time,
  with the timestamps inside the pass or a pass per dispatch, 16 steps or one a submission;
- ``first_of_submission`` / ``rest_of_submission``: the first step of each 16-step submission
  apart from the others (a step after the host's read-back follows an idle GPU);
- ``wall_loop``: the host clock around 200 back-to-back ``Session.run`` calls and one sync;
- ``chain16`` (square products only): 16 dependent copies of the product in one program,
  as a workload's step runs them, per dispatch;
- ``torch``: cuBLAS with CUDA events (``F.linear`` for ``nt``), when CUDA is there, a short
  ``torch.cuda._sleep`` queued first (the H200 file of 2026-12-04 was written before it was,
  so its ``torch`` figures include the launch latency: 86 us for a 37 us product).

With ``--clocks`` an ``nvidia-smi`` sampler logs the SM clock every 50 ms beside the timings,
so a low clock under a light load shows. Writes ``bench/results/tuner_timing_<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_SHAPES = "1500,384,384,nt;128,576,49152,nt;128,576,1536,nt"


def per_step_us(prof) -> list[float]:
    """GPU microseconds of each profiled step (every dispatch of the step summed)."""
    return [ns / 1e3 for ns in prof.repeat_ns()]


def chain_graph(key, copies: int):
    """``copies`` dependent products x <- x @ b^T (layout nt, K == N) over parameters a, b."""
    from meganeura.graph.builder import GraphBuilder

    m, k, n, _, _ = key
    g = GraphBuilder()
    x, b = g.parameter("a", (m, k)), g.parameter("b", (n, k))
    for _ in range(copies):
        x = x @ b.mT
    g.output("y", x)
    return g.build()


def time_shape(key, device, limits, heater, clocks_mark) -> dict:
    from meganeura.compile import compile
    from meganeura.runtime import Session
    from meganeura.tune import matmul as tm

    m, k, n, layout, batch = key
    graph, a_shape, b_shape = tm.build_matmul(key)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(a_shape, dtype=np.float32)
    b = rng.standard_normal(b_shape, dtype=np.float32) / np.float32(np.sqrt(k))
    plan = tm.default_plan(key, limits)
    row: dict = {"shape": list(key), "plan": plan, "gflop": 2 * m * k * n * batch / 1e9}
    heater.run(2.0)
    clocks_mark(f"{key} tuner")
    row["tuner"] = tm._time_plan(plan, key, graph, a, b, device, limits, 5, 2, heater)[1]
    program = compile(graph, limits=limits)
    row["dispatches"] = [d.name for d in program.dispatches]
    with Session(program, device) as sess:
        sess.load_state_dict({"a": a, "b": b})
        sess.run({})
        for method in ("inside", "passes"):
            for replays in (16, 1):
                heater.kick()
                clocks_mark(f"{key} profile {method} r{replays}")
                reps = 5 if replays > 1 else 40
                per = per_step_us(
                    sess.profile({}, repeats=reps, warmup=2, method=method, replays=replays)
                )
                row[f"profile_{method}_r{replays}"] = statistics.median(per)
                if replays > 1:
                    row[f"first_of_submission_{method}"] = statistics.median(per[::replays])
                    rest = [p for i, p in enumerate(per) if i % replays]
                    row[f"rest_of_submission_{method}"] = statistics.median(rest)
                    row[f"steps_{method}_r{replays}"] = [round(p, 2) for p in per[:replays]]
        heater.kick()
        clocks_mark(f"{key} wall loop")
        for _ in range(20):
            sess.run({})
        sess.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            sess.run({})
        sess.synchronize()
        row["wall_loop"] = (time.perf_counter() - t) * 1e6 / 200
    if layout == "nt" and k == n and batch == 1:
        chain = compile(chain_graph(key, 16), limits=limits)
        with Session(chain, device) as sess:
            sess.load_state_dict({"a": a, "b": b})
            sess.run({})
            heater.kick()
            clocks_mark(f"{key} chain16")
            prof = sess.profile({}, repeats=10, warmup=2)
            ds = [t.duration_ns / 1e3 for t in prof.timings]
            row["chain16_per_dispatch"] = statistics.median(ds)
            row["chain16_dispatches"] = len(chain.dispatches)
    try:
        import torch

        if torch.cuda.is_available():
            ta = torch.from_numpy(a).cuda()
            tb = torch.from_numpy(b).cuda()
            torch.backends.cuda.matmul.allow_tf32 = False
            f = (lambda: torch.nn.functional.linear(ta, tb)) if layout == "nt" else None
            if f is not None:
                for _ in range(20):
                    f()
                times = []
                for _ in range(50):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                    torch.cuda._sleep(200_000)  # the launch's latency outside the events
                    e0.record()
                    f()
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3)
                row["torch"] = statistics.median(times)
    except ImportError:
        pass
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="M,K,N,layout[;...] (batch 1)")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--clocks", action="store_true", help="log nvidia-smi's SM clock (50 ms)")
    args = ap.parse_args()
    from meganeura.runtime import get_device
    from meganeura.training import device_limits
    from meganeura.tune.matmul import Heater

    device = get_device()
    limits = device_limits(device)
    sampler, marks = None, []
    t_start = time.time()
    if args.clocks and shutil.which("nvidia-smi"):
        sampler = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu",
                "--format=csv,noheader",
                "-lms",
                "50",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

    def mark(what: str) -> None:
        marks.append((round(time.time() - t_start, 3), what))

    heater = Heater(device, n=64 if limits.cpu else 2048)  # lavapipe: a light heater
    rows = []
    try:
        for spec in args.shapes.split(";"):
            m, k, n, layout = spec.split(",")
            key = (int(m), int(k), int(n), layout, 1)
            row = time_shape(key, device, limits, heater, mark)
            rows.append(row)
            print(
                json.dumps({x: v for x, v in row.items() if not x.startswith("steps")}),
                flush=True,
            )
    finally:
        heater.close()
        clocks = []
        if sampler is not None:
            sampler.terminate()
            clocks = sampler.communicate()[0].splitlines()
    from bench.conv_sweep import machine_tag

    tag = args.machine or machine_tag(device.name)
    out = Path(__file__).parent / "results" / f"tuner_timing_{tag}.json"
    doc = {
        "adapter": device.name,
        "rows": rows,
        "marks": marks,
        "clocks": clocks,
        "start_unix": t_start,
    }
    from bench.common import write_json

    write_json(out, doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
