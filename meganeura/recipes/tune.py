"""``meganeura tune``: time matmul plans on this device and keep the fastest (docs/tuning.md).

``meganeura tune MODEL`` tunes the products of a built-in model's training step and forward
(``tune.models.MODELS``), ``--shapes M,K,N,layout[,batch] ...`` given products; ``--list``
prints this device's cache, ``--clear`` removes it. The cache folder is
``$MEGANEURA_CACHE_DIR/tuning`` (set by ``cli.main``), else ``~/.cache/meganeura/tuning``.
"""

from __future__ import annotations

import argparse
import sys

from ..tune.models import MODELS


def add_commands(sub) -> None:
    """Register ``tune`` on the CLI's subparsers."""
    t = sub.add_parser(
        "tune",
        help="time the candidate matmul plans of a model's (or given) products on this device "
        "and record the fastest in the device's tuning cache, which later runs read",
        description="Time the candidate matmul plans on this device; record each product's "
        "fastest plan (>= 3%% over the default, its result checked) in the device's tuning "
        "cache ($MEGANEURA_CACHE_DIR/tuning, default ~/.cache/meganeura/tuning), which every "
        "later compile on this device reads. Models: "
        + "; ".join(f"{k}: {v}" for k, v in MODELS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("model", nargs="?", choices=sorted(MODELS), help="built-in model to tune")
    t.add_argument(
        "--shapes",
        nargs="+",
        metavar="M,K,N,LAYOUT[,BATCH]",
        help="products to tune: A [M, K] @ B [K, N], layout nn, nt (B stored [N, K]), tn (A "
        "stored [K, M]) or tt; batch default 1",
    )
    t.add_argument("--list", action="store_true", help="print this device's cache and exit")
    t.add_argument("--clear", action="store_true", help="remove this device's cache and exit")
    t.add_argument("--batch-size", type=int, default=None, help="mnist: rows (default 64); "
                   "smollm2: sequences (default 1)")  # fmt: skip
    t.add_argument("--seq-len", type=int, default=128, help="smollm2: tokens (default 128)")
    t.add_argument("--hidden", type=int, default=128, help="mnist: hidden width (default 128)")
    t.add_argument("--layers", type=int, default=1, help="smollm2: decoder layers (default 1)")
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="modes", action="store_const", const=("train",),
                      help="the training step's products only")  # fmt: skip
    mode.add_argument("--forward", dest="modes", action="store_const", const=("forward",),
                      help="the forward's products only")  # fmt: skip
    t.set_defaults(modes=("train", "forward"))
    t.add_argument("--repeats", type=int, default=5, help="timed steps per plan (default 5)")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    t.add_argument(
        "--budget-s", type=float, default=None, help="wall-clock budget, shared by the shapes"
    )
    t.add_argument("--plans", nargs="+", help="only these candidate plans (and the default)")
    t.add_argument("--dry-run", action="store_true", help="time and print, write nothing")
    t.add_argument("--verbose", action="store_true", help="print every plan's time")
    t.set_defaults(handler=cmd_tune)


def cmd_tune(args) -> int:
    from ..cli import _device
    from ..tune import cache as tc

    if args.list or args.clear:
        if args.model or args.shapes:
            raise SystemExit("--list and --clear take no MODEL or --shapes")
        if tc.cache_dir() is None:
            raise SystemExit("the tuning cache is off")
        dev = _device(args)
        key = tc.device_key(dev)
        path = tc.cache_path(key)
        if args.clear:
            print(f"removed {path}" if tc.clear(key) else f"no cache for {dev.name} ({path})")
            return 0
        print(format_cache(tc.load(key), str(path)))
        return 0
    if bool(args.model) == bool(args.shapes):
        raise SystemExit("give a MODEL or --shapes (or --list, --clear)")
    try:
        shapes = [tc.parse_shape(s) for s in args.shapes or ()]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    dev = _device(args)
    print(f"device: {dev.name}")
    from ..training import device_limits
    from ..tune import shapes_of, tune_matmuls
    from ..tune.models import model_programs

    if args.model:
        batch = args.batch_size or (64 if args.model == "mnist" else 1)
        try:
            programs = model_programs(
                args.model, device_limits(dev), batch, args.seq_len, args.hidden, args.layers,
                args.modes,
            )  # fmt: skip
        except ValueError as e:
            raise SystemExit(str(e)) from None
        shapes = shapes_of(programs.values())
        print(f"{args.model} ({', '.join(programs)}): {len(shapes)} distinct products")
    try:
        report = tune_matmuls(
            shapes, dev, repeats=args.repeats, warmup=args.warmup, budget_s=args.budget_s,
            plans=args.plans, save=not args.dry_run, progress=print if args.verbose else None,
        )  # fmt: skip
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None
    print(report.table())
    for r in report.results:
        if r.default_us is None:
            print(f"{tc.format_shape(r.key)}: default {r.default_plan} failed: "
                  f"{r.rejected.get(r.default_plan)}", file=sys.stderr)  # fmt: skip
    return 0


def format_cache(cache, path: str) -> str:
    """The ``--list`` table of a device's cache."""
    k = cache.key
    lines = [f"device: {k.adapter} | {k.driver} | {k.backend}", f"cache: {path}"]
    if not cache.matmul:
        lines.append("(no tuned products)")
        return "\n".join(lines)
    lines.append(
        f"{'shape (M,K,N,layout,batch)':<28} {'plan':<16} {'us':>10} {'default':<16} "
        f"{'us':>10} {'gain':>6} {'timing':<10} measured"
    )
    from ..tune.cache import format_shape

    for key, e in sorted(cache.matmul.items()):
        lines.append(
            f"{format_shape(key):<28} {e.plan:<16} {e.gpu_us:>10.1f} {e.default_plan:<16} "
            f"{e.heuristic_us:>10.1f} {e.gain:>5.2f}x {e.timing:<10} {e.measured}"
        )
    return "\n".join(lines)
