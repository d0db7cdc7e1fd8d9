"""Independent neighbouring dispatches packed into one (``schedule.pack``): what packs and
what never does, the packed WGSL's parts (workgroup memory shared, bindings renumbered, grids
folded), and on the GPU the same bits as the program with packing off (a tiny Llama's
training step, an MLP's gradients against float64 torch autograd, grids folded into 2-D and
3-D)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.schedule import pack
from meganeura.schedule.program import binding_conflict

from ..codegen.harness import compile_both, run_identical

SEP = pack.SEPARATOR
CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
           max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip


def _towers(batch: int = 24, widths=(40, 56, 8)):
    """Two 2-layer MLPs on inputs of their own, logits summed, a cross-entropy loss: their
    layers are independent of each other, side by side in program order."""
    b = GraphBuilder()
    hs = [b.input(f"x{t}", (batch, widths[0])) for t in range(2)]
    for layer in range(2):
        n_in, n_out = widths[layer], widths[layer + 1]
        hs = [
            F.linear(
                h, b.parameter(f"w{t}{layer}", (n_out, n_in)), b.parameter(f"b{t}{layer}", (n_out,))
            )
            for t, h in enumerate(hs)
        ]
        if layer == 0:
            hs = [F.relu(h) for h in hs]
    b.output("loss", F.cross_entropy(hs[0] + hs[1], b.input("y", (batch,), DType.i32)))
    return b.build()


def _llama_step():
    """A tiny Llama's training step graph (SGD): per layer its gradients' matmuls pack."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    ids = np.random.default_rng(0).integers(0, 96, (2, 12)).astype(np.int32)
    traced = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, ids.copy()), {}, "loss")
    return traced.graph, CompileOptions(loss="loss", optimizer=mn.optim.SGD(lr=0.1))


def llama_steps_on_off(device, switch, seed: int, token_seed: int) -> list[tuple]:
    """Two Trainer steps (forward, backward, SGD) of the tiny Llama, with ``switch(True)``
    then ``switch(False)`` (True again after): per run the first step's (loss, gradients),
    the second step's loss, the parameters after them and the dispatch names compiled."""
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss

    tokens = np.random.default_rng(token_seed).integers(0, 96, (2, 13))
    got = []
    try:
        for on in (True, False):
            switch(on)
            mn.manual_seed(seed)
            model = LlamaForCausalLM(LlamaConfig(**CFG))
            tr = mn.Trainer(model, mn.optim.SGD(lr=0.05), lm_loss, device=device)
            first = tr.step(tokens[:, :-1], tokens[:, 1:].copy(), return_grads=True)
            second = tr.step(tokens[:, 1:], tokens[:, :-1].copy())
            programs = [p.entry.runner.program for p in tr._cache.values()]
            names = [d.name for prog in programs for d in prog.dispatches]
            state = {k: np.asarray(v) for k, v in tr.state_dict().items()}
            got.append((first, second, state, names))
            tr.close()
    finally:
        switch(True)
    return got


def _assert_same_bits(got: dict, want: dict) -> None:
    """The same names, each array equal bit for bit."""
    assert got.keys() == want.keys()
    for name, v in got.items():
        np.testing.assert_array_equal(v, want[name], err_msg=name)


def _spans(program, d):
    out = []
    for i, b in enumerate(d.bindings):
        off, size = d.span(i, program.buffers[b].size)
        out.append((b, off, off + size))
    return out


def _resnet_step():
    """A tiny bottleneck ResNet's training step graph (SGD): a block's shortcut conv is
    independent of its main branch, a few dispatches on in program order."""
    import meganeura as mn
    from meganeura.models.resnet import ResNet, ResNetConfig
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    model = ResNet(ResNetConfig("bottleneck", (1, 1, 1, 1), 5, width=4)).train()
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    y = np.array([1, 4], np.int32)

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    traced = trace_call(model, loss, (x, y), {}, "loss")
    return traced.graph, CompileOptions(loss="loss", optimizer=mn.optim.SGD(lr=0.1)), model, x, y


