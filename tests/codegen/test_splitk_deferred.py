"""Split-K products summed by their readers (``codegen.wgsl.matmul.deferred``): no summing
dispatch, values bit-identical to the two-dispatch program, forward and gradients against
float64 references; which products qualify; dispatch counts on the H200's limits.

GPU tests force a split-K plan (lavapipe's own plans never split) and compare programs
compiled with deferral on and off (``deferred.set_enabled``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.matmul import deferred, tiled_group
from meganeura.codegen.wgsl.matmul.plan import force_plan
from meganeura.compile import CompileOptions
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.activation import silu
from meganeura.optim import HYPER_INPUT, SGD

from .harness import compile_both, run_identical

RNG = np.random.default_rng(31)
SPLIT = "64x64x16/s4"


@pytest.fixture(autouse=True)
def split_members_apart():
    """Split-K products stay out of tiled matmul groups (``tiled_group``), which would run
    them unsplit: these tests are about the split-K paths."""
    old = tiled_group.SPLIT_MEMBERS[0]
    tiled_group.set_split_members(False)
    yield
    tiled_group.set_split_members(old)


@pytest.fixture
def split_plan():
    force_plan(SPLIT)
    yield SPLIT
    force_plan(None)
    deferred.set_enabled(True)


def _both(graph, options, limits):
    """(program with deferred sums, program without)."""
    return compile_both(deferred.set_enabled, graph, options, limits)


def _sums(program) -> list[str]:
    return [d.name for d in program.dispatches if d.name.endswith("sum_splits")]


def _summed(program) -> int:
    """Products whose partials a summing dispatch sums (one back-to-back run, ``matmul.
    summing``, is one dispatch named ``%a+b+c matmul sum_splits``)."""
    return sum(n.split()[0].count("+") + 1 for n in _sums(program))


def _forward_graph(m: int = 40, k: int = 96):
    """Three kinds of reader of a plain split-K product: a permute (through a reshape), the
    epilogue of another split-K matmul (``silu(x @ Wg.T) * (x @ Wu.T)``) and the epilogue of
    a product's add; one product read by a reduction keeps its summing dispatch."""
    b = GraphBuilder()
    x = b.input("x", (1, m, k))
    w = {n: b.parameter(f"w{n}", (c, k)) for n, c in (("q", 48), ("g", 64), ("u", 64), ("a", 48),
                                                ("b", 48), ("r", 32))}  # fmt: skip
    q = F.reshape(F.linear(x, w["q"]), (1, m, 4, 12))
    b.output("q", F.permute(q, (0, 2, 1, 3)))
    b.output("mlp", silu(F.linear(x, w["g"])) * F.linear(x, w["u"]))
    b.output("s", F.linear(x, w["a"]) + F.linear(x, w["b"]))
    b.output("r", F.sum(F.linear(x, w["r"]), -1))
    return b.build()


def _params(graph) -> dict[str, np.ndarray]:
    return {
        n.name: (RNG.standard_normal(n.type.shape) * 0.2).astype(np.float32)
        for n in graph.nodes
        if n.op == "parameter"
    }


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_readers_sum_the_partials_bit_identically(gpu_device, split_plan, precision):
    """Fast mode stores the products as f16: the readers round their sums to f16 likewise."""
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _forward_graph()
    params = _params(graph)
    x = RNG.standard_normal((1, 40, 96)).astype(np.float32)
    on, off = _both(graph, CompileOptions(precision=precision), limits)
    if precision == "fast":
        assert any("f32(f16(v))" in d.wgsl for d in on.dispatches)
    # q, u and b lose their summing dispatch (r, read by a reduction, keeps it), and the first
    # dispatches of q, g, u, a, b and r become one (``split_group``)
    assert len(off.dispatches) - len(on.dispatches) == 3 + 5
    assert len(_sums(on)) == 1 and len(_sums(off)) == 4
    got = run_identical(gpu_device, (on, off), {"x": x}, ["q", "mlp", "s", "r"], params)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x64 = x.astype(np.float64)

    def lin(n):
        return x64 @ p[f"w{n}"].T

    gate = lin("g")
    want = {
        "q": lin("q").reshape(1, 40, 4, 12).transpose(0, 2, 1, 3),
        "mlp": gate / (1 + np.exp(-gate)) * lin("u"),
        "s": lin("a") + lin("b"),
        "r": lin("r").sum(-1),
    }
    tol = 1e-4 if precision == "strict" else 1e-2
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=tol, atol=tol, err_msg=name)


