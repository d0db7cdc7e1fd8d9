"""Dead-code and common-subexpression elimination: what they remove, what they keep, and
that the interpreted results do not change (no GPU)."""

from __future__ import annotations

import numpy as np

from meganeura.compile import CompileOptions, build_training_graph
from meganeura.dtypes import i32
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.graph.ir import Graph
from meganeura.graph.verify import verify
from meganeura.ops import functional as F
from meganeura.optim import HYPER_INPUT, Adam
from meganeura.passes import cse, dce

RNG = np.random.default_rng(0)
XV = RNG.standard_normal((3, 4)).astype(np.float32)
YV = RNG.standard_normal((3, 4)).astype(np.float32)
WV = RNG.standard_normal((4, 2)).astype(np.float32)


def _ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes]


def _outputs(g: Graph, feed, params=None) -> dict[str, np.ndarray]:
    vals, _, _ = interpret(g, feed, params)
    return {k: vals[v] for k, v in g.outputs}


def test_dce_removes_dead_nodes_and_keeps_inputs():
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    unused_input = b.input("z", (5,))
    w = b.parameter("w", (4, 2))
    dead_param = b.parameter("dead", (4,))
    _ = F.exp(x) + dead_param  # dead: reaches no output
    _ = F.sum(unused_input)  # dead, but the input it reads stays
    y = F.tanh(x @ w)
    b.output("y", y)
    g = b.build()
    assert len(g) == 9
    g2, ids = dce(g)
    verify(g2, allow_unused_inputs=True)  # z is kept on purpose, now unread
    assert _ops(g2) == ["input", "input", "parameter", "matmul", "tanh"]
    assert [n.name for n in g2.nodes[:3]] == ["x", "z", "w"]
    assert ids[y.id] == 4 and g2.output_dict == {"y": 4}
    assert ids[x.id] == 0 and ids[unused_input.id] == 1 and ids[w.id] == 2
    assert dead_param.id not in ids
    for i, n in enumerate(g2.nodes):
        assert n.id == i
    feed = {"x": XV, "z": np.zeros(5, np.float32)}
    want = _outputs(g, feed, {"w": WV, "dead": np.zeros(4, np.float32)})
    got = _outputs(g2, feed, {"w": WV})
    np.testing.assert_array_equal(got["y"], want["y"])


def test_dce_keeps_effects():
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    y = b.input("y", (3,), i32)
    w = b.parameter("w", (4, 2))
    b.output("loss", F.cross_entropy(x @ w, y))
    opt = Adam(lr=0.1)
    g = build_training_graph(b.build(), CompileOptions(loss="loss", optimizer=opt))
    g2, _ = dce(g)
    assert _ops(g2).count("adam_update") == 1
    assert len(g2) <= len(g)
    feed = {"x": XV, "y": np.array([0, 1, 1], np.int32), HYPER_INPUT: opt.hyper(0, opt.lr)}
    _, p1, s1 = interpret(g, feed, {"w": WV})
    _, p2, s2 = interpret(g2, feed, {"w": WV})
    assert not np.array_equal(p1["w"], WV)
    np.testing.assert_array_equal(p1["w"], p2["w"])
    assert s1.keys() == s2.keys() == {"w.exp_avg", "w.exp_avg_sq"}
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k])


