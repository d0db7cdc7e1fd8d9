"""Dropout, as ``torch.nn.Dropout``: a fresh mask every call in train mode, identity in eval."""

from __future__ import annotations

from .. import functional as F
from ..module import Module


class Dropout(Module):
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)`` in train
    mode; identity in eval mode (``torch.nn.Dropout``; Srivastava et al., JMLR 2014).

    Shapes: any floating input, output alike. Each dropout site of a traced forward gets its
    own u32 seed input, fed a new value from the global generator (``meganeura.manual_seed``)
    on every compiled call, so masks are reproducible under a seed but not PyTorch's masks.
    ``inplace`` is accepted and ignored (a graph has no in-place ops).

    Raises:
        ValueError: ``p`` outside [0, 1].
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input):  # noqa: A002 - PyTorch's name
        return F.dropout(input, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


__all__ = ["Dropout"]
