"""What ``compile`` and the Trainer say about what the user wrote (issue 10, item 6): a loss
the graph does not have is "no output named 'loss'" with the outputs it does have, raised
before any device is touched; the host-side range check of an index input is worded by the
op the user called to read it (no GPU)."""

from __future__ import annotations

import sys

import pytest

import meganeura.nn.functional as F
from meganeura.compile import CompileOptions, build_training_graph, compile
from meganeura.dtypes import i32
from meganeura.graph.builder import GraphBuilder
from meganeura.optim import SGD
from meganeura.training import Trainer


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def _graph_without_a_loss_output():
    """A classifier whose scalar loss is an output named 'ce', beside 'logits'."""
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    y = b.input("y", (4,), i32)
    w = b.parameter("fc.weight", (3, 8))
    logits = F.linear(x, w)
    b.output("ce", F.cross_entropy(logits, y))
    b.output("logits", logits)
    return b.build()


MISSING = "loss 'loss': no output named 'loss'; the graph's outputs are 'ce', 'logits'"


@pytest.mark.parametrize(
    "train",
    [
        lambda g: compile(g, CompileOptions(loss="loss", optimizer=SGD())),
        lambda g: build_training_graph(g, CompileOptions(loss="loss", optimizer=SGD())),
        lambda g: Trainer(g, SGD()),  # loss="loss" is the Trainer's default
    ],
    ids=["compile", "build_training_graph", "trainer"],
)
def test_a_missing_loss_output_is_named_and_the_outputs_listed(train):
    # It was KeyError: "graph has no leaf named 'loss'", which speaks of leaves, not of the
    # output the user was asked to name; the Trainer said so only after opening a device.
    graph = _graph_without_a_loss_output()
    with pytest.raises(ValueError) as ei:
        train(graph)
    msg = str(ei.value)
    assert msg.startswith(MISSING), msg
    assert "GraphBuilder.output('loss', ...)" in msg and "loss=<one of them>" in msg


def test_compile_takes_the_loss_from_the_outputs_only():
    # differentiate also takes leaf names; compile's loss is an output name (CompileOptions).
    graph = _graph_without_a_loss_output()
    with pytest.raises(ValueError, match="loss 'x': no output named 'x'; .* 'ce', 'logits'"):
        compile(graph, CompileOptions(loss="x", optimizer=SGD()))


def test_a_graph_without_outputs_says_so():
    b = GraphBuilder()
    F.sum(b.parameter("w", (3,)))
    with pytest.raises(ValueError, match="no output named 'loss'; the graph's outputs are none"):
        compile(b.build(), CompileOptions(loss="loss", optimizer=SGD()))


def test_a_non_scalar_loss_output_is_named_with_a_hint():
    graph = _graph_without_a_loss_output()
    with pytest.raises(ValueError) as ei:
        compile(graph, CompileOptions(loss="logits", optimizer=SGD()))
    msg = str(ei.value)
    assert "loss must be a floating scalar, got 'logits' (%" in msg, msg
    assert "f32[4,3]" in msg and ".sum() or .mean()" in msg, msg


# ---- index range checks are worded by the op reading the index ----------------------------------
def test_each_index_check_is_worded_by_its_reader():
    # An embedding lowers to index_select: its check said "class index" and "index_select".
    b = GraphBuilder()
    ids = b.input("ids", (2, 3), i32)
    y = b.input("y", (6,), i32)
    sel = b.input("sel", (2,), i32)
    g = b.input("g", (6, 1), i32)
    emb_line = _line() + 1
    h = F.reshape(F.embedding(ids, b.parameter("emb", (5, 4))), (6, 4))
    logits = F.linear(h, b.parameter("w", (10, 4)))
    loss = F.cross_entropy(logits, y) + F.sum(F.index_select(logits, 0, sel))
    b.output("loss", loss + F.sum(F.gather(logits, 1, g)))
    program = compile(b.build(), CompileOptions(loss="loss", optimizer=SGD()))
    checks = {lc.name: lc for lc in program.label_checks}
    assert {k: (v.what, v.num_classes) for k, v in checks.items()} == {
        "ids": ("token id", 5),
        "y": ("class index", 10),
        "sel": ("index", 6),
        "g": ("index", 10),
    }
    assert checks["ids"].consumer.startswith("embedding %")
    assert checks["ids"].consumer.endswith(f" at test_compile.py:{emb_line}")
    assert checks["y"].consumer.startswith("cross_entropy %")
    assert checks["sel"].consumer.startswith("index_select %")
    assert checks["g"].consumer.startswith("gather %")
