"""Errors of the user-facing ops speak of what the user wrote (issue 10, item 6): each names
the function the user called (``cat``, ``conv1d``, ``embedding``, not the ops they lower to),
the operands as the user passed them (``%0: f32[2,3]``), the arguments, and the user's
``file:line``; then says what is wrong in the terms of that function (no GPU)."""

from __future__ import annotations

import sys

import pytest

import meganeura.nn.functional as F
from meganeura.dtypes import i32
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


# ---- cat, stack, split, chunk --------------------------------------------------------------------
def _ab():
    b = GraphBuilder()
    return b, b.input("a", (2, 3)), b.input("b", (2, 4))


def test_cat_names_itself_every_operand_the_dim_and_the_line():
    # It was a bare ShapeError from the shape helper: "operand 1 has shape [2, 4], expected
    # ['*', 3] (every dim but 0 equal to operand 0's)", with no op, dim or line.
    _, a, b = _ab()
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.cat([a, b], dim=0)
    msg = _message(ei, "cat", ["[%0: f32[2,3], %1: f32[2,4]]", "dim=0"], line)
    assert "operand 1 has shape [2, 4] where [*, 3] is expected" in msg, msg
    assert "every dim but dim 0 must equal operand 0's [2, 3]" in msg, msg
    assert F.cat([a, b], dim=1).shape == (2, 7)  # the same operands, along the dim that differs


@pytest.mark.parametrize(
    "second, dim, says",
    [
        ((2, 3, 1), 0, "operand 1 has 3 dims [2, 3, 1], operand 0 has 2 [2, 3]"),
        ("i32", 0, "operand 1 has dtype i32, operand 0 f32"),
        ((2, 3), 2, "dim 2 out of range: expected -2 <= dim < 2"),
    ],
    ids=["ndim", "dtype", "dim_out_of_range"],
)
def test_cat_mismatches(second, dim, says):
    b = GraphBuilder()
    a = b.input("a", (2, 3))
    c = b.input("c", (2, 3), i32) if second == "i32" else b.input("c", second)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.cat((a, c), dim)
    msg = _message(ei, "cat", [f"[%0: f32[2,3], %1: {c.type}]", f"dim={dim}"], line)
    assert says in msg, msg


def test_cat_of_nothing_and_of_a_non_tensor():
    _, a, _ = _ab()
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.cat([])
    assert "needs at least one tensor" in _message(ei, "cat", ["[]", "dim=0"], line)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.cat([a, 1.0])
    assert "operand 1 is not a Tensor: 1.0" in _message(ei, "cat", ["%0: f32[2,3]"], line)


def test_stack_speaks_of_the_users_shapes_not_the_unsqueezed_ones():
    # It was cat's message over the unsqueezed views: "operand 1 has shape [1, 3, 3],
    # expected ['*', 2, 3]", shapes the user never wrote.
    b = GraphBuilder()
    a, c = b.input("a", (2, 3)), b.input("c", (3, 3))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.stack([a, c], dim=1)
    msg = _message(ei, "stack", ["[%0: f32[2,3], %1: f32[3,3]]", "dim=1"], line)
    assert "operand 1 is f32[3,3], operand 0 f32[2,3]" in msg, msg
    assert "[1, 3, 3]" not in msg, msg
    with pytest.raises(GraphTypeError, match=r"dim=3\) at .*expected -3 <= dim < 3"):
        F.stack([a, a], dim=3)


def test_split_and_chunk_name_the_call_and_the_line():
    _, a, _ = _ab()
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.split(a, [1, 1], dim=1)
    msg = _message(ei, "split", ["%0: f32[2,3]", "split_size_or_sections=[1, 1]"], line)
    assert "sections [1, 1] must be positive and sum to 3, the size of dim 1" in msg, msg
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.chunk(a, 0)
    assert "chunks must be positive" in _message(ei, "chunk", ["%0: f32[2,3]", "chunks=0"], line)


