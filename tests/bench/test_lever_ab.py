"""``bench/lever_ab.py`` on lavapipe: the levers switch what compiles (the U-Net decoder's
broadcast copies come back with ``broadcast_views`` off), every switch is restored after a
build, and an unknown lever is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import lever_ab
from meganeura.passes import broadcast_views

ROOT = Path(__file__).resolve().parents[2]


def test_a_lever_changes_the_program_and_is_restored(tmp_path):
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "bench/lever_ab.py", "--quick", "--cases", "w5:fwd_small_b2",
           "--levers", "broadcast_views", "--rounds", "1", "--repeats", "2", "--warmup", "1",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "w5:fwd_small_b2" and row["off"] == ["broadcast_views"]
    # the nearest-2x upsample's broadcast_to copies run again with the lever off
    assert row["dispatches_off"] == row["dispatches_on"] + 4
    assert row["ms_on"] > 0 and row["ms_off"] > 0


def test_switch_sets_and_restores():
    lever_ab.switch("broadcast_views", False)
    try:
        assert broadcast_views.enabled() is False
    finally:
        lever_ab.switch("broadcast_views", True)
    assert broadcast_views.enabled() is True
    with pytest.raises(KeyError, match="unknown lever 'nope'; levers: norm_prologue"):
        lever_ab.switch("nope", True)


def _fake_sides(log: list) -> list[dict]:
    return [
        {"run": lambda n=n: log.append(n), "sync": lambda n=n: log.append(f"sync {n}")}
        for n in ("on", "off")
    ]


def test_rounds_alternate_which_side_goes_first():
    log: list = []
    times = lever_ab.interleaved(_fake_sides(log), rounds=3, warmup=1, repeats=2)
    assert [len(t) for t in times] == [6, 6]  # per side, in sides' order, round by round

    def turn(n):  # one side's turn: its warm-up call, a sync, then each timed call and sync
        return [n, f"sync {n}"] * 3

    # on first in rounds 0 and 2, off in round 1
    assert log == [*turn("on"), *turn("off"), *turn("off"), *turn("on"), *turn("on"), *turn("off")]
    assert lever_ab.round_medians([1.0, 3.0, 10.0, 20.0, 5.0, 5.0], 2) == [2.0, 15.0, 5.0]


def test_heat_calls_both_sides_in_turn_then_syncs():
    log: list = []
    assert lever_ab.heat_all(_fake_sides(log), 0.0) == 0 and log == []
    n = lever_ab.heat_all(_fake_sides(log), 0.01)
    assert n >= 2 and n % 2 == 0
    assert log[:n] == ["on", "off"] * (n // 2) and log[n:] == ["sync on", "sync off"]


def test_resident_side_uploads_and_reopens_nothing_per_call(monkeypatch):
    """W2 fwd's resident side (the H200's slow on side) against its uploading side, counted per
    timed call: each submits the step once and syncs once; only off uploads (its 3 inputs);
    neither reopens its Session nor reads anything back."""
    from bench.workloads_lib.registry import WORKLOADS
    from meganeura.runtime import fastpath, session

    wl = WORKLOADS["w2"]
    if wl.missing():
        pytest.skip(wl.missing())
    case = wl.case("fwd_chunk10", True)
    on, _ = lever_ab.build(wl, case, True, [])
    off, _ = lever_ab.build(wl, case, True, ["resident_inputs"])
    counts: dict = {}

    def counted(key, fn):
        def wrapper(*a, **k):
            counts[key] = counts.get(key, 0) + 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(fastpath, "write", counted("write", fastpath.write))
    monkeypatch.setattr(fastpath, "map_read", counted("map_read", fastpath.map_read))
    monkeypatch.setattr(fastpath.Recorder, "submit", counted("submit", fastpath.Recorder.submit))
    prepared = counted("submit", fastpath.Recorder.submit_prepared)  # a step recorded ahead
    monkeypatch.setattr(fastpath.Recorder, "submit_prepared", staticmethod(prepared))
    monkeypatch.setattr(session.Session, "__init__", counted("open", session.Session.__init__))
    monkeypatch.setattr(session.Session, "read", counted("read", session.Session.read))
    sessions = {id(s) for side in (on, off) for s in side["sessions"]()}
    for turn in range(2):  # each side's calls after the other's, as lever_ab's rounds
        for name, side in (("on", on), ("off", off)):
            counts.clear()
            for _ in range(4):
                side["run"]()
                side["sync"]()
            n_inputs = len(side["profile"]()[1])
            uploads = {} if name == "on" else {"write": 4 * n_inputs}
            assert n_inputs == 3
            assert counts == {"submit": 4, **uploads}, (name, turn)
    assert {id(s) for side in (on, off) for s in side["sessions"]()} == sessions
