"""Benchmark: linear layers on Q8_0 / Q4_1 weights (dequantized in the kernel) against f32.

Cases: SmolLM2-135M's projections (hidden 576, 9 q / 3 kv heads of 64, SwiGLU 1536, tied
49152-token LM head) as ``x [M, in] @ W^T``, W [out, in]; decode rows M = 1 and 8 (the GEMV
kernel) and prefill M = 128 (the tiled kernel). Per case and weight type:
  * ours: GPU time of the dispatch (``Session.profile``, timestamp queries) for an f32
    ``F.linear`` (the matmul GEMV / tiled kernels), ``quantized_linear`` q8_0 and q4_1;
  * torch: ``torch.nn.functional.linear`` on the *dequantized f32* weight (CUDA events; the
    CPU on the sandbox), the same weight our quantized kernel multiplies by.
Rows: ``<case>_<type>`` (metric ms, ``speedup`` = torch / ours), with ``weight_bytes`` (what
the kernel must read), ``GB_per_s`` (weight bytes / our time: the decode roofline measure),
``rel_err`` against torch. Our operands are graph parameters / state loaded once.

Usage: python bench/quantized_gemv.py [--quick] [--repeats 10] [--warmup 3]
           [--out bench/results/quantized_gemv_h200.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

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
    to_numpy,
)

# (name, in_features, out_features, origin)
SHAPES = [
    ("q_o_proj", 576, 576, "q_proj / o_proj (9 heads x 64)"),
    ("k_v_proj", 576, 192, "k_proj / v_proj (3 kv heads x 64)"),
    ("gate_up_proj", 576, 1536, "gate_proj / up_proj"),
    ("down_proj", 1536, 576, "down_proj"),
    ("lm_head", 576, 49152, "tied LM head"),
]
ROWS = (1, 8, 128)
TYPES = ("f32", "q8_0", "q4_1")


def build(qtype: str, m: int, n: int, out: int):
    """One-op graph y = x @ W^T; x and W (f32) parameters, packed weights state."""
    import meganeura as mn
    import meganeura.nn.functional as F
    from meganeura.ops import quant_formats as qf

    g = mn.GraphBuilder()
    x = g.parameter("x", (m, n))
    if qtype == "f32":
        y = F.linear(x, g.parameter("w", (out, n)))
    else:
        fmt = qf.qformat(qtype)
        q = g.state("q", fmt.qweight_shape(out, n), mn.DType.u32)
        s = g.state("s", fmt.scales_shape(out, n), mn.DType.u32)
        y = F.quantized_linear(x, q, s, qtype)
    g.output("y", y)
    return g.build()


def run_case(args, device, dev, torch, rec, case, m, n, out, origin):
    from meganeura.ops import quant_formats as qf
    from meganeura.training import compile_for

    rng = np.random.default_rng(m * 7 + n * 3 + out)
    x = rng.standard_normal((m, n), dtype=np.float32)
    w = rng.standard_normal((out, n), dtype=np.float32) / np.float32(np.sqrt(n))
    tx = torch.from_numpy(x).to(dev)
    for qtype in TYPES:
        if qtype == "f32":
            weights, dense = {"w": w}, w
        else:
            q, s = qf.pack_blocks(qf.quantize_blocks(w, qtype), w.shape, qtype)
            weights, dense = {"q": q, "s": s}, qf.dequantize_packed(q, s, qtype)
        program, sess = compile_for(build(qtype, m, n, out), device=device)
        try:
            sess.load_state_dict({"x": x, **weights})
            ours_y = sess.run({}, fetch=("y",))["y"]
            ours = profile_ms(sess, {}, args.warmup, args.repeats)["all"]
        finally:
            sess.close()
        tw = torch.from_numpy(dense).to(dev)
        fn = lambda tw=tw: torch.nn.functional.linear(tx, tw)  # noqa: E731
        err = rel_err(ours_y, to_numpy(fn()))
        theirs = time_torch(fn, dev, args.warmup, args.repeats)
        nbytes = sum(a.nbytes for a in weights.values())
        rec.add(
            result(
                f"{case}_m{m}_{qtype}",
                "ms",
                ours["median"],
                theirs["median"],
                shape=f"M={m} in={n} out={out}",
                origin=origin,
                qtype=qtype,
                ours_min=ours["min"],
                torch_min=theirs["min"],
                weight_bytes=nbytes,
                bytes_per_weight=nbytes / w.size,
                GB_per_s=nbytes / (ours["median"] * 1e6),
                torch_GB_per_s=w.nbytes / (theirs["median"] * 1e6),
                rel_err=err,
                dispatches=[d.name for d in program.dispatches],
            )
        )
        if err > 1e-4:
            print(f"  WARNING {case} {qtype}: rel_err {err:.2e} against PyTorch")
        del tw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "quantized_gemv")
    ap.add_argument("--out", default=None, help="result file (default bench/results/<name>.json)")
    args = ap.parse_args()
    if args.out is not None:
        args.out_name = Path(args.out).stem
    resolve_args(args)
    device, torch, dev, rec = start(args)
    shapes = SHAPES[:2] if args.quick else SHAPES
    rows = (1, 33) if args.quick else ROWS
    for case, n, out, origin in shapes:
        for m in rows:
            run_case(args, device, dev, torch, rec, case, m, n, out, origin)
    path = rec.finish()
    if args.out is not None and Path(args.out).resolve() != path.resolve():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(path.read_text())
        print(f"copied to {args.out}")
    _summary(path)


def _summary(path: Path) -> None:
    """Print quantized vs f32 time per case (ours)."""
    rows = json.loads(path.read_text())["results"]
    by = {(r["shape"], r["qtype"]): r["ours"] for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        f = by.get((shape, "f32"))
        parts = [f"{t} {by[(shape, t)] / f:.2f}x" for t in TYPES[1:] if (shape, t) in by]
        if f:
            print(f"{shape:<28} time vs our f32: " + ", ".join(parts))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.1f} s")
