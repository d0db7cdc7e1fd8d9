"""The runs the distributed tests compare: shared by the MPI worker (``tests.distributed.
worker``) and the single-process reference in the test (``test_data_parallel``).

A tiny MLP (8-16-4) trained for ``STEPS`` steps on global batches of ``GLOBAL_BATCH`` rows;
each configuration's optimizer and clipping. Everything is drawn from fixed seeds so the
worker ranks and the reference see the same initial weights and batches.
"""

from __future__ import annotations

import numpy as np

import meganeura as mn
from meganeura.models.mlp import MLP
from meganeura.nn import functional as F
from meganeura.optim import SGD, AdamW

STEPS = 3
GLOBAL_BATCH = 12  # divisible by 2 and 3 ranks, and their shards by 2 micro-batches
SIZES = (8, 16, 4)

# name -> (optimizer factory, max_grad_norm, accumulation_steps per rank); the clipped runs
# clip (the global norm is ~0.5); with accumulation, one process on the whole batch uses
# accumulation_steps * ranks micro-batches (the same contiguous blocks of rows)
CONFIGS = {
    "sgd-momentum": (lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01), None, 1),
    "sgd-momentum-clip": (lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01), 0.05, 1),
    "adamw": (lambda: AdamW(lr=1e-2, weight_decay=0.01), None, 1),
    "adamw-clip": (lambda: AdamW(lr=1e-2, weight_decay=0.01), 0.05, 1),
    "adamw-clip-accumulate2": (lambda: AdamW(lr=1e-2, weight_decay=0.01), 0.05, 2),
}


def loss_fn(model, x, y):
    """Mean cross-entropy of the MLP's logits f32[N, 4] against classes y int[N]."""
    return F.cross_entropy(model(x), y)


# PyTorch DDP's bucket_cap_mb: ~210 bytes, so the overlapped runs reduce in 2 buckets, in the
# order backward finishes them: the loss with fc2's gradients (bucket 0, final while fc1's
# gradients are still being computed), then fc1's
BUCKET_CAP_MB = 2e-4


def dropout_loss_fn(model, x, y):
    """``loss_fn`` with dropout (p = 0.5) on the input: a seed input per step."""
    return F.cross_entropy(model(F.dropout(x, 0.5, True)), y)


def make_bn_model():
    """Linear(8, 16, bias=False) -> BatchNorm1d(16) -> ReLU -> Linear(16, 4): a forward that updates
    running statistics."""
    from meganeura import nn

    mn.manual_seed(1)
    # no bias before BatchNorm (as ResNet's convolutions): its gradient is rounding noise,
    # which Adam's m / sqrt(v) scales up to the learning rate
    return nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
    )


def make_model() -> MLP:
    mn.manual_seed(0)
    return MLP(SIZES)


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """``STEPS`` global batches (x f32[GLOBAL_BATCH, 8], y i32[GLOBAL_BATCH])."""
    rng = np.random.default_rng(7)
    return [
        (
            rng.standard_normal((GLOBAL_BATCH, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], GLOBAL_BATCH).astype(np.int32),
        )
        for _ in range(STEPS)
    ]
