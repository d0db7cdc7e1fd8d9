"""Where a workload forward call's wall time goes between the host and the GPU, per phase.

``Session.run`` with a step recorded ahead (``pre_encode``, the default) ends and finishes the
recorded command buffers, submits them, and (in the workloads' timed calls) the caller waits
for the device. This script does those phases by hand on a workload's own Session, each call
after a device sync, as ``cell.timed`` times a call, and reports the median of each:

  finish   end each chunk's open compute pass and ``finish`` its encoder
  submit   ``queue.submit`` of every chunk
  wait     ``Session.synchronize`` after the submit (GPU time plus the launch and wake-up)
  prepare  recording the next step (outside the timed call: it overlaps the GPU's run)

beside ``gpu_us``, the step's first-start-to-last-end GPU time from ``Session.profile``
(timestamps inside the pass), ``run_us`` (``Session.run`` plus a sync, timed whole) and
``latency_us`` = finish + submit + wait - gpu: what a call costs beyond the GPU's work. The
case ``tiny`` is a 16 x 16 x 16 matmul: the floor of one call. Session internals; a diagnostic
(no PyTorch side), so the ratios against PyTorch stay in ``bench/workloads.py``.

Usage: python bench/call_phases.py [--cases tiny,w4:fwd,w5:fwd_small_b2] [--calls 200]
       [--machine h200]  (writes bench/results/call_phases_<machine>.json)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_session():
    """A Session of one 16 x 16 x 16 matmul and the feeds of its calls (none)."""
    from meganeura.compile import compile
    from meganeura.runtime import Session, get_device
    from meganeura.training import device_limits
    from meganeura.tune import matmul as tm

    device = get_device()
    graph, a_shape, b_shape = tm.build_matmul((16, 16, 16, "nt", 1))
    session = Session(compile(graph, limits=device_limits(device)), device)
    session.load_state_dict({"a": np.ones(a_shape, np.float32), "b": np.ones(b_shape, np.float32)})
    return session, {}


def workload_session(spec: str, quick: bool):
    """The Session of a workload's forward case (``w4:fwd``) as its cell times it, and the
    feeds of a timed call (none: the inputs are written once)."""
    from bench.lever_ab import build
    from bench.workloads_lib.registry import WORKLOADS

    wid, _, name = spec.partition(":")
    if wid not in WORKLOADS:
        raise SystemExit(f"--cases {spec!r}: unknown workload {wid!r} (of {', '.join(WORKLOADS)})")
    wl = WORKLOADS[wid]
    case = wl.case(name, quick)
    if case.kind != "fwd":
        raise SystemExit(f"{spec}: only forward cases (a call and a sync), got {case.kind}")
    side, _ = build(wl, case, quick, [])
    (session,) = side["sessions"]()
    return session, {}


def phases(session, calls: int) -> dict:
    """Median microseconds of each phase over ``calls`` calls (see the module docstring)."""
    from meganeura.runtime import fastpath

    rows = {k: [] for k in ("finish", "submit", "wait", "prepare", "run")}
    for _ in range(20):  # warm-up, and a step recorded ahead
        session.run({})
    session.synchronize()
    for _ in range(calls):
        session.synchronize()
        t = time.perf_counter()
        session.run({})
        session.synchronize()
        rows["run"].append(time.perf_counter() - t)
    for _ in range(calls):
        session.synchronize()
        parts, session._ready = session._ready, None
        if parts is None:
            parts = session._plan.prepare(session._gpu, session._chunks)
        t0 = time.perf_counter()
        bufs = [fastpath._finish(enc, cp, None) for enc, cp in parts]
        t1 = time.perf_counter()
        for buf in bufs:
            session._queue.submit([buf])
        t2 = time.perf_counter()
        session.synchronize()
        t3 = time.perf_counter()
        session._ready = session._plan.prepare(session._gpu, session._chunks)
        t4 = time.perf_counter()
        spans = {"finish": t1 - t0, "submit": t2 - t1, "wait": t3 - t2, "prepare": t4 - t3}
        for k, v in spans.items():
            rows[k].append(v)
    out = {f"{k}_us": round(statistics.median(v) * 1e6, 2) for k, v in rows.items()}
    out["dispatches"] = len(session.program.dispatches)
    out["chunks"] = len(session._chunks)
    if "timestamp-query" in session.device.features:
        prof = session.profile({}, repeats=5, warmup=2)
        out["gpu_us"] = round(statistics.median(prof.repeat_ns()) / 1e3, 2)
        out["latency_us"] = round(
            out["finish_us"] + out["submit_us"] + out["wait_us"] - out["gpu_us"], 2
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="tiny,w4:fwd,w5:fwd_small_b2,w2:fwd_chunk50")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--machine", default=None)
    ap.add_argument("--quick", action="store_true", help="the CPU-sized cases (lavapipe)")
    args = ap.parse_args()
    from bench.common import write_json
    from meganeura.runtime import get_device

    device = get_device()
    rows = []
    for spec in args.cases.split(","):
        session, _ = tiny_session() if spec == "tiny" else workload_session(spec, args.quick)
        row = {"case": spec, **phases(session, args.calls)}
        print(row, flush=True)
        rows.append(row)
        session.close()
    if args.machine:
        out = Path(__file__).parent / "results" / f"call_phases_{args.machine}.json"
        write_json(out, {"adapter": device.name, "calls": args.calls, "rows": rows})
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
