"""The matmul tuner and ``meganeura tune`` on the adapter at hand (lavapipe on CI): only plans
whose results match are recorded, and the next compile uses them and stays right."""

from __future__ import annotations

import itertools
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from meganeura.cli import main
from meganeura.compile import compile
from meganeura.runtime import Session
from meganeura.training import device_limits
from meganeura.tune import cache as tc
from meganeura.tune import matmul as tm

SHAPES = [(16, 64, 32, "nn", 1), (3, 64, 48, "nt", 1), (12, 40, 24, "tn", 2)]
PLANS = ["simd8", "gemv32", "64x64x16/np"]  # with each shape's default: a few plans each


def slow_default(monkeypatch, factor: float = 1000.0, wrong: str | None = None):
    """Time the default plans ``factor`` times slower, so a candidate wins whatever the
    timing noise; a plan named ``wrong`` returns a wrong result (1% off) in no time. (With 10,
    lavapipe's 64x64x16/np, ~6x slower than simd16 on a batched 12 x 40 x 24 product, lost the
    confirming second timing about one run in three.)"""
    real = tm._time_plan
    defaults = {}

    def timed(name, shape, *args):
        y, us = real(name, shape, *args)
        defaults.setdefault(shape, tm.default_plan(shape, device_limits(args[3])))
        if name == wrong:
            return y * np.float32(1.01), 0.001
        return y, us * factor if name == defaults[shape] else us

    monkeypatch.setattr(tm, "_time_plan", timed)


@pytest.mark.gpu
def test_tuner_records_matching_plans_and_the_compile_uses_them(gpu_device, tmp_path, monkeypatch):
    tc.set_cache_dir(tmp_path)
    slow_default(monkeypatch, wrong="simd8")
    report = tm.tune_matmuls(SHAPES, gpu_device, repeats=2, warmup=1, plans=PLANS)
    assert report.path is not None and report.timing in ("timestamps", "wall")
    doc = json.loads(open(report.path).read())
    by_key = {r.key: r for r in report.results}
    assert set(by_key) == set(SHAPES)
    for r in report.results:
        # the wrong plan was caught, never timed as a winner
        if "simd8" in r.rejected:
            assert r.rejected["simd8"].startswith("result differs")
        assert "simd8" not in r.times and r.best_plan != "simd8"
        assert r.recorded and r.gain >= tm.MIN_GAIN and r.best_plan != r.default_plan
        saved = doc["matmul"][tc.format_shape(r.key)]
        assert saved["plan"] == r.best_plan and saved["default_plan"] == r.default_plan
    assert "wall clock" in report.table() or "timestamp" in report.table()

    limits = device_limits(gpu_device)
    assert dict(limits.matmul_plans) == {k: r.best_plan for k, r in by_key.items()}
    rng = np.random.default_rng(3)
    for key in SHAPES:
        graph, a_shape, b_shape = tm.build_matmul(key)
        program = compile(graph, limits=limits)
        (choice,) = program.meta["matmuls"]
        assert (choice["plan"], choice["source"]) == (by_key[key].best_plan, "device")
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32)
        with Session(program, gpu_device) as sess:
            sess.load_state_dict({"a": a, "b": b})
            y = sess.run({}, fetch=("y",))["y"]
        want = tm._numpy_product(a, b, key[3])
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_no_gain_records_nothing_and_drops_an_old_entry(gpu_device, tmp_path, monkeypatch):
    key = SHAPES[0]
    dkey = tc.device_key(gpu_device)
    tc.save(tc.TuningCache(dkey, {key: tc.MatmulEntry("64x64x16/np", 1.0, "x", 2.0)}), tmp_path)
    real = tm._time_plan

    def default_fastest(name, shape, *args):
        y, _ = real(name, shape, *args)
        return y, 1.0 if name == tm.default_plan(shape, device_limits(args[3])) else 5.0

    monkeypatch.setattr(tm, "_time_plan", default_fastest)
    report = tm.tune_matmuls([key], gpu_device, repeats=1, warmup=0, plans=PLANS,
                             directory=tmp_path)  # fmt: skip
    (r,) = report.results
    assert not r.recorded and r.best_plan == r.default_plan
    assert tc.load(dkey, tmp_path).matmul == {}