# ---- conv1d / conv2d ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "x_shape, w_shape, kw, says",
    [
        ((2, 4, 16), (8, 5, 3), {}, "weight [8, 5, 3] expects 5 input channels, the input has 4"),
        ((4, 16), (8, 5, 3), {}, "weight [8, 5, 3] expects 5 input channels, the input has 4"),
        (
            (2, 4, 16),
            (8, 4, 3),
            {"groups": 2},
            "weight [8, 4, 3] expects 4 * groups=2 = 8 input channels, the input has 4",
        ),
        ((2, 4, 16), (7, 2, 3), {"groups": 2}, "groups=2 does not divide the weight's 7 output"),
        (
            (2, 4, 16),
            (8, 4, 20),
            {},
            "input length 16 padded by 0 on each side is smaller than the dilated kernel 20",
        ),
        (
            (2, 4, 16),
            (8, 4, 4),
            {"dilation": 6},
            "input length 16 padded by 0 on each side is smaller than the dilated kernel 19",
        ),
        ((2, 4, 16), (8, 4, 3), {"stride": 0}, "stride must be >= 1, got 0"),
        ((2, 4, 16), (8, 4, 3, 3), {}, "weight must be 3-d [out_channels, in_channels/groups, ke"),
        ((2, 4, 16, 1), (8, 4, 3), {}, "input must be [N, C, L] or unbatched [C, L], got f32[2,4"),
    ],
    ids=[
        "channels",
        "channels_unbatched",
        "channels_groups",
        "groups_out_channels",
        "input_too_short",
        "dilated_kernel_too_long",
        "stride0",
        "weight_4d",
        "input_4d",
    ],
)
def test_conv1d_speaks_of_its_own_3d_shapes(x_shape, w_shape, kw, says):
    # They were conv2d's: "conv2d(%16: f32[2,4,1,16], %15: f32[8,5,1,3], stride=(1, 1), ...):
    # expected weight [OC, 4, KH, KW] ...", shapes the user never wrote.
    b = GraphBuilder()
    x, w = b.input("x", x_shape), b.input("w", w_shape)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.conv1d(x, w, **kw)
    msg = _message(ei, "conv1d", [f"%0: {x.type}", f"%1: {w.type}"], line)
    assert says in msg, msg
    for internal in ("conv2d", "KH", ",1,", "(1, "):
        assert internal not in msg, msg


def test_conv1d_bias_and_padding_errors():
    b = GraphBuilder()
    x, w = b.input("x", (2, 4, 16)), b.input("w", (8, 4, 4))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.conv1d(x, w, b.input("bias", (7,)))
    msg = _message(ei, "conv1d", ["%0: f32[2,4,16]", "%1: f32[8,4,4]", "%2: f32[7]"], line)
    assert "bias must be f32[8], one per output channel, got f32[7]" in msg, msg
    with pytest.raises(ValueError) as ei:  # a padding spec is a bad value: ValueError, as before
        line = _line() + 1
        F.conv1d(x, w, padding="same")
    msg = _message(ei, "conv1d", ["%1: f32[8,4,4]", "padding='same'"], line)
    assert "kernel_size 4 and dilation 1 needs asymmetric padding" in msg, msg
    with pytest.raises(ValueError, match=r"conv1d\(.*stride=\(1, 2\).*an int or a 1-tuple"):
        F.conv1d(x, w, stride=(1, 2))


def test_conv1d_still_builds_what_it_built():
    b = GraphBuilder()
    x, w = b.input("x", (2, 4, 16)), b.input("w", (8, 2, 3))
    assert F.conv1d(x, w, stride=2, padding=1, groups=2).shape == (2, 8, 8)
    assert F.conv1d(b.input("u", (4, 16)), w, groups=2, padding="same").shape == (8, 16)


