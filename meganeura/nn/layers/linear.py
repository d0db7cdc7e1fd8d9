"""Linear, Identity, Flatten (torch.nn names, arguments, defaults and initialization)."""

from __future__ import annotations

import math

from ...ops import functional as F
from .. import init
from ..module import Module
from ..parameter import Parameter


class Identity(Module):
    """Returns its input (``torch.nn.Identity``; arguments are accepted and ignored)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, input):  # noqa: A002
        return input


class Linear(Module):
    """``y = x @ weight.T + bias`` (``torch.nn.Linear``).

    Shapes: input [*, in_features] -> [*, out_features]; weight [out_features, in_features],
    bias [out_features].
    Initialization as PyTorch's ``reset_parameters``: weight by ``kaiming_uniform_(a=sqrt(5))``,
    i.e. U(-1/sqrt(in), 1/sqrt(in)), bias U(-1/sqrt(in), 1/sqrt(in)).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = Parameter(shape=(out_features, in_features), dtype=dtype)
        if bias:
            self.bias = Parameter(shape=(out_features,), dtype=dtype)
        else:
            self.register_parameter("bias", None)  # declared absent, as torch (repr, loading)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):  # noqa: A002
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self._parameters['bias'] is not None}"
        )


class Flatten(Module):
    """Flattens dims ``start_dim``..``end_dim`` (``torch.nn.Flatten``, default from dim 1)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input):  # noqa: A002
        return F.flatten(input, self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"
