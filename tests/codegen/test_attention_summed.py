"""The attention forward reading q, k and v as sums of their split-K partials
(``codegen.wgsl.attention.summed``): q, k and v lose their summing dispatch, values
bit-identical to the program with the feature off (a plain SDPA block and the project's tiny
Llama, whose attention rotates q and k in its loads, strict and fast mode) and against float64
references; training programs keep the sums (the backward reads q, k and v).

GPU tests force a split-K plan (lavapipe's own plans never split), as
tests/codegen/test_splitk_deferred.py does.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS, ScratchRef
from meganeura.codegen.wgsl.attention import summed
from meganeura.codegen.wgsl.matmul.plan import force_plan
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.attention import scaled_dot_product_attention

from .harness import compile_both, run_identical, split_k_everywhere
from .test_splitk_deferred import SPLIT, _params
from .test_sum_runs import CFG

RNG = np.random.default_rng(71)
S, E, H, HKV, D = 24, 64, 4, 2, 16


@pytest.fixture(autouse=True)
def split_plan():
    """Split-K plans everywhere (``harness.split_k_everywhere``); the feature back on afterwards."""
    with split_k_everywhere(SPLIT, summed.set_enabled):
        yield SPLIT


def _both(graph, options, limits):
    """(program whose attention sums the partials, program without)."""
    return compile_both(summed.set_enabled, graph, options, limits)


def _sdpa_graph(loss: bool = False):
    """x -> q, k, v projections -> heads -> causal GQA attention (no rotation) -> output
    (with ``loss``: its sum, a training program's loss)."""
    b = GraphBuilder()
    x = b.input("x", (1, S, E))

    def heads(name, h):
        p = F.linear(x, b.parameter(name, (h * D, E)))
        return F.permute(F.reshape(p, (1, S, h, D)), (0, 2, 1, 3))

    q, k, v = heads("wq", H), heads("wk", HKV), heads("wv", HKV)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = F.reshape(F.permute(out, (0, 2, 1, 3)), (1, S, H * D))
    b.output("loss" if loss else "out", F.sum(out) if loss else out)
    return b.build()


def _sums(program) -> list[str]:
    return [d.name for d in program.dispatches if d.name.endswith("sum_splits")]


def _products(names: list[str]) -> int:
    """Products stored by the summing dispatches among dispatch ``names``."""
    sums = [n for n in names if n.endswith(" matmul sum_splits")]
    return sum(len(n.split()[0].split("+")) for n in sums)


def _attention(program):
    (att,) = [d for d in program.dispatches if "attention fwd" in d.name]
    return att


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_attention_binds_the_partials_and_sums_vanish():
    on, off = _both(_sdpa_graph(), CompileOptions(), H200_LIMITS)
    assert len(_sums(off)) == 1 and not _sums(on)  # q, k and v's merged sum: gone
    assert len(off.dispatches) - len(on.dispatches) == 1
    att = _attention(on)
    from meganeura.schedule.schedule import schedule

    (ks,) = [k for _, k in schedule(_sdpa_graph(), H200_LIMITS, fuse=True).dispatches
             if "attention fwd" in k.name]  # fmt: skip
    assert sum(isinstance(b, ScratchRef) for b in ks.bindings) == 3
    assert att.wgsl.count("fn sum_") == 3


def test_training_keeps_the_sums():
    """The backward reads q, k and v: they stay stored, the program is unchanged."""
    import meganeura as mn

    options = CompileOptions(loss="loss", optimizer=mn.optim.SGD(lr=0.1))
    on, off = _both(_sdpa_graph(loss=True), options, H200_LIMITS)
    assert _sums(on) and [d.name for d in on.dispatches] == [d.name for d in off.dispatches]


# ---- execution (GPU) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_sdpa_bit_identical(gpu_device, precision):
    """Fast mode stores the products as f16: the attention narrows its sums likewise."""
    import torch

    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _sdpa_graph()
    params = _params(graph)
    x = RNG.standard_normal((1, S, E)).astype(np.float32)
    on, off = _both(graph, CompileOptions(precision=precision), limits)
    assert not _sums(on) and _sums(off)
    assert _attention(on).wgsl.count("fn sum_") == 3
    assert _attention(on).wgsl.count("fn sum4_") == 3  # vec4 runs of rows: vec4 sums
    if precision == "fast":
        assert "f32(f16(v))" in _attention(on).wgsl
    got = run_identical(gpu_device, (on, off), {"x": x}, ["out"], params)["out"]
    t = {k: torch.from_numpy(v).double() for k, v in params.items()}
    xt = torch.from_numpy(x).double()

    def heads(name, h):
        return (xt @ t[name].T).reshape(1, S, h, D).permute(0, 2, 1, 3)

    k = heads("wk", HKV).repeat_interleave(H // HKV, 1)
    v = heads("wv", HKV).repeat_interleave(H // HKV, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(heads("wq", H), k, v, is_causal=True)
    want = ref.permute(0, 2, 1, 3).reshape(1, S, H * D).numpy()
    tol = 1e-5 if precision == "strict" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_tiny_llama_logits_bit_identical_and_match_transformers(
    gpu_device, precision, compiled_names
):
    """The project's Llama (2 layers, 20 tokens): per layer the rope-prefill attention reads
    q, k and v's partials (strict; in fast mode the f16 q and k are rotated by ``rope_cache``,
    which reads their partials, narrowed to f16 as stored, and the attention v's). Logits on
    and off bit for bit, and transformers' float64 ones
    within f32 (f16) rounding."""
    import torch
    import transformers

    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.training import device_limits

    if precision == "fast" and not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")

    ids = np.random.default_rng(5).integers(0, 96, (1, 20)).astype(np.int32)
    got = []
    for on in (True, False):
        summed.set_enabled(on)
        mn.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CFG))
        got.append(mn.compile(model, precision=precision, device=gpu_device)(ids))
    summed.set_enabled(True)
    summed_products = [_products(n) for n in compiled_names]
    if precision == "strict":  # the attention rotates q and k as it loads them
        assert len([n for n in compiled_names[0] if "rope_prefill_attention" in n]) == 2
        assert (
            len(compiled_names[1]) - len(compiled_names[0]) == 2
        )  # q, k and v's merged sum, per layer
        assert summed_products[1] - summed_products[0] == 6
    else:  # f16 q and k are rotated by their own kernel (rope_cache), which sums them
        assert summed_products[1] - summed_products[0] == 6
    np.testing.assert_array_equal(got[0], got[1])
    ref = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CFG, attn_implementation="eager")
    ).to(torch.float64)
    state = {k: torch.from_numpy(v).double() for k, v in model.state_dict().items()}
    ref.load_state_dict(state, strict=False)
    want = ref(torch.from_numpy(ids.astype(np.int64))).logits.detach().numpy()
    tol = 1e-4 if precision == "strict" else 3e-2
    np.testing.assert_allclose(got[0], want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_tiny_llama_cache_prefill_and_decode_bit_identical(gpu_device, precision, compiled_names):
    """With a KV cache: the prefill's rotations and cache writes (``rope_cache``) and the
    decode steps' fused attention (``rope_attention``, where the adapter's plan fuses it)
    read q, k and v's partials. Logits on and off bit for bit; prefill then decode equal a
    full recompute within f32 rounding (fast mode: within f16 rounding; its program without
    this feature once failed to compile, v stored into the f32 cache unconverted)."""
    import meganeura as mn
    from meganeura.training import device_limits

    if precision == "fast" and not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

    ids = np.random.default_rng(3).integers(0, 96, (1, 12)).astype(np.int32)
    got = []
    for on in (True, False):
        summed.set_enabled(on)
        mn.manual_seed(2)
        model = LlamaForCausalLM(LlamaConfig(**CFG))
        fn = mn.compile(model, precision=precision, device=gpu_device)
        full = fn(ids)
        model.setup_cache(1, 32)
        out = [fn(ids[:, :9], cache_position=np.int32(0))]  # prefill 9 tokens
        for t in range(9, 12):  # then one token at a time
            out.append(fn(ids[:, t : t + 1], cache_position=np.asarray([t], np.int64)))
        got.append((full, np.concatenate(out, axis=1)))
    summed.set_enabled(True)
    half = len(compiled_names) // 2
    on_names, off_names = sum(compiled_names[:half], []), sum(compiled_names[half:], [])
    assert any("rope_cache" in n or "rope_attention" in n for n in on_names)
    assert _products(on_names) < _products(off_names)
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    full = got[0][0]
    tol = 1e-5 if precision == "strict" else 3e-2
    np.testing.assert_allclose(got[0][1], full, rtol=0, atol=tol * np.abs(full).max())


@pytest.mark.gpu
def test_tiny_llama_training_step_bit_identical(gpu_device, compiled_names):
    """A training step: the rotations (``rope_cache``, storing q_rot and k_rot for the
    backward) are q and k's only readers and sum their partials; v, read by the backward
    too, keeps its sum. Loss and every gradient on and off bit for bit."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    tokens = np.random.default_rng(6).integers(0, 96, (1, 13))
    got = []
    for on in (True, False):
        summed.set_enabled(on)
        mn.manual_seed(13)
        model = LlamaForCausalLM(LlamaConfig(**CFG))
        tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
        got.append(tr.step(tokens[:, :-1], tokens[:, 1:].copy(), return_grads=True))
    summed.set_enabled(True)
    assert (
        len(compiled_names) == 2
        and _products(compiled_names[1]) - _products(compiled_names[0]) == 4
    )  # q, k x 2
    assert got[0][0] == got[1][0]
    assert got[0][1].keys() == got[1][1].keys()
    for name, g in got[0][1].items():
        np.testing.assert_array_equal(g, got[1][1][name], err_msg=name)


def test_the_bound_keeps_sums_whose_row_tiles_would_reread_too_much():
    """At SmolLM2's widths (576 -> 9 x 64 and 3 x 64, seq 128, 8 splits) every row tile of a kv
    head would load k and v 8 times (~66 MB a product a layer): bounded (the default), k and v
    keep their sum; unbounded, the attention sums all three."""
    b = GraphBuilder()
    x = b.input("x", (1, 128, 576))

    def heads(name, h):
        p = F.linear(x, b.parameter(name, (h * 64, 576)))
        return F.permute(F.reshape(p, (1, 128, h, 64)), (0, 2, 1, 3))

    q, k, v = heads("wq", 9), heads("wk", 3), heads("wv", 3)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b.output("out", F.reshape(F.permute(out, (0, 2, 1, 3)), (1, 128, 576)))
    graph = b.build()
    force_plan("64x64x16/s8")
    bounded = compile(graph, CompileOptions(), H200_LIMITS)
    summed.set_bounded(False)
    try:
        unbounded = compile(graph, CompileOptions(), H200_LIMITS)
    finally:
        summed.set_bounded(True)
    assert _products(_sums(bounded)) == 2 and _products(_sums(unbounded)) == 0
