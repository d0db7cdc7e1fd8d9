"""Benchmark: the forward attention kernel with its keys split over workgroups (the
flash-decoding split of ``codegen/wgsl/attention/decode.py``) at long query blocks, against
the plain lane kernel and torch's SDPA (f32) in the same process.

Why: at Whisper's 6 heads x 1500 x 64 the lane forward's best plans (2 lanes a row) run 9000
rows x 2 threads, ~4 warps an H200 SM, and 291 us a layer (11.9 TFLOP/s); more lanes a row
were slower (more distinct workgroup-memory addresses per read). A key split keeps each
thread's work and reads as they are and multiplies the threads by the chunk count, for one
merge kernel (~rows x chunks x (Dv + 2) floats read).

Each variant forces a lane plan (``plan.LANE_OVERRIDE``) and a chunk count (1: no split;
``SPLIT_OVERRIDE`` with ``SPLIT_MAX_CHUNKS``; the long split's own choice,
``plan.choose_long_split``, is off), compiles the forward of ``bench/attention.py``,
checks its output against torch and reports the GPU time of the partial kernel, the merge and
their sum (``Session.profile``, median of ``--repeats``).

Usage: python bench/attention_split.py [--quick] [--shapes whisper] [--chunks 1,2,3,4,6,8]
    [--plans 32x2x16,64x2x16,16x2x16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import CASES, build, flops, inputs  # noqa: E402
from bench.common import (  # noqa: E402
    add_args,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    start,
    time_torch,
    to_numpy,
)


def _plans(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in text.split(",") if p]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "attention_split", repeats=20, warmup=5)
    ap.add_argument("--shapes", default="whisper", help="bench/attention.py CASES names")
    ap.add_argument("--chunks", default="1,2,3,4,6,8", help="key chunks (1: no split)")
    ap.add_argument("--plans", default="32x2x16,64x2x16,16x2x16,32x1x8",
                    help="lane plans rows x lanes x tile")  # fmt: skip
    args = ap.parse_args(argv)
    resolve_args(args)
    from meganeura.codegen.wgsl.attention import plan as attention_plan
    from meganeura.training import compile_for

    device, torch, dev, rec = start(args)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    chunks = [int(c) for c in args.chunks.split(",")]
    plans = _plans(args.plans)
    for name, b, hq, hkv, lq, lk, d, causal in CASES:
        if name not in args.shapes.split(","):
            continue
        if args.quick:
            lq = lk = 96
        arrays = inputs(b, hq, hkv, lq, lk, d)
        tt = {n: torch.from_numpy(a).to(dev) for n, a in arrays.items()}
        gqa = hq != hkv

        def t_fwd(tt=tt, causal=causal, gqa=gqa):
            return sdpa(tt["q"], tt["k"], tt["v"], is_causal=causal, enable_gqa=gqa)

        with torch.no_grad():
            ref = to_numpy(t_fwd())
            torch_ms = time_torch(t_fwd, dev, args.warmup, args.repeats)["median"]
        work = flops(b, hq, lq, lk, d, causal)
        shape = f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
        print(f"\n{name}: {shape}; torch sdpa f32 {torch_ms * 1e3:.1f} us")
        print(f"{'plan':<10} {'chunks':>6} {'partial':>8} {'merge':>8} {'sum us':>8} "
              f"{'TFLOP/s':>8} {'vs torch':>8} {'err':>8}")  # fmt: skip
        for plan in plans:
            for nc in chunks:
                # the forced split (SPLIT_OVERRIDE) in exactly nc chunks, or none at all: the
                # long split's own rule and table (choose_long_split) stay out of the variants
                attention_plan.LANE_OVERRIDE["fwd"] = plan
                attention_plan.SPLIT_OVERRIDE = nc > 1
                long_split = attention_plan.LONG_SPLIT_OVERRIDE
                attention_plan.LONG_SPLIT_OVERRIDE = False
                saved = attention_plan.SPLIT_MAX_CHUNKS, attention_plan.SPLIT_TARGET_GROUPS
                attention_plan.SPLIT_MAX_CHUNKS, attention_plan.SPLIT_TARGET_GROUPS = nc, 1 << 30
                try:
                    graph = build(b, hq, hkv, lq, lk, d, causal, False)
                    program, sess = compile_for(graph, device=device)
                except ValueError as exc:  # a plan the adapter cannot run
                    print(f"{'x'.join(map(str, plan)):<10} {nc:>6} skipped: {exc}")
                    continue
                finally:
                    attention_plan.LANE_OVERRIDE.pop("fwd", None)
                    attention_plan.SPLIT_OVERRIDE = None
                    attention_plan.LONG_SPLIT_OVERRIDE = long_split
                    attention_plan.SPLIT_MAX_CHUNKS, attention_plan.SPLIT_TARGET_GROUPS = saved
                try:
                    sess.load_state_dict({n: arrays[n] for n in ("q", "k", "v")})
                    err = rel_err(sess.run({}, fetch=("o",))["o"], ref)
                    preds = {
                        "merge": lambda n: "merge" in n,
                        "partial": lambda n: "merge" not in n,
                    }
                    prof = profile_ms(sess, {}, args.warmup, args.repeats, preds)
                finally:
                    sess.close()
                kernels = [x.name for x in program.dispatches]
                ms = prof["all"]["median"]
                label = "x".join(map(str, plan))
                row = result(
                    f"sdpa_fwd_{name}_{label}_c{nc}",
                    "ms",
                    ms,
                    torch_ms,
                    shape=shape,
                    plan=list(plan),
                    chunks=nc,
                    partial_ms=prof["partial"]["median"],
                    merge_ms=prof["merge"]["median"],
                    tflops=work / ms / 1e9,
                    rel_err=err,
                    kernels=kernels,
                )
                rec.add(
                    row,
                    f"{label:<10} {nc:>6} {prof['partial']['median'] * 1e3:8.1f} "
                    f"{prof['merge']['median'] * 1e3:8.1f} {ms * 1e3:8.1f} "
                    f"{row['tflops']:8.2f} {row['speedup']:8.2f} {err:8.1e}",
                )
    rec.finish()
    return {r["case"]: r for r in rec.rows}


if __name__ == "__main__":
    main()
