"""``passes.split_bindings``: tensors larger than one storage binding, bound in row blocks.

The binding limit is lowered (``CompileOptions.max_storage_binding_bytes``) so that a
1000 x 64 f32 embedding (256 000 bytes) splits into blocks of a 64 KiB limit; the split program
is compared with the unsplit one (NumPy interpreter, then the GPU) and with NumPy / torch
references. One GPU test runs SmolLM2-360M's real tied embedding (49152 x 960 f32, 188 MB) on
the adapter's own limit (128 MiB on lavapipe).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.codegen.kernel import Limits
from meganeura.compile import CompileOptions, _training_graph, compile, simplify_program
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.nn import functional as F
from meganeura.optim import HYPER_INPUT, SGD, AdamW
from meganeura.passes.split_bindings import BindingSplitError, row_partition, split_bindings

rng = np.random.default_rng(12)

V, E, LIMIT = 1000, 64, 65536  # 256 000 bytes: four blocks of <= 256 rows
LIMITS = Limits(max_storage_buffer_binding_size=LIMIT)
# Token ids at every block's first and last row, and repeated ones (scatter-add order).
IDS = np.array([0, 255, 256, 511, 512, 767, 768, 999, 3, 999, 256, 40], np.int32)


class TiedLM(mn.nn.Module):
    """Embedding -> Linear -> ReLU -> logits through the embedding's weight (tied head)."""

    def __init__(self, vocab: int = V, dim: int = E) -> None:
        super().__init__()
        self.emb = mn.nn.Embedding(vocab, dim)
        self.fc = mn.nn.Linear(dim, dim)

    def forward(self, ids):
        return F.linear(F.relu(self.fc(self.emb(ids))), self.emb.weight)


def _model() -> TiedLM:
    m = TiedLM()
    m.load_state_dict(
        {
            "emb.weight": rng.normal(size=(V, E)).astype(np.float32),
            "fc.weight": (rng.normal(size=(E, E)) / 8).astype(np.float32),
            "fc.bias": rng.normal(size=E).astype(np.float32),
        }
    )
    return m


def _params(m) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in m.state_dict().items()}


def _numpy_forward(p, ids):
    w = p["emb.weight"]
    return np.maximum(w[ids] @ p["fc.weight"].T + p["fc.bias"], 0) @ w.T


