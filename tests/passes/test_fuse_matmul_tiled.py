"""Horizontal matmul fusion on the tiled kernel (``codegen.wgsl.matmul.tiled_group``): M > 8
rows, matmuls sharing a left operand and the norm producing it as one dispatch.

Plans are forced (the CPU adapter's own plan for M > 8 is the ``simd`` kernel, which does not
group), so the fused and unfused programs run the same tile. Without a norm prologue each
product's K order is the unfused kernel's, so results are compared exactly; with one, within
f32 rounding of ``rstd``.
"""

from __future__ import annotations

import pytest

from meganeura.codegen.kernel import H200_LIMITS, Limits
from meganeura.codegen.wgsl.matmul.plan import force_plan
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.activation import silu
from meganeura.ops.norm import rms_norm

from .test_fuse_matmul import BIG, _attention_in, _check, _mlp_in, _ops, _plan


@pytest.fixture
def plan(request):
    force_plan(request.param)
    yield request.param
    force_plan(None)


@pytest.fixture(autouse=True)
def tiled_prologues():
    """The tiled groups' norm prologue, off by default (``fuse_matmul.TILED_NORMS_APART``: the
    H200 timed it slower), is what most of this file tests: on here, restored after."""
    from meganeura.passes import fuse_matmul

    fuse_matmul.set_tiled_norms_apart(False)
    yield
    fuse_matmul.set_tiled_norms_apart(True)


# ---- planning (no GPU) ------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_tiled_groups_keep_the_norm_apart_by_default(plan):
    """By default (``set_tiled_norms_apart(True)``) a tiled group leaves the norm its own
    dispatch; a GEMV group (M <= 8 rows) still takes it as a prologue."""
    from meganeura.passes import fuse_matmul

    fuse_matmul.set_tiled_norms_apart(True)
    g, (grp,), sched = _plan(_attention_in(m=70, k=40))
    assert grp.norm is None and _ops(g, grp.members) == ["matmul", "matmul", "matmul"]
    assert len(sched.dispatches) == 2 and "<workgroup> nst" not in sched.dispatches[1][1].wgsl
    force_plan(None)  # decode-sized rows: the GEMV group, prologue kept
    g, (grp,), sched = _plan(_attention_in(m=1, k=40))
    assert _ops(g, grp.members) == ["rms_norm", "matmul", "matmul", "matmul"]
    assert len(sched.dispatches) == 1


@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_qkv_of_many_rows_and_their_norm_become_one_dispatch(plan):
    g, (grp,), sched = _plan(_attention_in(m=70, k=40))
    assert _ops(g, grp.members) == ["rms_norm", "matmul", "matmul", "matmul"]
    assert len(sched.dispatches) == 1 and "<workgroup> nst" in sched.dispatches[0][1].wgsl
    assert len(compile(_attention_in(m=70, k=40), CompileOptions(fuse=False), BIG).dispatches) == 4


@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_prologue_switch_keeps_the_norm_apart(plan):
    """``fuse_matmul.set_prologues(False)`` (the bench lever ``matmul_norm_prologue``): the
    qkv matmuls still run as one group, the norm in its own dispatch before it."""
    from meganeura.passes import fuse_matmul

    fuse_matmul.set_prologues(False)
    try:
        g, (grp,), sched = _plan(_attention_in(m=70, k=40))
    finally:
        fuse_matmul.set_prologues(True)
    assert grp.norm is None and _ops(g, grp.members) == ["matmul", "matmul", "matmul"]
    assert len(sched.dispatches) == 2 and "<workgroup> nst" not in sched.dispatches[1][1].wgsl


@pytest.mark.parametrize("plan", ["128x128x8/d2"], indirect=True)
def test_two_product_segments_take_a_smaller_per_thread_tile(plan):
    from meganeura.codegen.wgsl.matmul.tiled_group import group_plan

    g, (grp,), sched = _plan(_mlp_in(m=20, k=32, n=48))
    assert [len(s.anchors) for s in grp.segments] == [2]
    assert group_plan(g, grp, BIG).tiling.name == "128x64x16"  # 8x4 per thread, two sets
    assert len(sched.dispatches) == 2


def test_split_k_members_stay_apart_by_default_and_group_unsplit_when_asked():
    # SmolLM2's prefill shapes are tuned to split K: by default they keep their split (the
    # H200 timed the prefill slower with them joined); asked, the group runs them unsplit
    from meganeura.codegen.wgsl.matmul import tiled_group
    from meganeura.codegen.wgsl.matmul.tiled_group import group_plan

    gpu = Limits(max_workgroup_storage_size=49152)
    assert _plan(_attention_in(m=128, k=576), gpu)[1] == []
    tiled_group.set_split_members(True)
    try:
        g, (grp,), sched = _plan(_attention_in(m=128, k=576), gpu)
        assert len(sched.dispatches) == 1
        assert group_plan(g, grp, gpu).splits == 1
        # a longer K stays split (SPLIT_MEMBERS_MAX_K)
        assert _plan(_attention_in(m=128, k=1536), gpu)[1] == []
    finally:
        tiled_group.set_split_members(False)


