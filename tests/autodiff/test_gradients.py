"""Gradients from ``differentiate`` evaluated by the NumPy interpreter in float64, against
torch.autograd in float64 (no GPU).

Every case builds ``loss = sum(op(...) * R)`` with a fixed random R, so the upstream gradient
is not all ones, differentiates with respect to the float operands (declared as parameters)
and compares each gradient with torch's: relative error (max abs difference over max abs
reference) at most 1e-10. Inputs stay away from non-differentiable points (relu at 0,
max/min ties) except in the dedicated amax tie test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.dtypes import DType, f32
from meganeura.graph.builder import GraphBuilder, Tensor
from meganeura.graph.interpret import interpret
from meganeura.ops import OPS
from meganeura.ops import functional as F

from ..ids import dims_id

RTOL = 1e-10


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal(*shape: int, seed: int = 0) -> np.ndarray:
    return _rng(seed).standard_normal(shape)


def positive(*shape: int, seed: int = 0) -> np.ndarray:
    return _rng(seed).uniform(0.5, 2.0, shape)


def away_from_zero(*shape: int, seed: int = 0) -> np.ndarray:
    r = _rng(seed)
    return r.uniform(0.1, 2.0, shape) * r.choice([-1.0, 1.0], shape)


def distinct_pair(shape_a, shape_b, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays whose broadcast elements differ by at least 0.05 (no max/min ties), the
    second at least 0.1 away from zero (a safe denominator)."""
    for s in range(seed, seed + 1000):
        a = normal(*shape_a, seed=s)
        b = normal(*shape_b, seed=s + 1000)
        if np.min(np.abs(a - b)) >= 0.05 and np.min(np.abs(b)) >= 0.1:
            return a, b
    raise AssertionError("no seed gave a tie-free pair")


@dataclass
class Case:
    """``mg`` and ``th`` compute the same function of the dict of operands."""

    id: str
    mg: Callable[[dict[str, Tensor]], Tensor]
    th: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    params: dict[str, np.ndarray]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


def _dtype(a: np.ndarray) -> DType:
    return f32 if a.dtype == np.float64 else DType.from_numpy(a.dtype)


def run_meganeura(case: Case, seed: int = 7):
    """Returns (loss value, {param: gradient}, R, forward graph id of op output)."""
    b = GraphBuilder()
    t: dict[str, Tensor] = {k: b.parameter(k, v.shape) for k, v in case.params.items()}
    t.update({k: b.input(k, v.shape, _dtype(v)) for k, v in case.inputs.items()})
    y = case.mg(t)
    r = normal(*y.shape, seed=seed)
    loss = F.sum(y * b.input("R", y.shape))
    b.output("loss", loss)
    g, grads = differentiate(b.build(), "loss", list(case.params))
    vals, params_after, _ = interpret(g, {**case.inputs, "R": r}, case.params, float64=True)
    for k, v in params_after.items():  # differentiate must not append effects
        np.testing.assert_array_equal(v, case.params[k])
    by_name = {g.nodes[p].name: vals[gid] for p, gid in grads.items()}
    for k, v in by_name.items():
        assert v.dtype == np.float64
        assert v.shape == case.params[k].shape, k
    return float(vals[loss.id]), by_name, r


def run_torch(case: Case, r: np.ndarray):
    tp = {
        k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in case.params.items()
    }
    ti = {k: torch.from_numpy(v) for k, v in case.inputs.items()}
    loss = (case.th({**tp, **ti}) * torch.from_numpy(r)).sum()
    loss.backward()
    grads = {}
    for k, v in tp.items():
        grads[k] = np.zeros(v.shape) if v.grad is None else v.grad.numpy()
    return float(loss.detach()), grads


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want), initial=0.0))
    diff = float(np.max(np.abs(got - want), initial=0.0))
    return diff / scale if scale > 0 else diff


