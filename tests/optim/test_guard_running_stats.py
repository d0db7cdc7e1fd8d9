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


def _accumulated(kind: str):
    opts = CompileOptions(loss="loss", nonfinite_guard="raise")
    if kind == "stage":
        opts = CompileOptions(loss="loss", accumulate_grads=True, nonfinite_guard="raise")
    else:
        opts = CompileOptions(
            loss="loss", optimizer=SGD(lr=0.1), accumulation_steps=2, nonfinite_guard="raise"
        )
    return build_training_graph(_graph(), opts)


def test_accumulation_stages_and_commits_through_pending_copies():
    x = np.random.default_rng(2).standard_normal((16, 3)).astype(np.float32)
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    stage, commit = _accumulated("stage"), _accumulated("commit")
    (u,) = [n for n in stage.nodes if n.op == "batch_norm_update_stats_into"]
    names = [stage[i].name for i in u.inputs[1:5]]
    assert names == [*STATS, "bn.running_mean.pending", "bn.running_var.pending"]
    (c,) = [n for n in commit.nodes if n.op == "batch_norm_update_stats_into"]
    assert [commit[i].name for i in c.inputs[1:5]] == names[2:] + names[:2]
    assert commit[c.inputs[6]].op == "guard_clip"
    assert not _updates(stage) and not _updates(commit)
    for g, into in ((stage, u), (commit, c)):  # the statistics come from the forward
        stats = g[into.inputs[0]]
        first_backward = min(n.id for n in g.nodes if n.op.endswith("_backward"))
        assert stats.op == "batch_norm_stats" and stats.id < first_backward

    def run(g, xs, state, first=1.0):
        feeds = {"x": xs, "accum.first": np.float32(first)}
        feeds["optim.hyper"] = np.array([0.1, 1.0], np.float32)
        feeds["guard.reset"] = np.float32(1.0)
        return interpret(g, feeds, {"w": w}, state)[2]

    state = run(stage, x[:8], dict(STATS))
    assert all(np.array_equal(state[k], STATS[k]) for k in STATS)  # only the copies change
    state = run(commit, x[8:], state)
    ref = dict(STATS)  # torch: one update per forward, in order
    for xs in (x[:8], x[8:]):
        ref = run(_train(None), xs, ref)
    for k in STATS:
        np.testing.assert_allclose(state[k], ref[k], rtol=1e-6)
    bad = x[8:].copy()
    bad[0, 0] = np.nan
    staged = run(stage, x[:8], dict(STATS))
    kept = run(commit, bad, staged)
    for k in STATS:  # a skipped step commits nothing
        np.testing.assert_array_equal(kept[k].view(np.uint32), STATS[k].view(np.uint32))
