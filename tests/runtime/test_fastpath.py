"""The runtime's native fast path (runtime/fastpath.py): the same results as NumPy whether a step
is encoded on one thread, split over several command buffers, or through wgpu-py's public API."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from meganeura.compile import CompileOptions
from meganeura.runtime import fastpath
from meganeura.training import compile_for

pytestmark = pytest.mark.gpu

STEPS = 37  # an odd count, so chunks have unequal lengths


def _chain():
    """x -> alternately * 1.5 and + 0.25, STEPS times, unfused: STEPS dispatches in order (any
    reordering or dropped dispatch changes the result)."""
    g = mn.GraphBuilder()
    x = g.input("x", (257,))
    y = x
    for i in range(STEPS):
        y = y * 1.5 if i % 2 == 0 else y + 0.25
    g.output("y", y)
    return g.build()


def _reference(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float32)
    for i in range(STEPS):
        y = y * np.float32(1.5) if i % 2 == 0 else y + np.float32(0.25)
    return y


def _run(threads: int | None, monkeypatch) -> tuple[np.ndarray, int]:
    if threads is not None:
        monkeypatch.setattr(fastpath, "MIN_CHUNK", 4)
        monkeypatch.setattr(fastpath, "RECORD_THREADS", threads)
    program, sess = compile_for(_chain(), CompileOptions(fuse=False))
    assert len(program.dispatches) == STEPS
    x = np.random.default_rng(0).uniform(-1, 1, 257).astype(np.float32)
    outs = [sess.run({"x": x * k}, fetch="y")["y"] for k in (1.0, -2.0)]
    sess.synchronize()
    np.testing.assert_allclose(outs[0], _reference(x), rtol=1e-6)
    np.testing.assert_allclose(outs[1], _reference(-2.0 * x), rtol=1e-6)
    return outs[0], len(sess._plan.chunks)


def test_one_command_buffer(monkeypatch):
    _, chunks = _run(1, monkeypatch)
    assert chunks == 1


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_split_over_threads(threads, monkeypatch):
    _, chunks = _run(threads, monkeypatch)
    assert chunks == min(threads, STEPS // 4)


def test_public_api_fallback(monkeypatch):
    monkeypatch.setattr(fastpath, "AVAILABLE", False)
    _run(3, monkeypatch)


@pytest.mark.parametrize(
    "n, threads, min_chunk, want",
    [
        (0, 4, 256, ((0, 0),)),
        (511, 4, 256, ((0, 511),)),
        (512, 4, 256, ((0, 256), (256, 512))),
        (1000, 4, 256, ((0, 333), (333, 666), (666, 1000))),
        (1000, 1, 4, ((0, 1000),)),
        (10, 3, 1, ((0, 3), (3, 6), (6, 10))),
    ],
)
def test_chunk_bounds(n, threads, min_chunk, want):
    got = fastpath.chunk_bounds(n, threads, min_chunk)
    assert got == want
    assert all(b - a >= min_chunk for a, b in got) or len(got) == 1
