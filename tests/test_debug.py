"""``meganeura.debug.find_nonfinite``: the first non-finite value of a program, its IR line,
its storage dtype, and whether f16 storage overflowed (issue 11, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from meganeura.compile import CompileOptions
from meganeura.debug import find_nonfinite
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.optim import SGD

pytestmark = pytest.mark.gpu
EYE = {"w": np.eye(8, dtype=np.float32)}


def _log_graph():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    h = x @ b.parameter("w", (8, 8))
    lg = F.log(h - 1.0)  # NaN where h < 1
    b.output("loss", F.sum(lg * 2.0))
    return b.build(), lg.node.id


def _scaled_graph():
    """relu(x @ w) * 200: an activation of 500 becomes 100000, past f16's range, although
    its degree (one activation times a constant below 256) says it fits."""
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    h = F.relu(x @ b.parameter("w", (8, 8))) * 200.0
    b.output("loss", F.sum(F.tanh(h)))
    return b.build(), h.node.id


@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_nan_from_a_log_of_a_negative(gpu_device, precision):
    g, log = _log_graph()
    x = np.full((4, 8), 0.5, np.float32)
    x[1:, :] = 3.0  # the first row holds the NaNs: 8 of 32
    found = find_nonfinite(g, {"x": x}, CompileOptions(precision=precision), EYE, device=gpu_device)
    assert found is not None and found.node == log and found.op == "log"
    assert (found.nan, found.posinf, found.neginf, found.numel) == (8, 0, 0, 32)
    assert not found.overflow
    assert found.line.startswith(f"%{log}: ") and "= log %" in found.line
    assert found.loc.startswith("test_debug.py:")
    want = "f16" if precision == "fast" and "shader-f16" in gpu_device.features else "f32"
    assert found.dtype == want and f"stored {want}" in str(found)


def test_finite_program_gives_none(gpu_device):
    g, _ = _log_graph()
    x = np.full((4, 8), 3.0, np.float32)
    for precision in ("strict", "fast"):
        assert find_nonfinite(g, {"x": x}, CompileOptions(precision=precision), EYE) is None


def test_f16_overflow_is_named_and_strict_is_finite(gpu_device):
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    g, scaled = _scaled_graph()
    x = np.full((4, 8), 500.0, np.float32)
    x[0, 0] = 1.0
    fast = CompileOptions(precision="fast")
    found = find_nonfinite(g, {"x": x}, fast, EYE, device=gpu_device)
    assert found is not None and found.node == scaled and found.dtype == "f16"
    assert found.posinf == 31 and found.overflow and found.f32_max_abs == 100000.0
    assert "f16 overflow" in str(found)
    # the same step, trained: the forward value is still the first
    train = CompileOptions(precision="fast", loss="loss", optimizer=SGD(lr=0.1))
    assert find_nonfinite(g, {"x": x}, train, EYE, device=gpu_device).node == scaled
    strict = CompileOptions(precision="strict")
    assert find_nonfinite(g, {"x": x}, strict, EYE, device=gpu_device) is None


def test_first_non_finite_in_the_backward_pass(gpu_device):
    """sqrt(relu(h)) is finite at 0, its gradient 1 / (2 sqrt(0)) is not: the report names
    a backward value, after every forward value."""
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    h = x @ b.parameter("w", (8, 8))
    b.output("loss", F.sum(F.sqrt(F.relu(h))))
    g = b.build()
    x = np.ones((4, 8), np.float32)
    x[2, 3] = -1.0
    opts = CompileOptions(loss="loss", optimizer=SGD(lr=0.1))
    found = find_nonfinite(g, {"x": x}, opts, EYE, device=gpu_device)
    assert found is not None and found.node >= len(g.nodes)  # a gradient
    assert found.op == "div" and (found.posinf, found.nan) == (1, 0)  # g / (2 sqrt(h))
    assert found.dtype == "f32" and not found.overflow


def test_a_non_finite_feed_is_reported_as_the_input(gpu_device):
    g, _ = _log_graph()
    x = np.full((4, 8), 3.0, np.float32)
    x[0, 1] = np.inf
    found = find_nonfinite(g, {"x": x}, CompileOptions(precision="fast"), EYE, device=gpu_device)
    assert found.op == "input" and found.node == 0 and found.posinf == 1


def test_a_module_graph_with_its_state_dict(gpu_device):
    """Through a module (``nn.trace``, the options ``mn.compile(model, precision="fast")``
    uses): a Linear whose output passes 65504 although its input and weights fit."""
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    model = mn.nn.Sequential(mn.nn.Linear(8, 8), mn.nn.Tanh())
    weights = {"0.weight": np.eye(8, dtype=np.float32) * 200, "0.bias": np.zeros(8, np.float32)}
    model.load_state_dict(weights)
    x = np.full((2, 8), 500.0, np.float32)
    graph = mn.nn.trace(model, x)
    opts = CompileOptions(precision="fast", shared_parameters=True)
    found = find_nonfinite(graph, {graph.leaves("input")[0].name: x}, opts, model.state_dict())
    assert found is not None and found.dtype == "f16" and found.overflow
    assert found.f32_max_abs == 100000.0 and found.posinf == 16
