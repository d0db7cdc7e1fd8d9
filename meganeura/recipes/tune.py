"""``meganeura tune``: time matmul plans on this device and keep the fastest (docs/tuning.md).

``meganeura tune MODEL`` tunes the products of a built-in model's training step and forward
(``tune.models.MODELS``), ``--workloads`` those of the paper's five workloads at their
benchmark sizes (``tune.models.WORKLOADS``, deduplicated, one budget), ``--shapes
M,K,N,layout[,batch] ...`` given products; ``--dry-run`` lists the products, their default plan
and candidate count and the estimated time, timing nothing; ``--list`` prints this device's
cache, ``--clear`` removes it. The cache folder is ``$MEGANEURA_CACHE_DIR/tuning`` (set by
``cli.main``), else ``~/.cache/meganeura/tuning``. Each product's line is printed (and the
cache file rewritten) as soon as it is tuned, so a run cut short keeps what it printed.
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap

from ..tune.models import MODELS, SIZES, WORKLOADS

# CLI option -> model_programs' size
_SIZE_OPTIONS = {"batch_size": "batch", "seq_len": "seq", "hidden": "hidden", "layers": "layers"}


def add_commands(sub) -> None:
    """Register ``tune`` on the CLI's subparsers."""
    t = sub.add_parser(
        "tune",
        help="time the candidate matmul plans of a model's (or given) products on this device "
        "and record the fastest in the device's tuning cache, which later runs read",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("model", nargs="?", choices=sorted(MODELS), help="built-in model to tune")
    t.add_argument(
        "--workloads",
        nargs="?",
        const=",".join(WORKLOADS),
        metavar="NAMES",
        help="tune the products of the paper's workloads (default all: "
        f"{','.join(WORKLOADS)}), each at its benchmark size, the shapes shared by several "
        "tuned once, under one --budget-s",
    )
    t.add_argument(
        "--shapes",
        nargs="+",
        metavar="M,K,N,LAYOUT[,BATCH]",
        help="products to tune: A [M, K] @ B [K, N], layout nn, nt (B stored [N, K]), tn (A "
        "stored [K, M]) or tt; batch default 1",
    )
    t.add_argument("--list", action="store_true", help="print this device's cache (matmul "
                   "and attention plans) and exit")  # fmt: skip
    t.add_argument("--clear", action="store_true", help="remove this device's cache (matmul "
                   "and attention plans) and exit")  # fmt: skip
    t.add_argument("--batch-size", type=int, default=None, help="rows, sequences or images "
                   "per step (default the model's: mnist 64, smollm2 1, smolvla 1, resnet50 4, "
                   "whisper 1, unet 2)")  # fmt: skip
    t.add_argument("--seq-len", type=int, default=None, help="smollm2: tokens (default 128); "
                   "smolvla: action tokens, the chunk (default 50)")  # fmt: skip
    t.add_argument("--hidden", type=int, default=None, help="mnist: hidden width (default 128)")
    t.add_argument("--layers", type=int, default=None, help="smollm2: decoder layers (default "
                   "1, all alike); smolvla: expert layers (default 16); whisper: encoder "
                   "layers (default 4)")  # fmt: skip
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="modes", action="store_const", const=("train",),
                      help="the training step's products only")  # fmt: skip
    mode.add_argument("--forward", dest="modes", action="store_const", const=("forward",),
                      help="the forward's products only")  # fmt: skip
    t.set_defaults(modes=("train", "forward"))
    t.add_argument("--repeats", type=int, default=5, help="timed steps per plan (default 5)")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    t.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget in seconds, shared by the products (each product's default "
        "plan is timed whatever the budget)",
    )
    t.add_argument("--plans", nargs="+", help="only these candidate plans (and the default)")
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="list the products, their default plan and number of candidates, and the "
        "estimated time on an H200; time nothing, write nothing",
    )
    t.add_argument("--no-save", action="store_true", help="time and print, write nothing")
    t.add_argument("--verbose", action="store_true", help="print every plan's time")
    t.set_defaults(handler=cmd_tune)


