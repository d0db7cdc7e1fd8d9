"""Steps recorded ahead of their call (``stepping.PRE_ENCODE``, ``Recorder.prepare``): a
prepared step sees every feed, ``write`` and fetch of the call that submits it, gives the
values of a step recorded at its call bit for bit (AdamW steps, chunked or not), and a Session
closed or dropped with a step prepared frees its buffers."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.compile import compile
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import Linear, Module
from meganeura.runtime import Session
from meganeura.runtime import stepping as session_mod
from meganeura.training import device_limits

pytestmark = pytest.mark.gpu


@pytest.fixture
def pre_encode():
    """Switch ``PRE_ENCODE`` for the Sessions a test creates; restored afterwards."""
    before = session_mod.PRE_ENCODE

    def switch(on: bool) -> None:
        session_mod.set_pre_encode(on)

    yield switch
    session_mod.set_pre_encode(before)


def _affine(device):
    """y = x @ w + b over an input x [5, 3], parameters w [3, 4] and b [4]; also z = 2 * y."""
    g = GraphBuilder()
    x = g.input("x", (5, 3))
    w, b = g.parameter("w", (3, 4)), g.parameter("b", (4,))
    y = x @ w + b
    g.output("y", y)
    g.output("z", y * 2.0)
    return Session(compile(g.build(), limits=device_limits(device)), device)


def test_a_prepared_step_sees_the_feeds_writes_and_fetch_of_its_call(gpu_device, pre_encode):
    pre_encode(True)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    with _affine(gpu_device) as sess:
        sess.load_state_dict({"w": w, "b": b})
        fetches = [("y",), ("z",), ("y", "z"), (), ("y",)]
        for i, fetch in enumerate(fetches):
            x = rng.standard_normal((5, 3)).astype(np.float32)
            if i == 3:  # a parameter written between two calls counts for the next one
                b = b + 1.0
                sess.write("b", b)
            out = sess.run({"x": x}, fetch)
            assert sess._ready is not None  # the next step is recorded already
            assert sorted(out) == sorted(fetch)
            ref = x.astype(np.float64) @ w + b
            for name, want in (("y", ref), ("z", 2 * ref)):
                if name in fetch:
                    np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5)


def test_no_step_is_prepared_with_the_switch_off(gpu_device, pre_encode):
    pre_encode(False)
    with _affine(gpu_device) as sess:
        sess.load_state_dict({"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)})
        out = sess.run({"x": np.ones((5, 3), np.float32)}, "y")["y"]
        assert sess._ready is None
        np.testing.assert_array_equal(out, np.full((5, 4), 3.0, np.float32))


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(12, 16)
        self.fc2 = Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _train(chunks, steps: int = 4):
    mn.manual_seed(5)
    tr = mn.Trainer(Net(), mn.optim.AdamW(lr=1e-2), lambda m, x, y: F.cross_entropy(m(x), y))
    rng = np.random.default_rng(11)
    losses = []
    for i in range(steps):
        x = rng.standard_normal((6, 12)).astype(np.float32)
        y = rng.integers(0, 4, 6).astype(np.int32)
        if i == 1:
            sess = next(iter(tr._cache.values())).entry.runner.session
            sess.set_submit_chunks(*chunks)  # drops the step prepared with the old chunks
            assert sess._ready is None
        losses.append(float(tr.step(x, y)))
    params = {k: np.array(v) for k, v in tr.state_dict().items()}
    tr.close()
    return losses, params


@pytest.mark.parametrize("chunks", [(0, 0), (1, 2)], ids=["one_buffer", "chunked"])
def test_prepared_training_steps_equal_steps_recorded_at_the_call(pre_encode, chunks):
    pre_encode(False)
    base_l, base_p = _train(chunks)
    pre_encode(True)
    got_l, got_p = _train(chunks)
    assert got_l == base_l
    assert got_p.keys() == base_p.keys()
    for k in base_p:
        np.testing.assert_array_equal(got_p[k], base_p[k], err_msg=k)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_session_dropped_or_closed_with_a_step_prepared_frees_its_buffers(gpu_device, pre_encode):
    if not device_limits(gpu_device).cpu:
        pytest.skip("host RSS shows device memory only on a CPU adapter (lavapipe)")
    pre_encode(True)
    g = GraphBuilder()
    a = g.parameter("a", (1024, 2048))  # 8 MiB
    g.output("y", a @ g.parameter("b", (2048, 4)))
    program = compile(g.build(), limits=device_limits(gpu_device))
    ones = {"a": np.ones((1024, 2048), np.float32), "b": np.ones((2048, 4), np.float32)}
    before = None
    for i in range(18):
        sess = Session(program, gpu_device)
        sess.load_state_dict(ones)
        sess.run({})
        assert sess._ready is not None
        if i % 2:
            sess.close()
            with pytest.raises(RuntimeError):
                sess.run({})
        del sess
        gc.collect()
        if i == 1:
            before = _rss_mib()
    # 16 Sessions of 8 MiB each: pinned buffers would add ~128 MiB
    assert _rss_mib() - before < 48


def test_a_failure_recording_ahead_does_not_fail_the_submitted_step(
    gpu_device, pre_encode, monkeypatch
):
    from meganeura.runtime import fastpath

    pre_encode(True)
    w = np.eye(3, 4, dtype=np.float32)
    with _affine(gpu_device) as sess:
        sess.load_state_dict({"w": w, "b": np.zeros(4, np.float32)})
        real = fastpath.Recorder.prepare

        def broken(self, gpu, chunks):
            raise RuntimeError("recording failed")

        monkeypatch.setattr(fastpath.Recorder, "prepare", broken)
        x = np.arange(15, dtype=np.float32).reshape(5, 3)
        np.testing.assert_array_equal(sess.run({"x": x}, "y")["y"], x @ w)  # the step ran
        assert sess._ready is None
        monkeypatch.setattr(fastpath.Recorder, "prepare", real)
        np.testing.assert_array_equal(sess.run({"x": 2 * x}, "y")["y"], 2 * x @ w)
        assert sess._ready is not None
