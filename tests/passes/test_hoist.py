"""``passes.hoist``: an elementwise node that a fusion group's outside reader kept out of the
group is moved next to it (SwiGLU's ``silu_backward`` into the dh matmul's epilogue); the
order stays a valid schedule; on the GPU a training step's results match hoisting off."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.elementwise.maps import FUSIBLE
from meganeura.compile import compile
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.verify import verify
from meganeura.ops import OPS
from meganeura.ops import functional as F
from meganeura.passes import hoist
from meganeura.passes.fuse import plan_fusion
from meganeura.passes.simplify import reorder

from ..schedule.test_pack import _llama_step


def _lone(program, op):
    return sum(d.name.split(" ", 1)[1] == op for d in program.dispatches)


def _compiled(on: bool):
    hoist.set_enabled(on)
    try:
        return compile(*_llama_step(), H200_LIMITS)
    finally:
        hoist.set_enabled(True)


def test_silu_backward_joins_the_dh_epilogue():
    off, on = _compiled(False), _compiled(True)
    layers = 2  # the tiny Llama's decoder layers: one SwiGLU backward each
    assert _lone(off, "silu_backward") == layers and _lone(on, "silu_backward") == 0
    assert len(on.dispatches) == len(off.dispatches) - layers


def test_hoisted_graph_is_a_valid_schedule_of_the_same_nodes():
    """Each moved node comes after its operands, no effect lies between its two places,
    and it now belongs to the group it reads."""
    from meganeura.compile import _training_graph, simplify_program

    graph, options = _llama_step()
    g, master = _training_graph(graph, options, H200_LIMITS)
    g, _ = simplify_program(g, master)
    bound = H200_LIMITS.max_storage_buffers_per_shader_stage
    moved_graph, id_map = hoist.hoist_fusible(g, FUSIBLE, bound)
    verify(moved_graph, allow_unused_inputs=True)
    assert sorted(id_map) == list(range(len(g.nodes)))
    assert sorted(id_map.values()) == list(range(len(g.nodes)))
    ops = collections.Counter(n.op for n in g.nodes)
    assert ops == collections.Counter(n.op for n in moved_graph.nodes)
    for old, new in id_map.items():  # the same node: op, attributes, operands mapped
        a, b = g[old], moved_graph[new]
        assert (a.op, a.attrs, a.type) == (b.op, b.attrs, b.type)
        assert tuple(id_map[i] for i in a.inputs) == b.inputs
    moved = [old for old, new in id_map.items() if new < old - 1 or new > old + 1]
    effects = [n.id for n in g.nodes if n.op in OPS and OPS[n.op].writes]
    hoisted = [old for old in moved if g[old].op == "silu_backward"]
    assert len(hoisted) == 2
    back = {new: old for old, new in id_map.items()}
    for old in hoisted:
        prev = back[id_map[old] - 1]  # what it now follows: a member of the group it reads
        assert not any(prev < e < old for e in effects)
    groups = plan_fusion(moved_graph, FUSIBLE, None, bound)
    group_of = {m: grp for grp in groups for m in grp.members}
    for old in hoisted:
        grp = group_of[id_map[old]]
        assert grp.anchor is not None and moved_graph[grp.anchor].op == "matmul"


def test_nothing_moves_without_a_blocked_group():
    b = GraphBuilder()  # a chain: every elementwise node already joins its producer's group
    h = b.input("x", (8, 16))
    for i in range(3):
        h = F.relu(F.linear(h, b.parameter(f"w{i}", (16, 16))))
    b.output("y", h)
    g = b.build()
    moved, id_map = hoist.hoist_fusible(g, FUSIBLE)
    assert moved is g and all(k == v for k, v in id_map.items())


def test_reorder_refuses_what_is_not_a_schedule():
    b = GraphBuilder()
    x = b.input("x", (4,))
    b.output("y", F.relu(x) + x)
    g = b.build()
    with pytest.raises(ValueError, match="permutation"):
        reorder(g, [0, 1])
    with pytest.raises(ValueError, match="before one of its inputs"):
        reorder(g, [1, 0, 2])
    same, id_map = reorder(g, [0, 1, 2])
    assert same.nodes == g.nodes and id_map == {0: 0, 1: 1, 2: 2}


@pytest.mark.gpu
def test_tiny_llama_training_steps_match_with_hoisting_off(gpu_device):
    """Two Trainer steps (forward, backward, SGD) of a tiny Llama, hoisting on and off: the
    losses, gradients and parameters agree to float32 rounding (the silu_backward computed in
    the epilogue from a register, not re-read from memory)."""
    from ..schedule.test_pack import llama_steps_on_off

    got = llama_steps_on_off(gpu_device, hoist.set_enabled, seed=11, token_seed=4)
    (loss_on, grads_on), second_on, params_on, names_on = got[0]
    (loss_off, grads_off), second_off, params_off, names_off = got[1]
    assert sum("silu_backward" in n for n in names_off) > 0
    assert not any(n.endswith(" silu_backward") for n in names_on)
    np.testing.assert_allclose(loss_on, loss_off, rtol=1e-6)
    np.testing.assert_allclose(second_on, second_off, rtol=1e-6)
    for name, g in grads_on.items():
        np.testing.assert_allclose(g, grads_off[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for name, p in params_on.items():
        np.testing.assert_allclose(p, params_off[name], rtol=1e-6, atol=1e-8, err_msg=name)
