"""passes.permute_views: the head-layout permutes around attention need no kernels.

Dispatch counts of a SmolLM2-like model (forward, prefill with a KV cache, training step)
with and without the rule (no GPU), then values on the GPU: attention written as models write
it (``[B, S, H, D]`` projections permuted to heads and back), causal GQA with rotary
embeddings, cross attention (other key length), a padding mask, strict and fast, against the
program without the rule and against torch float64 autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import reads
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.attention import apply_rotary_emb, scaled_dot_product_attention
from meganeura.passes import permute_views
from meganeura.runtime import Session
from meganeura.training import device_limits

from ..opinfo.attention import _rope_ref, _sdpa_ref

LIMITS = Limits(max_storage_buffers_per_shader_stage=32)


def _tiny_llama():
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _names(graph, options, enabled, monkeypatch):
    monkeypatch.setattr(permute_views, "ENABLED", enabled)
    program = compile(graph, options, LIMITS)
    return [d.name.split()[1] for d in program.dispatches]


def _counts(graph, options, monkeypatch):
    """(dispatch names without the rule, with it)."""
    return _names(graph, options, False, monkeypatch), _names(graph, options, True, monkeypatch)


def test_tiny_llama_forward_prefill_and_training_run_no_permutes(monkeypatch):
    import meganeura as mn
    from meganeura.models.llama import lm_loss
    from meganeura.nn.compiled import trace_call
    from meganeura.training.batches import bind_model

    ids = np.zeros((1, 6), np.int32)
    model = _tiny_llama()
    fwd = trace_call(model, model.forward, (ids,), {}).graph
    before, after = _counts(fwd, CompileOptions(), monkeypatch)
    assert before.count("permute") == 2 * 4  # q, k, v to heads, the output back, per layer
    # the 8 permutes go; with them the q, k, v of a layer (and its norm) merge into one
    # dispatch (``fuse_matmul`` orders readers through nodes without a kernel): 3 more a layer
    assert "permute" not in after and len(before) - len(after) == 8 + 2 * 3

    model.setup_cache(1, 16)
    kw = {"cache_position": np.int32(0), "logits_to_keep": 1, "greedy": True}
    prefill = trace_call(model, model.forward, (ids,), kw).graph
    before, after = _counts(prefill, CompileOptions(), monkeypatch)
    assert before.count("permute") == 8 and "permute" not in after
    assert len(before) - len(after) == 8 + 2 * 3

    train_model = _tiny_llama()
    fn = bind_model(lm_loss, train_model)
    train = trace_call(train_model, fn, (ids, ids), {}, "loss").graph
    options = CompileOptions(loss="loss", optimizer=mn.optim.AdamW(lr=1e-3))
    before, after = _counts(train, options, monkeypatch)
    # forward 4 per layer; backward: the output gradient to heads, dq, dk, dv back
    assert before.count("permute") == 2 * 8 and "permute" not in after
    # and q, k, v of each layer's forward merge into one dispatch (2 more a layer)
    assert len(before) - len(after) == 16 + 2 * 2


def _graph(b_, lq, lk, hq, hkv, d, *, causal, rope, mask_shape=None):
    """``sum(o * w)`` of attention as a model writes it, ``o`` the output permuted back to
    [B, Lq, Hq*D]; returns the graph with the output and the gradients of q, k, v (each
    [B, L, H, D]) as outputs."""
    b = GraphBuilder()
    q = b.parameter("q", (b_, lq, hq, d))
    k, v = b.parameter("k", (b_, lk, hkv, d)), b.parameter("v", (b_, lk, hkv, d))
    qh, kh, vh = (F.permute(t, (0, 2, 1, 3)) for t in (q, k, v))
    if rope:
        qh, kh = apply_rotary_emb(qh, 100.0), apply_rotary_emb(kh, 100.0)
    mask = b.input("mask", mask_shape) if mask_shape is not None else None
    out = scaled_dot_product_attention(qh, kh, vh, mask, is_causal=causal, enable_gqa=True)
    o = F.reshape(F.permute(out, (0, 2, 1, 3)), (b_, lq, hq * d))
    w = b.input("w", o.shape)
    b.output("o", o)
    b.output("loss", F.sum(o * w))
    graph, grads = differentiate(b.build(), "loss", ["q", "k", "v"])
    gb = GraphBuilder(graph)
    for n in "qkv":
        gb.output(f"d{n}", gb.tensor(grads[graph.find(n).id]))
    return gb.build()


def _torch(params, feeds, *, causal, rope):
    t = {n: torch.tensor(params[n], dtype=torch.float64, requires_grad=True) for n in "qkv"}
    qh, kh, vh = (t[n].permute(0, 2, 1, 3) for n in "qkv")
    if rope:
        qh, kh = _rope_ref(qh, 100.0), _rope_ref(kh, 100.0)
    mask = feeds.get("mask")
    if mask is not None:
        mask = torch.tensor(mask, dtype=torch.float64)
        if causal:  # torch takes one or the other: fold the causal rule into the mask
            lq, lk = qh.shape[2], kh.shape[2]
            future = torch.arange(lk)[None, :] > torch.arange(lq)[:, None]
            mask = torch.where(future, -torch.inf, mask.expand(*mask.shape[:-2], lq, lk))
            causal = False
    out = _sdpa_ref(qh, kh, vh, mask, is_causal=causal, enable_gqa=True)
    o = out.permute(0, 2, 1, 3).reshape(feeds["w"].shape)
    (o * torch.tensor(feeds["w"], dtype=torch.float64)).sum().backward()
    return {"o": o.detach().numpy(), **{f"d{n}": t[n].grad.numpy() for n in "qkv"}}


def _run(device, graph, params, feeds, enabled, monkeypatch, precision="strict", full_names=False):
    monkeypatch.setattr(permute_views, "ENABLED", enabled)
    options = CompileOptions(precision=precision)
    program = compile(graph, options, device_limits(device))
    fetch = ["o", "dq", "dk", "dv"]
    with Session(program, device) as sess:
        sess.load_state_dict(params)
        got = sess.run(feeds, fetch)
    names = [d.name if full_names else d.name.split()[1] for d in program.dispatches]
    return got, names


CASES = {
    # (B, Lq, Lk, Hq, Hkv, D), causal, rope, mask shape
    "causal_gqa_rope": ((2, 7, 7, 4, 2, 8), True, True, None),
    "padding_mask_gqa": ((2, 6, 6, 4, 1, 12), False, True, (2, 1, 1, 6)),
    "cross_lq5_lk9_padding": ((2, 5, 9, 3, 3, 4), True, False, (2, 1, 1, 9)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_values_match_the_copying_program_and_torch(case, gpu_device, monkeypatch):
    (b_, lq, lk, hq, hkv, d), causal, rope, mask_shape = CASES[case]
    graph = _graph(b_, lq, lk, hq, hkv, d, causal=causal, rope=rope, mask_shape=mask_shape)
    rng = np.random.default_rng(5)
    params = {
        "q": rng.standard_normal((b_, lq, hq, d)).astype(np.float32),
        "k": rng.standard_normal((b_, lk, hkv, d)).astype(np.float32),
        "v": rng.standard_normal((b_, lk, hkv, d)).astype(np.float32),
    }
    feeds = {"w": rng.standard_normal((b_, lq, hq * d)).astype(np.float32)}
    if mask_shape is not None:  # padding: the last keys of the first sequence masked
        mask = np.zeros(mask_shape, np.float32)
        mask[0, ..., lk - 2 :] = -np.inf
        feeds["mask"] = mask
    got, names = _run(gpu_device, graph, params, feeds, True, monkeypatch)
    plain, plain_names = _run(gpu_device, graph, params, feeds, False, monkeypatch)
    assert "permute" not in names and plain_names.count("permute") >= 4
    want = _torch(params, feeds, causal=causal, rope=rope)
    for name in ("o", "dq", "dk", "dv"):
        # the same kernels computing in the same order: only addresses differ
        np.testing.assert_array_equal(got[name], plain[name], err_msg=name)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.gpu
def test_fast_mode_values(gpu_device, monkeypatch):
    if not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    (b_, lq, lk, hq, hkv, d), causal, rope, _ = CASES["causal_gqa_rope"]
    graph = _graph(b_, lq, lk, hq, hkv, d, causal=causal, rope=rope)
    rng = np.random.default_rng(6)
    params = {
        "q": rng.standard_normal((b_, lq, hq, d)).astype(np.float32),
        "k": rng.standard_normal((b_, lk, hkv, d)).astype(np.float32),
        "v": rng.standard_normal((b_, lk, hkv, d)).astype(np.float32),
    }
    feeds = {"w": rng.standard_normal((b_, lq, hq * d)).astype(np.float32)}
    got, names = _run(gpu_device, graph, params, feeds, True, monkeypatch, "fast")
    plain, _ = _run(gpu_device, graph, params, feeds, False, monkeypatch, "fast")
    assert "permute" not in names
    want = _torch(params, feeds, causal=causal, rope=rope)
    for name in ("o", "dq", "dk", "dv"):
        # f16 storage: the copies rounded what they moved, a strided read or write does not
        err, plain_err = (np.abs(x - want[name]).max() for x in (got[name], plain[name]))
        assert err <= plain_err * 1.01 + 1e-6, (name, err, plain_err)
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-2, err_msg=name)


def test_reads_report_the_buffers_kernels_bind():
    (b_, lq, lk, hq, hkv, d), causal, rope, _ = CASES["causal_gqa_rope"]
    graph = _graph(b_, lq, lk, hq, hkv, d, causal=causal, rope=rope)
    sdpa = next(n for n in graph.nodes if n.op == "scaled_dot_product_attention")
    perm = permute_views.placement(graph, sdpa.id)
    assert perm is not None and graph[perm].op == "permute"
    # v is read from the parameter's buffer; the rotations from their own
    v_param = graph.find("v").id
    assert v_param in reads(graph, sdpa.id)
    assert reads(graph, perm) == (sdpa.id,)
    delta = next(n for n in graph.nodes if n.op == "scaled_dot_product_attention_delta")
    assert perm in reads(graph, delta.id) and sdpa.id not in reads(graph, delta.id)


def _case_values(device, case, monkeypatch, seed=7):
    (b_, lq, lk, hq, hkv, d), causal, rope, mask_shape = CASES[case]
    graph = _graph(b_, lq, lk, hq, hkv, d, causal=causal, rope=rope, mask_shape=mask_shape)
    rng = np.random.default_rng(seed)
    params = {
        "q": rng.standard_normal((b_, lq, hq, d)).astype(np.float32),
        "k": rng.standard_normal((b_, lk, hkv, d)).astype(np.float32),
        "v": rng.standard_normal((b_, lk, hkv, d)).astype(np.float32),
    }
    feeds = {"w": rng.standard_normal((b_, lq, hq * d)).astype(np.float32)}
    if mask_shape is not None:
        mask = np.zeros(mask_shape, np.float32)
        mask[0, ..., lk - 2 :] = -np.inf
        feeds["mask"] = mask
    got, names = _run(device, graph, params, feeds, True, monkeypatch, full_names=True)
    return got, names, _torch(params, feeds, causal=causal, rope=rope)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal_gqa_rope", "cross_lq5_lk9_padding"])
def test_register_tiled_kernels_read_and_write_views(case, gpu_device, monkeypatch):
    """The block kernels (forced; the lane kernel is the automatic choice) index through the
    same strides."""
    from meganeura.codegen.wgsl.attention import plan as attention_plan

    forced = {m: (8, 8, 2, 4) for m in ("fwd", "stats", "dq", "dk", "dv", "dkv")}
    monkeypatch.setattr(attention_plan, "BLOCK_OVERRIDE", forced)
    got, names, want = _case_values(gpu_device, case, monkeypatch)
    assert "permute" not in names and any("block" in n for n in names)
    for name in ("o", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.gpu
def test_split_key_forward_writes_the_permuted_output(gpu_device, monkeypatch):
    """The flash-decoding forward (keys split over workgroups, then a merge kernel) of a short
    query block writes the output permute's buffer from its merge kernel."""
    from meganeura.codegen.wgsl.attention import splits as attention_splits

    monkeypatch.setattr(attention_splits, "SPLIT_OVERRIDE", True)
    b = GraphBuilder()
    q, k, v = b.input("q", (1, 2, 4, 8)), b.input("k", (1, 40, 2, 8)), b.input("v", (1, 40, 2, 8))
    qh, kh, vh = (F.permute(t, (0, 2, 1, 3)) for t in (q, k, v))
    out = scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    b.output("o", F.reshape(F.permute(out, (0, 2, 1, 3)), (1, 2, 32)))
    graph = b.build()
    rng = np.random.default_rng(8)
    feeds = {n: rng.standard_normal(graph.find(n).type.shape).astype(np.float32) for n in "qkv"}
    program = compile(graph, CompileOptions(), device_limits(gpu_device))
    names = [d.name for d in program.dispatches]
    assert any("split" in n for n in names) and not any("permute" in n for n in names)
    with Session(program, gpu_device) as sess:
        got = sess.run(feeds, ["o"])["o"]
    t = {n: torch.tensor(feeds[n], dtype=torch.float64).permute(0, 2, 1, 3) for n in "qkv"}
    want = _sdpa_ref(t["q"], t["k"], t["v"], enable_gqa=True).permute(0, 2, 1, 3).reshape(1, 2, 32)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=2e-5)


