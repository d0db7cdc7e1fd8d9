"""Optimizer update and gradient-accumulation kernels against ops/update.py's references,
over several steps."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import ValueRef
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret

from .harness import run

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(11)
SHAPE = (37, 29)  # not a multiple of the workgroup size


def _graph(op: str, attrs: dict, n_state: int, n_hyper: int, clip_const: bool):
    b = GraphBuilder()
    p = b.parameter("w", SHAPE)
    g = b.input("grad", SHAPE)
    hyper = b.input("hyper", (n_hyper,))
    clip = b.constant(1.0) if clip_const else b.input("clip", ())
    st = [b.state(f"w.s{i}", SHAPE) for i in range(n_state)]
    b.add(op, [p, g, hyper, clip, *st], attrs)
    return b.build_unverified()


SGD = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
ADAM = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, maximize=False)
CASES = [
    ("sgd_update", SGD, 0, False),
    ("sgd_update", {**SGD, "weight_decay": 0.01, "maximize": True}, 0, True),
    ("sgd_momentum_update", {**SGD, "momentum": 0.9}, 1, False),
    ("sgd_momentum_update", {**SGD, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-3}, 1,
     True),
    ("sgd_momentum_update", {**SGD, "momentum": 0.8, "nesterov": True}, 1, False),
    ("adam_update", ADAM, 2, False),
    ("adam_update", {**ADAM, "weight_decay": 0.05}, 2, True),
    ("adam_update", {**ADAM, "weight_decay": 0.05, "decoupled": True, "maximize": True}, 2, False),
    ("adam_update", {**ADAM, "beta1": 0.5, "beta2": 0.9, "eps": 1e-3}, 2, True),
]  # fmt: skip


def _hyper(op: str, step: int, attrs: dict) -> np.ndarray:
    lr = 0.05
    if op != "adam_update":
        return np.array([lr, 1.0 if step == 0 else 0.0], np.float32)
    t = step + 1
    bc1, bc2 = 1 - attrs["beta1"] ** t, 1 - attrs["beta2"] ** t
    return np.array([lr, lr / bc1, np.sqrt(bc2)], np.float32)


def _case_id(case: tuple) -> str:
    """The op, the attributes that differ from its defaults, and whether clip is a constant."""
    op, attrs, _, clip_const = case
    base = ADAM if op == "adam_update" else SGD
    changed = [k for k, v in attrs.items() if v != base[k]] or ["defaults"]
    return "-".join([op, *changed, *(["const_clip"] if clip_const else [])])


@pytest.mark.parametrize("op,attrs,n_state,clip_const", CASES, ids=[_case_id(c) for c in CASES])
def test_updates_match_reference_over_steps(op, attrs, n_state, clip_const):
    n_hyper = 3 if op == "adam_update" else 2
    graph = _graph(op, attrs, n_state, n_hyper, clip_const)
    params = {"w": rng.standard_normal(SHAPE).astype(np.float32)}
    state: dict[str, np.ndarray] = {}
    ref_params, ref_state = dict(params), dict(state)
    for step in range(3):
        feeds = {"grad": rng.standard_normal(SHAPE).astype(np.float32),
                 "hyper": _hyper(op, step, attrs), "clip": np.float32(0.6)}  # fmt: skip
        if clip_const:
            del feeds["clip"]
        res = run(graph, feeds, params, state)
        _, ref_params, ref_state = interpret(graph, feeds, ref_params, ref_state)
        for k, v in ref_params.items():
            np.testing.assert_allclose(res.params[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
        for k, v in ref_state.items():
            np.testing.assert_allclose(res.state[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
        assert not np.array_equal(res.params["w"], params["w"])  # it moved
        params, state = res.params, res.state
    (k,) = res.kernels
    token = len(graph.nodes) - 1
    refs = [r for r in k.bindings if isinstance(r, ValueRef)]
    assert all(r.node != token for r in refs)  # the token is never bound
    written = {graph[r.node].name for r in refs if r.write}
    assert written == {"w", *(f"w.s{i}" for i in range(n_state))}


@pytest.mark.parametrize("shape", [(37, 29), (4,), ()], ids=["37x29", "4", "scalar"])
def test_accumulate_matches_reference(shape):
    b = GraphBuilder()
    acc = b.state("w.grad_accum", shape)
    b.add("accumulate", [acc, b.input("value", shape), b.input("first", ())])
    graph = b.build_unverified()
    state = {"w.grad_accum": np.full(shape, np.nan, np.float32)}  # stale NaN: dropped by first
    total = np.zeros(shape, np.float32)
    for step, first in enumerate([1, 0, 0, 1, 0]):
        value = rng.standard_normal(shape).astype(np.float32)
        feeds = {"value": value, "first": np.float32(first)}
        res = run(graph, feeds, {}, state)
        _, _, ref = interpret(graph, feeds, {}, state)
        total = value if first else total + value
        np.testing.assert_array_equal(res.state["w.grad_accum"], ref["w.grad_accum"])
        np.testing.assert_array_equal(res.state["w.grad_accum"], total, err_msg=f"step {step}")
        state = res.state
