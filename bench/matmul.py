"""Benchmark: f32 matmul, meganeura vs cuBLAS with TF32 off (strict f32 on both sides).

Cases: a square sweep (512..8192, 4096^3 the headline), and the five workloads' own matmul
shapes (docs/workloads.md) in the layouts the models use: ``nt`` (x @ W^T, nn.Linear's
[out, in] weights, how every projection runs), ``nn`` (x @ W) and a few ``tn`` (x^T @ dy, the
weight gradients of training).

Ours: a one-matmul graph whose operands are *parameters* (uploaded once with
``load_state_dict``), compiled with ``meganeura.training.compile_for``.
  * kernel: GPU time of the dispatch from ``Session.profile`` (timestamp queries);
    torch: CUDA events around the op. Metric TFLOP/s = 2 M N K / time.
  * call (workload shapes only): ``Session.run({})`` + ``synchronize()`` wall time (nothing is
    uploaded because the operands are parameters), against the torch op + cuda.synchronize.
    This includes wgpu's ~0.2 ms read-back sync, PyTorch's sync is a few us.
Each case also checks our output against PyTorch's (``rel_err``).

Usage: python bench/matmul.py [--quick] [--repeats 10] [--warmup 3] [--out-name matmul]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    add_args,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    start,
    time_torch,
    timeit,
    to_numpy,
    torch_sync,
)

# (name, M, K, N, where it comes from). Layout is applied on top: nt = x[M,K] @ W[N,K]^T.
SWEEP = (512, 1024, 2048, 4096, 8192)
WORKLOAD = [
    # W1 SmolLM2-135M, batch 1 x seq 128 (hidden 576, 9 q / 3 kv heads of 64, SwiGLU 1536)
    ("smollm2_q_o", 128, 576, 576, "W1 q_proj and o_proj [128,576]x[576,576]"),
    ("smollm2_k_v", 128, 576, 192, "W1 k_proj / v_proj (3 kv heads x 64)"),
    ("smollm2_gate_up", 128, 576, 1536, "W1 gate_proj / up_proj"),
    ("smollm2_down", 128, 1536, 576, "W1 down_proj"),
    ("smollm2_head", 128, 576, 49152, "W1 tied LM head x @ embedding^T"),
    # W1 decode: one token (the greedy-generation case)
    ("smollm2_dec_q_o", 1, 576, 576, "W1 decode q/o_proj"),
    ("smollm2_dec_k_v", 1, 576, 192, "W1 decode k/v_proj"),
    ("smollm2_dec_gate_up", 1, 576, 1536, "W1 decode gate/up_proj"),
    ("smollm2_dec_down", 1, 1536, 576, "W1 decode down_proj"),
    ("smollm2_dec_head", 1, 576, 49152, "W1 decode LM head"),
    # W2 SmolVLA action expert, chunk 50 (hidden 720, 15 q / 5 kv heads of 64, SwiGLU 2048)
    ("smolvla_q", 50, 720, 960, "W2 q_proj (15 heads x 64)"),
    ("smolvla_k_v", 50, 720, 320, "W2 self-attn k/v_proj (5 kv heads x 64)"),
    ("smolvla_o", 50, 960, 720, "W2 o_proj"),
    ("smolvla_gate_up", 50, 720, 2048, "W2 gate/up_proj"),
    ("smolvla_down", 50, 2048, 720, "W2 down_proj"),
    ("smolvla_cross_kv", 16, 320, 320, "W2 cross-attn Linear(320->320) on VLM K/V [16,320]"),
    ("smolvla_action_in", 50, 32, 720, "W2 action_in_proj [50,32]"),
    ("smolvla_action_out", 50, 720, 32, "W2 action_out_proj -> [50,32]"),
    ("smolvla_c1_gate_up", 1, 720, 2048, "W2 chunk-1 gate/up_proj"),
    # W4 Whisper-tiny encoder, 1500 frames (d 384, 6 heads, fc 1536)
    ("whisper_q_k_v_o", 1500, 384, 384, "W4 q/k/v/out_proj, each 384x384"),
    ("whisper_qkv_fused", 1500, 384, 1152, "W4 q,k,v as one [384,1152] (fusion candidate)"),
    ("whisper_fc1", 1500, 384, 1536, "W4 fc1"),
    ("whisper_fc2", 1500, 1536, 384, "W4 fc2"),
    ("whisper_train_head", 1500, 384, 64, "W4 training head Linear(384->64)"),
]
# Weight gradients dW = x^T @ dy ([K, M] stored transposed: a^T @ b), training only.
TN = [
    ("smollm2_dw_gate_up", 576, 128, 1536, "W1 dW of gate/up: x^T [576,128] @ dy [128,1536]"),
    ("smollm2_dw_down", 1536, 128, 576, "W1 dW of down_proj"),
    ("whisper_dw_fc1", 384, 1500, 1536, "W4 dW of fc1: x^T [384,1500] @ dy [1500,1536]"),
]


def build(m: int, k: int, n: int, layout: str):
    """Graph with one matmul of parameters a, b; returns (graph, a shape, b shape)."""
    import meganeura as mn
    import meganeura.nn.functional as F

    a_shape = (k, m) if layout == "tn" else (m, k)
    b_shape = (n, k) if layout == "nt" else (k, n)
    g = mn.GraphBuilder()
    a = g.parameter("a", a_shape)
    b = g.parameter("b", b_shape)
    if layout == "nt":
        y = F.linear(a, b)
    elif layout == "tn":
        y = a.mT @ b
    else:
        y = a @ b
    g.output("y", y)
    return g.build(), a_shape, b_shape


def torch_fn(torch, a, b, layout: str):
    F = torch.nn.functional
    if layout == "nt":
        return lambda: F.linear(a, b)
    if layout == "tn":
        return lambda: a.mT @ b
    return lambda: a @ b


def run_case(args, device, dev, torch, rec, case, m, k, n, layout, origin, call: bool):
    from meganeura.training import compile_for

    rng = np.random.default_rng(m * 7 + k * 3 + n)
    graph, a_shape, b_shape = build(m, k, n, layout)
    t = time.perf_counter()
    program, sess = compile_for(graph, device=device)
    compile_s = time.perf_counter() - t
    a = rng.standard_normal(a_shape, dtype=np.float32)
    b = rng.standard_normal(b_shape, dtype=np.float32) / np.float32(np.sqrt(k))
    sess.load_state_dict({"a": a, "b": b})
    try:
        ours_y = sess.run({}, fetch=("y",))["y"]
        names = [d.name for d in program.dispatches]
        groups = {n: partial(str.__eq__, n) for n in names}
        prof = profile_ms(sess, {}, args.warmup, args.repeats, groups)
        ours = prof["all"]
        ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
        fn = torch_fn(torch, ta, tb, layout)
        err = rel_err(ours_y, to_numpy(fn()))
        theirs = time_torch(fn, dev, args.warmup, args.repeats)
        flop = 2.0 * m * n * k
        common = {
            "shape": f"{layout} M={m} K={k} N={n}",
            "origin": origin,
            "ours_ms": ours["median"],
            "torch_ms": theirs["median"],
            "ours_min_ms": ours["min"],
            "torch_min_ms": theirs["min"],
            "rel_err": err,
            "dispatches": len(program.dispatches),
            "ours_dispatch_ms": {n: prof[n]["median"] for n in names},
            "compile_s": round(compile_s, 3),
        }
        rec.add(
            result(
                f"{case}_{layout}_kernel",
                "TFLOP/s",
                flop / ours["median"] / 1e9,
                flop / theirs["median"] / 1e9,
                **common,
            )
        )
        if err > 1e-4:
            print(f"  WARNING {case}_{layout}: rel_err {err:.2e} against PyTorch")
        if call:
            o = timeit(lambda: sess.run({}), sess.synchronize, args.warmup, args.repeats)
            c = timeit(fn, torch_sync(dev), args.warmup, args.repeats)
            rec.add(
                result(
                    f"{case}_{layout}_call",
                    "ms",
                    o["median"],
                    c["median"],
                    shape=common["shape"],
                    ours_min=o["min"],
                    torch_min=c["min"],
                )
            )
        del ta, tb
    finally:
        sess.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "matmul")
    ap.add_argument("--no-call", action="store_true", help="skip the end-to-end call timings")
    args = ap.parse_args()
    resolve_args(args)
    device, torch, dev, rec = start(args)

    def scale(d: int) -> int:  # --quick: every shape divided by 8 (at least 1)
        return max(1, d // 8) if args.quick else d

    sweep = (64, 128) if args.quick else SWEEP
    for s in sweep:
        run_case(args, device, dev, torch, rec, f"square{s}", s, s, s, "nn", "sweep", False)
    big = 128 if args.quick else 4096
    run_case(args, device, dev, torch, rec, f"square{big}", big, big, big, "nt", "sweep", False)
    for case, m, k, n, origin in WORKLOAD:
        for layout in ("nt", "nn"):
            run_case(
                args, device, dev, torch, rec, case, scale(m), scale(k), scale(n), layout,
                origin, call=not args.no_call and layout == "nt",
            )  # fmt: skip
    for case, m, k, n, origin in TN:
        run_case(
            args, device, dev, torch, rec, case, scale(m), scale(k), scale(n), "tn", origin,
            call=False,
        )  # fmt: skip
    rec.finish()


if __name__ == "__main__":
    main()
