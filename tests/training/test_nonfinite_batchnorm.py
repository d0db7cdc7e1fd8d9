"""A step the non-finite guard skips leaves BatchNorm's running statistics and
``num_batches_tracked`` as they were (issue 11 item 3; ``optim.guard.defer_update_stats``).

The running statistics used to be written by the forward, before the loss existed, so a NaN
batch made ``running_mean``/``running_var`` NaN (and every later eval output NaN) although the
guard kept the parameters. Compared bit for bit, as the parameters are in
``test_nonfinite_guard.py``: after a tripped step the running statistics and the counter are
the bits they had, and a run that skipped a bad batch is the bits of a run that never saw it.
"""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import BatchNorm1d, BatchNorm2d, Conv2d, Linear, Module
from meganeura.optim import SGD, AdamW
from meganeura.training import GraphTrainer, NonFiniteError, NonFiniteWarning, Trainer

pytestmark = pytest.mark.gpu

ROWS = 4
STATS = ("running_mean", "running_var", "num_batches_tracked")


class MLP(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(6, 5)
        self.bn = BatchNorm1d(5)
        self.fc2 = Linear(5, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class ConvNet(Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = Conv2d(2, 3, 3, padding=1)
        self.bn = BatchNorm2d(3)
        self.fc = Linear(3 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).reshape(x.shape[0], -1))


MODELS = {"mlp_bn1d": (MLP, (6,)), "conv_bn2d": (ConvNet, (2, 4, 4))}


def mse(model, x, t):
    return F.mse_loss(model(x), t)


def _batches(model: str, n: int, seed: int = 0, rows: int = ROWS):
    r = np.random.default_rng(seed)
    shape = MODELS[model][1]
    return [
        (
            r.standard_normal((rows, *shape)).astype(np.float32),
            r.standard_normal((rows, 3)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _poison(batch, value=np.nan):
    x, t = (a.copy() for a in batch)
    x.reshape(len(x), -1)[1, 2] = value
    return x, t


def _trainer(gpu_device, model: str, opt=None, **kw) -> Trainer:
    mn.manual_seed(0)
    return Trainer(MODELS[model][0](), opt or AdamW(lr=1e-2), mse, device=gpu_device, **kw)


def _bits(tr) -> dict[str, np.ndarray]:
    sd = tr.model.state_dict()  # not tr.state_dict(): that reads the guard's count first
    return {k: np.atleast_1d(np.asarray(v)).view(np.uint8).copy() for k, v in sd.items()}


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _stats(tr) -> dict[str, np.ndarray]:
    return {k: v for k, v in _bits(tr).items() if k.rsplit(".", 1)[-1] in STATS}


def _fast_context(gpu_device, precision: str):
    if precision == "fast" and "shader-f16" not in gpu_device.features:
        return pytest.warns(UserWarning)  # compiled strict: the same guarantees
    return _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("model", list(MODELS))
def test_raise_mode_keeps_running_statistics(gpu_device, model, precision):
    good = _batches(model, 3)
    with _fast_context(gpu_device, precision):
        tr = _trainer(gpu_device, model, precision=precision)
        ref = _trainer(gpu_device, model, precision=precision)
        tr.step(*good[0])
        ref.step(*good[0])
    before = _bits(tr)
    assert int(tr.model.bn.num_batches_tracked.data) == 1
    with pytest.raises(NonFiniteError, match=r"step 1: .*running statistics"):
        tr.step(*_poison(good[1]))
    _assert_same_bits(_bits(tr), before)  # running stats, counter and parameters
    # the next good step is the one of a run that never saw the bad batch
    assert tr.step(*good[2]) == ref.step(*good[2])
    _assert_same_bits(_bits(tr), _bits(ref))
    assert int(tr.model.bn.num_batches_tracked.data) == 2
    tr.model.eval()
    ref.model.eval()
    x = good[0][0]
    out = np.asarray(tr.model(x))
    assert np.isfinite(out).all()  # eval normalizes with the running statistics
    np.testing.assert_array_equal(out, np.asarray(ref.model(x)))


@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("model", list(MODELS))
def test_skip_mode_keeps_running_statistics(gpu_device, model, precision):
    good = _batches(model, 3)
    with _fast_context(gpu_device, precision):
        tr = _trainer(gpu_device, model, on_nonfinite="skip", precision=precision)
        ref = _trainer(gpu_device, model, precision=precision)
        tr.step(*good[0])
        ref.step(*good[0])
    before = _stats(tr)
    with pytest.warns(NonFiniteWarning, match="step 1"):
        tr.step(*_poison(good[1], np.inf))
    _assert_same_bits(_stats(tr), before)
    assert tr.step(*good[2]) == ref.step(*good[2])
    _assert_same_bits(_bits(tr), _bits(ref))


def test_unread_steps_take_back_the_counter(gpu_device):
    """Raise mode over unread steps: the guard is sticky, so the steps after the bad one are
    skipped too and the counter goes back to before the bad one. Skip mode: only the bad step
    is skipped; the counter counts the others."""
    good = _batches("mlp_bn1d", 3)
    tr = _trainer(gpu_device, "mlp_bn1d", SGD(lr=0.1, momentum=0.9))
    tr.step(*good[0])
    before = _bits(tr)
    tr.step(*_poison(good[1]), return_loss=False)
    tr.step(*good[2], return_loss=False)
    with pytest.raises(NonFiniteError, match=r"steps 2 ran after it"):
        tr.check_nonfinite()
    _assert_same_bits(_bits(tr), before)

    skip = _trainer(gpu_device, "mlp_bn1d", SGD(lr=0.1, momentum=0.9), on_nonfinite="skip")
    ref = _trainer(gpu_device, "mlp_bn1d", SGD(lr=0.1, momentum=0.9))
    for b in (good[0], _poison(good[1]), good[2]):
        skip.step(*b, return_loss=False)
    for b in (good[0], good[2]):
        ref.step(*b)
    with pytest.warns(NonFiniteWarning, match="1 of the steps 0-2"):
        skip.check_nonfinite()
    assert int(skip.model.bn.num_batches_tracked.data) == 2
    _assert_same_bits(_bits(skip), _bits(ref))


def _sequential_stats(bn_in: list[np.ndarray], mean, var, momentum=0.1):
    """torch's running statistics after one forward per micro-batch (float64)."""
    mean, var = mean.astype(np.float64), var.astype(np.float64)
    for h in bn_in:
        mean = (1 - momentum) * mean + momentum * h.mean(0)
        var = (1 - momentum) * var + momentum * h.var(0, ddof=1)
    return mean, var


def test_accumulated_step_updates_statistics_per_micro_batch(gpu_device):
    """With accumulation the micro-batches stage their updates in pending copies and the
    guarded last one commits them: the values are torch's, one update per forward."""
    (x, t), (x2, t2) = _batches("mlp_bn1d", 2, rows=6)
    tr = _trainer(gpu_device, "mlp_bn1d", accumulation_steps=3)
    bn, fc1 = tr.model.bn, tr.model.fc1
    for xs, ts in ((x, t), (x2, t2)):
        w, b = fc1.weight.data.astype(np.float64), fc1.bias.data.astype(np.float64)
        m0, v0 = bn.running_mean.data, bn.running_var.data
        count = int(bn.num_batches_tracked.data)
        tr.step(xs, ts)
        want = _sequential_stats([xs[i : i + 2] @ w.T + b for i in (0, 2, 4)], m0, v0)
        np.testing.assert_allclose(bn.running_mean.data, want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bn.running_var.data, want[1], rtol=1e-5, atol=1e-6)
        assert int(bn.num_batches_tracked.data) == count + 3


class TwiceNormed(Module):
    """One BatchNorm1d called twice per forward: two updates of the same statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(6, 3)
        self.bn = BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.bn(self.fc1(x)))


def test_a_module_called_twice_chains_its_staged_updates(gpu_device):
    (x, t), (x2, t2) = _batches("mlp_bn1d", 2, rows=6)
    mn.manual_seed(0)
    tr = Trainer(TwiceNormed(), AdamW(lr=1e-2), mse, device=gpu_device, accumulation_steps=2)
    bn, fc1 = tr.model.bn, tr.model.fc1
    for xs, ts in ((x, t), (x2, t2)):
        w, b = fc1.weight.data.astype(np.float64), fc1.bias.data.astype(np.float64)
        gamma, beta = bn.weight.data.astype(np.float64), bn.bias.data.astype(np.float64)
        m0, v0 = bn.running_mean.data, bn.running_var.data
        inputs = []
        for i in (0, 3):
            h = xs[i : i + 3] @ w.T + b
            y = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5) * gamma + beta
            inputs += [h, y]  # the two calls' inputs, in order
        tr.step(xs, ts)
        want = _sequential_stats(inputs, m0, v0)
        np.testing.assert_allclose(bn.running_mean.data, want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bn.running_var.data, want[1], rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked.data) == 8
    before = _bits(tr)
    bad = x.copy()
    bad[4, 1] = np.nan
    with pytest.raises(NonFiniteError):
        tr.step(bad, t)
    _assert_same_bits(_bits(tr), before)


@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("row", [0, 5], ids=["first_micro_batch", "last_micro_batch"])
def test_accumulated_step_skipped_keeps_every_micro_batch_statistics(gpu_device, row, precision):
    """A bad micro-batch, the first (whose program runs before the guard can decide) or the
    last (the guarded one): the running statistics and the counter are as before the step,
    and the next step is the one of a run that never saw the bad batch."""
    good = _batches("conv_bn2d", 3, rows=6)
    with _fast_context(gpu_device, precision):
        tr = _trainer(gpu_device, "conv_bn2d", accumulation_steps=3, precision=precision)
        ref = _trainer(gpu_device, "conv_bn2d", accumulation_steps=3, precision=precision)
        tr.step(*good[0])
        ref.step(*good[0])
    before = _bits(tr)
    x, t = good[1][0].copy(), good[1][1]
    x[row, 0, 1, 2] = np.nan
    with pytest.raises(NonFiniteError, match="step 1"):
        tr.step(x, t)
    _assert_same_bits(_bits(tr), before)
    assert tr.step(*good[2]) == ref.step(*good[2])
    _assert_same_bits(_bits(tr), _bits(ref))


def _bn_graph():
    b = GraphBuilder()
    x, t = b.input("x", (ROWS, 6)), b.input("t", (ROWS, 3))
    w = b.parameter("w", (6, 3))
    rm, rv = b.state("bn.running_mean", (3,)), b.state("bn.running_var", (3,))
    b.output("loss", F.mse_loss(F.batch_norm(x @ w, rm, rv, training=True), t))
    return b.build()


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_graph_trainer(gpu_device, mode):
    """A hand-built graph's running statistics (state leaves) are guarded as well."""
    good = _batches("mlp_bn1d", 3)
    w = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    tr = GraphTrainer(_bn_graph(), AdamW(lr=1e-2), device=gpu_device, on_nonfinite=mode)
    ref = GraphTrainer(_bn_graph(), AdamW(lr=1e-2), device=gpu_device)
    for g in (tr, ref):
        g.load_parameters({"w": w})
        g.step(dict(zip("xt", good[0])))
    before = tr.state_dict()
    bad = dict(zip("xt", _poison(good[1])))
    if mode == "raise":
        with pytest.raises(NonFiniteError, match="GraphTrainer step 1"):
            tr.step(bad)
    else:
        with pytest.warns(NonFiniteWarning):
            tr.step(bad)
    after = tr.state_dict()
    for k in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_array_equal(after[k].view(np.uint32), before[k].view(np.uint32))
    assert tr.step(dict(zip("xt", good[2]))) == ref.step(dict(zip("xt", good[2])))
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(tr.state_dict()[k].view(np.uint32), v.view(np.uint32))