# ---- the partition -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows,row_bytes,limit,align",
    [(1000, (256,), 65536, 256), (49152, (3840,), 2**27, 256), (300, (4, 2), 1024, 256),
     (1000, (24,), 65536, 256), (20, (12,), 96, 32)],
    ids=["embedding", "smollm2", "f32_and_f16", "odd_row", "tiny"],
)  # fmt: skip
def test_row_partition_fits_the_limit_at_aligned_offsets(rows, row_bytes, limit, align):
    parts = row_partition(rows, row_bytes, limit, align)
    assert parts[0][0] == 0 and parts[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    for start, end in parts:
        for rb in row_bytes:
            assert (end - start) * rb <= limit and start * rb % align == 0
    assert len(parts) == -(-rows // (parts[0][1]))  # equal blocks but the last


def test_row_partition_refuses_rows_larger_than_the_limit():
    with pytest.raises(ValueError, match="rows of 2000 bytes.*1024 bytes"):
        row_partition(10, (2000,), 1024, 256)
    with pytest.raises(ValueError, match="multiples of 256 bytes"):
        row_partition(10, (800,), 1024, 256)  # one row fits, but not at an aligned offset


# ---- the rewrite, on the NumPy interpreter -------------------------------------------------------
def test_forward_split_matches_on_the_interpreter():
    m = _model()
    graph = mn.nn.trace(m, IDS)
    split, kept = split_bindings(graph, LIMITS)
    blocks = [n for n in split.nodes if n.op == "row_block"]
    assert [(n.attr("start"), n.attr("length")) for n in blocks] == [
        (0, 256), (256, 256), (512, 256), (768, 232)
    ]  # fmt: skip
    assert all(n.type.nbytes <= LIMIT for n in split.nodes if n.op != "parameter")
    p = _params(m)
    want = interpret(graph, {"ids": IDS}, p)[0][graph.outputs[0][1]]
    got = interpret(split, {"ids": IDS}, p)[0][split.outputs[0][1]]
    # the interpreter's matmuls go through the host's BLAS, whose kernels (picked per CPU and
    # per shape) may round a product of 256 rows differently from one of 1000: equal up to f32
    # rounding of the sums, not bit for bit
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(got, _numpy_forward(p, IDS), rtol=1e-5, atol=1e-4)
    assert split[kept[graph.find("emb.weight").id]].name == "emb.weight"


def test_nothing_to_split_returns_the_graph():
    graph = mn.nn.trace(_model(), IDS)
    assert split_bindings(graph, Limits())[0] is graph


@pytest.mark.parametrize(
    "optimizer", [AdamW(lr=0.01), SGD(lr=0.1, momentum=0.9)], ids=["adamw", "sgd"]
)
def test_training_split_matches_on_the_interpreter(optimizer):
    m = _model()
    y = rng.integers(0, V, size=IDS.shape).astype(np.int32)
    graph = mn.nn.trace(m, IDS, y, fn=lambda ids, y: {"loss": F.cross_entropy(m(ids), y)})
    options = CompileOptions(loss="loss", optimizer=optimizer, max_grad_norm=1.0)
    train, _ = simplify_program(_training_graph(graph, options)[0], frozenset())
    split, _ = split_bindings(train, LIMITS)
    updates = [n for n in split.nodes if n.op.endswith("_update")]
    assert sum(split[n.inputs[0]].op == "row_block" for n in updates) == 4
    feeds = {"ids": IDS, "y": y, HYPER_INPUT: optimizer.hyper(0, optimizer.lr)}
    _, want, want_state = interpret(train, feeds, _params(m), float64=True)
    _, got, got_state = interpret(split, feeds, _params(m), float64=True)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)
    for k in want_state:
        np.testing.assert_allclose(got_state[k], want_state[k], rtol=1e-12, atol=1e-12)


def _long_batch():
    """40 tokens in a batch of 2: logits f32[2, 20, 1000] (160 000 bytes) exceed the limit
    too; two targets are ignored and labels are smoothed."""
    ids = rng.integers(0, V, size=(2, 20)).astype(np.int32)
    y = rng.integers(0, V, size=(2, 20)).astype(np.int32)
    y[0, 3] = y[1, 7] = -100
    return ids, y


def _long_loss(m):
    def loss(ids, y):
        logits = F.flatten(m(ids), 0, 1)  # as models.transformer: [B, S, V] -> [B * S, V]
        return {"loss": F.cross_entropy(logits, y.flatten(), label_smoothing=0.1)}

    return loss


def test_logits_above_the_limit_train_in_row_blocks_on_the_interpreter():
    m = _model()
    ids, y = _long_batch()
    opt = SGD(lr=0.1, momentum=0.9)
    graph = mn.nn.trace(m, ids, y, fn=_long_loss(m))
    options = CompileOptions(loss="loss", optimizer=opt, max_grad_norm=1.0)
    train, _ = simplify_program(_training_graph(graph, options)[0], frozenset())
    split, _ = split_bindings(train, LIMITS)
    ce = [n for n in split.nodes if n.op.startswith("cross_entropy")]
    assert {n.type.shape for n in ce} == {(), (16, V), (8, V)}  # blocks of 16, 16, 8 rows
    feeds = {"ids": ids, "y": y, HYPER_INPUT: opt.hyper(0, opt.lr)}
    vals, want, _ = interpret(train, feeds, _params(m), float64=True)
    got_vals, got, _ = interpret(split, feeds, _params(m), float64=True)
    loss = got_vals[split.output_dict["loss"]]
    np.testing.assert_allclose(loss, vals[train.output_dict["loss"]], rtol=1e-13)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-13, err_msg=k)


