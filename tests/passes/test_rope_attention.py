"""A decode step's rotations, cache writes and attention as one kernel
(``passes.rope_cache.attach_attention``, ``codegen.wgsl.attention.rope_attention``): which
groups form, and the fused step against the interpreter and the unfused program."""

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
from meganeura.runtime import Session
from meganeura.training import device_limits

rng = np.random.default_rng(11)
B, HQ, HKV, S, D = 2, 4, 2, 16, 8
WIDE = Limits(max_storage_buffers_per_shader_stage=16)


def _graph(new=2, per_row=True, mask=False, q_read=False):
    """Rotations of ``new`` positions, both cache writes at ``slots`` and the lower-right
    causal attention over ``kvl`` keys of the caches."""
    b = GraphBuilder()
    q = b.input("q", (B, HQ, new, D))
    k, v = b.input("k", (B, HKV, new, D)), b.input("v", (B, HKV, new, D))
    off = b.input("off", (B,) if per_row else (), DType.i32)
    slots = b.input("slots", (new,), DType.i32)
    kvl = b.input("kvl", (B,), DType.i32)
    kc, vc = b.state("kc", (B, HKV, S, D)), b.state("vc", (B, HKV, S, D))
    qr = apply_rotary_emb(q, 1e4, off)
    keys = F.index_copy_(kc, 2, slots, apply_rotary_emb(k, 1e4, off))
    values = F.index_copy_(vc, 2, slots, v)
    m = b.input("mask", (B, 1, 1, S)) if mask else None
    o = F.scaled_dot_product_attention(
        qr, keys, values, attn_mask=m, is_causal=True, enable_gqa=True, kv_length=kvl
    )
    b.output("o", o)
    b.output("keys", keys)
    b.output("values", values)
    if q_read:
        b.output("q_rot", qr)
    return b.build()


def _kinds(program):
    return [d.name.split()[1] for d in program.dispatches]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_decode_step_is_one_kernel():
    assert _kinds(compile(_graph(), CompileOptions(), WIDE)) == ["rope_attention"]


@pytest.mark.parametrize(
    ("kwargs", "limits"),
    [({"q_read": True}, WIDE), ({}, Limits(max_storage_buffers_per_shader_stage=8))],
    ids=["rotated_queries_read_elsewhere", "binding_bound_8"],
)
def test_the_attention_stays_apart(kwargs, limits):
    kinds = _kinds(compile(_graph(**kwargs), CompileOptions(), limits))
    assert kinds == ["rope_cache", "scaled_dot_product_attention"]


def test_more_query_rows_than_one_tile_stay_apart():
    # 2 query heads per kv head x 8 new positions: 16 rows, more than one lane-kernel tile
    kinds = _kinds(compile(_graph(new=8), CompileOptions(), WIDE))
    assert "rope_attention" not in kinds


def test_smollm2_decode_saves_a_dispatch_per_layer(monkeypatch):
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    model = LlamaForCausalLM(LlamaConfig())
    model.setup_cache(1, 512)
    traced = trace_call(
        model, model.forward, (np.zeros((1, 1), np.int32),), {"cache_position": np.int32(0)}
    )
    fused = compile(traced.graph, CompileOptions(), WIDE)
    schedule = importlib.import_module("meganeura.schedule.schedule")
    monkeypatch.setattr(schedule, "attach_attention", lambda graph, groups, *a, **k: groups)
    plain = compile(traced.graph, CompileOptions(), WIDE)
    assert _kinds(fused).count("rope_attention") == 30
    assert "rope_cache" not in _kinds(fused)
    assert len(plain.dispatches) - len(fused.dispatches) == 30


# ---- values (GPU) -----------------------------------------------------------------------------
def _run(device, graph, steps, state, fuse=True):
    program = compile(graph, CompileOptions(fuse=fuse), device_limits(device))
    fetch = [name for name, _ in graph.outputs]
    with Session(program, device) as sess:
        sess.load_state_dict(state)
        outs = [sess.run(feeds, fetch) for feeds in steps]
    return outs, _kinds(program)


@pytest.mark.gpu
@pytest.mark.parametrize("new", [1, 2], ids=["one_token", "two_tokens"])
@pytest.mark.parametrize("mask", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("per_row", [True, False], ids=["offset_per_row", "offset_scalar"])
def test_fused_steps_match_the_interpreter_and_the_unfused_program(new, mask, per_row, gpu_device):
    graph = _graph(new=new, per_row=per_row, mask=mask)
    state = {n: rng.standard_normal((B, HKV, S, D)).astype(np.float32) for n in ("kc", "vc")}
    steps = []
    for start in (5, 5 + new):  # the second step attends over the first step's writes
        feeds = {
            "q": rng.standard_normal((B, HQ, new, D)).astype(np.float32),
            "k": rng.standard_normal((B, HKV, new, D)).astype(np.float32),
            "v": rng.standard_normal((B, HKV, new, D)).astype(np.float32),
            "off": np.array([start, start + 300], np.int32) if per_row else np.int32(start),
            "slots": np.arange(start, start + new, dtype=np.int32),
            "kvl": np.array([start + new, start + new - 1], np.int32),
        }
        if mask:
            m = np.zeros((B, 1, 1, S), np.float32)
            m[1, ..., :2] = -np.inf  # sequence 1 left-padded by two slots
            feeds["mask"] = m
        steps.append(feeds)
    got, kinds = _run(gpu_device, graph, steps, state)
    if "rope_attention" not in kinds:
        pytest.skip(f"this adapter's plan keeps the kernels apart: {kinds}")
    assert kinds == ["rope_attention"]
    plain, plain_kinds = _run(gpu_device, graph, steps, state, fuse=False)
    assert "rope_attention" not in plain_kinds
    cur = dict(state)
    for step, feeds in enumerate(steps):
        values, _, after = interpret(graph, feeds, None, cur)
        cur = {k: np.asarray(after[k]) for k in state}
        for name, v in graph.outputs:
            want = values[v]
            np.testing.assert_allclose(got[step][name], want, rtol=0, atol=3e-6, err_msg=name)
            np.testing.assert_allclose(got[step][name], plain[step][name], rtol=0, atol=2e-6)


@pytest.mark.gpu
def test_fast_mode_reads_f16_queries_into_the_f32_caches(gpu_device):
    if not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter lacks shader-f16")
    graph = _graph(new=1)
    state = {n: rng.standard_normal((B, HKV, S, D)).astype(np.float32) for n in ("kc", "vc")}
    feeds = {
        "q": rng.standard_normal((B, HQ, 1, D)).astype(np.float32),
        "k": rng.standard_normal((B, HKV, 1, D)).astype(np.float32),
        "v": rng.standard_normal((B, HKV, 1, D)).astype(np.float32),
        "off": np.array([7, 40], np.int32),
        "slots": np.array([7], np.int32),
        "kvl": np.array([8, 8], np.int32),
    }
    program = compile(graph, CompileOptions(precision="fast"), device_limits(gpu_device))
    fetch = [name for name, _ in graph.outputs]
    with Session(program, gpu_device) as sess:
        sess.load_state_dict(state)
        got = sess.run(feeds, fetch)
    values, _, _ = interpret(graph, feeds, None, state)
    for name, v in graph.outputs:
        np.testing.assert_allclose(got[name], values[v], rtol=1e-2, atol=1e-2, err_msg=name)
