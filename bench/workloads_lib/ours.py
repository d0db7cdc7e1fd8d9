"""meganeura's side of a cell: programs compiled from a model, their feeds, device memory,
and the profile of a slow cell."""

from __future__ import annotations

import re
import time

import numpy as np

# Timed inference calls read inputs written once to the Session (``Session.write``: resident
# on the GPU, as PyTorch's batch stays on the device) instead of uploading them each call.
# ``set_resident_inputs(False)`` uploads every call (bench/lever_ab.py lever resident_inputs).
RESIDENT_INPUTS = [True]


def set_resident_inputs(on: bool) -> None:
    """Timed inference calls read resident inputs (on, the default) or upload them (off)."""
    RESIDENT_INPUTS[:] = [bool(on)]


def timed_feeds(runner, feeds: dict) -> dict:
    """The feeds each timed call of ``runner`` passes: ``{}`` after writing ``feeds`` to its
    Session once (``RESIDENT_INPUTS``), else ``feeds`` (uploaded every call)."""
    if not RESIDENT_INPUTS[0]:
        return feeds
    for name, value in feeds.items():
        runner.session.write(name, value)
    return {}


def compile_call(model, fn, args: tuple, precision: str, outputs_prefix: str = "output"):
    """Trace ``fn(*args)`` (reading ``model``), compile it in ``precision``, open its Session
    bound to the model's shared parameters.

    Returns:
        (ProgramRunner, feeds {input name: array}, output spec, seconds {trace, compile, setup}).
    """
    from meganeura.compile import CompileOptions
    from meganeura.nn.compiled import ProgramRunner, flatten_arguments, trace_call

    traced = trace_call(model, fn, args, {}, outputs_prefix)
    options = CompileOptions(precision=precision, shared_parameters=True)
    runner = ProgramRunner(traced, options)
    _, _, arrays = flatten_arguments(fn, args, {})
    inputs = runner.program.inputs
    feeds = {n: a for n, (_, a) in zip(traced.inputs, arrays, strict=True) if n in inputs}
    secs = {
        "trace": traced.seconds,
        "compile": runner.compile_seconds,
        "setup": runner.setup_seconds,
    }
    return runner, feeds, traced.output_spec, secs


def compile_grads(model, loss_fn, args: tuple, precision: str, loss_scale: float = 1.0):
    """Forward + backward alone: a program whose outputs are ``loss`` and ``<name>.grad`` for
    every trained parameter, no optimizer update (``CompileOptions(output_grads=True)``;
    ``loss_scale``: ``CompileOptions.loss_scale``, the outputs unscaled).

    Returns:
        (ProgramRunner, feeds, {gradient output: parameter name}, seconds).
    """
    from meganeura.compile import CompileOptions, grad_output
    from meganeura.nn.compiled import ProgramRunner, flatten_arguments, trace_call

    def fn(*batch):
        return {"loss": loss_fn(model, *batch)}

    from meganeura.nn.parameter import Parameter

    traced = trace_call(model, fn, args, {})
    trainable = tuple(  # as Trainer: frozen parameters (Whisper's positions) get no gradient
        n for n, o in traced.trace.objects.items() if isinstance(o, Parameter) and o.requires_grad
    )
    options = CompileOptions(
        loss="loss",
        output_grads=True,
        trainable=trainable,
        precision=precision,
        shared_parameters=True,
        loss_scale=loss_scale,
    )
    runner = ProgramRunner(traced, options)
    _, _, arrays = flatten_arguments(fn, args, {})
    inputs = runner.program.inputs
    feeds = {n: a for n, (_, a) in zip(traced.inputs, arrays, strict=True) if n in inputs}
    grads = {
        grad_output(n): n
        for n in runner.program.parameters
        if grad_output(n) in runner.program.outputs
    }
    secs = {
        "trace": traced.seconds,
        "compile": runner.compile_seconds,
        "setup": runner.setup_seconds,
    }
    return runner, feeds, grads, secs


def device_bytes(sessions) -> int:
    """Bytes of GPU memory the given Sessions bind: each one's own buffers and staging, plus
    each distinct shared buffer (parameters, optimizer state: ``runtime.shared``) once, whole.

    Reads private fields of ``Session`` (a benchmark's view of the allocation, not an API).
    """
    total, shared = 0, {}
    for s in sessions:
        if s is None:
            continue
        own = set(s._own)
        total += sum(max(s.program.buffers[i].size, 4) for i in own)
        total += sum(b.size for b in s._staging)
        for i, buf in enumerate(s._buffers):
            if i not in own:
                shared[id(buf)] = buf.size
    return int(total + sum(shared.values()))


def program_flops(sessions) -> int:
    """FLOPs of one step of each Session's program, as its kernels report them (``Dispatch.flops``;
    kernels that report 0 are not counted)."""
    return int(sum(d.flops for s in sessions for d in s.program.dispatches))


