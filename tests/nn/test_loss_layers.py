"""Loss modules (``meganeura/nn/layers/loss.py``) against torch.nn's: the same constructor
arguments give the same state-dict layout (class weights are buffers), ``reduction`` (legacy
flags included) and repr, and the same loss: float64 on the NumPy interpreter and f32 on the
GPU through compile-on-call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura.nn as mnn

from .harness import check_state_dict_layout, interpret_forward, rel_err, to_torch

pytestmark = pytest.mark.filterwarnings("ignore:.*(size_average|reduce).*:UserWarning")
_rng = np.random.default_rng(5)
LOGITS = _rng.standard_normal((6, 4)).astype(np.float32) * 2
LABELS = np.array([0, 3, -100, 1, 2, 3], np.int64)
LOGITS_K = _rng.standard_normal((2, 4, 3)).astype(np.float32)
LABELS_K = _rng.integers(0, 4, (2, 3))
W4 = _rng.uniform(0.3, 2.0, 4).astype(np.float32)
PRED = _rng.standard_normal((3, 4)).astype(np.float32)
TARGET = _rng.standard_normal((3, 4)).astype(np.float32)
PROB = _rng.uniform(0.05, 0.95, (3, 4)).astype(np.float32)
HARD = (_rng.random((3, 4)) < 0.5).astype(np.float32)
LOGP = np.log(PROB / PROB.sum(1, keepdims=True)).astype(np.float32)

# id -> (class name, constructor kwargs with NumPy weights, inputs)
CASES = {
    "cross_entropy": ("CrossEntropyLoss", {}, (LOGITS, LABELS)),
    "cross_entropy_weight_smoothing": (
        "CrossEntropyLoss",
        {"weight": W4, "label_smoothing": 0.1, "ignore_index": 3},
        (LOGITS, np.where(LABELS < 0, 2, LABELS)),
    ),
    "cross_entropy_kdim_none": ("CrossEntropyLoss", {"reduction": "none"}, (LOGITS_K, LABELS_K)),
    "cross_entropy_probs": ("CrossEntropyLoss", {"reduction": "sum"}, (PRED, PROB)),
    "nll_weight": ("NLLLoss", {"weight": W4}, (LOGITS, LABELS)),
    "nll_legacy_sum": ("NLLLoss", {"size_average": False}, (LOGITS, LABELS)),
    "mse": ("MSELoss", {}, (PRED, TARGET)),
    "mse_none": ("MSELoss", {"reduction": "none"}, (PRED, TARGET)),
    "l1_legacy_none": ("L1Loss", {"reduce": False}, (PRED, TARGET)),
    "bce": ("BCELoss", {"weight": W4}, (PROB, HARD)),
    "bce_with_logits": ("BCEWithLogitsLoss", {}, (PRED, HARD)),
    "bce_with_logits_weights": (
        "BCEWithLogitsLoss",
        {"weight": W4, "pos_weight": W4[::-1].copy(), "reduction": "sum"},
        (PRED, PROB),
    ),
    "smooth_l1": ("SmoothL1Loss", {"beta": 0.5}, (PRED, TARGET)),
    "huber": ("HuberLoss", {"delta": 1.5, "reduction": "sum"}, (PRED, TARGET)),
    "kl_div_batchmean": ("KLDivLoss", {"reduction": "batchmean"}, (LOGP, PROB)),
    "kl_div_log_target": ("KLDivLoss", {"log_target": True, "reduction": "sum"}, (LOGP, LOGP)),
}


def _build(name, kwargs):
    theirs = getattr(torch.nn, name)(
        **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    )
    ours = getattr(mnn, name)(**kwargs)
    return theirs, ours


def _torch_loss(theirs, inputs):
    theirs.double()
    return theirs(*[to_torch(a) for a in inputs]).detach().numpy()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_layout_reduction_and_repr_match_torch(case):
    name, kwargs, _ = case
    theirs, ours = _build(name, kwargs)
    check_state_dict_layout(theirs, ours)
    assert ours.reduction == theirs.reduction
    assert repr(ours) == repr(theirs)
    for k, v in theirs.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.numpy())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_loss_on_the_interpreter_matches_torch(case):
    name, kwargs, inputs = case
    theirs, ours = _build(name, kwargs)
    got, _ = interpret_forward(ours, inputs)
    assert rel_err(got, _torch_loss(theirs, inputs)) <= 1e-10


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_loss_on_the_gpu_matches_torch(gpu_device, case):
    name, kwargs, inputs = case
    theirs, ours = _build(name, kwargs)
    assert rel_err(ours(*inputs), _torch_loss(theirs, inputs)) <= 2e-6


def test_loss_modules_export_and_a_model_trains_through_one():
    class Net(mnn.Module):
        def __init__(self):
            super().__init__()
            self.fc = mnn.Linear(4, 4)
            self.loss = mnn.CrossEntropyLoss(weight=W4)

        def forward(self, x, y):
            return self.loss(self.fc(x), y)

    net = Net()
    assert list(net.state_dict()) == ["fc.weight", "fc.bias", "loss.weight"]
    tnet = torch.nn.Sequential(torch.nn.Linear(4, 4))
    tnet[0].load_state_dict({"weight": torch.from_numpy(net.fc.weight.numpy()),
                             "bias": torch.from_numpy(net.fc.bias.numpy())})  # fmt: skip
    loss = torch.nn.CrossEntropyLoss(weight=torch.from_numpy(W4).double())
    want = loss(tnet.double()(to_torch(LOGITS)), to_torch(LABELS)).item()
    got, _ = interpret_forward(net, (LOGITS, LABELS))
    assert abs(float(got) - want) <= 1e-6 * abs(want)
