"""torch.Tensor methods on graph Tensors (``graph/tensor_methods.py``) against torch.

Each case is written once as a method chain on ``t`` (the operands by name) and run on torch
tensors and on graph Tensors: the result structure, shapes, dtypes (int64 read as i32) and
values must agree; forward values by the NumPy interpreter and, for the whole table in one
traced program, on the GPU; gradients of the differentiable cases by the float64 interpreter
against torch.autograd.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.autodiff import differentiate
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.ops import functional as OF
from meganeura.ops.reduce import ValuesIndices

_rng = np.random.default_rng(20240611)
X = _rng.standard_normal((2, 3, 4)).astype(np.float32)  # distinct values: no ties
P = _rng.uniform(0.5, 2.0, (2, 3, 4)).astype(np.float32)
W = _rng.standard_normal((4, 5)).astype(np.float32)
M = _rng.random((3, 4)) < 0.4  # a mask with no fully masked row of 4
M[:, 0] = False
K = np.array([3, -1, 0, 2], np.int32)
ARRAYS = {"x": X, "p": P, "w": W, "m": M, "k": K}

CASES = {
    "flatten": lambda t: t["x"].flatten(),
    "flatten_1": lambda t: t["x"].flatten(1),
    "view": lambda t: t["x"].view(6, -1),
    "view_tuple": lambda t: t["x"].view((3, 8)),
    "view_as_reshape_as": lambda t: t["x"].view_as(t["p"]).reshape_as(t["x"].flatten()),
    "unflatten": lambda t: t["x"].unflatten(2, (2, -1)),
    "unsqueeze_squeeze": lambda t: t["x"].unsqueeze(1).unsqueeze(-1).squeeze(-1).squeeze(),
    "squeeze_dim": lambda t: t["x"][:, :1].squeeze(1),
    "expand": lambda t: t["x"][:, :1].expand(2, 5, -1),
    "expand_new_dims": lambda t: t["k"].expand(3, -1),
    "expand_as_broadcast_to": lambda t: t["k"].expand_as(t["x"]) + t["k"].broadcast_to((3, 4)),
    "repeat": lambda t: t["x"].repeat(2, 1, 3),
    "repeat_new_dims": lambda t: t["k"].repeat(2, 3),
    "exp_log_sqrt": lambda t: t["p"].exp() + t["p"].log() + t["p"].sqrt() + t["p"].rsqrt(),
    "abs_neg": lambda t: t["x"].abs() + t["x"].neg() + t["k"].abs(),
    "sigmoid_tanh_relu": lambda t: t["x"].sigmoid() * t["x"].tanh() + t["x"].relu(),
    "square_reciprocal": lambda t: t["x"].square() + t["p"].reciprocal(),
    "floor_ceil_trunc": lambda t: (
        (t["x"] * 3).floor() + (t["x"] * 3).ceil() * 10 + (t["x"] * 3).trunc() * 100
    ),
    "softmax": lambda t: t["x"].softmax(-1) + t["x"].log_softmax(1),
    "float_int_bool": lambda t: t["x"].int().float() + t["x"].bool().int() + t["k"].float(),
    "to_dtype": lambda t: t["x"].to(t["k"]) + t["k"].to("cpu"),
    "type_as": lambda t: t["k"].type_as(t["x"]) * 0.5,
    "long": lambda t: (t["x"] * 4).long(),
    "chunk": lambda t: t["x"].chunk(2, -1),
    "split": lambda t: t["x"].split(1, 1),
    "split_sections": lambda t: t["x"].split([1, 3], 2),
    "unbind": lambda t: t["x"].unbind(1),
    "transpose_permute": lambda t: t["x"].transpose(0, 2).permute(1, 0, 2).contiguous(),
    "t_T": lambda t: t["w"].t() + t["w"].T,
    "mT": lambda t: t["x"].mT[0].T.t(),
    "sum_mean": lambda t: t["x"].sum(-1) + t["x"].mean(2, keepdim=True).sum(2),
    "sum_dims": lambda t: t["x"].sum((0, 2)) + t["x"].mean(dim=(0, 2)),
    "var_std": lambda t: t["x"].var(1) + t["x"].std(1, keepdim=True).sum(1),
    "var_unbiased_false": lambda t: t["x"].var(2, False) + t["x"].std(correction=0),
    "var_all": lambda t: t["x"].var() + t["x"].std(),
    "clamp": lambda t: t["x"].clamp(-0.5, 0.7) + t["x"].clamp(min=0.1) + t["x"].clip(max=0.0),
    "pow": lambda t: t["p"].pow(2.5) + t["x"].pow(2) + t["k"].pow(3),
    "matmul": lambda t: t["x"].matmul(t["w"]) + t["x"] @ t["w"],
    "masked_fill": lambda t: t["x"].masked_fill(t["m"], 0.25),
    "masked_fill_neg_inf_softmax": lambda t: t["x"].masked_fill(t["m"], -math.inf).softmax(-1),
    "masked_fill_int": lambda t: t["k"].masked_fill(t["m"][0], 7),
    "where_method": lambda t: t["x"].where(t["m"], -1.0),
    "detach": lambda t: t["x"].detach() * t["x"],
    "new_zeros_ones_full": lambda t: (
        t["x"].new_zeros(3, 4) + t["x"].new_ones((3, 4)) + t["x"].new_full((3, 4), 2.5)
    ),
    "new_zeros_dtype": lambda t: t["k"].new_zeros(2),
    "max_min_all": lambda t: t["x"].max() + t["x"].min(),
    "max_dim": lambda t: t["x"].max(1),
    "min_dim_keepdim": lambda t: t["x"].min(-1, keepdim=True),
    "max_unpacked": lambda t: (lambda v, i: v * 2 + i)(*t["x"].max(dim=2)),
    "max_fields": lambda t: t["x"].max(0).values + t["x"].min(0).indices,
    "max_other": lambda t: t["x"].max(t["p"]) + t["x"].min(t["p"]),
    "argmax_argmin": lambda t: (
        t["x"].argmax() + t["x"].argmin(1).unsqueeze(1) + t["x"].argmax(-1, True)
    ),
    "amax_amin": lambda t: t["x"].amax((0, 2)) + t["x"].amin(1).sum(),
    "logsumexp_cumsum": lambda t: t["x"].logsumexp(-1) + t["x"].cumsum(1).sum(-1),
    "any_all": lambda t: (t["m"].any(-1) & t["m"].all(-1)) | (t["k"] > 0).any(),
    "named_arithmetic": lambda t: t["x"].add(t["p"], alpha=2).sub(1).mul(t["p"]).div(t["p"]),
    "named_comparisons": lambda t: t["x"].gt(0) & t["x"].le(t["p"]) | t["k"].eq(2) | t["k"].ne(0),
    "size_numel": lambda t: t["x"] * (t["x"].size(-1) + t["x"].numel() + t["x"].dim()),
    "gather_index_select": lambda t: (
        t["x"].gather(2, t["x"].argmax(2, keepdim=True))
        + t["x"].index_select(2, t["x"].argmin(2)[0, :1])
    ),
    "is_floating_point": lambda t: t["x"] * float(t["x"].is_floating_point()),
}
# Cases whose gradient with respect to x is compared (the others are shape- or index-only).
GRAD_CASES = [
    "repeat",
    "expand",
    "unbind",
    "var_std",
    "var_unbiased_false",
    "masked_fill_neg_inf_softmax",
    "max_dim",
    "max_unpacked",
    "max_other",
    "amax_amin",
    "clamp",
    "detach",
    "split_sections",
    "softmax",
    "matmul",
]


def _torch_operands(requires_grad: bool = False):
    out = {}
    for k, a in ARRAYS.items():
        v = torch.from_numpy(np.asarray(a).copy())
        if k == "x" and requires_grad:
            v = v.double().requires_grad_(True)
        elif v.dtype == torch.float32 and requires_grad:
            v = v.double()
        out[k] = v
    return out


def _flat(result, prefix: str = "") -> dict:
    """Tensors of a (nested tuple) result by name: ``chunk.0``, ``max_dim.values``."""
    if isinstance(result, ValuesIndices) or type(result).__name__ in ("max", "min"):
        return {f"{prefix}.values": result[0], f"{prefix}.indices": result[1]}
    if isinstance(result, tuple):
        return {f"{prefix}.{i}": r for i, r in enumerate(result)}
    return {prefix: result}


def _graph():
    g = GraphBuilder()
    t = {
        k: g.input(k, np.shape(a), DType.from_numpy(np.asarray(a).dtype)) for k, a in ARRAYS.items()
    }
    outs = {}
    for name, fn in CASES.items():
        outs.update(_flat(fn(t), name))
    for k, v in outs.items():
        g.output(k, v)
    return g.build_unverified(), outs


def _torch_outputs():
    t = _torch_operands()
    outs = {}
    for name, fn in CASES.items():
        outs.update(_flat(fn(t), name))
    return outs


def _check(name, got: np.ndarray, want: torch.Tensor, rtol: float = 2e-6):
    w = want.detach().numpy()
    if w.dtype == np.int64:
        w = w.astype(np.int32)
    assert got.dtype == w.dtype and got.shape == w.shape, (name, got.dtype, w.dtype, got.shape)
    if w.dtype.kind == "f":
        scale = float(np.abs(w[np.isfinite(w)]).max(initial=1.0))
        np.testing.assert_allclose(got, w, rtol=rtol, atol=rtol * scale, err_msg=name)
    else:
        np.testing.assert_array_equal(got, w, err_msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_method_matches_torch(name):
    graph, outs = _graph()
    want = {k: v for k, v in _torch_outputs().items() if k == name or k.startswith(name + ".")}
    got_names = {k for k in outs if k == name or k.startswith(name + ".")}
    assert got_names == set(want)
    vals, _, _ = interpret(graph, {k: np.asarray(a) for k, a in ARRAYS.items()})
    for k, w in want.items():
        _check(k, vals[graph.output_dict[k]], w)


def test_max_with_dim_is_a_named_tuple_and_without_the_value():
    g = GraphBuilder()
    x = g.input("x", (3, 4))
    r = x.max(1)
    values, indices = r
    assert isinstance(r, ValuesIndices) and r.values is values and r.indices is indices
    assert values.type.dtype is DType.f32 and indices.dtype is DType.i32 and values.shape == (3,)
    assert x.max().shape == () and x.min(dim=0, keepdim=True).values.shape == (1, 4)


def test_masked_fill_rejects_a_non_bool_mask_and_a_widening_mask():
    g = GraphBuilder()
    x = g.input("x", (3, 4))
    with pytest.raises(GraphTypeError, match="bool"):
        x.masked_fill(g.input("k", (3, 4), DType.i32), 0.0)
    with pytest.raises(GraphTypeError, match="broadcast"):
        x[0].masked_fill(g.input("m", (3, 4), DType.bool), 0.0)


def test_view_of_a_dtype_and_iteration_raise():
    g = GraphBuilder()
    x = g.input("x", (3, 4))
    with pytest.raises(TypeError, match="dtype"):
        x.view(DType.i32)
    with pytest.raises(TypeError, match="unbind"):
        list(x)


@pytest.mark.parametrize("name", GRAD_CASES)
def test_method_gradient_matches_torch_autograd(name):
    g = GraphBuilder()
    t = {
        k: g.input(k, np.shape(a), DType.from_numpy(np.asarray(a).dtype)) for k, a in ARRAYS.items()
    }
    outs = [v for v in _flat(CASES[name](t), name).values() if v.dtype.is_floating]
    rs = [np.random.default_rng(i).standard_normal(o.shape) for i, o in enumerate(outs)]
    loss = sum(OF.sum(o * g.input(f"_r{i}", o.shape)) for i, o in enumerate(outs))
    g.output("loss", loss)
    g2, grads = differentiate(g.build_unverified(), "loss", ["x"])
    feeds = {k: np.asarray(a) for k, a in ARRAYS.items()}
    feeds.update({f"_r{i}": r for i, r in enumerate(rs)})
    feeds = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    vals, _, _ = interpret(g2, feeds, float64=True)
    got = vals[next(iter(grads.values()))]

    tt = _torch_operands(requires_grad=True)
    touts = [v for v in _flat(CASES[name](tt), name).values() if v.dtype.is_floating_point]
    tloss = sum((o * torch.from_numpy(r)).sum() for o, r in zip(touts, rs, strict=True))
    tloss.backward()
    np.testing.assert_allclose(got, tt["x"].grad.numpy(), rtol=1e-9, atol=1e-12)


class _Cases(mn.nn.Module):
    def forward(self, x, p, w, m, k):
        t = {"x": x, "p": p, "w": w, "m": m, "k": k}
        outs = {}
        for name, fn in CASES.items():
            outs.update(_flat(fn(t), name))
        return outs


@pytest.mark.gpu
def test_the_whole_table_on_the_gpu(gpu_device):
    out = _Cases()(*ARRAYS.values())
    for k, want in _torch_outputs().items():
        _check(k, out[k], want, rtol=2e-5)
