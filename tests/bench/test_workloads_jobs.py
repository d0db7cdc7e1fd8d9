"""``bench/workloads.py --jobs N``: overlapped children whose GPU phases take turns.

The lock and the quiet sections are checked with real processes (locked intervals never overlap;
others stop during a quiet section and run again after it); the
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


_TICKER = textwrap.dedent(
    """
    import sys, time
    while True:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        time.sleep(0.01)
    """
)


def _ticks(path):
    try:
        return path.read_text()
    except OSError:
        return ""


def test_quiet_section_stops_the_other_children_and_continues_them(tmp_path, monkeypatch):
    pids = tmp_path / "gpu.lock.pids"
    ticks = [tmp_path / f"t{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _TICKER, str(t)]) for t in ticks]
    try:
        gpu_lock.write_pids(str(pids), [p.pid for p in procs] + [os.getpid()])
        monkeypatch.setenv(gpu_lock.PIDS_ENV, str(pids))
        deadline = time.time() + 30
        while not all(_ticks(t) for t in ticks) and time.time() < deadline:
            time.sleep(0.02)
        with gpu_lock.quiet() as stopped:
            assert stopped == 2  # itself excluded
            time.sleep(0.1)
            before = [_ticks(t) for t in ticks]
            time.sleep(0.3)
            assert [_ticks(t) for t in ticks] == before  # nothing ran
        time.sleep(0.3)
        assert all(_ticks(t) != b for t, b in zip(ticks, before, strict=True))  # running again
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_child_starts_only_once_listed(tmp_path, monkeypatch):
    pids = tmp_path / "gpu.lock.pids"
    gpu_lock.write_pids(str(pids), [])
    monkeypatch.setenv(gpu_lock.PIDS_ENV, str(pids))
    t = threading.Timer(0.3, gpu_lock.write_pids, (str(pids), [os.getpid()]))
    t0 = time.perf_counter()
    t.start()
    gpu_lock.started()
    assert time.perf_counter() - t0 >= 0.25
    assert os.getpid() in gpu_lock.read_pids(str(pids))


def test_gpu_overlap_names_no_lock_but_keeps_quiet_sections(monkeypatch):
    """``--gpu-overlap``: the child's environment has the pid file (quiet sections) and no
    GPU lock; without it, both."""
    envs = []

    def fake_child(cell, args, env, compile_only=False):
        envs.append(env)
        return {}

    monkeypatch.setattr(runner, "child", fake_child)
    wl, case = _Wl("w1"), _Case("fwd")
    for overlap in (False, True):
        args = argparse.Namespace(
            jobs=2, in_process=False, timeout=10, warm=False, gpu_overlap=overlap
        )
        runner._side(wl, case, "strict", "eager", args, "/tmp/x/gpu.lock")
    locked, overlapped = envs
    assert locked[gpu_lock.ENV] == "/tmp/x/gpu.lock"
    assert locked[gpu_lock.PIDS_ENV] == overlapped[gpu_lock.PIDS_ENV] == "/tmp/x/gpu.lock.pids"
    assert gpu_lock.ENV not in overlapped


_PARENT_OF_TICKER = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    time.sleep(600)
    """
)


def test_quiet_section_stops_the_workers_a_child_spawned(tmp_path, monkeypatch):
    """A child in a session of its own (as ``runner.child`` starts it) is stopped with the
    processes it started, as torch.compile's compile pool is; a pid that leads no group is
    signalled alone."""
    pids = tmp_path / "gpu.lock.pids"
    tick = tmp_path / "grandchild"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT_OF_TICKER, _TICKER, str(tick)], start_new_session=True
    )
    try:
        gpu_lock.write_pids(str(pids), [parent.pid, os.getpid()])
        monkeypatch.setenv(gpu_lock.PIDS_ENV, str(pids))
        deadline = time.time() + 30
        while not _ticks(tick) and time.time() < deadline:
            time.sleep(0.02)
        assert _ticks(tick), "the grandchild never ran"
        with gpu_lock.quiet():
            time.sleep(0.1)
            before = _ticks(tick)
            time.sleep(0.3)
            assert _ticks(tick) == before  # the grandchild stopped with its parent
        time.sleep(0.3)
        assert _ticks(tick) != before
    finally:
        gpu_lock.signal_all([parent.pid], 9)
        parent.wait()


def _fake_torch_cell(monkeypatch, overlap: bool, mode: str, prime: bool = False):
    """``cell.run_torch`` with a stand-in model and side: where the first call and the timed
    calls ran, inside the quiet section or not."""
    import contextlib

    import numpy as np
    import torch

    from bench.workloads_lib import cell, torch_side

    inside, where = [False], []

    @contextlib.contextmanager
    def fake_quiet():
        inside[0] = True
        yield 0
        inside[0] = False

    class Wl:
        def torch_model(self, case, quick):
            return torch.nn.Identity()

        def batch(self, case, quick):
            return (np.zeros(2, np.float32),)

    def fake_steps(wl, case, m, batch, mode, dev):
        return {
            "first": lambda: where.append(("first", inside[0])),
            "run": lambda: where.append(("run", inside[0])),
        }

    monkeypatch.setattr(cell, "quiet", fake_quiet)
    monkeypatch.setattr(torch_side, "setup", lambda precision: (torch, "cpu"))
    monkeypatch.setattr(torch_side, "steps", fake_steps)
    args = argparse.Namespace(
        allow_cpu_compile=True,
        compile_only=False,
        overlap_compile=overlap,
        prime=prime,
        quick=True,
        warm_seconds=0,
        warmup=1,
        repeats=2,
    )
    case = _Case("fwd_x")
    case.kind = "fwd"
    doc = cell.run_torch(Wl(), case, "strict", mode, args)
    return doc, where


