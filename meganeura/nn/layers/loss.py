"""Loss modules, as ``torch.nn.modules.loss``: each holds its reduction (from ``reduction`` or
torch's deprecated ``size_average``/``reduce``) and its options, and calls the functional loss.

Class weights (``weight``, and ``pos_weight`` of BCEWithLogitsLoss) are buffers, as PyTorch
registers them, so a loss with weights has them in its state dict and they move to the GPU
with the model; a loss without weights has an empty state dict.
"""

from __future__ import annotations

from ...ops import loss as L
from ..module import Module


class _Loss(Module):
    """Base of the losses (torch's ``_Loss``): ``self.reduction``."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = L.legacy_reduction(size_average, reduce, reduction)


class _WeightedLoss(_Loss):
    """A loss with an optional per-class ``weight`` buffer (torch's ``_WeightedLoss``)."""

    def __init__(self, weight=None, size_average=None, reduce=None, reduction="mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)


class L1Loss(_Loss):
    """Mean absolute error (``torch.nn.L1Loss``): input and target of one shape."""

    def forward(self, input, target):  # noqa: A002 - PyTorch's names
        return L.l1_loss(input, target, reduction=self.reduction)


class MSELoss(_Loss):
    """Mean squared error (``torch.nn.MSELoss``): input and target of one shape."""

    def forward(self, input, target):  # noqa: A002
        return L.mse_loss(input, target, reduction=self.reduction)


class NLLLoss(_WeightedLoss):
    """Negative log-likelihood of log-probabilities (``torch.nn.NLLLoss``).

    Shapes: input [N, C] (or [N, C, d1, ...], unbatched [C]), target i32 [N] (or
    [N, d1, ...], []). See ``F.nll_loss``: with every target ignored the mean is 0.
    """

    def __init__(
        self,
        weight=None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
    ) -> None:
        super().__init__(weight, size_average, reduce, reduction)
        self.ignore_index = ignore_index

    def forward(self, input, target):  # noqa: A002
        return L.nll_loss(
            input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction
        )


class CrossEntropyLoss(_WeightedLoss):
    """Cross-entropy of logits (``torch.nn.CrossEntropyLoss``): class indices or class
    probabilities, ``weight``, ``ignore_index`` and ``label_smoothing`` as ``F.cross_entropy``
    (with every target ignored the mean is 0, where torch gives NaN).

    Shapes: input [N, C] (or [N, C, d1, ...], unbatched [C]); target i32 [N] ([N, d1, ...],
    []) or probabilities shaped like input.
    """

    def __init__(
        self,
        weight=None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(weight, size_average, reduce, reduction)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, input, target):  # noqa: A002
        return L.cross_entropy(
            input,
            target,
            self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


class BCELoss(_WeightedLoss):
    """Binary cross-entropy of probabilities (``torch.nn.BCELoss``; logs clamped at -100)."""

    def forward(self, input, target):  # noqa: A002
        return L.binary_cross_entropy(input, target, self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
    """Binary cross-entropy on logits (``torch.nn.BCEWithLogitsLoss``): ``weight`` broadcasts
    over the input, ``pos_weight`` along its last dim (both buffers)."""

    def __init__(
        self,
        weight=None,
        size_average=None,
        reduce=None,
        reduction: str = "mean",
        pos_weight=None,
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input, target):  # noqa: A002
        return L.binary_cross_entropy_with_logits(
            input, target, self.weight, reduction=self.reduction, pos_weight=self.pos_weight
        )


class KLDivLoss(_Loss):
    """Kullback-Leibler divergence (``torch.nn.KLDivLoss``): input log-probabilities, target
    probabilities (log-probabilities with ``log_target``); ``reduction="batchmean"`` gives the
    mathematical KL per sample."""

    def __init__(
        self, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self.log_target = log_target

    def forward(self, input, target):  # noqa: A002
        return L.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)


class HuberLoss(_Loss):
    """Huber loss (``torch.nn.HuberLoss``): quadratic below ``delta``, linear above."""

    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(reduction=reduction)
        self.delta = delta

    def forward(self, input, target):  # noqa: A002
        return L.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class SmoothL1Loss(_Loss):
    """Smooth L1 loss (``torch.nn.SmoothL1Loss``): ``HuberLoss / beta`` for beta > 0."""

    def __init__(
        self, size_average=None, reduce=None, reduction: str = "mean", beta: float = 1.0
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self.beta = beta

    def forward(self, input, target):  # noqa: A002
        return L.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


__all__ = [
    "BCELoss",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "HuberLoss",
    "KLDivLoss",
    "L1Loss",
    "MSELoss",
    "NLLLoss",
    "SmoothL1Loss",
]
