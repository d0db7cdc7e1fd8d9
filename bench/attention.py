"""Benchmark: scaled_dot_product_attention in f32, forward and forward + backward,
meganeura vs torch.nn.functional.scaled_dot_product_attention (f32, enable_gqa).

Shapes (docs/workloads.md):
  whisper        1 x 6 heads x 1500 x 64, full attention (W4 encoder self-attention)
  smollm2        1 x 9 q / 3 kv heads x 128 x 64, causal, GQA (W1 at seq 128)
  smolvla_self   1 x 15 q / 5 kv heads x 50 x 64, causal, GQA (W2 even layers)
  smolvla_cross  1 x 15 q heads x 50 against 5 kv heads x 16 (VLM context), full, GQA
                 (W2 odd layers)
Ours, forward: one graph ``o = sdpa(q, k, v)`` with q, k, v parameters (uploaded once).
Ours, forward + backward: one program holding the forward and the gradients of q, k, v from
``meganeura.autodiff.differentiate`` of ``loss = sum(o * go)`` (go a parameter: the output
gradient), outputs o, dq, dk, dv. GPU times from ``Session.profile``; "ours" counts the
attention kernels only (forward, stats, dq, and dk and dv, or dkv where one kernel computes
both: ``attention.plan.fuses_key_value``), ``ours_all_ms`` adds the loss's mul/sum
and its backward (a few tiny elementwise dispatches PyTorch does not run, since
``o.backward(go)`` starts from go directly). Torch: CUDA events around ``sdpa`` and around
``sdpa`` + ``o.backward(go)``. Outputs and gradients are checked against PyTorch (rel_err).
TFLOP/s extras count 4 B Hq Lq Lk D for the forward (the unmasked pairs only when causal) and
3.5 times that for forward + backward (FlashAttention's convention).

Usage: python bench/attention.py [--quick] [--repeats 10] [--out-name attention]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    add_args,
    dispatch_op,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    start,
    time_torch,
    to_numpy,
)

# name, B, Hq, Hkv, Lq, Lk, D, causal
CASES = [
    ("whisper", 1, 6, 6, 1500, 1500, 64, False),
    ("smollm2", 1, 9, 3, 128, 128, 64, True),
    ("smolvla_self", 1, 15, 5, 50, 50, 64, True),
    ("smolvla_cross", 1, 15, 5, 50, 16, 64, False),
]


def inputs(b: int, hq: int, hkv: int, lq: int, lk: int, d: int) -> dict[str, np.ndarray]:
    """q [b, hq, lq, d], k and v [b, hkv, lk, d] and the output gradient go [b, hq, lq, d]:
    f32 standard normals, seeded by the shape (the same arrays on every run)."""
    rng = np.random.default_rng(hq * 100 + lq)
    return {
        "q": rng.standard_normal((b, hq, lq, d), dtype=np.float32),
        "k": rng.standard_normal((b, hkv, lk, d), dtype=np.float32),
        "v": rng.standard_normal((b, hkv, lk, d), dtype=np.float32),
        "go": rng.standard_normal((b, hq, lq, d), dtype=np.float32),
    }


def is_attention(name: str) -> bool:
    return dispatch_op(name).startswith("scaled_dot_product_attention")


def flops(b, hq, lq, lk, d, causal) -> float:
    """Forward FLOPs (q k^T and p v; causal counts the unmasked half)."""
    pairs = lq * lk
    if causal:
        pairs = sum(min(i + 1, lk) for i in range(lq))
    return 4.0 * b * hq * pairs * d


def build(b, hq, hkv, lq, lk, d, causal, backward: bool):
    import meganeura as mn
    import meganeura.nn.functional as F
    from meganeura.autodiff import differentiate

    g = mn.GraphBuilder()
    q = g.parameter("q", (b, hq, lq, d))
    k = g.parameter("k", (b, hkv, lk, d))
    v = g.parameter("v", (b, hkv, lk, d))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    g.output("o", o)
    if not backward:
        return g.build()
    go = g.parameter("go", (b, hq, lq, d))
    loss = F.sum(o * go)
    graph, grads = differentiate(g.build_unverified(), loss.id, ["q", "k", "v"])
    gb = mn.GraphBuilder(graph)
    for name in ("q", "k", "v"):
        gb.output("d" + name, gb.tensor(grads[graph.find(name).id]))
    return gb.build_unverified()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "attention")
    args = ap.parse_args()
    resolve_args(args)
    from meganeura.training import compile_for

    device, torch, dev, rec = start(args)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    for name, b, hq, hkv, lq, lk, d, causal in CASES:
        if args.quick and name == "whisper":
            lq = lk = 96  # lavapipe: keep the smoke test short
        arrays = inputs(b, hq, hkv, lq, lk, d)
        tt = {n: torch.from_numpy(a).to(dev) for n, a in arrays.items()}
        gqa = hq != hkv
        shape = f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
        fl = flops(b, hq, lq, lk, d, causal)

        # ---- forward ----
        def t_fwd(tt=tt, causal=causal, gqa=gqa):
            return sdpa(tt["q"], tt["k"], tt["v"], is_causal=causal, enable_gqa=gqa)

        t = time.perf_counter()
        program, sess = compile_for(build(b, hq, hkv, lq, lk, d, causal, False), device=device)
        compile_s = time.perf_counter() - t
        try:
            sess.load_state_dict({n: arrays[n] for n in ("q", "k", "v")})
            err = rel_err(sess.run({}, fetch=("o",))["o"], to_numpy(t_fwd()))
            ours = profile_ms(sess, {}, args.warmup, args.repeats)["all"]
        finally:
            sess.close()
        with torch.no_grad():
            theirs = time_torch(t_fwd, dev, args.warmup, args.repeats)
        rec.add(
            result(
                f"sdpa_{name}_fwd",
                "ms",
                ours["median"],
                theirs["median"],
                shape=shape,
                ours_min=ours["min"],
                torch_min=theirs["min"],
                ours_tflops=fl / ours["median"] / 1e9,
                torch_tflops=fl / theirs["median"] / 1e9,
                rel_err=err,
                dispatches=[x.name for x in program.dispatches],
                compile_s=round(compile_s, 3),
            )
        )

        # ---- forward + backward ----
        req = {n: tt[n].clone().requires_grad_(True) for n in ("q", "k", "v")}

        def t_fwd_bwd(req=req, go=tt["go"], causal=causal, gqa=gqa):
            for x in req.values():
                x.grad = None
            o = sdpa(req["q"], req["k"], req["v"], is_causal=causal, enable_gqa=gqa)
            o.backward(go)
            return o

        t = time.perf_counter()
        program, sess = compile_for(build(b, hq, hkv, lq, lk, d, causal, True), device=device)
        compile_s = time.perf_counter() - t
        try:
            sess.load_state_dict(arrays)
            out = sess.run({}, fetch=("o", "dq", "dk", "dv"))
            ref_o = to_numpy(t_fwd_bwd())
            errs = {"o": rel_err(out["o"], ref_o)}
            for n in ("q", "k", "v"):
                errs["d" + n] = rel_err(out["d" + n], to_numpy(req[n].grad))
            prof = profile_ms(sess, {}, args.warmup, args.repeats, {"attn": is_attention})
        finally:
            sess.close()
        theirs = time_torch(t_fwd_bwd, dev, args.warmup, args.repeats)
        ours = prof["attn"]
        rec.add(
            result(
                f"sdpa_{name}_fwd_bwd",
                "ms",
                ours["median"],
                theirs["median"],
                shape=shape,
                ours_min=ours["min"],
                torch_min=theirs["min"],
                ours_all_ms=prof["all"]["median"],
                ours_tflops=3.5 * fl / ours["median"] / 1e9,
                torch_tflops=3.5 * fl / theirs["median"] / 1e9,
                rel_err=max(errs.values()),
                rel_errs=errs,
                dispatches=[x.name for x in program.dispatches],
                compile_s=round(compile_s, 3),
            )
        )
        worst = max(errs.values())
        if max(err, worst) > 1e-4:
            print(f"  WARNING {name}: rel_err fwd {err:.2e}, fwd+bwd {errs}")
        del tt, req
    rec.finish()


if __name__ == "__main__":
    main()
