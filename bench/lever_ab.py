"""A/B of the compiler's dispatch levers on the workloads' own programs, ours only, in one
process: each lever's program compiled with it on and off, then timed interleaved (on, off;
off, on; ...) so clock drift and the other side's warm-up fall on both alike.

Each lever is a switch read when a program compiles (``LEVERS``); "off" compiles the workload
case with that one lever off and everything else as shipped, "on" as shipped. ``--all``
compares everything on against all of the chosen levers off. Times are ``bench/workloads.py``'s
(``cell._ours_side``: a forward call and a device sync, or a training step with its loss read),
median and min of ``--rounds`` x ``--repeats`` calls after ``--warmup``, with the rounds
alternating which side goes first and, as a cell, ``--warm-seconds`` of calls first (both sides
in turn) so the GPU's clocks have ramped up; dispatch counts from the compiled programs.

Why the heat and the alternation: the on side used to be timed first in every round, the
first round right after the off side's compile had left the GPU idle, so a slow start (the
clocks ramping up, the likeliest reading; not measured per call on the H200) fell on it alone.
W2 fwd (143 short dispatches) with ``resident_inputs`` measured on 4.31 ms against off 2.58
on the H200 (``lever_ab_h200_resident.json``) although on's min, 2.33 ms, was below off's 2.45
and the same program measured 2.50 ms in its own cell: its timed calls do strictly less host
work than off's (no uploads, no Session reopened; ``tests/bench/test_lever_ab.py``), but its
median/min was 1.85 against off's 1.05 (1.36 and 1.19 against 1.17 and 1.13 in two earlier
W2 fwd rows).

Usage:
    python bench/lever_ab.py --cases w3:train_b4,w5:fwd_small_b2 --levers conv_norm,conv_epilogue
    python bench/lever_ab.py --cases w1:fwd_seq128 --levers norm_prologue,sum_runs --all
    python bench/lever_ab.py --quick   # the CPU-sized cases on lavapipe (a smoke test)

Writes ``bench/results/lever_ab_<machine>.json`` (``--quick``: under ``results/quick/``;
``--out``) and prints one line per case and lever: ms on / off, the ratio off / on (> 1: the
lever pays) and the dispatch counts; the file's rows also hold each side's median per round
(``rounds_on``, ``rounds_off``), where a side slow in some rounds only shows.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# lever -> (module, how to switch it); each is read when a program compiles
LEVERS = {
    "norm_prologue": ("meganeura.codegen.wgsl.norm.prologue", "set_enabled"),
    "conv_norm": ("meganeura.codegen.wgsl.norm.conv_prologue", "set_enabled"),
    "conv_epilogue": ("meganeura.passes.fuse_conv", "set_enabled"),
    "sum_runs": ("meganeura.codegen.wgsl.matmul.summing", "set_enabled"),
    "attention_sums": ("meganeura.codegen.wgsl.attention.summed", "set_enabled"),
    # off: the attention sums partials however often its row tiles re-read them (untimed)
    "attention_rereads": ("meganeura.codegen.wgsl.attention.summed", "set_bounded"),
    "broadcast_views": ("meganeura.passes.broadcast_views", "set_enabled"),
    "weight_grads": ("meganeura.codegen.wgsl.matmul.tiled_rgroup", "set_enabled"),
    "sum_groups": ("meganeura.codegen.wgsl.matmul.split_group", "set_sum_groups"),
    "split_sums": ("meganeura.codegen.wgsl.matmul.deferred", "set_enabled"),
    "residual": ("meganeura.passes.fuse_norm", "RESIDUAL"),
    "split_members": ("meganeura.codegen.wgsl.matmul.tiled_group", "set_split_members"),
    "conv_phases": ("meganeura.codegen.wgsl.conv.lowering", "MERGE_PHASES"),
    "delta_in_dq": ("meganeura.codegen.wgsl.attention.dq_delta", "set_enabled"),
    # off: query-row attention loops load each key tile after the barrier, not before (untimed)
    "attention_prefetch": ("meganeura.codegen.wgsl.attention.lane_stream", "set_prefetch"),
    # off: the automatic lane plans instead of the measured ones (the device's tuning cache,
    # attention/tuned.py)
    "attention_tuned": ("meganeura.codegen.wgsl.attention.plan", "set_tuned"),
    # off: a norm read only by a left-shared matmul group keeps its own dispatch instead of
    # being the group's prologue (candidate for W4: its fc1 with the prologue runs at 13
    # TFLOP/s, fc2 without at 18)
    "matmul_norm_prologue": ("meganeura.passes.fuse_matmul", "set_prologues"),
    # off: tiled groups take the norm as a prologue again (W4 fwd 5.3% slower on the H200)
    "tiled_norms_apart": ("meganeura.passes.fuse_matmul", "set_tiled_norms_apart"),
    # off: timed inference calls upload their inputs every call instead of reading inputs
    # written once to the Session (a harness switch, not the compiler's)
    "resident_inputs": ("bench.workloads_lib.ours", "set_resident_inputs"),
    # off: dkv half streams 32-entry query tiles instead of 16 (q and dO prefetched; W4 train
    # 12.54 against 11.28 ms on the H200, lever_ab_h200_tile16.json)
    "dkv_half_tile16": ("meganeura.codegen.wgsl.attention.dkv_half", "set_short_tiles"),
    # off: every kernel its own dispatch instead of independent neighbours packed into one
    # (meganeura.schedule.pack: W1 train 919 -> 739 dispatches, W3 train 588 -> 355)
    "pack": ("meganeura.schedule.pack", "set_enabled"),
    # off: runs pack neighbours only, instead of also taking members from up to 4 dispatches
    # on that commute with those they pass (W3 train 355 -> 346 dispatches, W4 train 158 -> 141)
    "pack_lookahead": ("meganeura.schedule.pack", "set_lookahead"),
    # off: the non-finite guard's pass over every gradient loads one element a thread per
    # iteration instead of four strides at once (W2 train: 147 us, 2.7 TB/s, with one)
    "found_inf_unroll": ("meganeura.codegen.wgsl.optim", "set_found_inf_unroll"),
    # off: SwiGLU's silu_backward keeps its own dispatch (W1 train 738 -> 768 dispatches,
    # W2 train 361 -> 377) instead of being hoisted into the dh matmul's epilogue group
    "fusion_hoist": ("meganeura.passes.hoist", "set_enabled"),
    # off: each call records its step's command buffers itself instead of ending and
    # submitting those recorded while the GPU ran the call before (Session, read at its
    # creation; W5 fwd's host share was 34%, W4 fwd's 8.9%)
    "pre_encode": ("meganeura.runtime.stepping", "set_pre_encode"),
    # off: a step recorded ahead of 32 to 80 dispatches goes as one command buffer instead of
    # its first 16 and the rest (finishing costs ~3 us a dispatch on the H200: W4 fwd 122 us)
    "split_short": ("meganeura.runtime.stepping", "set_split_short"),
    # off: a long forward (and, since the eighth session, its query gradient) runs the plain
    # lane kernel instead of its keys split over workgroups plus a merge (W4 fwd: 283 -> 225
    # us a layer in isolation)
    "attention_long_split": ("meganeura.codegen.wgsl.attention.splits", "set_long_split"),
    # off: a long query gradient runs the plain lane kernel (forwards split as shipped)
    "attention_dq_split": ("meganeura.codegen.wgsl.attention.splits", "set_dq_split"),
    # off: dkv half streams each query head's rows in one workgroup per key tile instead of
    # in chunks over workgroups plus a sum
    "attention_dkv_split": ("meganeura.codegen.wgsl.attention.dkv_half", "set_query_split"),
    # off: the norms' weight-gradient channel sums over long strided rows keep 32 channels a
    # workgroup instead of fewer channels and more threads each (rows.narrowed)
    "narrow_strided_rows": ("meganeura.codegen.wgsl.rowwise.rows", "set_narrow_strided"),
    # off: the chunks of split attention kernels (fwd, dq) never prefetch their next key tile
    # (W4 train, the rule's dq plan: 9.67 ms with, 10.99 without; lever_ab_h200_splits.json)
    # off: an erf GELU (and its gradient) joins its matmul's epilogue like any elementwise op
    # instead of a kernel of its own (W4 fc1 with it: 111.7 us a layer on the H200, the bare
    # product 87.3)
    "erf_apart": ("meganeura.passes.fuse", "set_erf_apart"),
    "attention_split_prefetch": (
        "meganeura.codegen.wgsl.attention.tile_loads",
        "set_split_prefetch",
    ),
}
# the command-line flags of bench/dispatch_counts.py and bench/llm_profile.py: argparse dest ->
# (lever, the flag's value that turns it on); split_members is off by default (measured slower)
FLAGS = {
    "split_sums": ("split_sums", "deferred"),
    "split_members": ("split_members", "join"),
    "conv_phases": ("conv_phases", "merged"),
    "weight_grads": ("weight_grads", "grouped"),
    "sum_groups": ("sum_groups", "on"),
    "residual": ("residual", "on"),
    "norm_prologue": ("norm_prologue", "on"),
    "conv_epilogue": ("conv_epilogue", "on"),
    "sum_runs": ("sum_runs", "on"),
    "conv_norm": ("conv_norm", "on"),
    "broadcast_views": ("broadcast_views", "on"),
    "attention_sums": ("attention_sums", "on"),
    "attention_rereads": ("attention_rereads", "bounded"),
    "delta_in_dq": ("delta_in_dq", "on"),
    "pack": ("pack", "on"),
}
QUICK_CASES = "w3:train_b4,w5:fwd_small_b2"  # the CPU-sized cases of the same names


def switch(lever: str, on: bool) -> None:
    """Turn ``lever`` on or off for programs compiled from now on.

    Raises:
        KeyError: an unknown lever (the message lists ``LEVERS``).
    """
    if lever not in LEVERS:
        raise KeyError(f"unknown lever {lever!r}; levers: {', '.join(LEVERS)}")
    mod, attr = LEVERS[lever]
    module = importlib.import_module(mod)
    target = getattr(module, attr)
    if callable(target):
        target(on)
    elif isinstance(target, list):  # a one-element list switch
        target[:] = [on]
    else:  # a module-level bool
        setattr(module, attr, on)


def apply_flags(args) -> None:
    """Switch every lever whose flag (``FLAGS``) the parsed ``args`` carry."""
    for dest, (lever, on_value) in FLAGS.items():
        if hasattr(args, dest):
            switch(lever, getattr(args, dest) == on_value)


def build(wl, case, quick: bool, off: list[str]):
    """Our side of ``case`` compiled with the levers ``off`` switched off (then back on):
    (side dict of ``cell._ours_side``, dispatch count)."""
    from bench.workloads_lib.cell import _ours_side

    for lever in off:
        switch(lever, False)
    try:
        model, _ = wl.ours_model(case, quick)
        side = _ours_side(wl, case, model, wl.batch(case, quick), "strict", quick)
        side["first"]()  # compiles here, with the switches as set
    finally:
        for lever in off:
            switch(lever, True)
    (session,) = side["sessions"]()
    return side, len(session.program.dispatches)


def heat_all(sides: list[dict], seconds: float) -> int:
    """Call each side's ``run`` in turn (one call each, round robin) until ``seconds`` have
    passed, then sync every side: the GPU under sustained load before the first timed call, as
    ``cell.heat`` does before a cell's (the clocks ramp up under load; a side timed right after
    a compile would otherwise take the ramp alone). Returns the calls made (0 when
    ``seconds`` <= 0)."""
    n = 0
    if seconds <= 0:
        return n
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for side in sides:
            side["run"]()
            n += 1
    for side in sides:
        (side.get("sync") or (lambda: None))()
    return n


def interleaved(
    sides: list[dict], rounds: int, warmup: int, repeats: int, warm_seconds: float = 0.0
) -> list[list[float]]:
    """ms per call of each side (in ``sides``' order; round by round, ``repeats`` a round):
    after :func:`heat_all` for ``warm_seconds``, ``rounds`` rounds, each side ``repeats`` synced
    calls after ``warmup`` unsynced ones in turn. Round ``r`` starts with side ``r mod
    len(sides)``, so no side is always the first timed after another's calls (with two
    sides: on, off; off, on; ...)."""
    out: list[list[float]] = [[] for _ in sides]
    heat_all(sides, warm_seconds)
    for r in range(rounds):
        k = r % len(sides)
        for i in [*range(k, len(sides)), *range(k)]:
            side, times = sides[i], out[i]
            sync = side.get("sync") or (lambda: None)
            for _ in range(warmup):
                side["run"]()
            sync()
            for _ in range(repeats):
                t = time.perf_counter()
                side["run"]()
                sync()
                times.append((time.perf_counter() - t) * 1e3)
    return out


def round_medians(times: list[float], repeats: int) -> list[float]:
    """Median ms of each round of one side's ``times`` (``repeats`` calls a round, in order)."""
    return [statistics.median(times[i : i + repeats]) for i in range(0, len(times), repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="w1:fwd_seq128,w3:train_b4", help="workload:case,...")
    ap.add_argument("--levers", default=",".join(LEVERS), help=f"of {', '.join(LEVERS)}")
    ap.add_argument("--all", action="store_true", help="also all chosen levers off at once")
    ap.add_argument("--only-all", action="store_true", help="only all chosen levers off")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--warm-seconds",
        type=float,
        default=None,
        help="calls of both sides in turn before the rounds, for this long (default 2; quick 0;"
        " as bench/workloads.py's cells): GPU clocks",
    )
    ap.add_argument("--quick", action="store_true", help=f"CPU-sized cases ({QUICK_CASES})")
    ap.add_argument("--machine", default=None, help="file name tag (default from the adapter)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.warm_seconds is None:
        args.warm_seconds = 0.0 if args.quick else 2.0
    from bench.workloads_lib.registry import WORKLOADS

    levers = [x for x in args.levers.split(",") if x]
    for lever in levers:
        if lever not in LEVERS:
            ap.error(f"unknown lever {lever!r}; levers: {', '.join(LEVERS)}")
    variants = [] if args.only_all else [[x] for x in levers]
    if args.all or args.only_all:
        variants.append(levers)
    cases = QUICK_CASES if args.quick and args.cases == ap.get_default("cases") else args.cases
    rows = []
    for spec in cases.split(","):
        wid, _, name = spec.partition(":")
        if wid not in WORKLOADS:
            ap.error(f"--cases {spec!r}: unknown workload {wid!r} (of {', '.join(WORKLOADS)})")
        wl = WORKLOADS[wid]
        case = wl.case(name, args.quick)
        on, n_on = build(wl, case, args.quick, [])
        for off_levers in variants:
            off, n_off = build(wl, case, args.quick, off_levers)
            t_on, t_off = interleaved(
                [on, off], args.rounds, args.warmup, args.repeats, args.warm_seconds
            )
            row = {
                "case": f"{wid}:{name}",
                "off": off_levers,
                "ms_on": statistics.median(t_on),
                "ms_off": statistics.median(t_off),
                "min_on": min(t_on),
                "min_off": min(t_off),
                "dispatches_on": n_on,
                "dispatches_off": n_off,
                "rounds_on": round_medians(t_on, args.repeats),
                "rounds_off": round_medians(t_off, args.repeats),
            }
            row["off_over_on"] = row["ms_off"] / row["ms_on"]
            rows.append(row)
            print(
                f"{row['case']:<20} off: {'+'.join(off_levers):<40} on {row['ms_on']:8.3f} ms"
                f" ({n_on})  off {row['ms_off']:8.3f} ms ({n_off})"
                f"  off/on {row['off_over_on']:.3f}",
                flush=True,
            )
    from bench.conv_sweep import machine_tag
    from meganeura.runtime.device import get_device

    adapter = get_device().name
    tag = args.machine or ("quick" if args.quick else machine_tag(adapter))
    results = Path(__file__).parent / "results"
    default = (
        results / "quick" / "lever_ab.json" if args.quick else results / f"lever_ab_{tag}.json"
    )
    out = Path(args.out or default)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "adapter": adapter,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "warm_seconds": args.warm_seconds,
        "rows": rows,
    }
    from bench.common import write_json

    write_json(out, doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
