"""Command line: ``meganeura info | train mnist | predict``.

This is the only place that reads environment variables (``MEGANEURA_ADAPTER``: a substring
of the adapter to use, e.g. ``nvidia`` or ``llvmpipe``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _device(args):
    from .runtime import get_device

    return get_device(args.adapter or os.environ.get("MEGANEURA_ADAPTER") or None)


def cmd_info(args) -> int:
    from .runtime import format_info

    print(format_info(_device(args)))
    return 0


def cmd_train(args) -> int:
    from .recipes.mnist import MnistConfig, train

    cfg = MnistConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        schedule=args.schedule,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        hidden=args.hidden,
        seed=args.seed,
        data=args.data,
        out=args.out,
    )
    dev = _device(args)
    print(f"device: {dev.name}")
    s = train(cfg, resume=args.resume, device=dev, progress=not args.no_progress)
    mem = s["memory"]
    print(
        f"steps: {s['steps']}  final loss: {s['final_loss']:.4f}  "
        f"throughput: {s['samples_per_second']:,.0f} samples/s"
    )
    print(
        f"step memory: {mem['planned_bytes']:,} B planned intermediates "
        f"(naive {mem['naive_bytes']:,} B), {mem['pinned_bytes']:,} B pinned"
    )
    print(f"checkpoint: {s['checkpoint']}")
    if "loss_plot" in s:
        print(f"loss curve: {s['loss_plot']}")
    print(f"test accuracy: {100 * s['test_accuracy']:.2f}%")
    return 0


def cmd_predict(args) -> int:
    from .recipes.mnist import predict

    r = predict(args.checkpoint, data=args.data, count=args.count, device=_device(args))
    print(f"predicted: {r['predictions']}")
    print(f"labels:    {r['labels']}")
    print(f"test accuracy: {100 * r['test_accuracy']:.2f}% over {r['n']} images")
    if args.json:
        print(json.dumps(r))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meganeura", description=__doc__.splitlines()[0])
    p.add_argument("--adapter", help="substring of the adapter to use (env MEGANEURA_ADAPTER)")
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="print the adapter, backend, features and limits")

    t = sub.add_parser("train", help="train a model")
    t.add_argument("job", choices=["mnist"], help="the job to run")
    t.add_argument("--data", help="folder of MNIST IDX files (default: embedded 5k subset)")
    t.add_argument("--epochs", type=int, default=10)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--schedule", choices=["constant", "warmup", "cosine"], default="constant")
    t.add_argument("--warmup-steps", type=int, default=0)
    t.add_argument("--max-grad-norm", type=float, default=None)
    t.add_argument("--hidden", type=int, default=128)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="runs/mnist", help="folder for checkpoint and loss curve")
    t.add_argument("--resume", help="checkpoint to continue from")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    r = sub.add_parser("predict", help="classify MNIST test images with a checkpoint")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--data", help="folder of MNIST IDX files (default: as in training)")
    r.add_argument("--count", type=int, default=10, help="predictions to print")
    r.add_argument("--json", action="store_true", help="also print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"info": cmd_info, "train": cmd_train, "predict": cmd_predict}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
