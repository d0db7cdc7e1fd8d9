"""Sum groups (``codegen.wgsl.matmul.split_group``): products whose partials (or, unsplit, values)
one kernel alone reads (``dG @ Wg + dU @ Wu``) compute them in one dispatch, at the last
product's position; each keeps its own partials and summing order, so values are
bit-identical to the program without sum groups (``set_sum_groups(False)``).

GPU tests force a split-K plan (lavapipe's own plans never split), as
tests/codegen/test_splitk_deferred.py does.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.matmul import split_group
from meganeura.codegen.wgsl.matmul.plan import force_plan
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from .harness import compile_both, run_identical
from .test_splitk_deferred import SPLIT, _params

RNG = np.random.default_rng(37)


@pytest.fixture
def split_plan():
    force_plan(SPLIT)
    yield SPLIT
    force_plan(None)
    split_group.set_sum_groups(True)


def _both(graph, options, limits):
    """(program with sum groups, program without)."""
    return compile_both(split_group.set_sum_groups, graph, options, limits)


def _sum_of_products(m: int = 37, ks=(96, 72, 136), n: int = 52):
    """y = a0 @ w0.mT + a1 @ w1.mT + a2 @ w2.mT (each a_i [m, k_i]), then a residual."""
    b = GraphBuilder()
    r = b.input("r", (m, n))
    y = r
    for i, k in enumerate(ks):
        y = y + F.linear(b.input(f"a{i}", (m, k)), b.parameter(f"w{i}", (n, k)))
    b.output("y", F.sigmoid(y))
    return b.build()


def _merged(program) -> list[str]:
    return [d.name for d in program.dispatches if "part1" in d.wgsl]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_products_summed_by_one_kernel_share_their_partials_dispatch(split_plan):
    on, off = _both(_sum_of_products(), CompileOptions(), H200_LIMITS)
    # off: three partials dispatches and the sum with the epilogue; on: one and the sum
    assert len(off.dispatches) == 4 and len(on.dispatches) == 2
    (name,) = _merged(on)
    assert on.dispatches[0].name == name
    # the products of the three partials dispatches (the epilogue's anchor's first)
    ids = sorted(int(d.name[1:].split("+")[0].split()[0]) for d in off.dispatches[:3])
    assert name == "%" + "+".join(map(str, ids)) + " matmul"


def test_unsplit_products_join_and_store_their_value(split_plan):
    # K = 16 is one K step of the forced plan: that product runs unsplit
    g = _sum_of_products(ks=(96, 16, 136))
    on, off = _both(g, CompileOptions(), H200_LIMITS)
    assert len(off.dispatches) == 4 and len(on.dispatches) == 2
    (merged,) = [d for d in on.dispatches if "part1" in d.wgsl or "c1" in d.wgsl]
    assert "g_c1" in merged.wgsl and "g_part2" in merged.wgsl


def test_the_switch_and_a_second_reader_keep_products_apart(split_plan):
    split_group.set_sum_groups(False)
    try:
        assert _merged(compile(_sum_of_products(), CompileOptions(), H200_LIMITS)) == []
    finally:
        split_group.set_sum_groups(True)
    b = GraphBuilder()  # p1 is read by two kernels: no one kernel reads both partial sets
    p = [F.linear(b.input(f"a{i}", (37, 96)), b.parameter(f"w{i}", (52, 96))) for i in range(2)]
    b.output("y", p[0] + p[1])
    b.output("z", F.sum(p[1], -1))
    assert _merged(compile(b.build(), CompileOptions(), H200_LIMITS)) == []


def test_smollm2_training_step_groups_the_input_gradients():
    """SmolLM2's widths, 1 layer, 128 tokens, H200 limits: the input gradients of the MLP
    (dG @ Wg + dU @ Wu, K = 1536, 12 splits each) and of attention (dK @ Wk, K = 192,
    unsplit, with dQ @ Wq, K = 576, split; dV @ Wv anchors the epilogue adding them) are one
    dispatch each besides their summing kernels."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, vocab_size=512))
    ids = (np.arange(128, dtype=np.int32) % 512)[None]
    labels = ((np.arange(128) + 1) % 512).astype(np.int32)[None]
    graph = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, labels), {}, "loss").graph
    on, off = _both(graph, CompileOptions(loss="loss", optimizer=mn.optim.AdamW()), H200_LIMITS)
    assert len(on.dispatches) == len(off.dispatches) - 2
    merged = [d.wgsl for d in on.dispatches if d.name not in {e.name for e in off.dispatches}]
    assert sorted(w.count("var<storage, read_write> g_part") for w in merged) == [1, 2]
    assert sum("g_c" in w for w in merged) == 1  # dK @ Wk, stored