def profile_text(session, feeds: dict, wall_ms: float, top: int = 15, repeats: int = 5) -> dict:
    """Per-kernel GPU profile of one step: top kernels by GPU time with achieved TB/s and
    TFLOP/s, and the host share ``(Session.run wall - GPU sum) / wall``.

    Returns:
        {"text": str, "gpu_ms", "span_ms", "wall_ms", "host_share", "dispatches", "top": [...]}.
    """
    prof = session.profile(feeds, repeats=repeats, warmup=1)
    gpu_ms = prof.step_ns() / 1e6
    host_share = (wall_ms - gpu_ms) / wall_ms if wall_ms > 0 else float("nan")
    rows = []
    for k in prof.stats("dispatch")[:top]:
        rows.append(
            {
                "kernel": k.name,
                "us": k.total_ns / prof.repeats / 1e3,
                "share": k.share,
                "TB_per_s": k.gb_per_s / 1e3,
                "TFLOP_per_s": k.gflop_per_s / 1e3,
            }
        )
    lines = [
        f"{len(session.program.dispatches)} dispatches; Session.run wall {wall_ms:.3f} ms, GPU sum "
        f"{gpu_ms:.3f} ms, span {prof.span_ns() / 1e6:.3f} ms, host share {100 * host_share:.1f}%",
        prof.table(by="op"),
        f"top {top} dispatches:",
        *(
            f"  {r['kernel'][:80]:80s} {r['us']:9.1f} us {100 * r['share']:5.1f}% "
            f"{r['TB_per_s']:6.3f} TB/s {r['TFLOP_per_s']:7.3f} TFLOP/s"
            for r in rows
        ),
    ]
    products = matmul_products(prof, session.program)
    if products:
        lines += [
            "matmul products (M x K x N, layout, batch; plan and its source; split-K sums apart):",
            *(
                f"  {r['product']:28s} {r['plan']:22s} {r['count']:4d} x {r['mean_us']:7.1f} us"
                f" = {r['us']:8.1f} us {100 * r['share']:5.1f}% {r['TFLOP_per_s']:7.3f} TFLOP/s"
                for r in products[:top]
            ),
        ]
    return {
        "text": "\n".join(lines),
        "gpu_ms": gpu_ms,
        "span_ms": prof.span_ns() / 1e6,
        "wall_ms": wall_ms,
        "host_share": host_share,
        "dispatches": len(session.program.dispatches),
        "top": rows,
        "matmul_products": products,
    }


_IDS = re.compile(r"^%([0-9+]+) ")


def matmul_products(prof, program) -> list[dict]:
    """GPU time per matmul product of one profiled step, longest first: the dispatches whose
    name's node ids (``"%823+829 matmul"``; every member's in a packed dispatch,
    ``"%823 matmul & %830 sum"``) include a matmul of ``program.meta["matmuls"]``,
    grouped by (M, K, N, layout, batch) and plan (a horizontal group: its products joined by
    ``" | "``); a split product's ``sum_splits`` dispatches are a row of their own.

    Returns:
        [{"product", "plan", "count" (dispatches per step), "mean_us", "us" (per step),
        "share" (of the step's summed GPU time), "TFLOP_per_s"}].
    """
    from meganeura.schedule.pack import SEPARATOR

    meta = {e["node"]: e for e in program.meta.get("matmuls", ())}
    total = sum(t.duration_ns for t in prof.timings) or 1.0
    groups: dict[tuple[str, str], list] = {}
    for t in prof.timings:
        ids = [i for part in t.name.split(SEPARATOR) for m in [_IDS.match(part)] if m
               for i in m.group(1).split("+")]  # fmt: skip
        found = [meta[int(i)] for i in ids if int(i) in meta]
        if not found:
            continue
        product = " | ".join(
            f"{e['m']}x{e['k']}x{e['n']} {e['layout']} b{e['batch']}" for e in found
        )
        plan = " | ".join(f"{e['plan']} ({e['source']})" for e in found)
        if all("sum_splits" in part for part in t.name.split(SEPARATOR)):
            plan = "sum_splits"
        groups.setdefault((product, plan), []).append(t)
    rows = []
    for (product, plan), ts in groups.items():
        ns = sum(t.duration_ns for t in ts)
        rows.append(
            {
                "product": product,
                "plan": plan,
                "count": len(ts) // prof.repeats,
                "mean_us": ns / len(ts) / 1e3,
                "us": ns / prof.repeats / 1e3,
                "share": ns / total,
                "TFLOP_per_s": sum(t.flops for t in ts) / ns / 1e3 if ns > 0 else 0.0,
            }
        )
    return sorted(rows, key=lambda r: -r["us"])


def first_call(fn) -> float:
    """Seconds of one call of ``fn``."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def as_numpy(x) -> np.ndarray:
    return np.asarray(x)
