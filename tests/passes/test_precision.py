"""``narrow_storage``: which values the fast mode stores as f16 (no GPU)."""

from __future__ import annotations

from meganeura.compile import CompileOptions, _training_graph
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.models.mlp import build_mlp
from meganeura.ops import functional as F
from meganeura.optim import SGD
from meganeura.passes.precision import narrow_storage


def _forward():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    w = b.parameter("w", (8, 8))
    h = F.relu(x @ w)  # matmul and relu: activations
    r = F.reshape(h, (32,))  # a view of relu's storage
    b.output("s", F.sum(r * 2.0))  # sum: kept f32 (and an output)
    b.output("h2", h * 3.0)  # an output: kept f32
    return b.build()


def test_forward_rules():
    g = _forward()
    plan, half = narrow_storage(g, parameters=True)
    dt = {n.op: n.type.dtype for n in plan.nodes}
    assert dt["matmul"] is DType.f16 and dt["relu"] is DType.f16
    assert dt["reshape"] is DType.f16  # follows its storage owner
    assert dt["parameter"] is DType.f16 and dt["input"] is DType.f32
    assert dt["sum"] is DType.f32
    assert all(plan[v].type.dtype is DType.f32 for _, v in plan.outputs)
    assert {n.id for n in plan.nodes if n.type.dtype is DType.f16} == set(half)
    # same nodes, same wiring: only types change
    assert [(n.op, n.inputs) for n in plan.nodes] == [(n.op, n.inputs) for n in g.nodes]


def test_parameters_stay_f32_unless_allowed_and_keep_is_honoured():
    g = _forward()
    plan, _ = narrow_storage(g)
    assert plan.leaves("parameter")[0].type.dtype is DType.f32
    relu = next(n.id for n in g.nodes if n.op == "relu")
    plan, half = narrow_storage(g, keep=[relu + 1])  # keep the reshape: its owner stays f32
    assert relu not in half and plan[relu].type.dtype is DType.f32


def test_training_keeps_gradients_and_clipping_in_f32():
    g, master = _training_graph(
        build_mlp(8, (16, 8, 4)).graph,
        CompileOptions(loss="loss", optimizer=SGD(lr=0.1), max_grad_norm=1.0),
    )
    plan, half = narrow_storage(g, master)
    assert half  # activations are narrowed
    assert not half & master
    for n in plan.nodes:
        if n.op == "sgd_update":
            assert all(plan[i].type.dtype is not DType.f16 for i in n.inputs)
        if n.op in ("parameter", "state", "input"):
            assert n.type.dtype is not DType.f16
