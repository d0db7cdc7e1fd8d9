"""Right-shared matmul groups (``passes.fuse_matmul`` with ``shared="right"``,
``codegen.wgsl.matmul.tiled_rgroup``): weight gradients ``dY_i.mT @ x`` reading one ``x`` run
as one tiled dispatch, segments along M.

Plans are forced (the CPU adapter's own plan for M > 8 is the ``simd`` kernel, which does not
group), so the grouped and ungrouped programs run the same tile; each product's K order is the
ungrouped kernel's, so results are compared exactly on llvmpipe.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS, Limits
from meganeura.codegen.wgsl.matmul import tiled_rgroup
from meganeura.codegen.wgsl.matmul.plan import force_plan
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from .test_fuse_matmul import BIG, _check, _ops, _plan


@pytest.fixture
def plan(request):
    force_plan(request.param)
    yield request.param
    force_plan(None)


def _weight_grads(k: int = 30, n: int = 72, ms=(70, 33, 130), row_major: int = -1):
    """x [k, n] read as the right operand of ``dy_i.mT @ x`` (dy_i [k, m_i]); product
    ``row_major`` reads its left operand as stored, [m, k] (layout ``nn``)."""
    b = GraphBuilder()
    x = b.input("x", (k, n))
    for i, m in enumerate(ms):
        if i == row_major:
            b.output(f"w{i}", b.input(f"dy{i}", (m, k)) @ x)
        else:
            b.output(f"w{i}", b.input(f"dy{i}", (k, m)).mT @ x)
    return b.build()


# ---- planning (no GPU) ------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_weight_gradients_sharing_x_become_one_dispatch(plan):
    g, (grp,), sched = _plan(_weight_grads())
    assert grp.shared == "right" and grp.norm is None
    assert _ops(g, grp.members) == ["matmul"] * 3
    assert [len(s.anchors) for s in grp.segments] == [1, 1, 1]
    assert len(sched.dispatches) == 1
    # 70, 33 and 130 rows: 2 + 1 + 3 row tiles of 64, times 2 column tiles
    assert "let tile_mg = wg / 2u;" in sched.dispatches[0][1].wgsl
    assert np.prod(sched.dispatches[0][1].grid) == 12
    assert len(compile(_weight_grads(), CompileOptions(fuse=False), BIG).dispatches) == 3


@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_the_switch_and_split_plans_keep_products_apart(plan):
    tiled_rgroup.set_enabled(False)
    try:
        assert _plan(_weight_grads())[1] == []
    finally:
        tiled_rgroup.set_enabled(True)
    force_plan("64x64x16/s2")  # products whose plan splits K stay apart
    assert _plan(_weight_grads())[1] == []


@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_a_product_reading_a_member_stays_apart(plan):
    b = GraphBuilder()
    x = b.input("x", (24, 24))
    w0 = b.input("dy0", (24, 40)).mT @ x
    b.output("w0", w0)
    b.output("w1", w0 @ x)  # its left operand is the first product
    b.output("w2", b.input("dy2", (24, 20)).mT @ x)
    g, (grp,), _ = _plan(b.build())
    assert len(grp.segments) == 2 and g[grp.members[0]].op == "matmul"


def test_h200_plans_group_the_smollm2_and_smolvla_weight_gradient_shapes():
    # K = the token count: the H200's plans for these products are unsplit
    g, (grp,), sched = _plan(_weight_grads(k=128, n=576, ms=(576, 192, 192)), H200_LIMITS)
    assert len(sched.dispatches) == 1 and grp.shared == "right"
    g, (grp,), sched = _plan(_weight_grads(k=50, n=720, ms=(2048, 2048)), H200_LIMITS)
    assert len(sched.dispatches) == 1


def test_smollm2_training_step_dispatch_count_on_h200_limits():
    """One SmolLM2 layer's training step (128 tokens, AdamW) on the H200's limits: the q/k/v
    and gate/up weight gradients are one dispatch each, three fewer than apart."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, vocab_size=512))
    ids = (np.arange(128, dtype=np.int32) % 512)[None]
    labels = ((np.arange(128) + 1) % 512).astype(np.int32)[None]
    graph = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, labels), {}, "loss").graph
    options = CompileOptions(loss="loss", optimizer=mn.optim.AdamW(lr=1e-5))

    def dispatches(grouped: bool):
        tiled_rgroup.set_enabled(grouped)
        try:
            return compile(graph, options, H200_LIMITS).dispatches
        finally:
            tiled_rgroup.set_enabled(True)

    on, off = dispatches(True), dispatches(False)
    right = [d.name.split()[0].count("+") + 1 for d in on if "(tile_mg - " in d.wgsl]
    assert sorted(right) == [2, 3] and len(on) == len(off) - 3