@pytest.mark.gpu
def test_tune_cli_shapes_list_clear(gpu_device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    slow_default(monkeypatch)
    argv = ["tune", "--shapes", "16,64,32,nn", "3,64,48,nt,1", "--plans", "64x64x16/np",
            "gemv32", "--repeats", "1", "--warmup", "0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "16,64,32,nn,1" in out and "3,64,48,nt,1" in out and "gain" in out
    path = tc.cache_path(tc.device_key(gpu_device), tmp_path / "tuning")
    doc = json.loads(path.read_text())
    assert sorted(doc["matmul"]) == ["16,64,32,nn,1", "3,64,48,nt,1"]
    assert main(["tune", "--list"]) == 0
    listed = capsys.readouterr().out
    assert str(path) in listed and doc["matmul"]["3,64,48,nt,1"]["plan"] in listed
    assert main(["tune", "--clear"]) == 0
    assert "removed" in capsys.readouterr().out and not path.exists()
    assert main(["tune", "--shapes", "1,2,3"]) == 2
    assert "M,K,N,layout" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_cli_a_built_in_model(gpu_device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    argv = ["tune", "mnist", "--batch-size", "16", "--hidden", "32", "--plans", "64x64x16/np",
            "--repeats", "1", "--warmup", "0", "--no-save"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    # the training step's products (forward, input-free backward) and the forward's
    assert "mnist (batch 16, hidden 32; train, forward): 5 distinct products" in out
    for shape in ("16,784,32,nt,1", "16,32,10,nt,1", "16,10,32,nn,1", "10,16,32,tn,1"):
        assert shape in out
    assert not (tmp_path / "tuning").exists()  # --no-save writes nothing


@pytest.mark.gpu
def test_without_timestamp_queries_it_times_the_wall_clock(gpu_device, tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu_device, "features", frozenset(gpu_device.features - {"timestamp-query"})
    )
    report = tm.tune_matmuls([SHAPES[1]], gpu_device, repeats=2, warmup=1, plans=["gemv32"],
                             directory=tmp_path)  # fmt: skip
    (r,) = report.results
    assert report.timing == "wall" and "wall clock" in report.table()
    assert set(r.times) == {r.default_plan, "gemv32"} and all(t > 0 for t in r.times.values())
    saved = tc.load(tc.device_key(gpu_device), tmp_path).matmul
    assert all(e.timing == "wall" for e in saved.values())


@pytest.mark.gpu
def test_a_training_step_with_device_plans_matches_the_defaults(gpu_device, tmp_path):
    """The MNIST MLP's step (forward, backward, SGD) with every product on a non-default
    device plan (split-K, tiles, gemv-free) gives the loss and parameters of the defaults."""
    from meganeura.models.mlp import build_mlp
    from meganeura.optim import SGD
    from meganeura.training import GraphTrainer

    net = build_mlp(16, (784, 32, 10), labels=True)
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((16, 784), dtype=np.float32),
             "y": rng.integers(0, 10, 16, dtype=np.int32)}  # fmt: skip
    params = {k: np.asarray(v) for k, v in net.state_dict().items()}

    def step():
        with GraphTrainer(net.graph, SGD(lr=0.1), device=gpu_device) as tr:
            tr.load_parameters(params)
            loss = float(tr.step(feeds)["loss"])
            return tr.program.meta["matmuls"], loss, tr.parameters()

    base_choices, base_loss, base_params = step()
    plans = ["64x64x16/s2", "128x64x16/np", "64x64x32"]
    tc.set_cache_dir(tmp_path)
    tc.save(tc.TuningCache(tc.device_key(gpu_device), {
        (c["m"], c["k"], c["n"], c["layout"], c["batch"]): tc.MatmulEntry(plans[i % 3], 1, "x", 2)
        for i, c in enumerate(base_choices)
    }))  # fmt: skip
    choices, loss, got = step()
    assert {c["source"] for c in choices} == {"device"}
    assert [c["plan"] for c in choices] != [c["plan"] for c in base_choices]
    assert loss == pytest.approx(base_loss, rel=1e-5)
    for name, value in base_params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_heater_runs_its_time_and_is_kicked_before_each_plan(gpu_device, monkeypatch):
    heater = tm.Heater(gpu_device, n=32)
    try:
        assert heater.run(0.0) == 0
        steps = heater.run(0.05)
    finally:
        heater.close()
    assert steps >= 8 and steps % 8 == 0
    events = []

    class Fake:
        settled_s = 0.0

        def __init__(self, device):
            events.append("new")

        def run(self, seconds):
            events.append(("run", seconds))

        def kick(self):
            events.append("kick")

        def calibrate(self):
            events.append("calibrate")

        def settle(self):
            events.append("settle")
            return 0.0

        def close(self):
            events.append("close")

    monkeypatch.setattr(tm, "Heater", Fake)
    plans = ["simd8"]
    tm.tune_matmuls([SHAPES[0]], gpu_device, repeats=1, warmup=0, plans=plans, save=False)
    if device_limits(gpu_device).cpu:  # a CPU adapter runs no heater by default
        assert events == []
    else:
        assert events[:3] == ["new", ("run", tm.WARM_SECONDS), "calibrate"]
        assert events[-1] == "close"
    events.clear()
    report = tm.tune_matmuls(
        [SHAPES[0]], gpu_device, repeats=1, warmup=0, plans=plans, save=False, warm_seconds=0.25
    )
    timed = len(report.results[0].times)
    assert events[:3] == ["new", ("run", 0.25), "calibrate"] and events[-1] == "close"
    assert events.count("kick") >= timed  # every timed plan (and any re-timing) after a kick
    # ... and after the clock gate, right before its kick
    kicks = [i for i, e in enumerate(events) if e == "kick"]
    assert all(events[i - 1] == "settle" for i in kicks)


def _fake_heater(checks_us, features=("timestamp-query",)):
    """A Heater whose profiled submissions take the step times of ``checks_us`` in turn (one
    list of per-step microseconds a submission; a number stands for that time at every step)
    and whose ``run`` records how long it was asked to heat and takes 1 ms (no GPU)."""
    checks = iter(checks_us)

    def profile(feeds, repeats, warmup, replays):
        c = next(checks)
        times = list(c) if isinstance(c, (list, tuple)) else [c] * replays
        assert len(times) == replays
        return SimpleNamespace(repeat_ns=lambda: [us * 1e3 for us in times])

    session = SimpleNamespace(device=SimpleNamespace(features=set(features)), profile=profile)
    heater = tm.Heater.__new__(tm.Heater)
    heater.session, heater.reference_us, heater.settled_s = session, None, 0.0
    heater.heats = []
    heater.run = lambda seconds: (heater.heats.append(seconds), time.sleep(0.001))
    return heater


def test_settle_heats_until_the_steps_run_at_the_reference_speed():
    # the reference is the median of REFERENCE_STEPS steps after the warm-up (one outlier
    # does not move it); then two slow checks (a lowered clock), then one within 5%
    ref = [100.0] * (tm.REFERENCE_STEPS - 1) + [50.0]
    heater = _fake_heater([ref, 480.0, 210.0, [104.9, 104.0, 400.0], 999.0])
    assert heater.settle() == 0.0 and heater.heats == []  # nothing to compare before calibrate
    assert heater.calibrate() == 100.0 and heater.reference_us == 100.0
    heated = heater.settle()
    assert heater.heats == [tm.SETTLE_RUN_S] * 2 and 0.002 <= heated < 1.0
    assert heater.settled_s == heated
    assert heater.reference_us == 100.0  # never moved by later steps


def test_settle_never_lowers_its_reference_and_stops_at_its_limit():
    heater = _fake_heater([100.0, 90.0, 103.0])
    heater.calibrate()
    assert heater.settle() == 0.0 and heater.settle() == 0.0  # a faster check moves nothing
    assert heater.reference_us == 100.0 and heater.heats == []
    # a GPU that never comes back: heat until the limit, then give up
    slow = _fake_heater(itertools.chain([100.0], itertools.repeat(400.0)))
    slow.calibrate()
    assert slow.settle(max_seconds=0.0) == 0.0 and slow.heats == []
    heated = slow.settle(max_seconds=0.02)
    assert 1 <= len(slow.heats) <= 20 and 0.02 <= heated < 1.0  # wall seconds, not nominal
    assert slow.settled_s == heated


def test_settle_is_a_no_op_without_timestamps():
    heater = _fake_heater([], features=())
    assert heater.calibrate() is None and heater.step_us() is None
    assert heater.settle() == 0.0 and heater.heats == []
