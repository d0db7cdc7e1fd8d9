"""GPU memory comes back (issue 11, item 8): a dropped Trainer, a closed one, and the programs a
compile-on-call cache evicts free their buffers. lavapipe's GPU memory is host memory, so the
measures are the process's resident set (with a generous bound: a leak of the models below is
~4 MB a cycle, ~400 MB over the loop) and wgpu-py's count of live GPUBuffer objects (exact)."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import wgpu

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.dtypes import f32
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import Linear, Module
from meganeura.optim import Adam
from meganeura.training import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS from /proc"),
]

CYCLES = 100
WARMUP = 10  # allocator pools, the pipeline cache and NumPy's caches fill in the first cycles
BOUND_MB = 64  # a Trainer of the Net below leaks ~4 MB a cycle when its memory is pinned


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(512, 512)  # ~1 MB of weights, 2 MB of Adam moments
        self.fc2 = Linear(512, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


X = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
Y = np.arange(8, dtype=np.int32) % 10


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _live_buffers() -> int:
    gc.collect()
    return wgpu.diagnostics.object_counts.get_dict().get("Buffer", {}).get("count", 0)


def _assert_flat(
    cycle, what: str, warmup: int = WARMUP, slack: float = 0.0, rss: bool = True
) -> None:
    """Run ``cycle(i)`` CYCLES times; after ``warmup``, neither RSS nor live buffers may grow
    (buffers by at most ``slack`` of their count then; checked every 10 cycles, so a leak
    fails early instead of exhausting memory)."""
    for i in range(warmup):
        cycle(i)
    base_rss, base_buffers = _rss_mb(), _live_buffers()
    for i in range(warmup, CYCLES):
        cycle(i)
        if (i + 1) % 10 == 0:
            grown = _rss_mb() - base_rss
            buffers = _live_buffers()
            assert grown < BOUND_MB or not rss, f"{what}: RSS grew {grown:.0f} MB by cycle {i + 1}"
            assert buffers <= base_buffers * (1 + slack), (
                f"{what}: {buffers} live buffers, {base_buffers} at start"
            )


def test_dropped_trainers_free_their_memory(gpu_device):
    models = []

    def cycle(i):
        mn.manual_seed(i)
        model = Net()
        Trainer(model, Adam(lr=1e-3), loss_fn, device=gpu_device).step(X, Y)
        models.append(weakref.ref(model))

    _assert_flat(cycle, "dropped Trainer")
    gc.collect()
    # Nothing keeps a dropped trainer's model (the signature cache held its loss closure).
    assert [r for r in models if r() is not None] == []


def test_closed_trainers_free_their_memory_and_the_model_keeps_its_values(gpu_device, tmp_path):
    mn.manual_seed(0)
    model = Net()
    trainers = []

    def cycle(i):
        with Trainer(model, Adam(lr=1e-3), loss_fn, device=gpu_device) as tr:
            tr.step(X, Y)
        trainers.append(tr)  # kept: closing alone must free the memory

    _assert_flat(cycle, "closed Trainer")
    sd = model.state_dict()  # trained for 100 steps, read back after every trainer closed
    h = np.maximum(X @ sd["fc1.weight"].T + sd["fc1.bias"], 0)
    np.testing.assert_allclose(model(X), h @ sd["fc2.weight"].T + sd["fc2.bias"], atol=1e-4)
    tr = trainers[-1]
    tr.close()  # twice: nothing happens
    for use in (
        lambda: tr.step(X, Y),
        lambda: tr.evaluate(X, Y),
        tr.state_dict,
        lambda: tr.save(tmp_path / "unused.safetensors"),
        lambda: tr.load(tmp_path / "unused.safetensors"),
    ):
        with pytest.raises(RuntimeError, match="Trainer is closed"):
            use()
    assert not (tmp_path / "unused.safetensors").exists()


def test_closed_graph_trainers_free_their_memory(gpu_device):
    b = GraphBuilder()
    x = b.input("x", (8, 512), f32)
    w = b.parameter("w", (512, 1024), f32)
    b.output("loss", F.mean(x @ w))
    graph = b.build()
    trainers = []

    def cycle(i):
        with Trainer(graph, Adam(lr=1e-3), device=gpu_device) as tr:
            tr.step({"x": X})
        trainers.append(tr)

    _assert_flat(cycle, "closed GraphTrainer")
    tr = trainers[-1]
    for use in (lambda: tr.step({"x": X}), tr.parameters, tr.state_dict):
        with pytest.raises(RuntimeError, match="GraphTrainer is closed"):
            use()


def test_compile_on_call_keeps_at_most_max_programs(gpu_device):
    """100 distinct batch sizes through one module: the cache keeps the 32 most recently used
    programs and closes the others; an evicted signature compiles again, correctly."""
    mn.manual_seed(0)
    model = Linear(512, 512)  # one kernel or two: each new shape compiles new pipelines
    run = mn.compile(model, device=gpu_device)
    assert run.max_programs == 32
    w, bias = model.weight.data, model.bias.data
    sessions = []

    def cycle(i):
        n = i + 1
        entry = run.precompile(X[:1].repeat(n, 0))
        sessions.append(weakref.ref(entry.runner.session))
        assert run.cache_info().currsize == min(n, 32)

    # From 40 on the cache is full; programs of other batch sizes may have other buffer counts.
    # RSS is not a measure here: every new shape compiles new pipelines, which the device's
    # pipeline cache keeps (and lavapipe's JIT code with them: ~1-2 MB a shape, measured).
    _assert_flat(cycle, "compiled module over 100 shapes", warmup=40, slack=0.5, rss=False)
    gc.collect()
    assert sum(r() is not None and not r()._closed for r in sessions) == 32
    assert all(r() is not None and not r()._closed for r in sessions[-32:])
    xs = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_allclose(run(xs), xs @ w.T + bias, atol=1e-4)  # evicted: compiles again
    with pytest.raises(ValueError, match="max_programs"):
        mn.compile(model, max_programs=0)


def test_the_least_recently_used_program_is_the_one_closed(gpu_device):
    model = Linear(4, 3)
    run = mn.compile(model, device=gpu_device, max_programs=2)
    xs = {n: np.full((n, 4), float(n), np.float32) for n in (1, 2, 3)}
    for n in (1, 2, 1, 3):  # 2 is the least recently used when 3 arrives
        run(xs[n])
    kept = [e.runner.program.inputs["input"].shape for e in run.cache_info().entries]
    assert sorted(kept) == [(1, 4), (3, 4)], kept
    w, b = model.weight.data, model.bias.data
    np.testing.assert_allclose(run(xs[2]), xs[2] @ w.T + b, rtol=1e-6)  # compiles again
    assert run.cache_info().misses == 4

    mn.manual_seed(0)
    tr = Trainer(Net(), Adam(lr=1e-3), loss_fn, device=gpu_device)
    tr.max_programs = 2
    for n in (8, 4, 2, 8):
        tr.step(X[:n], Y[:n])
    assert tr.cache_info().currsize == 2 and tr.cache_info().misses == 4
