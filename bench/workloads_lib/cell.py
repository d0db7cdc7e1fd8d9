"""One configuration in one process: a workload's case, a precision and a side (``ours`` or a
PyTorch mode). Writes a JSON document the parent (``runner.py``) turns into result rows.

Ours: the first call (trace + compile + Session setup + the first run, the driver's shader
compile included) is timed first, before any other program of the process compiles a kernel;
then calls for ``--warm-seconds`` (the GPU's clocks ramp up under sustained load: a child
starts after the previous one kept the GPU idle while compiling), ``warmup`` + ``repeats`` timed
calls with a sync around each; device bytes; the profile
when asked; then the gates against PyTorch eager in strict f32 on the same device (TF32 off),
computed after the timing so they cannot disturb it.

PyTorch: the first call (``torch.compile``'s compilation happens there), the timed calls, and
``torch.cuda.max_memory_allocated`` over them.

Both sides build their models on the CPU first (the gates' PyTorch reference too), then take
the GPU lock (``gpu_lock.gpu_phase``) and run the first call and the timed calls inside a
quiet section (``gpu_lock.quiet``), so overlapped children (``--jobs``) neither share the GPU
nor run while one is measured.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback

import numpy as np

from . import gates
from .base import to_torch
from .gpu_lock import gpu_phase, quiet
from .ours import (
    compile_call,
    compile_grads,
    device_bytes,
    profile_text,
    program_flops,
    timed_feeds,
)
from .registry import WORKLOADS


def stats(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "n": len(times)}


def heat(side: dict, sync, seconds: float) -> int:
    """Call ``side["run"]`` until ``seconds`` have passed (none when 0 or there is no ``run``);
    returns the number of calls."""
    fn = side.get("run")
    n = 0
    if fn is None or seconds <= 0:
        return n
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        n += 1
    sync()
    return n


def timed(fn, sync, warmup: int, repeats: int) -> list[float]:
    """ms of ``repeats`` calls after ``warmup``, synced before and after each."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _measure(side: dict, sync, args) -> dict:
    """{metric: stats} of ``args.warmup`` + ``args.repeats`` calls (a side's own ``measure``
    where it has one: decode's per-token figures)."""
    if "measure" in side:
        return {k: stats(v) for k, v in side["measure"](args.warmup, args.repeats).items()}
    return {"ms": stats(timed(side["run"], sync, args.warmup, args.repeats))}


def _optimizer(spec):
    import meganeura as mn

    kind, lr = spec
    return mn.optim.SGD(lr=lr) if kind == "sgd" else mn.optim.Adam(lr=lr)


# ------------------------------------------------------------------------------ ours
def _ours_side(wl, case, model, batch, precision, quick, loss_scale=1.0):
    """{"first", "run", "sync", "result", "sessions", "stages", "profile"} of our side."""
    import meganeura as mn

    st: dict = {}
    if case.kind == "fwd":

        def first():
            fn = wl.ours_forward_fn(model)
            runner, feeds, _, secs = compile_call(model, fn, batch, precision)
            st.update(runner=runner, feeds=feeds, secs=secs)
            st["out"] = runner.run(feeds, tuple(runner.program.outputs))
            st["timed"] = timed_feeds(runner, feeds)

        def result():
            r = st["runner"]
            out = r.run(st["feeds"], tuple(r.program.outputs))
            return next(iter(out.values()))

        return {
            "first": first,
            "run": lambda: st["runner"].run(st["timed"], ()),
            "sync": lambda: st["runner"].session.synchronize(),
            "result": result,
            "sessions": lambda: [st["runner"].session],
            "stages": lambda: st["secs"],
            "profile": lambda: (st["runner"].session, st["feeds"]),
        }
    if case.kind == "fwdbwd":

        def first():
            runner, feeds, grads, secs = compile_grads(
                model, wl.ours_loss, batch, precision, loss_scale
            )
            st.update(runner=runner, feeds=feeds, secs=secs, grads=grads)
            runner.run(feeds, ("loss",))

        return {
            "first": first,
            "run": lambda: st["runner"].run(st["feeds"], ("loss",)),
            "sync": lambda: None,  # the loss read waits for the step
            "sessions": lambda: [st["runner"].session],
            "stages": lambda: st["secs"],
            "profile": lambda: (st["runner"].session, st["feeds"]),
            "runner": lambda: st["runner"],
            "feeds": lambda: st["feeds"],
            "grads": lambda: st["grads"],
        }
    if case.kind in ("train", "train_steps"):
        n = case.params.get("steps", 1) if case.kind == "train_steps" else 1
        tr = mn.Trainer(
            model,
            _optimizer(case.optimizer),
            wl.ours_loss,
            precision=precision,
            loss_scale=loss_scale,
        )

        def run():
            for _ in range(n - 1):
                tr.step(*batch, return_loss=False)
            return tr.step(*batch)

        def runner():
            return next(iter(tr._cache.values())).entry.runner

        def stages():
            e = tr.cache_info().entries[0]
            return {
                "trace": e.trace_seconds,
                "compile": e.compile_seconds,
                "setup": e.setup_seconds,
            }

        def profile():
            r = runner()
            return r.session, {name: r.session.read(name) for name in r.program.inputs}

        return {
            "first": run,
            "run": run,
            "sync": lambda: None,  # the loss read waits for the step
            "sessions": lambda: [runner().session],
            "stages": stages,
            "profile": profile,
            "trainer": tr,
        }
    return wl.custom_ours(case, model, batch, precision, quick)