def _unpacked_order(on, off):
    """Positions in ``off``'s dispatches of the members of ``on``'s, in the order they run."""
    at = {d.name: i for i, d in enumerate(off.dispatches)}
    return [at[n] for d in on.dispatches for n in d.name.split(SEP)]


# ---- planning (no GPU) ------------------------------------------------------------------------
def test_lookahead_moves_only_dispatches_that_commute_with_those_they_pass():
    """With the lookahead a run takes members from a few dispatches on; each runs before the
    dispatches it passed, so it must neither write what they bind nor read what they write."""
    from meganeura.schedule.program import commute, read_write_ranges

    graph, options = _resnet_step()[:2]
    on, off = compile_both(pack.set_enabled, graph, options, H200_LIMITS)
    pack.set_lookahead(0)
    try:
        neighbours = compile(graph, options, H200_LIMITS)
    finally:
        pack.set_lookahead(True)
    assert len(on.dispatches) < len(neighbours.dispatches) < len(off.dispatches)
    order = _unpacked_order(on, off)
    assert sorted(order) == list(range(len(off.dispatches)))  # nothing lost, nothing twice
    assert order != sorted(order)  # and something moved
    rw = [read_write_ranges(off, d) for d in off.dispatches]
    moved = 0
    for p, i in enumerate(order):
        for j in order[p + 1 :]:
            if j < i:  # j came before i in program order and now runs after it
                moved += 1
                assert commute(rw[i], rw[j]), (off.dispatches[i].name, off.dispatches[j].name)
    assert moved > 0
    at = {d.name: i for i, d in enumerate(off.dispatches)}
    for d in on.dispatches:  # a run's members keep their program order
        pos = [at[n] for n in d.name.split(SEP)]
        assert pos == sorted(pos)


def test_packed_members_are_the_unpacked_dispatches_in_order(monkeypatch):
    monkeypatch.setattr(pack, "LOOKAHEAD", 0)  # neighbours only: order never changes
    on, off = compile_both(pack.set_enabled, *_llama_step(), H200_LIMITS)
    packed = [d for d in on.dispatches if SEP in d.name]
    assert packed and len(on.dispatches) < len(off.dispatches)
    names = [n for d in on.dispatches for n in d.name.split(SEP)]
    assert names == [d.name for d in off.dispatches]  # nothing reordered, nothing lost
    by_name = {d.name: d for d in off.dispatches}
    for d in packed:
        members = [by_name[n] for n in d.name.split(SEP)]
        assert 2 <= len(members) <= pack.MAX_MEMBERS
        assert d.bindings == tuple(b for m in members for b in m.bindings)
        assert d.writes == tuple(w for m in members for w in m.writes)
        assert d.flops == sum(m.flops for m in members)
        groups = sum(m.grid[0] * m.grid[1] * m.grid[2] for m in members)
        assert d.grid == (groups, 1, 1)
        # no member writes what another binds, none both reads and writes one buffer
        spans = [s for m in members for s in _spans(off, m)]
        assert binding_conflict(spans, list(d.writes)) is None
        assert d.wgsl.count("@compute") == 1 and d.wgsl.count("fn main_p") == len(members)


def test_dependent_neighbours_and_the_switch():
    b = GraphBuilder()  # a chain: each kernel reads the one before
    h = b.input("x", (16, 32))
    for i in range(3):
        h = F.relu(F.linear(h, b.parameter(f"w{i}", (32, 32))))
    b.output("y", h)
    on, off = compile_both(pack.set_enabled, b.build(), CompileOptions(), H200_LIMITS)
    assert [d.name for d in on.dispatches] == [d.name for d in off.dispatches]
    pack.set_enabled(False)
    try:
        program = compile(*_llama_step(), H200_LIMITS)
    finally:
        pack.set_enabled(True)
    assert not any(SEP in d.name for d in program.dispatches)
    assert program.meta["compile_seconds"]["pack"] >= 0.0


def test_accumulates_stay_apart():
    """The accumulate program of gradient accumulation / data parallelism: each accumulate
    keeps its own dispatch (``runtime.segments`` moves them up one by one), the rest packs."""
    graph, _ = _llama_step()
    program = compile(graph, CompileOptions(loss="loss", accumulate_grads=True), H200_LIMITS)
    names = [d.name for d in program.dispatches]
    accumulates = [n for n in names if "accumulate" in n]
    assert len(accumulates) > 10 and all(SEP not in n for n in accumulates)
    assert any(SEP in n for n in names)