def check(case: Case) -> dict[str, np.ndarray]:
    loss, grads, r = run_meganeura(case)
    want_loss, want = run_torch(case, r)
    assert abs(loss - want_loss) <= RTOL * max(1.0, abs(want_loss)), (loss, want_loss)
    assert grads.keys() == want.keys()
    for k in want:
        assert rel_err(grads[k], want[k]) <= RTOL, (k, rel_err(grads[k], want[k]))
    return grads


def C(id, mg, th, params, inputs=None) -> Case:  # noqa: N802 - a short constructor for tables
    return Case(id, mg, th, params, inputs or {})


def _ce(ignore_index, reduction):
    def mg(t):
        return F.cross_entropy(t["x"], t["t"], ignore_index=ignore_index, reduction=reduction)

    def th(t):
        return torch.nn.functional.cross_entropy(
            t["x"], t["t"].long(), ignore_index=ignore_index, reduction=reduction
        )

    return mg, th


A45, B45 = distinct_pair((4, 5), (4, 5))
A41, B5 = distinct_pair((4, 1), (5,), seed=3)
X345 = normal(3, 4, 5, seed=11)
TARGET = np.array([0, 4, -100, 2, 3, -100], np.int32)
TARGET_IGNORE_2 = np.array([2, 1, 2, 0, 4, 3], np.int32)
COND = _rng(5).random((4, 5)) > 0.5
COND41 = np.array([[True], [False], [True], [True]])

UNARY = [
    C("neg", lambda t: -t["x"], lambda t: -t["x"], {"x": normal(4, 5)}),
    C("exp", lambda t: F.exp(t["x"]), lambda t: torch.exp(t["x"]), {"x": normal(4, 5)}),
    C("log", lambda t: F.log(t["x"]), lambda t: torch.log(t["x"]), {"x": positive(4, 5)}),
    C("sqrt", lambda t: F.sqrt(t["x"]), lambda t: torch.sqrt(t["x"]), {"x": positive(4, 5)}),
    C("relu", lambda t: F.relu(t["x"]), lambda t: torch.relu(t["x"]), {"x": away_from_zero(4, 5)}),
    C("tanh", lambda t: F.tanh(t["x"]), lambda t: torch.tanh(t["x"]), {"x": normal(4, 5)}),
    C(
        "sigmoid",
        lambda t: F.sigmoid(t["x"]),
        lambda t: torch.sigmoid(t["x"]),
        {"x": normal(4, 5) * 8},
    ),
]

A213, B41 = distinct_pair((2, 1, 3), (4, 1), seed=6)
BINARY = []
for _name, _mg, _th in [
    ("add", lambda a, b: a + b, lambda a, b: a + b),
    ("sub", lambda a, b: a - b, lambda a, b: a - b),
    ("mul", lambda a, b: a * b, lambda a, b: a * b),
    ("div", lambda a, b: a / b, lambda a, b: a / b),
    ("maximum", F.maximum, torch.maximum),
    ("minimum", F.minimum, torch.minimum),
]:
    # Same shapes; [4,1] with [5] (gradients summed back to [4,1] and [5]); and [2,1,3] with
    # [4,1] (a rank difference plus a size-1 dim in the middle).
    for _suffix, _a, _b in [
        ("", A45, B45),
        ("_broadcast_41_5", A41, B5),
        ("_broadcast_213_41", A213, B41),
    ]:
        BINARY.append(
            C(
                f"{_name}{_suffix}",
                lambda t, f=_mg: f(t["a"], t["b"]),
                lambda t, f=_th: f(t["a"], t["b"]),
                {"a": _a, "b": _b},
            )
        )
BINARY += [
    C(
        "scalar_operands",
        lambda t: 2.0 - t["x"] / 3.0 + 1.5 * t["x"],
        lambda t: 2.0 - t["x"] / 3.0 + 1.5 * t["x"],
        {"x": normal(3)},
    ),
    C(
        "scalar_shaped_param",
        lambda t: t["x"] * t["s"],
        lambda t: t["x"] * t["s"],
        {"x": normal(3, 2), "s": np.array(1.7)},
    ),
]

