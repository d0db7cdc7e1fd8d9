"""Activations as modules, as torch.nn: each wraps one op of ``meganeura.nn.functional`` (or a
short composite of them) with PyTorch's class name, constructor arguments and ``extra_repr``.

Every activation is elementwise over any shape and keeps the input's floating dtype, except
Softmax / LogSoftmax / Softmin / GLU, which work along ``dim``. ``inplace`` is accepted for
PyTorch compatibility and ignored: a traced graph has no in-place ops (results are the same).
Formulas are PyTorch's (torch.nn docs); composites use ``clamp`` on the unselected branch so
its gradient never multiplies 0 by an overflowed exp.
"""

from __future__ import annotations

import warnings

from ...ops.functional import normalize_dim
from .. import functional as F
from .. import init
from ..module import Module
from ..parameter import Parameter


def _inplace(inplace: bool, lead: str = "") -> str:
    return f"{lead}inplace=True" if inplace else ""


class _Inplace(Module):
    """An activation whose only argument is PyTorch's (ignored) ``inplace``."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def extra_repr(self) -> str:
        return _inplace(self.inplace)


class ReLU(_Inplace):
    """``max(x, 0)`` (``torch.nn.ReLU``)."""

    def forward(self, input):  # noqa: A002 - PyTorch's name
        return F.relu(input)


class Hardtanh(Module):
    """``clamp(x, min_val, max_val)`` (``torch.nn.Hardtanh``). The gradient passes at the
    bounds themselves (``clamp``'s rule); PyTorch's ``hardtanh_backward`` is 0 there."""

    def __init__(
        self,
        min_val: float = -1.0,
        max_val: float = 1.0,
        inplace: bool = False,
        min_value: float | None = None,
        max_value: float | None = None,
    ) -> None:
        super().__init__()
        for old, new in (("min_value", min_value), ("max_value", max_value)):
            if new is not None:  # PyTorch's deprecated spellings
                warnings.warn(f"{old} is deprecated; use {old[:7]}", FutureWarning, stacklevel=2)
        min_val = min_val if min_value is None else min_value
        max_val = max_val if max_value is None else max_value
        if max_val <= min_val:
            raise ValueError(f"Hardtanh: max_val {max_val} must be greater than min_val {min_val}")
        self.min_val, self.max_val, self.inplace = min_val, max_val, inplace

    def forward(self, input):  # noqa: A002
        return F.clamp(input, self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}{_inplace(self.inplace, ', ')}"


class ReLU6(Hardtanh):
    """``min(max(x, 0), 6)`` (``torch.nn.ReLU6``)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__(0.0, 6.0, inplace)

    def extra_repr(self) -> str:
        return _inplace(self.inplace)


class LeakyReLU(Module):
    """``x`` for ``x > 0``, else ``negative_slope * x`` (``torch.nn.LeakyReLU``)."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, input):  # noqa: A002
        return F.leaky_relu(input, self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}{_inplace(self.inplace, ', ')}"


class PReLU(Module):
    """``x`` for ``x > 0``, else ``weight * x`` with a learned slope (``torch.nn.PReLU``).

    Shapes: weight [num_parameters], initialized to ``init``; with ``num_parameters > 1`` the
    input is [N, C, *] with C == num_parameters and the slope is per channel (dim 1).
    """

    def __init__(self, num_parameters: int = 1, init: float = 0.25, dtype=None) -> None:
        super().__init__()
        self.num_parameters, self.init = int(num_parameters), init
        self.weight = Parameter(shape=(self.num_parameters,), dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.constant_(self.weight, self.init)

    def forward(self, input):  # noqa: A002
        w = self.weight
        if self.num_parameters > 1:
            if input.ndim < 2 or input.shape[1] != self.num_parameters:
                raise ValueError(
                    f"PReLU({self.num_parameters}) needs an input [N, {self.num_parameters}, *], "
                    f"got {input!r}"
                )
            w = F.reshape(w, (self.num_parameters,) + (1,) * (input.ndim - 2))
        return F.where(input > 0.0, input, input * w)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


class ELU(Module):
    """``x`` for ``x > 0``, else ``alpha * (exp(x) - 1)`` (``torch.nn.ELU``; Clevert et al.
    2015)."""

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, input):  # noqa: A002
        return _elu(input, self.alpha, 1.0)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}{_inplace(self.inplace, ', ')}"


def _elu(x, alpha: float, input_scale: float):
    neg = F.expm1(F.clamp(x, max=0.0) * input_scale) * alpha
    return F.where(x > 0.0, x, neg)


class CELU(Module):
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))`` (``torch.nn.CELU``; Barron 2017)."""

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}{_inplace(self.inplace, ', ')}"

    def forward(self, input):  # noqa: A002
        return _elu(input, self.alpha, 1.0 / self.alpha)


class SELU(_Inplace):
    """``scale * elu(x, alpha)`` with Klambauer et al.'s (2017) constants (``torch.nn.SELU``)."""

    ALPHA = 1.6732632423543772848170429916717
    SCALE = 1.0507009873554804934193349852946

    def forward(self, input):  # noqa: A002
        return _elu(input, self.ALPHA, 1.0) * self.SCALE