@pytest.mark.parametrize("bindings", [8, 10])
def test_limits_bound_a_pack(bindings):
    limits = dataclasses.replace(H200_LIMITS, max_storage_buffers_per_shader_stage=bindings)
    program = compile(*_llama_step(), limits)
    packed = [d for d in program.dispatches if SEP in d.name]
    assert packed and all(len(d.bindings) <= bindings for d in packed)
    for d in program.dispatches:
        mod = pack.parse(d.wgsl)
        if SEP in d.name:
            assert mod is not None  # a packed kernel is a kernel of the builder's shape
            assert pack.workgroup_layout([mod])[2] <= limits.max_workgroup_storage_size


def test_type_bytes():
    assert pack.type_bytes("array<vec4<f32>, 1088>") == 1088 * 16
    assert pack.type_bytes("array<f32, 260>") == 1040
    assert pack.type_bytes("array<vec3<f32>, 4>") == 64  # vec3 strides as vec4
    assert pack.type_bytes("array<vec4<f16>, 8>") == 64
    assert pack.type_bytes("atomic<u32>") == 4
    assert pack.type_bytes("array<atomic<u32>, 33u>") == 132
    assert pack.type_bytes("mat4x4<f32>") is None
    assert pack.type_bytes("array<S, 4>") is None


def _kernel(workgroup: str, body: str = "  sh[lid] = 1.0;", extra: str = "") -> str:
    return (
        "@group(0) @binding(0) var<storage, read_write> g_out: array<f32>;\n"
        f"{workgroup}\n{extra}"
        "@compute @workgroup_size(64)\n"
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: "
        "vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n"
        f"{body}\n  g_out[wid.x] = 0.0;\n}}\n"
    )


def test_workgroup_memory_shared_by_name_and_type():
    a = pack.parse(_kernel("var<workgroup> sh: array<f32, 64>;"))
    b = pack.parse(_kernel("var<workgroup> sh: array<f32, 256>;"))
    c = pack.parse(_kernel("var<workgroup> sh: array<vec4<f32>, 16>;", "  sh[lid] = vec4(1.0);"))
    lines, renames, total = pack.workgroup_layout([a, b])
    assert lines == ["var<workgroup> sh: array<f32, 256>;"] and renames == [{}, {}]
    assert total == 1024
    lines, renames, total = pack.workgroup_layout([a, c])
    assert renames == [{"sh": "sh_p0"}, {"sh": "sh_p1"}] and total == 256 + 256
    assert sorted(lines) == [
        "var<workgroup> sh_p0: array<f32, 64>;",
        "var<workgroup> sh_p1: array<vec4<f32>, 16>;",
    ]


def test_parse_refuses_other_shapes():
    ok = _kernel("var<workgroup> sh: array<f32, 64>;")
    mod = pack.parse(ok)
    assert mod is not None and mod.names == ("g_out",) and mod.size == "64"
    assert [a[0] for a in mod.args] == ["workgroup_id", "num_workgroups", "local_invocation_index"]
    assert pack.parse(ok + "fn after() {}\n") is None  # a declaration after main
    other = ok.replace("local_invocation_index) lid", "global_invocation_id) lid")
    assert pack.parse(other) is None  # a builtin the packed main cannot pass on
    assert pack.parse(ok.replace("fn main", "fn entry")) is None


def test_renaming_keeps_member_accesses():
    helper = "fn x(v: vec4<f32>) -> f32 { return v.x; }\n"
    mods = [pack.parse(_kernel("", "  let y = x(vec4(1.0));", helper)) for _ in range(2)]
    dummy = pack.Dispatch("%1 k", "", (0,), (True,), (3, 1, 1))
    src, grid = pack.packed_wgsl(mods, [dummy, dummy], H200_LIMITS)
    assert grid == (6, 1, 1)
    assert "fn x_p0(v: vec4<f32>) -> f32 { return v.x; }" in src
    assert "let y = x_p1(vec4(1.0));" in src
    assert "@binding(1) var<storage, read_write> g_out_p1" in src


