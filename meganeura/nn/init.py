"""Parameter initialization, as ``torch.nn.init``: each function fills a Parameter (or Buffer)
in place on the host from the global generator (``meganeura.manual_seed``) or ``generator``.

Formulas and gains are PyTorch's (``torch/nn/init.py``; He et al. 2015 for kaiming, Glorot &
Bengio 2010 for xavier). Inside :func:`empty_weights` nothing is drawn: layers built there have
uninitialized parameters that must be loaded before the model runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np

from ..random import default_generator

_SKIP = [False]


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build layers without drawing their initial values (as ``accelerate.init_empty_weights``
    or the meta device): for a model whose weights are loaded next. Using such a model before
    ``load_state_dict`` raises ``UninitializedParameterError``."""
    _SKIP.append(True)
    try:
        yield
    finally:
        _SKIP.pop()


def skipping() -> bool:
    """True inside :func:`empty_weights`."""
    return _SKIP[-1]


def _fill(tensor, value_fn):
    if skipping():
        return tensor
    tensor.copy_(np.asarray(value_fn(tensor.shape), np.float64).astype(tensor.dtype.numpy))
    return tensor


def _gen(generator):
    return generator if generator is not None else default_generator()


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """``torch.nn.init.calculate_gain``."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "sigmoid", "conv_transpose2d"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity!r}")


def calculate_fan_in_and_fan_out(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of ``shape`` [out, in, *kernel] (PyTorch's convention).

    Raises:
        ValueError: fewer than 2 dimensions.
    """
    if len(shape) < 2:
        raise ValueError(f"fan in and fan out need at least 2 dimensions, got shape {shape}")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def uniform_(tensor, a: float = 0.0, b: float = 1.0, generator=None):
    """Fill from U(a, b)."""
    return _fill(tensor, lambda s: _gen(generator).uniform(a, b, s))


def normal_(tensor, mean: float = 0.0, std: float = 1.0, generator=None):
    """Fill from N(mean, std^2)."""
    return _fill(tensor, lambda s: _gen(generator).normal(mean, std, s))


def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """Fill from N(mean, std^2) truncated to [a, b] (by rejection)."""

    def draw(shape):
        g = _gen(generator)
        out = g.normal(mean, std, shape)
        bad = (out < a) | (out > b)
        while bad.any():
            out[bad] = g.normal(mean, std, int(bad.sum()))
            bad = (out < a) | (out > b)
        return out

    return _fill(tensor, draw)


def constant_(tensor, val: float):
    return _fill(tensor, lambda s: np.full(s, val))


def zeros_(tensor):
    return constant_(tensor, 0.0)


def ones_(tensor):
    return constant_(tensor, 1.0)


def _fan(shape, mode: str) -> int:
    fan_in, fan_out = calculate_fan_in_and_fan_out(shape)
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")
    return fan_in if mode == "fan_in" else fan_out


def kaiming_uniform_(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """U(-bound, bound) with bound = gain * sqrt(3 / fan)."""
    if skipping():
        return tensor
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / _fan(tensor.shape, mode))
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """N(0, std^2) with std = gain / sqrt(fan)."""
    if skipping():
        return tensor
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor.shape, mode))
    return normal_(tensor, 0.0, std, generator)


def xavier_uniform_(tensor, gain: float = 1.0, generator=None):
    if skipping():
        return tensor
    fan_in, fan_out = calculate_fan_in_and_fan_out(tensor.shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor, gain: float = 1.0, generator=None):
    if skipping():
        return tensor
    fan_in, fan_out = calculate_fan_in_and_fan_out(tensor.shape)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)
