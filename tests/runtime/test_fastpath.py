"""The runtime's native fast path (runtime/fastpath.py): the same results as NumPy through the
native calls and through wgpu-py's public API."""

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


def _run(monkeypatch=None) -> np.ndarray:
    program, sess = compile_for(_chain(), CompileOptions(fuse=False))
    assert len(program.dispatches) == STEPS
    x = np.random.default_rng(0).uniform(-1, 1, 257).astype(np.float32)
    outs = [sess.run({"x": x * k}, fetch="y")["y"] for k in (1.0, -2.0)]
    sess.synchronize()
    np.testing.assert_allclose(outs[0], _reference(x), rtol=1e-6)
    np.testing.assert_allclose(outs[1], _reference(-2.0 * x), rtol=1e-6)
    return outs[0]


def test_native_calls():
    assert fastpath.AVAILABLE  # wgpu-py 0.32 as pinned; a layout change must be noticed
    _run()


def test_public_api_fallback(monkeypatch):
    native = _run()
    monkeypatch.setattr(fastpath, "AVAILABLE", False)
    np.testing.assert_array_equal(_run(), native)
