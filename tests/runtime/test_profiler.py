"""Profiler: timestamps per dispatch, the table and the Chrome trace.

The aggregation and trace tests run without a GPU on synthetic timings; the GPU tests profile
a hand-built Program and the MNIST training step on the real adapter and skip when it lacks
``timestamp-query``. No test asserts on how long anything takes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from meganeura.dtypes import DType
from meganeura.runtime.profiler import (
    DispatchTiming,
    Profile,
    ProfilerError,
    choose_method,
    profile_dispatches,
    require_timestamps,
)
from meganeura.schedule.program import BufferSpec, Dispatch, Program, TensorSlot

N = 1000
WG = (N + 63) // 64


def _timing(index, name, repeat, start, dur, flops=0, nbytes=0) -> DispatchTiming:
    return DispatchTiming(index, name, repeat, start, dur, flops, nbytes, (1, 1, 1))


def _synthetic() -> Profile:
    timings = []
    for r in range(2):
        t0 = 10_000.0 * r
        timings += [
            _timing(0, "%1 matmul", r, t0, 3000.0, flops=6_000_000, nbytes=3_000_000),
            _timing(1, "%2 relu", r, t0 + 3500.0, 500.0, flops=1000, nbytes=8000),
            _timing(2, "%3 matmul", r, t0 + 4000.0, 1000.0, flops=2_000_000, nbytes=1_000_000),
        ]
    return Profile(tuple(timings), 2, "test adapter", 1.0, "given")


def test_stats_sorted_with_shares_and_rates():
    p = _synthetic()
    rows = p.stats()
    assert [k.name for k in rows] == ["%1 matmul", "%3 matmul", "%2 relu"]
    assert [k.count for k in rows] == [2, 2, 2]
    assert sum(k.share for k in rows) == pytest.approx(1.0)
    top = rows[0]
    assert top.total_ns == 6000.0 and top.mean_ns == 3000.0
    assert top.gb_per_s == pytest.approx(1000.0)  # 3 MB in 3 us
    assert top.gflop_per_s == pytest.approx(2000.0)
    assert p.step_ns() == pytest.approx(4500.0)
    assert p.span_ns() == pytest.approx(5000.0)
    slow = Profile((*p.timings, _timing(1, "%2 relu", 1, 15_000.0, 700.0)), 2, "a", 1.0, "given")
    assert slow.repeat_ns() == [4500.0, 5200.0]  # each repeat's own sum, in repeat order

    by_op = {k.name: k for k in p.stats(by="op")}
    assert set(by_op) == {"matmul", "relu"}
    assert by_op["matmul"].count == 4 and by_op["matmul"].total_ns == 8000.0


def test_table_lists_every_kernel_longest_first():
    lines = _synthetic().table().splitlines()
    assert lines[0].split()[:4] == ["kernel", "count", "total", "us"]
    body = [ln for ln in lines[2:] if ln.startswith("%")]
    assert [ln.split()[0] + " " + ln.split()[1] for ln in body] == [
        "%1 matmul",
        "%3 matmul",
        "%2 relu",
    ]
    assert body[0].rstrip().endswith("66.7%")  # 6000 of 9000 ns
    assert lines[-1].startswith("step: 4.5 us GPU")


def test_trace_events_carry_times_and_rates(tmp_path):
    p = _synthetic()
    path = p.write_trace(tmp_path / "sub" / "trace.json")
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 6
    e = events[0]
    assert e["name"] == "%1 matmul" and e["ts"] == 0.0 and e["dur"] == 3.0
    assert e["args"]["bytes"] == 3_000_000 and e["args"]["flops"] == 6_000_000
    assert e["args"]["GB/s"] == pytest.approx(1000.0)
    assert e["args"]["GFLOP/s"] == pytest.approx(2000.0)
    assert events[3]["ts"] == 10.0 and events[3]["args"]["repeat"] == 1
    assert doc["otherData"]["device"] == "test adapter"


def test_missing_timestamp_feature_is_a_clear_error():
    dev = SimpleNamespace(
        features=frozenset({"shader-f16"}), adapter=SimpleNamespace(features=set()), name="fake"
    )
    with pytest.raises(ProfilerError, match="timestamp-query.*fake.*does not offer"):
        require_timestamps(dev)
    dev.adapter.features = {"timestamp-query"}
    with pytest.raises(ProfilerError, match="created without it"):
        require_timestamps(dev)


def _fake_device(*features: str) -> SimpleNamespace:
    return SimpleNamespace(
        features=frozenset(features), adapter=SimpleNamespace(features=set(features)), name="fake"
    )


def test_choose_method_prefers_inside_and_refuses_what_the_device_lacks():
    both = _fake_device("timestamp-query", "timestamp-query-inside-passes")
    plain = _fake_device("timestamp-query")
    assert choose_method(both) == "inside"
    assert choose_method(both, "passes") == "passes"
    assert choose_method(plain) == "passes"
    assert choose_method(plain, "passes") == "passes"
    with pytest.raises(ProfilerError, match="fake has no 'timestamp-query-inside-passes'"):
        choose_method(plain, "inside")
    with pytest.raises(ProfilerError, match="does not offer"):
        choose_method(_fake_device("timestamp-query-inside-passes"), "auto")
    with pytest.raises(ValueError, match="method must be .* got 'fast'"):
        choose_method(both, "fast")


def test_profile_dispatches_refuses_zero_repeats_before_touching_the_device():
    # The fake has no .gpu: reaching the device would raise AttributeError instead.
    with pytest.raises(ValueError, match="repeats >= 1, got 0"):
        profile_dispatches(_fake_device("timestamp-query"), (), (), (), repeats=0)


# ----------------------------------------------------------------------------- on the GPU


@pytest.fixture
def ts_device(gpu_device):
    if "timestamp-query" not in gpu_device.features:
        pytest.skip(f"{gpu_device.name} has no timestamp-query")
    return gpu_device


_SCALE = """@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  if (g.x >= 1000u) { return; }
  y[g.x] = 2.0 * x[g.x];
}
"""
_COUNT = """@group(0) @binding(0) var<storage, read_write> c: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  if (g.x >= 1000u) { return; }
  c[g.x] = c[g.x] + 1.0;
}
"""


def _counting_program() -> Program:
    f32 = DType.f32
    return Program(
        buffers=(
            BufferSpec(0, N * 4, "input", "x"),
            BufferSpec(1, N * 4, "output", "y"),
            BufferSpec(2, N * 4, "state", "count"),
        ),
        dispatches=(
            Dispatch("%1 scale", _SCALE, (0, 1), (False, True), (WG, 1, 1), N, 8 * N),
            Dispatch("%2 empty", _SCALE, (0, 1), (False, True), (0, 1, 1)),
            Dispatch("%3 count", _COUNT, (2,), (True,), (WG, 1, 1), N, 8 * N),
        ),
        inputs={"x": TensorSlot(0, (N,), f32)},
        outputs={"y": TensorSlot(1, (N,), f32)},
        parameters={},
        state={"count": TensorSlot(2, (N,), f32)},
    )


@pytest.mark.parametrize("replays", [1, 3], ids=["one_step", "three_steps"])
@pytest.mark.parametrize("method", ["inside", "passes"])
def test_profile_times_each_executed_dispatch_and_runs_the_step(ts_device, method, replays):
    """Each profiled submission replays the step ``replays`` times back to back, each replay
    a repeat of the Profile."""
    from meganeura.runtime import Session

    if method == "inside" and "timestamp-query-inside-passes" not in ts_device.features:
        pytest.skip(f"{ts_device.name} has no timestamp-query-inside-passes")
    with Session(_counting_program(), ts_device) as s:
        x = np.arange(N, dtype=np.float32)
        p = s.profile({"x": x}, repeats=3, warmup=2, method=method, replays=replays)
        assert p.method == method and p.repeats == 3 * replays
        # The empty grid is skipped, as in run(); every other dispatch once per repeat.
        assert [(t.index, t.name, t.repeat) for t in p.timings] == [
            (i, name, r)
            for r in range(3 * replays)
            for i, name in ((0, "%1 scale"), (2, "%3 count"))
        ]
        assert all(t.duration_ns >= 0 and t.start_ns >= 0 for t in p.timings)
        assert p.timings[0].start_ns == 0
        starts = [t.start_ns for t in p.timings]
        assert starts == sorted(starts)  # passes run in order, repeats one after another
        if method == "inside":  # back to back: each dispatch starts where the previous ended
            a, b = p.timings[0], p.timings[1]
            assert b.start_ns == a.start_ns + a.duration_ns
        assert p.timings[0].flops == N and p.timings[0].bytes == 8 * N
        assert p.timestamp_period > 0
        # Warm-up and profiled steps really ran: 2 + 3 x replays increments, and y = 2x.
        steps = 2 + 3 * replays
        np.testing.assert_array_equal(s.read("count"), np.full(N, steps, np.float32))
        np.testing.assert_array_equal(s.read("y"), 2 * x)
        # run() is unaffected afterwards.
        np.testing.assert_array_equal(s.run({"x": x + 1}, ["y"])["y"], 2 * (x + 1))
        assert s.read("count")[0] == steps + 1


def test_profile_rejects_bad_arguments_before_running(ts_device):
    from meganeura.runtime import InputError, Session

    with Session(_counting_program(), ts_device) as s:
        for bad in ({"x": np.zeros(N, np.float64)}, {"x": np.zeros(N, np.float32), "z": 0}, {}):
            with pytest.raises(InputError) as from_run:
                s.run(bad)
            with pytest.raises(InputError) as from_profile:
                s.profile(bad)
            assert str(from_profile.value) == str(from_run.value)
        with pytest.raises(ValueError, match="repeats"):
            s.profile({"x": np.zeros(N, np.float32)}, repeats=0)
        with pytest.raises(ValueError, match="method"):
            s.profile({"x": np.zeros(N, np.float32)}, method="fast")
        with pytest.raises(ValueError, match="replays >= 1"):
            s.profile({"x": np.zeros(N, np.float32)}, replays=0)
        np.testing.assert_array_equal(s.read("count"), np.zeros(N, np.float32))


def test_profile_refuses_a_closed_session(ts_device):
    from meganeura.runtime import Session

    s = Session(_counting_program(), ts_device)
    s.close()
    with pytest.raises(RuntimeError, match="this Session is closed"):
        s.profile({"x": np.zeros(N, np.float32)})


def test_profile_mnist_training_step(ts_device, tmp_path):
    from meganeura import manual_seed
    from meganeura.models.mlp import build_mlp
    from meganeura.optim import HYPER_INPUT, AdamW
    from meganeura.optim.guard import GUARD_RESET_INPUT
    from meganeura.training import Trainer

    manual_seed(0)
    net = build_mlp(16, (784, 32, 10))
    tr = Trainer(net.graph, AdamW(lr=1e-3), device=ts_device)
    tr.load_parameters(net.state_dict())
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((16, 784), dtype=np.float32),
        "y": rng.integers(0, 10, 16, dtype=np.int32),
        HYPER_INPUT: tr.optimizer.hyper(0, 1e-3),
        GUARD_RESET_INPUT: np.float32(1),  # the non-finite guard's flag (training.guard)
    }
    p = tr.session.profile(feeds, repeats=2)
    executed = [d for d in tr.program.dispatches if 0 not in d.grid]
    assert len(p.timings) == 2 * len(executed)
    assert [t.name for t in p.timings[: len(executed)]] == [d.name for d in executed]
    assert all(t.duration_ns >= 0 for t in p.timings)
    doc = json.loads(p.write_trace(tmp_path / "t.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(p.timings)
    assert all({"name", "ts", "dur", "args"} <= set(e) for e in xs)
    assert all({"flops", "bytes", "GB/s", "GFLOP/s"} <= set(e["args"]) for e in xs)
    assert "matmul" in {k.name for k in p.stats(by="op")}