def _attention(out_users):
    """sdpa of permuted [1, 3, 2, 4] operands; ``out_users(b, out)`` adds the outputs."""
    b = GraphBuilder()
    q, k, v = (b.input(n, (1, 3, 2, 4)) for n in "qkv")
    qh, kh, vh = (F.permute(t, (0, 2, 1, 3)) for t in (q, k, v))
    out = scaled_dot_product_attention(qh, kh, vh)
    out_users(b, out)
    return b.build()


@pytest.mark.parametrize(
    "users",
    [
        lambda b, o: (b.output("p", F.permute(o, (0, 2, 1, 3))), b.output("y", o + 1.0)),
        lambda b, o: (b.output("p", F.permute(o, (0, 2, 1, 3))), b.output("o", o)),
        lambda b, o: b.output("p", F.permute(o, (0, 1, 3, 2))),
        lambda b, o: (
            b.output("p", F.permute(o, (0, 2, 1, 3))),
            b.output("r", F.reshape(o, (-1,))),
        ),
    ],
    ids=["read_by_a_map", "a_graph_output", "last_dim_moved", "read_through_a_view"],
)
def test_an_output_other_kernels_read_keeps_its_buffer(users, monkeypatch):
    graph = _attention(users)
    sdpa = next(n for n in graph.nodes if n.op == "scaled_dot_product_attention")
    assert permute_views.placement(graph, sdpa.id) is None
    before, after = _counts(graph, CompileOptions(fuse=False), monkeypatch)
    assert after.count("permute") == 1 and before.count("permute") == 4


def test_a_permute_moving_the_head_dim_is_copied(monkeypatch):
    b = GraphBuilder()
    q, k, v = (b.input(n, (1, 4, 2, 4)) for n in "qkv")  # [B, D, H, S] -> [B, H, S, D]
    qh, kh, vh = (F.permute(t, (0, 2, 3, 1)) for t in (q, k, v))
    b.output("o", scaled_dot_product_attention(qh, kh, vh))
    graph = b.build()
    assert all(permute_views.read_view(graph, i) is None for i in (qh.id, kh.id, vh.id))
    assert _counts(graph, CompileOptions(), monkeypatch)[1].count("permute") == 3