def _ours_gates(wl, case, model, state, batch, precision, side, dev, ref_model, loss_scale=1.0):
    """Gate figures of our side against PyTorch eager strict f32 on ``dev``; ``ref_model`` is
    PyTorch's model with ``state``, built on the CPU before the GPU phase."""
    import meganeura as mn

    th = gates.thresholds(wl.id, precision)
    ref_model = ref_model.to(dev)
    tb = to_torch(batch, dev)
    parts: dict = {}
    if case.kind == "fwd":
        from .torch_side import reference

        ref = reference(wl, case, ref_model, tb)
        parts["forward"] = gates.forward_gate(th, side["result"](), ref["output"])
    elif case.kind == "fwdbwd":  # the timed program itself, every gradient fetched
        from .torch_side import reference

        ref = reference(wl, case, ref_model, tb)
        model.load_state_dict(state)
        runner, feeds, gnames = side["runner"](), side["feeds"](), side["grads"]()
        out = runner.run(feeds, ("loss", *gnames))
        grads = {gnames[g]: out[g] for g in gnames}
        parts["forward"] = gates.forward_gate(th, loss=float(out["loss"]), ref_loss=ref["loss"])
        parts["backward"] = gates.backward_gate(th, grads, ref["grads"])
    elif case.kind in ("train", "train_steps"):
        # a fresh Trainer (zero moments, step 0) from the initial weights: one step returns
        # the loss and the gradients, and leaves the updated weights
        from .torch_side import reference

        ref = reference(wl, case, ref_model, tb)
        model.load_state_dict(state)
        with mn.Trainer(
            model,
            _optimizer(case.optimizer),
            wl.ours_loss,
            precision=precision,
            loss_scale=loss_scale,
        ) as tr:
            loss, grads = tr.step(*batch, return_grads=True)
            tr.check_nonfinite()
            after = model.state_dict()
            parts["forward"] = gates.forward_gate(th, loss=loss, ref_loss=ref["loss"])
            parts["backward"] = gates.backward_gate(th, grads, ref["grads"])
            adam = case.optimizer[0] == "adam"
            parts["step"] = gates.step_gate(th, after, ref["after"], ref["before"], adam)
            if case.kind == "train_steps":
                for _ in range(case.params["steps"] - 2):
                    tr.step(*batch, return_loss=False)
                final = tr.step(*batch)
                figs = gates.forward_gate(th, loss=final, ref_loss=ref["final_loss"])
                # after `steps` Adam steps the two runs drift apart by rounding: gated at
                # the gradient-norm tolerance (1% strict, 10% fast)
                figs["pass"] = bool(figs["loss_rel"] <= th["grad_norm_rel"])
                parts["steps"] = figs
    else:  # custom kinds: compare the result with the torch eager strict run of the same kind
        ref_side = wl.custom_torch(case, ref_model, tb, "eager", dev)
        ref_side["first"]()
        ours, ref = np.asarray(side["result"]()), np.asarray(ref_side["result"]())
        if case.kind == "decode":
            same = int(np.sum(np.cumprod(ours[: len(ref)] == ref[: len(ours)])))
            parts["forward"] = {
                "pass": same == len(ref),
                "tokens_matching": same,
                "tokens": len(ref),
            }
        else:
            parts["forward"] = gates.forward_gate(th, ours, ref)
    return parts, th