# ---- execution (GPU) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16", "128x64x16/np", "128x128x8/d2"], indirect=True)
@pytest.mark.parametrize("norm", ["rms", "layer", None], ids=lambda n: n or "no_norm")
@pytest.mark.parametrize("k", [48, 30], ids=lambda k: f"k{k}")  # vec4 and scalar loads
def test_qkv_values_match_the_unfused_program(gpu_device, plan, norm, k):
    # M = 70: not a multiple of any tile; N = k, k / 2, k / 2: ragged columns
    _check(_attention_in(70, k, norm), gpu_device, kernels=1, exact=norm is None)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16", "128x128x8", "128x128x8/d2"], indirect=True)
def test_silu_gate_times_up_values_match_the_unfused_program(gpu_device, plan):
    _check(_mlp_in(37, 64, 96), gpu_device, kernels=2, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_weights_stored_k_by_n_and_epilogues_per_segment(gpu_device, plan):
    b = GraphBuilder()
    x = b.input("x", (19, 40))
    r = b.input("r", (19, 24))
    b.output("a", F.sigmoid(x @ b.parameter("a.weight", (40, 72))))  # [K, N], 2 column tiles
    b.output("s", silu(F.linear(x, b.parameter("s.weight", (24, 40)))) + r)
    b.output("g", F.linear(x, b.parameter("g.weight", (8, 40))))
    _check(b.build(), gpu_device, kernels=1, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_many_row_tiles_with_the_norm_prologue(gpu_device, plan):
    # 150 rows: three row tiles, each workgroup's statistics its own rows'
    b = GraphBuilder()
    x = b.input("x", (150, 36))
    h = rms_norm(x, 36, b.parameter("ln.weight", (36,)), eps=1e-6)
    for name, n in (("q", 130), ("k", 36), ("v", 20)):
        b.output(name, F.linear(h, b.parameter(f"{name}.weight", (n, 36))))
    _check(b.build(), gpu_device, kernels=1, exact=False)


@pytest.mark.gpu
def test_smollm2_prefill_group_kernels_validate_on_h200_limits(gpu_device):
    """SmolLM2's prefill (128 rows) on the H200's limits with split products joined
    (``set_split_members(True)``): each layer's norm + q/k/v and norm + gate/up (+ silu * up)
    are one tiled dispatch each, valid WGSL for naga (shader modules only: their workgroup
    memory exceeds lavapipe's)."""
    import numpy as np

    from meganeura.codegen.wgsl.matmul import tiled_group
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, vocab_size=512))
    model.setup_cache(1, 256)
    ids = np.zeros((1, 128), np.int32)
    kw = {"cache_position": np.int32(0), "logits_to_keep": 1, "greedy": True}
    graph = trace_call(model, model.forward, (ids,), kw).graph
    tiled_group.set_split_members(True)
    try:
        program = compile(graph, CompileOptions(), H200_LIMITS)
    finally:
        tiled_group.set_split_members(False)
    names = [d.name for d in program.dispatches]
    merged = [d for d in program.dispatches if "var<workgroup> nst" in d.wgsl]
    assert [d.name.split()[0].count("+") for d in merged] == [3, 4]  # norm+q+k+v, +g+u+silu+mul
    assert sum("rms_norm" in n for n in names) == 1  # the final norm only
    for d in merged:
        gpu_device.gpu.create_shader_module(code=d.wgsl)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_llama_forward_and_training_step_match_transformers(gpu_device, plan):
    """A 2-layer Llama on 12 tokens with tiled plans: the forward's norm + q/k/v and norm +
    gate/up groups (prologues), the training step's forward groups (norms stored for the
    backward) against transformers in float64."""
    import numpy as np
    import torch
    import transformers

    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    cfg = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    mn.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    state = model.state_dict()
    tokens = np.random.default_rng(3).integers(0, 96, (1, 13))
    ids, labels = tokens[:, :-1], tokens[:, 1:].copy()
    ref = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**cfg, attn_implementation="eager")
    ).to(torch.float64)
    ref.load_state_dict({k: torch.from_numpy(v).double() for k, v in state.items()}, strict=False)
    out = ref(torch.from_numpy(ids)).logits
    want_loss = torch.nn.functional.cross_entropy(out.reshape(-1, 96), torch.from_numpy(labels)[0])
    want_loss.backward()
    got = model(ids.astype(np.int32))
    want = out.detach().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
    loss, grads = tr.step(ids, labels, return_grads=True)
    assert abs(loss - want_loss.item()) <= 1e-5
    named = dict(ref.named_parameters())
    for name, g in grads.items():
        w = named[name].grad.numpy()
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=name)
