"""Sweep: every applicable matmul plan per shape against cuBLAS (TF32 off), to fill TUNED.

For 4096^3, 2048^3, 1024^3, 512x4096x512 and the workloads' own shapes (``bench/matmul.py``:
the ``nt`` projections incl. the M <= 8 decode shapes, and the ``tn`` weight gradients), each
plan of ``variants(...)`` is forced with ``matmul.force_plan``, compiled, checked against
PyTorch's result (rel_err) and timed as GPU time from ``Session.profile`` (as bench/matmul.py
does); torch is timed with CUDA events in the same process. Prints one table row per
(shape, plan), the best plan per shape with its ratio to cuBLAS, and the ``TUNED`` dict to
paste into ``meganeura/codegen/wgsl/matmul/tuned.py``. A ``--budget-s`` wall-clock budget, shared
evenly by the shapes, skips a shape's remaining plans (never the default) once its share is
spent; the JSON is rewritten after each shape.

Usage: python bench/matmul_sweep.py [--quick] [--out PATH] [--repeats 5] [--warmup 2]
                                    [--budget-s 170] [--only CASE ...] [--layout nn|nt|tn|tt]
                                    [--runtime-checks on|off]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    machine,
    profile_ms,
    rel_err,
    time_torch,
    to_numpy,
    torch_setup,
    versions,
    warm_gpu,
)
from bench.matmul import TN, WORKLOAD, build, torch_fn  # noqa: E402

SQUARE = [
    ("square4096", 4096, 4096, 4096, "nn", "headline"),
    ("square4096_nt", 4096, 4096, 4096, "nt", "headline, nn.Linear layout"),
    ("square2048", 2048, 2048, 2048, "nn", "sweep"),
    ("square1024", 1024, 1024, 1024, "nn", "sweep"),
    ("long_k", 512, 4096, 512, "nn", "few tiles, long K (split-K)"),
]


def shapes(quick: bool) -> list[tuple[str, int, int, int, str, str]]:
    out = SQUARE + [(c, m, k, n, "nt", o) for c, m, k, n, o in WORKLOAD]
    out += [(c, m, k, n, "tn", o) for c, m, k, n, o in TN]
    if not quick:
        return out
    pick = ("square1024", "long_k", "smollm2_dec_q_o", "whisper_fc1", "whisper_dw_fc1")
    return [(c, max(1, m // 8), max(1, k // 8), max(1, n // 8), lay, o)
            for c, m, k, n, lay, o in out if c in pick]  # fmt: skip


def variants(m: int, k: int, n: int, quick: bool) -> list[str]:
    """Plans worth timing for one shape (the default plan is added by the caller)."""
    from meganeura.codegen.wgsl.matmul import plan as mm

    if m <= mm.GEMV_MAX_M:
        out = [f"gemv{lanes}" for lanes in (8, 16, 32, 64)]
        out += [f"gemv32/s{s}" for s in (2, 4, 8) if k // s >= 128]
        out.append("64x64x16")
        return out[:3] if quick else out
    out = ["128x128x8", "128x128x16", "128x64x16", "64x128x16", "64x64x16"]
    if m * n >= 2048 * 2048:
        out.append("128x128x8/np")  # what prefetch buys
    if m * n >= 1024 * 1024:  # two-deep prefetch
        out += ["128x128x8/d2", "128x128x16/d2", "64x64x16/d2"]
    if m * n >= 4096 * 1024:  # 16 x 8 outputs per thread, only where tiles stay plentiful
        out += ["256x128x8", "128x256x8", "256x128x8/np", "128x256x8/np"]
    small = -(-m // 64) * -(-n // 64) < 2 * mm.SMS
    if small:  # longer K steps, or two-deep prefetch: more loads in flight per step
        out += ["64x64x32", "64x64x64/np", "64x64x16/d2"]
        out += [f"64x64x16/s{s}/d2" for s in (4, 8) if k // s >= 32]
    for t in ("128x128x8", "64x64x16", "64x64x32"):
        tiling = mm.TILINGS[t]
        tiles = -(-m // tiling.bm) * -(-n // tiling.bn)
        if tiles < 2 * mm.SMS:
            # short chunks (down to 32 of K) too: a small product is a latency chain of K steps
            least = 128 if t == "128x128x8" else 2 * tiling.bk
            out += [f"{t}/s{s}" for s in (2, 4, 8, 16, 32) if k // s >= least]
    return out[:3] if quick else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 3 plans each (lavapipe)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=170.0)
    ap.add_argument("--warm-seconds", type=float, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="case names to run")
    ap.add_argument("--adapter", default=os.environ.get("MEGANEURA_ADAPTER"))
    ap.add_argument(
        "--layout",
        choices=("nn", "nt", "tn", "tt"),
        default=None,
        help="run the chosen shapes in this operand layout instead of their own",
    )
    ap.add_argument(
        "--runtime-checks",
        choices=("on", "off"),
        default=None,
        help="naga's runtime checks in shader modules (default: the library's)",
    )
    args = ap.parse_args()
    if args.runtime_checks is not None:
        from meganeura.runtime import pipelines

        pipelines.RUNTIME_CHECKS = args.runtime_checks == "on"
    repeats = args.repeats or (2 if args.quick else 5)
    warmup = args.warmup or (1 if args.quick else 2)
    warm_s = args.warm_seconds if args.warm_seconds is not None else (0.0 if args.quick else 2.0)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results", "quick" if args.quick else "sweeps", "matmul_sweep.json",
    )  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    from meganeura.codegen.wgsl.matmul import plan as mm
    from meganeura.runtime import get_device
    from meganeura.training import compile_for, device_limits

    device = get_device(args.adapter)
    # the default without this device's tuning cache (docs/tuning.md): the sweep fills TUNED
    limits = dataclasses.replace(device_limits(device), matmul_plans=())
    torch, dev = torch_setup()
    warm = warm_gpu(device, dev, warm_s)
    t0 = time.perf_counter()
    rows: list[dict] = []
    best: dict[str, dict] = {}
    doc = {"machine": machine(device), "versions": versions(), "gpu_warmup": warm,
           "repeats": repeats, "warmup": warmup, "quick": args.quick}  # fmt: skip

    def save(complete: bool) -> None:
        doc.update(rows=rows, best=list(best.values()), complete=complete,
                   wall_seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)

    print(f"{'case':<22} {'layout':<4} {'M':>5} {'K':>5} {'N':>6} {'plan':<16} "
          f"{'ms':>9} {'TFLOP/s':>8} {'xcuBLAS':>7} {'rel_err':>8}")  # fmt: skip
    todo = [s for s in shapes(args.quick) if not args.only or s[0] in args.only]
    if args.layout:  # the same shapes in another operand layout
        todo = [(c, m, k, n, args.layout, o) for c, m, k, n, _, o in todo]
    for i, (case, m, k, n, layout, origin) in enumerate(todo):
        # an even share of the budget per shape, so a slow start cannot starve the last ones
        deadline = t0 + args.budget_s * (i + 1) / len(todo)
        graph, a_shape, b_shape = build(m, k, n, layout)
        rng = np.random.default_rng(m * 7 + k * 3 + n)
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32) / np.float32(np.sqrt(k))
        ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
        fn = torch_fn(torch, ta, tb, layout)
        ref = to_numpy(fn())
        torch_ms = time_torch(fn, dev, warmup, repeats)["median"]
        flop = 2.0 * m * n * k
        mlay = "nn" if layout == "nn" else layout  # Problem.layout of this graph
        default = mm.choose_plan(m, k, n, 1, mlay, limits).name
        plans = [default] + [v for v in variants(m, k, n, args.quick) if v != default]
        shape_rows = []
        for plan in plans:
            if plan != default and time.perf_counter() > deadline:
                print(f"  budget spent: skipping {plan}")
                continue
            mm.force_plan(plan)
            try:
                program, sess = compile_for(graph, device=device)
            except ValueError as e:  # the plan cannot run this shape on this adapter
                print(f"  {plan}: {e}")
                continue
            finally:
                mm.force_plan(None)
            try:
                sess.load_state_dict({"a": a, "b": b})
                err = rel_err(sess.run({}, fetch=("y",))["y"], ref)
                ms = profile_ms(sess, {}, warmup, repeats)["all"]["median"]
            finally:
                sess.close()
            row = {
                "case": case, "origin": origin, "layout": layout, "m": m, "k": k, "n": n,
                "plan": plan, "default": plan == default, "ms": ms, "tflops": flop / ms / 1e9,
                "torch_ms": torch_ms, "torch_tflops": flop / torch_ms / 1e9,
                "vs_cublas": torch_ms / ms, "rel_err": err, "dispatches": len(program.dispatches),
            }  # fmt: skip
            rows.append(row)
            shape_rows.append(row)
            flag = "*" if plan == default else " "
            line = f"{case:<22} {layout:<4} {m:>5} {k:>5} {n:>6} {plan + flag:<16} {ms:>9.4f} "
            line += f"{row['tflops']:>8.2f} {row['vs_cublas']:>7.3f} {err:>8.1e}"
            print(line, flush=True)
            if err > 1e-4:
                print(f"  WARNING {case} {plan}: rel_err {err:.2e} against PyTorch")
        ok = [r for r in shape_rows if r["rel_err"] <= 1e-4]
        if ok:
            top = min(ok, key=lambda r: r["ms"])
            dflt = next((r for r in shape_rows if r["default"]), top)
            best[case] = {**top, "default_plan": default, "default_ms": dflt["ms"],
                          "gain_over_default": dflt["ms"] / top["ms"]}  # fmt: skip
        del ta, tb
        save(False)
    save(True)

    print(f"\nbest plan per shape (* = current default), {time.perf_counter() - t0:.0f} s:")
    print(f"{'case':<22} {'best':<16} {'TFLOP/s':>8} {'xcuBLAS':>7} {'default':<16} {'gain':>5}")
    for r in best.values():
        print(f"{r['case']:<22} {r['plan']:<16} {r['tflops']:>8.2f} {r['vs_cublas']:>7.3f} "
              f"{r['default_plan']:<16} {r['gain_over_default']:>5.2f}")  # fmt: skip
    print("\n# paste into meganeura/codegen/wgsl/matmul/tuned.py (plans >= 3% over the default):")
    print("TUNED: dict[tuple[int, int, int, str], str] = {")
    for r in best.values():
        if r["gain_over_default"] >= 1.03:
            key = (r["m"], r["k"], r["n"], r["layout"])
            print(f"    {key!r}: {r['plan']!r},  # {r['case']} x{r['gain_over_default']:.2f}")
    print("}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
