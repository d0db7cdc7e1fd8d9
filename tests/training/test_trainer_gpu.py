"""End-to-end training on the GPU (lavapipe on CI): optimizer steps against torch.optim,
bit-identical resume, and bad input that must leave parameters untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura import manual_seed
from meganeura.io.checkpoint import CheckpointError, save_checkpoint
from meganeura.models.mlp import build_mlp
from meganeura.optim import SGD, Adam, AdamW
from meganeura.runtime import InputError
from meganeura.training import Trainer

pytestmark = pytest.mark.gpu

SIZES = (20, 16, 5)
BATCH = 8


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    return x, y


def _trainer(gpu_device, opt, max_grad_norm=None):
    manual_seed(1)
    net = build_mlp(BATCH, SIZES)
    params = net.state_dict()
    tr = Trainer(net.graph, opt, max_grad_norm=max_grad_norm, device=gpu_device)
    tr.load_parameters(params)
    return tr, params


def _torch_steps(params, opt_name, kw, batches, max_grad_norm=None):
    model = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(), torch.nn.Linear(SIZES[1], SIZES[2])
    )
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    with torch.no_grad():
        for n, p in zip(names, model.parameters()):
            p.copy_(torch.from_numpy(params[n]))
    opt = getattr(torch.optim, opt_name)(model.parameters(), **kw)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x)), torch.from_numpy(y).long()
        )
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().numpy() for n, p in zip(names, model.parameters())}, losses


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = [
    (SGD(lr=0.1), "SGD", {"lr": 0.1}),
    (
        SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    ),
    (Adam(lr=1e-2, weight_decay=1e-2), "Adam", {"lr": 1e-2, "weight_decay": 1e-2}),
    (AdamW(lr=1e-2, weight_decay=0.1), "AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("opt,tname,kw", CASES, ids=["sgd", "sgd_nesterov_wd", "adam", "adamw"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_steps_match_torch_optim(gpu_device, opt, tname, kw, clip):
    tr, params = _trainer(gpu_device, opt, max_grad_norm=clip)
    batches = [_data(s) for s in range(3)]
    ours_losses = [float(tr.step({"x": x, "y": y})["loss"]) for x, y in batches]
    ref, ref_losses = _torch_steps(params, tname, kw, batches, clip)
    np.testing.assert_allclose(ours_losses, ref_losses, rtol=1e-5)
    got = tr.parameters()
    for name, want in ref.items():
        assert _rel(got[name], want) <= 1e-6, (name, _rel(got[name], want))
        assert not np.array_equal(got[name], params[name]), f"{name} did not move"


def test_one_step_matches_torch_to_1e6(gpu_device):
    tr, params = _trainer(gpu_device, AdamW(lr=1e-3, weight_decay=0.01))
    x, y = _data(7)
    tr.step({"x": x, "y": y})
    ref, _ = _torch_steps(params, "AdamW", {"lr": 1e-3, "weight_decay": 0.01}, [(x, y)])
    for name, want in ref.items():
        assert _rel(tr.parameters()[name], want) <= 1e-6


def test_resume_is_bit_identical(gpu_device, tmp_path):
    batches = [_data(s) for s in range(6)]
    a, _ = _trainer(gpu_device, AdamW(lr=1e-2))
    for x, y in batches:
        a.step({"x": x, "y": y})

    b, _ = _trainer(gpu_device, AdamW(lr=1e-2))
    for x, y in batches[:3]:
        b.step({"x": x, "y": y})
    b.save(tmp_path / "ck.safetensors", {"note": "half way"})
    c, _ = _trainer(gpu_device, AdamW(lr=1e-2))  # fresh weights, then overwritten by load
    meta = c.load(tmp_path / "ck.safetensors")
    assert meta["note"] == "half way" and c.step_count == 3
    for x, y in batches[3:]:
        c.step({"x": x, "y": y})
    sa, sc = a.state_dict(), c.state_dict()
    assert sa.keys() == sc.keys() and len(sa) == 12  # 4 params + 8 Adam moments
    for k in sa:
        assert np.array_equal(sa[k], sc[k]), k


@pytest.mark.parametrize(
    "feeds,match",
    [
        ({"x": np.zeros((BATCH, 19), np.float32)}, "'x'"),
        ({"x": np.zeros((BATCH, SIZES[0]), np.float64)}, "'x'"),
        ({"y": np.full(BATCH, 2**40, np.int64)}, "'y'"),  # int64 must fit int32
        ({"y": np.full(BATCH, SIZES[-1], np.int32)}, "'y'"),
        ({"y": np.full(BATCH, -1, np.int32)}, "'y'"),
    ],
    ids=["x_shape", "x_dtype", "y_dtype", "label_too_big", "label_negative"],
)
def test_bad_feed_raises_and_leaves_parameters(gpu_device, feeds, match):
    tr, _ = _trainer(gpu_device, AdamW(lr=1e-2))
    x, y = _data()
    tr.step({"x": x, "y": y})
    before = tr.state_dict()
    with pytest.raises(InputError, match=match):
        tr.step({"x": x, "y": y, **feeds})
    after = tr.state_dict()
    assert tr.step_count == 1
    for k in before:
        assert np.array_equal(before[k], after[k]), k


def test_missing_input_named(gpu_device):
    tr, _ = _trainer(gpu_device, SGD(lr=0.1))
    with pytest.raises(InputError, match="'y'"):
        tr.step({"x": _data()[0]})


def test_checkpoint_with_missing_or_unknown_keys(gpu_device, tmp_path):
    tr, _ = _trainer(gpu_device, SGD(lr=0.1))
    good = tr.state_dict()
    missing = dict(good)
    missing.pop("fc2.bias")
    save_checkpoint(tmp_path / "m.safetensors", missing, {"step": 0})
    with pytest.raises(CheckpointError, match="fc2.bias"):
        tr.load(tmp_path / "m.safetensors")
    extra = {**good, "fc3.weight": np.zeros(3, np.float32)}
    save_checkpoint(tmp_path / "u.safetensors", extra, {"step": 0})
    with pytest.raises(CheckpointError, match="fc3.weight"):
        tr.load(tmp_path / "u.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        tr.load(tmp_path / "t.safetensors")
    for k, v in tr.state_dict().items():
        assert np.array_equal(v, good[k]), k


@pytest.mark.parametrize(
    "step", [-1, "3", None, 2.5, True], ids=["negative", "string", "null", "float", "bool"]
)
def test_checkpoint_with_a_bad_step_changes_nothing(gpu_device, tmp_path, step):
    """Issue 11, item 6: a negative or string step was accepted and a null one failed with a
    bare TypeError after the tensors had been loaded."""
    tr, _ = _trainer(gpu_device, SGD(lr=0.1, momentum=0.9))
    x, y = _data()
    tr.step({"x": x, "y": y})
    good = tr.state_dict()
    other = {k: v + 1 for k, v in good.items()}
    save_checkpoint(tmp_path / "bad.safetensors", other, {"step": step})
    with pytest.raises(CheckpointError, match=r"'step' is .*integer >= 0"):
        tr.load(tmp_path / "bad.safetensors")
    assert tr.step_count == 1
    for k, v in tr.state_dict().items():
        assert np.array_equal(v, good[k]), k


def test_out_of_range_token_ids_rejected_before_the_step(gpu_device):
    from meganeura.dtypes import i32
    from meganeura.graph.builder import GraphBuilder
    from meganeura.ops import functional as F
    from meganeura.ops.gather import embedding

    b = GraphBuilder()
    ids = b.input("ids", (2, 3), i32)
    w = b.parameter("emb", (5, 4))
    b.output("loss", F.sum(embedding(ids, w) * embedding(ids, w)))
    tr = Trainer(b.build(), SGD(lr=0.1), device=gpu_device)
    tr.load_parameters({"emb": np.ones((5, 4), np.float32)})
    tr.step({"ids": np.array([[0, 1, 4], [2, 3, 4]], np.int32)})
    before = tr.parameters()["emb"]
    with pytest.raises(InputError, match="'ids'.*5"):
        tr.step({"ids": np.array([[0, 1, 5], [2, 3, 4]], np.int32)})
    assert np.array_equal(tr.parameters()["emb"], before)
    assert tr.step_count == 1


def test_one_index_input_is_checked_against_every_op_reading_it(gpu_device):
    """Ids that are class labels of a 10-way cross-entropy and rows of a 5-row embedding: an
    id of 7 is a valid class but no row, and must be refused (issue 11, item 9: only the first
    consumer's bound was checked, and the embedding silently read a zero row)."""
    from meganeura.dtypes import i32
    from meganeura.graph.builder import GraphBuilder
    from meganeura.ops import functional as F
    from meganeura.ops.gather import embedding

    b = GraphBuilder()
    ids = b.input("ids", (4,), i32)
    logits = b.parameter("logits", (4, 10))
    rows = embedding(ids, b.parameter("emb", (5, 3)))
    b.output("loss", F.cross_entropy(logits, ids) + F.sum(rows * rows))
    tr = Trainer(b.build(), SGD(lr=0.1), device=gpu_device)
    assert sorted(lc.num_classes for lc in tr.program.label_checks) == [5, 10]
    tr.load_parameters(
        {"logits": np.zeros((4, 10), np.float32), "emb": np.ones((5, 3), np.float32)}
    )
    tr.step({"ids": np.array([0, 1, 4, 2], np.int32)})
    before = tr.parameters()
    with pytest.raises(InputError, match=r"'ids': token id 7 .*\[0, 5\) \(embedding %\d+ at "):
        tr.step({"ids": np.array([0, 7, 4, 2], np.int32)})
    with pytest.raises(InputError, match=r"'ids'.* -1 .* out of range"):
        tr.step({"ids": np.array([0, 1, -1, 2], np.int32)})
    for k, v in tr.parameters().items():
        assert np.array_equal(v, before[k]), k
    assert tr.step_count == 1


def test_fuse_switch_reaches_the_compiled_step(gpu_device):
    manual_seed(1)
    net = build_mlp(BATCH, SIZES)
    fused = Trainer(net.graph, SGD(lr=0.1), device=gpu_device)
    plain = Trainer(net.graph, SGD(lr=0.1), device=gpu_device, fuse=False)
    assert len(fused.program.dispatches) < len(plain.program.dispatches)
    params = net.state_dict()
    x, y = _data()
    for tr in (fused, plain):
        tr.load_parameters(params)
        tr.step({"x": x, "y": y})
    for k, v in fused.parameters().items():
        np.testing.assert_allclose(v, plain.parameters()[k], rtol=1e-6, atol=1e-7)


def test_step_returns_the_loss_the_trainer_was_given(gpu_device):
    # With loss="ce", step(feeds) fetched "loss" by default and failed with InputError
    # "no output named 'loss'; known: ['ce']".
    from meganeura.dtypes import i32
    from meganeura.graph.builder import GraphBuilder
    from meganeura.ops import functional as F

    b = GraphBuilder()
    x = b.input("x", (4, 8))
    y = b.input("y", (4,), i32)
    b.output("ce", F.cross_entropy(F.linear(x, b.parameter("w", (3, 8))), y))
    tr = Trainer(b.build(), SGD(lr=0.1), loss="ce", device=gpu_device)
    tr.load_parameters({"w": np.zeros((3, 8), np.float32)})
    out = tr.step({"x": np.ones((4, 8), np.float32), "y": np.zeros(4, np.int32)})
    assert list(out) == ["ce"]
    np.testing.assert_allclose(out["ce"], np.log(3), rtol=1e-6)  # uniform over 3 classes


@pytest.mark.parametrize(
    "feed, says",
    [
        ("ids", "input 'ids': token id 5 at position (1, 2) is outside [0, 5) (embedding %"),
        ("y", "input 'y': class index 10 at position (5,) is outside [0, 10) or -100 (ig"),
        ("sel", "input 'sel': index 6 at position (1,) is outside [0, 6) (index_select %"),
    ],
    ids=["embedding", "cross_entropy", "index_select"],
)
def test_an_index_out_of_range_is_worded_by_the_op_reading_it(gpu_device, feed, says):
    # An embedding's token id was reported as a "class index" read by "index_select".
    import sys

    import meganeura.nn.functional as F
    from meganeura.dtypes import i32
    from meganeura.graph.builder import GraphBuilder

    b = GraphBuilder()
    ids, y, sel = b.input("ids", (2, 3), i32), b.input("y", (6,), i32), b.input("sel", (2,), i32)
    lines = {"ids": sys._getframe().f_lineno + 1}
    h = F.embedding(ids, b.parameter("emb", (5, 4)))
    logits = F.linear(F.reshape(h, (6, 4)), b.parameter("w", (10, 4)))
    lines["sel"] = sys._getframe().f_lineno + 1
    picked = F.index_select(logits, 0, sel)
    lines["y"] = sys._getframe().f_lineno + 1
    b.output("loss", F.cross_entropy(logits, y) + F.sum(picked))
    tr = Trainer(b.build(), SGD(lr=0.1), device=gpu_device)
    tr.load_parameters({"emb": np.ones((5, 4), np.float32), "w": np.zeros((10, 4), np.float32)})
    good = {
        "ids": np.array([[0, 1, 4], [2, 3, 4]], np.int32),
        "y": np.arange(6, dtype=np.int32),
        "sel": np.array([0, 5], np.int32),
    }
    bad = {
        "ids": np.array([[0, 1, 4], [2, 3, 5]], np.int32),
        "y": np.array([0, 1, 2, 3, 4, 10], np.int32),
        "sel": np.array([0, 6], np.int32),
    }
    with pytest.raises(InputError) as ei:
        tr.step({**good, feed: bad[feed]})
    msg = str(ei.value)
    assert msg.startswith(says), msg
    assert f" at test_trainer_gpu.py:{lines[feed]} reads it); 1 value(s) out of range" in msg, msg
    assert tr.step_count == 0
