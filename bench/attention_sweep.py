"""Benchmark sweep: every attention kernel plan (``attention.plan.BLOCK_PLANS`` and the lane
kernel) on the issue's shapes, forward and backward, against
torch.nn.functional.scaled_dot_product_attention (f32) in the same process.

Each variant forces one plan for all attention kernels (``BLOCK_OVERRIDE``; a plan that
does not fit the adapter falls back to the lane kernel, visible in ``kernels``) and dk and dv
in one ``dkv`` pass or in two (``FUSE_KEY_VALUE``; ``-sep`` variants run them apart),
compiles the forward + backward program of ``bench/attention.py`` and reports per-kernel GPU
times (``Session.profile``): fwd, stats, lse, delta, dq, dk, dv, dkv (0 for kernels a variant
does not run; fwd includes the log-sum-exp store where the forward writes it, ``fwd+lse``).
Torch: CUDA events around ``sdpa`` and ``sdpa`` + ``o.backward(go)``. The summary row ``best``
takes the fastest plan per kernel, and the faster of dkv and dk + dv (what a tuned
plan table would give). Outputs and gradients are checked against torch.

``--quick`` (a lavapipe smoke test): Whisper at L=96 and the first four variants only.

Usage: python bench/attention_sweep.py [--quick] [--repeats 20] [--out-name attention_sweep]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import CASES, build, inputs  # noqa: E402
from bench.common import (  # noqa: E402
    add_args,
    dispatch_op,
    kernels_apart,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    start,
    time_torch,
    to_numpy,
)

SDPA = "scaled_dot_product_attention"
KERNELS = {
    "fwd": SDPA,
    "stats": f"{SDPA}_stats",  # lse and delta in one pass (what the backward used before lse)
    "lse": f"{SDPA}_lse",  # the log-sum-exp pass (0 where the forward writes it: fwd+lse)
    "delta": f"{SDPA}_delta",  # (lse, rowsum(dO * O)); 0 where dq computes it: dq+delta
    "dq": f"{SDPA}_backward_query",
    "dk": f"{SDPA}_backward_key",
    "dv": f"{SDPA}_backward_value",
    "dkv": f"{SDPA}_backward_key_value",  # dk and dv in one pass (fusion of the two nodes)
}
SWEEP_CASES = ("whisper", "smollm2")


def variants() -> list[tuple[str, dict, bool | None]]:
    """(label, BLOCK_OVERRIDE, FUSE_KEY_VALUE) per variant; ``-nolse`` variants run with
    ``SAVE_LSE`` off (the backward's own lse pass instead of the forward writing it),
    ``-dkvhalf`` ones with ``DKV_HALF`` on (dk and dv fused over half head dims per thread)."""
    from meganeura.codegen.wgsl.attention.plan import BLOCK_PLANS

    lane = {m: None for m in KERNELS}
    out = [
        ("auto", {}, None),
        ("auto-sep", {}, False),
        ("auto-nolse", {}, None),
        ("auto-dkvhalf", {}, None),
        ("lane", lane, True),
        ("lane-sep", lane, False),
    ]
    for plan in BLOCK_PLANS:
        label = "block" + "x".join(map(str, plan))
        out += [
            (label, {m: plan for m in KERNELS}, True),
            (label + "-sep", {m: plan for m in KERNELS}, False),
        ]
    return out


def main() -> None:
    """Run the benchmark, every kernel in its own dispatch (``common.kernels_apart``)."""
    with kernels_apart():
        _main()


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "attention_sweep", repeats=20, warmup=5)
    args = ap.parse_args()
    resolve_args(args)
    from meganeura.codegen.wgsl.attention import plan as attention_plan
    from meganeura.training import compile_for

    device, torch, dev, rec = start(args)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    head = f"{'case':<30}" + "".join(f" {m:>8}" for m in KERNELS) + f" {'bwd':>8}"
    head += f" {'fwd x':>6} {'f+b x':>6} {'err':>8}"

    for name, b, hq, hkv, lq, lk, d, causal in CASES:
        if name not in SWEEP_CASES:
            continue
        if args.quick and name == "whisper":
            lq = lk = 96
        arrays = inputs(b, hq, hkv, lq, lk, d)
        tt = {n: torch.from_numpy(a).to(dev) for n, a in arrays.items()}
        req = {n: tt[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
        gqa = hq != hkv

        def t_fwd(tt=tt, causal=causal, gqa=gqa):
            return sdpa(tt["q"], tt["k"], tt["v"], is_causal=causal, enable_gqa=gqa)

        def t_fwd_bwd(req=req, go=tt["go"], causal=causal, gqa=gqa):
            for x in req.values():
                x.grad = None
            o = sdpa(req["q"], req["k"], req["v"], is_causal=causal, enable_gqa=gqa)
            o.backward(go)
            return o

        ref = {"o": to_numpy(t_fwd_bwd())}
        ref.update({"d" + n: to_numpy(req[n].grad) for n in ("q", "k", "v")})
        with torch.no_grad():
            torch_fwd = time_torch(t_fwd, dev, args.warmup, args.repeats)["median"]
        torch_fb = time_torch(t_fwd_bwd, dev, args.warmup, args.repeats)["median"]
        shape = f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
        print(f"\n{name}: {shape}; torch fwd {torch_fwd * 1e3:.1f} us, "
              f"fwd+bwd {torch_fb * 1e3:.1f} us; ours in us")  # fmt: skip
        print(head)
        best: dict[str, tuple[float, str]] = {}
        saved_lse = False  # some variant's forward wrote the lse: no lse pass is needed
        for label, override, fuse in variants()[: 4 if args.quick else None]:
            attention_plan.BLOCK_OVERRIDE.clear()
            attention_plan.BLOCK_OVERRIDE.update(override)
            attention_plan.FUSE_KEY_VALUE = fuse
            attention_plan.SAVE_LSE = not label.endswith("-nolse")
            attention_plan.DKV_HALF = label.endswith("-dkvhalf")
            try:
                graph = build(b, hq, hkv, lq, lk, d, causal, True)
                program, sess = compile_for(graph, device=device)
            finally:
                attention_plan.BLOCK_OVERRIDE.clear()
                attention_plan.FUSE_KEY_VALUE = None
                attention_plan.SAVE_LSE = True
                attention_plan.DKV_HALF = False
            try:
                sess.load_state_dict(arrays)
                out = sess.run({}, fetch=("o", "dq", "dk", "dv"))
                err = max(rel_err(out[n], ref[n]) for n in ref)
                preds = {m: (lambda n, op=op: dispatch_op(n) == op) for m, op in KERNELS.items()}
                prof = profile_ms(sess, {}, args.warmup, args.repeats, preds)
            finally:
                sess.close()
            ms = {m: prof[m]["median"] for m in KERNELS}
            ran = {dispatch_op(x.name) for x in program.dispatches}
            for m, t in ms.items():
                if KERNELS[m] in ran and (m not in best or t < best[m][0]):
                    best[m] = (t, label)
            bwd = sum(t for m, t in ms.items() if m != "fwd")
            kernels = [x.name for x in program.dispatches if "attention" in x.name]
            saved_lse = saved_lse or any("fwd+lse" in x for x in kernels)
            row = result(
                f"sdpa_{name}_{label}",
                "ms",
                ms["fwd"] + bwd,
                torch_fb,
                shape=shape,
                variant=label,
                kernel_ms=ms,
                torch_fwd_ms=torch_fwd,
                fwd_speedup=torch_fwd / ms["fwd"],
                rel_err=err,
                kernels=kernels,
            )
            line = f"{name + ' ' + label:<30}" + "".join(f" {ms[m] * 1e3:8.1f}" for m in KERNELS)
            line += f" {bwd * 1e3:8.1f} {row['fwd_speedup']:6.2f} {row['speedup']:6.2f}"
            rec.add(row, line + f" {err:8.1e}")
        split = sum(best[m][0] for m in ("dk", "dv")) if "dk" in best and "dv" in best else None
        if "dkv" in best and split is not None:  # keep the faster way to get dk and dv
            for m in ("dkv",) if best["dkv"][0] > split else ("dk", "dv"):
                del best[m]
        if saved_lse:  # the forward's lse store costs next to nothing; drop the separate pass
            best.pop("lse", None)
        total = sum(t for t, _ in best.values())
        choice = {m: lbl for m, (_, lbl) in best.items()}
        rec.add(
            result(
                f"sdpa_{name}_best",
                "ms",
                total,
                torch_fb,
                shape=shape,
                choice=choice,
                fwd_speedup=torch_fwd / best["fwd"][0],
            ),  # fmt: skip
            f"{name} best per kernel: fwd x{torch_fwd / best['fwd'][0]:.2f}, fwd+bwd "
            f"x{torch_fb / total:.2f} with {choice}",
        )
    rec.finish()


if __name__ == "__main__":
    main()
