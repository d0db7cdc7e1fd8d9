"""Benchmark: the attention kernels with their streams split over workgroups at long sequences:
the forward (the flash-decoding split of ``codegen/wgsl/attention/decode.py``) and the query
gradient (``dq_split``) split their keys (``splits.choose_long_split``), dk and dv on the half
kernel their queries (``dkv_half.choose_query_split``); against the unsplit kernel and torch
(f32) in the same process.

Why: at Whisper's 6 heads x 1500 x 64 the lane forward's best plans (2 lanes a row) run 9000
rows x 2 threads, ~4 warps an H200 SM, and 291 us a layer (11.9 TFLOP/s); more lanes a row
were slower (more distinct workgroup-memory addresses per read). A key split keeps each
thread's work and reads as they are and multiplies the threads by the chunk count, for one
merge kernel (~rows x chunks x (Dv + 2) floats read; dq: a sum of rows x chunks x D). dq's
plain kernel (32 x 2 x 16 at Whisper) has the same thread count.

Each variant forces a lane plan (``plan.LANE_OVERRIDE``), a chunk count (1: no split;
``splits.LONG_SPLIT_CHUNKS``, ahead of the long split's own table and rule; dkv:
``dkv_half.QUERY_SPLIT_CHUNKS`` on the half kernel's own plan; 0: the lane kernels, fused or
apart as the shape gets them without the half kernel) and whether the chunks
prefetch their next key tile (``tile_loads.set_split_prefetch``; dkv half's chunks prefetch
as its whole kernel does), compiles the forward of ``bench/attention.py`` (``--modes fwd``)
or its training graph (``dq``, ``dkv``: only that mode's kernels are timed), checks the
output (o, dq or dk) against torch and reports the GPU time of the
partial kernel, the merge or sum and their total (``Session.profile``, median of
``--repeats``). torch's column is its SDPA forward (fwd) or forward plus backward (dq, dkv).

Usage: python bench/attention_split.py [--quick] [--shapes whisper] [--modes fwd,dq,dkv]
    [--chunks 1,2,3,4,6,8] [--plans 32x2x16,64x2x16,16x2x16] [--prefetch 0,1]
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


def _variant(mode: str, plan, chunks: int, fetching: bool):
    """Switch the compiler to ``mode``'s lane ``plan`` in ``chunks`` key chunks (1: unsplit;
    ``splits.LONG_SPLIT_CHUNKS``, ahead of the long split's own table and rule) with the chunks
    prefetching or not; returns the function that puts every switch back."""
    from meganeura.codegen.wgsl.attention import dkv_half, tile_loads
    from meganeura.codegen.wgsl.attention import plan as attention_plan
    from meganeura.codegen.wgsl.attention import splits as attention_splits

    if mode == "dkv":  # the half kernel's own plan, its query chunks; 0: the lane kernels
        saved_half = attention_plan.DKV_HALF, dkv_half.QUERY_SPLIT_CHUNKS[0]
        attention_plan.DKV_HALF = chunks > 0
        dkv_half.QUERY_SPLIT_CHUNKS[0] = max(chunks, 1)

        def restore_half() -> None:
            attention_plan.DKV_HALF, dkv_half.QUERY_SPLIT_CHUNKS[0] = saved_half

        return restore_half
    saved = (attention_plan.LANE_OVERRIDE.get(mode), attention_splits.LONG_SPLIT_CHUNKS.get(mode))
    prefetching = tile_loads.SPLIT_PREFETCH[0]
    attention_plan.LANE_OVERRIDE[mode] = plan
    attention_splits.LONG_SPLIT_CHUNKS[mode] = chunks
    tile_loads.set_split_prefetch(fetching)

    def restore() -> None:
        for table, value in zip((attention_plan.LANE_OVERRIDE, attention_splits.LONG_SPLIT_CHUNKS),
                                saved, strict=True):  # fmt: skip
            if value is None:
                table.pop(mode, None)
            else:
                table[mode] = value
        tile_loads.set_split_prefetch(prefetching)

    return restore


def _is_mode(mode: str):
    """Predicate on dispatch names: the kernels of ``mode`` (the forward's partial kernel or
    plain kernel and its merge; dq's, with or without its delta, and their sum)."""
    if mode == "dq":
        return lambda n: "backward_query" in n
    if mode == "dkv":  # dk and dv, fused or apart
        return lambda n: "backward_key" in n or "backward_value" in n
    return lambda n: "backward" not in n and "scaled_dot_product_attention" in n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "attention_split", repeats=20, warmup=5)
    ap.add_argument("--shapes", default="whisper", help="bench/attention.py CASES names")
    ap.add_argument("--modes", default="fwd", help="fwd (the forward), dq (the query gradient "
                    "of a training step, which computes its delta), dkv (dk and dv on the "
                    "half kernel, its query rows split; --plans and --prefetch do not "
                    "apply)")  # fmt: skip
    ap.add_argument("--chunks", default="1,2,3,4,6,8",
                    help="key chunks (1: no split); dkv: query chunks of the half kernel, 0 "
                    "the lane dk/dv kernels the shape gets without it")  # fmt: skip
    ap.add_argument("--plans", default="32x2x16,64x2x16,16x2x16,32x1x8",
                    help="lane plans rows x lanes x tile")  # fmt: skip
    ap.add_argument("--prefetch", default="0", help="split chunks prefetching: 0, 1 or 0,1")
    args = ap.parse_args(argv)
    resolve_args(args)
    from meganeura.training import compile_for

    device, torch, dev, rec = start(args)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    chunks = [int(c) for c in args.chunks.split(",")]
    plans = _plans(args.plans)
    fetches = [bool(int(x)) for x in args.prefetch.split(",")]
    for name, b, hq, hkv, lq, lk, d, causal in CASES:
        if name not in args.shapes.split(","):
            continue
        if args.quick:  # lavapipe: short rows and a narrow head, shaders it compiles fast
            lq, lk, d = 96, 96, 16
        arrays = inputs(b, hq, hkv, lq, lk, d)
        tt = {n: torch.from_numpy(a).to(dev) for n, a in arrays.items()}
        gqa = hq != hkv
        shape = f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
        for mode in args.modes.split(","):
            if mode == "fwd":

                def t_side(tt=tt, causal=causal, gqa=gqa):
                    return sdpa(tt["q"], tt["k"], tt["v"], is_causal=causal, enable_gqa=gqa)

                with torch.no_grad():
                    ref = to_numpy(t_side())
                work, fetch = flops(b, hq, lq, lk, d, causal), "o"
            else:  # dq or dk of sum(o * go): torch's forward and backward, ours' kernels
                which = "q" if mode == "dq" else "k"
                x = tt[which].clone().requires_grad_(True)

                def t_side(x=x, which=which, tt=tt, causal=causal, gqa=gqa):
                    qkv = {**tt, which: x}
                    o = sdpa(qkv["q"], qkv["k"], qkv["v"], is_causal=causal, enable_gqa=gqa)
                    return torch.autograd.grad(o, x, tt["go"])[0]

                ref = to_numpy(t_side())
                # per (query, key) pair: dq 3 d-dots, dk + dv 4 (of the forward's 2)
                work = (1.5 if mode == "dq" else 2.0) * flops(b, hq, lq, lk, d, causal)
                fetch = "d" + which
            torch_ms = time_torch(t_side, dev, args.warmup, args.repeats)["median"]
            what = "sdpa" if mode == "fwd" else "forward + backward"  # its column's scope
            print(f"\n{name} {mode}: {shape}; torch {what} f32 {torch_ms * 1e3:.1f} us")
            print(f"{'plan':<10} {'chunks':>6} {'pref':>4} {'partial':>8} {'merge':>8} "
                  f"{'sum us':>8} {'TFLOP/s':>8} {'vs torch':>8} {'err':>8}")  # fmt: skip
            for plan in plans if mode != "dkv" else [(32, 2, 16)]:  # dkv half's own plan
                for nc in chunks:
                    if nc == 0 and mode != "dkv":  # the unsplit kernel is chunk count 1
                        continue
                    for fetching in fetches if nc > 1 and mode != "dkv" else fetches[:1]:
                        restore = _variant(mode, plan, nc, fetching)
                        try:
                            graph = build(b, hq, hkv, lq, lk, d, causal, mode != "fwd")
                            program, sess = compile_for(graph, device=device)
                        except ValueError as exc:  # a plan the adapter cannot run
                            print(f"{'x'.join(map(str, plan)):<10} {nc:>6} skipped: {exc}")
                            continue
                        finally:
                            restore()
                        variant = (name, plan, nc, fetching, shape, work, torch_ms)
                        rec.add(*_measure(args, sess, program, arrays, mode, fetch, ref, variant))
    rec.finish()
    return {r["case"]: r for r in rec.rows}


