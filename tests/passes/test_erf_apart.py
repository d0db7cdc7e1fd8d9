"""``erf_apart`` (``passes.fuse.set_erf_apart``): an erf GELU or its gradient never joins a
matmul's epilogue group, the tanh form still does, and programs compute exactly what the
unfused ones do (lavapipe): forward epilogues (bias, residual, other users of the product,
batched, GEMV-sized and split-K products), training steps through ``Trainer`` (AdamW), and
the hoist pass (``passes.hoist``), which moves a blocked erf gradient next to a matmul it can
no longer join."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as NF
from meganeura.codegen.wgsl.elementwise.maps import FUSIBLE
from meganeura.compile import CompileOptions, build_training_graph, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.ir import Graph
from meganeura.nn import Linear, Module
from meganeura.ops import functional as F
from meganeura.ops.activation import gelu
from meganeura.optim import AdamW
from meganeura.passes import cse, dce, hoist
from meganeura.passes.fuse import _ERF_APART, plan_fusion, set_erf_apart
from meganeura.runtime import Session
from meganeura.training import device_limits

RNG = np.random.default_rng(17)


@pytest.fixture(autouse=True)
def _restore_levers():
    before, hoisting = _ERF_APART[0], hoist.ENABLED
    yield
    set_erf_apart(before)
    hoist.set_enabled(hoisting)


def _erf(graph: Graph, nid: int) -> bool:
    node = graph[nid]
    return node.op in ("gelu", "gelu_backward") and node.attr("approximate") == "none"


def _f32(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


def _exact(device) -> bool:
    """lavapipe: fused equals unfused bit for bit; other drivers may contract an epilogue into
    the product's last FMA (``tests/passes/test_fuse.py``, ``_assert_same_arithmetic``)."""
    return "llvmpipe" in device.name.lower()


def _same(a, b, device, name: str) -> None:
    if _exact(device):
        np.testing.assert_array_equal(a, b, err_msg=name)
    else:
        atol = 4 * float(np.finfo(np.float32).eps) * float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=name)


def _run(graph: Graph, feeds: dict, device, erf_apart: bool, fuse: bool = True):
    set_erf_apart(erf_apart)
    program = compile(graph, CompileOptions(fuse=fuse), limits=device_limits(device))
    with Session(program, device) as sess:
        out = sess.run(feeds, [name for name, _ in graph.outputs])
    return out, len(program.dispatches)


