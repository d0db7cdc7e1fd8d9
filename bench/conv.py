"""Benchmark: ResNet-50's distinct convolution shapes at batch 4 (224x224 input), forward,
grad-input and grad-weight each, meganeura vs cuDNN with TF32 off (strict f32).

Shapes: torchvision's resnet50 (v1.5: stride on the 3x3 conv, 1x1 downsample), listed below
with how many times each occurs; ``--quick`` runs a handful of them at batch 1 on 32x32-ish
inputs. Ours: one program per shape holding ``y = conv2d(x, w)`` and the gradients of x and w
from ``meganeura.autodiff.differentiate`` of ``sum(y * gy)`` (x, w, gy parameters, uploaded
once); ``Session.profile`` times each dispatch and the rows sum the dispatches of each op
(``conv2d``, ``conv2d_backward_input``, ``conv2d_backward_weight``; a strided grad-input may be
several dispatches). Torch: ``F.conv2d``, ``torch.nn.grad.conv2d_input`` and
``torch.nn.grad.conv2d_weight`` (cuDNN, ``cudnn.benchmark`` on so it picks its best algorithm
during warm-up), CUDA events around each. FLOPs = 2 N OC OH OW C KH KW for each of the three.

The ``resnet50_b4_*`` rows add every layer's time weighted by its count: the whole network's
convolutions (the stem's grad-input left out: training never computes it).

Usage: python bench/conv.py [--quick] [--repeats 10] [--out-name conv]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    Recorder,
    add_args,
    dispatch_op,
    kernels_apart,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    time_torch,
    to_numpy,
    torch_setup,
    warm_gpu,
)

# name, C_in, C_out, kernel, stride, H_in (square), count in resnet50. Padding is k // 2.
LAYERS = [
    ("stem_7x7s2", 3, 64, 7, 2, 224, 1),
    # layer1 (56x56), 3 bottlenecks of width 64; downsample 64->256 has conv3's shape
    ("l1_1x1_64_64", 64, 64, 1, 1, 56, 1),
    ("l1_3x3_64", 64, 64, 3, 1, 56, 3),
    ("l1_1x1_64_256", 64, 256, 1, 1, 56, 4),
    ("l1_1x1_256_64", 256, 64, 1, 1, 56, 2),
    # layer2 (56 -> 28), 4 bottlenecks of width 128
    ("l2_1x1_256_128", 256, 128, 1, 1, 56, 1),
    ("l2_3x3s2_128", 128, 128, 3, 2, 56, 1),
    ("l2_ds_1x1s2_256_512", 256, 512, 1, 2, 56, 1),
    ("l2_1x1_128_512", 128, 512, 1, 1, 28, 4),
    ("l2_1x1_512_128", 512, 128, 1, 1, 28, 3),
    ("l2_3x3_128", 128, 128, 3, 1, 28, 3),
    # layer3 (28 -> 14), 6 bottlenecks of width 256
    ("l3_1x1_512_256", 512, 256, 1, 1, 28, 1),
    ("l3_3x3s2_256", 256, 256, 3, 2, 28, 1),
    ("l3_ds_1x1s2_512_1024", 512, 1024, 1, 2, 28, 1),
    ("l3_1x1_256_1024", 256, 1024, 1, 1, 14, 6),
    ("l3_1x1_1024_256", 1024, 256, 1, 1, 14, 5),
    ("l3_3x3_256", 256, 256, 3, 1, 14, 5),
    # layer4 (14 -> 7), 3 bottlenecks of width 512
    ("l4_1x1_1024_512", 1024, 512, 1, 1, 14, 1),
    ("l4_3x3s2_512", 512, 512, 3, 2, 14, 1),
    ("l4_ds_1x1s2_1024_2048", 1024, 2048, 1, 2, 14, 1),
    ("l4_1x1_512_2048", 512, 2048, 1, 1, 7, 3),
    ("l4_1x1_2048_512", 2048, 512, 1, 1, 7, 2),
    ("l4_3x3_512", 512, 512, 3, 1, 7, 2),
]
QUICK = ("stem_7x7s2", "l1_3x3_64", "l2_3x3s2_128", "l2_ds_1x1s2_256_512", "l4_1x1_512_2048")
PARTS = ("fwd", "bwd_input", "bwd_weight")
OPS = {
    "fwd": "conv2d",
    "bwd_input": "conv2d_backward_input",
    "bwd_weight": "conv2d_backward_weight",
}


def out_size(h: int, k: int, s: int) -> int:
    return (h + 2 * (k // 2) - k) // s + 1


def torch_fns(torch, tx, tw, tgy, s: int, pad: int) -> dict:
    """PyTorch's three products of one convolution, keyed by ``PARTS``: ``F.conv2d``,
    ``torch.nn.grad.conv2d_input`` and ``conv2d_weight`` on the given device tensors."""
    tF = torch.nn.functional
    return {
        "fwd": lambda: tF.conv2d(tx, tw, None, s, pad),
        "bwd_input": lambda: torch.nn.grad.conv2d_input(tx.shape, tw, tgy, s, pad),
        "bwd_weight": lambda: torch.nn.grad.conv2d_weight(tx, tw.shape, tgy, s, pad),
    }


def build(n, c, oc, k, s, h):
    import meganeura as mn
    import meganeura.nn.functional as F
    from meganeura.autodiff import differentiate

    oh = out_size(h, k, s)
    g = mn.GraphBuilder()
    x = g.parameter("x", (n, c, h, h))
    w = g.parameter("w", (oc, c, k, k))
    gy = g.parameter("gy", (n, oc, oh, oh))
    y = F.conv2d(x, w, stride=s, padding=k // 2)
    g.output("y", y)
    loss = F.sum(y * gy)
    graph, grads = differentiate(g.build_unverified(), loss.id, ["x", "w"])
    gb = mn.GraphBuilder(graph)
    gb.output("dx", gb.tensor(grads[graph.find("x").id]))
    gb.output("dw", gb.tensor(grads[graph.find("w").id]))
    return gb.build_unverified()


def main() -> None:
    """Run the benchmark, every kernel in its own dispatch (``common.kernels_apart``)."""
    with kernels_apart():
        _main()


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "conv")
    ap.add_argument("--batch", type=int, default=None, help="default 4 (1 when --quick)")
    args = ap.parse_args()
    resolve_args(args)
    from meganeura.runtime import get_device
    from meganeura.training import compile_for

    device = get_device(args.adapter)
    torch, dev = torch_setup()
    torch.backends.cudnn.benchmark = True
    warm = warm_gpu(device, dev, args.warm_seconds)
    n = args.batch or (1 if args.quick else 4)
    rec = Recorder(args, device, {"torch_device": dev, "gpu_warmup": warm, "batch": n})
    layers = [x for x in LAYERS if x[0] in QUICK] if args.quick else LAYERS
    totals = {p: [0.0, 0.0] for p in PARTS}

    for name, c, oc, k, s, h, count in layers:
        if args.quick:  # lavapipe: 1/7 of the spatial size, at most 64 channels
            h, c, oc = max(k, h // 7), min(c, 64), min(oc, 64)
        oh = out_size(h, k, s)
        rng = np.random.default_rng(c * 31 + oc + k)
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        w = rng.standard_normal((oc, c, k, k), dtype=np.float32) / np.float32(np.sqrt(c * k * k))
        gy = rng.standard_normal((n, oc, oh, oh), dtype=np.float32)
        tx, tw, tgy = (torch.from_numpy(a).to(dev) for a in (x, w, gy))
        pad = k // 2
        t_fns = torch_fns(torch, tx, tw, tgy, s, pad)
        t = time.perf_counter()
        program, sess = compile_for(build(n, c, oc, k, s, h), device=device)
        compile_s = time.perf_counter() - t
        groups = {p: (lambda nm, op=op: dispatch_op(nm) == op) for p, op in OPS.items()}
        try:
            sess.load_state_dict({"x": x, "w": w, "gy": gy})
            out = sess.run({}, fetch=("y", "dx", "dw"))
            with torch.no_grad():
                refs = {p: to_numpy(f()) for p, f in t_fns.items()}
            errs = {
                "fwd": rel_err(out["y"], refs["fwd"]),
                "bwd_input": rel_err(out["dx"], refs["bwd_input"]),
                "bwd_weight": rel_err(out["dw"], refs["bwd_weight"]),
            }
            prof = profile_ms(sess, {}, args.warmup, args.repeats, groups)
        finally:
            sess.close()
        flop = 2.0 * n * oc * oh * oh * c * k * k
        shape = f"N{n} C{c} H{h} -> OC{oc} OH{oh}, {k}x{k}/{s} pad {pad}"
        for part in PARTS:
            with torch.no_grad():
                theirs = time_torch(t_fns[part], dev, args.warmup, args.repeats)
            ours = prof[part]
            if not (name.startswith("stem") and part == "bwd_input"):
                totals[part][0] += count * ours["median"]
                totals[part][1] += count * theirs["median"]
            rec.add(
                result(
                    f"{name}_{part}",
                    "ms",
                    ours["median"],
                    theirs["median"],
                    shape=shape,
                    count=count,
                    ours_min=ours["min"],
                    torch_min=theirs["min"],
                    ours_tflops=flop / ours["median"] / 1e9,
                    torch_tflops=flop / theirs["median"] / 1e9,
                    rel_err=errs[part],
                    ours_dispatches=[
                        d.name for d in program.dispatches if dispatch_op(d.name) == OPS[part]
                    ],
                    compile_s=round(compile_s, 3),
                )
            )
            if errs[part] > 1e-4:
                print(f"  WARNING {name}_{part}: rel_err {errs[part]:.2e} against PyTorch")
        del tx, tw, tgy
    tag = "quick_subset" if args.quick else f"resnet50_b{n}"
    for part in PARTS:
        o, t = totals[part]
        rec.add(result(f"{tag}_all_convs_{part}", "ms", o, t, weighted_by="count"))
    o, t = (sum(v[i] for v in totals.values()) for i in (0, 1))
    rec.add(result(f"{tag}_all_convs_fwd_bwd", "ms", o, t, weighted_by="count"))
    rec.finish()


if __name__ == "__main__":
    main()