def _measure(args, sess, program, arrays, mode, fetch, ref, variant) -> tuple[dict, str]:
    """(result row, printed line) of one compiled variant: its output against torch's, the GPU
    time of its partial (or plain) kernel and of its merge or sum."""
    name, plan, nc, fetching, shape, work, torch_ms = variant
    mine = _is_mode(mode)
    try:
        names = ("q", "k", "v") if mode == "fwd" else ("q", "k", "v", "go")
        sess.load_state_dict({n: arrays[n] for n in names})
        feeds: dict = {}
        err = rel_err(sess.run(feeds, fetch=(fetch,))[fetch], ref)
        preds = {
            "mode": mine,
            "merge": lambda n: mine(n) and (" merge " in n or " sum " in n),
        }
        prof = profile_ms(sess, feeds, args.warmup, args.repeats, preds)
    finally:
        sess.close()
    kernels = [x.name for x in program.dispatches if mine(x.name)]
    ms, merge = prof["mode"]["median"], prof["merge"]["median"]
    label = "lane" if mode == "dkv" and nc == 0 else "x".join(map(str, plan))
    tag = f"sdpa_{mode}"
    row = result(
        f"{tag}_{name}_{label}_c{nc}{'_prefetch' if fetching else ''}",
        "ms",
        ms,
        torch_ms,
        shape=shape,
        mode=mode,
        plan=list(plan),
        chunks=nc,
        prefetch=fetching,
        partial_ms=ms - merge,
        merge_ms=merge,
        tflops=work / ms / 1e9,
        rel_err=err,
        kernels=kernels,
    )
    line = (
        f"{label:<10} {nc:>6} {int(fetching):>4} {(ms - merge) * 1e3:8.1f} {merge * 1e3:8.1f} "
        f"{ms * 1e3:8.1f} {row['tflops']:8.2f} {row['speedup']:8.2f} {err:8.1e}"
    )
    return row, line


if __name__ == "__main__":
    main()
