"""PyTorch's type promotion for Tensor operators and the functional binary ops.

Each case is one expression written once and evaluated on torch tensors (int32, float32,
float16, bool, 0-d tensors and Python scalars, as a user's torch code has them) and on graph
Tensors of the same dtypes: the result dtype must be torch's (int64 read as i32, meganeura's
integer default) and the values equal (integers and bools exactly; floats to float32
rounding). Values come from the NumPy interpreter and, for the whole table in one traced
program, from the GPU. IR ops stay single-dtype: promotion inserts ``cast`` nodes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.dtypes import DType, promote_types, result_type
from meganeura.graph.builder import GraphBuilder, GraphTypeError, use_builder
from meganeura.graph.interpret import interpret

I = np.array([-7, -4, -1, 0, 1, 3, 4, 9], np.int32)  # noqa: E741
NZ = np.array([-3, -2, -1, 1, 2, 3, 5, 7], np.int32)  # nonzero divisors
F = np.array([-2.5, -1.0, -0.25, 0.0, 0.5, 1.5, 2.0, 7.25], np.float32)
B = np.array([True, False, True, True, False, False, True, False])
H = F.astype(np.float16)
ARRAYS = {"i": I, "nz": NZ, "f": F, "b": B, "h": H, "i0": np.int32(3), "f0": np.float32(0.5)}

# name -> expression of (t: the operands by name, M: torch or meganeura)
CASES = {
    "int_times_float": lambda t, M: t["i"] * 0.5,
    "int_plus_float": lambda t, M: t["i"] + 0.5,
    "float_plus_int_reflected": lambda t, M: 0.5 + t["i"],
    "float_minus_int_reflected": lambda t, M: 0.5 - t["i"],
    "int_div_int": lambda t, M: t["i"] / (t["nz"] + 10),
    "int_div_python_int": lambda t, M: (t["i"] - 4) / 3,
    "python_int_div_int": lambda t, M: 3 / t["nz"],
    "int_pow_half": lambda t, M: (t["i"] * t["i"]) ** 0.5,
    "int_pow_int": lambda t, M: t["i"] ** 3,
    "int_pow_zero": lambda t, M: t["i"] ** 0,
    "float_pow_int_tensor": lambda t, M: 2.0 ** t["i"],
    "arange_times_float": lambda t, M: M.arange(4) * 0.5,
    "int_plus_int": lambda t, M: t["i"] + 2,
    "int_times_float_tensor": lambda t, M: t["i"] * t["f"],
    "float_tensor_minus_int": lambda t, M: t["f"] - t["i"],
    "half_times_float": lambda t, M: t["h"] * 0.5,
    "half_plus_float_tensor": lambda t, M: t["h"] + t["f"],
    "int_plus_half": lambda t, M: t["i"] + t["h"],
    "int_plus_float_0d": lambda t, M: t["i"] + t["f0"],
    "half_plus_float_0d": lambda t, M: t["h"] + t["f0"],
    "float_plus_int_0d": lambda t, M: t["f"] + t["i0"],
    "bool_times_float": lambda t, M: t["b"] * 0.5,
    "bool_plus_int": lambda t, M: t["b"] + 1,
    "bool_times_int_tensor": lambda t, M: t["b"] * t["i"],
    "bool_plus_bool": lambda t, M: t["b"] + ~t["b"],
    "bool_times_bool": lambda t, M: t["b"] * t["b"],
    "bool_div_bool": lambda t, M: t["b"] / (t["b"] + 1),
    "bool_sum": lambda t, M: t["b"].sum(),
    "bool_sum_dim": lambda t, M: M.sum(t["b"], 0),
    "int_sum": lambda t, M: t["i"].sum(),
    "int_gt_float": lambda t, M: t["i"] > 0.5,
    "int_eq_float": lambda t, M: t["i"] == 3.0,
    "float_le_int": lambda t, M: t["f"] <= t["i"],
    "int_ne_float_reflected": lambda t, M: 0.5 != t["i"],
    "floordiv_int": lambda t, M: t["i"] // 3,
    "floordiv_int_negative": lambda t, M: t["i"] // -3,
    "rfloordiv_int": lambda t, M: -7 // t["nz"],
    "floordiv_int_tensors": lambda t, M: t["i"] // t["nz"],
    "mod_int": lambda t, M: t["i"] % 3,
    "mod_int_negative": lambda t, M: t["i"] % -3,
    "rmod_int": lambda t, M: 7 % t["nz"],
    "mod_int_tensors": lambda t, M: t["i"] % t["nz"],
    "floordiv_float": lambda t, M: t["f"] // 0.75,
    "mod_float": lambda t, M: t["f"] % 0.75,
    "mod_float_negative": lambda t, M: t["f"] % -0.75,
    "floordiv_int_by_float": lambda t, M: t["i"] // 2.5,
    "div_trunc_int": lambda t, M: M.div(t["i"], t["nz"], rounding_mode="trunc"),
    "div_trunc_float": lambda t, M: M.div(t["f"], 0.75, rounding_mode="trunc"),
    "div_floor": lambda t, M: M.div(t["i"], 2, rounding_mode="floor"),
    "add_alpha": lambda t, M: M.add(t["i"], t["f"], alpha=2),
    "where_int_float": lambda t, M: M.where(t["b"], t["i"], 0.5),
    "where_two_floats": lambda t, M: M.where(t["b"], 0.0, -math.inf),
    "where_two_ints": lambda t, M: M.where(t["b"], 1, 0),
    "maximum_int_float": lambda t, M: M.maximum(t["i"], t["f"]),
    "minimum_bool_bool": lambda t, M: M.minimum(t["b"], ~t["b"]),
    "clamp_int_float_bound": lambda t, M: M.clamp(t["i"], min=0.5),
    "clamp_int_int_bounds": lambda t, M: M.clamp(t["i"], -2, 3),
    "clamp_float_tensor_bounds": lambda t, M: M.clamp(t["f"], t["i"] * 0.1, t["f0"]),
    "logical_and_mixed": lambda t, M: M.logical_and(t["i"], t["f"]),
    "bool_and_or_xor": lambda t, M: (t["b"] & (t["i"] > 0)) | (t["b"] ^ (t["f"] < 0)),
    "int_neg_abs": lambda t, M: abs(-t["i"]) + t["i"].abs(),
}


def _torch_operands():
    out = {}
    for k, a in ARRAYS.items():
        out[k] = torch.from_numpy(np.asarray(a).copy()) if np.ndim(a) else torch.tensor(a)
    return out


def _torch_results():
    t = _torch_operands()
    return {name: fn(t, torch) for name, fn in CASES.items()}


def _want_dtype(tt: torch.Tensor) -> DType:
    d = tt.numpy().dtype
    return DType.from_numpy(np.int32 if d == np.int64 else d)


def _graph():
    g = GraphBuilder()
    t = {
        k: g.input(k, np.shape(a), DType.from_numpy(np.asarray(a).dtype)) for k, a in ARRAYS.items()
    }
    with use_builder(g):
        outs = {name: fn(t, mn) for name, fn in CASES.items()}
    for k, v in outs.items():
        g.output(k, v)
    return g.build_unverified(), outs


def _check(name, got: np.ndarray, want: torch.Tensor):
    w = want.numpy()
    if w.dtype == np.int64:
        w = w.astype(np.int32)
    assert got.dtype == w.dtype and got.shape == w.shape, (name, got.dtype, w.dtype)
    if w.dtype.kind == "f":
        tol = 1e-3 if w.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(got, w, rtol=tol, atol=tol, err_msg=name)
    else:
        np.testing.assert_array_equal(got, w, err_msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_result_dtype_and_value_match_torch(name):
    graph, outs = _graph()
    want = _torch_results()[name]
    assert outs[name].dtype is _want_dtype(want)
    vals, _, _ = interpret(graph, {k: np.asarray(a) for k, a in ARRAYS.items()})
    _check(name, vals[graph.output_dict[name]], want)


def test_ir_ops_stay_single_dtype():
    graph, _ = _graph()
    for n in graph.nodes:
        if n.op in ("add", "sub", "mul", "div", "pow", "maximum", "where", "greater", "eq"):
            dts = {graph.nodes[i].type.dtype for i in n.inputs[-2:]}
            assert len(dts) == 1, n


class _Cases(mn.nn.Module):
    def forward(self, i, nz, f, b, h, i0, f0):
        t = {"i": i, "nz": nz, "f": f, "b": b, "h": h, "i0": i0, "f0": f0}
        return {name: fn(t, mn) for name, fn in CASES.items()}


@pytest.mark.gpu
def test_the_whole_table_on_the_gpu(gpu_device):
    out = _Cases()(*(np.asarray(a) for a in ARRAYS.values()))
    for name, want in _torch_results().items():
        _check(name, out[name], want)


@pytest.mark.parametrize(
    "expr",
    [
        lambda t: t["b"] - t["b"],  # torch: "Subtraction ... with two bool tensors"
        lambda t: t["i"] ** -1,  # torch: integers to negative integer powers
        lambda t: t["i"] ** t["nz"],  # an integer power of a tensor exponent: not implemented
        lambda t: 2 ** t["i"],
        lambda t: t["i"] + t["u"],  # torch gives int64
        lambda t: t["b"] // t["b"],
    ],
    ids=[
        "bool_minus_bool",
        "int_negative_power",
        "int_tensor_power",
        "int_base_power",
        "int32_plus_uint32",
        "bool_floordiv",
    ],  # fmt: skip
)
def test_promotions_torch_rejects_or_that_need_int64_raise(expr):
    g = GraphBuilder()
    t = {
        "b": g.input("b", (3,), DType.bool),
        "i": g.input("i", (3,), DType.i32),
        "nz": g.input("nz", (3,), DType.i32),
        "u": g.input("u", (3,), DType.u32),
    }
    with pytest.raises(GraphTypeError):
        expr(t)


def test_promote_types_and_result_type():
    f32, f16, i32, u32, b = DType.f32, DType.f16, DType.i32, DType.u32, DType.bool
    assert promote_types(i32, f16) is f16 and promote_types(b, u32) is u32
    assert promote_types(f16, f32) is f32
    with pytest.raises(TypeError, match="int64"):
        promote_types(i32, u32)
    assert result_type([i32], [], [f32]) is f32  # int tensor * 0.5
    assert result_type([f16], [f32], [f32]) is f16  # a 0-d f32 tensor does not widen f16
    assert result_type([u32], [], [i32]) is u32  # a Python int keeps uint32
    assert result_type([b], [], [i32]) is i32
    assert result_type([i32], [u32]) is i32  # a 0-d tensor of the same category
    assert result_type([], [], [i32, f32]) is f32


def test_numpy_operands_defer_to_the_tensor():
    g = GraphBuilder()
    x = g.input("x", (3,))
    y = np.float32(2.0) * x  # a NumPy scalar is a Python number
    assert y.dtype is DType.f32 and y.node.op == "mul"
    assert (np.int64(3) // g.input("k", (3,), DType.i32)).dtype is DType.i32


def test_numpy_arrays_on_the_left_are_lifted_inside_a_trace():
    class Net(mn.nn.Module):
        def forward(self, x):
            return np.arange(3, dtype=np.int64) * x + np.float64(0.5) ** x, np.full(3, 2) > x

    x = np.array([0.5, 1.5, -2.0], np.float32)
    y, gt = Net()(x)
    np.testing.assert_allclose(y, np.arange(3) * x + 0.5**x, rtol=1e-6)
    assert y.dtype == np.float32 and gt.dtype == np.bool_ and (gt == (2 > x)).all()
