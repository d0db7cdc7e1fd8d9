"""passes.fold_batch_norm on the NumPy interpreter (no GPU): an eval-mode BatchNorm after a
convolution disappears, in both forms, and the folded graph computes the same values (float64,
so only the rewrite's algebra is tested); BatchNorms the pass must leave alone stay."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura.nn as mnn
from meganeura.graph.interpret import interpret
from meganeura.nn.compiled import trace_call
from meganeura.nn.parameter import Buffer, Parameter
from meganeura.passes.fold_batch_norm import fold_batch_norm, foldable_batch_norms

rng = np.random.default_rng(5)


class ConvBN(mnn.Module):
    """conv -> BatchNorm -> ReLU, optionally also returning the conv output (a second reader)."""

    def __init__(self, bias: bool, affine: bool = True, leak: bool = False) -> None:
        super().__init__()
        self.conv = mnn.Conv2d(3, 6, 3, stride=2, padding=1, bias=bias)
        self.bn = mnn.BatchNorm2d(6, affine=affine, eps=1e-3)
        self.relu = mnn.ReLU()
        self.leak = leak

    def forward(self, x):
        y = self.conv(x)
        out = self.relu(self.bn(y))
        return (out, y) if self.leak else out


def _perturb(model: mnn.Module) -> None:
    """Statistics and affine parameters away from 0 and 1, so a wrong fold shows."""
    state = model.state_dict()
    for k, v in state.items():
        if k.endswith(("running_mean", "bias")):
            state[k] = rng.uniform(-0.5, 0.5, v.shape).astype(np.float32)
        elif k.endswith(("running_var", "bn.weight")):
            state[k] = rng.uniform(0.5, 2.0, v.shape).astype(np.float32)
    model.load_state_dict(state)


def _run(traced, graph, x):
    objs = traced.trace.objects
    params = {n: o.data.astype(np.float64) for n, o in objs.items() if isinstance(o, Parameter)}
    state = {n: o.data.astype(np.float64) for n, o in objs.items() if isinstance(o, Buffer)}
    vals, _, _ = interpret(graph, {"x": x.astype(np.float64)}, params, state, float64=True)
    return [vals[v] for _, v in graph.outputs]


def _count(graph, op: str) -> int:
    return sum(n.op == op for n in graph.nodes)


@pytest.mark.parametrize("into", ["output", "weight"])
@pytest.mark.parametrize("bias", [False, True], ids=["conv_no_bias", "conv_bias"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
def test_fold_removes_batch_norm_and_keeps_values(into, bias, affine):
    model = ConvBN(bias, affine)
    _perturb(model)
    model.eval()
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    traced = trace_call(model, model.forward, (x,), {})
    assert _count(traced.graph, "batch_norm") == 1
    folded, ids = fold_batch_norm(traced.graph, into)
    assert _count(folded, "batch_norm") == 0
    assert _count(folded, "conv2d") == 1
    # the weight form gives the conv a bias; the output form leaves the conv as it was
    conv = next(n for n in folded.nodes if n.op == "conv2d")
    assert len(conv.inputs) == (3 if into == "weight" or bias else 2)
    if into == "output":  # what remains of the BatchNorm is elementwise: it fuses with ReLU
        from meganeura.codegen.wgsl.elementwise.maps import FUSIBLE

        skip = ("reshape", "parameter", "state", "constant")
        after = [n for n in folded.nodes if n.id > conv.id and n.op not in skip]
        assert {n.op for n in after} <= FUSIBLE, {n.op for n in after}
    (want,), (got,) = _run(traced, traced.graph, x), _run(traced, folded, x)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    bn = next(n.id for n in traced.graph.nodes if n.op == "batch_norm")
    assert folded.nodes[ids[bn]].op == ("conv2d" if into == "weight" else "add")


def test_fold_leaves_a_conv_read_elsewhere_and_train_mode_alone():
    model = ConvBN(bias=False, leak=True).eval()
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    traced = trace_call(model, model.forward, (x,), {})
    assert foldable_batch_norms(traced.graph) == []
    assert fold_batch_norm(traced.graph)[0] is traced.graph
    model = ConvBN(bias=False).train()  # batch statistics: nothing to fold
    traced = trace_call(model, model.forward, (x,), {})
    assert foldable_batch_norms(traced.graph) == []


def test_fold_rejects_an_unknown_form():
    model = ConvBN(bias=False).eval()
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    graph = trace_call(model, model.forward, (x,), {}).graph
    with pytest.raises(ValueError, match="into must be 'output' or 'weight', got 'bias'"):
        fold_batch_norm(graph, "bias")
