"""``passes.rope_cache``: the rotary embeddings of one attention step and their KV-cache writes
as one dispatch. Which groups the planner forms and refuses, the SmolLM2 decode program's
dispatch count, and values through compile + Session against the NumPy interpreter and the
unfused program (the cache written in place, read back after the step)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.nn import functional as F
from meganeura.ops.attention import apply_rotary_emb
from meganeura.passes.rope_cache import plan_rope_cache, rope_cache_bindings
from meganeura.runtime import Session
from meganeura.training import device_limits

rng = np.random.default_rng(7)
B, HQ, HKV, L, S, D = 2, 4, 2, 3, 16, 8


def _graph(per_row=True, stored_k=False, values_index="same", reader_between=False):
    """q/k rotations by one offset operand, k's rotation and v written into state caches
    at ``slots``; outputs q_rot, the caches (and k_rot with ``stored_k``)."""
    b = GraphBuilder()
    q, k, v = (
        b.input("q", (B, HQ, L, D)),
        b.input("k", (B, HKV, L, D)),
        b.input("v", (B, HKV, L, D)),
    )
    off = b.input("off", (B,) if per_row else (), DType.i32)
    slots = b.input("slots", (L,), DType.i32)
    kc, vc = b.state("kc", (B, HKV, S, D)), b.state("vc", (B, HKV, S, D))
    qr = apply_rotary_emb(q, 1e4, off)
    if reader_between:  # a reader of q_rot between the rotations and the writes
        b.output("q_twice", qr * 2.0)
    kr = apply_rotary_emb(k, 1e4, off)
    keys = F.index_copy_(kc, 2, slots, kr)
    vslots = slots if values_index == "same" else b.input("vslots", (L,), DType.i32)
    values = F.index_copy_(vc, 2, vslots, v)
    b.output("q_rot", qr)
    b.output("keys", keys)
    b.output("values", values)
    if stored_k:
        b.output("k_rot", kr)
    return b.build()


def _needed(graph):
    return [True] * len(graph.nodes)


def _ops(graph, group):
    return [graph[m].op for m in group.members]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_rotations_and_both_cache_writes_form_one_group():
    graph = _graph()
    (group,) = plan_rope_cache(graph, _needed(graph))
    assert _ops(graph, group) == ["apply_rotary_emb"] * 2 + ["index_copy_"] * 2
    q_rot = graph.output_dict["q_rot"]
    k_rot = group.members[1]
    # q_rot and both caches are stored; k_rot only feeds its cache write
    assert q_rot in group.outputs and k_rot not in group.outputs
    assert rope_cache_bindings(graph, group) == 8  # q k v off slots, q_rot kc vc


def test_a_rotation_read_elsewhere_is_stored_too():
    graph = _graph(stored_k=True)
    (group,) = plan_rope_cache(graph, _needed(graph))
    assert group.members[1] in group.outputs


def test_values_written_at_other_slots_stay_out():
    graph = _graph(values_index="other")
    (group,) = plan_rope_cache(graph, _needed(graph))
    assert _ops(graph, group) == ["apply_rotary_emb"] * 2 + ["index_copy_"]


def test_a_reader_before_the_last_member_keeps_that_rotation_out():
    # q_rot is read (q_twice) before k is rotated: a kernel after the writes would be too late
    # for it, so k's rotation joins its cache write and the values' write without q's
    graph = _graph(reader_between=True)
    (group,) = plan_rope_cache(graph, _needed(graph))
    assert _ops(graph, group) == ["apply_rotary_emb"] + ["index_copy_"] * 2
    assert graph[group.members[0]].inputs[0] == graph.find("k").id


@pytest.mark.parametrize(
    ("bound", "ops"),
    [
        (8, ["apply_rotary_emb"] * 2 + ["index_copy_"] * 2),
        (7, ["apply_rotary_emb"] * 2 + ["index_copy_"]),  # q k off slots, q_rot kc: 6
        (5, ["apply_rotary_emb"] * 2),  # q k off, q_rot k_rot (k_rot now read outside)
        (4, ["apply_rotary_emb", "index_copy_"]),  # k's alone: k off slots, kc
        (3, None),
    ],
    ids=[
        "8-both_ropes_both_writes",
        "7-both_ropes_key_write",
        "5-both_ropes",
        "4-key_rope_write",
        "3-none",
    ],
)
def test_the_binding_bound_shrinks_the_group(bound, ops):
    graph = _graph()
    groups = plan_rope_cache(graph, _needed(graph), max_bindings=bound)
    assert [_ops(graph, g) for g in groups] == ([ops] if ops else [])


def test_two_writes_of_one_cache_stay_apart():
    # the values written into the keys' cache at the same slots: the later write must win,
    # which one kernel could not promise
    b = GraphBuilder()
    k, v = b.input("k", (1, 2, 3, 8)), b.input("v", (1, 2, 3, 8))
    off, slots = b.input("off", (), DType.i32), b.input("slots", (3,), DType.i32)
    kc = b.state("kc", (1, 2, 16, 8))
    keys = F.index_copy_(kc, 2, slots, apply_rotary_emb(k, 1e4, off))
    b.output("keys", F.index_copy_(keys, 2, slots, v))
    graph = b.build()
    (group,) = plan_rope_cache(graph, _needed(graph))
    assert _ops(graph, group) == ["apply_rotary_emb", "index_copy_"]


def test_rotations_of_different_offsets_are_not_paired():
    b = GraphBuilder()
    x = b.input("x", (1, 2, 3, 8))
    o1, o2 = b.input("o1", (), DType.i32), b.input("o2", (), DType.i32)
    b.output("a", apply_rotary_emb(x, 1e4, o1))
    b.output("b", apply_rotary_emb(x, 1e4, o2))
    b.output("c", apply_rotary_emb(x, 1e4, o1))  # pairs with "a"
    graph = b.build()
    (group,) = plan_rope_cache(graph, _needed(graph))
    assert group.members == (graph.output_dict["a"], graph.output_dict["c"])


def _smollm2_decode(fuse_rope: bool, monkeypatch):
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    schedule = importlib.import_module("meganeura.schedule.schedule")
    if not fuse_rope:
        monkeypatch.setattr(schedule, "plan_rope_cache", lambda *a, **k: ())
    model = LlamaForCausalLM(LlamaConfig())
    model.setup_cache(1, 512)
    ids = np.zeros((1, 1), np.int32)
    traced = trace_call(
        model, model.forward, (ids,), {"cache_position": np.int32(0), "greedy": True}
    )
    return compile(traced.graph, CompileOptions())


def test_smollm2_decode_runs_one_rope_cache_dispatch_per_layer(monkeypatch):
    plain = _smollm2_decode(False, monkeypatch)
    monkeypatch.undo()
    fused = _smollm2_decode(True, monkeypatch)
    names = [d.name.split()[1] for d in fused.dispatches]
    assert names.count("rope_cache") == 30
    assert "apply_rotary_emb" not in names and "index_copy_" not in names
    # per layer: 2 rotations + 2 cache writes -> 1
    assert len(plain.dispatches) - len(fused.dispatches) == 30 * 3


def test_no_cache_forward_pairs_the_two_rotations(monkeypatch):
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    traced = trace_call(model, model.forward, (np.zeros((1, 5), np.int32),), {})
    limits = Limits(max_storage_buffers_per_shader_stage=32)
    names = [d.name.split()[1] for d in compile(traced.graph, CompileOptions(), limits).dispatches]
    # the pair goes on into the attention's kernel (tests/passes/test_rope_prefill.py) ...
    assert names.count("rope_prefill_attention") == 2 and "rope_cache" not in names
    # ... and without that, it is one rope_cache dispatch
    schedule = importlib.import_module("meganeura.schedule.schedule")
    monkeypatch.setattr(schedule, "attach_prefill_attention", lambda graph, groups, *a, **k: groups)
    names = [d.name.split()[1] for d in compile(traced.graph, CompileOptions(), limits).dispatches]
    assert names.count("rope_cache") == 2 and "apply_rotary_emb" not in names


# ---- values (GPU) -----------------------------------------------------------------------------
def _feeds(per_row, values_index="same"):
    feeds = {
        "q": rng.standard_normal((B, HQ, L, D)).astype(np.float32),
        "k": rng.standard_normal((B, HKV, L, D)).astype(np.float32),
        "v": rng.standard_normal((B, HKV, L, D)).astype(np.float32),
        "off": np.array([5, 1000], np.int32) if per_row else np.array(9, np.int32),
        "slots": np.array([4, 11, 7], np.int32),
    }
    if values_index != "same":
        feeds["vslots"] = np.array([0, 15, 2], np.int32)
    return feeds


def _run(device, graph, feeds, state, fuse=True, precision="strict"):
    program = compile(graph, CompileOptions(fuse=fuse, precision=precision), device_limits(device))
    fetch = [name for name, _ in graph.outputs]
    with Session(program, device) as sess:
        sess.load_state_dict(state)
        first = sess.run(feeds, fetch)
        # the cache persists: a second step at other slots keeps the first step's rows
        feeds2 = dict(feeds, slots=np.array([0, 1, 2], np.int32))
        second = sess.run(feeds2, fetch)
    names = [d.name.split()[1] for d in program.dispatches]
    return first, second, names


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [True, False], ids=["offset_per_row", "offset_scalar"])
@pytest.mark.parametrize("stored_k", [False, True], ids=["k_internal", "k_stored"])
def test_fused_step_matches_the_interpreter_and_the_unfused_program(per_row, stored_k, gpu_device):
    graph = _graph(per_row=per_row, stored_k=stored_k)
    feeds = _feeds(per_row)
    state = {n: rng.standard_normal((B, HKV, S, D)).astype(np.float32) for n in ("kc", "vc")}
    got, got2, names = _run(gpu_device, graph, feeds, state)
    assert names == ["rope_cache"]
    plain, plain2, plain_names = _run(gpu_device, graph, feeds, state, fuse=False)
    assert sorted(plain_names) == ["apply_rotary_emb"] * 2 + ["index_copy_"] * 2
    values, _, _ = interpret(graph, feeds, None, state)
    want = {name: values[v] for name, v in graph.outputs}
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-6)
        # the same f32 formula as the separate kernels (up to the compiler's contractions)
        np.testing.assert_allclose(got[name], plain[name], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got2[name], plain2[name], rtol=0, atol=1e-6)
    # rows outside the written slots keep the state's values; the written ones hold the new
    untouched = [s for s in range(S) if s not in (4, 11, 7)]
    assert np.array_equal(got["keys"][:, :, untouched], state["kc"][:, :, untouched])
    assert np.array_equal(got["values"][:, :, [4, 11, 7]], feeds["v"])
    assert np.array_equal(got2["values"][:, :, [4, 11, 7]], feeds["v"])  # kept from step 1


@pytest.mark.gpu
def test_fast_mode_pairs_f16_queries_with_f32_keys(gpu_device):
    """Fast mode stores q_rot as f16 and keeps the keys f32 (their cache is f32): still one
    kernel, each load and store converting."""
    if not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter lacks shader-f16")
    graph = _graph()
    feeds = _feeds(True)
    state = {n: rng.standard_normal((B, HKV, S, D)).astype(np.float32) for n in ("kc", "vc")}
    got, _, names = _run(gpu_device, graph, feeds, state, precision="fast")
    assert names == ["rope_cache"]
    values, _, _ = interpret(graph, feeds, None, state)
    for name, v in graph.outputs:
        np.testing.assert_allclose(got[name], values[v], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_out_of_range_slots_are_not_written(gpu_device):
    """An index computed on the GPU is not checked: rows whose slot is out of range are
    skipped, as by index_copy_'s own kernel."""
    b = GraphBuilder()
    k, v = b.input("k", (1, 1, 2, 4)), b.input("v", (1, 1, 2, 4))
    base = b.input("base", (), DType.i32)
    slots = (
        F.arange(2, builder=b) + base
    )  # GPU-computed: base 3 gives slots 3 and 4 (4 is past S = 4)
    kc, vc = b.state("kc", (1, 1, 4, 4)), b.state("vc", (1, 1, 4, 4))
    b.output("keys", F.index_copy_(kc, 2, slots, apply_rotary_emb(k, 1e4, base)))
    b.output("values", F.index_copy_(vc, 2, slots, v))
    b.output("q", apply_rotary_emb(k * 1.0, 1e4, base))
    graph = b.build()
    state = {"kc": np.zeros((1, 1, 4, 4), np.float32), "vc": np.zeros((1, 1, 4, 4), np.float32)}
    feeds = {"k": np.ones((1, 1, 2, 4), np.float32), "v": np.ones((1, 1, 2, 4), np.float32),
             "base": np.array(3, np.int32)}  # fmt: skip
    program = compile(graph, CompileOptions(), device_limits(gpu_device))
    assert any("rope_cache" in d.name for d in program.dispatches)
    with Session(program, gpu_device) as sess:
        sess.load_state_dict(state)
        got = sess.run(feeds, ["keys", "values"])
    assert not got["values"][0, 0, :3].any() and (got["values"][0, 0, 3] == 1).all()
    assert not got["keys"][0, 0, :3].any() and got["keys"][0, 0, 3].any()
