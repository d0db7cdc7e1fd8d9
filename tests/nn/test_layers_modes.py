"""Train/eval behaviour: BatchNorm's running statistics and counter, Dropout's masks.

BatchNorm in train mode normalizes with the batch statistics and updates running_mean /
running_var in the same program and num_batches_tracked on the host after it (one per call,
as PyTorch's forward does); in eval mode it reads the running statistics. Each is compared
with torch after the same calls.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn as mnn
import meganeura.nn.functional as F
from meganeura.nn.compiled import trace_call

from .harness import GPU_RTOL, assert_close, build, f32, interpret_forward, rel_err, torch_forward

rng = np.random.default_rng(5)


def _torch_train_call(theirs, x):
    theirs.double()
    with torch.no_grad():
        return theirs(torch.from_numpy(x.astype(np.float64))).numpy()


def _check_stats(ours, theirs, rtol):
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    for k in ("running_mean", "running_var"):
        assert rel_err(ours_sd[k], theirs_sd[k].numpy()) <= rtol, k
    assert ours_sd["num_batches_tracked"].dtype == np.int64
    assert int(ours_sd["num_batches_tracked"]) == int(theirs_sd["num_batches_tracked"])


def test_batchnorm_train_updates_running_stats_like_torch(gpu_device):
    theirs, ours = build("BatchNorm2d", (3,), {"momentum": 0.25})
    for _ in range(2):  # two calls: the second hits the cache and must still update
        x = f32(rng.standard_normal((4, 3, 3, 3)) * 2 + 1)
        assert_close(ours(x), _torch_train_call(theirs, x), GPU_RTOL)
    assert ours._compiled.cache_info().hits == 1
    _check_stats(ours, theirs, GPU_RTOL)
    assert int(ours.state_dict()["num_batches_tracked"]) == 2
    # Eval mode normalizes with the running statistics just learned.
    ours.eval()
    theirs.eval()
    x = f32(rng.standard_normal((2, 3, 3, 3)))
    assert_close(ours(x), torch_forward(theirs, [x]), GPU_RTOL)
    _check_stats(ours, theirs, GPU_RTOL)  # eval changes nothing


def test_batchnorm_train_graph_updates_state_in_the_interpreter():
    theirs, ours = build("BatchNorm1d", (3,))
    x = f32(rng.standard_normal((6, 3)) * 3 - 1)
    _, state = interpret_forward(ours, [x])
    _torch_train_call(theirs, x)
    for k in ("running_mean", "running_var"):
        assert rel_err(state[k], theirs.state_dict()[k].numpy()) <= 1e-7, k


def test_batchnorm_eval_without_running_stats_uses_batch_stats():
    theirs, ours = build("BatchNorm1d", (3,), {"track_running_stats": False})
    ours.eval()
    theirs.eval()
    x = f32(rng.standard_normal((5, 3, 2)))
    got, _ = interpret_forward(ours, [x])
    assert_close(got, torch_forward(theirs, [x]), 1e-10)
    assert "running_mean" not in ours.state_dict()


def test_batchnorm_counter_only_counts_train_calls():
    ours = mnn.BatchNorm1d(2)
    counter = ours._buffers["num_batches_tracked"]
    train = trace_call(ours, ours.forward, [np.zeros((3, 2), np.float32)], {})
    assert len(train.trace.host_effects) == 1
    train.trace.host_effects[0]()
    assert int(counter.data) == 1
    ours.eval()
    evaluated = trace_call(ours, ours.forward, [np.zeros((3, 2), np.float32)], {})
    assert evaluated.trace.host_effects == []


def test_batchnorm_momentum_none_is_refused_in_train_mode_only():
    ours = mnn.BatchNorm1d(2, momentum=None)
    x = f32(rng.standard_normal((4, 2)))
    with pytest.raises(NotImplementedError, match="momentum=None"):
        trace_call(ours, ours.forward, [x], {})
    ours.eval()
    got, _ = interpret_forward(ours, [x])  # eval reads the running statistics: fine
    np.testing.assert_allclose(got, x / np.sqrt(1 + 1e-5), rtol=1e-6)


def test_batchnorm_rejects_wrong_rank():
    ours = mnn.BatchNorm2d(2)
    with pytest.raises(ValueError, match="expected 4D input"):
        trace_call(ours, ours.forward, [np.zeros((3, 2), np.float32)], {})


def test_batchnorm_loads_a_torch_checkpoint_with_its_counter():
    theirs = torch.nn.BatchNorm2d(3)
    theirs.num_batches_tracked.fill_(7)
    theirs.running_mean.uniform_()
    ours = mnn.BatchNorm2d(3)
    ours.load_state_dict(theirs.state_dict())
    assert int(ours.state_dict()["num_batches_tracked"]) == 7
    np.testing.assert_array_equal(ours.running_mean.data, theirs.running_mean.numpy())


# ---------------------------------------------------------------------------- Dropout
def test_dropout_train_masks_and_scales_eval_is_identity(gpu_device):
    mn.manual_seed(0)
    ours = mnn.Dropout(0.25)
    x = f32(rng.uniform(1, 2, (64, 64)))
    y1, y2 = ours(x), ours(x)
    for y in (y1, y2):
        kept = y != 0
        np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-6)
        assert 0.2 < 1 - kept.mean() < 0.3  # 4096 draws: p within +-0.05 by a wide margin
    assert not np.array_equal(y1 != 0, y2 != 0)  # a fresh mask each call
    mn.manual_seed(0)
    np.testing.assert_array_equal(ours(x), y1)  # the same masks under the same seed
    ours.eval()
    np.testing.assert_array_equal(ours(x), x)


def test_dropout_eval_graph_has_no_seed():
    ours = mnn.Dropout(0.5).eval()
    traced = trace_call(ours, ours.forward, [np.ones((2, 3), np.float32)], {})
    assert traced.trace.seeds == []
    ours.train()
    traced = trace_call(ours, ours.forward, [np.ones((2, 3), np.float32)], {})
    assert len(traced.trace.seeds) == 1


@pytest.mark.parametrize("p", [-0.1, 1.5], ids=["negative", "above_one"])
def test_dropout_rejects_p(p):
    with pytest.raises(ValueError, match="between 0 and 1"):
        mnn.Dropout(p)


def test_batchnorm_under_the_trainer_counts_each_step_once(gpu_device):
    """The Trainer replays BatchNorm's on_run effect once per executed forward, so a training
    step counts once, as torch's train-mode call does."""
    from meganeura.optim import SGD
    from meganeura.training import Trainer

    theirs, ours = build("BatchNorm1d", (3,))
    trainer = Trainer(ours, SGD(lr=0.0), lambda m, x: F.sum(m(x)), device=gpu_device)
    for _ in range(2):
        x = f32(rng.standard_normal((4, 3)) + 2)
        trainer.step(x)
        _torch_train_call(theirs, x)
    _check_stats(ours, theirs, GPU_RTOL)