WHERE = [
    C(
        "where",
        lambda t: F.where(t["c"], t["a"], t["b"]),
        lambda t: torch.where(t["c"], t["a"], t["b"]),
        {"a": A45, "b": B45},
        {"c": COND},
    ),
    C(
        "where_broadcast",
        lambda t: F.where(t["c"], t["a"], t["b"]),
        lambda t: torch.where(t["c"], t["a"], t["b"]),
        {"a": A41, "b": B5},
        {"c": COND},
    ),
    C(
        "where_cond_broadcast",
        lambda t: F.where(t["c"], t["a"], t["b"]),
        lambda t: torch.where(t["c"], t["a"], t["b"]),
        {"a": A45, "b": np.array(0.3)},
        {"c": COND41},
    ),
    C(
        "where_from_comparison",
        lambda t: F.where(t["a"] > t["b"], t["a"] * t["b"], t["b"]),
        lambda t: torch.where(t["a"] > t["b"], t["a"] * t["b"], t["b"]),
        {"a": A45, "b": B45},
    ),
]

REDUCE = []
for _dim in [None, 0, 1, -1, (0, 2), (2, 0, 1)]:
    for _keep in [False, True]:
        for _name, _mg, _th in [
            ("sum", F.sum, torch.sum),
            ("mean", F.mean, torch.mean),
            ("amax", F.amax, torch.amax),
        ]:
            if _dim is None:
                th_dim = tuple(range(3))
            else:
                th_dim = _dim
            REDUCE.append(
                C(
                    f"{_name}_{dims_id(_dim)}" + ("_keepdim" if _keep else ""),
                    lambda t, f=_mg, d=_dim, k=_keep: f(t["x"], d, keepdim=k),
                    lambda t, f=_th, d=th_dim, k=_keep: f(t["x"], d, keepdim=k),
                    {"x": X345},
                )
            )
REDUCE.append(
    C(
        "tensor_methods",
        lambda t: t["x"].sum(1) + t["x"].mean(1) + t["x"].max(1).values + t["x"].amin(1),
        lambda t: t["x"].sum(1) + t["x"].mean(1) + t["x"].max(1).values + t["x"].amin(1),
        {"x": X345},
    )
)

SHAPE = [
    C(
        "reshape",
        lambda t: F.reshape(t["x"], (12, 5)) * 1.0,
        lambda t: t["x"].reshape(12, 5),
        {"x": X345},
    ),
    C(
        "reshape_then_nonlinear",
        lambda t: F.tanh(t["x"].reshape(5, 2, 6)),
        lambda t: torch.tanh(t["x"].reshape(5, 2, 6)),
        {"x": X345},
    ),
    C(
        "permute",
        lambda t: F.permute(t["x"], (2, 0, 1)),
        lambda t: t["x"].permute(2, 0, 1),
        {"x": X345},
    ),
    C("transpose", lambda t: F.exp(t["x"].mT), lambda t: torch.exp(t["x"].mT), {"x": X345}),
    C(
        "broadcast_to_41",
        lambda t: F.broadcast_to(t["x"], (2, 4, 3)),
        lambda t: t["x"].broadcast_to(2, 4, 3),
        {"x": normal(4, 1)},
    ),
    C(
        "broadcast_to_5",
        lambda t: F.broadcast_to(t["x"], (3, 5)),
        lambda t: t["x"].broadcast_to(3, 5),
        {"x": normal(5)},
    ),
    C(
        "flatten",
        lambda t: F.sigmoid(F.flatten(t["x"], 1)),
        lambda t: torch.sigmoid(t["x"].flatten(1)),
        {"x": X345},
    ),
]