def _mlp_loss_graph(m: int = 24, k: int = 80, n: int = 112):
    """A residual SwiGLU block (x + down(silu(gate(x)) * up(x))), squared-sum loss."""
    b = GraphBuilder()
    x = b.input("x", (1, m, k))
    gate = F.linear(x, b.parameter("gate.weight", (n, k)))
    up = F.linear(x, b.parameter("up.weight", (n, k)))
    y = x + F.linear(silu(gate) * up, b.parameter("down.weight", (k, n)))
    b.output("loss", F.sum(y * y))
    return b.build()


@pytest.mark.gpu
def test_training_gradients_exact_and_match_torch_float64(gpu_device, split_plan):
    from meganeura.training import device_limits

    graph = _mlp_loss_graph()
    params = _params(graph)
    x = RNG.standard_normal((1, 24, 80)).astype(np.float32)
    opt = SGD(lr=0.0)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    on, off = _both(graph, options, device_limits(gpu_device))
    assert len(on.dispatches) < len(off.dispatches)
    names = [f"{n}.grad" for n in params] + ["loss"]
    got = run_identical(
        gpu_device, (on, off), {"x": x, HYPER_INPUT: opt.hyper(0, opt.lr)}, names, params
    )
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    xt = torch.tensor(x, dtype=torch.float64)
    gu = torch.nn.functional.silu(xt @ t["gate.weight"].T) * (xt @ t["up.weight"].T)
    y = xt + gu @ t["down.weight"].T
    loss = (y * y).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, p in t.items():
        want = p.grad.numpy()
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(
            got[f"{name}.grad"], want, rtol=0, atol=1e-5 * scale, err_msg=name
        )


def test_products_read_otherwise_keep_their_summing_dispatch(split_plan):
    """Read as a matmul operand, as a graph output or by a reduction: the product is stored
    by its summing dispatch, at its own position; the three products of x still share their
    first dispatch."""
    b = GraphBuilder()
    x = b.input("x", (1, 40, 96))
    h = F.linear(x, b.parameter("w1", (64, 96)))
    b.output("y", F.linear(h, b.parameter("w2", (32, 64))))
    b.output("h", F.linear(x, b.parameter("w3", (48, 96))))
    b.output("r", F.sum(F.linear(x, b.parameter("w4", (48, 96))), -1))
    on, off = _both(b.build(), CompileOptions(), H200_LIMITS)
    assert _summed(on) == _summed(off) == len(_sums(off)) == 4
    # 2 first dispatches merged; the sums of the product of h, w3's and w4's run back to back
    # (``matmul.summing``): 3 -> 1
    assert len(off.dispatches) - len(on.dispatches) == 2 + 2
    names = [d.name for d in on.dispatches]
    assert names[:2] == ["%3+9+12 matmul", "%3 matmul sum_splits"]


