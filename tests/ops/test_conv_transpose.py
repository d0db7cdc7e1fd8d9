"""conv_transpose2d beyond the op database (no GPU): output shapes and values on the NumPy
interpreter in float64 against torch over a sweep of geometries, the gradient graph it gets
from conv2d_backward_input's rule, and the errors PyTorch raises."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from meganeura.autodiff import differentiate
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.ops import functional as F
from meganeura.ops.conv_transpose import conv_transpose2d

GEOMETRIES = {
    f"s{s}_p{p}_op{op}_d{d}_g{g}": dict(
        stride=s, padding=p, output_padding=op, dilation=d, groups=g
    )
    for s, p, op, d, g in itertools.product((1, 2, 3), (0, 1), (0, 1, 2), (1, 2), (1, 2))
    if op < max(s, d)
}


@pytest.mark.parametrize("kw", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_value_matches_torch_in_float64(kw):
    rng = np.random.default_rng(7)
    x, w, bias = rng.standard_normal((2, 4, 3, 4)), rng.standard_normal((4, 3, 3, 2)), None
    b = GraphBuilder()
    y = conv_transpose2d(b.input("x", x.shape), b.input("w", w.shape), bias, **kw)
    b.output("y", y)
    vals, _, _ = interpret(b.build(), {"x": x, "w": w}, float64=True)
    ref = TF.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(w), **kw).numpy()
    assert vals[y.id].shape == ref.shape
    np.testing.assert_allclose(vals[y.id], ref, rtol=1e-12, atol=1e-12)


def test_gradients_are_conv2d_and_its_weight_gradient():
    b = GraphBuilder()
    x, w = b.input("x", (1, 4, 3, 3)), b.input("w", (4, 2, 3, 3))
    y = conv_transpose2d(x, w, stride=2, padding=1, output_padding=1)
    b.output("loss", F.sum(y * y))
    graph, grads = differentiate(b.build(), "loss", [x.id, w.id])
    assert graph[grads[x.id]].op == "conv2d"
    assert graph[grads[w.id]].op == "conv2d_backward_weight"


ERRORS = {
    "outpad_not_below_stride_or_dilation": (
        (1, 2, 3, 3),
        (2, 2, 3, 3),
        dict(stride=2, output_padding=2),
        ValueError,
        "smaller than",
    ),
    "channels": ((1, 3, 3, 3), (2, 2, 3, 3), {}, GraphTypeError, "input channels"),
    "groups": ((1, 3, 3, 3), (3, 2, 3, 3), dict(groups=2), GraphTypeError, "divisible"),
    "empty": ((1, 2, 1, 1), (2, 2, 1, 1), dict(padding=1), ValueError, "empty"),
    "weight_rank": ((1, 2, 3, 3), (2, 2, 3), {}, ValueError, "weight must be"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_invalid_calls_raise(case):
    xs, ws, kw, exc, text = case
    b = GraphBuilder()
    with pytest.raises(exc, match=text):
        conv_transpose2d(b.input("x", xs), b.input("w", ws), **kw)


def test_bias_shape_is_checked():
    b = GraphBuilder()
    x, w = b.input("x", (1, 2, 3, 3)), b.input("w", (2, 3, 3, 3))
    with pytest.raises(GraphTypeError, match="bias must be"):
        conv_transpose2d(x, w, b.input("bias", (2,)))