MATMUL = []
for _sa, _sb in [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((3, 1, 2, 4), (1, 4, 4, 5)),  # [3,1,M,K] @ [1,4,K,N]
    ((2, 3, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (3, 4, 2)),
]:
    MATMUL.append(
        C(
            f"matmul_{'x'.join(map(str, _sa))}_{'x'.join(map(str, _sb))}",
            lambda t: t["a"] @ t["b"],
            lambda t: t["a"] @ t["b"],
            {"a": normal(*_sa, seed=1), "b": normal(*_sb, seed=2)},
        )
    )

SOFTMAX = []
for _dim in [0, 1, 2, -1]:
    SOFTMAX.append(
        C(
            f"softmax_dim{_dim}",
            lambda t, d=_dim: F.softmax(t["x"], d),
            lambda t, d=_dim: torch.softmax(t["x"], d),
            {"x": X345 * 3},
        )
    )
    SOFTMAX.append(
        C(
            f"log_softmax_dim{_dim}",
            lambda t, d=_dim: F.log_softmax(t["x"], d),
            lambda t, d=_dim: torch.log_softmax(t["x"], d),
            {"x": X345 * 3},
        )
    )
# exp(900) overflows even float64: the reference must subtract the row maximum.
SOFTMAX.append(
    C(
        "log_softmax_large_logits",
        lambda t: F.log_softmax(t["x"], 1),
        lambda t: torch.log_softmax(t["x"], 1),
        {"x": normal(3, 4) * 300},
    )
)

LOSS = [
    C("cross_entropy_mean_ignore", *_ce(-100, "mean"), {"x": normal(6, 5)}, {"t": TARGET}),
    C("cross_entropy_sum_ignore", *_ce(-100, "sum"), {"x": normal(6, 5)}, {"t": TARGET}),
    C("cross_entropy_mean_ignore_2", *_ce(2, "mean"), {"x": normal(6, 5)}, {"t": TARGET_IGNORE_2}),
    C("cross_entropy_sum_ignore_2", *_ce(2, "sum"), {"x": normal(6, 5)}, {"t": TARGET_IGNORE_2}),
    C(
        "cross_entropy_mean_none_ignored",
        *_ce(-100, "mean"),
        {"x": normal(6, 5) * 4},
        {"t": TARGET_IGNORE_2},
    ),
    C(
        "cross_entropy_after_linear",
        lambda t: F.cross_entropy(t["x"] @ t["w"], t["t"]),
        lambda t: torch.nn.functional.cross_entropy(t["x"] @ t["w"], t["t"].long()),
        {"x": normal(6, 3), "w": normal(3, 5, seed=1)},
        {"t": TARGET},
    ),
    C(
        "mse_loss_mean",
        lambda t: F.mse_loss(t["a"], t["b"]),
        lambda t: torch.nn.functional.mse_loss(t["a"], t["b"]),
        {"a": A45, "b": B45},
    ),
    C(
        "mse_loss_sum",
        lambda t: F.mse_loss(t["a"], t["b"], reduction="sum"),
        lambda t: torch.nn.functional.mse_loss(t["a"], t["b"], reduction="sum"),
        {"a": A45, "b": B45},
    ),
    C(
        "linear",
        lambda t: F.linear(t["x"], t["w"], t["b"]),
        lambda t: torch.nn.functional.linear(t["x"], t["w"], t["b"]),
        {"x": normal(6, 4), "w": normal(3, 4, seed=1), "b": normal(3, seed=2)},
    ),
    C(
        "linear_no_bias",
        lambda t: F.linear(t["x"], t["w"]),
        lambda t: torch.nn.functional.linear(t["x"], t["w"]),
        {"x": normal(6, 4), "w": normal(3, 4, seed=1)},
    ),
    C(
        "linear_batched",
        lambda t: F.linear(t["x"], t["w"], t["b"]),
        lambda t: torch.nn.functional.linear(t["x"], t["w"], t["b"]),
        {"x": normal(2, 6, 4), "w": normal(3, 4, seed=1), "b": normal(3, seed=2)},
    ),
]

COMPOSITE = [
    # x is read three times (by two nodes); contributions must accumulate.
    C(
        "fan_out",
        lambda t: t["x"] * t["x"] + F.tanh(t["x"]),
        lambda t: t["x"] * t["x"] + torch.tanh(t["x"]),
        {"x": normal(4, 5)},
    ),
    C(
        "fan_out_broadcast",
        lambda t: (t["a"] + t["b"]) * t["a"] - F.exp(t["b"]),
        lambda t: (t["a"] + t["b"]) * t["a"] - torch.exp(t["b"]),
        {"a": A41, "b": B5},
    ),
    C(
        "stop_gradient",
        lambda t: t["x"] * F.stop_gradient(F.exp(t["x"])),
        lambda t: t["x"] * torch.exp(t["x"]).detach(),
        {"x": normal(4, 5)},
    ),
    C(
        "mlp",
        lambda t: F.cross_entropy(
            F.linear(F.relu(F.linear(t["x"], t["w1"], t["b1"])), t["w2"], t["b2"]), t["t"]
        ),
        lambda t: torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(
                torch.relu(torch.nn.functional.linear(t["x"], t["w1"], t["b1"])), t["w2"], t["b2"]
            ),
            t["t"].long(),
        ),
        {
            "x": normal(6, 4),
            "w1": normal(7, 4, seed=1),
            "b1": normal(7, seed=2) + 0.05,
            "w2": normal(5, 7, seed=3),
            "b2": normal(5, seed=4),
        },
        {"t": TARGET},
    ),
]

