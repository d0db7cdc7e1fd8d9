"""Where a small step's wall time goes: the host phases of ``Session.run`` for the MNIST MLP
forward (batch 64) and training step, next to the GPU time of its dispatches.

Phases (median ms over ``--repeats`` calls, the device idle before each call):
  check    feed validation (``slots.checked``, label ranges)
  upload   writing the feeds (``fastpath.write``)
  record   encoding the dispatches (and the output copies)
  finish   ``GPUCommandEncoder.finish``
  submit   ``queue.submit``
  wait     until the GPU is done (``Session.synchronize``)
  read     mapping the staging buffer and copying the outputs out
plus ``run_ms`` (one ``Session.run`` with the same fetch, timed whole) and ``gpu_ms`` (sum of
the dispatches' timestamps from ``Session.profile``). Session internals; a diagnostic, not a
comparison with PyTorch, so it writes no result file unless ``--out`` is given.

Usage: python bench/host_breakdown.py [--repeats 50] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meganeura import manual_seed  # noqa: E402
from meganeura.models.mlp import build_mlp  # noqa: E402
from meganeura.optim import HYPER_INPUT, AdamW  # noqa: E402
from meganeura.optim.guard import GUARD_RESET_INPUT  # noqa: E402
from meganeura.runtime import fastpath, get_device  # noqa: E402
from meganeura.runtime.slots import check_labels, checked  # noqa: E402
from meganeura.training import Trainer, compile_for  # noqa: E402

PHASES = ("check", "upload", "record", "finish", "submit", "wait", "read")


def phases(sess, feeds: dict, fetch: tuple[str, ...], repeats: int) -> dict:
    rows: dict[str, list[float]] = {k: [] for k in (*PHASES, "run")}
    for i in range(repeats + 3):
        sess.synchronize()
        t0 = time.perf_counter()
        ready = [(sess._bound[n], checked(sess._bound[n], v)) for n, v in feeds.items()]
        check_labels(sess.program, feeds)
        t1 = time.perf_counter()
        for b, data in ready:
            sess._upload(b, data)
        t2 = time.perf_counter()
        enc = sess._gpu.create_command_encoder()
        cp = enc.begin_compute_pass()
        sess._plan.record(cp)
        cp.end()
        for name in fetch:
            b = sess._bound[name]
            chunk, off = sess._stage_at[name]
            enc.copy_buffer_to_buffer(b.buffer, b.start, sess._staging[chunk], off, b.length)
        t3 = time.perf_counter()
        cb = enc.finish()
        t4 = time.perf_counter()
        sess._queue.submit([cb])
        t5 = time.perf_counter()
        sess.synchronize()
        t6 = time.perf_counter()
        sess._read_staged(fetch)
        t7 = time.perf_counter()
        sess.synchronize()
        t8 = time.perf_counter()
        sess.run(feeds, fetch=fetch)
        t9 = time.perf_counter()
        if i >= 3:
            ts = (t0, t1, t2, t3, t4, t5, t6, t7)
            for k, a, b in zip(PHASES, ts, ts[1:], strict=False):
                rows[k].append(1e3 * (b - a))
            rows["run"].append(1e3 * (t9 - t8))
    out = {f"{k}_ms": float(np.median(v)) for k, v in rows.items()}
    prof = sess.profile(feeds, repeats=max(3, repeats // 5))
    out["gpu_ms"] = prof.step_ns() / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = get_device()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 784)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    manual_seed(0)
    params = build_mlp(64).state_dict()
    infer = build_mlp(64, labels=False)
    _, fwd = compile_for(infer.graph, device=device)
    fwd.load_state_dict(params)
    trainer = Trainer(build_mlp(64).graph, AdamW(lr=1e-3, weight_decay=0.01), device=device)
    trainer.load_parameters(params)
    hyper = trainer.optimizer.hyper(0, trainer.lr())
    train_feeds = {"x": x, "y": y, HYPER_INPUT: hyper, GUARD_RESET_INPUT: np.float32(1)}
    out_name = next(iter(fwd.program.outputs))
    loss_name = next(iter(trainer.program.outputs))
    report = {"native_calls": fastpath.AVAILABLE, "device": device.name}
    for case, sess, feeds, fetch in (
        ("forward_b64_fetch", fwd, {"x": x}, (out_name,)),
        ("forward_b64", fwd, {"x": x}, ()),
        ("train_step_b64", trainer.session, train_feeds, ()),
        (
            "train_step_b64_fetch_loss",
            trainer.session,
            train_feeds,
            (loss_name,),
        ),
    ):
        r = phases(sess, feeds, fetch, args.repeats)
        report[case] = r
        print(f"{case:<28}" + " ".join(f"{k[:-3]} {v:.3f}" for k, v in r.items() if v is not None))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