def test_cse_merges_duplicates():
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    y = b.input("y", (3, 4))
    p1 = x * y
    p2 = x * y  # the same product again
    q = y * x  # operands swapped: a different node, kept
    e1, e2 = F.exp(p1), F.exp(p2)  # equal only once p1 and p2 are merged
    s1 = F.sum(e1, 1)
    s2 = F.sum(e2, 0)  # different attrs: kept
    b.output("a", e1 + e2 + q)
    b.output("b", s1)
    b.output("c", s2)
    g = b.build()
    g2, ids = cse(g)
    verify(g2)
    assert ids[p1.id] == ids[p2.id]
    assert ids[e1.id] == ids[e2.id]
    assert ids[q.id] != ids[p1.id]
    assert ids[s1.id] != ids[s2.id]
    assert _ops(g2).count("mul") == 2
    assert _ops(g2).count("exp") == 1
    assert len(g2) == len(g) - 2
    added = g2.nodes[g2.output_dict["a"]]
    assert added.op == "add"
    assert g2.nodes[added.inputs[0]].inputs == (ids[e1.id], ids[e1.id])  # exp(p) + exp(p)
    feed = {"x": XV, "y": YV}
    want, got = _outputs(g, feed), _outputs(g2, feed)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_cse_merges_constants_of_an_extended_graph_but_not_leaves():
    b = GraphBuilder()
    x = b.input("x", (3,))
    x2 = b.input("x2", (3,))  # same type as x, but a distinct leaf
    m1 = x * 2.0
    b.output("a", m1 + x2)
    b2 = GraphBuilder(b.build())  # a fresh builder does not know the first 2.0
    b2.output("b", b2.tensor(x.id) * 2.0)
    g = b2.build()
    assert _ops(g).count("constant") == 2
    g2, ids = cse(g)
    assert _ops(g2).count("constant") == 1
    assert _ops(g2).count("mul") == 1
    assert _ops(g2).count("input") == 2
    assert g2.output_dict["b"] == ids[m1.id]  # b is the shared x * 2.0
    feed = {"x": XV[0, :3], "x2": YV[0, :3]}
    want, got = _outputs(g, feed), _outputs(g2, feed)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_cse_then_dce_on_a_training_graph_keeps_results():
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    w = b.parameter("w", (4, 2))
    h = x @ w
    b.output("loss", F.mean(h * h) + F.mean(h * h))
    opt = Adam(lr=0.1)
    g = build_training_graph(
        b.build(), CompileOptions(loss="loss", optimizer=opt, max_grad_norm=1.0)
    )
    g2, _ = dce(cse(g)[0])
    verify(g2, allow_unused_inputs=True)
    assert len(g2) < len(g)
    feed = {"x": XV, HYPER_INPUT: opt.hyper(0, opt.lr)}
    v1, p1, _ = interpret(g, feed, {"w": WV})
    v2, p2, _ = interpret(g2, feed, {"w": WV})
    np.testing.assert_array_equal(p1["w"], p2["w"])
    for k, v in g.outputs:
        np.testing.assert_array_equal(v2[g2.output_dict[k]], v1[v])


def test_fold_permutes_composes_and_cancels():
    import numpy as np

    from meganeura.graph.builder import GraphBuilder
    from meganeura.graph.interpret import interpret
    from meganeura.ops import functional as F
    from meganeura.passes import dce, fold_permutes

    b = GraphBuilder()
    x = b.input("x", (2, 3, 4))
    twice = F.permute(F.permute(x, (1, 0, 2)), (1, 0, 2))  # identity
    chained = F.permute(F.permute(x, (2, 0, 1)), (0, 2, 1))  # one permute of x
    b.output("a", twice * 2.0)
    b.output("b", chained)
    g = b.build()
    folded, _ = dce(fold_permutes(g)[0])
    perms = [n for n in folded.nodes if n.op == "permute"]
    assert len(perms) == 1 and perms[0].inputs == (0,)
    assert perms[0].attr("dims") == (2, 1, 0)
    xs = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}
    want, _, _ = interpret(g, xs)
    got, _, _ = interpret(folded, xs)
    for name in ("a", "b"):
        assert np.array_equal(got[folded.output_dict[name]], want[g.output_dict[name]])


def test_fold_permutes_turns_unit_dim_moves_into_reshapes():
    import numpy as np

    from meganeura.graph.builder import GraphBuilder
    from meganeura.graph.interpret import interpret
    from meganeura.ops import functional as F
    from meganeura.passes import fold_permutes

    b = GraphBuilder()
    x = b.input("x", (2, 1, 3, 4))  # a one-token decode step's [B, S, H, D]
    b.output("view", F.permute(x, (0, 2, 1, 3)) * 2.0)  # only the size-1 dim moves
    b.output("copy", F.permute(x, (0, 1, 3, 2)))  # 3 and 4 swap: a real permute
    g = b.build()
    folded, _ = fold_permutes(g)
    ops = {name: folded.nodes[folded.output_dict[name]] for name in ("view", "copy")}
    view_src = folded.nodes[ops["view"].inputs[0]]
    assert view_src.op == "reshape" and view_src.type.shape == (2, 3, 1, 4)
    assert ops["copy"].op == "permute"
    xs = {"x": np.arange(24, dtype=np.float32).reshape(2, 1, 3, 4)}
    want, _, _ = interpret(g, xs)
    got, _, _ = interpret(folded, xs)
    for name in ("view", "copy"):
        assert np.array_equal(got[folded.output_dict[name]], want[g.output_dict[name]])
