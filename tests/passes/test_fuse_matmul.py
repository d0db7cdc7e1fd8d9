"""Horizontal matmul fusion (``passes.fuse_matmul``, ``codegen.wgsl.matmul.horizontal``):
matmuls sharing a left operand and the norm producing it run as one gemv dispatch.

Planning tests check the groups and the dispatch counts; GPU tests (lavapipe) compare the
fused program with the unfused one and with the NumPy interpreter. Without a norm prologue the
per-product arithmetic is the unfused gemv's, so results are compared exactly; with one, the
row statistics are summed in another order, so within f32 rounding of ``rstd``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.codegen.kernel import Limits, ValueRef
from meganeura.codegen.wgsl.elementwise.maps import FUSIBLE
from meganeura.compile import CompileOptions, build_training_graph, compile, simplify_program
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.graph.ir import Graph
from meganeura.ops import functional as F
from meganeura.ops.activation import gelu, silu
from meganeura.ops.norm import layer_norm, rms_norm
from meganeura.optim import HYPER_INPUT, SGD
from meganeura.passes.fuse import plan_fusion
from meganeura.passes.fuse_matmul import MatmulGroup, plan_matmul_groups
from meganeura.schedule.schedule import schedule

RNG = np.random.default_rng(12)
BIG = Limits(max_workgroup_storage_size=32768, max_storage_buffers_per_shader_stage=32)


def _attention_in(m: int = 1, k: int = 32, norm: str | None = "rms", extra_reader=False):
    """x [1, m, k] -> norm -> q (k outputs), k and v (k / 2 outputs each), all outputs."""
    b = GraphBuilder()
    x = b.input("x", (1, m, k))
    if norm == "rms":
        h = rms_norm(x, k, b.parameter("ln.weight", (k,)), eps=1e-5)
    elif norm == "layer":
        h = layer_norm(x, k, b.parameter("ln.weight", (k,)), b.parameter("ln.bias", (k,)))
    else:
        h = x
    for name, n in (("q", k), ("k", k // 2), ("v", k // 2)):
        b.output(name, F.linear(h, b.parameter(f"{name}.weight", (n, k))))
    if extra_reader:
        b.output("h", h)
    return b.build()


def _mlp_in(m: int = 1, k: int = 32, n: int = 48, residual: bool = True):
    """rms_norm -> silu(gate) * up -> down (+ x)."""
    b = GraphBuilder()
    x = b.input("x", (1, m, k))
    h = rms_norm(x, k, b.parameter("ln.weight", (k,)), eps=1e-5)
    gate = F.linear(h, b.parameter("gate.weight", (n, k)))
    up = F.linear(h, b.parameter("up.weight", (n, k)))
    down = F.linear(silu(gate) * up, b.parameter("down.weight", (k, n)))
    b.output("y", x + down if residual else down)
    return b.build()


def _plan(graph: Graph, limits: Limits = BIG):
    graph, _ = simplify_program(graph, frozenset())
    sched = schedule(graph, limits, fuse=True)
    return graph, [g for g in sched.groups if isinstance(g, MatmulGroup)], sched


def _ops(graph: Graph, ids) -> list[str]:
    return [graph[i].op for i in ids]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_qkv_and_their_norm_become_one_dispatch():
    g, (grp,), _ = _plan(_attention_in())
    assert _ops(g, grp.members) == ["rms_norm", "matmul", "matmul", "matmul"]
    assert grp.norm == grp.members[0]
    assert [len(s.anchors) for s in grp.segments] == [1, 1, 1]  # no epilogue links them
    assert _ops(g, grp.outputs) == ["matmul"] * 3  # the normalized x is never stored
    assert len(compile(_attention_in(), CompileOptions(), BIG).dispatches) == 1
    assert len(compile(_attention_in(), CompileOptions(fuse=False), BIG).dispatches) == 4


def test_gate_and_up_share_one_segment_and_the_activation_is_not_stored():
    g, (grp,), sched = _plan(_mlp_in())
    (seg,) = grp.segments
    assert _ops(g, seg.anchors) == ["matmul", "matmul"]
    assert _ops(g, seg.epilogue) == ["silu", "mul"]
    assert _ops(g, grp.outputs) == ["mul"]
    # norm + gate + up + silu * up, then down with the residual in its epilogue
    assert len(sched.dispatches) == 2


def test_a_norm_read_elsewhere_is_stored_and_the_matmuls_still_merge():
    g, (grp,), sched = _plan(_attention_in(extra_reader=True))
    assert grp.norm is None and _ops(g, grp.members) == ["matmul"] * 3
    assert len(sched.dispatches) == 2


def test_layer_norm_joins_as_a_prologue_and_plain_x_merges_without_one():
    g, (grp,), _ = _plan(_attention_in(norm="layer"))
    assert g[grp.norm].op == "layer_norm"
    g, (grp,), sched = _plan(_attention_in(norm=None))
    assert grp.norm is None and len(sched.dispatches) == 1


def test_more_than_eight_rows_are_left_to_the_tiled_kernel():
    from meganeura.codegen.wgsl.matmul.tiled_group import is_tiled_group

    g, (grp,), _ = _plan(_attention_in(m=9))  # tests/passes/test_fuse_matmul_tiled.py
    assert is_tiled_group(grp, g, BIG)


def test_a_reader_before_the_last_matmul_splits_the_group():
    b = GraphBuilder()
    x = b.input("x", (1, 32))
    q = F.linear(x, b.parameter("q.weight", (32, 32)))
    s = F.linear(F.exp(q), b.parameter("s.weight", (8, 32)))  # reads q before k and v exist
    k = F.linear(x, b.parameter("k.weight", (16, 32)))
    v = F.linear(x, b.parameter("v.weight", (16, 32)))
    for name, t in (("s", s), ("k", k), ("v", v)):
        b.output(name, t)
    g = b.build()
    needed = [True] * len(g.nodes)
    groups = plan_fusion(g, FUSIBLE, needed)
    from meganeura.codegen.wgsl.matmul.horizontal import gemv_key

    merged = plan_matmul_groups(g, groups, needed, lambda n: gemv_key(g, n, BIG))
    (grp,) = [m for m in merged if isinstance(m, MatmulGroup)]
    assert grp.members == (k.id, v.id)


def test_the_binding_limit_keeps_matmuls_apart():
    # norm x and weight, three weights, three outputs: 8 bindings
    assert len(_plan(_attention_in(), Limits())[1]) == 1
    tight = Limits(max_storage_buffers_per_shader_stage=6)
    g, (grp,), sched = _plan(_attention_in(), tight)
    # q and k merge (x, two weights, two outputs); v does not fit, so the norm stays stored
    assert grp.norm is None and len(grp.segments) == 2
    assert max(len(ks.bindings) for _, ks in sched.dispatches) <= 6


def test_workgroup_memory_of_eight_rows_with_two_products_is_checked():
    # 8 rows x 8 columns x 33 lane sums x 2 products = 16.9 KB > WebGPU's 16 KB minimum
    g, groups, sched = _plan(_mlp_in(m=8), Limits())
    assert not any(len(s.anchors) > 1 for grp in groups for s in grp.segments)
    _, groups, _ = _plan(_mlp_in(m=8), BIG)
    assert any(len(s.anchors) == 2 for grp in groups for s in grp.segments)


def test_fused_kernels_bind_each_value_once():
    g, groups, sched = _plan(_mlp_in())
    for _, ks in sched.dispatches:
        values = [r.node for r in ks.bindings if isinstance(r, ValueRef)]
        assert len(values) == len(set(values)), ks.name
    hidden = {m for grp in groups for m in grp.members} - {m for grp in groups for m in grp.outputs}
    bound = {r.node for _, ks in sched.dispatches for r in ks.bindings if isinstance(r, ValueRef)}
    assert not hidden & bound


def test_smollm2_decode_step_dispatch_count():
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    m = LlamaForCausalLM(LlamaConfig())
    m.setup_cache(1, 512)
    ids = np.zeros((1, 1), np.int32)
    kw = {"cache_position": np.int32(0), "greedy": True}
    traced = trace_call(m, m.forward, (ids,), kw)
    program = compile(traced.graph, CompileOptions())
    names = [d.name for d in program.dispatches]
    # per layer norm + q/k/v, o_proj + residual, norm + gate/up + silu * up, down + residual;
    # then the final norm + lm_head (428 dispatches before, 277 with this fusion on main)
    assert sum(n.endswith(" matmul") for n in names) == 30 * 4 + 1
    assert not any("rms_norm" in n for n in names)
    assert len(program.dispatches) <= 277


# ---- execution (GPU) --------------------------------------------------------------------------
def _feeds(graph: Graph) -> tuple[dict, dict]:
    feeds, params = {}, {}
    for n in graph.nodes:
        if n.op in ("input", "parameter"):
            a = RNG.standard_normal(n.type.shape).astype(np.float32)
            if n.name.endswith("weight") and n.type.shape[-1] > 1 and len(n.type.shape) == 2:
                a *= 1 / np.sqrt(n.type.shape[-1])
            (feeds if n.op == "input" else params)[n.name] = a
    return feeds, params


def _run(graph: Graph, feeds, params, fuse: bool, device):
    from meganeura.training import compile_for

    prog, sess = compile_for(graph, CompileOptions(fuse=fuse), device)
    sess.load_state_dict(params)
    return len(prog.dispatches), sess.run(feeds, [name for name, _ in graph.outputs])


def _check(graph: Graph, device, kernels: int, exact: bool) -> None:
    feeds, params = _feeds(graph)
    n_off, off = _run(graph, feeds, params, False, device)
    n_on, on = _run(graph, feeds, params, True, device)
    assert n_on == kernels < n_off
    vals, _, _ = interpret(graph, feeds, params)
    for name, v in graph.outputs:
        scale = float(np.max(np.abs(off[name])))
        if exact and "llvmpipe" in device.name.lower():
            np.testing.assert_array_equal(on[name], off[name], err_msg=name)
        else:  # rstd rounded differently: a few ulps of the largest output
            atol = 16 * float(np.finfo(np.float32).eps) * scale
            np.testing.assert_allclose(on[name], off[name], rtol=0, atol=atol, err_msg=name)
        np.testing.assert_allclose(on[name], vals[v], rtol=1e-5, atol=1e-5 * scale, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms", "layer", None], ids=lambda n: n or "no_norm")
@pytest.mark.parametrize("m", [1, 3, 8], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("k", [64, 30], ids=lambda k: f"k{k}")  # vec4 and scalar K loops
def test_qkv_values_match_the_unfused_program(gpu_device, norm, m, k):
    _check(_attention_in(m, k, norm), gpu_device, kernels=1, exact=norm is None)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5], ids=lambda m: f"m{m}")
def test_silu_gate_times_up_values_match_the_unfused_program(gpu_device, m):
    _check(_mlp_in(m, 64, 96), gpu_device, kernels=2, exact=False)


@pytest.mark.gpu
def test_wide_output_spans_many_workgroups(gpu_device):
    # q: 2000 columns (250 workgroups of 8), k and v 1000 each, K = 68 (vec4, ragged lanes)
    b = GraphBuilder()
    x = b.input("x", (2, 68))
    h = rms_norm(x, 68, b.parameter("ln.weight", (68,)), eps=1e-6)
    for name, n in (("q", 2000), ("k", 1000), ("v", 1000)):
        b.output(name, F.linear(h, b.parameter(f"{name}.weight", (n, 68))))
    _check(b.build(), gpu_device, kernels=1, exact=False)


def _block_loss_graph() -> Graph:
    """A Llama-style block on 6 tokens: rms_norm -> q, k, v; rms_norm -> silu(gate) * up."""
    b = GraphBuilder()
    x = b.input("x", (1, 6, 16))
    h = rms_norm(x, 16, b.parameter("ln1.weight", (16,)), eps=1e-5)
    q, k, v = (F.linear(h, b.parameter(f"{n}.weight", (16, 16))) for n in "qkv")
    y = x + q * k + v
    h2 = rms_norm(y, 16, b.parameter("ln2.weight", (16,)), eps=1e-5)
    gate = F.linear(h2, b.parameter("gate.weight", (24, 16)))
    up = F.linear(h2, b.parameter("up.weight", (24, 16)))
    out = F.linear(silu(gate) * up, b.parameter("down.weight", (16, 24)))
    b.output("loss", F.sum((y + out) * (y + out)))
    return b.build()


def test_training_graph_keeps_the_backward_and_merges_forward_products():
    options = CompileOptions(loss="loss", optimizer=SGD(lr=0.0), output_grads=True)
    g, groups, _ = _plan(build_training_graph(_block_loss_graph(), options))
    # the weight gradients sharing a normed input (dGate/dUp, then dQ/dK/dV) are grouped too
    # (tests/passes/test_fuse_matmul_right.py)
    right = [grp for grp in groups if grp.shared == "right"]
    assert [[len(s.anchors) for s in grp.segments] for grp in right] == [[1, 1], [1, 1, 1]]
    groups = [grp for grp in groups if grp.shared == "left"]
    # the norms are read again by the weight gradients: no prologue, but q/k/v and gate/up
    # merge, each into one segment (``x + q * k + v`` and ``silu(gate) * up`` link them)
    assert [[len(s.anchors) for s in grp.segments] for grp in groups] == [[3], [2]]
    assert all(grp.norm is None for grp in groups)
    (qkv,) = groups[0].segments
    # the backward of q * k reads q and k; nothing reads v itself, so it stays in registers
    assert [a in qkv.outputs for a in qkv.anchors] == [True, True, False]


@pytest.mark.gpu
def test_training_gradients_match_torch_float64(gpu_device):
    from meganeura.training import compile_for

    graph = _block_loss_graph()
    feeds, params = _feeds(graph)
    opt = SGD(lr=0.0)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    feeds[HYPER_INPUT] = opt.hyper(0, opt.lr)
    grads = {}
    for fuse in (False, True):
        prog, sess = compile_for(graph, CompileOptions(**{**options.__dict__, "fuse": fuse}))
        sess.load_state_dict(params)
        names = [n for n, _ in prog.outputs.items() if n.endswith(".grad")]
        grads[fuse] = sess.run(feeds, names)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    x = torch.tensor(feeds["x"], dtype=torch.float64)

    def rms(a, w):
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    h = rms(x, t["ln1.weight"])
    q, k, v = (h @ t[f"{n}.weight"].T for n in "qkv")
    y = x + q * k + v
    h2 = rms(y, t["ln2.weight"])
    gu = torch.nn.functional.silu(h2 @ t["gate.weight"].T) * (h2 @ t["up.weight"].T)
    z = y + gu @ t["down.weight"].T
    (z * z).sum().backward()
    assert set(grads[True]) == {f"{k}.grad" for k in params}
    for name in params:
        want = t[name].grad.numpy()
        got = grads[True][f"{name}.grad"]
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale, err_msg=name)
        np.testing.assert_allclose(got, grads[False][f"{name}.grad"], rtol=0, atol=1e-5 * scale)


@pytest.mark.gpu
def test_llama_decode_and_short_training_step_match_transformers(gpu_device):
    import transformers

    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    cfg = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    mn.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    state = model.state_dict()
    tokens = RNG.integers(0, 96, (1, 7))
    ids, labels = tokens[:, :-1], tokens[:, 1:].copy()
    ref = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**cfg, attn_implementation="eager")
    ).to(torch.float64)
    ref.load_state_dict({k: torch.from_numpy(v).double() for k, v in state.items()}, strict=False)
    out = ref(torch.from_numpy(ids)).logits
    want_loss = torch.nn.functional.cross_entropy(out.reshape(-1, 96), torch.from_numpy(labels)[0])
    want_loss.backward()
    # decode one token at a time (M = 1 gemv groups with norm prologues)
    model.setup_cache(1, 16)
    got = np.concatenate(
        [model(ids[:, t : t + 1].astype(np.int32), cache_position=np.int32(t)) for t in range(6)],
        axis=1,
    )
    want = out.detach().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # a 6-token training step: M = 6 products merged in the forward, the backward unchanged
    tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
    loss, grads = tr.step(ids, labels, return_grads=True)
    assert abs(loss - want_loss.item()) <= 1e-5
    named = dict(ref.named_parameters())
    for name, g in grads.items():
        w = named[name].grad.numpy()
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_fast_mode_reads_and_writes_f16_through_prologue_and_epilogue(gpu_device, norm):
    from meganeura.training import compile_for
    from meganeura.training.graph import device_limits

    if not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    b = GraphBuilder()
    x = b.input("x", (1, 2, 64))
    w = b.parameter("ln.weight", (64,))
    h = rms_norm(x, 64, w) if norm == "rms" else layer_norm(x, 64, w, b.parameter("ln.b", (64,)))
    gate = F.linear(h, b.parameter("gate.weight", (96, 64)))
    up = F.linear(h, b.parameter("up.weight", (96, 64)))
    b.output("y", F.linear(silu(gate) * up, b.parameter("down.weight", (64, 96))))
    graph = b.build()
    feeds, params = _feeds(graph)
    prog, sess = compile_for(graph, CompileOptions(precision="fast"), gpu_device)
    assert prog.meta["precision"] == "fast" and len(prog.dispatches) == 2
    assert "f16" in prog.dispatches[0].wgsl
    sess.load_state_dict(params)
    got = sess.run(feeds, ["y"])["y"]
    want = interpret(graph, feeds, params)[0][graph.output_dict["y"]]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


@pytest.fixture
def erf_fused():
    """An erf GELU joins its matmul's epilogue (``passes.fuse.set_erf_apart(False)``): the
    fused code path stays covered although the compiler keeps it apart by default."""
    from meganeura.passes.fuse import set_erf_apart

    set_erf_apart(False)
    yield
    set_erf_apart(True)


@pytest.mark.gpu
def test_segments_with_different_epilogues_and_shared_helpers(gpu_device, erf_fused):
    # sigmoid alone in one segment, silu (which calls the same helper) and gelu in others
    b = GraphBuilder()
    x = b.input("x", (3, 40))
    r = b.input("r", (3, 24))
    b.output("a", F.sigmoid(F.linear(x, b.parameter("a.weight", (16, 40)))))
    b.output("s", silu(F.linear(x, b.parameter("s.weight", (24, 40)))) + r)
    b.output("g", gelu(F.linear(x, b.parameter("g.weight", (8, 40)))))
    _check(b.build(), gpu_device, kernels=1, exact=True)