def test_logits_above_the_limit_are_written_in_place_into_the_output():
    m = _model()
    ids = _long_batch()[0]
    graph = mn.nn.trace(m, ids)
    split, _ = split_bindings(graph, LIMITS)
    (out,) = (n for n in split.nodes if n.op == "row_concat")
    assert [split[i].type.shape for i in out.inputs] == [(16, V), (16, V), (8, V)]
    p = _params(m)
    got = interpret(split, {"ids": ids}, p)[0][split.outputs[0][1]]
    np.testing.assert_allclose(got, _numpy_forward(p, ids), rtol=1e-5, atol=1e-4)
    program = compile(graph, CompileOptions(max_storage_binding_bytes=LIMIT), Limits())
    slot = program.outputs["output"]
    assert program.buffers[slot.buffer].size == 2 * 20 * V * 4 > LIMIT
    written = sorted(
        d.span(i, program.buffers[b].size)
        for d in program.dispatches
        for i, (b, w) in enumerate(zip(d.bindings, d.writes))
        if w and b == slot.buffer
    )
    assert written == [(0, 64000), (64000, 64000), (128000, 32000)]


def test_compiled_bindings_stay_under_the_limit_at_aligned_offsets():
    program = compile(
        mn.nn.trace(_model(), IDS), CompileOptions(max_storage_binding_bytes=LIMIT), Limits()
    )
    (table,) = [b for b in program.buffers if b.name == "emb.weight"]
    assert table.size == V * E * 4  # one buffer, several bindings
    offsets = set()
    for d in program.dispatches:
        for i, buf in enumerate(d.bindings):
            off, size = d.span(i, program.buffers[buf].size)
            assert size <= LIMIT and off % 256 == 0, d.name
            if buf == table.id:
                offsets.add(off)
    assert offsets == {0, 65536, 131072, 196608}
    assert program.meta["max_storage_binding_bytes"] == LIMIT
    # the token ids are still range-checked on the host, though the split reads clamped ids
    assert [(c.name, c.num_classes) for c in program.label_checks] == [("ids", V)]


# ---- refusals ----------------------------------------------------------------------------------
def _refused(build, limit=1024):
    b = GraphBuilder()
    build(b)
    with pytest.raises(BindingSplitError) as e:
        compile(b.build(), CompileOptions(max_storage_binding_bytes=limit), Limits())
    return str(e.value)


def test_unsplittable_consumer_is_named_with_the_tensor_size_and_limit():
    msg = _refused(lambda b: b.output("y", F.softmax(b.parameter("w", (300, 4)), 0)))
    assert "'w'" in msg and "f32[300,4]" in msg and "4800 bytes" in msg and "1024 bytes" in msg
    assert "op softmax" in msg and "max_storage_binding_bytes" in msg


def test_rows_too_large_for_one_block_are_refused():
    msg = _refused(lambda b: b.output("y", F.sum(F.exp(b.parameter("w", (2, 300))))))
    assert "'w'" in msg and "rows cannot be split: rows of 1200 bytes" in msg


def test_binding_limit_option_is_checked():
    with pytest.raises(ValueError, match="positive multiple of 4"):
        CompileOptions(max_storage_binding_bytes=1001)
    b = GraphBuilder()
    b.output("y", F.exp(b.input("x", (4,))))
    with pytest.raises(ValueError, match="exceeds the adapter's max_storage_buffer_binding_size"):
        compile(b.build(), CompileOptions(max_storage_binding_bytes=2**30), Limits())


# ---- on the GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_module_forward_split_matches_unsplit_bitwise(gpu_device):
    m = _model()
    split = mn.compile(m, device=gpu_device, max_storage_binding_bytes=LIMIT)
    whole = mn.compile(m, device=gpu_device)
    got, want = split(IDS), whole(IDS)
    assert any(d.offsets for d in split.precompile(IDS).runner.program.dispatches)
    # the interpreter's matmuls go through the host's BLAS, whose kernels (picked per CPU and
    # per shape) may round a product of 256 rows differently from one of 1000: equal up to f32
    # rounding of the sums, not bit for bit
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(got, _numpy_forward(_params(m), IDS), rtol=1e-5, atol=1e-4)


