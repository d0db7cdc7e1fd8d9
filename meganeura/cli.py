"""Command line: ``meganeura info|train|predict|classify|profile|generate|chat|finetune|embed|
transcribe|export|serve-web|tune``.

This is the only place that reads environment variables (``MEGANEURA_ADAPTER``: a substring
of the adapter to use, e.g. ``nvidia`` or ``llvmpipe``; ``MEGANEURA_CACHE_DIR``: the folder
whose ``tuning/`` holds the per-device tuning cache, default ``~/.cache/meganeura``, for every
command: ``meganeura.tune.set_cache_dir``). The runtime only sets one Vulkan
loader variable before the first adapter request (``runtime/device.py``,
``_quiet_vulkan_device_select``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _device(args):
    from .runtime import get_device

    try:
        return get_device(args.adapter or os.environ.get("MEGANEURA_ADAPTER") or None)
    except RuntimeError as e:  # no adapter, or none matching --adapter: main prints it
        raise SystemExit(str(e)) from None


def _distributed_device(args):
    """(device, is rank 0) of an ``mpiexec`` rank (``meganeura.distributed.init``)."""
    try:
        from .distributed import init
    except ImportError as e:  # mpi4py missing
        raise SystemExit(str(e)) from None
    try:
        ctx = init(args.adapter or os.environ.get("MEGANEURA_ADAPTER") or None)
    except (ImportError, RuntimeError) as e:
        raise SystemExit(f"--distributed: {e}") from None
    return ctx.device, ctx.rank == 0


def cmd_info(args) -> int:
    from .runtime import format_info

    print(format_info(_device(args)))
    return 0


def _precision_flag(p) -> None:
    p.add_argument(
        "--precision",
        choices=["strict", "fast"],
        default="strict",
        help="strict f32, or fast: f16 storage with f32 accumulation where the adapter has "
        "shader-f16 (falls back to strict with a warning otherwise)",
    )


def _train_settings(args) -> dict:
    """The settings ``train mnist`` and ``train resnet`` share, from the command line."""
    if args.log_every < 1:
        raise SystemExit(f"--log-every must be >= 1, got {args.log_every}")
    return dict(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        schedule=args.schedule,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        data=args.data,
        out=args.out or f"runs/{args.job}",
        log_every=args.log_every,
        precision=args.precision,
    )


def cmd_train(args) -> int:
    if args.job == "resnet":
        return cmd_train_resnet(args)
    from .io.checkpoint import CheckpointError
    from .recipes.mnist import MnistConfig, train

    cfg = MnistConfig(hidden=args.hidden, distributed=args.distributed, **_train_settings(args))
    dev, main = _distributed_device(args) if args.distributed else (_device(args), True)
    if main:
        print(f"device: {dev.name}")
    cache = dev.pipelines
    before = (cache.compiled, cache.hits, cache.shader_seconds + cache.pipeline_seconds)
    try:
        s = train(cfg, resume=args.resume, device=dev, progress=not args.no_progress)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"meganeura train mnist: {e}", file=sys.stderr)
        return 2
    if not main:  # rank 0 alone reports
        return 0
    compiled, hits = cache.compiled - before[0], cache.hits - before[1]
    pipeline_s = cache.shader_seconds + cache.pipeline_seconds - before[2]
    mem, cs = s["memory"], s["compile_seconds"]
    final = "-" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    print(
        f"steps: {s['steps']}  final loss: {final}  "
        f"throughput: {s['samples_per_second']:,.0f} samples/s"
    )
    if mem is not None:  # None when a resumed run had no step left to take
        print(
            f"step memory: {mem['planned_bytes']:,} B planned intermediates "
            f"(naive {mem['naive_bytes']:,} B), {mem['pinned_bytes']:,} B pinned"
        )
    print(
        f"compile: {cs['trace']:.3f} s tracing, {cs['compile']:.3f} s graph -> Program, "
        f"{pipeline_s:.3f} s creating {compiled} pipelines ({hits} reused) for the training "
        "and evaluation programs"
    )
    if "reduce_ms_per_step" in s:
        print(
            f"distributed: {s['world_size']} ranks, "
            f"{s['samples_per_second'] / s['world_size']:,.0f} samples/s per rank, "
            f"{s['reduce_ms_per_step']:.3f} ms per step of reading back and all-reducing "
            f"{s['reduce_bytes']:,} B of gradients not hidden by the backward pass"
        )
    print(f"checkpoint: {s['checkpoint']}")
    if "loss_plot" in s:
        print(f"loss curve: {s['loss_plot']}")
    print(f"test accuracy: {100 * s['test_accuracy']:.2f}%")
    return 0


def cmd_train_resnet(args) -> int:
    from .io.checkpoint import CheckpointError
    from .recipes.resnet import ResNetTrainConfig, format_train, train

    cfg = ResNetTrainConfig(
        arch=args.arch,
        width=args.width,
        image_size=args.image_size,
        distributed=args.distributed,
        **_train_settings(args),
    )
    dev, main = _distributed_device(args) if args.distributed else (_device(args), True)
    if main:
        print(f"device: {dev.name}")
    try:
        s = train(cfg, resume=args.resume, device=dev, progress=not args.no_progress)
    except (OSError, ValueError, ImportError, CheckpointError) as e:
        print(f"meganeura train resnet: {e}", file=sys.stderr)
        return 2
    if not main:  # rank 0 alone reports
        return 0
    print(format_train(s))
    return 0


def cmd_classify(args) -> int:
    from .io.checkpoint import CheckpointError
    from .recipes.resnet import classify, format_classify

    try:
        r = classify(
            args.images, args.checkpoint, args.top_k, args.labels, _device(args), args.precision
        )
    except (OSError, ValueError, ImportError, CheckpointError) as e:
        print(f"meganeura classify: {e}", file=sys.stderr)
        return 2
    print(format_classify(r))
    return 0


def cmd_predict(args) -> int:
    from .io.checkpoint import CheckpointError
    from .recipes.mnist import predict

    try:
        r = predict(
            args.checkpoint,
            data=args.data,
            count=args.count,
            device=_device(args),
            precision=args.precision,
        )
    except (OSError, ValueError, CheckpointError) as e:
        print(f"meganeura predict: {e}", file=sys.stderr)
        return 2
    print(f"predicted: {r['predictions']}")
    print(f"labels:    {r['labels']}")
    print(f"test accuracy: {100 * r['test_accuracy']:.2f}% over {r['n']} images")
    if args.json:
        print(json.dumps(r))
    return 0


def _seconds(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in parts.items())


def cmd_profile(args) -> int:
    import numpy as np

    from .compile import compile
    from .models.mlp import build_mlp
    from .optim import HYPER_INPUT, AdamW
    from .optim.guard import GUARD_RESET_INPUT
    from .random import manual_seed
    from .runtime import Session
    from .runtime.profiler import ProfilerError
    from .training import Trainer, device_limits

    dev = _device(args)
    print(f"device: {dev.name}")
    train = args.mode == "train"
    manual_seed(args.seed)
    t = time.perf_counter()
    net = build_mlp(args.batch_size, (784, args.hidden, 10), labels=train)
    graph_s = time.perf_counter() - t
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch_size, 784), dtype=np.float32)
    if train:
        trainer = Trainer(net.graph, AdamW(lr=1e-3, weight_decay=0.01), device=dev)
        program, session = trainer.program, trainer.session
        program.meta["compile_seconds"] = {"graph": graph_s, **program.meta["compile_seconds"]}
        trainer.load_parameters(net.state_dict())
        y = rng.integers(0, 10, args.batch_size, dtype=np.int32)
        hyper = trainer.optimizer.hyper(trainer.step_count, trainer.lr())
        feeds = {"x": x, "y": y, HYPER_INPUT: hyper, GUARD_RESET_INPUT: np.float32(1)}
    else:
        program = compile(net.graph, limits=device_limits(dev), graph_seconds=graph_s)
        session = Session(program, dev)
        session.load_state_dict(net.state_dict())
        feeds = {"x": x}
    cs, ss = program.meta["compile_seconds"], session.setup_seconds
    print(f"compile: {sum(cs.values()):.3f} s graph -> Program ({_seconds(cs)})")
    print(
        f"session: {sum(ss.values()):.3f} s setup ({_seconds(ss)}); pipelines "
        f"{session.pipelines_compiled} compiled, {session.pipelines_reused} reused"
    )
    try:
        prof = session.profile(feeds, args.repeats, args.warmup, args.timestamps)
    except ProfilerError as e:
        print(f"meganeura profile: {e}", file=sys.stderr)
        return 2
    print(prof.table(by=args.by))
    trace = args.trace or f"runs/profile/mnist-{args.mode}.json"
    print(f"trace: {prof.write_trace(trace)} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_serve_web(args) -> int:
    from .web.server import serve_web

    try:
        serve_web(args.bundle, args.host, args.port, demo_lm=args.demo_lm)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meganeura",
        description="Train and run neural networks on any GPU through WebGPU (wgpu-py).",
    )
    p.add_argument("--adapter", help="substring of the adapter to use (env MEGANEURA_ADAPTER)")
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="print the adapter, backend, features and limits")

    t = sub.add_parser(
        "train",
        help="train the MNIST MLP (mnist) or a ResNet on an image folder (resnet) with AdamW, "
        "evaluate, write a checkpoint and curves, and print throughput",
    )
    t.add_argument("job", choices=["mnist", "resnet"], help="the job to run")
    t.add_argument(
        "--data",
        help="mnist: folder of MNIST IDX files; resnet: an ImageFolder (one subfolder of "
        "images per class); default: the embedded 5k MNIST subset",
    )
    t.add_argument("--epochs", type=int, default=10, help="passes over the data (default 10)")
    t.add_argument("--batch-size", type=int, default=64, help="images per step (default 64)")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    t.add_argument(
        "--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)"
    )
    t.add_argument(
        "--schedule",
        choices=["constant", "warmup", "cosine"],
        default="constant",
        help="learning-rate schedule (default constant)",
    )
    t.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warmup (default 0)")
    t.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip the global gradient L2 norm to this (default: no clipping)",
    )
    t.add_argument("--hidden", type=int, default=128, help="mnist: hidden width (default 128)")
    t.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    t.add_argument(
        "--log-every", type=int, default=10, help="read the loss back every N steps (default 10)"
    )
    t.add_argument(
        "--arch",
        default="resnet18",
        help="resnet: resnet18, resnet34, resnet50 or resnet101 (default resnet18)",
    )
    t.add_argument(
        "--width", type=int, default=64, help="resnet: first stage's channels (default 64)"
    )
    t.add_argument(
        "--image-size", type=int, default=32, help="resnet: image side in pixels (default 32)"
    )
    t.add_argument("--out", help="folder for checkpoint and curves (default runs/JOB)")
    t.add_argument("--resume", help="checkpoint to continue from")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel over the ranks of mpiexec -n N (pip install "
        "'meganeura[distributed]'); --batch-size is the global batch; rank 0 logs and writes",
    )
    _precision_flag(t)

    r = sub.add_parser("predict", help="classify MNIST test images with a checkpoint")
    r.add_argument("--checkpoint", required=True, help="from train mnist")
    r.add_argument("--data", help="folder of MNIST IDX files (default: as in training)")
    r.add_argument("--count", type=int, default=10, help="predictions to print (default 10)")
    r.add_argument("--json", action="store_true", help="also print the result as JSON")
    _precision_flag(r)

    c = sub.add_parser("classify", help="print the top classes of images with a ResNet checkpoint")
    c.add_argument("images", nargs="+", help="image files (Pillow reads them)")
    c.add_argument(
        "--checkpoint",
        required=True,
        help="from train resnet, or a torchvision ResNet state dict in safetensors",
    )
    c.add_argument("--top-k", type=int, default=5, help="classes printed per image (default 5)")
    c.add_argument("--labels", help="text file of class names, one per line")
    _precision_flag(c)

    f = sub.add_parser(
        "profile",
        help="time every GPU dispatch of one step with timestamp queries; print a per-kernel "
        "table and write a Chrome/Perfetto trace",
    )
    f.add_argument("job", choices=["mnist"], help="the model to profile (the MNIST MLP)")
    f.add_argument("--batch-size", type=int, default=64, help="rows per step (default 64)")
    f.add_argument("--hidden", type=int, default=128, help="hidden width (default 128)")
    mode = f.add_mutually_exclusive_group()
    mode.add_argument(
        "--train",
        dest="mode",
        action="store_const",
        const="train",
        help="a training step: forward, backward and AdamW update (default)",
    )
    mode.add_argument(
        "--forward",
        dest="mode",
        action="store_const",
        const="forward",
        help="an inference step: logits only",
    )
    f.set_defaults(mode="train")
    f.add_argument("--repeats", type=int, default=10, help="profiled steps, averaged")
    f.add_argument("--warmup", type=int, default=2, help="unprofiled steps first")
    f.add_argument(
        "--by",
        choices=["dispatch", "op"],
        default="dispatch",
        help="table rows: one per dispatch, or one per op kind (all matmuls together)",
    )
    f.add_argument(
        "--timestamps",
        choices=["auto", "inside", "passes"],
        default="auto",
        help="inside: timestamps between dispatches of the step's one pass; passes: one pass per "
        "dispatch with begin/end timestamps; auto: inside when the adapter allows it",
    )
    f.add_argument("--trace", help="trace file to write (default runs/profile/mnist-MODE.json)")
    f.add_argument("--seed", type=int, default=0, help="seed of the random batch and weights")

    w = sub.add_parser(
        "serve-web",
        help="serve a bundle (meganeura export) with meganeura.js and its demo page on "
        "127.0.0.1 for a browser's WebGPU (docs/web.md); prints the URL",
    )
    w.add_argument("bundle", nargs="?", help="bundle folder (e.g. runs/mnist/bundle)")
    w.add_argument(
        "--demo-lm",
        action="store_true",
        help="instead of BUNDLE: export and serve the byte-level transformer demo",
    )
    w.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    w.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    w.set_defaults(handler=cmd_serve_web)

    from .recipes import embed, export, llm, transcribe, tune

    llm.add_commands(sub)
    embed.add_commands(sub)
    transcribe.add_commands(sub)
    export.add_commands(sub)
    tune.add_commands(sub)
    return p


def _tuning_cache_from_env() -> None:
    from pathlib import Path

    from .tune import set_cache_dir

    root = os.environ.get("MEGANEURA_CACHE_DIR")
    if root:
        set_cache_dir(Path(root).expanduser() / "tuning")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _tuning_cache_from_env()
    handlers = {"info": cmd_info, "train": cmd_train, "predict": cmd_predict}
    handlers["classify"] = cmd_classify
    handler = getattr(args, "handler", None) or {**handlers, "profile": cmd_profile}[args.command]
    try:
        return handler(args)
    except SystemExit as e:  # a command's user error: one line, exit status 2 (as argparse's)
        if not isinstance(e.code, str):
            raise
        print(f"meganeura {args.command}: {e.code}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
