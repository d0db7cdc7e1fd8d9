"""Optimizer updates run as one kernel per group (``schedule.update_groups``): dispatch counts,
arena layout (no GPU), and GPU results against torch.optim in float64 for single and mixed
optimizers, clipping and frozen parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.models.mlp import build_mlp
from meganeura.models.transformer import TransformerConfig, build_transformer
from meganeura.optim import HYPER_INPUT, SGD, Adam, AdamW, Optimizer

from .test_optimizers import GRAPH, INIT, XS, YS

STEPS = 3
# these tests count each update group's kernel among the step's dispatches
pytestmark = pytest.mark.usefixtures("kernels_unpacked")


def _updates(program):
    return [d.name for d in program.dispatches if "_update" in d.name]


# ---- no GPU ---------------------------------------------------------------------------------
def test_mlp_step_runs_the_four_updates_as_one_kernel():
    mlp = build_mlp(64).graph
    on = compile(mlp, CompileOptions(loss="loss", optimizer=AdamW()))
    off = compile(mlp, CompileOptions(loss="loss", optimizer=AdamW(), fuse=False))
    assert len(_updates(off)) == 4
    assert [n.split(" ", 1)[1] for n in _updates(on)] == ["adam_update group of 4"]
    assert len(on.dispatches) == 12  # 15 with one update kernel per parameter


def test_transformer_block_step_runs_its_updates_as_one_kernel():
    net = build_transformer(1, 32, TransformerConfig(num_layers=1))
    p = compile(net.graph, CompileOptions(loss="loss", optimizer=AdamW()))
    assert len(p.parameters) == 12
    assert [n.split(" ", 1)[1] for n in _updates(p)] == ["adam_update group of 12"]
    # 74 with one update kernel per parameter; one kernel computes attention's dk and dv, the
    # rotary embeddings of q and k (forward and backward) run as one kernel each, and the 8
    # permutes to and from the head layout are read and written in place (passes.permute_views),
    # and each of the 3 rms_norm input gradients leaves the row statistics for its weight
    # gradient (passes.fuse_norm), whose own statistics kernel goes (53 before; 50); q, k, v
    # and gate / up forward products each one tiled dispatch (matmul.tiled_group: 47); the
    # weight gradients of q/k/v and gate/up one dispatch each (matmul.tiled_rgroup: 44); the
    # products summed into the attention's input gradient one dispatch (matmul.split_group's
    # sum groups: 43); the 2 residual adds stored by the rms_norm input gradients' kernels
    # (fuse_norm.RESIDUAL: 41); the attention's delta computed by its dq kernel (dq_delta: 40);
    # SwiGLU's silu_backward in the dh matmul's epilogue (passes.hoist: 39)
    assert len(p.dispatches) == 39


@pytest.mark.parametrize("align", [256, 64])
def test_arenas_hold_each_member_at_one_aligned_offset(align):
    limits = Limits(min_storage_buffer_offset_alignment=align)
    p = compile(GRAPH, CompileOptions(loss="loss", optimizer=Adam()), limits)
    (arena,) = {s.buffer for s in p.parameters.values()}
    spans = sorted((s.offset, s.offset + s.nbytes) for s in p.parameters.values())
    assert all(off % align == 0 for off, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert p.buffers[arena].role == "parameter" and p.buffers[arena].size >= spans[-1][1]
    for suffix in ("exp_avg", "exp_avg_sq"):
        states = {k.removesuffix("." + suffix): s for k, s in p.state.items() if k.endswith(suffix)}
        assert len({s.buffer for s in states.values()}) == 1
        assert {k: s.offset for k, s in states.items()} == {
            k: s.offset for k, s in p.parameters.items()
        }
    (d,) = [d for d in p.dispatches if "group" in d.name]
    roles = [p.buffers[b].role for b in d.bindings]
    assert roles.count("gradient") == 1 and d.offsets == ()  # arenas are bound whole
    # a forward kernel binds its weight as a sub-range of the parameter arena
    partial = [d for d in p.dispatches if arena in d.bindings and d.offsets]
    assert partial and all(o % align == 0 for d in partial for o in d.offsets)


def test_group_splits_when_an_arena_would_exceed_one_binding():
    limits = Limits(max_storage_buffer_binding_size=600)  # fc1.weight alone is 512 B
    p = compile(GRAPH, CompileOptions(loss="loss", optimizer=SGD(momentum=0.9)), limits)
    names = _updates(p)
    assert len(names) > 1 and any("group of" in n for n in names)
    assert all(b.size <= 600 for b in p.buffers)


def test_frozen_and_single_parameters_keep_their_own_buffers():
    opts = CompileOptions(loss="loss", optimizer=AdamW(), trainable=("fc1.weight", "fc2.weight"))
    p = compile(GRAPH, opts)
    assert [n.split(" ", 1)[1] for n in _updates(p)] == ["adam_update group of 2"]
    assert p.parameters["fc1.weight"].buffer == p.parameters["fc2.weight"].buffer
    own = {p.parameters[k].buffer for k in ("fc1.bias", "fc2.bias")}
    assert len(own) == 2 and not own & {p.parameters["fc1.weight"].buffer}
    single = compile(GRAPH, CompileOptions(loss="loss", optimizer=SGD(), trainable=("fc2.bias",)))
    assert [n.split(" ", 1)[1] for n in _updates(single)] == ["sgd_update"]


# ---- GPU ------------------------------------------------------------------------------------
def _torch_mlp(tp, step):
    x = torch.from_numpy(XS[step]).double()
    h = torch.relu(torch.nn.functional.linear(x, tp["fc1.weight"], tp["fc1.bias"]))
    logits = torch.nn.functional.linear(h, tp["fc2.weight"], tp["fc2.bias"])
    return torch.nn.functional.cross_entropy(logits, torch.from_numpy(YS[step]).long())


def _torch_params():
    return {k: torch.nn.Parameter(torch.from_numpy(v).double()) for k, v in INIT.items()}


def _torch_optimizer(opt: Optimizer, params):
    cfg = opt.config()
    return getattr(torch.optim, cfg.pop("type"))(params, **cfg)


def _assert_close(got: dict, want: dict, moved: tuple[str, ...]):
    for k, w in want.items():
        w = w.detach().numpy() if isinstance(w, torch.Tensor) else w
        if k in moved:
            assert np.max(np.abs(w - INIT[k])) > 1e-4, f"{k} did not move"
        np.testing.assert_allclose(got[k], w, rtol=2e-5, atol=2e-6, err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("max_grad_norm", [None, 0.25], ids=["noclip", "clip"])
@pytest.mark.parametrize(
    "opt",
    [
        SGD(lr=0.1),
        SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
        Adam(lr=1e-2, weight_decay=0.1),
        AdamW(lr=1e-2, weight_decay=0.1),
    ],
    ids=["sgd", "sgd_nesterov_wd", "adam_wd", "adamw"],
)
def test_grouped_step_matches_torch_float64(gpu_device, opt, max_grad_norm):
    from meganeura.training import compile_for

    prog, sess = compile_for(GRAPH, CompileOptions("loss", opt, max_grad_norm), gpu_device)
    assert any("group of 4" in n for n in _updates(prog))
    sess.load_state_dict({**{k: sess.read(k) for k in prog.state}, **INIT})
    tp = _torch_params()
    topt = _torch_optimizer(opt, list(tp.values()))
    for step in range(STEPS):
        sess.run({"x": XS[step], "y": YS[step], HYPER_INPUT: opt.hyper(step, opt.lr)}, ["loss"])
        topt.zero_grad()
        _torch_mlp(tp, step).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(tp.values(), max_grad_norm)
        topt.step()
    got = sess.state_dict()
    _assert_close(got, tp, tuple(INIT))
    want_state = {
        f"{k}.{s}": t.numpy()
        for k, v in tp.items()
        for s, t in topt.state[v].items()
        if s != "step"
    }
    assert set(want_state) == set(prog.state)
    for k, w in want_state.items():
        np.testing.assert_allclose(got[k], w, rtol=2e-5, atol=2e-6, err_msg=k)


@pytest.mark.gpu
def test_mixed_optimizers_run_as_one_kernel_each(gpu_device):
    """Weights under AdamW, biases under SGD with momentum: two groups, two hyper vectors."""
    from meganeura.training import compile_for

    adamw, sgd = AdamW(lr=1e-2, weight_decay=0.1), SGD(lr=0.1, momentum=0.9)
    params = [n.id for n in GRAPH.leaves("parameter")]
    g, grads = differentiate(GRAPH, "loss", params, unreachable="omit")
    b = GraphBuilder(g)
    hyper = {adamw: b.input("hyper.adamw", (3,)), sgd: b.input("hyper.sgd", (2,))}
    clip = b.constant(1.0)
    for pid, gid in grads.items():
        opt = adamw if g[pid].name.endswith("weight") else sgd
        opt.append_update(b, b.tensor(pid), b.tensor(gid), hyper[opt], clip)
    graph = b.build()
    prog, sess = compile_for(graph, CompileOptions(), gpu_device)
    assert sorted(n.split(" ", 1)[1] for n in _updates(prog)) == [
        "adam_update group of 2",
        "sgd_momentum_update group of 2",
    ]
    sess.load_state_dict({**{k: sess.read(k) for k in prog.state}, **INIT})
    tp = _torch_params()
    t_adamw = _torch_optimizer(adamw, [tp["fc1.weight"], tp["fc2.weight"]])
    t_sgd = _torch_optimizer(sgd, [tp["fc1.bias"], tp["fc2.bias"]])
    ref_params, ref_state = dict(INIT), {}
    for step in range(STEPS):
        feed = {
            "x": XS[step],
            "y": YS[step],
            "hyper.adamw": adamw.hyper(step, adamw.lr),
            "hyper.sgd": sgd.hyper(step, sgd.lr),
        }
        sess.run(feed, ["loss"])
        _, ref_params, ref_state = interpret(graph, feed, ref_params, ref_state)
        for t in (t_adamw, t_sgd):
            t.zero_grad()
        _torch_mlp(tp, step).backward()
        t_adamw.step()
        t_sgd.step()
    got = sess.state_dict()
    _assert_close(got, tp, tuple(INIT))
    for k, want in {**ref_params, **ref_state}.items():  # the NumPy oracle, same f32 ops
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(
        got["fc1.bias.momentum_buffer"],
        t_sgd.state[tp["fc1.bias"]]["momentum_buffer"].numpy(),
        rtol=2e-5,
        atol=2e-6,
    )


@pytest.mark.gpu
def test_frozen_parameters_stay_put_while_the_group_trains(gpu_device):
    from meganeura.training import compile_for

    opt = Adam(lr=1e-2)
    trainable = ("fc1.weight", "fc2.weight", "fc2.bias")
    prog, sess = compile_for(GRAPH, CompileOptions("loss", opt, trainable=trainable), gpu_device)
    assert any("group of 3" in n for n in _updates(prog))
    sess.load_state_dict({**{k: sess.read(k) for k in prog.state}, **INIT})
    tp = _torch_params()
    tp["fc1.bias"].requires_grad_(False)
    topt = _torch_optimizer(opt, [tp[k] for k in trainable])
    for step in range(STEPS):
        sess.run({"x": XS[step], "y": YS[step], HYPER_INPUT: opt.hyper(step, opt.lr)}, ["loss"])
        topt.zero_grad()
        _torch_mlp(tp, step).backward()
        topt.step()
    got = sess.state_dict()
    np.testing.assert_array_equal(got["fc1.bias"], INIT["fc1.bias"])
    _assert_close(got, tp, trainable)


def test_members_bound_read_and_write_by_one_kernel_are_excluded():
    from meganeura.codegen.kernel import KernelSource, ValueRef
    from meganeura.compile import build_training_graph
    from meganeura.schedule.schedule import _arena_clashes, schedule
    from meganeura.schedule.update_groups import arena_value

    g = build_training_graph(GRAPH, CompileOptions(loss="loss", optimizer=SGD()))
    sched = schedule(g, Limits(), fuse=True)
    (group,) = sched.update_groups
    a, b, c = group.members[:3]
    grad = {m: arena_value(g, m, "grad") for m in (a, b, c)}
    assert not _arena_clashes(g, list(sched.dispatches), sched.update_groups)
    # wgpu rejects one buffer bound read-only and read_write in one dispatch, even disjointly
    ks = KernelSource("x", "", (ValueRef(grad[a], True), ValueRef(grad[b], False)), (1, 1, 1))
    both = KernelSource("y", "", (ValueRef(grad[a], True), ValueRef(grad[c], True)), (1, 1, 1))
    assert _arena_clashes(g, [(0, ks), (1, both)], sched.update_groups) == {a, b}