def _torch_steps(p, ids, y, steps, lr):
    w, fw, fb = (torch.tensor(p[k], dtype=torch.float64, requires_grad=True)
                 for k in ("emb.weight", "fc.weight", "fc.bias"))  # fmt: skip
    opt = torch.optim.AdamW([w, fw, fb], lr=lr)
    ids_t, y_t = torch.tensor(ids.reshape(-1)).long(), torch.tensor(y.reshape(-1)).long()
    for _ in range(steps):
        opt.zero_grad()
        h = torch.relu(w[ids_t] @ fw.T + fb)
        torch.nn.functional.cross_entropy(h @ w.T, y_t).backward()
        torch.nn.utils.clip_grad_norm_([w, fw, fb], 1.0)
        opt.step()
    return {"emb.weight": w, "fc.weight": fw, "fc.bias": fb}


@pytest.mark.gpu
def test_training_steps_split_match_unsplit_and_torch(gpu_device):
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    m = _model()
    ids = IDS.reshape(2, 6)  # a batch: the head's matmul is 3-D
    y = rng.integers(0, V, size=ids.shape).astype(np.int32)
    graph = mn.nn.trace(
        m, ids, y, fn=lambda ids, y: {"loss": F.cross_entropy(F.flatten(m(ids), 0, 1), y.flatten())}
    )
    opt, steps = AdamW(lr=0.01), 3
    results = []
    for limit in (None, LIMIT):
        options = CompileOptions(
            loss="loss", optimizer=opt, max_grad_norm=1.0, nonfinite_guard="skip",
            max_storage_binding_bytes=limit,
        )  # fmt: skip
        program = compile(graph, options, device_limits(gpu_device))
        with Session(program, gpu_device) as s:
            s.load_state_dict({**{k: s.read(k) for k in program.state}, **_params(m)})
            feeds = {n: np.zeros(t.shape, t.dtype.numpy) for n, t in program.inputs.items()}
            feeds.update(ids=ids, y=y)
            for step in range(steps):
                s.run({**feeds, HYPER_INPUT: opt.hyper(step, opt.lr)})
            results.append({k: s.read(k) for k in program.parameters})
    want = _torch_steps(_params(m), ids, y, steps, opt.lr)
    for k, ref in want.items():
        np.testing.assert_allclose(results[1][k], results[0][k], rtol=1e-5, atol=2e-6, err_msg=k)
        np.testing.assert_allclose(results[1][k], ref.detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_smollm2_embedding_and_tied_head_on_the_adapter_limit(gpu_device):
    """49152 x 960 f32 (188 MB) on the adapter's own binding limit: lavapipe's 128 MiB."""
    vocab, dim = 49152, 960
    limit = gpu_device.max_storage_buffer_binding_size
    if vocab * dim * 4 <= limit or vocab * dim * 4 > gpu_device.max_buffer_size:
        pytest.skip(f"binding limit {limit} holds the table, or the buffer limit does not")
    table = np.random.default_rng(5).standard_normal((vocab, dim), np.float32)
    m = TiedLM.__new__(TiedLM)
    mn.nn.Module.__init__(m)
    m.emb = mn.nn.Embedding.from_pretrained(table)
    m.forward = lambda ids: F.linear(m.emb(ids) * 0.5, m.emb.weight)
    ids = np.array([0, vocab - 1, 34952, 34951, 17, 40000], np.int32)
    run = mn.compile(m, device=gpu_device)
    program = run.precompile(ids).runner.program
    assert any(d.offsets for d in program.dispatches)  # the table is bound in blocks
    got = run(ids)
    want = (table[ids].astype(np.float64) * 0.5) @ table.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
def test_trainer_with_accumulation_split_matches_unsplit(gpu_device):
    """mn.Trainer: micro-batch accumulators and the guard's found_inf run per block too.
    SGD, whose step is linear in the gradient: Adam's m / sqrt(v) turns the rounding of
    gradients near zero (the split head sums its input gradient in another order) into
    differences of up to lr per element."""
    y = rng.integers(0, V, size=IDS.shape).astype(np.int32)
    start, results = _model(), []
    for limit in (None, LIMIT):
        m = _model()
        m.load_state_dict(_params(start))
        trainer = mn.Trainer(
            m, SGD(lr=0.1, momentum=0.9), lambda model, ids, y: F.cross_entropy(model(ids), y),
            accumulation_steps=2, on_nonfinite="skip", device=gpu_device,
            max_storage_binding_bytes=limit,
        )  # fmt: skip
        with trainer:
            losses = [float(trainer.step(IDS, y)) for _ in range(4)]
        results.append((losses, _params(m)))
    (want_loss, want), (got_loss, got) = results
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert not np.array_equal(got["emb.weight"], _params(start)["emb.weight"])


def test_a_transpose_of_a_big_leaf_read_elementwise_is_refused_naming_the_op():
    def build(b):
        b.output("y", F.sum(F.permute(b.parameter("w", (300, 8)), (1, 0)) * 2.0))

    msg = _refused(build, limit=4096)
    assert "(permute: f32[8,300]) of 9600 bytes" in msg and "op mul" in msg


@pytest.mark.gpu
def test_logits_above_the_limit_train_on_the_gpu_as_unsplit_and_torch(gpu_device):
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    m = _model()
    ids, y = _long_batch()
    graph = mn.nn.trace(m, ids, y, fn=_long_loss(m))
    opt, results = SGD(lr=0.1, momentum=0.9), []
    for limit in (None, LIMIT):
        options = CompileOptions(loss="loss", optimizer=opt, max_storage_binding_bytes=limit)
        program = compile(graph, options, device_limits(gpu_device))
        with Session(program, gpu_device) as s:
            s.load_state_dict({**{k: s.read(k) for k in program.state}, **_params(m)})
            losses = [
                float(
                    s.run({"ids": ids, "y": y, HYPER_INPUT: opt.hyper(i, opt.lr)}, ["loss"])["loss"]
                )
                for i in range(2)
            ]
            results.append((losses, {k: s.read(k) for k in program.parameters}))
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in _params(m).items()}
    sgd = torch.optim.SGD(p.values(), lr=0.1, momentum=0.9)
    ids_t, y_t = torch.tensor(ids.reshape(-1)).long(), torch.tensor(y.reshape(-1)).long()
    want_losses = []
    for _ in range(2):
        sgd.zero_grad()
        h = torch.relu(p["emb.weight"][ids_t] @ p["fc.weight"].T + p["fc.bias"])
        loss = torch.nn.functional.cross_entropy(h @ p["emb.weight"].T, y_t, label_smoothing=0.1)
        loss.backward()
        sgd.step()
        want_losses.append(loss.item())
    (whole_losses, whole), (got_losses, got) = results
    np.testing.assert_allclose(got_losses, whole_losses, rtol=1e-6)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for k, ref in p.items():
        np.testing.assert_allclose(got[k], whole[k], rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(got[k], ref.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.gpu
def test_outputs_above_the_limit_on_the_gpu(gpu_device):
    """The 40-token logits of the tied head, and exp of the table itself, as outputs."""
    m = _model()
    ids = _long_batch()[0]
    got = mn.compile(m, device=gpu_device, max_storage_binding_bytes=LIMIT)(ids)
    np.testing.assert_allclose(got, mn.compile(m, device=gpu_device)(ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, _numpy_forward(_params(m), ids), rtol=1e-5, atol=1e-4)
    b = GraphBuilder()
    b.output("y", F.exp(b.parameter("w", (V, E))))
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    options = CompileOptions(max_storage_binding_bytes=LIMIT)
    w = _params(m)["emb.weight"]
    with Session(compile(b.build(), options, device_limits(gpu_device)), gpu_device) as s:
        s.write("w", w)
        np.testing.assert_allclose(s.run({}, ["y"])["y"], np.exp(w), rtol=2e-6)


# ---- matmul tilings, each against the unsplit graph -------------------------------------------
MATMUL_LIMIT = 4096  # w: 9600 bytes in blocks of 128 rows; every other value fits but y and out


def _w(b):
    return b.parameter("w", (300, 8))


MATMULS = {
    "x_wt": lambda b: b.input("x", (3, 8)) @ F.permute(_w(b), (1, 0)),
    "x_w": lambda b: b.input("x", (3, 300)) @ _w(b),
    "wt_y": lambda b: F.permute(_w(b), (1, 0)) @ b.input("y", (300, 6)),  # y is big too
    "w_y_output": lambda b: _w(b) @ b.input("y", (8, 6)),  # a big output, written in place
    "batched_x_wt": lambda b: b.input("x", (2, 1, 8)) @ F.permute(_w(b), (1, 0)),
    "xt_w": lambda b: F.permute(b.input("x", (300, 3)), (1, 0)) @ _w(b),
    "w_y_summed": lambda b: F.sum(_w(b) @ b.input("y", (8, 6)), 0),
    # ops of rows: a softmax written in place as an output, a greedy argmax, log-sum-exp
    "w_y_softmax": lambda b: F.softmax(_w(b) @ b.input("y", (8, 6)), 1),
    "w_y_argmax": lambda b: F.argmax(_w(b) @ b.input("y", (8, 6)), 1),
    "w_logsumexp": lambda b: F.logsumexp(_w(b), 1),
}


def _matmul_case(name):
    b = GraphBuilder()
    b.output("out", MATMULS[name](b))
    graph = b.build()
    feeds = {
        n.name: rng.normal(size=n.type.shape).astype(np.float32) for n in graph.leaves("input")
    }
    return graph, feeds, {"w": rng.normal(size=(300, 8)).astype(np.float32)}


@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul_tilings_match_unsplit_on_the_interpreter(name):
    graph, feeds, params = _matmul_case(name)
    split, _ = split_bindings(graph, Limits(max_storage_buffer_binding_size=MATMUL_LIMIT))
    assert any(n.op == "row_block" for n in split.nodes)
    want = interpret(graph, feeds, params, float64=True)[0][graph.outputs[0][1]]
    got = interpret(split, feeds, params, float64=True)[0][split.outputs[0][1]]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert got.dtype == want.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul_tilings_on_the_gpu(name, gpu_device):
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    graph, feeds, params = _matmul_case(name)
    want = interpret(graph, feeds, params, float64=True)[0][graph.outputs[0][1]]
    options = CompileOptions(max_storage_binding_bytes=MATMUL_LIMIT)
    with Session(compile(graph, options, device_limits(gpu_device)), gpu_device) as s:
        s.write("w", params["w"])
        got = s.run(feeds, ["out"])["out"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_fast_precision_training_split_matches_unsplit(gpu_device):
    """f16 storage (passes.precision) mixes f16 and f32 operands: blocks are stored as the
    values they split."""
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter has no shader-f16")
    m = _model()
    y = rng.integers(0, V, size=IDS.shape).astype(np.int32)
    graph = mn.nn.trace(m, IDS, y, fn=lambda ids, y: {"loss": F.cross_entropy(m(ids), y)})
    opt, results = AdamW(lr=0.01), []
    for limit in (None, LIMIT):
        options = CompileOptions(
            loss="loss", optimizer=opt, precision="fast", max_storage_binding_bytes=limit
        )
        program = compile(graph, options, device_limits(gpu_device))
        assert program.meta["precision"] == "fast"
        with Session(program, gpu_device) as s:
            s.load_state_dict({**{k: s.read(k) for k in program.state}, **_params(m)})
            for i in range(3):
                s.run({"ids": IDS, "y": y, HYPER_INPUT: opt.hyper(i, opt.lr)})
            results.append({k: s.read(k) for k in program.parameters})
    for k in results[0]:
        np.testing.assert_allclose(results[1][k], results[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