def _smollm2_programs():
    """SmolLM2-135M's layer widths (2 layers, a 512-token vocabulary): prefill of 128 tokens
    and a training step, compiled for the H200 with deferral on and off."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn import Parameter
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=512))
    ids = (np.arange(128, dtype=np.int32) % 512)[None]
    model.setup_cache(1, 256)
    kwargs = {"cache_position": np.asarray(0, np.int32), "logits_to_keep": 1, "greedy": True}
    prefill = trace_call(model, model.forward, (ids,), kwargs).graph
    model.clear_cache()
    traced = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, (ids + 1) % 512), {},
                        "loss")  # fmt: skip
    trainable = tuple(n for n, o in traced.trace.objects.items() if isinstance(o, Parameter))
    train_opts = CompileOptions(loss="loss", optimizer=mn.optim.AdamW(lr=1e-5),
                                trainable=trainable, nonfinite_guard="raise")  # fmt: skip
    from meganeura.codegen.wgsl.attention import summed

    # the counts below are this feature's; the attention's rotations would also read q, k
    # and v's partials (``attention.summed``, counted in tests/codegen/test_attention_summed.py)
    summed.set_enabled(False)
    try:
        return _both(prefill, CompileOptions(), H200_LIMITS), _both(
            traced.graph, train_opts, H200_LIMITS
        )
    finally:
        summed.set_enabled(True)


def _merged(program) -> list:
    return [d for d in program.dispatches if d.name.split()[0].count("+") == 2 and
            d.name.endswith(" matmul") and "part2" in d.wgsl]  # fmt: skip


def test_smollm2_dispatch_counts_on_h200_limits():
    """Per layer (2 layers): in the forward, up (read by the gate's epilogue) loses its summing
    dispatch; q, k and v keep theirs, since rotary and attention kernels read them in place
    through the permute views (``passes.permute_views``) and do not sum partials; q, k and v
    run as one first dispatch and so do gate and up. In the backward, the gradients of up's
    input and of the q/k/v inputs (read by an epilogue's add) lose theirs, and the products
    summed by one kernel are one dispatch (``split_group``'s sum groups): the partials of the
    gradients of gate's and up's inputs, and those of q's input with k's (unsplit) product."""
    (pre_on, pre_off), (tr_on, tr_off) = _smollm2_programs()
    assert len(_sums(pre_off)) == 8 and _summed(pre_on) == 6
    assert len(_merged(pre_on)) == 2 and _merged(pre_off) == []
    # and q, k and v's sums, back to back, are one dispatch a layer (``matmul.summing``)
    assert len(pre_off.dispatches) - len(pre_on.dispatches) == 2 + 2 * (2 + 1) + 2 * 2
    removed = len(tr_off.dispatches) - len(tr_on.dispatches)
    assert len(_sums(tr_off)) - _summed(tr_on) == 6
    assert removed == 6 + 2 * (2 + 1) + 2 * 2 + 2 * 2


@pytest.mark.gpu
def test_smollm2_merged_qkv_kernel_validates(gpu_device):
    """The H200's q/k/v kernel (three tiled branches, 576 + 192 + 192 columns, 8 splits each)
    is valid WGSL for naga (shader module only: its workgroup memory exceeds lavapipe's)."""
    (pre_on, _), _ = _smollm2_programs()
    (first, _) = _merged(pre_on)
    assert first.wgsl.count("workgroupBarrier") > 3 and first.grid[0] == 144 + 48 + 48
    gpu_device.gpu.create_shader_module(code=first.wgsl)


def _conv_loss_graph(oc2: int):
    """x -> conv 3x3 (8 channels) -> relu -> conv 3x3 (``oc2`` channels) -> relu -> sum of
    squares: conv2's input gradient (K = oc2 * 9, split) is read by conv1's relu backward."""
    from meganeura.ops.conv import conv2d

    b = GraphBuilder()
    x = b.input("x", (2, 3, 6, 6))
    h = F.relu(conv2d(x, b.parameter("w1", (8, 3, 3, 3)), padding=1))
    y = F.relu(conv2d(h, b.parameter("w2", (oc2, 8, 3, 3)), padding=1))
    b.output("loss", F.sum(y * y))
    return b.build()


@pytest.mark.gpu
@pytest.mark.parametrize("oc2", [128, 256], ids=["splits4_lanes1", "splits9_lanes4"])
def test_conv_input_gradient_sums_exact_and_match_torch_float64(gpu_device, oc2):
    """GPU plans on lavapipe (``cpu=False``) so that the input gradient splits K: 4 ways (one
    thread per element in the summing kernel) and 9 ways (four lanes)."""
    import dataclasses

    from meganeura.training import device_limits

    graph = _conv_loss_graph(oc2)
    params = _params(graph)
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    opt = SGD(lr=0.0)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    on, off = _both(graph, options, dataclasses.replace(device_limits(gpu_device), cpu=False))
    assert len(off.dispatches) - len(on.dispatches) == 1
    assert not any("backward_input sum_splits" in d.name for d in on.dispatches)
    assert any("backward_input sum_splits" in d.name for d in off.dispatches)
    names = ["w1.grad", "w2.grad", "loss"]
    got = run_identical(
        gpu_device, (on, off), {"x": x, HYPER_INPUT: opt.hyper(0, opt.lr)}, names, params
    )
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    conv = torch.nn.functional.conv2d
    h = torch.relu(conv(torch.tensor(x, dtype=torch.float64), t["w1"], padding=1))
    y = torch.relu(conv(h, t["w2"], padding=1))
    loss = (y * y).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, p in t.items():
        want = p.grad.numpy()
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(
            got[f"{name}.grad"], want, rtol=0, atol=1e-5 * scale, err_msg=name
        )


def _qkv_graph(m: int = 40, k: int = 96, computed_b: bool = False):
    """x @ Wq.T, x @ Wk.T, x @ Wv.T (48, 32, 32 columns), each read through a reshape by a
    permute; with ``computed_b``, Wv is computed (2 * Wv0) between q's and k's matmuls."""
    b = GraphBuilder()
    x = b.input("x", (1, m, k))
    for name, n in (("q", 48), ("k", 32), ("v", 32)):
        w = b.parameter(f"w{name}", (n, k))
        if computed_b and name == "v":
            w = w * 2.0
        y = F.reshape(F.linear(x, w), (1, m, n // 8, 8))
        b.output(name, F.permute(y, (0, 2, 1, 3)))
    return b.build()


@pytest.mark.gpu
def test_products_sharing_x_run_as_one_dispatch_bit_identically(gpu_device, split_plan):
    from meganeura.training import device_limits

    graph = _qkv_graph()
    params = _params(graph)
    x = RNG.standard_normal((1, 40, 96)).astype(np.float32)
    on, off = _both(graph, CompileOptions(), device_limits(gpu_device))
    names = [d.name for d in on.dispatches]
    assert names[0].endswith(" matmul") and names[0].count("+") == 2
    assert len(on.dispatches) == 4 and len(off.dispatches) == 9  # 1 + 3 permutes; 3 x 3
    got = run_identical(gpu_device, (on, off), {"x": x}, ["q", "k", "v"], params)
    for name, n in (("q", 48), ("k", 32), ("v", 32)):
        ref = x.astype(np.float64) @ params[f"w{name}"].T.astype(np.float64)
        ref = ref.reshape(1, 40, n // 8, 8).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_right_operand_computed_after_the_first_product_keeps_it_apart(split_plan):
    graph = _qkv_graph(computed_b=True)
    on, _ = _both(graph, CompileOptions(), H200_LIMITS)
    merged = [d.name for d in on.dispatches if d.name.split()[0].count("+") == 1]
    assert len(merged) == 1  # q and k; v's weight is computed after q's matmul
    assert not any(d.name.endswith("sum_splits") for d in on.dispatches)


def test_a_large_product_read_by_three_kernels_keeps_its_sum(split_plan):
    """Three permutes reading a 2^21-element product split 4 ways would read 32 MiB more than
    the summing dispatch and their own reads (``deferred.extra_bytes``, over
    ``MAX_EXTRA_BYTES``); a small product is deferred."""
    for rows, kept in ((1024, True), (64, False)):
        b = GraphBuilder()
        y = F.linear(b.input("x", (2, rows, 64)), b.parameter("w", (1024, 64)))
        for name, dims in (("a", (0, 2, 1)), ("b", (1, 0, 2)), ("c", (2, 1, 0))):
            b.output(name, F.permute(y, dims))
        on, _ = _both(b.build(), CompileOptions(), H200_LIMITS)
        assert (len(_sums(on)) == 1) == kept, rows
    part = deferred.SplitPartials(0, 4, 2 * 1024 * 1024)
    assert deferred.extra_bytes(part, 1) < 0
    assert deferred.extra_bytes(part, 3) == 4 * (3 * 4 - 4 - 1 - 3) * part.total == 32 << 20