ALL = UNARY + BINARY + WHERE + REDUCE + SHAPE + MATMUL + SOFTMAX + LOSS + COMPOSITE


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_gradient_matches_torch(case):
    grads = check(case)
    for k, g in grads.items():  # a vacuous all-zero gradient would hide a missing rule
        assert np.max(np.abs(g)) > 1e-6, k


def test_case_ids_are_unique():
    ids = [c.id for c in ALL]
    assert len(ids) == len(set(ids))


def _forward_ops(case: Case) -> set[str]:
    b = GraphBuilder()
    t: dict[str, Tensor] = {k: b.parameter(k, v.shape) for k, v in case.params.items()}
    t.update({k: b.input(k, v.shape, _dtype(v)) for k, v in case.inputs.items()})
    case.mg(t)
    return {n.op for n in b.nodes}


def test_every_op_has_a_gradient_rule_or_the_mark_and_every_rule_is_tested():
    for name, d in OPS.items():
        assert (d.grad is not None) != (not d.differentiable), name
    covered = set().union(*(_forward_ops(c) for c in ALL)) | {"cast"}  # cast: tests below
    # Ops added with the op database have their gradients checked there, on the GPU path.
    from tests.opinfo import DATABASE

    covered |= {op for info in DATABASE if info.differentiable for op in info.ops}
    untested = {name for name, d in OPS.items() if d.grad is not None} - covered
    assert not untested, sorted(untested)


def _cast_f32(x: Tensor) -> Tensor:
    # F.cast elides a cast to the same dtype; the builder still accepts the node.
    return x.builder.add("cast", [x], {"dtype": "float32"})


def test_cast_f32_to_f32_passes_the_gradient_through():
    x = normal(4, 5)
    _, grads, r = run_meganeura(C("cast", lambda t: _cast_f32(t["x"]) * 2.0, None, {"x": x}))
    np.testing.assert_array_equal(grads["x"], 2.0 * r)


def test_cast_gradient_before_nonlinear_op():
    check(
        C(
            "cast_f32_f32_exp",
            lambda t: F.exp(_cast_f32(t["x"])),
            lambda t: torch.exp(t["x"]),
            {"x": normal(4, 5)},
        )
    )


def test_stop_gradient_excludes_the_stopped_path():
    x = normal(4, 5)
    case = C(
        "sg",
        lambda t: t["x"] * F.stop_gradient(F.exp(t["x"])),
        lambda t: t["x"] * torch.exp(t["x"]).detach(),
        {"x": x},
    )
    _, grads, r = run_meganeura(case)
    np.testing.assert_allclose(grads["x"], r * np.exp(x), rtol=1e-14)  # not r*(1+x)*exp(x)


def test_fully_stopped_parameter_gets_zero_gradient():
    case = C(
        "sg_all",
        lambda t: F.stop_gradient(t["x"]) * 2.0 + t["y"],
        lambda t: t["x"].detach() * 2.0 + t["y"],
        {"x": normal(3), "y": normal(3)},
    )
    _, grads, r = run_meganeura(case)
    np.testing.assert_array_equal(grads["x"], np.zeros(3))
    np.testing.assert_array_equal(grads["y"], r)


