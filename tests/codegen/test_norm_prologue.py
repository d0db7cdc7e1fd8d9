"""Norms computing their input from a split-K matmul group's partials (``codegen.wgsl.norm
.prologue``): the group's summing dispatch goes, values bit-identical to the program with it
(forward in strict and fast mode, a tiny Llama's logits, gradients of a training step), and
against float64 references; which norms qualify; dispatch counts on the H200's limits.

GPU tests force a split-K plan (lavapipe's own plans never split) and compare programs
compiled with the feature on and off (``prologue.set_enabled``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.codegen.kernel import H200_LIMITS, ScratchRef
from meganeura.codegen.wgsl.matmul.plan import force_plan
from meganeura.codegen.wgsl.norm import prologue
from meganeura.compile import CompileOptions
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.activation import silu
from meganeura.ops.norm import layer_norm, rms_norm
from meganeura.optim import HYPER_INPUT, SGD

from .harness import compile_both, run_identical, split_k_everywhere

RNG = np.random.default_rng(47)
SPLIT = "64x64x16/s4"
M, D, FF = 24, 96, 128


@pytest.fixture(autouse=True)
def split_plan():
    """Split-K plans everywhere (``harness.split_k_everywhere``); the feature back on afterwards."""
    with split_k_everywhere(SPLIT, prologue.set_enabled):
        yield SPLIT


def _both(graph, options, limits):
    """(program with norm prologues, program without)."""
    return compile_both(prologue.set_enabled, graph, options, limits)


def _block_graph(loss: bool = False, d: int = D):
    """``h = x + a @ Wo.T``, ``y = rms_norm(h)``, ``h2 = h + silu(y @ Wg.T) @ Wd.T``, ``z =
    layer_norm(h2)``: two split-K groups whose stored sums feed norms (h is also read by h2's
    add, h2 is an output)."""
    b = GraphBuilder()
    x, a = b.input("x", (1, M, d)), b.input("a", (1, M, d))
    shapes = (("wo", (d, d)), ("wg", (FF, d)), ("wd", (d, FF)), ("n1", (d,)), ("n2", (d,)),
              ("b2", (d,)))  # fmt: skip
    p = {n: b.parameter(n, s) for n, s in shapes}
    h = x + F.linear(a, p["wo"])
    y = rms_norm(h, d, p["n1"], eps=1e-6)
    h2 = h + F.linear(silu(F.linear(y, p["wg"])), p["wd"])
    z = layer_norm(h2, d, p["n2"], p["b2"])
    if loss:
        b.output("loss", F.sum(z * z))
    else:
        b.output("z", z)
        b.output("h2", h2)
    return b.build()


def _params(graph) -> dict[str, np.ndarray]:
    """Weights ~ N(0, 0.2), norm weights ~ 1 + N(0, 1), biases ~ N(0, 1)."""
    out = {}
    for n in graph.nodes:
        if n.op == "parameter":
            noise = RNG.standard_normal(n.type.shape)
            value = noise * 0.2 if len(n.type.shape) > 1 else noise + (n.name[0] == "n")
            out[n.name] = value.astype(np.float32)
    return out


def _reference(params, x, a):
    """Float64 NumPy forward of ``_block_graph``: (z, h2)."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    h = x.astype(np.float64) + a.astype(np.float64) @ p["wo"].T
    y = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * p["n1"]
    g = y @ p["wg"].T
    h2 = h + (g / (1 + np.exp(-g))) @ p["wd"].T
    mu, var = h2.mean(-1, keepdims=True), h2.var(-1, keepdims=True)
    return (h2 - mu) / np.sqrt(var + 1e-5) * p["n2"] + p["b2"], h2


