"""The attention backward's delta pass inside the dq kernel (``codegen.wgsl.attention
.dq_delta``): the delta dispatch goes, gradients bit-identical to the program with it (causal
and not, GQA and not, a mask, a head dim not a multiple of 4; a tiny Llama's training step)
and against float64 torch autograd; which pairs qualify; dispatch counts on the H200's limits.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.attention import dq_delta
from meganeura.compile import CompileOptions
from meganeura.optim import SGD

from .attention_ab import graph, run_both
from .harness import compile_both

# name: (q shape, k shape, v head dim, is_causal, mask)
CASES = {
    "gqa_causal": ((1, 4, 12, 16), (1, 2, 12, 16), 16, True, False),
    "mha": ((2, 2, 9, 8), (2, 2, 11, 8), 8, False, False),
    "gqa_mask_d6": ((1, 4, 7, 6), (1, 2, 10, 6), 6, False, True),
    "mha_causal_dv12": ((1, 2, 10, 8), (1, 2, 10, 8), 12, True, False),
}


@pytest.fixture(autouse=True)
def restore():
    yield
    dq_delta.set_enabled(True)


def _delta_kernels(program) -> list[str]:
    return [d.name for d in program.dispatches if "_delta" in d.name or "+delta" in d.name]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_attention_gradients_bit_identical_and_match_torch(gpu_device, case, precision):
    def check(on, off):
        assert len(off.dispatches) - len(on.dispatches) == 1
        assert [n.split()[-1] for n in _delta_kernels(on)] == ["dq+delta"]

    run_both(gpu_device, dq_delta.set_enabled, case, precision, check, seed=11)


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _llama(on: bool):
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

    dq_delta.set_enabled(on)
    mn.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_tiny_llama_training_step_bit_identical(gpu_device, precision, monkeypatch):
    """The Trainer's step (forward, backward, SGD at lr 0): loss and every gradient; both
    layers' dq kernels compute delta with the switch on, none with it off."""
    import meganeura as mn
    from meganeura.models.llama import lm_loss
    from meganeura.schedule import schedule

    fused = []
    lowering = schedule.lower_dq_delta
    monkeypatch.setattr(schedule, "lower_dq_delta", lambda *a: fused.append(a) or lowering(*a))
    from meganeura.training import device_limits

    if precision == "fast" and not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    tokens = np.random.default_rng(6).integers(0, 96, (1, 17))
    got = []
    for on in (True, False):
        tr = mn.Trainer(_llama(on), mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device,
                        precision=precision)  # fmt: skip
        got.append(tr.step(tokens[:, :-1], tokens[:, 1:].copy(), return_grads=True))
        assert len(fused) == 2  # the off program adds none
    assert got[0][0] == got[1][0]
    for name, g in got[0][1].items():
        np.testing.assert_array_equal(g, got[1][1][name], err_msg=name)


def test_smollm2_widths_dispatch_counts_on_h200_limits():
    """SmolLM2-135M's widths (2 layers, 128 tokens) compiled for the H200: each layer's delta
    dispatch goes into its dq kernel."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=512))
    ids = (np.arange(128, dtype=np.int32) % 512)[None]
    traced = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, (ids + 1) % 512), {},
                        "loss")  # fmt: skip
    options = CompileOptions(loss="loss", optimizer=SGD(lr=0.1))
    on, off = compile_both(dq_delta.set_enabled, traced.graph, options, H200_LIMITS)
    assert len(off.dispatches) - len(on.dispatches) == 2
    assert len(_delta_kernels(on)) == 2 and all("dq+delta" in n for n in _delta_kernels(on))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
def test_too_few_bindings_or_a_block_plan_keep_the_delta_dispatch(masked):
    """The fused dq kernel binds 8 storage buffers (9 with a mask): with one fewer, or with a
    block plan forced for dq (``plan.BLOCK_OVERRIDE``), the delta dispatch stays."""
    from dataclasses import replace

    from meganeura.codegen.wgsl.attention import plan

    g = graph((1, 2, 8, 8), (1, 2, 8, 8), 8, True, masked)
    options = CompileOptions(loss="loss", optimizer=SGD(lr=0.1))
    need = 8 + masked
    for n, fused in ((need, True), (need - 1, False)):
        limits = replace(H200_LIMITS, max_storage_buffers_per_shader_stage=n)
        on, off = compile_both(dq_delta.set_enabled, g, options, limits)
        assert len(off.dispatches) - len(on.dispatches) == fused, n
    plan.BLOCK_OVERRIDE["dq"] = plan.BLOCK_PLANS[0]
    try:
        on, off = compile_both(dq_delta.set_enabled, g, options, H200_LIMITS)
    finally:
        del plan.BLOCK_OVERRIDE["dq"]
    assert len(on.dispatches) == len(off.dispatches)
    assert any(" dq block " in d.name for d in on.dispatches)