# ---- execution (GPU) --------------------------------------------------------------------------


def _record_packs(monkeypatch) -> list[int]:
    """Packed dispatches of each program compiled from now on."""
    import importlib

    compile_module = importlib.import_module("meganeura.compile")  # not mn.compile, a function
    seen: list[int] = []
    real = compile_module.pack_program

    def record(program, limits):
        out = real(program, limits)
        seen.append(sum(SEP in d.name for d in out.dispatches))
        return out

    monkeypatch.setattr(compile_module, "pack_program", record)
    return seen


@pytest.mark.gpu
def test_nonfinite_constants_stay_opaque(gpu_device):
    """``x * 0.0`` and ``x / 0.0`` in two packed members: the kernels' zero constant stays
    opaque to the shader compiler (``codegen.wgsl.core.literals``), so inf * 0 is NaN and
    1 / 0 is inf as in torch and NumPy, not folded to 0 (Mesa's inexact rules)."""
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    b = GraphBuilder()
    x = [b.input(f"x{i}", (64,)) for i in range(2)]
    b.output("y0", x[0] * 0.0)
    b.output("y1", x[1] / 0.0)
    program = compile(b.build(), CompileOptions(), device_limits(gpu_device))
    assert [d.name.count(SEP) for d in program.dispatches] == [1]
    v = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.5] * 10 + [2.0] * 4, np.float32)
    with Session(program, gpu_device) as s:
        got = s.run({"x0": v, "x1": v}, ["y0", "y1"])
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(got["y0"], v * np.float32(0.0))
        np.testing.assert_array_equal(got["y1"], v / np.float32(0.0))


@pytest.mark.gpu
def test_tiny_llama_training_steps_bit_identical(gpu_device, monkeypatch):
    """Two Trainer steps (forward, backward, SGD): losses, gradients and the parameters
    after them, packing on and off."""
    seen = _record_packs(monkeypatch)
    got = llama_steps_on_off(gpu_device, pack.set_enabled, seed=13, token_seed=6)
    assert seen[0] > 0 and seen[-1] == 0  # packed on, nothing packed off
    (loss_on, grads_on), second_on, params_on, _ = got[0]
    (loss_off, grads_off), second_off, params_off, _ = got[1]
    assert loss_on == loss_off and second_on == second_off
    _assert_same_bits(grads_on, grads_off)
    _assert_same_bits(params_on, params_off)


@pytest.mark.gpu
def test_resnet_training_step_with_the_lookahead_bit_identical(gpu_device):
    """A tiny ResNet's Trainer step (BatchNorm in train mode, SGD): the loss, the gradients,
    the parameters and the running statistics after it, packed with the lookahead (members
    taken past other dispatches) and unpacked."""
    import meganeura as mn
    from meganeura.models.resnet import ResNet, ResNetConfig
    from meganeura.training import device_limits

    graph, options = _resnet_step()[:2]
    counts = []
    for look in (0, True):  # on this adapter too, the lookahead packs more
        pack.set_lookahead(look)
        counts.append(len(compile(graph, options, device_limits(gpu_device)).dispatches))
    assert counts[1] < counts[0]
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    y = np.array([1, 4], np.int32)
    got = []
    try:
        for on in (True, False):
            pack.set_enabled(on)
            mn.manual_seed(3)
            model = ResNet(ResNetConfig("bottleneck", (1, 1, 1, 1), 5, width=4)).train()
            tr = mn.Trainer(
                model,
                mn.optim.SGD(lr=0.05),
                lambda m, a, b: F.cross_entropy(m(a), b),
                device=gpu_device,
            )
            loss, grads = tr.step(x, y, return_grads=True)
            got.append((loss, grads, {k: np.asarray(v) for k, v in tr.state_dict().items()}))
            tr.close()
    finally:
        pack.set_enabled(True)
    (loss_on, grads_on, state_on), (loss_off, grads_off, state_off) = got
    assert np.isfinite(loss_on) and loss_on == loss_off
    _assert_same_bits(grads_on, grads_off)
    _assert_same_bits(state_on, state_off)