def run_ours(wl, case, precision, args) -> dict:
    from .torch_side import setup

    torch, dev = setup("strict")
    doc: dict = {}
    t = time.perf_counter()
    model, state = wl.ours_model(case, args.quick)
    doc["build_wall_s"] = time.perf_counter() - t
    batch = wl.batch(case, args.quick)
    ref_model = wl.torch_model(case, args.quick, state)  # the gates' reference, on the CPU
    scale = getattr(args, "loss_scale", 1.0) if precision == "fast" else 1.0
    if scale != 1.0:
        doc["loss_scale"] = scale
    doc["lock_wait_s"] = gpu_phase()
    # --compile-warm's priming child fills the caches and gives no figure: not quiet
    section = contextlib.nullcontext() if getattr(args, "prime", False) else quiet()
    with section:  # the measured section: no other child of the parent runs
        side = _ours_side(wl, case, model, batch, precision, args.quick, scale)
        t = time.perf_counter()
        side["first"]()
        if "sync" in side:
            side["sync"]()
        doc["first_call_s"] = time.perf_counter() - t
        if "stages" in side:
            doc["stages"] = side["stages"]()
        if args.compile_only:
            return doc
        sync = side.get("sync") or (lambda: None)  # custom sides (decode) sync themselves
        doc["heat_calls"] = heat(side, sync, args.warm_seconds)
        t = time.perf_counter()
        doc["metrics"] = _measure(side, sync, args)
        doc["timing_wall_s"] = time.perf_counter() - t
    sessions = side["sessions"]()
    doc["peak_bytes"] = device_bytes(sessions)
    doc["flops"] = program_flops(sessions) * (
        case.params.get("steps", 1) if case.kind == "train_steps" else 1
    )
    doc["precision_compiled"] = sorted({s.program.meta.get("precision", "?") for s in sessions})
    if args.profile and "profile" in side:
        try:
            session, feeds = side["profile"]()
            wall = next(iter(doc["metrics"].values()))["median"]  # ms, or ms per token
            doc["profile"] = profile_text(session, feeds, wall)
        except Exception as e:  # noqa: BLE001 - lavapipe may lack timestamp queries
            doc["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if "trainer" in side:
        side["trainer"].close()
    t = time.perf_counter()
    try:  # a gate that cannot be computed keeps the timings: gate "ERROR", no speedup
        parts, th = _ours_gates(
            wl, case, model, state, batch, precision, side, dev, ref_model, scale
        )
        doc["gate"] = gates.verdict(parts)
        doc["gate_figures"] = parts
        doc["thresholds"] = th
    except Exception as e:  # noqa: BLE001
        doc["gate"] = "ERROR"
        doc["gate_figures"] = {"error": f"{type(e).__name__}: {e}"}
        doc["gate_traceback"] = traceback.format_exc()[-4000:]
    doc["gate_wall_s"] = time.perf_counter() - t
    return doc


# ------------------------------------------------------------------------------ torch
def run_torch(wl, case, precision, mode, args) -> dict:
    from .torch_side import setup, steps

    torch, dev = setup(precision)
    if mode != "eager" and dev != "cuda" and not args.allow_cpu_compile:
        return {"skipped": f"{mode} needs CUDA (this is {dev})"}
    doc: dict = {}
    m = wl.torch_model(case, args.quick)
    batch = wl.batch(case, args.quick)
    doc["lock_wait_s"] = gpu_phase()

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def first():
        nonlocal m, batch, side
        m = m.to(dev)
        batch = to_torch(batch, dev)
        if case.kind in ("fwd", "train", "fwdbwd", "train_steps"):
            side = steps(wl, case, m, batch, mode, dev)
        else:
            side = wl.custom_torch(case, m, batch, mode, dev)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        side["first"]() if "first" in side else side["run"]()
        sync()
        doc["first_call_s"] = time.perf_counter() - t

    side: dict = {}
    if getattr(args, "prime", False):  # --compile-warm's priming child: caches, no figure
        first()
        return doc
    # --overlap-compile: the compilation overlaps the other children (not a compile figure)
    overlapped = getattr(args, "overlap_compile", False) and mode != "eager"
    overlapped = overlapped and not args.compile_only
    if overlapped:
        first()
        doc["first_call_overlapped"] = True
    with quiet():  # the measured section: no other child of the parent runs
        if not overlapped:
            first()
        if args.compile_only:
            return doc
        doc["heat_calls"] = heat(side, sync, args.warm_seconds)
        doc["metrics"] = _measure(side, sync, args)
    doc["peak_bytes"] = int(torch.cuda.max_memory_allocated()) if dev == "cuda" else None
    doc["device"] = dev
    doc["torch_model"] = f"{type(m).__module__}.{type(m).__name__}"
    return doc


def main(args) -> dict:
    """Run the cell ``args.cell`` = ``workload:case:precision:side``; returns its document."""
    wid, case_name, precision, side = args.cell.split(":")
    wl = WORKLOADS[wid]
    doc = {
        "cell": args.cell,
        "workload": wid,
        "case": case_name,
        "precision": precision,
        "side": side,
    }
    reason = wl.missing()
    if reason:
        return {**doc, "skipped": reason}
    case = wl.case(case_name, args.quick)
    t = time.perf_counter()
    try:
        if side == "ours":
            doc.update(run_ours(wl, case, precision, args))
        else:
            doc.update(run_torch(wl, case, precision, side, args))
    except Exception as e:  # noqa: BLE001 - the parent records the error and continues
        doc["error"] = f"{type(e).__name__}: {e}"
        doc["traceback"] = traceback.format_exc()[-4000:]
    doc["child_wall_s"] = time.perf_counter() - t
    return doc
