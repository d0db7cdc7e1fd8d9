"""Benchmark: what compile-on-call costs. For each model, ``model(x)`` on a new input signature
(trace + compile + Session setup + the first run, which includes the driver's shader compile)
and on a cache hit, against ``torch.compile`` of the same module (first call, then a hit) and
PyTorch eager, same process, same weights, outputs returned to the host on both sides.

Also: the hit's overhead over calling the compiled program's Session directly (the price of
the module layer), a second batch size (a second compile of the same model: its parameters
are shared, nothing is uploaded again), and the module Trainer's first step against a hit.

Models: the MNIST MLP (784-128-10, batch 64), ResNet-18 (torchvision's, 3x64x64, batch 8,
eval) and a BERT encoder (4 layers, hidden 256, seq 128, batch 4, eval; transformers' BertModel
on the torch side). torchvision and transformers are optional: a missing one skips its model.

Usage: python bench/compile_cache.py [--repeats 20] [--out-name compile_cache]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meganeura as mn  # noqa: E402
import meganeura.nn.functional as F  # noqa: E402
from bench.common import timeit, torch_setup, torch_sync, write  # noqa: E402
from meganeura.runtime import get_device  # noqa: E402


class MLP(mn.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = mn.nn.Linear(784, 128), mn.nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def models(rng, quick=False):
    """(name, ours, torch module, example input, second input) for each available model."""
    import torch

    out = []
    tm = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ours = MLP()
    ours.load_state_dict(
        {
            k.replace("0.", "fc1.").replace("2.", "fc2."): v.numpy()
            for k, v in tm.state_dict().items()
        }
    )
    x = rng.standard_normal((64, 784)).astype(np.float32)
    out.append(("mlp_b64", ours, tm, x, x[:32]))
    if quick:
        return out
    try:
        import torchvision

        from meganeura.models.resnet import resnet

        tm = torchvision.models.resnet18(num_classes=1000).eval()
        ours = resnet("resnet18").eval()
        ours.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
        x = rng.standard_normal((8, 3, 64, 64)).astype(np.float32)
        out.append(("resnet18_b8_64px", ours, tm, x, x[:4]))
    except ImportError as e:
        print(f"skipping ResNet-18: {e}")
    try:
        import transformers

        from meganeura.models.bert import BertConfig, BertModel

        kw = dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=30522,
        )
        tm = transformers.BertModel(
            transformers.BertConfig(**kw, attn_implementation="eager"), add_pooling_layer=False
        ).eval()
        ours = BertModel(BertConfig(**kw), add_pooling_layer=False).eval()
        ours.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
        ids = rng.integers(0, 30522, (4, 128)).astype(np.int32)
        out.append(("bert4x256_b4_s128", ours, tm, ids, ids[:2]))
    except ImportError as e:
        print(f"skipping BERT: {e}")
    return out


def bench_model(name, ours, tm, x, x2, dev, sync_torch, repeats) -> list[dict]:
    import torch

    tx = torch.from_numpy(x.astype(np.int64) if x.dtype == np.int32 else x).to(dev)

    def torch_call(module):
        with torch.no_grad():
            y = module(tx)
            y = y.last_hidden_state if hasattr(y, "last_hidden_state") else y
            return y.cpu().numpy()

    cm = mn.compile(ours)
    t = time.perf_counter()
    y = cm(x)
    first = time.perf_counter() - t
    entry = cm.cache_info().entries[0]
    y = y["last_hidden_state"] if isinstance(y, dict) else y
    ref = torch_call(tm)
    err = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
    hit = timeit(lambda: cm(x), lambda: None, warmup=3, repeats=repeats)
    runner = entry.runner
    feeds = dict(zip(runner.traced.inputs, [x], strict=False))
    fetch = tuple(runner.program.outputs)
    raw = timeit(lambda: runner.session.run(feeds, fetch), lambda: None, 3, repeats)
    t = time.perf_counter()
    cm(x2)
    second = time.perf_counter() - t
    eager = timeit(lambda: torch_call(tm), sync_torch, 3, repeats)
    tc = torch.compile(tm)
    t = time.perf_counter()
    torch_call(tc)
    sync_torch()
    tc_first = time.perf_counter() - t
    tc_hit = timeit(lambda: torch_call(tc), sync_torch, 3, repeats)
    return [
        {
            "case": f"{name}_first_call_vs_compile",
            "metric": "s",
            "ours": first,
            "torch": tc_first,
            "speedup": tc_first / first,
            "trace_s": entry.trace_seconds,
            "compile_s": entry.compile_seconds,
            "setup_s": entry.setup_seconds,
            "rel_err": err,
        },
        {
            "case": f"{name}_hit_vs_compile",
            "metric": "ms",
            "ours": hit["median"],
            "torch": tc_hit["median"],
            "speedup": tc_hit["median"] / hit["median"],
            "ours_min": hit["min"],
            "torch_min": tc_hit["min"],
        },
        {
            "case": f"{name}_hit_vs_eager",
            "metric": "ms",
            "ours": hit["median"],
            "torch": eager["median"],
            "speedup": eager["median"] / hit["median"],
        },
        {
            "case": f"{name}_hit_over_session_run",
            "metric": "ms",
            "ours": hit["median"],
            "torch": None,
            "speedup": None,
            "session_run_ms": raw["median"],
            "layer_overhead_ms": hit["median"] - raw["median"],
        },
        {
            "case": f"{name}_second_batch_size_first_call",
            "metric": "s",
            "ours": second,
            "torch": None,
            "speedup": None,
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out-name", default="compile_cache")
    ap.add_argument("--quick", action="store_true", help="MLP only, few repeats (smoke test)")
    args = ap.parse_args()
    _, dev = torch_setup()
    sync_torch = torch_sync(dev)
    device = get_device()
    rng = np.random.default_rng(0)
    rows = []
    for name, ours, tm, x, x2 in models(rng, args.quick):
        rows += bench_model(name, ours, tm.to(dev), x, x2, dev, sync_torch, args.repeats)
        print(rows[-5:], flush=True)

    # the module Trainer: first step of a signature and a hit
    model = MLP()
    tr = mn.Trainer(model, mn.optim.AdamW(lr=1e-3), lambda m, x, y: F.cross_entropy(m(x), y))
    x = rng.standard_normal((64, 784)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    t = time.perf_counter()
    tr.step(x, y)
    first = time.perf_counter() - t
    hit = timeit(lambda: tr.step(x, y), lambda: None, 3, args.repeats)
    rows.append(
        {
            "case": "mlp_b64_trainer_first_step",
            "metric": "s",
            "ours": first,
            "torch": None,
            "speedup": None,
            "hit_ms": hit["median"],
        }
    )
    write(args.out_name, device, rows, quick=args.quick)


if __name__ == "__main__":
    main()
