"""``verify`` rejects hand-made graphs that break an IR invariant (no GPU)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from meganeura.dtypes import f32, i32
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.ir import Graph, Node, TensorType, make_attrs
from meganeura.graph.verify import GraphError, verify

T3 = TensorType((3,), f32)


def _x() -> Node:
    return Node(0, "input", (), (), T3, "x")


def test_valid_hand_made_graph_passes():
    g = Graph((_x(), Node(1, "neg", (0,), (), T3)), (("y", 1),))
    verify(g)


def test_forward_reference_is_a_cycle():
    # %1 reads %2 and %2 reads %1: a cycle, which list order cannot express.
    g = Graph((_x(), Node(1, "add", (0, 2), (), T3), Node(2, "neg", (1,), (), T3)), (("y", 2),))
    with pytest.raises(GraphError, match=r"%1 reads %2, a cycle or forward reference"):
        verify(g)


def test_self_reference():
    g = Graph((_x(), Node(1, "add", (0, 1), (), T3)), (("y", 1),))
    with pytest.raises(GraphError, match=r"%1 reads %1, a cycle"):
        verify(g)


def test_negative_operand_id():
    g = Graph((_x(), Node(1, "neg", (-1,), (), T3)), (("y", 1),))
    with pytest.raises(GraphError, match="invalid id"):
        verify(g)


def test_id_must_equal_position():
    g = Graph((_x(), Node(2, "neg", (0,), (), T3)), (("y", 1),))
    with pytest.raises(GraphError, match="position 1 has id 2"):
        verify(g)


def test_unused_input_is_named():
    b = GraphBuilder()
    x = b.input("x", (3,))
    line = sys._getframe().f_lineno + 1
    b.input("forgotten", (4, 2), i32)
    b.output("y", -x)
    with pytest.raises(GraphError) as ei:
        b.build()
    msg = str(ei.value)
    assert "input 'forgotten'" in msg
    assert "i32[4,2]" in msg
    assert f"test_verify.py:{line}" in msg
    assert "never used" in msg
    # Passes that append to a graph may leave inputs unused on purpose.
    g = b.build_unverified()
    verify(g, allow_unused_inputs=True)


def test_input_used_only_as_output_counts_as_used():
    b = GraphBuilder()
    x = b.input("x", (3,))
    b.output("x", x)
    assert b.build().outputs == (("x", 0),)


def test_stored_type_disagrees_with_rule():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    w = b.parameter("w", (3, 4))
    b.output("y", x @ w)
    g = b.build()
    bad = dataclasses.replace(g.nodes[2], type=TensorType((2, 5), f32))
    g2 = Graph(g.nodes[:2] + (bad,), g.outputs)
    with pytest.raises(GraphError) as ei:
        verify(g2)
    msg = str(ei.value)
    assert "stored type f32[2,5] != inferred f32[2,4]" in msg
    assert "%2: f32[2,5] = matmul %0, %1" in msg  # the node, as the printer shows it


def test_stored_dtype_disagrees_with_rule():
    g = Graph((_x(), Node(1, "neg", (0,), (), TensorType((3,), i32))), (("y", 1),))
    with pytest.raises(GraphError, match=r"stored type i32\[3\] != inferred f32\[3\]"):
        verify(g)


def test_ill_typed_node():
    g = Graph(
        (_x(), Node(1, "reshape", (0,), make_attrs({"shape": (2, 2)}), TensorType((2, 2), f32))),
        (("y", 1),),
    )
    with pytest.raises(GraphError, match="ill-typed node"):
        verify(g)


def test_unknown_op():
    g = Graph((_x(), Node(1, "frobnicate", (0,), (), T3)), (("y", 1),))
    with pytest.raises(GraphError, match="unknown op"):
        verify(g)


def test_duplicate_leaf_names():
    g = Graph(
        (_x(), Node(1, "parameter", (), (), T3, "x"), Node(2, "add", (0, 1), (), T3)), (("y", 2),)
    )
    with pytest.raises(GraphError, match=r"name 'x' used by %0 and %1"):
        verify(g)


def test_leaf_with_operands():
    g = Graph((_x(), Node(1, "parameter", (0,), (), T3, "p")), (("y", 1),))
    with pytest.raises(GraphError, match="leaf with operands"):
        verify(g)


def test_output_to_missing_node():
    g = Graph((_x(), Node(1, "neg", (0,), (), T3)), (("y", 1), ("z", 7)))
    with pytest.raises(GraphError, match=r"output 'z' refers to missing node %7"):
        verify(g)


def test_node_missing_attributes_is_a_graph_error():
    g = Graph((_x(), Node(1, "sum", (0,), (), TensorType((), f32))), (("y", 1),))
    with pytest.raises(GraphError, match="sum"):
        verify(g)


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param(
            (_x(), Node(1, "add", (0, 2), (), T3), Node(2, "neg", (1,), (), T3)), id="cycle"
        ),
        pytest.param((_x(), Node(1, "add", (0, 1), (), T3)), id="self_loop"),
        pytest.param((_x(), Node(1, "neg", (0,), (), TensorType((4,), f32))), id="mis_typed"),
    ],
)
def test_compile_verifies_its_input(nodes):
    """compile used to take such graphs as they came: a KeyError, or a wrong result for a
    mis-typed node (issue 11, item 7)."""
    from meganeura.compile import compile

    with pytest.raises(GraphError):
        compile(Graph(nodes, (("y", len(nodes) - 1),)))