class GELU(Module):
    """Gaussian error linear unit (``torch.nn.GELU``; Hendrycks & Gimpel 2016):
    ``x * Phi(x)``, or with ``approximate='tanh'``
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, input):  # noqa: A002
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(_Inplace):
    """``x * sigmoid(x)`` (``torch.nn.SiLU``, a.k.a. swish)."""

    def forward(self, input):  # noqa: A002
        return F.silu(input)


class Mish(_Inplace):
    """``x * tanh(softplus(x))`` (``torch.nn.Mish``; Misra 2019)."""

    def forward(self, input):  # noqa: A002
        return input * F.tanh(F.softplus(input))


class Hardsigmoid(_Inplace):
    """``clamp(x / 6 + 1/2, 0, 1)`` (``torch.nn.Hardsigmoid``); the gradient passes at
    ``x = +-3`` (PyTorch: 0 there)."""

    def forward(self, input):  # noqa: A002
        return _hardsigmoid(input)

    def extra_repr(self) -> str:
        return ""


class Hardswish(_Inplace):
    """``x * hardsigmoid(x)`` (``torch.nn.Hardswish``; Howard et al. 2019); the gradient
    passes at ``x = +-3`` (PyTorch's ``hardswish_backward`` is 0 at -3)."""

    def forward(self, input):  # noqa: A002
        return input * _hardsigmoid(input)

    def extra_repr(self) -> str:
        return ""


def _hardsigmoid(x):
    return F.clamp(x / 6.0 + 0.5, 0.0, 1.0)


class Tanh(Module):
    """``tanh(x)`` (``torch.nn.Tanh``)."""

    def forward(self, input):  # noqa: A002
        return F.tanh(input)


class Sigmoid(Module):
    """``1 / (1 + exp(-x))`` (``torch.nn.Sigmoid``)."""

    def forward(self, input):  # noqa: A002
        return F.sigmoid(input)


class Softplus(Module):
    """``log(1 + exp(beta x)) / beta``, and ``x`` where ``beta x > threshold``
    (``torch.nn.Softplus``)."""

    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, input):  # noqa: A002
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"


class Softsign(Module):
    """``x / (1 + |x|)`` (``torch.nn.Softsign``)."""

    def forward(self, input):  # noqa: A002
        return input / (F.abs(input) + 1.0)


class LogSigmoid(Module):
    """``log(sigmoid(x)) = -softplus(-x)`` (``torch.nn.LogSigmoid``), stable for large |x|."""

    def forward(self, input):  # noqa: A002
        return -F.softplus(-input)


class Tanhshrink(Module):
    """``x - tanh(x)`` (``torch.nn.Tanhshrink``)."""

    def forward(self, input):  # noqa: A002
        return input - F.tanh(input)


def _softmax_dim(name: str, dim: int | None, ndim: int) -> int:
    if dim is not None:
        return dim
    # PyTorch's legacy choice for dim=None (torch.nn.functional._get_softmax_dim), with its warning.
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. "
        "Change the call to include dim=X as an argument.",
        stacklevel=4,
    )
    return 0 if ndim in (0, 1, 3) else 1


class _AlongDim(Module):
    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Softmax(_AlongDim):
    """``exp(x) / sum(exp(x), dim)`` along ``dim`` (``torch.nn.Softmax``); ``dim=None`` picks
    PyTorch's legacy dim (0 for 0/1/3-d input, else 1) with its deprecation warning."""

    def forward(self, input):  # noqa: A002
        return F.softmax(input, _softmax_dim("softmax", self.dim, input.ndim))


class Softmin(_AlongDim):
    """``softmax(-x, dim)`` (``torch.nn.Softmin``)."""

    def forward(self, input):  # noqa: A002
        return F.softmax(-input, _softmax_dim("softmin", self.dim, input.ndim))


class LogSoftmax(_AlongDim):
    """``x - logsumexp(x, dim)`` (``torch.nn.LogSoftmax``)."""

    def forward(self, input):  # noqa: A002
        return F.log_softmax(input, _softmax_dim("log_softmax", self.dim, input.ndim))


class GLU(_AlongDim):
    """Gated linear unit ``a * sigmoid(b)`` where ``a, b`` are the halves of the input along
    ``dim`` (``torch.nn.GLU``; Dauphin et al. 2017): [*, 2n, *] -> [*, n, *]."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__(dim)

    def forward(self, input):  # noqa: A002
        d = normalize_dim(self.dim, input.ndim) if input.ndim else 0
        if input.ndim == 0 or input.shape[d] % 2:
            raise ValueError(f"GLU: halving dim {self.dim} needs an even size, got {input!r}")
        a, b = F.chunk(input, 2, d)
        return a * F.sigmoid(b)


__all__ = [
    "CELU",
    "ELU",
    "GELU",
    "GLU",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "LeakyReLU",
    "LogSigmoid",
    "LogSoftmax",
    "Mish",
    "PReLU",
    "ReLU",
    "ReLU6",
    "SELU",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softmin",
    "Softplus",
    "Softsign",
    "Tanh",
    "Tanhshrink",
]
