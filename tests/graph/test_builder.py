"""The builder's type checking: errors name the op, every operand's printed type and the
caller's ``file:line``; the broadcasting rule of ``add`` agrees with NumPy (no GPU)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meganeura.dtypes import bool_, f32, i32
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.ops import functional as F

from ..ids import shape_id

FILE = "test_builder.py"


def _line() -> int:
    """The caller's line number (so a test can name the line its next statement is on)."""
    return sys._getframe(1).f_lineno


def _assert_names(err: BaseException, op: str, operands: list[str], line: int) -> str:
    msg = str(err)
    assert msg.startswith(f"{op}("), msg
    for operand in operands:
        assert operand in msg, msg
    assert f"at {FILE}:{line}:" in msg, msg
    return msg


def test_matmul_inner_dim_mismatch():
    b = GraphBuilder()
    x = b.input("x", (64, 784))
    w = b.parameter("w", (10, 785))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        _ = x @ w.T
    msg = _assert_names(ei.value, "matmul", ["%0: f32[64,784]", "%2: f32[785,10]"], line)
    assert "inner dimensions differ: 784 vs 785" in msg


def test_broadcast_failure():
    b = GraphBuilder()
    x = b.input("x", (4, 3))
    y = b.input("y", (5,))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        _ = x + y
    msg = _assert_names(ei.value, "add", ["%0: f32[4,3]", "%1: f32[5]"], line)
    assert "do not broadcast" in msg


def test_broadcast_failure_through_functional_api():
    # The reported line is the test's, not functional.py's.
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    y = b.input("y", (2, 4))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.maximum(x, y)
    _assert_names(ei.value, "maximum", ["%0: f32[2,3]", "%1: f32[2,4]"], line)


def test_dtype_mismatch():
    # IR ops take one dtype; the operators promote first (tests/graph/test_promotion.py)
    b = GraphBuilder()
    x = b.input("x", (3,))
    k = b.input("k", (3,), i32)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        b.add("mul", [x, k])
    msg = _assert_names(ei.value, "mul", ["%0: f32[3]", "%1: i32[3]"], line)
    assert "dtype mismatch" in msg
    y = x * k
    assert y.dtype is f32 and y.node.op == "mul" and b.nodes[y.node.inputs[1]].op == "cast"


def test_bool_arithmetic_rejected():
    b = GraphBuilder()
    m = b.input("m", (3,), bool_)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        b.add("add", [m, m])
    _assert_names(ei.value, "add", ["%0: bool[3]", "%0: bool[3]"], line)


def test_cross_entropy_float_targets():
    b = GraphBuilder()
    logits = b.input("logits", (8, 10))
    target = b.input("target", (8,))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.cross_entropy(logits, target)
    msg = _assert_names(ei.value, "cross_entropy", ["%0: f32[8,10]", "%1: f32[8]"], line)
    assert "i32[8]" in msg
    assert "reduction='mean'" in msg


def test_cross_entropy_target_length():
    b = GraphBuilder()
    logits = b.input("logits", (8, 10))
    target = b.input("target", (7,), i32)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.cross_entropy(logits, target)
    _assert_names(ei.value, "cross_entropy", ["%0: f32[8,10]", "%1: i32[7]"], line)


@pytest.mark.parametrize("op", [F.sum, F.mean, F.amax], ids=lambda f: f.__name__)
def test_reduction_over_empty_dim(op):
    b = GraphBuilder()
    x = b.input("x", (3, 0, 2))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        op(x, 1)
    msg = _assert_names(ei.value, op.__name__, ["%0: f32[3,0,2]"], line)
    assert "zero elements" in msg


def test_reduction_over_nonempty_dims_of_a_tensor_with_an_empty_dim_is_fine():
    b = GraphBuilder()
    x = b.input("x", (3, 0, 2))
    assert F.sum(x, 2).shape == (3, 0)
    assert F.sum(x, (0, 2), keepdim=True).shape == (1, 0, 1)


def test_duplicate_leaf_names():
    b = GraphBuilder()
    line = _line() + 1
    b.input("x", (2,))
    with pytest.raises(ValueError) as ei:
        b.parameter("x", (3,))
    msg = str(ei.value)
    assert "'x'" in msg
    assert f"%0 (input, {FILE}:{line})" in msg  # where the first one was declared