def _check(graph, feeds, device, want: dict, kernels: tuple[int, int], off_equal=True):
    """On (apart) equals unfused bit for bit (and off too, where ``off_equal``); both are
    within f32 rounding of the float64 torch values ``want``; ``kernels``: (on, off)."""
    on, k_on = _run(graph, feeds, device, True)
    off, k_off = _run(graph, feeds, device, False)
    bare, _ = _run(graph, feeds, device, True, fuse=False)
    assert (k_on, k_off) == kernels
    for name, ref in want.items():
        _same(on[name], bare[name], device, name)
        if off_equal:
            _same(off[name], bare[name], device, name)
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(on[name], ref, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
        np.testing.assert_allclose(off[name], ref, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


# ---- planning (no GPU) ------------------------------------------------------------------------
def _geglu(approximate: str) -> Graph:
    """x + down(gelu(x @ Wg.T) * (x @ Wu.T)), summed squares as the loss."""
    b = GraphBuilder()
    x = b.input("x", (9, 24))
    wg, wu = b.parameter("wg", (40, 24)), b.parameter("wu", (40, 24))
    h = gelu(F.linear(x, wg), approximate=approximate) * F.linear(x, wu)
    out = x + F.linear(h, b.parameter("wd", (24, 40)))
    b.output("loss", F.sum(out * out))
    return b.build()


def _mlp(approximate: str) -> Graph:
    b = GraphBuilder()
    x = b.input("x", (9, 24))
    w1, b1 = b.parameter("w1", (40, 24)), b.parameter("b1", (40,))
    h = gelu(F.linear(x, w1, b1), approximate=approximate)
    out = x + F.linear(h, b.parameter("w2", (24, 40)))
    b.output("loss", F.sum(out * out))
    return b.build()


def _training(graph: Graph) -> Graph:
    g = build_training_graph(graph, CompileOptions(loss="loss", optimizer=AdamW()))
    g, _ = dce(g)
    g, _ = cse(g)
    return dce(g)[0]


@pytest.mark.parametrize("model", ["mlp", "geglu"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("hoisted", [False, True], ids=["traced", "hoisted"])
def test_no_anchored_group_holds_an_erf_gelu(model, approximate, hoisted):
    g = _training({"mlp": _mlp, "geglu": _geglu}[model](approximate))
    if hoisted:
        g, _ = hoist.hoist_fusible(g, FUSIBLE, 32)
    grads = [n.id for n in g.nodes if n.op == "gelu_backward"]
    assert grads  # the training graph has the gradient the lever is about
    set_erf_apart(True)
    apart = plan_fusion(g, FUSIBLE, None, 32)
    set_erf_apart(False)
    joined = plan_fusion(g, FUSIBLE, None, 32)
    for grp in apart:
        if grp.anchor is not None:
            assert not any(_erf(g, m) for m in grp.members), [g[m].op for m in grp.members]
    in_epilogue = {m for grp in joined if grp.anchor is not None for m in grp.members}
    if approximate == "tanh":
        assert apart == joined  # the lever leaves the tanh form alone
    else:
        # with the lever off some erf node joins an epilogue, so the lever changed something
        assert any(_erf(g, m) for m in in_epilogue)
        assert len(apart) >= 1


def test_hoisted_erf_gradient_stays_out_of_the_epilogue_it_was_moved_to():
    """In GeGLU's backward the hoist pass moves ``gelu_backward(dh * up, gate)`` up to the
    matmul giving ``dh`` (a weight gradient reads ``dh * gelu(gate)`` first); apart, it is
    moved but not taken, and the program stays valid."""
    g = _training(_geglu("none"))
    set_erf_apart(True)
    moved, ids = hoist.hoist_fusible(g, FUSIBLE, 32)
    (grad,) = [n.id for n in g.nodes if n.op == "gelu_backward"]
    assert ids[grad] < grad  # moved up
    groups = plan_fusion(moved, FUSIBLE, None, 32)
    anchored = {m for grp in groups if grp.anchor is not None for m in grp.members}
    assert ids[grad] not in anchored
    # every operand still precedes its reader (reorder kept a valid program order)
    assert all(i < n.id for n in moved.nodes for i in n.inputs)


# ---- execution (GPU) --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_residual(gpu_device, approximate):
    b = GraphBuilder()
    x, w = b.input("x", (37, 19)), b.input("w", (70, 19))
    bias, res = b.input("b", (70,)), b.input("r", (37, 70))
    b.output("out", gelu(F.linear(x, w, bias), approximate=approximate) + res)
    feeds = {"x": _f32(37, 19), "w": _f32(70, 19), "b": _f32(70), "r": _f32(37, 70)}
    t = {k: _t(v) for k, v in feeds.items()}
    want = torch.nn.functional.gelu(t["x"] @ t["w"].T + t["b"], approximate=approximate)
    kernels = (2, 1) if approximate == "none" else (1, 1)
    _check(b.build(), feeds, gpu_device, {"out": (want + t["r"]).numpy()}, kernels)


@pytest.mark.gpu
def test_gelu_of_a_product_with_other_users(gpu_device):
    b = GraphBuilder()
    x, w = b.input("x", (33, 24)), b.input("w", (24, 40))
    h = x @ w
    b.output("g", gelu(h))
    b.output("h2", h * 2.0)
    b.output("gh", gelu(h) + h)
    feeds = {"x": _f32(33, 24), "w": _f32(24, 40)}
    hh = _t(feeds["x"]) @ _t(feeds["w"])
    gg = torch.nn.functional.gelu(hh)
    want = {"g": gg.numpy(), "h2": (2 * hh).numpy(), "gh": (gg + hh).numpy()}
    on, k_on = _run(b.build(), feeds, gpu_device, True)
    off, k_off = _run(b.build(), feeds, gpu_device, False)
    bare, _ = _run(b.build(), feeds, gpu_device, True, fuse=False)
    assert k_on >= k_off
    for name, ref in want.items():
        _same(on[name], bare[name], gpu_device, name)
        _same(off[name], bare[name], gpu_device, name)
        np.testing.assert_allclose(on[name], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    ["batched", "gemv", "split_k", "bwd_epilogue"],
)
def test_products_of_each_kernel_family(gpu_device, case):
    b = GraphBuilder()
    if case == "batched":
        x, w = b.input("x", (3, 17, 24)), b.input("w", (3, 24, 20))
        feeds = {"x": _f32(3, 17, 24), "w": _f32(3, 24, 20)}
        h = x @ w
        b.output("o", gelu(h))
        want = torch.nn.functional.gelu(_t(feeds["x"]) @ _t(feeds["w"]))
    elif case == "gemv":
        x, w = b.input("x", (1, 64)), b.input("w", (96, 64))
        feeds = {"x": _f32(1, 64), "w": _f32(96, 64)}
        b.output("o", gelu(F.linear(x, w)))
        want = torch.nn.functional.gelu(_t(feeds["x"]) @ _t(feeds["w"]).T)
    elif case == "split_k":
        x, w = b.input("x", (8, 4096)), b.input("w", (4096, 16))
        feeds = {"x": _f32(8, 4096), "w": _f32(4096, 16)}
        b.output("o", gelu(x @ w))
        want = torch.nn.functional.gelu(_t(feeds["x"]) @ _t(feeds["w"]))
    else:  # gelu_backward(g @ w + r, pre): the gradient op itself after a product
        g, w = b.input("g", (37, 19)), b.input("w", (19, 70))
        pre, r = b.input("pre", (37, 70)), b.input("r", (37, 70))
        b.output("o", b.add("gelu_backward", [g @ w + r, pre], {"approximate": "none"}))
        feeds = {"g": _f32(37, 19), "w": _f32(19, 70), "pre": _f32(37, 70), "r": _f32(37, 70)}
        t = {k: _t(v) for k, v in feeds.items()}
        p = t["pre"].clone().requires_grad_(True)
        torch.nn.functional.gelu(p).backward(t["g"] @ t["w"] + t["r"])
        want = p.grad
    _check(b.build(), feeds, gpu_device, {"o": want.detach().numpy()}, (2, 1))


class _GeluNet(Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate
        self.fc1, self.fc2, self.fc3 = Linear(12, 32), Linear(32, 32), Linear(32, 5)

    def forward(self, x):
        z = self.fc1(x)
        h = z + NF.gelu(self.fc2(NF.gelu(z, approximate=self.approximate)), self.approximate)
        return self.fc3(h)


class _GeGLU(Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate
        self.inp, self.head = Linear(12, 24), Linear(24, 5)
        self.gate, self.up = Linear(24, 40, bias=False), Linear(24, 40, bias=False)
        self.down = Linear(40, 24, bias=False)

    def forward(self, x):
        x = self.inp(x)
        a = NF.gelu(self.gate(x), approximate=self.approximate)
        return self.head(x + self.down(a * self.up(x)))


def _train(cls, approximate, erf_apart, fuse=True, hoisting=True, steps=3):
    set_erf_apart(erf_apart)
    hoist.set_enabled(hoisting)
    mn.manual_seed(1)
    model = cls(approximate)
    init = {k: np.array(v) for k, v in model.state_dict().items()}
    loss = lambda m, x, y: NF.cross_entropy(m(x), y)  # noqa: E731
    tr = mn.Trainer(model, mn.optim.AdamW(lr=1e-2), loss, fuse=fuse)
    rng = np.random.default_rng(4)
    losses, batches = [], []
    for _ in range(steps):
        x = rng.standard_normal((9, 12)).astype(np.float32)
        batches.append((x, rng.integers(0, 5, 9).astype(np.int32)))
        losses.append(float(tr.step(*batches[-1])))
    kernels = len(next(iter(tr._cache.values())).entry.runner.session.program.dispatches)
    params = {k: np.array(v) for k, v in tr.state_dict().items() if k in init}
    tr.close()
    return losses, params, kernels, init, batches


def _torch_adamw(cls, approximate, init, batches):
    p = {k: _t(v).requires_grad_(True) for k, v in init.items()}
    act = lambda h: torch.nn.functional.gelu(h, approximate=approximate)  # noqa: E731

    def lin(name, x):
        y = x @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    def forward(x):
        if cls is _GeluNet:
            z = lin("fc1", x)
            return lin("fc3", z + act(lin("fc2", act(z))))
        x = lin("inp", x)
        return lin("head", x + lin("down", act(lin("gate", x)) * lin("up", x)))

    opt = torch.optim.AdamW(list(p.values()), lr=1e-2)  # torch's defaults are meganeura's
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(_t(x)), torch.tensor(y).long())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in p.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [_GeluNet, _GeGLU], ids=["mlp", "geglu"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_training_steps_equal_unfused_and_torch(gpu_device, cls, approximate):
    on_l, on_p, on_k, init, batches = _train(cls, approximate, True)
    bare_l, bare_p, bare_k, _, _ = _train(cls, approximate, True, fuse=False)
    off_l, off_p, off_k, _, _ = _train(cls, approximate, False)
    assert on_k < bare_k and off_k <= on_k
    if approximate == "tanh":
        assert on_k == off_k
    if _exact(gpu_device):
        assert on_l == bare_l
    for k in bare_p:
        _same(on_p[k], bare_p[k], gpu_device, k)
    want_l, want_p = _torch_adamw(cls, approximate, init, batches)
    np.testing.assert_allclose(on_l, want_l, rtol=1e-5)
    np.testing.assert_allclose(off_l, want_l, rtol=1e-5)
    for k in want_p:
        np.testing.assert_allclose(on_p[k], want_p[k], rtol=0, atol=1e-5, err_msg=k)
        np.testing.assert_allclose(off_p[k], want_p[k], rtol=0, atol=1e-5, err_msg=k)


@pytest.mark.gpu
def test_hoisting_an_erf_gradient_changes_no_value(gpu_device):
    hoisted = _train(_GeGLU, "none", True, hoisting=True)
    traced = _train(_GeGLU, "none", True, hoisting=False)
    assert hoisted[2] <= traced[2]
    assert hoisted[0] == traced[0]
    for k in traced[1]:
        np.testing.assert_array_equal(hoisted[1][k], traced[1][k], err_msg=k)


@pytest.mark.gpu
def test_residual_of_the_products_own_left_operand_is_exact(gpu_device):
    if not _exact(gpu_device):
        pytest.skip("bit-exactness is lavapipe's")
    b = GraphBuilder()
    h, w = b.input("h", (9, 32)), b.input("w", (32, 32))
    b.output("o", F.linear(h, w) + h)
    feeds = {"h": _f32(9, 32), "w": _f32(32, 32)}
    fused, _ = _run(b.build(), feeds, gpu_device, True)
    bare, _ = _run(b.build(), feeds, gpu_device, True, fuse=False)
    np.testing.assert_array_equal(fused["o"], bare["o"])
