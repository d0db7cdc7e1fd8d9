"""Embedding, as ``torch.nn.Embedding`` (PyTorch keeps it in ``torch/nn/modules/sparse.py``)."""

from __future__ import annotations

import numpy as np

from ...graph.builder import Tensor
from .. import functional as F
from .. import init
from ..creation import tensor
from ..module import Module
from ..parameter import Parameter


class Embedding(Module):
    """A lookup table: ``out[..., :] = weight[input[...], :]`` (``torch.nn.Embedding``).

    Shapes: input i32/u32 of any shape (int64 arrays are fed as int32; a NumPy array given
    inside a traced forward, such as positions, is a constant) -> float [*input, E];
    weight [num_embeddings, embedding_dim]. Initialization as PyTorch's ``reset_parameters``:
    weight from N(0, 1), then the ``padding_idx`` row set to zero.

    ``padding_idx``: as in PyTorch, positions holding it read the row but give it no gradient
    (the row stays whatever it was loaded or initialized to). The lookup is the same
    ``index_select``; its result passes through a ``where`` that routes the padding positions
    through ``stop_gradient``, so values are exact and only the gradient is masked.

    Args:
        num_embeddings, embedding_dim: the table's size.
        padding_idx: a row in ``[-num_embeddings, num_embeddings)`` (negative counts from the
            end, stored normalized as PyTorch does), or None.
        max_norm, scale_grad_by_freq: must be None / False (PyTorch renormalizes rows in place
            and rescales gradients by batch frequency; neither is supported).
        norm_type: accepted (only read with ``max_norm``).
        sparse: accepted; gradients are dense (the values are the same).
        _weight: an initial table [num_embeddings, embedding_dim] (``from_pretrained``).
        _freeze: ``requires_grad=False`` on the weight.

    Raises:
        ValueError: ``padding_idx`` out of range or ``_weight`` of another shape.
        NotImplementedError: ``max_norm`` or ``scale_grad_by_freq``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight=None,
        _freeze: bool = False,
        dtype=None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(
                    f"padding_idx {padding_idx} must be within num_embeddings "
                    f"({self.num_embeddings})"
                )
            padding_idx = int(padding_idx) % self.num_embeddings
        if max_norm is not None:
            raise NotImplementedError("Embedding(max_norm=...) is not supported")
        if scale_grad_by_freq:
            raise NotImplementedError("Embedding(scale_grad_by_freq=True) is not supported")
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        shape = (self.num_embeddings, self.embedding_dim)
        if _weight is None:
            self.weight = Parameter(shape=shape, dtype=dtype, requires_grad=not _freeze)
            self.reset_parameters()
        else:
            w = Parameter(_weight, requires_grad=not _freeze)
            if w.shape != shape:
                raise ValueError(
                    f"_weight has shape {w.shape}, not (num_embeddings, embedding_dim) = {shape}"
                )
            self.weight = w

    @classmethod
    def from_pretrained(
        cls,
        embeddings,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> Embedding:
        """An Embedding holding ``embeddings`` [V, E] (frozen unless ``freeze=False``).

        Raises:
            ValueError: ``embeddings`` is not 2-D.
        """
        arr = np.asarray(embeddings)
        if arr.ndim != 2:
            raise ValueError(f"embeddings must be 2-dimensional, got shape {arr.shape}")
        return cls(
            arr.shape[0],
            arr.shape[1],
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight=arr,
            _freeze=freeze,
        )

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None and self.weight.is_initialized:
            w = self.weight.numpy()
            w[self.padding_idx] = 0
            self.weight.copy_(w)

    def forward(self, input):  # noqa: A002 - PyTorch's name
        if not isinstance(input, Tensor):  # ids written in forward (positions): a constant
            input = tensor(input)
        out = F.embedding(input, self.weight)
        if self.padding_idx is None:
            return out
        pad = F.unsqueeze(F.eq(input, self.padding_idx), -1)
        return F.where(pad, F.stop_gradient(out), out)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.sparse:
            s += ", sparse=True"
        return s


__all__ = ["Embedding"]
