"""Benchmark: strict f32 vs the fast mode (f16 storage, f32 accumulation) on the same device.

Cases:
  matmul       c = a @ b, 4096 x 4096 x 4096, a and b parameters (f16 in fast mode), forward
  mlp_step     a training step (AdamW) of an MLP 784-4096-4096-10, batch 1024
  transformer  a training step (AdamW) of a decoder: hidden 512, 8 heads (4 kv), 2 layers,
               intermediate 2048, vocab 4096, batch 4 x seq 512
Each case is compiled twice (``CompileOptions.precision`` strict and fast); the time is the
wall clock of ``--repeats`` back-to-back steps ended by ``Session.synchronize`` (after
``--warmup`` steps), so it includes submission, as a training loop sees it. Every case also
reports the fast output's relative error against strict (``max|fast - strict| / max|strict|``
of the logits / product, or of the first-step loss for training cases).

Usage: python bench/fast_mode.py [--repeats 20] [--warmup 3]
       [--out bench/results/precision/fast_mode.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meganeura import manual_seed  # noqa: E402
from meganeura.compile import CompileOptions  # noqa: E402
from meganeura.graph.builder import GraphBuilder  # noqa: E402
from meganeura.models.mlp import build_mlp  # noqa: E402
from meganeura.models.transformer import TransformerConfig, build_transformer  # noqa: E402
from meganeura.optim import AdamW  # noqa: E402
from meganeura.runtime import get_device  # noqa: E402
from meganeura.training import Trainer, compile_for  # noqa: E402


def _time(step, sync, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    sync()
    return (time.perf_counter() - t) / repeats * 1e3


def bench_matmul(dev, precision, args, n=4096):
    b = GraphBuilder()
    a, w = b.parameter("a", (n, n)), b.parameter("b", (n, n))
    b.output("c", a @ w)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal((n, n)).astype(np.float32) for k in ("a", "b")}
    prog, s = compile_for(b.build(), CompileOptions(precision=precision), dev)
    s.load_state_dict(params)
    ms = _time(lambda: s.run({}), s.synchronize, args.repeats, args.warmup)
    out = s.run({}, ["c"])["c"]
    s.close()
    return prog, ms, out, 2 * n**3 / (ms * 1e-3) / 1e12


def bench_train(dev, precision, args, graph, params, feeds):
    tr = Trainer(graph, AdamW(lr=1e-4), device=dev, precision=precision)
    tr.load_parameters(params)
    loss = float(tr.step(feeds)["loss"])
    ms = _time(lambda: tr.step(feeds, fetch=()), tr.session.synchronize, args.repeats, args.warmup)
    tr.session.close()
    return tr.program, ms, np.array(loss), None


def cases(args):
    rng = np.random.default_rng(1)
    manual_seed(2)
    mlp = build_mlp(1024, (784, 4096, 4096, 10))
    mlp_feeds = {
        "x": rng.standard_normal((1024, 784)).astype(np.float32),
        "y": rng.integers(0, 10, 1024).astype(np.int32),
    }
    cfg = TransformerConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=2048,
    )
    manual_seed(3)
    tf = build_transformer(4, 512, cfg)
    tf_feeds = {
        "input_ids": rng.integers(0, 4096, (4, 512)).astype(np.int32),
        "labels": rng.integers(0, 4096, (4, 512)).astype(np.int32),
    }
    return {
        "matmul": lambda dev, p: bench_matmul(dev, p, args),
        "mlp_step": lambda dev, p: bench_train(
            dev, p, args, mlp.graph, mlp.state_dict(), mlp_feeds
        ),
        "transformer": lambda dev, p: bench_train(
            dev, p, args, tf.graph, tf.state_dict(), tf_feeds
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="case names to run (default all)")
    ap.add_argument("--out", default="bench/results/precision/fast_mode.json")
    args = ap.parse_args()
    dev = get_device()
    report = {"device": dev.name, "shader_f16": "shader-f16" in dev.features, "cases": {}}
    for name, run in cases(args).items():
        if args.only and name not in args.only:
            continue
        row, ref = {}, None
        for precision in ("strict", "fast"):
            prog, ms, out, tflops = run(dev, precision)
            row[f"{precision}_ms"] = round(ms, 4)
            row[f"{precision}_compiled"] = prog.meta["precision"]
            if tflops is not None:
                row[f"{precision}_tflops"] = round(tflops, 2)
            if ref is None:
                ref = out
            else:
                row["fast_rel_err"] = float(np.abs(out - ref).max() / np.abs(ref).max())
        row["speedup"] = round(row["strict_ms"] / row["fast_ms"], 3)
        report["cases"][name] = row
        print(name, row, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
