"""Attention without a KV cache with its query and key rotations in its kernel
(``passes.rope_cache.attach_prefill_attention``, ``codegen.wgsl.attention.rope_prefill``):
which groups form, the SmolLM2 forward's dispatch count, and the fused kernel's outputs
against the unfused program's (rope_cache, then the same attention kernel) bit for bit."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.nn import functional as F
from meganeura.runtime import Session
from meganeura.training import device_limits

rng = np.random.default_rng(5)
WIDE = Limits(max_storage_buffers_per_shader_stage=16)
FUSED = "rope_prefill_attention"
SDPA = "scaled_dot_product_attention"


def _graph(
    b=1, hq=6, hkv=2, length=37, d=64, causal=True, offset="none", inverse=False, q_read=False,
    mask=False,
):  # fmt: skip
    """q and k [b, h, length, d] rotated from position 3 (plus an i32 operand with
    ``offset`` "scalar" or "per_row"), then attention over them (with ``mask``: an additive
    [b, 1, 1, length] mask)."""
    gb = GraphBuilder()
    q, k = gb.input("q", (b, hq, length, d)), gb.input("k", (b, hkv, length, d))
    v = gb.input("v", (b, hkv, length, d))
    off = None
    if offset != "none":
        off = gb.input("off", (b,) if offset == "per_row" else (), DType.i32)

    def rot(x):
        attrs = {"theta": 1e5, "inverse": inverse, "position_offset": 3}
        return gb.add("apply_rotary_emb", [x] if off is None else [x, off], attrs)

    qr, kr = rot(q), rot(k)
    m = gb.input("mask", (b, 1, 1, length)) if mask else None
    o = F.scaled_dot_product_attention(
        qr, kr, v, attn_mask=m, is_causal=causal, enable_gqa=hq != hkv
    )
    gb.output("o", o)
    if q_read:
        gb.output("q_rot", qr)
    return gb.build()


def _feeds(graph):
    feeds = {}
    for name in ("q", "k", "v"):
        shape = next(n.type.shape for n in graph.nodes if n.op == "input" and n.name == name)
        feeds[name] = rng.standard_normal(shape).astype(np.float32)
    off = next((n for n in graph.nodes if n.op == "input" and n.name == "off"), None)
    if off is not None:
        feeds["off"] = (
            np.arange(off.type.shape[0], dtype=np.int32) * 500 + 7 if off.type.shape else 11
        )
        feeds["off"] = np.asarray(feeds["off"], np.int32)
    mask = next((n for n in graph.nodes if n.op == "input" and n.name == "mask"), None)
    if mask is not None:
        feeds["mask"] = np.zeros(mask.type.shape, np.float32)
        feeds["mask"][-1, ..., :3] = -np.inf  # the last sequence left-padded by three tokens
        feeds["mask"][0, ..., -1] = -0.5
    return feeds


def _kinds(program):
    return [d.name.split()[1] for d in program.dispatches]


def _unfused(monkeypatch):
    """Compile without this fusion from here on (the rest of the plan unchanged)."""
    schedule = importlib.import_module("meganeura.schedule.schedule")
    monkeypatch.setattr(schedule, "attach_prefill_attention", lambda graph, groups, *a, **k: groups)


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_forward_without_cache_is_one_kernel():
    assert _kinds(compile(_graph(), CompileOptions(), WIDE)) == [FUSED]


@pytest.mark.parametrize(
    ("kwargs", "limits", "override"),
    [
        ({"q_read": True}, WIDE, None),
        ({"d": 36}, WIDE, None),
        ({}, Limits(max_storage_buffers_per_shader_stage=3), None),
        ({}, WIDE, (16, 16, 4, 4)),
        ({}, WIDE, "off"),
    ],
    ids=[
        "rotated_queries_read_elsewhere", "head_dim_36", "binding_bound_3", "block_plan",
        "switched_off",
    ],
)  # fmt: skip
def test_the_attention_stays_apart(kwargs, limits, override, monkeypatch):
    if override == "off":
        monkeypatch.setattr(attention_plan, "ROPE_PREFILL", False)
    elif override is not None:
        monkeypatch.setitem(attention_plan.BLOCK_OVERRIDE, "fwd", override)
    kinds = _kinds(compile(_graph(**kwargs), CompileOptions(), limits))
    assert FUSED not in kinds
    assert SDPA in kinds


def test_fast_mode_f16_rotations_stay_apart():
    # the fused kernel would skip the f16 rounding of the stored rotations
    limits = Limits(max_storage_buffers_per_shader_stage=16, shader_f16=True)
    kinds = _kinds(compile(_graph(), CompileOptions(precision="fast"), limits))
    assert kinds == ["rope_cache", SDPA]


def test_training_keeps_the_rotations_for_the_backward():
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call
    from meganeura.optim import SGD

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    ids = (np.arange(8, dtype=np.int32) % 64)[None]
    traced = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, ids), {}, "loss")
    program = compile(traced.graph, CompileOptions(loss="loss", optimizer=SGD(lr=1e-3)), WIDE)
    kinds = _kinds(program)
    assert FUSED not in kinds
    assert f"{SDPA}_backward_query" in kinds


def test_smollm2_forward_saves_a_dispatch_per_layer(monkeypatch):
    from meganeura.codegen.wgsl.attention import summed
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    # the attention reading q/k/v's partials (attention.summed) would also drop their sums
    monkeypatch.setattr(summed, "ENABLED", [False])
    model = LlamaForCausalLM(LlamaConfig())
    ids = (np.arange(128, dtype=np.int32) * 7 % 49152)[None]
    traced = trace_call(model, model.forward, (ids,), {})
    fused = compile(traced.graph, CompileOptions(shared_parameters=True), WIDE)
    _unfused(monkeypatch)
    plain = compile(traced.graph, CompileOptions(shared_parameters=True), WIDE)
    assert _kinds(fused).count(FUSED) == 30
    assert "rope_cache" not in _kinds(fused)
    assert _kinds(plain).count("rope_cache") == 30
    assert len(plain.dispatches) - len(fused.dispatches) == 30


# ---- values (GPU) -----------------------------------------------------------------------------
def _run(device, graph, feeds):
    program = compile(graph, CompileOptions(), device_limits(device))
    with Session(program, device) as sess:
        out = sess.run(feeds, ["o"])["o"]
    return out, _kinds(program)


CASES = {
    "causal_gqa_d64_len37": {},
    "noncausal_gqa_d64_len37": {"causal": False},
    "causal_d32_len21_offset_scalar": {"d": 32, "length": 21, "offset": "scalar"},
    "causal_b2_offset_per_row": {"b": 2, "hq": 4, "length": 19, "offset": "per_row"},
    "noncausal_mha_d32_len5": {"hq": 2, "d": 32, "length": 5, "causal": False},
    "causal_smollm2_heads_len70": {"hq": 9, "hkv": 3, "length": 70},
    "inverse_rotation": {"length": 13, "inverse": True, "offset": "scalar"},
    "one_token": {"length": 1},
    "padding_mask_b2": {"b": 2, "length": 11, "mask": True, "causal": False},
    # 64 rows a workgroup, one lane each: the rows' queries outgrow the workgroup memory, so
    # each thread rotates its own row in registers
    "rows_64_queries_in_registers": {"hq": 256, "hkv": 256, "length": 64},
    "rows_32_two_lanes_d32": {"hq": 128, "hkv": 128, "length": 64, "d": 32},
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_equals_the_unfused_program_bit_for_bit(case, gpu_device, monkeypatch):
    graph = _graph(**CASES[case])
    feeds = _feeds(graph)
    got, kinds = _run(gpu_device, graph, feeds)
    if FUSED not in kinds:
        pytest.skip(f"this adapter's plan keeps the kernels apart: {kinds}")
    assert kinds == [FUSED]
    _unfused(monkeypatch)
    plain, plain_kinds = _run(gpu_device, graph, feeds)
    assert plain_kinds == ["rope_cache", SDPA]
    np.testing.assert_array_equal(got, plain)
    values, _, _ = interpret(graph, feeds, None, {})
    want = values[graph.outputs[0][1]]
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
