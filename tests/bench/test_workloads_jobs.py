"""``bench/workloads.py --jobs N``: overlapped children whose GPU phases take turns.

The lock is checked with real processes (their locked intervals must not overlap); the
scheduler with a stand-in for a side's child (every cell yielded once with every side, at most
N sides alive at once, no cell started after the deadline).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import threading
import time

from bench.workloads_lib import gpu_lock, runner

_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from bench.workloads_lib.gpu_lock import gpu_phase
    time.sleep(0.05 * {i})
    gpu_phase()
    t0 = time.time()
    time.sleep(0.3)
    print(t0, time.time())
    """
)


def test_gpu_phases_of_concurrent_children_never_overlap(tmp_path):
    env = dict(os.environ, **{gpu_lock.ENV: str(tmp_path / "gpu.lock")})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(root=str(runner.ROOT), i=i)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    spans = sorted(tuple(map(float, p.communicate(timeout=60)[0].split())) for p in procs)
    assert len(spans) == 3
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end - 1e-3, spans  # each waits for the previous holder to exit


def test_gpu_phase_is_a_no_op_without_the_variable(monkeypatch):
    monkeypatch.delenv(gpu_lock.ENV, raising=False)
    assert gpu_lock.gpu_phase() == 0.0 and not gpu_lock._held


class _Wl:
    def __init__(self, wid):
        self.id = wid


class _Case:
    def __init__(self, name):
        self.name = name


def _items(n):
    return [(_Wl(f"w{i}"), _Case("fwd"), "strict", ["eager", "compile"]) for i in range(n)]


def _args(jobs):
    return argparse.Namespace(jobs=jobs, in_process=False, timeout=10, warm=False)


def test_run_configs_overlaps_at_most_jobs_sides_and_yields_every_cell_once(monkeypatch):
    alive, peak, lock, seen_timeouts = [0], [0], threading.Lock(), set()

    def fake_side(wl, case, p, side, args, lock_path):
        assert lock_path is not None
        seen_timeouts.add(args.timeout)
        with lock:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
        time.sleep(0.02)
        with lock:
            alive[0] -= 1
        return {"side": side, "cell": wl.id}

    monkeypatch.setattr(runner, "_side", fake_side)
    out = list(runner.run_configs(_items(5), _args(3), lambda s: None))
    assert sorted(it[0].id for it, _ in out) == [f"w{i}" for i in range(5)]
    for it, docs in out:
        assert set(docs) == {"ours", "eager", "compile"}
        assert {d["cell"] for d in docs.values()} == {it[0].id}
    assert 1 < peak[0] <= 3
    assert seen_timeouts == {30}  # a child's timeout covers its wait for the lock


def test_run_configs_starts_no_cell_after_the_deadline(monkeypatch):
    calls = []

    def fake_side(wl, case, p, side, args, lock_path):
        calls.append(wl.id)
        time.sleep(0.05)
        return {}

    monkeypatch.setattr(runner, "_side", fake_side)
    deadline = time.perf_counter() + 0.01
    out = list(runner.run_configs(_items(4), _args(2), lambda s: None, deadline))
    # the first cell started before the deadline and ran all three sides; no other started
    assert [it[0].id for it, _ in out] == ["w0"] and calls.count("w0") == 3
    assert set(calls) == {"w0"}
