"""BatchNorm1d/2d/3d, as torch.nn (``torch/nn/modules/batchnorm.py``): same arguments, defaults,
parameter and buffer names, so PyTorch state dicts load key for key.

Train mode normalizes with the batch statistics and updates ``running_mean`` /
``running_var`` on the GPU within the same program (``batch_norm_update_stats``); eval mode
normalizes with the running statistics. ``num_batches_tracked`` is an int64 host-only buffer
(PyTorch's dtype, so state dicts match): no kernel reads it, and each train-mode call adds 1
on the host after the program ran (``Trace.on_run``), as PyTorch's forward does.
"""

from __future__ import annotations

import numpy as np

from .. import functional as F
from ..module import Module
from ..parameter import Buffer
from ..tracing import current_trace
from .normalization import register_affine, reset_affine


class _BatchNorm(Module):
    """Batch normalization over [N, C, *] per channel (Ioffe & Szegedy, 2015):
    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, with the biased batch variance in
    train mode; the running variance is updated with the unbiased one, as PyTorch:
    ``running = (1 - momentum) * running + momentum * batch_stat``.

    Args:
        num_features: C.
        eps: added to the variance.
        momentum: the running-average factor; None (PyTorch's cumulative average) is accepted
            but raises NotImplementedError when a train-mode forward would update the
            statistics.
        affine: learn weight [C] (ones at init) and bias [C] (zeros).
        track_running_stats: keep running_mean [C] (zeros), running_var [C] (ones) and
            num_batches_tracked (int64 scalar); without them both modes use batch statistics.
        bias: keyword-only, as PyTorch 2.x: False drops the bias.
    """

    _ndims: tuple[int, ...] = ()

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = int(num_features), eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        c = (self.num_features,)
        register_affine(self, c, affine, bias, dtype)
        if track_running_stats:
            self.register_buffer("running_mean", Buffer(np.zeros(c, np.float32)))
            self.register_buffer("running_var", Buffer(np.ones(c, np.float32)))
            self.register_buffer(
                "num_batches_tracked", Buffer(np.array(0, np.int64), host_only=True)
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self._buffers["running_mean"].copy_(np.zeros(self.num_features, np.float32))
            self._buffers["running_var"].copy_(np.ones(self.num_features, np.float32))
            self._buffers["num_batches_tracked"].copy_(np.array(0, np.int64))

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        reset_affine(self)

    def _check_input_dim(self, input) -> None:  # noqa: A002
        if input.ndim not in self._ndims:
            want = " or ".join(f"{d}D" for d in self._ndims)
            raise ValueError(f"expected {want} input (got {input.ndim}D input)")

    def forward(self, input):  # noqa: A002 - PyTorch's name
        self._check_input_dim(input)
        update = self.training and self.track_running_stats
        if update:
            if self.momentum is None:
                raise NotImplementedError(
                    f"{type(self).__name__}(momentum=None): the cumulative moving average "
                    "needs a factor that changes every step, which is not supported; give a "
                    "momentum (PyTorch's default is 0.1), or call eval() to use the running "
                    "statistics"
                )
            counter = self._buffers["num_batches_tracked"]
            trace = current_trace()
            if counter is not None and trace is not None:
                trace.on_run(lambda: counter.copy_(counter.data + 1))
        # PyTorch's rule: batch statistics in train mode, and in eval mode without buffers.
        running_mean, running_var = self.running_mean, self.running_var
        batch_stats = self.training or (running_mean is None and running_var is None)
        if self.training and not self.track_running_stats:
            running_mean = running_var = None
        return F.batch_norm(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            batch_stats,
            0.0 if self.momentum is None else self.momentum,
            self.eps,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, bias={self._parameters['bias'] is not None}, "
            f"track_running_stats={self.track_running_stats}"
        )


class BatchNorm1d(_BatchNorm):
    """``torch.nn.BatchNorm1d``: input floating [N, C] or [N, C, L], output alike; statistics
    over N (and L). See ``_BatchNorm`` for the arguments.

    Raises:
        ValueError: another input rank, or one value per channel in train mode.
    """

    _ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """``torch.nn.BatchNorm2d``: input floating [N, C, H, W], output alike; statistics over
    (N, H, W). See ``_BatchNorm`` for the arguments.

    Raises:
        ValueError: another input rank, or one value per channel in train mode.
    """

    _ndims = (4,)


class BatchNorm3d(_BatchNorm):
    """``torch.nn.BatchNorm3d``: input floating [N, C, D, H, W], output alike."""

    _ndims = (5,)


__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]
