"""The footguns of issue 10, item 6, met through the module API (``model(x)``, ``mn.Trainer``)
as a user porting a torch model meets them: each raises an error that says what the user
wrote, and a step that raises changes nothing.

The same errors at the op and graph level: tests/ops/test_error_messages.py (cat, conv1d),
tests/test_compile.py ("no output named 'loss'"), tests/training/test_trainer_gpu.py (token ids
of a graph trainer), tests/nn/test_compiled.py (truth values, host values, empty weights).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn as nn
import meganeura.nn.functional as F
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.nn import UninitializedParameterError
from meganeura.runtime import InputError

pytestmark = pytest.mark.gpu

X = np.ones((2, 4), np.float32)
NOT_YET = "truth value of Tensor.* is unknown while the graph is built.* only when the compiled"


def _sum_loss(model, x):
    return F.sum(model(x))


class Branchy(nn.Module):
    """``if h.sum() > 0:`` in forward, as eager PyTorch allows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h
        return -h


def test_if_on_a_traced_tensor_in_forward_raises(gpu_device):
    with pytest.raises(TypeError, match=NOT_YET):
        Branchy()(X)
    tr = mn.Trainer(Branchy(), mn.optim.SGD(lr=0.1), _sum_loss, device=gpu_device)
    with pytest.raises(TypeError, match=NOT_YET) as ei:
        tr.step(X)
    assert "while tracing _sum_loss(model, x: float32[2, 4]) for Trainer.step" in ei.value.__notes__
    assert tr.step_count == 0


def test_bool_in_a_loss_fn_raises(gpu_device):
    def clipped(model, x):
        loss = F.sum(model(x))
        return loss if bool(loss < 10) else loss * 0.1

    tr = mn.Trainer(nn.Linear(4, 4), mn.optim.SGD(lr=0.1), clipped, device=gpu_device)
    with pytest.raises(TypeError, match=NOT_YET):
        tr.step(X)


def test_an_uninitialized_model_raises_until_loaded(gpu_device):
    with nn.init.empty_weights():
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with pytest.raises(UninitializedParameterError, match="parameter '0.weight' was never init"):
        model(X)
    tr = mn.Trainer(model, mn.optim.SGD(lr=0.1), _sum_loss, device=gpu_device)
    with pytest.raises(UninitializedParameterError, match="'0.weight'"):
        tr.step(X)
    assert tr.step_count == 0
    w, b = np.full((3, 4), 0.5, np.float32), np.array([-1.0, 0.0, 1.0], np.float32)
    model.load_state_dict({"0.weight": w, "0.bias": b})
    np.testing.assert_allclose(model(X), np.maximum(X @ w.T + b, 0), rtol=1e-6)


def test_a_graph_without_the_loss_output_says_so(gpu_device):
    b = GraphBuilder()
    x = b.input("x", (2, 4))
    b.output("logits", F.linear(x, b.parameter("w", (3, 4))))
    with pytest.raises(ValueError, match="no output named 'loss'; the graph's outputs are 'logit"):
        mn.Trainer(b.build(), mn.optim.SGD(lr=0.1), device=gpu_device)


@pytest.mark.parametrize(
    "returns, says",
    [
        (lambda out: None, "loss_fn returned None; it must return the loss as a scalar Tensor"),
        (lambda out: out, r"loss_fn returned a Tensor of shape \[2, 4\]; the loss must be a scal"),
    ],
    ids=["none", "not-reduced"],
)
def test_a_loss_fn_without_a_loss_says_so(gpu_device, returns, says):
    loss_fn = lambda m, x: returns(m(x))  # noqa: E731
    tr = mn.Trainer(nn.Linear(4, 4), mn.optim.SGD(lr=0.1), loss_fn, device=gpu_device)
    with pytest.raises((TypeError, ValueError), match=says):
        tr.step(X)


class Concat(nn.Module):
    def forward(self, a, b):
        return mn.cat([a, b], dim=0)


CAT_LINE = Concat.forward.__code__.co_firstlineno + 1


def test_a_failed_cat_names_the_op_and_the_users_line(gpu_device):
    with pytest.raises(GraphTypeError) as ei:
        Concat()(np.ones((2, 3), np.float32), np.ones((2, 4), np.float32))
    msg = str(ei.value)
    assert msg.startswith(
        f"cat([%0: f32[2,3], %1: f32[2,4]], dim=0) at test_footguns.py:{CAT_LINE}: "
    ), msg
    assert "operand 1 has shape [2, 4] where [*, 3] is expected" in msg


@pytest.mark.parametrize(
    "shape, kernel, says",
    [
        ((2, 5, 16), 3, "weight [8, 4, 3] expects 4 input channels, the input has 5"),
        ((2, 4, 16, 3), 3, "input must be [N, C, L] or unbatched [C, L], got f32[2,4,16,3]"),
        ((2, 4, 3), 5, "input length 3 padded by 0 on each side is smaller than the dilated kern"),
    ],
    ids=["channels", "4d-input", "too-short"],
)
def test_conv1d_errors_speak_of_1d_shapes(gpu_device, shape, kernel, says):
    conv = nn.Conv1d(4, 8, kernel)
    line = sys._getframe().f_lineno + 2
    with pytest.raises(GraphTypeError) as ei:
        conv(np.ones(shape, np.float32))
    msg = str(ei.value)
    assert msg.startswith(f"conv1d(%0: f32[{','.join(map(str, shape))}], %1: f32[8,4,{kernel}]")
    assert f"at test_footguns.py:{line}: {says}" in msg, msg
    assert "conv2d" not in msg and "[N, C, H, W]" not in msg


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)

    def forward(self, ids):
        return self.embed(ids)


EMBED_LINE = Tagger.forward.__code__.co_firstlineno + 1


def test_an_out_of_range_embedding_id_is_a_token_id(gpu_device):
    model = Tagger()
    says = r"input 'ids': token id {} at position \(0, 1\) is outside \[0, 5\) \(embedding %\d+ at "
    with pytest.raises(InputError, match=says.format(5) + rf"test_footguns.py:{EMBED_LINE}\b"):
        model(np.array([[0, 5, 2]], np.int32))
    tr = mn.Trainer(model, mn.optim.SGD(lr=0.1), lambda m, ids: F.sum(m(ids)), device=gpu_device)
    before = model.state_dict()
    with pytest.raises(InputError, match=says.format(7)) as ei:
        tr.step(np.array([[1, 7, 4]], np.int32))
    assert "class index" not in str(ei.value)
    assert tr.step_count == 0
    np.testing.assert_array_equal(model.state_dict()["embed.weight"], before["embed.weight"])
    tr.step(np.array([[1, 4, 4]], np.int32))  # in range: the same program runs
    assert tr.step_count == 1
