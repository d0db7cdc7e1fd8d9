"""Benchmark sweep: lane plans (rows, lanes, tile) of every flash-attention kernel the
workloads run, at the workloads' shapes, against the automatic plan (``attention.plan``).

Shapes (docs/workloads.md): smollm2 (B1 Hq9 Hkv3 L128 D64 causal), smolvla_self (B1 Hq15 Hkv5
L50 D64 causal), smolvla_cross (B1 Hq15 Hkv5 Lq50 Lk16 D64 full) and whisper (B1 H6 L1500 D64
full, ``WHISPER_PLANS`` plans per kernel only).

Kernels ("labels", the dispatch name's last token) and the programs holding them:
  * ``train``: three independent attentions of the shape (``build_train``): one with the
    gradients of q, k and v (fwd+lse, dq+delta, and dk and dv in one pass: dkv, with
    ``FUSE_KEY_VALUE`` True and ``DKV_HALF`` False), one with only k's (dk) and one with only
    v's (dv), so one compile times every training kernel; the three fwd+lse kernels are the
    same kernel, their times averaged per run;
  * ``fwd``: the forward alone (inference programs): fwd; timed for the default and the
    ``FWD_ONLY_BEST`` fastest fwd+lse plans only (same mode, same plan key).
One compile times one plan per mode at once (``plan.LANE_OVERRIDE`` per mode: a "round" pops
the next plan of each mode's queue); a mode whose queue is empty runs its default plan (one
more default sample).

Plans per (shape, mode): threads in {32, 64, 128, 256}, lanes powers of two up to the stream
length (and the threads), rows = threads / lanes (at most the rows there are), tile = lanes * k
for k in 1, 2, 4, 8 with tile <= 64, at most the stream and at least min(16, 8 * lanes, the
stream), fitting the adapter (``plan.check_plan``); ordered by distance from the default plan
(|log2| steps of threads, lanes and tile), nearest first, at most ``--cap``. The budget
(``--budget-s``, shared among the shapes still to run, Whisper taking a smaller ``SHARE``,
unused time passing on) stops a shape's rounds cleanly (keeping time for the forward-only
programs), so a cut run loses the farthest plans first. A program that fails to compile or
run is recorded (``programs[].error``) and the sweep goes on.

Each program: outputs and q/k/v gradients checked against float64 torch (numpy when torch is
missing), then ``Session.profile`` per-kernel GPU times (median over ``--repeats`` after
``--warmup``), printed as one line per program (``*``: the default plan). Writes
``bench/results/attention_plans_<machine>.json`` (``--quick``: under ``bench/results/quick/``)
through a temporary name after each program, and prints the best plan per (shape, kernel)
against the default after each shape.

``--record`` then writes, per (shape, mode), the best plan into this device's tuning cache
(``meganeura.tune.cache``: the ``attention`` table of its file, which every later compile on
this adapter reads through ``Limits.attention_plans``) where it beat the default plan by
``MIN_GAIN`` (3%) in medians that include ``--confirm`` (2) more samples of both, timed
after the rounds, interleaved (the best of many plans, each timed once, is biased low), and
removes an entry of that key where the default won. The ``fwd`` mode is
decided by the fwd+lse kernel (the training programs', timed for every plan), ``dq`` by
dq+delta; the forward-only ``fwd`` label shares the fwd mode and is not consulted. The cache
folder is the library's default, ``~/.cache/meganeura/tuning``, the one the other benchmark
scripts read (whatever ``MEGANEURA_CACHE_DIR`` says: docs/tuning.md).

Usage: python bench/attention_plans.py [--quick] [--budget-s 230] [--cap 40] [--whisper-cap 6]
    [--repeats 10] [--warmup 3] [--shapes smollm2,smolvla_self] [--out-name NAME | --out PATH]
    [--record]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import CASES, build, inputs  # noqa: E402
from bench.attention_plans_summary import (  # noqa: E402
    LABELS,
    _dims,
    best_overrides,
    print_table,
    record,
    summarize,
)
from bench.common import (  # noqa: E402
    RESULTS,
    add_args,
    kernels_apart,
    machine,
    resolve_args,
    versions,
)

# name, B, Hq, Hkv, Lq, Lk, D, causal: bench/attention.py's workload shapes, Whisper's long
# kernels last (a cut budget loses its plans, not the short shapes')
SHAPES = sorted(CASES, key=lambda c: c[0] == "whisper")
QUICK_SHAPES = [  # lavapipe smoke test
    ("smollm2_l24_d32", 1, 9, 3, 24, 24, 32, True),
    ("smolvla_cross_l12x8_d32", 1, 15, 5, 12, 8, 32, False),
]
WHISPER_PLANS = 6  # the sweep times only the nearest few plans at Whisper (long kernels)
SHARE = {"whisper": 0.4}  # a shape's share of the budget left (others 1; unused time passes on)
QUICK_PLANS = 2
FWD_ONLY_BEST = 4
THREADS = (32, 64, 128, 256)
MAX_TILE = 64
TOL = 1e-4  # relative L2 error above which a plan's program counts as wrong

TRAIN_MODES = ("fwd", "dq", "dkv", "dk", "dv")
# output -> the reference it is checked against
TRAIN_OUTPUTS = {"o": "o", "dq": "dq", "dk": "dk", "dv": "dv", "dk_k": "dk", "dv_v": "dv"}


def build_train(b, hq, hkv, lq, lk, d, causal):
    """Three independent attentions of one shape in one graph, from parameters q, k, v, go
    (suffix ``_k``, ``_v`` for the second and third): outputs o, dq, dk, dv of the first
    (dk and dv fuse into dkv), dk_k of the second and dv_v of the third (each alone: the dk
    and dv kernels)."""
    import meganeura as mn
    import meganeura.nn.functional as F
    from meganeura.autodiff import differentiate

    g = mn.GraphBuilder()
    loss, wrt = None, []
    for tag, want in (("", "qkv"), ("_k", "k"), ("_v", "v")):
        q = g.parameter("q" + tag, (b, hq, lq, d))
        k = g.parameter("k" + tag, (b, hkv, lk, d))
        v = g.parameter("v" + tag, (b, hkv, lk, d))
        go = g.parameter("go" + tag, (b, hq, lq, d))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        if not tag:
            g.output("o", o)
        part = F.sum(o * go)
        loss = part if loss is None else loss + part
        wrt += [n + tag for n in want]
    graph, grads = differentiate(g.build_unverified(), loss.id, wrt)
    gb = mn.GraphBuilder(graph)
    for name in wrt:
        gb.output("d" + name, gb.tensor(grads[graph.find(name).id]))
    return gb.build_unverified()


def log2(n: int) -> int:
    return n.bit_length() - 1


def candidates(mode, dims, limits, default, cap: int) -> list[tuple[int, int, int]]:
    """The plans to time for ``mode`` (see the module docstring), nearest the default first,
    at most ``cap``; the default plan itself is left out (it is timed in every run)."""
    from meganeura.codegen.wgsl.attention.plan import Plan, check_plan, extents
    from meganeura.codegen.wgsl.core.layout import next_pow2

    n_rows, n_stream = extents(mode, dims)
    rows_max, stream = next_pow2(n_rows), next_pow2(n_stream)
    out = []
    for threads in THREADS:
        lanes = 1
        while lanes <= min(threads, stream):
            rows = threads // lanes
            for k in (1, 2, 4, 8):
                tile = lanes * k
                low = min(16, 8 * lanes, stream)
                if rows > rows_max or tile > MAX_TILE or tile > max(lanes, stream) or tile < low:
                    continue
                plan = Plan(rows, lanes, tile)
                if plan == default:
                    continue
                try:
                    check_plan(mode, dims, plan, limits)
                except ValueError:
                    continue
                out.append(plan)
            lanes *= 2

    def distance(p):
        return (
            abs(log2(p.size) - log2(default.size))
            + abs(log2(p.lanes) - log2(default.lanes))
            + abs(log2(p.tile) - log2(default.tile))
        )

    out.sort(key=lambda p: (distance(p), p.size, p.lanes, p.tile))
    return [(p.rows, p.lanes, p.tile) for p in out[:cap]]


def reference(arrays, hq, hkv, causal, scale) -> dict[str, np.ndarray]:
    """o, dq, dk, dv of ``sum(sdpa(q, k, v) * go)`` in float64: torch on the CPU if it is
    installed, else numpy."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = {n: torch.tensor(arrays[n], dtype=torch.float64, requires_grad=n != "go")
             for n in ("q", "k", "v", "go")}  # fmt: skip
        o = torch.nn.functional.scaled_dot_product_attention(
            t["q"], t["k"], t["v"], is_causal=causal, enable_gqa=hq != hkv
        )
        (o * t["go"]).sum().backward()
        return {"o": o.detach().numpy(), **{"d" + n: t[n].grad.numpy() for n in "qkv"}}
    g = hq // hkv
    q, go = (arrays[n].astype(np.float64) for n in ("q", "go"))
    k, v = (np.repeat(arrays[n].astype(np.float64), g, axis=1) for n in ("k", "v"))
    s = q @ k.swapaxes(-1, -2) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.arange(lk)[None, :] > np.arange(lq)[:, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dp = go @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = ds @ k * scale
    dk = (ds.swapaxes(-1, -2) @ q * scale).reshape(k.shape[0], hkv, g, *k.shape[2:]).sum(2)
    dv = (p.swapaxes(-1, -2) @ go).reshape(v.shape[0], hkv, g, *v.shape[2:]).sum(2)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


def rel_l2(ours, ref) -> float:
    a, b = np.asarray(ours, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class Sweep:
    """Compiles and times one program per call, collecting rows and writing the result file."""

    def __init__(self, args, device):
        from meganeura.training.graph import device_limits

        self.args, self.device = args, device
        self.limits = device_limits(device)
        self.rows: list[dict] = []
        self.programs: list[dict] = []
        self.summary: dict[str, dict] = {}
        self.t0 = time.perf_counter()
        name = args.out_name or f"attention_plans_{machine_tag(device)}"
        self.path = (RESULTS / "quick" if args.quick else RESULTS) / f"{name}.json"
        if getattr(args, "out", None):
            self.path = Path(args.out)

    def run(self, shape, arrays, ref, program: str, override: dict[str, tuple]) -> None:
        """``_run``, recording an exception (a plan the driver rejects) instead of raising."""
        try:
            self._run(shape, arrays, ref, program, override)
        except Exception as e:  # noqa: BLE001 - one bad plan must not end the sweep
            print(f"  ERROR {shape[0]} {program} {override}: {type(e).__name__}: {e}")
            self.programs.append({"shape": shape[0], "program": program,
                                  "override": {m: list(p) for m, p in override.items()},
                                  "error": f"{type(e).__name__}: {e}"})  # fmt: skip

    def _run(self, shape, arrays, ref, program: str, override: dict[str, tuple]) -> None:
        """Compile ``program`` ("train" or "fwd") of ``shape`` with ``override`` (mode ->
        plan), check it, profile it; one row per lane kernel label."""
        from meganeura.codegen.wgsl.attention import plan as P
        from meganeura.codegen.wgsl.attention.plan import choose_plan
        from meganeura.training import compile_for

        name, b, hq, hkv, lq, lk, d, causal = shape
        train = program == "train"
        graph = build_train(*shape[1:]) if train else build(b, hq, hkv, lq, lk, d, causal, False)
        P.LANE_OVERRIDE.clear()
        P.LANE_OVERRIDE.update(override)
        P.FUSE_KEY_VALUE, P.DKV_HALF = True, False
        t = time.perf_counter()
        try:
            prog, sess = compile_for(graph, device=self.device)
        finally:
            P.LANE_OVERRIDE.clear()
            P.FUSE_KEY_VALUE, P.DKV_HALF = None, None
        compile_s = time.perf_counter() - t
        outputs = TRAIN_OUTPUTS if train else {"o": "o"}
        feeds = {n + tag: arrays[n] for n in ("q", "k", "v", "go") for tag in ("", "_k", "_v")}
        try:
            sess.load_state_dict(feeds if train else {n: arrays[n] for n in "qkv"})
            t = time.perf_counter()
            out = sess.run({}, fetch=tuple(outputs))
            first_run_s = time.perf_counter() - t  # creates the pipelines
            errs = {n: rel_l2(out[n], ref[r]) for n, r in outputs.items()}
            prof = sess.profile({}, repeats=self.args.repeats, warmup=self.args.warmup)
        finally:
            sess.close()
        # label -> per run [sum, count] (the three fwd+lse kernels are one kernel: averaged)
        acc: dict[str, list[list[float]]] = {}
        for tm in prof.timings:
            parts = tm.name.split()
            if len(parts) >= 3 and parts[1].startswith("scaled_dot_product_attention"):
                runs = acc.setdefault(parts[2], [[0.0, 0] for _ in range(prof.repeats)])
                runs[tm.repeat][0] += tm.duration_ns / 1e3
                runs[tm.repeat][1] += 1
        dims = _dims(shape)
        ok = max(errs.values()) <= TOL
        line = []
        for label, mode in LABELS.items():
            if label not in acc or (label == "fwd") == train:
                continue
            if mode in override:
                plan = tuple(override[mode])
            else:
                p = choose_plan(mode, dims, self.limits)
                plan = (p.rows, p.lanes, p.tile)
            us = [total / max(count, 1) for total, count in acc[label]]
            self.rows.append({
                "shape": name, "label": label, "mode": mode, "program": program,
                "plan": list(plan), "threads": plan[0] * plan[1],
                "default": mode not in override, "us": statistics.median(us),
                "us_min": min(us), "n": len(us), "ok": ok,
            })  # fmt: skip
            tag = "x".join(map(str, plan)) + ("*" if mode not in override else "")
            line.append(f"{label} {tag} {statistics.median(us):.1f}")
        self.programs.append({"shape": name, "program": program,
                              "override": {m: list(p) for m, p in override.items()},
                              "compile_s": round(compile_s, 3),
                              "first_run_s": round(first_run_s, 3), "rel_errs": errs,
                              "kernels": [x.name for x in prog.dispatches
                                          if "attention" in x.name]})  # fmt: skip
        print(f"  {name} {program} ({compile_s + first_run_s:.1f} s): {', '.join(line)} us"
              f"{'' if ok else f'  WRONG rel_err {errs}'}", flush=True)  # fmt: skip
        self.write(complete=False)

    def write(self, complete: bool) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            host = machine(self.device)
        except ImportError:  # machine() asks torch for its device
            host = {"adapter": self.device.name}
        doc = {
            "machine": host,
            "versions": versions(),
            "complete": complete,
            "quick": bool(self.args.quick),
            "budget_s": self.args.budget_s,
            "cap": self.args.cap,
            "repeats": self.args.repeats,
            "warmup": self.args.warmup,
            "wall_seconds": round(time.perf_counter() - self.t0, 2),
            "compiles": len(self.programs),
            "compile_s_total": round(sum(p.get("compile_s", 0) for p in self.programs), 2),
            "first_run_s_total": round(sum(p.get("first_run_s", 0) for p in self.programs), 2),
            "errors": sum("error" in p for p in self.programs),
            "summary": self.summary,
            "rows": self.rows,
            "programs": self.programs,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.path)


def machine_tag(device) -> str:
    """``h200`` for an NVIDIA H200, else the adapter name's first word, lower case."""
    name = device.name
    m = re.search(r"\b([A-Z]\d{2,4})\b", name)
    if m:
        return m.group(1).lower()
    word = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_").split("_")[0]
    return word or "unknown"


def sweep_shape(sw: Sweep, shape, deadline: float, cap: int) -> None:
    """The rounds of one shape until its queues are empty or ``deadline`` (perf_counter)."""
    from meganeura.codegen.wgsl.attention.plan import choose_plan

    name, b, hq, hkv, lq, lk, d, causal = shape
    dims = _dims(shape)
    arrays = inputs(b, hq, hkv, lq, lk, d)
    ref = reference(arrays, hq, hkv, causal, 1.0 / math.sqrt(d))
    defaults = {m: choose_plan(m, dims, sw.limits) for m in TRAIN_MODES}
    queues = {m: candidates(m, dims, sw.limits, defaults[m], cap) for m in TRAIN_MODES}
    print(f"\n{name}: B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}; "
          f"plans per mode {', '.join(f'{m} {len(q)}' for m, q in queues.items())}")  # fmt: skip
    t_shape = time.perf_counter()
    sw.run(shape, arrays, ref, "train", {})  # the defaults first
    t = time.perf_counter()
    sw.run(shape, arrays, ref, "fwd", {})
    n_fwd = 1 if sw.args.quick else FWD_ONLY_BEST
    # time kept for the forward-only programs and the confirming training programs
    reserve = 1.2 * n_fwd * (time.perf_counter() - t)
    reserve += 1.2 * 2 * sw.args.confirm * (t - t_shape)
    rounds = 0
    while any(queues.values()) and time.perf_counter() < deadline - reserve:
        override = {m: q.pop(0) for m, q in queues.items() if q}
        sw.run(shape, arrays, ref, "train", override)
        rounds += 1
    # The best plan of each mode was picked from one sample among many (biased low): time it
    # again against the default, interleaved, so the medians the summary (and --record) use
    # hold unbiased samples of both.
    best = best_overrides(sw.rows, name, defaults)
    for _ in range(sw.args.confirm if best else 0):
        if time.perf_counter() >= deadline:
            break
        sw.run(shape, arrays, ref, "train", {})
        sw.run(shape, arrays, ref, "train", best)
    # the forward alone: its default and the fastest forward plans of the training programs
    rows = [r for r in sw.rows if r["shape"] == name and r["label"] == "fwd+lse" and r["ok"]]
    best = sorted({tuple(r["plan"]) for r in rows if not r["default"]},
                  key=lambda p: min(r["us"] for r in rows if tuple(r["plan"]) == p))  # fmt: skip
    for plan in best[:n_fwd]:
        if time.perf_counter() >= deadline:
            break
        sw.run(shape, arrays, ref, "fwd", {"fwd": plan})
    left = {m: len(q) for m, q in queues.items() if q}
    sw.summary[name] = summarize(
        sw.rows, name, defaults, left, rounds, time.perf_counter() - t_shape
    )
    print_table(sw.summary[name])
    sw.write(complete=False)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, every kernel in its own dispatch (``common.kernels_apart``)."""
    with kernels_apart():
        return _main(argv)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "", repeats=10, warmup=3)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget in seconds (default 230; --quick 50)")  # fmt: skip
    ap.add_argument("--cap", type=int, default=40, help="most plans per (shape, kernel)")
    ap.add_argument("--whisper-cap", type=int, default=WHISPER_PLANS,
                    help="most plans per kernel at Whisper")  # fmt: skip
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the shapes")
    ap.add_argument("--out", default=None, help="result file path (default: see above)")
    ap.add_argument("--confirm", type=int, default=2,
                    help="after a shape's rounds, time its best plans against the default "
                    "this many times more, interleaved (0: none)")  # fmt: skip
    ap.add_argument("--record", action="store_true",
                    help="write the winning plans (>= 3%% over the default) into this "
                    "device's tuning cache, which later compiles on it read")  # fmt: skip
    args = ap.parse_args(argv)
    resolve_args(args)
    if args.budget_s is None:
        args.budget_s = 50.0 if args.quick else 230.0
    try:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        dev = "cpu"

    from meganeura.codegen.wgsl.attention.plan import set_tuned

    # "default" is the automatic rule, not the measured plans (this device's tuning cache,
    # attention/tuned.py's table), which are back on when main returns
    set_tuned(False)
    try:
        _sweep(args, dev)
    finally:
        set_tuned(True)


def _sweep(args, dev: str) -> None:
    from bench.common import warm_gpu
    from meganeura.runtime import get_device

    t0 = time.perf_counter()
    device = get_device(args.adapter)
    sw = Sweep(args, device)
    warm_gpu(device, dev, min(args.warm_seconds, 0.2 * args.budget_s))
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        want = args.shapes.split(",")
        unknown = set(want) - {s[0] for s in shapes}
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {[s[0] for s in shapes]}")
        shapes = [s for s in shapes if s[0] in want]
    weights = [SHARE.get(s[0], 1.0) for s in shapes]
    for i, shape in enumerate(shapes):
        left = args.budget_s - (time.perf_counter() - t0)
        deadline = time.perf_counter() + left * weights[i] / sum(weights[i:])
        whisper = shape[0] == "whisper"
        cap = QUICK_PLANS if args.quick else args.whisper_cap if whisper else args.cap
        sweep_shape(sw, shape, deadline, cap)
    sw.write(complete=True)
    print(f"wrote {sw.path} ({len(sw.rows)} rows, {len(sw.programs)} compiles, "
          f"{time.perf_counter() - t0:.1f} s)")  # fmt: skip
    if args.record:
        print("\nrecording in this device's tuning cache:")
        for line in record(sw.summary, shapes, device):
            print("  " + line)


if __name__ == "__main__":
    main()