def test_conv2d_names_the_unbatched_input_as_given():
    # An unbatched [C, H, W] input was reported as the [1, C, H, W] view made for it.
    b = GraphBuilder()
    x, w = b.input("x", (4, 8, 8)), b.input("w", (8, 5, 3, 3))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.conv2d(x, w, padding=1)
    msg = _message(ei, "conv2d", ["%0: f32[4,8,8]", "%1: f32[8,5,3,3]", "padding=1"], line)
    assert "weight [8, 5, 3, 3] expects 5 input channels, the input has 4" in msg, msg
    with pytest.raises(GraphTypeError, match=r"input size \[8, 8\] padded by \[0, 0\] on each"):
        F.conv2d(x, b.input("w9", (8, 4, 9, 9)))


# ---- embedding, gather -------------------------------------------------------------------------
def test_embedding_with_float_ids_names_embedding_and_the_ids_as_given():
    # It was index_select's: "index_select(%9: f32[10,6], %40: f32[10], dim=0) ...: index must
    # be an integer tensor", about a flattened copy of the ids the user never made.
    b = GraphBuilder()
    ids, w = b.input("ids", (2, 5)), b.parameter("emb", (10, 6))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.embedding(ids, w)
    msg = _message(ei, "embedding", ["%0: f32[2,5]", "%1: f32[10,6]"], line)
    assert "input must hold integer token ids (i32 or u32), got f32[2,5]" in msg, msg
    assert "index_select" not in msg and "f32[10]" not in msg, msg


def test_embedding_weight_must_be_a_table():
    b = GraphBuilder()
    ids = b.input("ids", (2, 5), i32)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.embedding(ids, b.parameter("emb", (10,)))
    msg = _message(ei, "embedding", ["%0: i32[2,5]", "%1: f32[10]"], line)
    assert "weight must be 2-D [num_embeddings, embedding_dim], got f32[10]" in msg, msg


def test_embedding_marks_its_node_so_later_errors_can_name_it():
    b = GraphBuilder()
    out = F.embedding(b.input("ids", (2, 5), i32), b.parameter("emb", (10, 6)))
    node = b.nodes[out.node.inputs[0]]  # out is a free reshape of the lookup
    assert (node.op, node.origin) == ("index_select", "embedding")
    assert out.shape == (2, 5, 6)


def test_gather_dim_out_of_range_names_the_call():
    b = GraphBuilder()
    x, idx = b.input("x", (2, 3)), b.input("i", (2, 3), i32)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.gather(x, 2, idx)
    msg = _message(ei, "gather", ["%0: f32[2,3]", "dim=2"], line)
    assert "dim 2 out of range: expected -2 <= dim < 2" in msg, msg


# ---- the ops a PyTorch user reaches first: linear, matmul, layer_norm and the norm family -------
def test_linear_with_the_wrong_in_features_names_linear_and_the_weight_as_given():
    # It was matmul's, over the transposed weight: "matmul(%0: f32[2,6], %2: f32[7,5]) ...:
    # inner dimensions differ: 6 vs 7".
    b = GraphBuilder()
    x, w = b.input("x", (2, 6)), b.parameter("fc.weight", (5, 7))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.linear(x, w)
    msg = _message(ei, "linear", ["%0: f32[2,6]", "%1: f32[5,7]"], line)
    assert "input has 6 features (its last dim)" in msg, msg
    assert "weight [5, 7] is [out_features, in_features] with in_features=7" in msg, msg
    assert "[7,5]" not in msg, msg


@pytest.mark.parametrize(
    "bias_shape, w_shape, says",
    [
        ((4,), (5, 6), "bias must be f32[5] (out_features), got f32[4]"),
        (None, (5, 6, 1), "weight must be 2-D [out_features, in_features], got f32[5,6,1]"),
    ],
    ids=["bias", "weight_3d"],
)
def test_linear_bias_and_weight_layout(bias_shape, w_shape, says):
    b = GraphBuilder()
    x, w = b.input("x", (2, 6)), b.parameter("w", w_shape)
    bias = None if bias_shape is None else b.parameter("b", bias_shape)
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.linear(x, w, bias)
    assert says in _message(ei, "linear", ["%0: f32[2,6]", f"%1: {w.type}"], line)


