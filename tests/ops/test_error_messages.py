"""Errors of the user-facing ops speak of what the user wrote (issue 10, item 6): each names
the function the user called (``cat``, ``conv1d``, ``embedding``, not the ops they lower to),
the operands as the user passed them (``%0: f32[2,3]``), the arguments, and the user's
``file:line``; then says what is wrong in the terms of that function (no GPU)."""

from __future__ import annotations

import sys

import pytest

from meganeura.graph.builder import GraphBuilder, GraphTypeError

FILE = "test_error_messages.py"


def _line() -> int:
    """The caller's line number (so a test can name the line its next statement is on)."""
    return sys._getframe(1).f_lineno


def _message(err: pytest.ExceptionInfo, op: str, operands: list[str], line: int) -> str:
    """The message, after checking it starts with ``op(``, quotes each operand and names the
    test's line."""
    msg = str(err.value)
    assert msg.startswith(f"{op}("), msg
    for operand in operands:
        assert operand in msg, msg
    assert f"at {FILE}:{line}:" in msg, msg
    return msg


# ---- reshape ----------------------------------------------------------------------------------
def test_tensor_reshape_infers_minus_one_as_functional_reshape_does():
    # x.reshape(-1, 3) used to reach the type rule with the -1 and fail ("cannot reshape 6
    # elements of [2, 3] into [-1, 3]"), though F.reshape(x, (-1, 3)) worked.
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    assert x.reshape(-1, 3).shape == (2, 3)
    assert x.reshape(-1).shape == (6,)
    assert x.reshape((3, -1)).shape == (3, 2)


@pytest.mark.parametrize(
    "shape, says",
    [
        ((-1, 4), "cannot infer the -1: 6 elements of [2, 3] are not a multiple of 4"),
        ((-1, -1), "only one dim can be -1"),
        ((-1, 0), "cannot infer the -1: the other dims hold no elements"),
        ((4, 2), "cannot reshape 6 elements of [2, 3] into [4, 2]"),
    ],
    ids=["minus_one_no_fit", "two_minus_ones", "minus_one_beside_zero", "wrong_numel"],
)
def test_reshape_names_the_shape_asked_for(shape, says):
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        x.reshape(*shape)
    msg = _message(ei, "reshape", ["%0: f32[2,3]", f"shape={shape!r}"], line)
    assert says in msg
