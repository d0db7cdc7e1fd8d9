"""Profile by difference: where the time of the tiled matmul kernel goes on a 4096^3 product.

NVIDIA's hardware profiler reads CUDA kernels, not Vulkan ones, so this places the kernel's
time by timing variants that leave stages out (``matmul/tiled.py: ABLATE``):
  * ``full``: the kernel as shipped;
  * ``no_global``: no global loads or workgroup stores; the K loop multiplies whatever the
    workgroup tiles hold (barriers kept);
  * ``no_shared``: also no workgroup-memory reads in the loop: each thread's operands are read
    once before it, leaving the unrolled FMAs, the loop and the barriers.
``no_shared`` is the FMA rate the driver's code reaches from this WGSL; ``full`` minus
``no_global`` is what feeding the tiles costs, ``no_global`` minus ``no_shared`` what reading
them does. Ablated results are wrong by design and not checked. PyTorch (cuBLAS, TF32 off)
runs the same product in the same process; TFLOP/s = 2 M N K / kernel time.

Usage: python bench/matmul_ablation.py [--quick] [--plans 128x128x8 ...] [--out-name ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    add_args,
    profile_ms,
    resolve_args,
    result,
    start,
    time_torch,
)
from bench.matmul import build, torch_fn  # noqa: E402

MODES = ("full", "no_global", "no_shared")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "matmul_ablation")
    ap.add_argument("--plans", nargs="*", default=["128x128x8", "128x128x8/np", "64x64x16"])
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args()
    resolve_args(args)
    from meganeura.codegen.wgsl.matmul import plan as mm
    from meganeura.codegen.wgsl.matmul import tiled as matmul_tiled
    from meganeura.training import compile_for

    device, torch, dev, rec = start(args)
    s = 256 if args.quick else args.size
    graph, a_shape, b_shape = build(s, s, s, "nn")
    rng = np.random.default_rng(0)
    params = {
        "a": rng.standard_normal(a_shape, dtype=np.float32),
        "b": rng.standard_normal(b_shape, dtype=np.float32),
    }
    ta, tb = (torch.from_numpy(params[n]).to(dev) for n in ("a", "b"))
    theirs = time_torch(torch_fn(torch, ta, tb, "nn"), dev, args.warmup, args.repeats)["median"]
    flop = 2.0 * s**3
    for plan in args.plans:
        for mode in MODES:
            mm.force_plan(plan)
            matmul_tiled.ABLATE[:] = [] if mode == "full" else [mode]
            try:
                _, sess = compile_for(build(s, s, s, "nn")[0], device=device)
            finally:
                mm.force_plan(None)
                matmul_tiled.ABLATE[:] = []
            try:
                sess.load_state_dict(params)
                ours = profile_ms(sess, {}, args.warmup, args.repeats)["all"]["median"]
            finally:
                sess.close()
            rec.add(
                result(
                    f"matmul_{s}_{plan}_{mode}",
                    "TFLOP/s",
                    flop / ours / 1e9,
                    flop / theirs / 1e9,
                    ours_ms=ours,
                    torch_ms=theirs,
                    plan=plan,
                    mode=mode,
                )
            )
    rec.finish()


if __name__ == "__main__":
    main()