def test_matmul_mismatch_already_names_matmul_both_operands_and_the_line():
    b = GraphBuilder()
    a, c = b.input("a", (2, 3)), b.input("c", (2, 3))
    with pytest.raises(GraphTypeError) as ei:
        line = _line() + 1
        F.matmul(a, c)
    msg = _message(ei, "matmul", ["%0: f32[2,3]", "%1: f32[2,3]"], line)
    assert "inner dimensions differ: 3 vs 2" in msg, msg


def test_layer_norm_normalized_shape_mismatch_names_the_call():
    # It was "normalized_shape [4] must be the trailing dims of the input Tensor(%0:
    # f32[2,3])": no op, no line.
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    with pytest.raises(ValueError) as ei:
        line = _line() + 1
        F.layer_norm(x, (4,))
    msg = _message(ei, "layer_norm", ["%0: f32[2,3]", "normalized_shape=(4,)"], line)
    assert "normalized_shape [4] must be the input's trailing dims, which are [3]" in msg, msg
    with pytest.raises(ValueError) as ei:
        line = _line() + 1
        F.layer_norm(x, 3, weight=b.parameter("ln.weight", (4,)))
    msg = _message(ei, "layer_norm", ["normalized_shape=3", "weight=%1: f32[4]"], line)
    assert "weight must have shape [3] (normalized_shape), got f32[4]" in msg, msg
    with pytest.raises(ValueError, match=r"^layer_norm\(.*\[2, 3, 4\] has more dims than the"):
        F.layer_norm(x, (2, 3, 4))


@pytest.mark.parametrize(
    "call, op, says",
    [
        (lambda b, x: F.rms_norm(x, 8), "rms_norm", "must be the input's trailing dims, which"),
        (lambda b, x: F.group_norm(x, 3), "group_norm", "num_groups 3 does not divide the inp"),
        (
            lambda b, x: F.batch_norm(x, None, None, b.parameter("bn.weight", (3,)), training=True),
            "batch_norm",
            "weight must have shape [4] (one per channel), got f32[3]",
        ),
        (
            lambda b, x: F.batch_norm(x, None, None),
            "batch_norm",
            "eval mode (training=False) needs running_mean and running_var",
        ),
    ],
    ids=["rms_norm", "group_norm", "batch_norm_weight", "batch_norm_eval"],
)
def test_the_other_norms_name_their_call(call, op, says):
    b = GraphBuilder()
    x = b.input("x", (2, 4, 5))
    with pytest.raises(ValueError) as ei:
        call(b, x)
    msg = str(ei.value)
    # the user's line is the lambda's, in the parameter list above
    assert msg.startswith(f"{op}(%0: f32[2,4,5]") and f") at {FILE}:" in msg, msg
    assert says in msg, msg


def test_linear_takes_an_unbatched_input_as_torch_does():
    # torch.nn.Linear maps [in_features] to [out_features]; it was refused with "input must be
    # [*, in_features] with at least 2 dims".
    import numpy as np
    import torch

    from meganeura.graph.interpret import interpret

    r = np.random.default_rng(0)
    x, w, bias = (r.standard_normal(s) for s in ((6,), (5, 6), (5,)))
    b = GraphBuilder()
    xi, wi, bi = b.input("x", (6,)), b.parameter("w", (5, 6)), b.parameter("b", (5,))
    y = F.linear(xi, wi, bi)
    assert y.shape == (5,)
    b.output("y", y)
    vals, _, _ = interpret(b.build(), {"x": x}, {"w": w, "b": bias}, float64=True)
    got = vals[y.id]
    ref = torch.nn.functional.linear(*(torch.from_numpy(a) for a in (x, w, bias))).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    with pytest.raises(GraphTypeError, match="input must be"):
        F.linear(b.input("s", ()), wi)