def test_overlap_compile_moves_only_the_compiled_first_call_out_of_the_quiet_section(
    monkeypatch,
):
    doc, where = _fake_torch_cell(monkeypatch, True, "compile")
    assert where[0] == ("first", False) and doc["first_call_overlapped"] is True
    assert all(inside for _, inside in where[1:]) and len(where) == 1 + 1 + 2
    doc, where = _fake_torch_cell(monkeypatch, False, "compile")
    assert all(inside for _, inside in where) and "first_call_overlapped" not in doc
    doc, where = _fake_torch_cell(monkeypatch, True, "eager")  # nothing to compile
    assert all(inside for _, inside in where) and "first_call_overlapped" not in doc
    # --compile-warm's priming child: the first call alone, outside the quiet section
    doc, where = _fake_torch_cell(monkeypatch, False, "compile", prime=True)
    assert where == [("first", False)] and "metrics" not in doc


class _ToyWorkload:
    id, name = "w9", "toy"
    paper: dict = {}

    def headline(self, quick):
        return {"fwd_x"}


def _toy_cell():
    """(workload class, its fwd case, our side's document with a passing gate)."""
    case = _Case("fwd_x")
    case.kind = "fwd"
    ours = {"metrics": {"ms": {"median": 1.0, "min": 1.0, "n": 10}}, "gate": "PASS"}
    return _ToyWorkload, case, ours


def test_rows_of_an_overlapped_compile_give_no_compile_figure():
    from bench.workloads_lib import rows

    Wl, case, ours = _toy_cell()
    ours["first_call_s"] = 2.0
    for overlapped in (False, True):
        theirs = {"metrics": {"ms": {"median": 2.0, "min": 2.0, "n": 10}}, "first_call_s": 30.0}
        if overlapped:
            theirs["first_call_overlapped"] = True
        out = rows.rows_for(Wl(), case, "strict", {"ours": ours, "compile": theirs}, quick=True)
        timing = [r for r in out if r["metric"] == "ms"]
        compile_rows = [r for r in out if r["metric"] == "s"]
        assert len(timing) == 1 and timing[0]["speedup"] == 2.0
        cs = timing[0]["compile_s"]
        if overlapped:
            assert compile_rows == [] and cs["torch_cold"] is None
            assert cs["torch_cold_overlapped"] == 30.0
        else:
            assert [r["torch"] for r in compile_rows] == [30.0] and cs["torch_cold"] == 30.0


def test_compile_warm_rows_attach_to_the_measured_rows_and_keep_their_stamp():
    from bench.workloads_lib import rows

    Wl, case, ours = _toy_cell()
    ours["first_call_s"] = 4.0
    docs = {"ours": ours}
    for mode in ("eager", "compile"):
        docs[mode] = {"metrics": {"ms": {"median": 2.0, "min": 2.0, "n": 10}}}
        docs[mode]["first_call_s"] = 30.0 if mode == "compile" else 0.1
    old = rows.rows_for(Wl(), case, "strict", docs, quick=True)
    for r in old:
        r["measured"] = {"commit": "aaa"}
    warm = {"ours": {"warm_first_call_s": 1.0}, "compile": {"warm_first_call_s": 6.0}}
    new = rows.warm_rows(Wl(), case, "strict", warm, old, quick=True)
    by = {r["case"]: r for r in new}
    assert set(by) == {
        "w9_toy_fwd_x_strict_vs_compile",
        "w9_toy_fwd_x_strict_compile_cold_vs_compile",
        "w9_toy_fwd_x_strict_compile_warm_vs_compile",
    }  # the eager row is not touched
    timing = by["w9_toy_fwd_x_strict_vs_compile"]
    assert timing["compile_s"] == {
        "ours_cold": 4.0,
        "ours_warm": 1.0,
        "torch_cold": 30.0,
        "torch_warm": 6.0,
    }
    assert timing["measured"] == {"commit": "aaa"} and timing["ours"] == 1.0
    w = by["w9_toy_fwd_x_strict_compile_warm_vs_compile"]
    assert (w["ours"], w["torch"], w["speedup"]) == (1.0, 6.0, 6.0) and "measured" not in w
    assert old[1]["compile_s"]["ours_warm"] is None  # the file's rows are copied, not changed
    # no timing row to attach to: nothing
    assert rows.warm_rows(Wl(), case, "fast", warm, old, quick=True) == []