# ---- execution (GPU) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["m37_n52", "m8_n64", "m37_n52_mixed", "m37_n52_mixed_fast"])
def test_sum_of_products_bit_identical(gpu_device, split_plan, shape):
    """``mixed``: the second product (K = 16, one K step) runs unsplit and stores its value;
    ``fast``: fast precision (products stored as f16)."""
    from meganeura.training import device_limits

    m, n = (int(s[1:]) for s in shape.split("_")[:2])
    ks = (96, 16, 136) if "mixed" in shape else (96, 72, 136)
    precision = "fast" if shape.endswith("fast") else "strict"
    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _sum_of_products(m, ks, n)
    params = _params(graph)
    feeds = {
        nd.name: RNG.standard_normal(nd.type.shape).astype(np.float32)
        for nd in graph.nodes
        if nd.op == "input"
    }
    on, off = _both(graph, CompileOptions(precision=precision), limits)
    assert len(on.dispatches) == 2 and len(off.dispatches) == 4
    got = run_identical(gpu_device, (on, off), feeds, ["y"], params)["y"]
    p = {k: v.astype(np.float64) for k, v in params.items()}
    y = feeds["r"].astype(np.float64)
    for i in range(3):
        y = y + feeds[f"a{i}"].astype(np.float64) @ p[f"w{i}"].T
    tol = 1e-5 if precision == "strict" else 1e-2
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-y)), rtol=tol, atol=tol / 10)


@pytest.mark.gpu
def test_llama_training_step_bit_identical_and_matches_transformers(
    gpu_device, split_plan, monkeypatch
):
    """A 2-layer Llama training step (12 tokens) with split-K plans everywhere: per layer the
    MLP's input gradient (2 products) and attention's (q, k and v: 3) are one sum group each;
    gradients equal the program's without sum groups bit for bit (llvmpipe) and transformers'
    float64 ones within f32 rounding."""
    import torch
    import transformers

    import meganeura as mn
    import meganeura.schedule.schedule as sched
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    lowered = []

    def lower(graph, group, limits):
        lowered.append(group.shared_left)
        return split_group.lower_split_group(graph, group, limits)

    monkeypatch.setattr(sched, "lower_split_group", lower)
    cfg = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    tokens = np.random.default_rng(6).integers(0, 96, (1, 13))
    ids, labels = tokens[:, :-1].astype(np.int32), tokens[:, 1:].copy()

    def step(on: bool):
        split_group.set_sum_groups(on)
        lowered.clear()
        try:
            mn.manual_seed(13)
            model = LlamaForCausalLM(LlamaConfig(**cfg))
            tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
            loss, grads = tr.step(ids, labels, return_grads=True)
        finally:
            split_group.set_sum_groups(True)
        return model.state_dict(), loss, grads, lowered.count(False)

    state, loss, grads, sums = step(True)
    _, loss0, grads0, sums0 = step(False)
    assert sums == 4 and sums0 == 0  # per layer the MLP's and attention's input gradients
    assert loss == loss0
    if "llvmpipe" in gpu_device.name.lower():
        for name, g in grads.items():
            np.testing.assert_array_equal(g, grads0[name], err_msg=name)
    ref = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**cfg, attn_implementation="eager")
    ).to(torch.float64)
    ref.load_state_dict({k: torch.from_numpy(v).double() for k, v in state.items()}, strict=False)
    out = ref(torch.from_numpy(ids.astype(np.int64))).logits
    want = torch.nn.functional.cross_entropy(out.reshape(-1, 96), torch.from_numpy(labels)[0])
    want.backward()
    assert abs(loss - want.item()) <= 1e-5
    named = dict(ref.named_parameters())
    for name, g in grads.items():
        w = named[name].grad.numpy()
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=name)
