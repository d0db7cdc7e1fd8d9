"""Benchmark: what issue 11's non-finite work costs, PyTorch in the same process.

Two parts:
  * ``ops``: GPU time of the kernels NaN propagation made heavier (amax over rows and
    columns, argmax, max_pool2d 3x3/2, a maximum/comparison chain, relu), ours by
    ``Session.profile`` timestamps, torch by CUDA events (``bench.common``). Run it on the
    checkout before the change too (``PYTHONPATH=<old checkout> python bench/nonfinite.py
    --parts ops --out-name nonfinite_base_h200``) to see what the change cost.
  * ``guard``: the non-finite guard of a training step (``CompileOptions.nonfinite_guard``,
    what ``mn.Trainer`` compiles): the MNIST MLP step (784-128-10, batch 64, AdamW) and a
    4-layer transformer step (hidden 256, batch 8 x 128, AdamW), with and without gradient
    clipping, each compiled without and with the guard; wall time per step with the loss
    read back (and the guard's count with it), against a torch eager step of the same model
    that reads its loss (``.item()``). Also the dispatch count each program has.

Writes ``bench/results/<out-name>.json`` (default ``nonfinite_h200``).

Usage: python bench/nonfinite.py [--parts ops,guard] [--quick] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    profile_ms,
    rel_err,
    result,
    time_torch,
    timeit,
    to_numpy,
    torch_setup,
    torch_sync,
    write,
)

OPS = {
    # name: (shape, ours(x), torch(x))
    "amax rows [8192,4096] dim1": ((8192, 4096), lambda x: x.amax(1), lambda t: t.amax(1)),
    "amax cols [4096,8192] dim0": ((4096, 8192), lambda x: x.amax(0), lambda t: t.amax(0)),
    "argmax rows [8192,4096] dim1": (
        (8192, 4096),
        lambda x: x.argmax(1),
        lambda t: t.argmax(1),
    ),
    "max_pool2d [32,64,112,112] k3 s2 p1": (
        (32, 64, 112, 112),
        lambda x: _F().max_pool2d(x, 3, stride=2, padding=1),
        lambda t: _tF().max_pool2d(t, 3, stride=2, padding=1),
    ),
    "where(x > 0.5, maximum(x, 0 * x), x) [2^25]": (
        (1 << 25,),
        lambda x: _F().where(x > 0.5, _F().maximum(x, x * 0.0), x),
        lambda t: _torch().where(t > 0.5, _torch().maximum(t, t * 0.0), t),
    ),
    "relu [2^25]": ((1 << 25,), lambda x: _F().relu(x), lambda t: _tF().relu(t)),
}


def _F():
    import meganeura.nn.functional as F

    return F


def _torch():
    import torch

    return torch


def _tF():
    import torch.nn.functional as tF

    return tF


def _small(shape):
    return (max(shape[0] // 64, 1), *shape[1:])


def bench_ops(args, device, torch, dev, rows) -> None:
    from meganeura.compile import CompileOptions, compile
    from meganeura.graph.builder import GraphBuilder
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    rng = np.random.default_rng(0)
    for name, (shape, ours_fn, torch_fn) in OPS.items():
        shape = _small(shape) if args.quick else shape
        b = GraphBuilder()
        b.output("y", ours_fn(b.input("x", shape)))
        program = compile(b.build(), CompileOptions(), device_limits(device))
        x = rng.standard_normal(shape, dtype=np.float32)
        tx = torch.from_numpy(x).to(dev)
        with Session(program, device) as s:
            ours_y = s.run({"x": x}, ("y",))["y"]
            ours = profile_ms(s, {"x": x}, args.warmup, args.repeats)["all"]
        ref = torch_fn(tx)
        theirs = time_torch(lambda f=torch_fn, t=tx: f(t), dev, args.warmup, args.repeats)
        err = rel_err(ours_y, to_numpy(ref))
        rows.append(result(name, "ms", ours["median"], theirs["median"], part="ops", rel_err=err))
        print(
            f"{name:<44} ours {ours['median']:.4f} ms  torch {theirs['median']:.4f} ms  "
            f"err {err:.1e}"
        )


def _guard_cases(quick: bool):
    from meganeura import manual_seed
    from meganeura.models.mlp import build_mlp
    from meganeura.models.transformer import TransformerConfig, build_transformer

    manual_seed(0)
    r = np.random.default_rng(0)
    mlp = build_mlp(64, (784, 128, 10))
    x = r.standard_normal((64, 784), dtype=np.float32)
    yield "mnist_mlp_b64", mlp, {"x": x, "y": r.integers(0, 10, 64, dtype=np.int32)}
    if quick:
        return
    cfg = TransformerConfig(
        vocab_size=1024,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=512,
    )
    lm = build_transformer(8, 128, cfg)
    ids = r.integers(0, cfg.vocab_size, (8, 128), dtype=np.int32)
    yield "transformer_b8x128", lm, {"input_ids": ids, "labels": ids}


def _torch_step(torch, dev, model_name, params, feeds, clip):
    """A torch eager training step of the same model (AdamW, loss read with .item())."""
    tF = torch.nn.functional
    p = {k: torch.tensor(v, device=dev, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.AdamW(p.values(), lr=1e-3)
    if model_name.startswith("mnist"):
        x = torch.from_numpy(feeds["x"]).to(dev)
        y = torch.from_numpy(feeds["y"]).long().to(dev)

        def loss():
            h = tF.relu(tF.linear(x, p["fc1.weight"], p["fc1.bias"]))
            return tF.cross_entropy(tF.linear(h, p["fc2.weight"], p["fc2.bias"]), y)

    else:
        return None

    def step():
        opt.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(p.values(), clip)
        opt.step()
        return value.item()

    return step


def bench_guard(args, device, torch, dev, rows) -> None:
    from meganeura.compile import CompileOptions, compile
    from meganeura.optim import HYPER_INPUT, AdamW
    from meganeura.optim.guard import GUARD_OUTPUT, GUARD_RESET_INPUT
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    limits = device_limits(device)
    for name, model, feeds in _guard_cases(args.quick):
        params = model.state_dict()
        for clip in (None, 1.0):
            times, counts = {}, {}
            for guard in (None, "raise"):
                opts = CompileOptions(
                    loss="loss", optimizer=AdamW(lr=1e-3), max_grad_norm=clip, nonfinite_guard=guard
                )
                prog = compile(model.graph, opts, limits)
                counts[guard] = len(prog.dispatches)
                with Session(prog, device) as sess:
                    sess.load_state_dict({**sess.state_dict(), **params})
                    full = {**feeds, HYPER_INPUT: AdamW(lr=1e-3).hyper(0, 1e-3)}
                    fetch = ("loss",)
                    if guard:
                        full[GUARD_RESET_INPUT] = np.float32(1)
                        fetch += (GUARD_OUTPUT,)
                    step = lambda s=sess, f=full, o=fetch: s.run(f, o)  # noqa: E731
                    times[guard] = timeit(step, sess.synchronize, args.warmup, args.repeats)
            theirs = None
            tstep = _torch_step(torch, dev, name, params, feeds, clip)
            if tstep is not None:
                theirs = timeit(tstep, torch_sync(dev), args.warmup, args.repeats)["median"]
            case = f"{name} clip={clip}"
            off, on = times[None]["median"], times["raise"]["median"]
            rows.append(
                result(
                    case + " guard",
                    "ms",
                    on,
                    theirs if theirs is not None else float("nan"),
                    part="guard",
                    ours_without_guard=off,
                    guard_overhead=on / off - 1.0,
                    dispatches_without_guard=counts[None],
                    dispatches_with_guard=counts["raise"],
                )
            )
            t = f"  torch eager {theirs:.3f} ms" if theirs is not None else ""
            print(
                f"{case:<34} without guard {off:.3f} ms ({counts[None]} dispatches)  with "
                f"{on:.3f} ms ({counts['raise']}): {on / off - 1:+.1%}{t}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ops,guard")
    ap.add_argument("--quick", action="store_true", help="small shapes, MLP only (lavapipe)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out-name", default="nonfinite_h200")
    args = ap.parse_args()
    from meganeura.runtime import get_device

    device = get_device()
    torch, dev = torch_setup()
    rows: list[dict] = []
    parts = args.parts.split(",")
    if "ops" in parts:
        bench_ops(args, device, torch, dev, rows)
    if "guard" in parts:
        bench_guard(args, device, torch, dev, rows)
    print(write(args.out_name, device, rows, quick=args.quick))


if __name__ == "__main__":
    main()
