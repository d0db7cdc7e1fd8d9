"""Benchmark: what naga's runtime checks cost, kernel by kernel, against PyTorch.

WebGPU's default shader module clamps every dynamic index into bounds and bounds every loop
with a counter (``PipelineCache.runtime_checks = True``); a trusted module passes the WGSL on
as written (``False``). Each case is compiled both ways in the same process and profiled
alternately (checked, trusted, checked, trusted; the median of each kind's two medians), and
PyTorch runs the same op on the same device.

Row: ``ours`` is the trusted time, ``ours_checked`` the checked one, ``torch`` PyTorch's
(CUDA events); ``speedup`` = torch / ours, ``checks_cost`` = checked / trusted. Outputs of
the two builds are compared (``rel_diff``).

Usage: python bench/runtime_checks.py [--quick] [--repeats 10] [--out-name runtime_checks]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import attention, conv, matmul  # noqa: E402
from bench.common import (  # noqa: E402
    add_args,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    start,
    time_torch,
)

# (case, M, K, N, layout)
MATMULS = [
    ("matmul_4096", 4096, 4096, 4096, "nt"),
    ("matmul_4096", 4096, 4096, 4096, "nn"),
    ("whisper_fc1", 1500, 384, 1536, "nt"),
    ("whisper_fc2", 1500, 1536, 384, "nt"),
    ("smollm2_gate_up", 128, 576, 1536, "nt"),
    ("smollm2_dw_gate_up", 576, 128, 1536, "tn"),
]
ATTENTION = [c for c in attention.CASES if c[0] in ("whisper", "smollm2")]
CONVS = [c for c in conv.LAYERS if c[0] in ("stem_7x7s2", "l1_3x3_64", "l2_3x3s2_128")]


def measure(device, build, params, args):
    """({checks: median ms}, rel diff of outputs) for one graph (``build()``) compiled both
    ways and profiled alternately."""
    from meganeura.training import compile_for

    sessions, outs, times = {}, {}, {True: [], False: []}
    before = device.pipelines.runtime_checks
    try:
        for checks in (True, False):
            device.pipelines.runtime_checks = checks
            _, sess = compile_for(build(), device=device)
            sess.load_state_dict(params)
            sessions[checks] = sess
            outs[checks] = sess.run({}, fetch=tuple(sess.program.outputs))
        for _ in range(2):
            for checks in (True, False):
                prof = profile_ms(sessions[checks], {}, args.warmup, args.repeats)
                times[checks].append(prof["all"]["median"])
    finally:
        device.pipelines.runtime_checks = before
        for sess in sessions.values():
            sess.close()
    diff = max(rel_err(outs[False][k], outs[True][k]) for k in outs[True])
    return {c: statistics.median(t) for c, t in times.items()}, diff


def graph_of(m, k, n, layout):
    return matmul.build(m, k, n, layout)[0]


def torch_sdpa(torch, tt, causal, gqa, backward):
    o = torch.nn.functional.scaled_dot_product_attention(
        tt["q"], tt["k"], tt["v"], is_causal=causal, enable_gqa=gqa
    )
    if backward:
        torch.autograd.grad(o, (tt["q"], tt["k"], tt["v"]), tt["go"])
    return o


def torch_conv(torch, x, w, gy, stride, padding):
    y = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
    torch.autograd.grad(y, (x, w), gy)


def add(rec, case, shape, t, diff, theirs):
    rec.add(
        result(
            case,
            "ms",
            t[False],
            theirs,
            ours_checked=t[True],
            checks_cost=t[True] / t[False],
            rel_diff=diff,
            shape=shape,
        ),
        line=f"{case:<40} trusted {t[False]:8.4f} ms  checked {t[True]:8.4f} ms  "
        f"({t[True] / t[False]:5.3f}x)  torch {theirs:8.4f} ms  diff {diff:.1e}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "runtime_checks")
    args = ap.parse_args()
    resolve_args(args)
    device, torch, dev, rec = start(args)
    rng = np.random.default_rng(0)

    for case, m, k, n, layout in MATMULS:
        if args.quick:
            m, k, n = min(m, 256), min(k, 256), min(n, 256)
        graph, a_shape, b_shape = matmul.build(m, k, n, layout)
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32) / np.float32(np.sqrt(k))
        t, diff = measure(device, partial(graph_of, m, k, n, layout), {"a": a, "b": b}, args)
        ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
        theirs = time_torch(matmul.torch_fn(torch, ta, tb, layout), dev, args.warmup, args.repeats)
        add(rec, f"{case}_{layout}", f"{layout} M={m} K={k} N={n}", t, diff, theirs["median"])

    for name, b, hq, hkv, lq, lk, d, causal in ATTENTION:
        if args.quick:
            lq = lk = min(lq, 96)
        arrays = {
            "q": rng.standard_normal((b, hq, lq, d), dtype=np.float32),
            "k": rng.standard_normal((b, hkv, lk, d), dtype=np.float32),
            "v": rng.standard_normal((b, hkv, lk, d), dtype=np.float32),
            "go": rng.standard_normal((b, hq, lq, d), dtype=np.float32),
        }
        tt = {
            n_: torch.from_numpy(x).to(dev).requires_grad_(n_ != "go") for n_, x in arrays.items()
        }
        shape = f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}{' causal' if causal else ''}"
        for backward in (False, True):
            t, diff = measure(
                device,
                partial(attention.build, b, hq, hkv, lq, lk, d, causal, backward),
                arrays if backward else {n_: arrays[n_] for n_ in ("q", "k", "v")},
                args,
            )

            theirs = time_torch(
                partial(torch_sdpa, torch, tt, causal, hq != hkv, backward),
                dev,
                args.warmup,
                args.repeats,
            )
            part = "fwd_bwd" if backward else "fwd"
            add(rec, f"attention_{name}_{part}", shape, t, diff, theirs["median"])

    n = 1 if args.quick else 4
    for name, c, oc, k, s, h, _count in CONVS:
        if args.quick:
            h = min(h, 28)
        oh = conv.out_size(h, k, s)
        params = {
            "x": rng.standard_normal((n, c, h, h), dtype=np.float32),
            "w": rng.standard_normal((oc, c, k, k), dtype=np.float32) / np.float32(c * k * k),
            "gy": rng.standard_normal((n, oc, oh, oh), dtype=np.float32),
        }
        t, diff = measure(device, partial(conv.build, n, c, oc, k, s, h), params, args)
        tx, tw, tgy = (torch.from_numpy(params[x]).to(dev) for x in ("x", "w", "gy"))
        tx.requires_grad_(True)
        tw.requires_grad_(True)

        theirs = time_torch(
            partial(torch_conv, torch, tx, tw, tgy, s, k // 2), dev, args.warmup, args.repeats
        )
        add(
            rec,
            f"conv_{name}_fwd_bwd",
            f"N{n} C{c} H{h} OC{oc} {k}x{k}/{s}",
            t,
            diff,
            theirs["median"],
        )
    rec.finish()


if __name__ == "__main__":
    main()
