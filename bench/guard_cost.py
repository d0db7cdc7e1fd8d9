"""Benchmark: the cost of the non-finite guard (``optim.guard``, issue 11 item 3).

For the MNIST MLP training step (784-128-10, batch 64, AdamW) and a transformer step
(``models.transformer``, the decoder of ``TransformerConfig(hidden_size=256, num_layers=4,
num_heads=8, num_kv_heads=4, intermediate_size=512, vocab_size=1024)``, batch 8 x 128 tokens,
AdamW), with and without gradient clipping, it compiles the step without the guard
(``nonfinite_guard=None``) and with it (``"raise"``, what the Trainers compile) and reports the
dispatch counts and the kernels the guard adds. With ``--time`` it also times one step of each
(``Session.run`` fetching the loss, and the guard's count with the guarded program: what
``Trainer.step`` reads) on the default device.

Usage: python bench/guard_cost.py [--time] [--repeats 20] [--case mnist]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import timeit  # noqa: E402
from meganeura import manual_seed  # noqa: E402
from meganeura.compile import CompileOptions, compile  # noqa: E402
from meganeura.models.mlp import build_mlp  # noqa: E402
from meganeura.models.transformer import TransformerConfig, build_transformer  # noqa: E402
from meganeura.optim import HYPER_INPUT, AdamW  # noqa: E402
from meganeura.optim.guard import GUARD_OUTPUT, GUARD_RESET_INPUT  # noqa: E402
from meganeura.runtime import Session, get_device  # noqa: E402
from meganeura.training import device_limits  # noqa: E402

CFG = TransformerConfig(
    vocab_size=1024,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=512,
)


def _cases():
    manual_seed(0)
    mlp = build_mlp(64, (784, 128, 10))
    r = np.random.default_rng(0)
    yield (
        "mnist_mlp_b64",
        mlp,
        {"x": r.standard_normal((64, 784), dtype=np.float32), "y": r.integers(0, 10, 64, np.int32)},
    )
    lm = build_transformer(8, 128, CFG)
    ids = r.integers(0, CFG.vocab_size, (8, 128), np.int32)
    yield "transformer_b8x128", lm, {"input_ids": ids, "labels": ids}


def _kind(name: str) -> str:
    """A dispatch's op names without node ids: '%12+13 matmul' -> 'matmul'."""
    return " ".join(w for w in name.split() if not w.startswith("%"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time", action="store_true", help="also time a step of each program")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    device = get_device()
    limits = device_limits(device)  # fusion and update groups depend on the adapter's limits
    print(f"device: {device.name}")
    for name, model, feeds in _cases():
        if args.case not in name:
            continue
        params = model.state_dict()
        for clip in (None, 1.0):
            progs = {}
            for guard in (None, "raise"):
                opts = CompileOptions(
                    loss="loss", optimizer=AdamW(lr=1e-3), max_grad_norm=clip, nonfinite_guard=guard
                )
                progs[guard] = compile(model.graph, opts, limits)
            base, guarded = progs[None], progs["raise"]
            added = collections.Counter(_kind(d.name) for d in guarded.dispatches)
            added.subtract(_kind(d.name) for d in base.dispatches)
            extra = {k: v for k, v in added.items() if v}
            n0, n1 = len(base.dispatches), len(guarded.dispatches)
            print(
                f"{name} clip={clip}: {n0} dispatches without the guard, {n1} with it "
                f"(+{n1 - n0}: {extra})"
            )
            if not args.time:
                continue
            for guard, prog in progs.items():
                sess = Session(prog, device)
                sess.load_state_dict({**sess.state_dict(), **params})
                full = {**feeds, HYPER_INPUT: AdamW(lr=1e-3).hyper(0, 1e-3)}
                fetch = ("loss",)
                if guard:
                    full[GUARD_RESET_INPUT] = np.float32(1)
                    fetch += (GUARD_OUTPUT,)
                step = lambda s=sess, f=full, o=fetch: s.run(f, o)  # noqa: E731
                t = timeit(step, sess.synchronize, 3, args.repeats)
                print(f"  guard={guard}: {t['median']:.3f} ms per step (median)")
                sess.close()


if __name__ == "__main__":
    main()