def test_parameter_not_reaching_loss_gets_zero_gradient():
    b = GraphBuilder()
    x = b.parameter("x", (4, 5))
    unused = b.parameter("unused", (2, 3))
    b.output("aux", F.exp(unused))  # used, but not by the loss
    b.output("loss", F.sum(x * x))
    g, grads = differentiate(b.build(), "loss", ["x", "unused"])
    xv = normal(4, 5)
    vals, _, _ = interpret(g, {}, {"x": xv, "unused": normal(2, 3)}, float64=True)
    gu = vals[grads[unused.id]]
    assert gu.shape == (2, 3)
    np.testing.assert_array_equal(gu, np.zeros((2, 3)))
    np.testing.assert_allclose(vals[grads[x.id]], 2 * xv, rtol=1e-15)


def test_gradient_with_respect_to_an_input_and_an_intermediate():
    b = GraphBuilder()
    x = b.input("x", (3,))
    h = F.exp(x)
    b.output("loss", F.sum(h * h))
    g, grads = differentiate(b.build(), "loss", ["x", h.id])
    xv = normal(3)
    vals, _, _ = interpret(g, {"x": xv}, float64=True)
    np.testing.assert_allclose(vals[grads[h.id]], 2 * np.exp(xv), rtol=1e-14)
    np.testing.assert_allclose(vals[grads[x.id]], 2 * np.exp(2 * xv), rtol=1e-14)


def test_loss_must_be_a_floating_scalar():
    b = GraphBuilder()
    x = b.parameter("x", (3,))
    b.output("y", F.exp(x))
    with pytest.raises(ValueError, match="loss must be a floating scalar, got 'y' "):
        differentiate(b.build(), "y", ["x"])


def test_an_unknown_loss_name_lists_the_outputs():
    b = GraphBuilder()
    x = b.parameter("x", (3,))
    b.output("total", F.sum(x))
    with pytest.raises(ValueError) as ei:
        differentiate(b.build(), "loss", ["x"])
    msg = str(ei.value)
    assert "no output named 'loss'; the graph's outputs are 'total'" in msg, msg
    with pytest.raises(ValueError, match="wrt 'w': no leaf named 'w'; the leaves are 'x'"):
        differentiate(b.build(), "total", ["w"])


@pytest.mark.parametrize("keepdim", [False, True], ids=["drop", "keepdim"])
def test_amax_ties_split_the_gradient_equally(keepdim):
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, 1.0, 1.0, 1.0]])
    case = C(
        "amax_ties",
        lambda t: F.amax(t["x"], 1, keepdim=keepdim),
        lambda t: torch.amax(t["x"], 1, keepdim=keepdim),
        {"x": x},
    )
    grads = check(case)
    _, _, r = run_meganeura(case)
    r = r.reshape(3)
    want = np.array(
        [
            [0, r[0] / 2, r[0] / 2, 0],
            [r[1] / 4] * 4,
            [r[2], 0, 0, 0],
        ]
    )
    np.testing.assert_allclose(grads["x"], want, rtol=1e-15)


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_maximum_minimum_ties_split_like_torch(op):
    a = np.array([1.0, 2.0, -0.5])
    b = np.array([1.0, 3.0, -0.5])
    check(
        C(
            f"{op}_ties",
            lambda t: getattr(F, op)(t["a"], t["b"]),
            lambda t: getattr(torch, op)(t["a"], t["b"]),
            {"a": a, "b": b},
        )
    )


def test_amax_ties_over_all_dims():
    x = np.array([[4.0, 1.0], [4.0, 4.0]])
    grads = check(C("amax_all", lambda t: F.amax(t["x"]), lambda t: torch.amax(t["x"]), {"x": x}))
    _, _, r = run_meganeura(C("amax_all", lambda t: F.amax(t["x"]), None, {"x": x}))
    np.testing.assert_allclose(grads["x"], np.array([[1, 0], [1, 1]]) * float(r) / 3, rtol=1e-15)