def _norm_kernels(program) -> list:
    return [d for d in program.dispatches if "norm" in d.name and "+" in d.name.split()[0]]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("precision", "d"), [("strict", D), ("fast", D), ("strict", 90)], ids=["strict", "fast", "d90"]
)
def test_norms_sum_the_partials_bit_identically(gpu_device, precision, d):
    """``d`` 90: rows of scalar units (the team reads vec4 units when 4 divides the row)."""
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _block_graph(d=d)
    params = _params(graph)
    x, a = (RNG.standard_normal((1, M, d)).astype(np.float32) for _ in range(2))
    on, off = _both(graph, CompileOptions(precision=precision), limits)
    # o's and down's summing dispatches go; the rms_norm and the layer_norm compute h, h2
    assert len(off.dispatches) - len(on.dispatches) == 2
    assert [d.name.split()[1] for d in _norm_kernels(on)] == ["rms_norm", "layer_norm"]
    if precision == "fast":
        assert any("f32(f16(v))" in k.wgsl for k in _norm_kernels(on))  # h; h2 is f32
    assert all(("vec4<f32>(0.0)" in k.wgsl) == (d % 4 == 0) for k in _norm_kernels(on))
    got = run_identical(gpu_device, (on, off), {"x": x, "a": a}, ["z", "h2"], params)
    tol = 1e-4 if precision == "strict" else 3e-2
    for name, ref in zip(("z", "h2"), _reference(params, x, a), strict=True):
        np.testing.assert_allclose(got[name], ref, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.gpu
def test_training_gradients_exact_and_match_torch_float64(gpu_device):
    from meganeura.training import device_limits

    graph = _block_graph(loss=True)
    params = _params(graph)
    x, a = (RNG.standard_normal((1, M, D)).astype(np.float32) for _ in range(2))
    opt = SGD(lr=0.0)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    on, off = _both(graph, options, device_limits(gpu_device))
    assert len(off.dispatches) - len(on.dispatches) == 2
    names = [f"{n}.grad" for n in params] + ["loss"]
    got = run_identical(
        gpu_device, (on, off), {"x": x, "a": a, HYPER_INPUT: opt.hyper(0, opt.lr)}, names, params
    )
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    xt, at = (torch.tensor(v, dtype=torch.float64) for v in (x, a))
    h = xt + at @ t["wo"].T
    y = torch.nn.functional.rms_norm(h, (D,), t["n1"], eps=1e-6)
    h2 = h + torch.nn.functional.silu(y @ t["wg"].T) @ t["wd"].T
    z = torch.nn.functional.layer_norm(h2, (D,), t["n2"], t["b2"])
    loss = (z * z).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, p in t.items():
        want = p.grad.numpy()
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(
            got[f"{name}.grad"], want, rtol=0, atol=1e-4 * scale, err_msg=name
        )


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _llama(on: bool):
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

    prologue.set_enabled(on)
    mn.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_tiny_llama_logits_bit_identical(gpu_device, precision):
    """The project's Llama (2 layers): per layer o_proj + residual feeds the post-attention
    rms_norm, down_proj + residual the next input rms_norm or the final norm. Logits with the
    feature on and off, bit for bit."""
    import meganeura as mn
    from meganeura.training import device_limits

    if precision == "fast" and not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    ids = np.random.default_rng(5).integers(0, 96, (1, 20)).astype(np.int32)
    got = [mn.compile(_llama(on), precision=precision, device=gpu_device)(ids) for on in (1, 0)]
    np.testing.assert_array_equal(got[0], got[1])
    assert np.isfinite(got[0]).all()


@pytest.mark.gpu
def test_tiny_llama_training_step_bit_identical(gpu_device):
    """The Trainer's step (forward, backward, SGD at lr 0): loss and every gradient."""
    import meganeura as mn
    from meganeura.models.llama import lm_loss

    tokens = np.random.default_rng(6).integers(0, 96, (1, 17))
    got = []
    for on in (True, False):
        tr = mn.Trainer(_llama(on), mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
        got.append(tr.step(tokens[:, :-1], tokens[:, 1:].copy(), return_grads=True))
    assert got[0][0] == got[1][0]
    for name, g in got[0][1].items():
        np.testing.assert_array_equal(g, got[1][1][name], err_msg=name)


def test_smollm2_widths_dispatch_counts_on_h200_limits():
    """SmolLM2-135M's widths (2 layers, a 512-token vocabulary, 128 tokens), compiled for the
    H200 with its own plans: o_proj + residual and down_proj + residual split K; their summing
    dispatches go, as a norm reads each sum (the last down_proj's feeds the final norm, a
    kernel of its own here: the 512-column LM head splits K too), in the forward and the
    training step."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call

    force_plan(None)
    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=512))
    ids = (np.arange(128, dtype=np.int32) % 512)[None]
    fwd = trace_call(model, model.forward, (ids,), {}).graph
    on, off = _both(fwd, CompileOptions(), H200_LIMITS)
    assert len(off.dispatches) - len(on.dispatches) == 4
    assert len(_norm_kernels(on)) == 4
    traced = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, (ids + 1) % 512), {},
                        "loss")  # fmt: skip
    on, off = _both(traced.graph, CompileOptions(loss="loss", optimizer=SGD(lr=0.1)), H200_LIMITS)
    assert len(off.dispatches) - len(on.dispatches) == 4


def test_partials_live_until_the_norm_and_sums_gone_on_h200_limits():
    """Compiled without a GPU for the H200: the norm kernels bind the group's partials (a
    ``ScratchRef`` owned by the group's sink), so the planner keeps them alive from the
    partials dispatch to the norm; no summing dispatch is left."""
    from meganeura.schedule.schedule import schedule

    graph = _block_graph()
    on, off = _both(graph, CompileOptions(), H200_LIMITS)
    assert len(off.dispatches) - len(on.dispatches) == 2
    assert sum(d.name.endswith("sum_splits") for d in on.dispatches) == 0
    sched = schedule(graph, H200_LIMITS, fuse=True)
    names = [ks.name for _, ks in sched.dispatches]
    for _, ks in sched.dispatches:
        if "norm" not in ks.name or "+" not in ks.name.split()[0]:
            continue
        (ref,) = [b for b in ks.bindings if isinstance(b, ScratchRef)]
        owner = ref.owner
        assert ref.key == "splitk" and not ref.write
        (iv,) = [i for i in sched.intervals if i.key == (owner, "splitk")]
        assert names[iv.end] == ks.name and iv.start < iv.end


def test_a_long_row_or_an_earlier_reader_keeps_the_summing_dispatch():
    """Rows past the team kernel's register mode (here 4 x 262144 elements, chunked) and h
    read by another kernel before the norm: the summing dispatch stays."""
    b = GraphBuilder()
    n = 1 << 18
    h = b.input("x", (1, 4, n)) + F.linear(b.input("a", (1, 4, 64)), b.parameter("w", (n, 64)))
    b.output("y", rms_norm(h, n))
    on, off = _both(b.build(), CompileOptions(), H200_LIMITS)
    assert len(on.dispatches) == len(off.dispatches)

    b = GraphBuilder()
    h = b.input("x", (1, M, D)) + F.linear(b.input("a", (1, M, D)), b.parameter("w", (D, D)))
    b.output("s", F.sum(h, -1))  # a reduction reading h before the norm
    b.output("y", rms_norm(h, D))
    on, off = _both(b.build(), CompileOptions(), H200_LIMITS)
    assert len(on.dispatches) == len(off.dispatches)
