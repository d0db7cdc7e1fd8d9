"""Op-database entries for the losses (``meganeura/ops/loss.py``).

Invariants of the samples: class counts 1, 7, 257 and 1000; every reduction (``mean``,
``sum``, ``none``); ignored rows (the default -100 and a real class used as ignore_index);
label smoothing with index and with probability targets; logits of magnitude up to 30 for
binary_cross_entropy_with_logits, where ``log(1 + exp(-|x|))`` without log1p would lose all
digits of the tail; l1_loss with exact ties (x == y), where torch's gradient is sign(0) = 0.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as TF

from meganeura.ops.loss import binary_cross_entropy_with_logits, cross_entropy, l1_loss

from . import OpInfo, Sample


def _labels(rng, n, c, ignored=()):
    t = rng.integers(0, c, n)
    for i in ignored:
        t[i] = -100
    return t


def _ce_samples(rng):
    out = []
    for n, c, red, ls, name in [
        (5, 7, "mean", 0.0, "mean"),
        (5, 7, "sum", 0.0, "sum"),
        (5, 7, "none", 0.0, "none"),
        (6, 7, "mean", 0.1, "smooth_mean"),
        (4, 257, "none", 0.2, "smooth_none_257"),
        (3, 1000, "sum", 0.05, "smooth_sum_1000"),
        (3, 1, "mean", 0.0, "one_class"),
    ]:
        x = rng.standard_normal((n, c)) * 3
        kw = {"reduction": red, "label_smoothing": ls}
        out.append(Sample((x, _labels(rng, n, c, (1,) if n > 3 else ())), kw, name))
    t = _labels(rng, 6, 7)
    t[:3] = 2
    x = rng.standard_normal((6, 7))
    out.append(Sample((x, t), {"ignore_index": 2, "label_smoothing": 0.3}, "ignore_class_2"))
    return out


def _ce_prob_samples(rng):
    out = []
    for n, c, red, ls, name in [
        (5, 7, "mean", 0.0, "mean"),
        (4, 257, "sum", 0.1, "smooth_sum_257"),
        (3, 1000, "none", 0.0, "none_1000"),
        (6, 3, "mean", 0.25, "smooth_mean"),
    ]:
        p = rng.random((n, c))
        p /= p.sum(axis=1, keepdims=True)
        x = rng.standard_normal((n, c)) * 3
        out.append(Sample((x, p), {"reduction": red, "label_smoothing": ls}, name))
    return out


def _l1_samples(rng):
    out = []
    for shape, red in [((7,), "mean"), ((3, 257), "sum"), ((1000,), "none"), ((1,), "mean")]:
        x, y = rng.standard_normal(shape), rng.standard_normal(shape)
        x.reshape(-1)[::3] = y.reshape(-1)[::3]  # exact ties
        out.append(Sample((x, y), {"reduction": red}, "x".join(map(str, shape)) + "_" + red))
    return out


def _bce_samples(rng):
    out = []
    for shape, red in [((7,), "mean"), ((3, 257), "sum"), ((1000,), "none"), ((2, 3, 5), "mean")]:
        x = rng.uniform(-30, 30, shape)
        t = rng.random(shape)
        t.reshape(-1)[::4] = np.round(t.reshape(-1)[::4])  # hard 0/1 labels too
        out.append(Sample((x, t), {"reduction": red}, "x".join(map(str, shape)) + "_" + red))
    x, t, w = rng.standard_normal((4, 5)), rng.random((4, 5)), rng.random(5)
    out.append(Sample((x, t, w), {"reduction": "mean"}, "weighted", grad=(0, 1)))
    return out


ENTRIES = [
    OpInfo(
        "cross_entropy",
        cross_entropy,
        TF.cross_entropy,
        _ce_samples,
        ("cross_entropy", "cross_entropy_backward"),
    ),
    OpInfo(
        "cross_entropy_probs",
        cross_entropy,
        TF.cross_entropy,
        _ce_prob_samples,
        ("log_softmax", "sum"),
    ),
    OpInfo("l1_loss", l1_loss, TF.l1_loss, _l1_samples, ("maximum", "sub")),
    OpInfo(
        "binary_cross_entropy_with_logits",
        binary_cross_entropy_with_logits,
        TF.binary_cross_entropy_with_logits,
        _bce_samples,
        ("binary_cross_entropy_with_logits",),
    ),
]
