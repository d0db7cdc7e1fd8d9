"""Sweep: conv GEMM plans (tiling x prefetch x split-K) per convolution shape against cuDNN.

Shapes: ResNet-50's distinct convolutions at batch 4 (``bench/conv.py``'s ``LAYERS``) and the
W5 U-Net's (``meganeura.models.unet``, ``UNetConfig()``: base 64, 4x32x32 latents) at batch 2,
found by tracing the model; each with its count in the network. ``--quick``: two tiny shapes
(lavapipe, < 60 s).

Per shape one program holds ``y = conv2d(x, w)`` and both gradients (``bench/conv.build``).
Each variant forces every conv GEMM's plan (``conv.gemm.force_plan``): tiling {SMALL, LARGE,
NARROW when min(C, OC) <= 64} x prefetch {one-deep, none, two-deep (SMALL and NARROW only)}
x split {default rule, none, the rule aiming at twice TARGET_GROUPS workgroups (``--quick``:
2 splits, as the CPU adapter never splits)};
and, for a strided shape, the default plans with the input gradient's stride phases apart
(``conv.lowering.MERGE_PHASES`` False: one GEMM dispatch per phase, the program before
``conv/phases.py``; variant ``default/default/default/apart``, its grad-input time the part's
``apart_ms``) and with the merged phases' split rule going down to K chunks of 64
(``conv.phases.MIN_CHUNK``, 64 by default since that sweep; variant
``default/default/default/chunk64``); variants whose plans (``conv.gemm.record_plans``)
equal an earlier one's are not rerun. Every
variant's y, dx and dw are compared with the default plan's (max |diff| / max |default| <=
1e-4: split-K reorders sums) and a variant that differs is rejected. GPU time per part
(forward, grad-input, grad-weight: the dispatches of ``conv2d``, ``conv2d_backward_input``,
``conv2d_backward_weight``) from ``Session.profile`` as bench/conv.py; cuDNN's (TF32 off,
``cudnn.benchmark`` on) with ``bench/conv.torch_fns`` and CUDA events.

Prints per shape and part the default plan's time, the best variant's and cuDNN's; then per
network the count-weighted sum of its convolutions (the first conv's grad-input left out:
training never computes it) for the default plans, the best variant per shape and part, and
cuDNN. First every variant is lowered (no pipelines, a few seconds) to count those with
plans of their own; the estimate printed then assumes ``--est-variant-s`` each (0.2 s: what
the matmul sweep measured on the H200) and 0.5 s per shape for cuDNN. ``--budget-s`` (wall
clock from the start of planning, shared evenly by the shapes) skips a shape's remaining
variants, never its default, once its share is spent. The JSON
(``bench/results/conv_sweep_<machine_tag>.json``, under ``quick/`` when quick) is rewritten
after each shape; its keys are ``KEYS``, each shape's ``SHAPE_KEYS``, each part's
``PART_KEYS``.

``--emit-table JSON`` prints ``meganeura/codegen/wgsl/conv/tuned.py``'s table from a sweep's
JSON (the best variants >= 3% faster than today's rule plans, keyed by GEMM op and sizes) and
what it buys per network, then exits (``bench/conv_table.py``; no GPU). The sweep itself
times the rules: every variant runs under ``force_plan``, which the table yields to.

Usage: python bench/conv_sweep.py [--quick] [--budget-s 200] [--repeats 5] [--warmup 2]
                                  [--only NAME ...] [--networks resnet50_b4,unet_small_b2]
                                  [--machine h200] [--out PATH]
       python bench/conv_sweep.py --emit-table bench/results/conv_sweep_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    dispatch_op,
    kernels_apart,
    machine,
    profile_ms,
    rel_err,
    time_torch,
    to_numpy,
    torch_setup,
    versions,
    warm_gpu,
)
from bench.conv import LAYERS, OPS, PARTS, build, out_size, torch_fns  # noqa: E402

KEYS = ("machine", "versions", "quick", "repeats", "warmup", "budget_s", "estimate_s",
        "grid", "shapes", "summary", "complete", "wall_seconds")  # fmt: skip
SHAPE_KEYS = ("network", "name", "n", "c", "oc", "k", "stride", "h", "count", "parts",
              "variants", "rel_err_vs_torch")  # fmt: skip
PART_KEYS = ("default_plans", "default_ms", "best_variant", "best_plans", "best_ms",
             "cudnn_ms", "gain", "counted", "default_as", "apart_ms")  # fmt: skip
TILINGS = ("small", "large", "narrow")
SPLITS = ("default", "none", "2x")
MODES = ("np", "pf", "d2")
MAX_DIFF = 1e-4
APART = "default/default/default/apart"  # the default plans, stride phases apart
CHUNK64 = "default/default/default/chunk64"  # merged phases split down to chunks of 64
TORCH_S = 0.5  # estimated seconds per shape for cuDNN's references and timings


def unet_layers() -> list[tuple[str, int, int, int, int, int, int]]:
    """The W5 U-Net's distinct convolutions (``LAYERS``' format: name, C, OC, kernel, stride,
    H, count; padding k // 2), traced from ``UNet(UNetConfig())`` on a 4x32x32 latent. The
    first (``conv_in``, on the model's input) is named ``unet_in_...``."""
    import meganeura as mn
    from meganeura.models.unet import UNet, UNetConfig

    graph = mn.nn.trace(UNet(UNetConfig()), np.zeros((1, 4, 32, 32), np.float32))
    out: dict[tuple, list] = {}
    for node in graph.nodes:
        if node.op != "conv2d":
            continue
        (_, c, h, _), (oc, _, k, _) = (graph[i].type.shape for i in node.inputs[:2])
        a = node.attr_dict
        assert a["padding"] == (k // 2, k // 2) and a["dilation"] == (1, 1) and a["groups"] == 1
        s = a["stride"][0]
        first = graph[node.inputs[0]].op == "input"
        key = (c, oc, k, s, h)
        if key not in out:
            tag = "in" if first else f"{k}x{k}" + (f"s{s}" if s > 1 else "")
            out[key] = [f"unet_{tag}_{c}_{oc}_h{h}", c, oc, k, s, h, 0]
        out[key][-1] += 1
    return [tuple(v) for v in out.values()]


def networks(quick: bool) -> list[tuple[str, int, list]]:
    """(network, batch, layers); the first layer of each is the one on the model's input."""
    if quick:
        return [
            ("resnet_quick", 1, [("q_3x3s2_8_12", 8, 12, 3, 2, 9, 2)]),
            ("unet_quick", 1, [("q_1x1_24_20", 24, 20, 1, 1, 6, 1)]),
        ]
    return [("resnet50_b4", 4, LAYERS), ("unet_small_b2", 2, unet_layers())]


def grid(c: int, oc: int) -> list[tuple[str, str, str]]:
    """(tiling, prefetch, split) variants for one shape, the default first; prefetch ``pf``
    (one-deep), ``np`` (none) or, for the small tilings only, ``d2`` (two-deep). The split
    rule varies slowest, so a budget cut still leaves every tiling and prefetch mode timed
    under the default split rule."""
    tilings = [t for t in TILINGS if t != "narrow" or min(c, oc) <= 64]
    out = [("default", "default", "default")]
    # the default tilings and splits with each prefetch mode: what flipping PREFETCH / DEEP gives
    out += [("default", mode, "default") for mode in MODES]
    for split, t in itertools.product(SPLITS, tilings):
        modes = ("pf", "np", "d2") if t in ("small", "narrow") else ("pf", "np")
        out += [(t, mode, split) for mode in modes]
    return out


def forcing(variant: tuple[str, str, str], quick: bool) -> dict:
    """``force_plan``'s arguments for a variant."""
    from meganeura.codegen.wgsl.conv import gemm

    tiling, pf, split = variant
    kw: dict = {}
    if tiling != "default":
        kw["tiling"] = tiling
    if pf != "default":
        kw.update(prefetch=pf != "np", deep=pf == "d2")
    if split == "none":
        kw["splits"] = 1
    elif split == "2x":
        kw.update(splits=2) if quick else kw.update(target_groups=2 * gemm.TARGET_GROUPS)
    return kw


def variant_programs(n: int, layer: tuple, limits, quick: bool) -> list[tuple]:
    """(label, plans, Program) of each variant of one shape whose conv GEMM plans differ
    from every earlier variant's, the default first; compiled (lowered) without pipelines."""
    import meganeura as mn
    from meganeura.codegen.wgsl.conv import gemm, lowering, phases

    _, c, oc, k, s, h, _ = layer
    graph = build(n, c, oc, k, s, h)
    seen, out = set(), []
    for variant in grid(c, oc):
        label = "/".join(variant)
        try:
            with gemm.record_plans() as plans, gemm.force_plan(**forcing(variant, quick)):
                program = mn.compile(graph, None, limits)
        except ValueError as e:  # a tile this adapter cannot hold
            print(f"  {layer[0]} {label}: {e}")
            continue
        if tuple(plans) not in seen:
            seen.add(tuple(plans))
            out.append((label, list(plans), program))
    if s > 1:  # the default plans with the grad-input's stride phases apart / short chunks
        for label, module, name, value in (
            (APART, lowering, "MERGE_PHASES", False),
            (CHUNK64, phases, "MIN_CHUNK", 64),
        ):
            saved = getattr(module, name)
            setattr(module, name, value)
            try:
                with gemm.record_plans() as plans:
                    program = mn.compile(graph, None, limits)
            finally:
                setattr(module, name, saved)
            if label == APART or tuple(plans) not in seen:
                seen.add(tuple(plans))
                out.append((label, list(plans), program))
    return out


def machine_tag(adapter: str) -> str:
    """The result file's tag, as the other result files': ``"h200"`` for an H200,
    ``"lavapipe"`` for Mesa's CPU adapter, else the adapter name's first two words in
    lowercase letters, digits and underscores."""
    name = adapter.lower()
    for tag, marks in (("h200", ("h200",)), ("lavapipe", ("llvmpipe", "lavapipe"))):
        if any(m in name for m in marks):
            return tag
    words = "".join(ch if ch.isalnum() else " " for ch in name).split()
    return "_".join(words[:2]) or "unknown"


def _short(plans: list[str]) -> str:
    """``["a", "a", "b"]`` -> ``"a x2,b"``."""
    counts = {p: plans.count(p) for p in plans}
    return ",".join(p if c == 1 else f"{p} x{c}" for p, c in counts.items()) or "-"


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.abs(b).max()) if b.size else 0.0
    return float(np.abs(a - b).max()) / (scale if scale > 0 else 1.0) if b.size else 0.0


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, every kernel in its own dispatch (``common.kernels_apart``)."""
    with kernels_apart():
        return _main(argv)


def _main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two tiny shapes (lavapipe, < 60 s)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    ap.add_argument("--machine", default=None, help="file name tag (default from the adapter)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--est-variant-s", type=float, default=0.2)
    ap.add_argument("--warm-seconds", type=float, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="shape names to run")
    ap.add_argument("--networks", default=None, help="comma-separated network names")
    ap.add_argument("--adapter", default=os.environ.get("MEGANEURA_ADAPTER"))
    ap.add_argument("--emit-table", metavar="JSON", default=None,
                    help="print conv/tuned.py's table from this sweep's JSON and the gain "
                         "estimate (bench/conv_table.py), then exit; needs no GPU")  # fmt: skip
    args = ap.parse_args(argv)
    if args.emit_table:
        from bench.conv_table import emit

        tab, est = emit(args.emit_table)
        return {"table": tab, "estimate": est}
    repeats = args.repeats or (2 if args.quick else 5)
    warmup = args.warmup or (1 if args.quick else 2)
    warm_s = args.warm_seconds if args.warm_seconds is not None else (0.0 if args.quick else 2.0)

    from meganeura.runtime import Session, get_device
    from meganeura.training import device_limits

    device = get_device(args.adapter)
    tag = args.machine or machine_tag(device.name)
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(
        here, "results", *(("quick",) if args.quick else ()), f"conv_sweep_{tag}.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    limits = device_limits(device)
    torch, dev = torch_setup()
    torch.backends.cudnn.benchmark = True
    warm = warm_gpu(device, dev, warm_s)

    nets = networks(args.quick)
    if args.networks:
        nets = [x for x in nets if x[0] in args.networks.split(",")]
    todo = [(net, n, layer, i == 0) for net, n, layers in nets for i, layer in enumerate(layers)]
    todo = [x for x in todo if not args.only or x[2][0] in args.only]
    t0 = time.perf_counter()  # the budget counts from here, planning included
    # lowering only (no pipelines): which variants have plans of their own, for the estimate
    programs = [variant_programs(x[1], x[2], limits, args.quick) for x in todo]
    n_variants = sum(len(v) for v in programs)
    estimate = n_variants * args.est_variant_s + len(todo) * TORCH_S
    print(f"{len(todo)} shapes, {n_variants} variants with distinct plans (planned in "
          f"{time.perf_counter() - t0:.1f} s): about {estimate:.0f} s at {args.est_variant_s} s "
          f"per variant and {TORCH_S} s per shape for cuDNN; budget {args.budget_s:.0f} s",
          flush=True)  # fmt: skip
    if estimate > args.budget_s:
        print("  the estimate exceeds the budget: the last variants of each shape may be skipped")
    doc = {"machine": machine(device), "versions": versions(), "quick": args.quick,
           "repeats": repeats, "warmup": warmup, "budget_s": args.budget_s,
           "estimate_s": round(estimate, 1), "gpu_warmup": warm,
           "grid": {"tilings": list(TILINGS), "prefetch": ["pf", "np", "d2"],
                    "splits": list(SPLITS)},
           "shapes": []}  # fmt: skip

    def save(complete: bool) -> None:
        doc.update(summary=summarize(doc["shapes"]), complete=complete,
                   wall_seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, out)

    groups = {p: (lambda nm, op=op: dispatch_op(nm) == op) for p, op in OPS.items()}
    for i, (net, n, (name, c, oc, k, s, h, count), first) in enumerate(todo):
        deadline = t0 + args.budget_s * (i + 1) / len(todo)
        oh, pad = out_size(h, k, s), k // 2
        rng = np.random.default_rng(c * 31 + oc + k)
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        w = rng.standard_normal((oc, c, k, k), dtype=np.float32) / np.float32(np.sqrt(c * k * k))
        gy = rng.standard_normal((n, oc, oh, oh), dtype=np.float32)
        tx, tw, tgy = (torch.from_numpy(a).to(dev) for a in (x, w, gy))
        fns = torch_fns(torch, tx, tw, tgy, s, pad)
        with torch.no_grad():
            refs = {p: to_numpy(f()) for p, f in fns.items()}
            cudnn = {p: time_torch(f, dev, warmup, repeats)["median"] for p, f in fns.items()}
        variants, default_out = [], None
        for label, plans, program in programs[i]:
            if label != "default/default/default" and time.perf_counter() > deadline:
                print(f"  budget spent: skipping {label} and the rest of {name}")
                break
            sess = Session(program, device)
            try:
                sess.load_state_dict({"x": x, "w": w, "gy": gy})
                res = sess.run({}, fetch=("y", "dx", "dw"))
                prof = profile_ms(sess, {}, warmup, repeats, groups)
            finally:
                sess.close()
            outs = {"fwd": res["y"], "bwd_input": res["dx"], "bwd_weight": res["dw"]}
            if default_out is None:
                default_out = outs
                doc_errs = {p: rel_err(outs[p], refs[p]) for p in PARTS}
            diff = max(_max_diff(outs[p], default_out[p]) for p in PARTS)
            row = {
                "variant": label,
                "plans": {p: [nm for op, nm in plans if op == OPS[p]] for p in PARTS},
                "ms": {p: prof[p]["median"] for p in PARTS},
                "max_rel_diff": diff,
                "rejected": diff > MAX_DIFF,
            }
            variants.append(row)
            if row["rejected"]:
                print(f"  REJECTED {name} {label}: max rel diff {diff:.2e} against the default")
        parts = {}
        for p in PARTS:
            dflt = variants[0]
            ok = [v for v in variants if not v["rejected"]]
            top = min(ok, key=lambda v, p=p: v["ms"][p])
            parts[p] = {
                "default_plans": dflt["plans"][p], "default_ms": dflt["ms"][p],
                "best_variant": top["variant"], "best_plans": top["plans"][p],
                "best_ms": top["ms"][p], "cudnn_ms": cudnn[p],
                "gain": dflt["ms"][p] / top["ms"][p] if top["ms"][p] > 0 else 1.0,
                "counted": not (first and p == "bwd_input"),
                "default_as": _default_as(variants, p),
                "apart_ms": next((v["ms"][p] for v in variants
                                  if v["variant"] == APART and p == "bwd_input"), None),
            }  # fmt: skip
            r = parts[p]
            print(f"{name:<24} {p:<10} default {_short(r['default_plans']):<26} "
                  f"{r['default_ms']:>8.4f} ms | best {r['best_variant']:<20} "
                  f"{r['best_ms']:>8.4f} ms x{r['gain']:.2f} | cuDNN {r['cudnn_ms']:>8.4f} ms"
                  + ("" if r["apart_ms"] is None else f" | phases apart {r['apart_ms']:.4f} ms"),
                  flush=True)  # fmt: skip
        doc["shapes"].append({
            "network": net, "name": name, "n": n, "c": c, "oc": oc, "k": k, "stride": s,
            "h": h, "count": count, "parts": parts, "variants": variants,
            "rel_err_vs_torch": doc_errs,
        })  # fmt: skip
        for p, e in doc_errs.items():
            if e > 1e-4:
                print(f"  WARNING {name} {p}: default plan rel_err {e:.2e} against PyTorch")
        del tx, tw, tgy
        save(False)
    save(True)
    print(f"\nweighted network conv time (ms), {time.perf_counter() - t0:.0f} s of sweep:")
    print("(dflt/np, /pf, /d2: the default plans' tilings and splits with that prefetch mode)")
    print("(apart: the default plans with the strided input gradients' phases apart)")
    print(f"{'network':<16} {'part':<10} {'default':>9} {'best':>9} {'cuDNN':>9} "
          f"{'gain':>6} {'xcuDNN':>7} {'dflt/np':>9} {'dflt/pf':>9} {'dflt/d2':>9} "
          f"{'apart':>9}")  # fmt: skip
    for net, parts in doc["summary"].items():
        for p, r in parts.items():
            as_ms = [r[f"default_as_{m}_ms"] for m in MODES]
            modes = " ".join(f"{'-' if v is None else f'{v:.3f}':>9}" for v in as_ms)
            print(f"{net:<16} {p:<10} {r['default_ms']:>9.3f} {r['best_ms']:>9.3f} "
                  f"{r['cudnn_ms']:>9.3f} {r['default_ms'] / r['best_ms']:>6.2f} "
                  f"{r['cudnn_ms'] / r['best_ms']:>7.2f} {modes} "
                  f"{r['apart_ms']:>9.3f}")  # fmt: skip
    print(f"wrote {out}")
    return doc


def _default_as(variants: list[dict], part: str) -> dict[str, float]:
    """Time of ``part`` under the default plans' tilings and splits with each prefetch mode
    (``np``, ``pf``, ``d2``), where a variant ran exactly those plans: what flipping
    ``conv.plan.PREFETCH`` / ``DEEP`` alone would give."""
    base = [p.rsplit("/", 1)[0] for p in variants[0]["plans"][part]]
    out = {}
    for mode in MODES:
        want = [f"{b}/{mode}" for b in base]
        ms = [v["ms"][part] for v in variants if not v["rejected"] and v["plans"][part] == want]
        if ms:
            out[mode] = min(ms)
    return out


def summarize(shapes: list[dict]) -> dict:
    """Per network and part (and ``all``): count-weighted sums of the default plans', the
    best variants' and cuDNN's times, the first conv's grad-input left out; ``apart_ms``, the
    default plans' with the strided input gradients' phases apart (``apart_ms`` of a part,
    else its default); and
    ``default_as_<mode>_ms``, the default plans with that prefetch mode (``_default_as``),
    None when some shape lacks it (a budget cut)."""
    out: dict[str, dict] = {}
    for sh in shapes:
        net = out.setdefault(sh["network"], {})
        for p, r in sh["parts"].items():
            if not r["counted"]:
                continue
            for part in (p, "all"):
                acc = net.setdefault(
                    part,
                    {
                        "default_ms": 0.0,
                        "best_ms": 0.0,
                        "cudnn_ms": 0.0,
                        "apart_ms": 0.0,
                        **{f"default_as_{m}_ms": 0.0 for m in MODES},
                    },
                )
                for key in ("default_ms", "best_ms", "cudnn_ms"):
                    acc[key] += sh["count"] * r[key]
                apart = r.get("apart_ms")
                acc["apart_ms"] += sh["count"] * (r["default_ms"] if apart is None else apart)
                for m in MODES:
                    key, ms = f"default_as_{m}_ms", r["default_as"].get(m)
                    acc[key] = (
                        None if ms is None or acc[key] is None else acc[key] + sh["count"] * ms
                    )
    order = (*PARTS, "all")
    return {net: {p: parts[p] for p in order if p in parts} for net, parts in out.items()}


if __name__ == "__main__":
    main()
