"""Ablation: a step submitted as one command buffer vs in chunks (``Session.set_submit_chunks``).

Why: the host encodes ~4.6 us per dispatch on the H200 machine (``bench/dispatch.py``); with one
command buffer the GPU waits for all of it. In chunks, the GPU runs chunk k while the host encodes
chunk k + 1. Same program, same buffers, settings interleaved call by call in one process, each
call synced before and after (``bench/workloads_lib/cell.py``'s ``timed``); the workload cells
and weights are those of ``bench/workloads.py``. Results:
``bench/results/submit_chunks_<machine>.json``: a ``..._one_submission`` row per cell, then one
row per chunk setting with ``vs_one_submission`` = one / chunked. Ours only (an ablation; the
workload table has PyTorch beside us).

    python bench/submit_chunks.py [--cells w3:train_b4,w1:fwd_seq128] [--quick] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = [(0, 0), (16, 128), (16, 64), (32, 256), (8, 32)]  # (first, size); (0, 0): one


def main(argv=None) -> None:
    from bench.common import write
    from bench.workloads import machine_name
    from bench.workloads_lib import cell as C
    from bench.workloads_lib.registry import WORKLOADS
    from meganeura.runtime import get_device

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cells", default="w3:train_b4,w1:fwd_seq128,w2:train_chunk50,w5:train_small_b2"
    )
    ap.add_argument("--quick", action="store_true", help="CPU-sized models (lavapipe)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out-name", default=None)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.cells.split(","):
        wid, cname = spec.split(":")
        wl = WORKLOADS[wid]
        cases = {c.name: c for c in wl.cases(args.quick)}
        if cname not in cases:
            print(f"{spec}: no such case at this size ({sorted(cases)})", flush=True)
            continue
        case = cases[cname]
        model, _ = wl.ours_model(case, args.quick)
        batch = wl.batch(case, args.quick)
        side = C._ours_side(wl, case, model, batch, "strict", args.quick)
        side["first"]()
        sess = side["sessions"]()[0]
        sync = side["sync"] or (lambda: None)
        times = {s: [] for s in SETTINGS}
        for s in SETTINGS:
            sess.set_submit_chunks(*s)
            for _ in range(args.warmup):
                side["run"]()
        for _ in range(args.repeats):
            for s in SETTINGS:
                sess.set_submit_chunks(*s)
                sync()
                t = time.perf_counter()
                side["run"]()
                sync()
                times[s].append((time.perf_counter() - t) * 1e3)
        one = statistics.median(times[(0, 0)])
        n = len(sess.program.dispatches)
        rows.append(
            {
                "case": f"{wid}_{cname}_one_submission",
                "metric": "ms",
                "ours": one,
                "torch": None,
                "speedup": None,
                "ours_min": min(times[(0, 0)]),
                "dispatches": n,
                "submissions": 1,
            }
        )
        for s in SETTINGS[1:]:
            sess.set_submit_chunks(*s)
            med = statistics.median(times[s])
            rows.append(
                {
                    "case": f"{wid}_{cname}_chunks_{s[0]}_{s[1]}",
                    "metric": "ms",
                    "ours": med,
                    "torch": None,
                    "speedup": None,
                    "ours_min": min(times[s]),
                    "one_submission": one,
                    "one_submission_min": min(times[(0, 0)]),
                    "vs_one_submission": one / med,
                    "dispatches": n,
                    "submissions": sess.submissions,
                }
            )
            print(
                f"{spec} {n} dispatches, chunks {s}: {med:.3f} ms vs one {one:.3f} "
                f"({one / med:.2f}x)",
                flush=True,
            )
        if "trainer" in side:
            side["trainer"].close()
        name = args.out_name or f"submit_chunks_{'lavapipe' if args.quick else machine_name()}"
        write(name, get_device(), rows, {"complete": False}, quick=args.quick)
    print(write(name, get_device(), rows, {"complete": True}, quick=args.quick))


if __name__ == "__main__":
    main()
