"""``split_short`` (``chunk_bounds(split_short=True)``, ``set_split_short``): a step recorded
ahead (``PRE_ENCODE``) of ``2 * first`` to ``first + size`` dispatches goes as two command
buffers. Results never depend on it: steps of 31 to 81 dispatches around both thresholds give
the values of the same step as one command buffer, bit for bit, across ``write``, ``profile``,
``set_submit_chunks`` after a step was prepared and training steps (AdamW); without
``PRE_ENCODE`` it never applies; a Session closed with a split step prepared is closed."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as NF
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import Linear, Module
from meganeura.ops import functional as F
from meganeura.runtime import Session, fastpath, stepping
from meganeura.training import device_limits

from .test_prepared_steps import _rss_mib
from .test_submit_chunks import Net

pytestmark = pytest.mark.gpu


@pytest.fixture
def levers(monkeypatch):
    """``switch(pre_encode, split_short)`` for the Sessions created next; both restored."""
    mod = stepping
    before = (mod.PRE_ENCODE, mod.SPLIT_SHORT)
    monkeypatch.delenv("MEGANEURA_SUBMIT_CHUNKS", raising=False)

    def switch(pre_encode: bool, split_short: bool) -> None:
        mod.set_pre_encode(pre_encode)
        mod.set_split_short(split_short)

    yield switch
    mod.set_pre_encode(before[0])
    mod.set_split_short(before[1])


def _chain(n: int, device) -> Session:
    """A Session whose step is exactly ``n`` dispatches: ``n - 1`` unfused elementwise ops on
    x [7, 9] (each reads the one before), then ``y @ w`` (parameter w [9, 9])."""
    g = GraphBuilder()
    y = g.input("x", (7, 9))
    w = g.parameter("w", (9, 9))
    for i in range(n - 1):
        y = F.tanh(y) if i % 2 == 0 else y * 1.5
    g.output("y", y)
    g.output("z", y @ w)
    program = compile(g.build(), CompileOptions(fuse=False), limits=device_limits(device))
    sess = Session(program, device)
    assert len(sess._plan) == n
    return sess


def _steps(sess: Session, profile: bool) -> list[dict]:
    """Five calls with new x each, w written before the third, a profile before the fourth,
    fetches varying; every fetched value and w read back at the end."""
    rng = np.random.default_rng(21)
    sess.write("w", rng.standard_normal((9, 9)).astype(np.float32))
    outs = []
    for i, fetch in enumerate([("y", "z"), ("z",), ("y", "z"), ("y",), ("z", "y")]):
        x = rng.standard_normal((7, 9)).astype(np.float32)
        if i == 2:
            sess.write("w", rng.standard_normal((9, 9)).astype(np.float32))
        if i == 3 and profile:
            prof = sess.profile({"x": x}, repeats=1, warmup=1)
            assert prof is not None
        outs.append(sess.run({"x": x}, fetch))
        assert sess._ready is not None and len(sess._ready) == sess.submissions
    outs.append({"w": sess.read("w")})
    return outs


def _want(n: int, split_short: bool) -> list[tuple[int, int]]:
    if split_short and 32 <= n <= 80 or n > 80:
        return [(0, 16), (16, n)]
    return [(0, n)]


def _can_profile(device) -> bool:
    return "timestamp-query" in device.features


@pytest.mark.parametrize("n", [31, 32, 33, 79, 80, 81], ids=lambda n: f"n{n}")
def test_steps_around_the_thresholds_equal_one_command_buffer(gpu_device, levers, n):
    got = {}
    for split in (False, True):
        levers(True, split)
        with _chain(n, gpu_device) as sess:
            assert list(sess._chunks) == _want(n, split)
            assert sess.submissions == len(_want(n, split))
            got[split] = _steps(sess, profile=_can_profile(gpu_device))
    for a, b in zip(got[False], got[True], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # and the values are the chain's (the comparison is not between two wrong steps)
    last = got[True][-2]["y"]
    assert np.all(np.isfinite(last)) and np.abs(last).max() > 0


def test_without_pre_encode_a_short_step_stays_one_command_buffer(gpu_device, levers):
    levers(False, True)
    with _chain(40, gpu_device) as sess:
        assert not sess._split_short
        assert list(sess._chunks) == [(0, 40)]
        sess.set_submit_chunks(8, 32)  # 16 <= 40 <= 40: would split with pre-encoding
        assert list(sess._chunks) == [(0, 40)]
        x = np.ones((7, 9), np.float32)
        sess.write("w", np.eye(9, dtype=np.float32))
        out = sess.run({"x": x}, ("y", "z"))
        assert sess._ready is None
        np.testing.assert_array_equal(out["y"], out["z"])  # w = I


def test_set_submit_chunks_after_a_step_was_prepared(gpu_device, levers):
    levers(True, True)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((7, 9)).astype(np.float32) for _ in range(4)]
    w = rng.standard_normal((9, 9)).astype(np.float32)
    with _chain(40, gpu_device) as ref:
        ref.set_submit_chunks(0, 0)
        ref.write("w", w)
        want = [ref.run({"x": x}, ("y", "z")) for x in xs]
        assert ref.submissions == 1
    with _chain(40, gpu_device) as sess:
        sess.write("w", w)
        got = [sess.run({"x": xs[0]}, ("y", "z"))]
        assert len(sess._ready) == 2  # prepared as 16 + 24
        sess.set_submit_chunks(8, 32)  # 16 <= 40 <= 40: 8 + 32
        assert sess._ready is None and list(sess._chunks) == [(0, 8), (8, 40)]
        got.append(sess.run({"x": xs[1]}, ("y", "z")))
        assert len(sess._ready) == 2
        sess.set_submit_chunks(25, 64)  # 50 > 40: one
        assert sess._ready is None and list(sess._chunks) == [(0, 40)]
        got.append(sess.run({"x": xs[2]}, ("y", "z")))
        assert len(sess._ready) == 1
        sess.set_submit_chunks(1, 2)  # 40 > 3: ordinary chunks, 1 then 2 at a time
        assert list(sess._chunks) == list(fastpath.chunk_bounds(40, 1, 2))
        assert sess.submissions == 21  # (0, 1), 19 of 2, (39, 40)
        got.append(sess.run({"x": xs[3]}, ("y", "z")))
        assert len(sess._ready) == 21
    for a, b in zip(want, got, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_closing_with_a_split_step_prepared(gpu_device, levers):
    levers(True, True)
    sess = _chain(32, gpu_device)
    sess.write("w", np.eye(9, dtype=np.float32))
    x = np.full((7, 9), 0.25, np.float32)
    first = sess.run({"x": x}, "z")["z"]
    assert len(sess._ready) == 2
    sess.close()
    assert sess._ready is None and sess.submissions == 1
    with pytest.raises(RuntimeError, match="closed"):
        sess.run({"x": x}, "z")
    sess.close()  # twice is fine
    with _chain(32, gpu_device) as again:  # the device still works
        again.write("w", np.eye(9, dtype=np.float32))
        np.testing.assert_array_equal(again.run({"x": x}, "z")["z"], first)


@pytest.mark.parametrize(
    "n,want",
    [(7, [(0, 7)]), (8, [(0, 4), (4, 8)]), (14, [(0, 4), (4, 14)]), (15, [(0, 4), (4, 15)])],
    ids=["below", "at_twice_first", "at_bound", "one_past"],
)
def test_environment_moves_the_thresholds(gpu_device, levers, monkeypatch, n, want):
    levers(True, True)
    monkeypatch.setenv("MEGANEURA_SUBMIT_CHUNKS", "4,10")
    with _chain(n, gpu_device) as sess:
        assert list(sess._chunks) == want
        sess.write("w", np.eye(9, dtype=np.float32))
        x = np.linspace(-1, 1, 63, dtype=np.float32).reshape(7, 9)
        out = sess.run({"x": x}, ("y", "z"))
        out2 = sess.run({"x": x}, ("y", "z"))  # this one from the prepared step
        np.testing.assert_array_equal(out["y"], out["z"])
        np.testing.assert_array_equal(out2["z"], out["z"])


@pytest.mark.parametrize(
    "n,first,size",
    [
        (n, f, s)
        for n in (1, 2, 3, 31, 32, 33, 79, 80, 81, 200)
        for f, s in ((16, 64), (1, 2), (0, 8), (5, 0), (40, 10))
    ],  # fmt: skip
    ids=lambda v: str(v),
)
def test_split_short_bounds_cover_the_plan(n, first, size):
    plain = list(fastpath.chunk_bounds(n, first, size))
    got = list(fastpath.chunk_bounds(n, first, size, split_short=True))
    assert got[0][0] == 0 and got[-1][1] == n
    assert all(a < b for a, b in got)
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    if size > 0 and first > 0 and 2 * first <= n <= first + size:
        assert got == [(0, first), (first, n)]
    else:
        assert got == plain


def _train(levers, split: bool, chunks: tuple[int, int] | None, steps: int = 4):
    levers(True, split)
    mn.manual_seed(3)
    tr = mn.Trainer(Net(), mn.optim.AdamW(lr=1e-2), lambda m, x, y: NF.cross_entropy(m(x), y))
    rng = np.random.default_rng(7)
    losses, parts = [], []
    for i in range(steps):
        x = rng.standard_normal((6, 12)).astype(np.float32)
        y = rng.integers(0, 4, 6).astype(np.int32)
        losses.append(float(tr.step(x, y)))
        sess = next(iter(tr._cache.values())).entry.runner.session
        if i == 0 and chunks is not None:
            n = len(sess._plan)
            sess.set_submit_chunks(*(chunks if chunks != (-1, -1) else (n // 2, n - n // 2)))
        parts.append(sess.submissions)
    params = {k: np.array(v) for k, v in tr.state_dict().items()}
    tr.close()
    return losses, params, parts


@pytest.mark.parametrize("chunks", [(-1, -1), (2, 200)], ids=["halves", "two_then_rest"])
def test_adamw_steps_equal_with_and_without_split_short(levers, chunks):
    base_l, base_p, base_n = _train(levers, False, chunks)
    got_l, got_p, got_n = _train(levers, True, chunks)
    assert set(base_n[1:]) == {1} and set(got_n[1:]) == {2}  # the lever did split
    assert got_l == base_l
    assert got_p.keys() == base_p.keys()
    for k in base_p:
        np.testing.assert_array_equal(got_p[k], base_p[k], err_msg=k)


def test_sessions_dropped_or_closed_with_a_split_step_prepared_free_their_buffers(
    gpu_device, levers
):
    if not device_limits(gpu_device).cpu:
        pytest.skip("host RSS shows device memory only on a CPU adapter (lavapipe)")
    levers(True, True)
    g = GraphBuilder()
    y = g.parameter("a", (1024, 2048)) @ g.parameter("b", (2048, 4))  # a: 8 MiB
    for i in range(39):
        y = F.tanh(y) if i % 2 == 0 else y * 0.5
    g.output("y", y)
    program = compile(g.build(), CompileOptions(fuse=False), limits=device_limits(gpu_device))
    ones = {"a": np.ones((1024, 2048), np.float32), "b": np.ones((2048, 4), np.float32)}
    before = None
    for i in range(18):
        sess = Session(program, gpu_device)
        assert len(sess._plan) == 40 and sess.submissions == 2
        sess.load_state_dict(ones)
        sess.run({})
        assert len(sess._ready) == 2
        if i % 2:
            sess.close()
        del sess
        gc.collect()
        if i == 1:
            before = _rss_mib()
    # 16 Sessions of 8 MiB each: pinned buffers would add ~128 MiB
    assert _rss_mib() - before < 48


class _Deep(Module):
    """Pre-norm residual GELU blocks: a training step of 32 to 80 dispatches at depth 3, so
    the default chunks (16, 64) split it."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.inp, self.out = Linear(12, 16), Linear(16, 4)
        for i in range(depth):
            setattr(self, f"block{i}", Linear(16, 16))

    def forward(self, x):
        h = self.inp(x)
        for i in range(self.depth):
            h = h + NF.gelu(getattr(self, f"block{i}")(NF.layer_norm(h, (16,))))
        return self.out(h)


