"""Matmul wall time on the default adapter (meant for lavapipe / llvmpipe, CI's CPU driver).

Cases: the linear / GEMV / square shapes CI's model tests run, in the layouts they use. Each
case compiles a one-matmul graph of parameters and times ``Session.run`` + ``synchronize``
(median of ``--repeats``, after one warm-up run): wall time, and the CPU time of
the process (lavapipe's worker threads included), which moves less when other jobs share the
machine. ``--plan NAME`` forces a plan
(``matmul.plan.force_plan``) for sweeps.

Measured 2026-12-02 on the 2-core CI-class machine (lavapipe, Mesa 22.3.6, LLVM 15, AVX2), wall
ms median of 7, before -> after the CPU plans (``matmul.plan.cpu_plan``, the ``simd`` kernel):
linear16 39.1 -> 1.9, linear128 80.5 -> 15.7, square512 68.4 -> 27.2, dw_tn 86.1 -> 22.0; M <= 8
keeps gemv (horizontal fusion needs it), where ``--plan simd8`` gave gemv_head 57.3 -> 20.0,
gemv_gate 3.5 -> 1.0, gemv_nn 9.3 -> 2.3.

Usage: python bench/cpu_matmul.py [--repeats 5] [--plan 64x64x16/np] [--only gemv]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.matmul import build  # noqa: E402

# (name, M, K, N, layout)
CASES = [
    ("linear16", 16, 576, 1536, "nt"),
    ("linear128", 128, 576, 1536, "nt"),
    ("square512", 512, 512, 512, "nn"),
    ("gemv_head", 1, 576, 49152, "nt"),
    ("gemv_gate", 1, 576, 1536, "nt"),
    ("gemv_nn", 4, 576, 1536, "nn"),
    ("dw_tn", 576, 128, 1536, "tn"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    from meganeura.codegen.wgsl.matmul import plan as mplan
    from meganeura.runtime import get_device
    from meganeura.training import compile_for

    device = get_device()
    mplan.force_plan(args.plan)
    for name, m, k, n, layout in CASES:
        if args.only and args.only not in name:
            continue
        graph, a_shape, b_shape = build(m, k, n, layout)
        try:
            program, sess = compile_for(graph, device=device)
        except ValueError as e:
            print(f"{name:10s} skipped: {e}")
            continue
        rng = np.random.default_rng(0)
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32)
        sess.load_state_dict({"a": a, "b": b})
        y = sess.run({}, fetch=("y",))["y"]
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        ref = a64 @ b64.T if layout == "nt" else (a64.T @ b64 if layout == "tn" else a64 @ b64)
        err = float(np.abs(y - ref).max() / np.abs(ref).max())
        times, cpu = [], []
        for _ in range(args.repeats):
            t, c = time.perf_counter(), time.process_time()
            sess.run({})
            sess.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
        ms, cms = statistics.median(times), statistics.median(cpu)
        gf = 2 * m * k * n / ms / 1e6
        kern = ",".join(d.name for d in program.dispatches)
        print(
            f"{name:10s} {layout} {m}x{k}x{n}: {ms:8.2f} ms wall {cms:8.2f} ms cpu "
            f"{gf:6.2f} GFLOP/s err {err:.1e} [{kern}]"
        )
        sess.close()


if __name__ == "__main__":
    main()