def _description() -> str:
    """``tune --help``'s text: what it does, then one paragraph per model."""
    wrap = textwrap.TextWrapper(width=88, subsequent_indent="    ", break_on_hyphens=False)
    head = (
        "Time the candidate matmul plans on this device; record each product's fastest plan "
        "(>= 3% over the default, its result checked) in the device's tuning cache "
        "($MEGANEURA_CACHE_DIR/tuning, default ~/.cache/meganeura/tuning), which every later "
        "compile on this device reads. A model is compiled (never run) for a training step "
        "and a forward; its sizes default to those of the bench/workloads.py cells. On a GPU "
        "the timings start after 3 s of back-to-back matmuls that keep it at working clocks, "
        "and before each plan more run until one runs as fast as after those 3 s."
    )
    lines = [textwrap.fill(head, 88), "", "models:"]
    lines += [wrap.fill(f"  {k}: {v}") for k, v in MODELS.items()]
    lines += ["", wrap.fill(f"--workloads: {', '.join(WORKLOADS)} (W1-W5) at those sizes.")]
    return "\n".join(lines)


def cmd_tune(args) -> int:
    from ..cli import _device
    from ..codegen.wgsl.matmul.plan import parse_plan
    from ..tune import cache as tc

    if args.list or args.clear:
        if args.model or args.shapes or args.workloads:
            raise SystemExit("--list and --clear take no MODEL, --workloads or --shapes")
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
    if sum(map(bool, (args.model, args.shapes, args.workloads))) != 1:
        raise SystemExit("give one of MODEL, --workloads or --shapes (or --list, --clear)")
    given = [k for k in _SIZE_OPTIONS if getattr(args, k) is not None]
    sizes = {_SIZE_OPTIONS[k]: getattr(args, k) for k in given}
    flags = ", ".join("--" + k.replace("_", "-") for k in given)
    names = [args.model] if args.model else []
    if args.workloads:
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown or not names:
            raise SystemExit(f"--workloads takes names of {', '.join(WORKLOADS)}, got {unknown}")
        if sizes:
            raise SystemExit(
                f"--workloads tunes each model at its benchmark size; give {flags} with one MODEL"
            )
    elif args.model:
        takes = [k for k, v in _SIZE_OPTIONS.items() if v in SIZES[args.model]]
        extra = [k for k in given if k not in takes]
        if extra:
            raise SystemExit(
                f"{args.model} takes no {', '.join('--' + k.replace('_', '-') for k in extra)} "
                f"(its sizes: {', '.join('--' + k.replace('_', '-') for k in takes)})"
            )
    try:
        shapes = [tc.parse_shape(s) for s in args.shapes or ()]
        for name in args.plans or ():
            parse_plan(name)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    dev = _device(args)
    print(f"device: {dev.name}", flush=True)
    from ..training import device_limits
    from ..tune import matmul as tm

    limits = device_limits(dev)
    if names:
        shapes = model_shapes(names, limits, sizes, args.modes, args.plans, args.dry_run)
    elif args.dry_run:
        for key in shapes:
            print(plan_line(key, limits, args.plans))
    if args.dry_run:
        print(dry_run_total(shapes, limits, args.plans))
        return 0
    if not shapes:
        print("no matmul products to tune")
        return 0
    print(f"tuning {len(shapes)} products", flush=True)
    try:
        report = tm.tune_matmuls(
            shapes, dev, repeats=args.repeats, warmup=args.warmup, budget_s=args.budget_s,
            plans=args.plans, save=not args.no_save, progress=_flushed if args.verbose else None,
            shape_done=functools.partial(_shape_line, saved=not args.no_save),
        )  # fmt: skip
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None
    print(report.table())
    for r in report.results:
        if r.default_us is None:
            print(f"{tc.format_shape(r.key)}: default {r.default_plan} failed: "
                  f"{r.rejected.get(r.default_plan)}", file=sys.stderr)  # fmt: skip
    return 0