def test_duplicate_leaf_name_error_names_the_callers_line():
    b = GraphBuilder()
    b.input("x", (2,))
    with pytest.raises(ValueError) as ei:
        line = _line() + 1
        b.state("x", (3,))
    assert f"{FILE}:{line}" in str(ei.value)


@pytest.mark.parametrize("shape", [(3, 3), (9,), (2, 2, 3)], ids=shape_id)
def test_reshape_wrong_element_count(shape):
    b = GraphBuilder()
    x = b.input("x", (2, 4))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        x.reshape(shape)
    msg = _assert_names(ei.value, "reshape", ["%0: f32[2,4]"], line)
    assert f"shape={tuple(shape)!r}" in msg
    assert "8 elements" in msg


def test_reshape_infers_minus_one():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4))
    assert F.reshape(x, (-1, 4)).shape == (6, 4)
    with pytest.raises(GraphTypeError, match=r"reshape\(%0: f32\[2,3,4\], shape=\(-1, 5\)\)"):
        F.reshape(x, (-1, 5))


def test_operand_from_another_graph():
    b1, b2 = GraphBuilder(), GraphBuilder()
    x = b1.input("x", (2,))
    y = b2.input("y", (2,))
    with pytest.raises(GraphTypeError, match="another graph"):
        _ = x + y


def test_successful_ops_record_types_and_location():
    b = GraphBuilder()
    a = b.input("a", (3, 1, 2, 4))
    w = b.input("w", (1, 5, 4, 6))
    line = _line() + 1
    y = a @ w
    assert y.type.shape == (3, 5, 2, 6)
    assert y.dtype is f32
    assert y.node.loc == f"{FILE}:{line}"
    z = F.softmax(y, dim=-2)
    assert z.node.attr("dim") == 2


# ---- broadcasting agrees with NumPy ---------------------------------------------------------
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(shapes, shapes)
def test_add_broadcasting_matches_numpy(sa, sb):
    b = GraphBuilder()
    x = b.input("x", sa)
    y = b.input("y", sb)
    try:
        expected = np.broadcast_shapes(sa, sb)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(GraphTypeError) as ei:
            _ = x + y
        msg = str(ei.value)
        assert f"%0: f32[{','.join(map(str, sa))}]" in msg
        assert f"%1: f32[{','.join(map(str, sb))}]" in msg
        return
    z = x + y
    assert z.shape == expected
    b.output("z", z)
    rng = np.random.default_rng(0)
    xv = rng.standard_normal(sa).astype(np.float32)
    yv = rng.standard_normal(sb).astype(np.float32)
    vals, _, _ = interpret(b.build(), {"x": xv, "y": yv})
    np.testing.assert_array_equal(vals[z.id], xv + yv)


def test_equal_constants_are_shared():
    b = GraphBuilder()
    assert b.constant(2.0).id == b.constant(2).id
    assert b.constant(2.0).id != b.constant(2, i32).id
    assert b.constant(2, i32).node.attr("value") == 2


def test_negative_zero_constant_is_not_merged_with_zero():
    b = GraphBuilder()
    b.constant(0.0)
    neg = b.constant(-0.0)
    assert np.signbit(neg.node.attr("value"))


def test_broadcast_to_negative_dim_names_op_and_line():
    b = GraphBuilder()
    x = b.input("x", (3,))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.broadcast_to(x, (-1, 3))
    _assert_names(ei.value, "broadcast_to", ["%0: f32[3]"], line)


def test_use_builder_sets_and_restores_the_current_builder():
    from meganeura.graph.builder import current_builder, use_builder

    outer, inner = GraphBuilder(), GraphBuilder()
    assert current_builder() is None
    with use_builder(outer):
        assert current_builder() is outer
        with use_builder(inner):
            assert current_builder() is inner
        assert current_builder() is outer
    assert current_builder() is None
    with pytest.raises(TypeError, match="expects a GraphBuilder"):
        with use_builder("not a builder"):
            pass


def test_tensor_equality_with_a_non_operand_is_identity():
    """``==`` builds an elementwise ``eq`` only for operands; anything else (Ellipsis, None,
    a string) compares by identity, so ``Ellipsis in (t, 0)`` is False, as with torch."""
    b = GraphBuilder()
    x = b.input("x", (3,), i32)
    assert Ellipsis not in (x, 0)
    assert (x != "a") is True
    assert (x == 1).node.op == "eq"
