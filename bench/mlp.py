"""Benchmark: the MNIST MLP (784-128-10, ReLU, cross-entropy, AdamW) forward and training
step at batch 64 and 1024, meganeura vs PyTorch (CUDA when available, else CPU), same run.

Rows ``mlp_{forward,train_step}_b{B}`` compare with PyTorch eager; rows ending ``_compiled``
compare with ``torch.compile`` (default mode) of the model, with ``AdamW(fused=True)`` on CUDA
for the step (its compile time is reported as ``torch_compile_s``). ``--no-compile`` skips
them. Every timing uploads the batch from host memory, on both sides.

Usage: python bench/mlp.py [--repeats 20] [--out-name mlp] [--no-compile]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import timeit, torch_setup, write  # noqa: E402
from meganeura import manual_seed  # noqa: E402
from meganeura.models.mlp import build_mlp  # noqa: E402
from meganeura.optim import AdamW  # noqa: E402
from meganeura.runtime import get_device  # noqa: E402
from meganeura.training import Trainer, compile_for  # noqa: E402


def torch_cases(
    batch: int, params: dict, x: np.ndarray, y: np.ndarray, repeats: int, compiled: bool = False
):
    """(forward timing, step timing, device, compile seconds) of PyTorch eager, or of
    ``torch.compile`` when ``compiled``."""
    import time

    torch, dev = torch_setup()
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    ).to(dev)
    with torch.no_grad():
        for name, p in zip(
            ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], model.parameters()
        ):
            p.copy_(torch.from_numpy(params[name]))
    fused = {"fused": True} if compiled and dev == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **fused)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    compile_s = 0.0
    if compiled:
        model = torch.compile(model)

    # Both frameworks upload the batch from host memory on every call, as a training loop
    # over host data must; meganeura's Session.run does the same through queue.write_buffer.
    def fwd():
        with torch.no_grad():
            model(torch.from_numpy(x).to(dev))

    def step():
        opt.zero_grad(set_to_none=True)
        tx, ty = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev).long()
        torch.nn.functional.cross_entropy(model(tx), ty).backward()
        opt.step()

    if compiled:  # compile both graphs (forward-only and training) outside the timings
        t = time.perf_counter()
        fwd()
        step()
        sync()
        compile_s = time.perf_counter() - t
    return timeit(fwd, sync, repeats=repeats), timeit(step, sync, repeats=repeats), dev, compile_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out-name", default="mlp")
    ap.add_argument("--adapter", default=os.environ.get("MEGANEURA_ADAPTER"))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = ap.parse_args()
    device = get_device(args.adapter)
    rng = np.random.default_rng(0)
    results = []
    for batch in (64, 1024):
        x = rng.standard_normal((batch, 784)).astype(np.float32)
        y = rng.integers(0, 10, batch).astype(np.int32)
        manual_seed(0)
        net = build_mlp(batch)
        params = net.state_dict()
        trainer = Trainer(net.graph, AdamW(lr=1e-3, weight_decay=0.01), device=device)
        trainer.load_parameters(params)
        infer = build_mlp(batch, labels=False)
        _, sess = compile_for(infer.graph, device=device)
        sess.load_state_dict(params)

        def ours_forward(sess=sess, x=x):
            sess.run({"x": x})

        def ours_train(trainer=trainer, x=x, y=y):
            trainer.step({"x": x, "y": y}, fetch=())

        ours_fwd = timeit(ours_forward, sess.synchronize, repeats=args.repeats)
        ours_step = timeit(ours_train, trainer.session.synchronize, repeats=args.repeats)
        t_fwd, t_step, tdev, _ = torch_cases(batch, params, x, y, args.repeats)
        rows = [("forward", "", ours_fwd, t_fwd, {}), ("train_step", "", ours_step, t_step, {})]
        if not args.no_compile:
            c_fwd, c_step, _, c_s = torch_cases(batch, params, x, y, args.repeats, compiled=True)
            extra = {"torch_compile_s": c_s}
            rows += [
                ("forward", "_compiled", ours_fwd, c_fwd, extra),
                ("train_step", "_compiled", ours_step, c_step, extra),
            ]
        for case, suffix, ours, theirs, extra in rows:
            results.append(
                {
                    "case": f"mlp_{case}_b{batch}{suffix}",
                    "metric": "ms",
                    "ours": ours["median"],
                    "torch": theirs["median"],
                    "speedup": theirs["median"] / ours["median"],
                    "ours_min": ours["min"],
                    "torch_min": theirs["min"],
                    "torch_device": tdev,
                    "dispatches": len(trainer.program.dispatches)
                    if case == "train_step"
                    else len(sess.program.dispatches),
                    **extra,
                }
            )
            r = results[-1]
            print(
                f"{r['case']:<33} ours {r['ours']:8.3f} ms   torch({tdev}) {r['torch']:8.3f} ms"
                f"   speedup {r['speedup']:.2f}x   dispatches {r['dispatches']}"
            )
    path = write(args.out_name, device, results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
