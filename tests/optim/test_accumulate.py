"""Gradient accumulation and gradient outputs on the NumPy interpreter (no GPU): the
accumulate and apply programs of ``optim.accumulate`` over two micro-batches give the full
batch's loss, gradients and update; CompileOptions refuses inconsistent combinations."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura import manual_seed
from meganeura.compile import CompileOptions, build_training_graph, compile, grad_output
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.models.mlp import build_mlp
from meganeura.optim import HYPER_INPUT, SGD, AdamW
from meganeura.optim.accumulate import ACCUM_FIRST_INPUT, LOSS_ACCUMULATOR, grad_accumulator

rng = np.random.default_rng(3)
SIZES = (6, 8, 3)


def _outputs(graph, values) -> dict:
    return {name: values[i] for name, i in graph.outputs}


@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9), AdamW(lr=0.01)], ids=["sgd", "adamw"])
def test_two_micro_batches_give_the_full_batch(opt):
    manual_seed(0)
    full, half = build_mlp(8, SIZES), build_mlp(4, SIZES)
    params = full.state_dict()
    x = rng.standard_normal((8, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], 8).astype(np.int32)
    hyper = opt.hyper(0, opt.lr)
    step = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    ref_graph = build_training_graph(full.graph, step)
    ref_vals, ref_params, _ = interpret(
        ref_graph, {"x": x, "y": y, HYPER_INPUT: hyper}, params, float64=True
    )
    ref = _outputs(ref_graph, ref_vals)

    acc_graph = build_training_graph(half.graph, CompileOptions(loss="loss", accumulate_grads=True))
    stale = {grad_accumulator(k): np.full(v.shape, np.nan, np.float32) for k, v in params.items()}
    stale[LOSS_ACCUMULATOR] = np.float32(np.nan)  # dropped: the first micro-batch overwrites
    feeds = {"x": x[:4], "y": y[:4], ACCUM_FIRST_INPUT: np.float32(1)}
    _, same, state = interpret(acc_graph, feeds, params, stale, float64=True)
    for k in params:
        np.testing.assert_array_equal(same[k], params[k])  # no update
    apply_graph = build_training_graph(
        half.graph, CompileOptions(loss="loss", optimizer=opt, output_grads=True,
                                   accumulation_steps=2)
    )  # fmt: skip
    feeds = {"x": x[4:], "y": y[4:], HYPER_INPUT: hyper}
    vals, new_params, _ = interpret(apply_graph, feeds, params, state, float64=True)
    got = _outputs(apply_graph, vals)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(got[grad_output(k)], ref[grad_output(k)], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(new_params[k], ref_params[k], rtol=1e-5, atol=1e-7)


def test_a_constant_gradient_is_still_an_output():
    b = GraphBuilder()
    w = b.parameter("w", (3,))
    s = b.parameter("s", ())
    b.output("loss", (w * b.input("x", (3,))).sum() + s)  # d(loss)/ds is the constant 1
    program = compile(b.build(), CompileOptions(loss="loss", output_grads=True))
    assert {"w.grad", "s.grad"} <= set(program.outputs)
    assert HYPER_INPUT not in program.inputs  # gradients only: no optimizer


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"accumulation_steps": 0}, "integer >= 1"),
        ({"accumulation_steps": 2}, "needs optimizer"),
        ({"accumulate_grads": True, "optimizer": SGD()}, "leave optimizer None"),
        ({"accumulate_grads": True, "output_grads": True}, "output_grads False"),
    ],
    ids=["zero_steps", "steps_without_optimizer", "accumulate_with_update", "accumulate_grads"],
)
def test_inconsistent_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        CompileOptions(loss="loss", **kw)