def test_the_binding_limit_splits_a_group():
    tight = Limits(max_workgroup_storage_size=32768, max_storage_buffers_per_shader_stage=5)
    force_plan("64x64x16")
    try:  # x, a left operand and an output per product: 3 products need 7 bindings, 2 need 5
        _, (grp,), sched = _plan(_weight_grads(), tight)
        assert len(grp.segments) == 2 and len(sched.dispatches) == 2
    finally:
        force_plan(None)


# ---- execution (GPU) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16", "128x64x16/np", "128x128x8/d2"], indirect=True)
@pytest.mark.parametrize("k", [48, 30], ids=lambda k: f"k{k}")  # vec4 and scalar loads
@pytest.mark.parametrize("n", [72, 30], ids=lambda n: f"n{n}")
def test_weight_gradient_values_match_the_ungrouped_program(gpu_device, plan, k, n):
    _check(_weight_grads(k, n), gpu_device, kernels=1, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_fast_precision_values_match_the_ungrouped_program(gpu_device, plan):
    """Fast mode stores the operands and products as f16: the grouped kernel widens and
    narrows them as the ungrouped ones do."""
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _weight_grads(48, 72)
    rng = np.random.default_rng(4)
    feeds = {n.name: rng.standard_normal(n.type.shape).astype(np.float32)
             for n in graph.nodes if n.op == "input"}  # fmt: skip
    got = []
    for on in (True, False):
        tiled_rgroup.set_enabled(on)
        try:
            program = compile(graph, CompileOptions(precision="fast"), limits)
        finally:
            tiled_rgroup.set_enabled(True)
        assert len(program.dispatches) == (1 if on else 3)
        with Session(program, gpu_device) as s:
            got.append(s.run(feeds, [name for name, _ in graph.outputs]))
    for name, _ in graph.outputs:
        np.testing.assert_array_equal(got[0][name], got[1][name], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_row_major_left_operand_and_epilogues(gpu_device, plan):
    b = GraphBuilder()
    x = b.input("x", (40, 36))
    r = b.input("r", (19, 36))
    b.output("a", F.sigmoid(b.input("da", (40, 100)).mT @ x))
    b.output("s", b.input("ds", (19, 40)) @ x + r)  # row-major A, a residual epilogue
    b.output("g", b.input("dg", (40, 9)).mT @ x)
    _check(b.build(), gpu_device, kernels=1, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["64x64x16"], indirect=True)
def test_llama_training_step_groups_weight_gradients_bit_identically(gpu_device, plan, monkeypatch):
    """A 2-layer Llama training step (12 tokens, tiled plans): per layer the q/k/v and the
    gate/up weight gradients are one dispatch each; gradients equal the ungrouped program's
    bit for bit (llvmpipe) and transformers' float64 ones within f32 rounding."""
    import torch
    import transformers

    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    cfg = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    import meganeura.schedule.schedule as sched

    lowered = []

    def lower(graph, group, limits):
        lowered.append(len(group.members))
        return tiled_rgroup.lower_right_group(graph, group, limits)

    monkeypatch.setattr(sched, "lower_right_group", lower)
    tokens = np.random.default_rng(5).integers(0, 96, (1, 13))
    ids, labels = tokens[:, :-1].astype(np.int32), tokens[:, 1:].copy()

    def step(grouped: bool):
        tiled_rgroup.set_enabled(grouped)
        try:
            mn.manual_seed(11)
            model = LlamaForCausalLM(LlamaConfig(**cfg))
            tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
            loss, grads = tr.step(ids, labels, return_grads=True)
        finally:
            tiled_rgroup.set_enabled(True)
        return model.state_dict(), loss, grads

    state, loss, grads = step(True)
    assert sorted(lowered) == [2, 2, 3, 3]  # per layer gate/up and q/k/v
    _, loss0, grads0 = step(False)
    assert len(lowered) == 4
    assert loss == loss0
    for name, g in grads.items():
        if "llvmpipe" in gpu_device.name.lower():
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