def model_shapes(names, limits, sizes: dict, modes, plans=None, dry_run: bool = False) -> list:
    """The distinct products of the built-in models ``names`` (their ``modes`` programs), in
    order. Prints a line per model: its sizes, product count, how many are new, and its
    convolutions (conv2d gemm kernels, which the matmul tuner does not tune); with
    ``dry_run`` also each product's default plan and number of plans to time."""
    from ..tune import shapes_of
    from ..tune.models import conv_dispatches, model_programs

    out: list = []
    for name in names:
        try:
            programs = model_programs(name, limits, modes=modes, **sizes)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        own = shapes_of(programs.values())
        new = [k for k in own if k not in out]
        out += new
        convs = sum(conv_dispatches(p) for p in programs.values())
        size = ", ".join(f"{k} {sizes.get(k, v)}" for k, v in SIZES[name].items())
        line = f"{name} ({size}; {', '.join(programs)}): {len(own)} distinct products"
        if len(names) > 1:
            line += f", {len(new)} not seen before"
        if convs:
            line += f"; {convs} conv2d dispatches (not matmuls: not tuned)"
        print(line, flush=True)
        if dry_run:
            for key in own:
                print(plan_line(key, limits, plans) + ("" if key in new else "  (seen above)"))
    return out


def plan_line(key, limits, plans=None) -> str:
    """``--dry-run``'s line of a product: shape, default plan, number of plans to time."""
    from ..tune import matmul as tm

    todo = tm.plans_to_time(key, limits, plans)
    return f"  {_fmt(key):<24} default {todo[0]:<14} {len(todo):>3} plans"


def dry_run_total(shapes, limits, plans=None) -> str:
    """``--dry-run``'s last line: products, plans to time, the estimated time on an H200."""
    from ..tune import matmul as tm

    total = sum(len(tm.plans_to_time(key, limits, plans)) for key in shapes)
    est = tm.estimate_seconds(total, len(shapes))
    return (
        f"{len(shapes)} distinct products, {total} plans to time on this adapter: "
        f"about {est:.0f} s ({est / 60:.1f} min) at the H200's ~{tm.PLAN_SECONDS} s a plan "
        "(confirmations included); nothing timed, nothing written"
    )


def _fmt(key) -> str:
    from ..tune.cache import format_shape

    return format_shape(key)


def _flushed(line: str) -> None:
    print(line, flush=True)


def _shape_line(i: int, count: int, r, seconds: float, saved: bool = True) -> None:
    """One line per tuned product, printed as soon as it is in the cache file (``saved``)."""
    d = "-" if r.default_us is None else f"{r.default_us:.1f}"
    b = "-" if r.best_us is None else f"{r.best_us:.1f}"
    g = "" if r.gain is None else f" {r.gain:.2f}x"
    if r.default_us is None:
        state = "default failed"
    elif r.recorded:
        state = "recorded" if saved else "to record (--no-save)"
    else:
        state = "not confirmed" if r.best_plan in r.rejected else "default kept"
    print(
        f"[{i + 1}/{count}] {_fmt(r.key):<24} {r.default_plan} {d} us -> {r.best_plan or '-'} "
        f"{b} us{g} {state} ({len(r.times)} plans, {seconds:.1f} s)",
        flush=True,
    )


def format_cache(cache, path: str) -> str:
    """The ``--list`` tables of a device's cache: its matmul products, then its attention lane
    kernels (``bench/attention_plans.py --record``) when it has any."""
    from ..tune.attention_entries import format_attention_key
    from ..tune.cache import format_shape

    k = cache.key
    lines = [f"device: {k.adapter} | {k.driver} | {k.backend}", f"cache: {path}"]
    if not cache.matmul:
        lines.append("(no tuned matmul products)")
    else:
        lines += _table("shape (M,K,N,layout,batch)", 28, cache.matmul, format_shape)
    if cache.attention:
        lines += _table("attention (mode,b,hkv,group,lq,lk,d,dv)", 40, cache.attention,
                        format_attention_key)  # fmt: skip
    return "\n".join(lines)


def _table(title: str, width: int, entries: dict, fmt) -> list[str]:
    lines = [
        f"{title:<{width}} {'plan':<16} {'us':>10} {'default':<16} "
        f"{'us':>10} {'gain':>6} {'timing':<10} measured"
    ]
    for key, e in sorted(entries.items()):
        lines.append(
            f"{fmt(key):<{width}} {e.plan:<16} {e.gpu_us:>10.1f} {e.default_plan:<16} "
            f"{e.heuristic_us:>10.1f} {e.gain:>5.2f}x {e.timing:<10} {e.measured}"
        )
    return lines