def _train_default(levers, split: bool, steps: int = 4):
    levers(True, split)
    mn.manual_seed(9)
    tr = mn.Trainer(_Deep(3), mn.optim.AdamW(lr=1e-2), lambda m, x, y: NF.cross_entropy(m(x), y))
    rng = np.random.default_rng(13)
    losses = []
    for _ in range(steps):
        x = rng.standard_normal((6, 12)).astype(np.float32)
        losses.append(float(tr.step(x, rng.integers(0, 4, 6).astype(np.int32))))
    sess = next(iter(tr._cache.values())).entry.runner.session
    n, chunks = len(sess._plan), list(sess._chunks)
    params = {k: np.array(v) for k, v in tr.state_dict().items()}
    tr.close()
    return losses, params, n, chunks


def test_adamw_steps_split_at_the_default_chunks_equal_one_buffer(levers):
    base_l, base_p, n, base_c = _train_default(levers, False)
    got_l, got_p, n2, got_c = _train_default(levers, True)
    assert n == n2 and 32 <= n <= 80, f"resize _Deep: its step is {n} dispatches"
    assert base_c == [(0, n)] and got_c == [(0, 16), (16, n)]
    assert got_l == base_l
    assert got_p.keys() == base_p.keys()
    for k in base_p:
        np.testing.assert_array_equal(got_p[k], base_p[k], err_msg=k)
