"""Fusion: which nodes ``plan_fusion`` groups, and that fused programs compute exactly what the
unfused ones do (GPU tests on lavapipe), with fewer dispatches and no buffer bound twice.

Fused and unfused results are compared with ``np.array_equal``: a fused kernel performs the
same f32 operations in the same order as the kernels it replaces (an f32 value stored and
reloaded is unchanged). A shader compiler may still rewrite arithmetic across former kernel
boundaries (Vulkan allows contraction and algebraic simplification; lavapipe folds
``(a - b) + b`` to ``a``), so the graphs here avoid such patterns rather than loosening the
comparison: on them any difference would be a fusion bug, not rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura import manual_seed
from meganeura.codegen.kernel import Limits, ValueRef
from meganeura.codegen.wgsl.elementwise.maps import FUSIBLE
from meganeura.compile import CompileOptions, build_training_graph, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.graph.ir import Graph
from meganeura.models.mlp import build_mlp
from meganeura.models.transformer import TransformerConfig, build_transformer
from meganeura.ops import elementwise as E
from meganeura.ops import functional as F
from meganeura.ops.activation import gelu, silu
from meganeura.optim import HYPER_INPUT, SGD, AdamW
from meganeura.passes import cse, dce
from meganeura.passes.fuse import plan_fusion
from meganeura.schedule.schedule import schedule

from ..ids import shape_id

RNG = np.random.default_rng(0)


def _simplified(graph: Graph) -> Graph:
    graph, _ = dce(graph)
    graph, _ = cse(graph)
    return dce(graph)[0]


def _mlp_training_graph() -> Graph:
    options = CompileOptions(loss="loss", optimizer=AdamW())
    return _simplified(build_training_graph(build_mlp(64).graph, options))


def _ops(graph: Graph, ids) -> list[str]:
    return [graph[i].op for i in ids]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_mlp_step_fuses_bias_relu_and_the_relu_mask_into_matmuls():
    g = _mlp_training_graph()
    groups = {tuple(_ops(g, grp.members)): grp for grp in plan_fusion(g, FUSIBLE)}
    assert set(groups) == {
        ("matmul", "add", "relu"),  # fc1: x @ W1^T + b1, relu
        ("matmul", "add"),  # fc2: logits
        ("matmul", "less_equal", "where"),  # backward through relu (threshold_backward)
    }
    fc1 = groups[("matmul", "add", "relu")]
    assert fc1.anchor == fc1.members[0]
    # the pre-activation is read by the backward mask, the activation by the next matmul
    assert _ops(g, fc1.outputs) == ["add", "relu"]
    mask = groups[("matmul", "less_equal", "where")]
    assert _ops(g, mask.outputs) == ["where"]  # the comparison is never stored


def test_mlp_step_has_fewer_dispatches_with_fusion():
    mlp = build_mlp(64).graph
    options = CompileOptions(loss="loss", optimizer=AdamW())
    off = compile(mlp, CompileOptions(loss="loss", optimizer=AdamW(), fuse=False))
    on = compile(mlp, options)
    assert options.fuse  # on by default
    # 15 from fusing kernels, minus 3 from the four Adam updates running as one kernel
    assert (len(off.dispatches), len(on.dispatches)) == (20, 12)
    assert not any("+" in d.name for d in off.dispatches)


def test_fuse_false_schedules_one_kernel_per_node():
    g = _mlp_training_graph()
    sched = schedule(g, Limits(), fuse=False)
    assert sched.groups == ()
    assert [nid for nid, _ in sched.dispatches] == sorted(nid for nid, _ in sched.dispatches)


def test_intermediate_read_before_the_group_ends_is_stored_not_fused_away():
    b = GraphBuilder()
    x, y = b.input("x", (3, 5)), b.input("y", (3, 5))
    a = x * y
    r = F.sum(a, dim=1, keepdim=True)  # reads `a` before the chain below ends
    b.output("out", F.exp(a) + r)
    g = b.build()
    groups = plan_fusion(g, FUSIBLE)
    assert [_ops(g, grp.members) for grp in groups] == [["exp", "add"]]
    assert all(a.id not in grp.members for grp in groups)


def test_intermediate_with_a_later_outside_reader_becomes_a_second_output():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    a = x * 3.0
    b.output("e", F.exp(a))
    b.output("s", F.sum(a))  # `a` is needed after the group: stored, not recomputed
    g = b.build()
    (grp,) = plan_fusion(g, FUSIBLE)
    assert _ops(g, grp.members) == ["mul", "exp"]
    assert grp.outputs == grp.members


def test_smaller_intermediate_broadcast_into_the_chain_is_not_stored():
    b = GraphBuilder()
    x, y = b.input("x", (4, 1)), b.input("y", (4, 5))
    b.output("out", F.exp(x) * y)
    g = b.build()
    (grp,) = plan_fusion(g, FUSIBLE)
    assert grp.shape == (4, 5) and _ops(g, grp.outputs) == ["mul"]
    # ...but a smaller member that must be stored keeps its own kernel.
    b = GraphBuilder()
    x, y = b.input("x", (4, 1)), b.input("y", (4, 5))
    e = F.exp(x)
    b.output("e", e)
    b.output("out", e * y)
    assert plan_fusion(b.build(), FUSIBLE) == ()


def test_no_group_spans_an_in_place_update():
    g = _simplified(build_training_graph(build_mlp(8, (6, 5, 3)).graph, _adamw()))
    effects = [n.id for n in g.nodes if n.op == "adam_update"]
    for grp in plan_fusion(g, FUSIBLE):
        assert not any(grp.members[0] < e < grp.sink for e in effects)


def _adamw() -> CompileOptions:
    return CompileOptions(loss="loss", optimizer=AdamW())


@pytest.mark.parametrize("which", ["mlp", "transformer"])
def test_fused_kernels_bind_each_buffer_once_and_no_constant(which):
    if which == "mlp":
        g = _mlp_training_graph()
    else:
        net = build_transformer(1, 32, TransformerConfig(num_layers=1))
        g = _simplified(build_training_graph(net.graph, _adamw()))
    sched = schedule(g, Limits(), fuse=True)
    assert sched.groups
    # A layer_norm / rms_norm backward pair (passes.fuse_norm) is two kernels at its sink (the
    # first named "+add" where the residual add joined it); every other group one kernel named
    # with a "+".
    norms = ("layer_norm_backward", "rms_norm_backward")
    pairs = {
        grp.sink for grp in sched.groups if grp.anchor is not None and g[grp.anchor].op in norms
    }
    fused = [ks for nid, ks in sched.dispatches if "+" in ks.name and nid not in pairs]
    # less matmuls sharing one dispatch outside any group (matmul.split_group)
    names = {"+".join(map(str, grp.members)) for grp in sched.groups}

    def split(ks) -> bool:
        ids = ks.name.split()[0][1:]
        return ids not in names and {g[int(i)].op for i in ids.split("+")} == {"matmul"}

    fused = [ks for ks in fused if not split(ks)]
    assert len(fused) == len(sched.groups) - len(pairs)
    paired = [ks for nid, ks in sched.dispatches if nid in pairs]
    assert len(paired) == 2 * len(pairs)
    fused += paired
    for ks in fused:
        values = [r.node for r in ks.bindings if isinstance(r, ValueRef)]
        assert len(values) == len(set(values)), ks.name
        assert all(g[v].op != "constant" for v in values), ks.name
    stored = {m for grp in sched.groups for m in grp.outputs}
    hidden = {m for grp in sched.groups for m in grp.members} - stored
    bound = {r.node for _, ks in sched.dispatches for r in ks.bindings if isinstance(r, ValueRef)}
    assert not hidden & bound  # members that are not outputs get no storage at all


# ---- execution (GPU) --------------------------------------------------------------------------
def _run_training(graph, params, feeds, fuse, device, steps=3):
    from meganeura.training import compile_for

    opt = AdamW(lr=1e-2)
    prog, sess = compile_for(graph, CompileOptions("loss", opt, fuse=fuse), device)
    sess.load_state_dict({**{k: sess.read(k) for k in prog.state}, **params})
    losses = []
    for step in range(steps):
        out = sess.run({**feeds, HYPER_INPUT: opt.hyper(step, opt.lr)}, ["loss", "logits"])
        losses.append(out["loss"])
    return losses, out["logits"], sess.state_dict(), len(prog.dispatches)


def _assert_same_training(graph, params, feeds, device):
    ref = _run_training(graph, params, feeds, False, device)
    got = _run_training(graph, params, feeds, True, device)
    assert got[3] < ref[3]
    np.testing.assert_array_equal(np.array(got[0]), np.array(ref[0]))
    np.testing.assert_array_equal(got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    for k in ref[2]:
        np.testing.assert_array_equal(got[2][k], ref[2][k], err_msg=k)


@pytest.mark.gpu
def test_mlp_training_steps_are_bit_identical_with_fusion(gpu_device):
    manual_seed(0)
    net = build_mlp(64)
    params = net.state_dict()
    feeds = {
        "x": RNG.standard_normal((64, 784)).astype(np.float32),
        "y": RNG.integers(0, 10, 64).astype(np.int32),
    }
    _assert_same_training(net.graph, params, feeds, gpu_device)


@pytest.mark.gpu
def test_transformer_training_steps_are_bit_identical_with_fusion(gpu_device):
    cfg = TransformerConfig(num_layers=1)
    manual_seed(0)
    net = build_transformer(1, 32, cfg)
    params = net.state_dict()
    feeds = {
        "input_ids": RNG.integers(0, cfg.vocab_size, (1, 32)).astype(np.int32),
        "labels": RNG.integers(0, cfg.vocab_size, (1, 32)).astype(np.int32),
    }
    _assert_same_training(net.graph, params, feeds, gpu_device)


def _assert_same_arithmetic(fused, unfused, device, name: str) -> None:
    """Bit-identical on lavapipe (CI). Other drivers may contract a fused epilogue into the
    matmul's last FMA, which Vulkan permits (docs/performance.md, Fusion): there, within 4
    float32 ulps of the output's largest magnitude (the H200 differed by 2 in a silu epilogue).
    """
    if "llvmpipe" in device.name.lower():
        np.testing.assert_array_equal(fused, unfused, err_msg=name)
        return
    scale = float(np.max(np.abs(unfused))) if np.size(unfused) else 0.0
    atol = 4 * float(np.finfo(np.float32).eps) * scale
    np.testing.assert_allclose(fused, unfused, rtol=0, atol=atol, err_msg=name)


def _compare(graph: Graph, feeds: dict, device, kernels: int | None = None) -> None:
    from meganeura.training import compile_for

    outs = {}
    for fuse in (False, True):
        prog, sess = compile_for(graph, CompileOptions(fuse=fuse), device)
        outs[fuse] = sess.run(feeds, [name for name, _ in graph.outputs])
        if fuse and kernels is not None:
            assert len(prog.dispatches) == kernels
    vals, _, _ = interpret(graph, feeds)
    for name, v in graph.outputs:
        _assert_same_arithmetic(outs[True][name], outs[False][name], device, name)
        # the oracle only guards against both sides being wrong alike; sums differ in order
        np.testing.assert_allclose(outs[True][name], vals[v], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_broadcasting_chain_is_one_exact_kernel(gpu_device):
    b = GraphBuilder()
    x, y, z = b.input("x", (3, 1, 5)), b.input("y", (4, 1)), b.input("z", (5,))
    b.output("out", F.sigmoid(x * 2.0 + y) * F.tanh(z))
    feeds = {
        "x": RNG.standard_normal((3, 1, 5)).astype(np.float32),
        "y": RNG.standard_normal((4, 1)).astype(np.float32),
        "z": RNG.standard_normal(5).astype(np.float32),
    }
    _compare(b.build(), feeds, gpu_device, kernels=1)


@pytest.mark.gpu
def test_two_consumer_intermediates_give_exact_results(gpu_device):
    b = GraphBuilder()
    x, y = b.input("x", (33, 70)), b.input("y", (70,))
    a = x * y
    r = F.sum(a, dim=1, keepdim=True)
    b.output("out", F.exp(a) + r)  # `a` read by a reduction between the chain's nodes
    c = F.where(F.greater(a, 0.0), a, x)
    b.output("c", c)
    b.output("d", F.sqrt(E.abs(c)) - c)  # `c` both an output and an operand
    feeds = {
        "x": RNG.standard_normal((33, 70)).astype(np.float32),
        "y": RNG.standard_normal(70).astype(np.float32),
    }
    _compare(b.build(), feeds, gpu_device)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "act", ["relu", "silu", "gelu", "tanh", "sigmoid", None], ids=lambda a: a or "no_act"
)
@pytest.mark.parametrize("lead", [(37,), (3, 7)], ids=lambda lead: f"lead_{shape_id(lead)}")
def test_linear_epilogue_is_exact(gpu_device, act, lead):
    from meganeura.passes.fuse import set_erf_apart

    set_erf_apart(False)  # the fused erf GELU stays covered (apart by default, tested below)
    try:
        _linear_epilogue(gpu_device, act, lead, kernels=1)
    finally:
        set_erf_apart(True)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_erf_gelu_keeps_its_own_kernel_after_a_matmul(gpu_device, approximate):
    """By default an erf GELU is not a matmul epilogue (its exact erfc, inlined per
    accumulator, slowed W4's fc1 by 28% on the H200); the tanh form still joins."""
    _linear_epilogue(gpu_device, "gelu" if approximate == "none" else "gelu_tanh", (37,),
                     kernels=2 if approximate == "none" else 1)  # fmt: skip


def _linear_epilogue(gpu_device, act, lead, kernels):
    acts = {"relu": F.relu, "silu": silu, "gelu": gelu, "tanh": F.tanh, "sigmoid": F.sigmoid,
            "gelu_tanh": lambda h: gelu(h, approximate="tanh")}  # fmt: skip
    b = GraphBuilder()
    x, w = b.input("x", (*lead, 19)), b.input("w", (70, 19))
    bias, res = b.input("b", (70,)), b.input("r", (*lead, 70))
    h = F.linear(x, w, bias)
    h = acts[act](h) if act else h
    b.output("out", h + res)  # residual add in the same store stage
    feeds = {
        "x": RNG.standard_normal((*lead, 19)).astype(np.float32),
        "w": RNG.standard_normal((70, 19)).astype(np.float32),
        "b": RNG.standard_normal(70).astype(np.float32),
        "r": RNG.standard_normal((*lead, 70)).astype(np.float32),
    }
    _compare(b.build(), feeds, gpu_device, kernels=kernels)


# ---- the adapter's storage-binding limit (issue 11, item 4) -----------------------------------
def _wide_sum(n_inputs: int) -> Graph:
    """``x0 + x1 + ... + x{n-1}``: one fused chain would bind every input and the output."""
    b = GraphBuilder()
    acc = b.input("x0", (64,))
    for i in range(1, n_inputs):
        acc = acc + b.input(f"x{i}", (64,))
    b.output("y", acc)
    return b.build()


def _tanh_chain(layers: int) -> Graph:
    """``sum(tanh^layers(x * w))``; its backward's chain of ``1 - t^2`` factors reads every
    layer's saved output."""
    b = GraphBuilder()
    y = b.input("x", (64,)) * b.parameter("w", (64,))
    for _ in range(layers):
        y = F.tanh(y)
    b.output("loss", F.sum(y))
    return b.build()


def _binding_cases(which: str) -> Graph:
    if which == "sum_of_33":
        return _wide_sum(33)
    options = CompileOptions("loss", SGD(lr=0.1))
    return _simplified(build_training_graph(_tanh_chain(40), options))


@pytest.mark.parametrize("bound", [8, 32])
@pytest.mark.parametrize("which", ["sum_of_33", "tanh_chain_40_training"])
def test_no_fused_kernel_binds_more_buffers_than_the_adapter_allows(which, bound):
    graph = _binding_cases(which)
    # unbounded, the planner fuses a chain whose kernel binds more than 32 buffers
    wide = schedule(graph, Limits(max_storage_buffers_per_shader_stage=1000), fuse=True)
    assert max(len(ks.bindings) for _, ks in wide.dispatches) > 32
    sched = schedule(graph, Limits(max_storage_buffers_per_shader_stage=bound), fuse=True)
    assert sched.groups
    assert max(len(ks.bindings) for _, ks in sched.dispatches) <= bound


@pytest.mark.gpu
def test_over_wide_chains_run_and_match_float64(gpu_device):
    from meganeura.training import Trainer, compile_for

    _, sess = compile_for(_wide_sum(33), device=gpu_device)
    feeds = {f"x{i}": np.full(64, i + 0.25, np.float32) for i in range(33)}
    np.testing.assert_array_equal(sess.run(feeds, ["y"])["y"], np.full(64, 536.25, np.float32))

    tr = Trainer(_tanh_chain(40), SGD(lr=0.1), device=gpu_device)
    w0, x = np.linspace(-1, 1, 64, dtype=np.float32), np.linspace(0.5, 2, 64, dtype=np.float32)
    tr.load_parameters({"w": w0})
    tr.step({"x": x})
    w64 = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    t = torch.tensor(x, dtype=torch.float64) * w64
    for _ in range(40):
        t = torch.tanh(t)
    t.sum().backward()
    want = w0 - 0.1 * w64.grad.numpy()
    np.testing.assert_allclose(tr.state_dict()["w"], want, rtol=0, atol=1e-6)