@pytest.mark.gpu
@pytest.mark.parametrize("per_dim", [65535, 4, 3])
def test_towers_gradients_match_float64_autograd(gpu_device, per_dim):
    """Two towers' gradients from packed dispatches whose grids fold into 1-D, 2-D and 3-D
    (``max_workgroups_per_dimension`` lowered), against torch float64 autograd, and the
    same bits as unpacked."""
    import torch

    from meganeura.training import device_limits

    limits = dataclasses.replace(device_limits(gpu_device), max_workgroups_per_dimension=per_dim)
    options = CompileOptions(loss="loss", output_grads=True)
    on, off = compile_both(pack.set_enabled, _towers(), options, limits)
    assert any(SEP in d.name for d in on.dispatches)
    if per_dim < 65535:
        assert any(d.grid[1] > 1 and SEP in d.name for d in on.dispatches)
    if per_dim == 3:
        assert any(d.grid[2] > 1 and SEP in d.name for d in on.dispatches)
    rng = np.random.default_rng(per_dim)
    widths = (40, 56, 8)
    params = {}
    for t in range(2):
        for layer in range(2):
            n_in, n_out = widths[layer], widths[layer + 1]
            w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
            params[f"w{t}{layer}"] = w.astype(np.float32)
            params[f"b{t}{layer}"] = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    feeds = {f"x{t}": rng.standard_normal((24, 40)).astype(np.float32) for t in range(2)}
    feeds["y"] = rng.integers(0, 8, 24).astype(np.int32)
    fetch = ["loss", *(f"{k}.grad" for k in params)]
    got = run_identical(gpu_device, (on, off), feeds, fetch, params)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    logits = 0
    for tower in range(2):
        h = torch.tensor(feeds[f"x{tower}"], dtype=torch.float64)
        h = torch.relu(torch.nn.functional.linear(h, t[f"w{tower}0"], t[f"b{tower}0"]))
        logits = logits + torch.nn.functional.linear(h, t[f"w{tower}1"], t[f"b{tower}1"])
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["y"], dtype=torch.long))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for k, v in t.items():
        want = v.grad.numpy()
        np.testing.assert_allclose(
            got[f"{k}.grad"], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=k
        )


@pytest.mark.gpu
def test_fast_precision_training_step_bit_identical(gpu_device):
    """Fast mode (f16 storage, ``enable f16;`` in the members): an SGD step of the two towers,
    packed and not, gives the same loss and parameters bit for bit, and the loss matches the
    float32 program's to f16 rounding."""
    import meganeura as mn
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    rng = np.random.default_rng(7)
    params = {}
    for t in range(2):
        for layer, (n_in, n_out) in enumerate(((40, 56), (56, 8))):
            w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
            params[f"w{t}{layer}"] = w.astype(np.float32)
            params[f"b{t}{layer}"] = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    feeds = {f"x{t}": rng.standard_normal((24, 40)).astype(np.float32) for t in range(2)}
    feeds["y"] = rng.integers(0, 8, 24).astype(np.int32)
    sgd = mn.optim.SGD(lr=0.1)
    feeds[mn.optim.HYPER_INPUT] = sgd.hyper(0, sgd.lr)
    got = {}
    for precision in ("fast", "strict"):
        options = CompileOptions(loss="loss", optimizer=sgd, precision=precision)
        on, off = compile_both(pack.set_enabled, _towers(), options, limits)
        packed = [d for d in on.dispatches if SEP in d.name]
        assert packed
        if precision == "fast":
            assert any(d.wgsl.startswith("enable f16;") for d in packed)
        runs = []
        for program in (on, off):
            with Session(program, gpu_device) as s:
                s.load_state_dict(params)
                loss = s.run(feeds, ["loss"])["loss"]
                runs.append({"loss": loss, **s.state_dict()})
        for name, value in runs[0].items():
            np.testing.assert_array_equal(value, runs[1][name], err_msg=f"{precision} {name}")
        got[precision] = runs[0]
    np.testing.assert_allclose(got["fast"]["loss"], got["strict"]["loss"], rtol=2e-2)
    for name in params:
        np.testing.assert_allclose(
            got["fast"][name], got["strict"][name], rtol=0, atol=2e-2, err_msg=name
        )
