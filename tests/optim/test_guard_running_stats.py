"""The guard's rewrite of BatchNorm's running-statistics updates (``optim.guard.
defer_update_stats``; issue 11 item 3), on the graph and the NumPy interpreter (no GPU): a
guarded training graph updates the running statistics after the guard's decision and not at
all when it trips; a graph without the guard is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura.nn.functional as F
from meganeura.compile import CompileOptions, build_training_graph
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.optim import SGD

STATS = {"bn.running_mean": np.full(4, 0.5, np.float32), "bn.running_var": np.ones(4, np.float32)}


def _graph(read_stats_after: bool = False):
    b = GraphBuilder()
    x = b.input("x", (8, 3))
    w = b.parameter("w", (3, 4))
    rm, rv = b.state("bn.running_mean", (4,)), b.state("bn.running_var", (4,))
    y = F.batch_norm(x @ w, rm, rv, training=True)
    loss = F.mean(y * y)
    if read_stats_after:  # a hand-built graph that uses the new statistics in the same step
        loss = loss + F.sum(rm)
    b.output("loss", loss)
    return b.build()


def _train(guard: str | None, read_stats_after: bool = False):
    opts = CompileOptions(loss="loss", optimizer=SGD(lr=0.1), nonfinite_guard=guard)
    return build_training_graph(_graph(read_stats_after), opts)


def _updates(g):
    return [n for n in g.nodes if n.op == "batch_norm_update_stats"]


def _run(g, x):
    r = np.random.default_rng(0)
    w = r.standard_normal((3, 4)).astype(np.float32)
    feeds = {"x": x, "optim.hyper": np.array([0.1, 1.0], np.float32)}
    for n in g.leaves("input"):
        feeds.setdefault(n.name, np.zeros(n.type.shape, np.float32))
    _, params, state = interpret(g, feeds, {"w": w}, dict(STATS))
    return params, state


def test_without_the_guard_the_update_stays_in_the_forward():
    (u,) = _updates(_train(None))
    assert len(u.inputs) == 3
    first_backward = min(n.id for n in _train(None).nodes if n.op.endswith("_backward"))
    assert u.id < first_backward


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_the_guard_moves_the_update_after_its_decision(mode):
    g = _train(mode)
    (u,) = _updates(g)
    (clip,) = [n for n in g.nodes if n.op == "guard_clip"]
    assert len(u.inputs) == 4 and u.inputs[3] == clip.id and u.id > clip.id
    assert u.id > max(n.id for n in g.nodes if n.op.endswith("_backward"))


def test_a_tripped_guard_keeps_the_running_statistics():
    x = np.random.default_rng(1).standard_normal((8, 3)).astype(np.float32)
    params, state = _run(_train("raise"), x)
    params0, state0 = _run(_train(None), x)
    for k in STATS:  # a good step: the same update as without the guard
        np.testing.assert_array_equal(state[k], state0[k])
        assert not np.array_equal(state[k], STATS[k])
    x[2, 1] = np.nan
    params, state = _run(_train("raise"), x)
    for k in STATS:
        np.testing.assert_array_equal(state[k].view(np.uint32), STATS[k].view(np.uint32))
    assert np.isfinite(params["w"]).all()


def test_an_update_whose_statistics_are_read_later_stays():
    (u,) = _updates(_train("raise", read_stats_after=True))
    assert len(u.inputs) == 3
