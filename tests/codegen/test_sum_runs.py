"""Back-to-back summing dispatches of split-K products as one dispatch (``codegen.wgsl.matmul
.summing``): each product its own workgroup range and its own summing body, values
bit-identical to the program with the feature off (forward in strict and fast mode, a tiny
Llama's logits, gradients of its training step) and against float64 references; lifetimes
and the switch.

GPU tests force a split-K plan (lavapipe's own plans never split), as
tests/codegen/test_splitk_deferred.py does.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS, ScratchRef, ValueRef
from meganeura.codegen.wgsl.attention import summed as attention_summed
from meganeura.codegen.wgsl.matmul import summing
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from .harness import compile_both, run_identical, split_k_everywhere
from .test_splitk_deferred import SPLIT, _params

RNG = np.random.default_rng(53)
WIDTHS = (48, 24, 40)


@pytest.fixture(autouse=True)
def split_plan():
    """Split-K plans everywhere (``harness.split_k_everywhere``); the feature back on afterwards."""
    with split_k_everywhere(SPLIT, summing.set_enabled):
        yield SPLIT


def _both(graph, options, limits):
    """(program with merged sums, program without)."""
    return compile_both(summing.set_enabled, graph, options, limits)


def _qkv_graph(m: int = 40, k: int = 96):
    """Three products of one x (one split group's partials dispatch), each read by a
    reduction (which does not sum partials: each keeps its summing dispatch), reductions
    after all three products, so the three sums run back to back."""
    b = GraphBuilder()
    x = b.input("x", (1, m, k))
    ps = [F.linear(x, b.parameter(f"w{i}", (n, k))) for i, n in enumerate(WIDTHS)]
    for i, p in enumerate(ps):
        b.output(f"s{i}", F.sum(p, -1))
    return b.build()


def _sums(program) -> list[str]:
    return [d.name for d in program.dispatches if d.name.endswith("sum_splits")]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_back_to_back_sums_are_one_dispatch():
    on, off = _both(_qkv_graph(), CompileOptions(), H200_LIMITS)
    assert len(_sums(off)) == 3 and len(off.dispatches) - len(on.dispatches) == 2
    (name,) = _sums(on)
    ids = [int(n.split()[0][1:]) for n in _sums(off)]
    assert name == "%" + "+".join(map(str, ids)) + " matmul sum_splits"
    from meganeura.schedule.schedule import schedule

    (merged,) = [ks for _, ks in schedule(_qkv_graph(), H200_LIMITS, fuse=True).dispatches
                 if ks.name == name]  # fmt: skip
    assert [type(b) for b in merged.bindings] == [ScratchRef, ValueRef] * 3
    assert [b.owner for b in merged.bindings[::2]] == ids  # each product's own partials
    outs = merged.bindings[1::2]
    assert [b.node for b in outs] == ids and all(b.write for b in outs)


def test_outputs_live_from_the_merged_dispatch_and_partials_until_it():
    from meganeura.schedule.schedule import schedule

    graph = _qkv_graph()
    sched = schedule(graph, H200_LIMITS, fuse=True)
    names = [ks.name for _, ks in sched.dispatches]
    (pos,) = [i for i, n in enumerate(names) if n.endswith("sum_splits")]
    _, ks = sched.dispatches[pos]
    ivs = {iv.key: iv for iv in sched.intervals}
    for b in ks.bindings:
        if isinstance(b, ScratchRef):  # written by the partials dispatch, last read here
            iv = ivs[(b.owner, "splitk")]
            assert iv.start < pos == iv.end
        else:  # written here, read by its reduction after
            iv = ivs[sched.root[b.node]]
            assert iv.start == pos < iv.end


def test_the_switch_and_sums_apart_stay_separate():
    summing.set_enabled(False)
    try:
        assert len(_sums(compile(_qkv_graph(), CompileOptions(), H200_LIMITS))) == 3
    finally:
        summing.set_enabled(True)
    b = GraphBuilder()  # different left operands: [partials, sum] per product, never adjacent
    for i in range(2):
        p = F.linear(b.input(f"x{i}", (40, 96)), b.parameter(f"w{i}", (48, 96)))
        b.output(f"s{i}", F.sum(p, -1))
    on, off = _both(b.build(), CompileOptions(), H200_LIMITS)
    assert [d.name for d in on.dispatches] == [d.name for d in off.dispatches]
    assert len(_sums(on)) == 2


def test_lower_sum_run_errors():
    from dataclasses import replace

    graph = _qkv_graph()
    prods = [n.id for n in graph.nodes if n.op == "matmul"]
    with pytest.raises(ValueError, match="storage bindings"):
        summing.lower_sum_run(
            graph, prods, replace(H200_LIMITS, max_storage_buffers_per_shader_stage=4)
        )
    x = next(n.id for n in graph.nodes if n.op == "input")
    with pytest.raises(ValueError, match="not a split-K matmul"):
        summing.lower_sum_run(graph, [prods[0], x], H200_LIMITS)


# ---- execution (GPU) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_merged_sums_bit_identical(gpu_device, precision):
    """Fast mode stores the products as f16: each body narrows as its own dispatch did."""
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _qkv_graph()
    params = _params(graph)
    x = RNG.standard_normal((1, 40, 96)).astype(np.float32)
    on, off = _both(graph, CompileOptions(precision=precision), limits)
    assert len(_sums(on)) == 1 and len(_sums(off)) == 3
    names = [f"s{i}" for i in range(3)]
    got = run_identical(gpu_device, (on, off), {"x": x}, names, params)
    tol = 1e-5 if precision == "strict" else 2e-2
    for i, name in enumerate(names):
        p = x[0].astype(np.float64) @ params[f"w{i}"].astype(np.float64).T
        np.testing.assert_allclose(got[name][0], p.sum(-1), rtol=tol, atol=tol, err_msg=name)


CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
           max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip


def _count_merged(monkeypatch) -> list[int]:
    """Record the number of products of each merged summing dispatch lowered from now on."""
    seen: list[int] = []
    lower = summing.lower_sum_run

    def record(graph, nids, limits):
        seen.append(len(nids))
        return lower(graph, nids, limits)

    monkeypatch.setattr(summing, "lower_sum_run", record)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_tiny_llama_logits_bit_identical_and_match_transformers(gpu_device, precision, monkeypatch):
    """The project's Llama (2 layers, 20 tokens): per layer q, k and v's sums (read by the
    attention kernel) are one dispatch. Logits on and off bit for bit, and transformers'
    float64 ones within f32 (f16) rounding."""
    import torch
    import transformers

    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.training import device_limits

    if precision == "fast" and not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    # the attention forward would read q, k and v's partials itself (no sums left to merge)
    monkeypatch.setattr(attention_summed, "ENABLED", [False])
    seen = _count_merged(monkeypatch)
    ids = np.random.default_rng(5).integers(0, 96, (1, 20)).astype(np.int32)
    got = []
    for on in (True, False):
        summing.set_enabled(on)
        mn.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CFG))
        got.append(mn.compile(model, precision=precision, device=gpu_device)(ids))
    summing.set_enabled(True)
    assert seen == [3, 3]
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
def test_tiny_llama_training_step_bit_identical(gpu_device, monkeypatch):
    """The Trainer's step (forward, backward, SGD at lr 0): loss and every gradient."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    # the rotations would read q and k's partials themselves (``attention.summed``)
    monkeypatch.setattr(attention_summed, "ENABLED", [False])
    seen = _count_merged(monkeypatch)
    tokens = np.random.default_rng(6).integers(0, 96, (1, 13))
    got = []
    for on in (True, False):
        summing.set_enabled(on)
        mn.manual_seed(13)
        model = LlamaForCausalLM(LlamaConfig(**CFG))
        tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
        got.append(tr.step(tokens[:, :-1], tokens[:, 1:].copy(), return_grads=True))
    summing.set_enabled(True)
    assert len(seen) >= 2  # the forward's q, k and v, per layer
    assert got[0][0] == got[1][0]
    assert got[0][1].keys() == got[1][1].keys()
    for name, g in got[0][1].items():
        np.testing.assert_array_equal(g, got[1][1][name], err_msg=name)
