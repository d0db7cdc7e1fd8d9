"""Transformer layers, as ``torch.nn.modules.transformer``: TransformerEncoderLayer,
TransformerEncoder, TransformerDecoderLayer, TransformerDecoder and Transformer, with
PyTorch's arguments, defaults, submodule names (so state dicts load from torch's) and
forward arguments, built on ``MultiheadAttention``.

The computation is PyTorch's reference path (``_sa_block``, ``_mha_block``, ``_ff_block``,
post-norm or ``norm_first``); masks are passed to MultiheadAttention as given (bool masks,
True = not allowed, become -inf there; float masks are added). PyTorch's inference fast
paths compute the same values, except that its nested-tensor path of TransformerEncoder
(eval, ``src_key_padding_mask`` given, ``enable_nested_tensor``) returns 0 at padded
positions, where this (like torch's training path) returns the layer's output there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from ...ops.activation import gelu
from ...ops.functional import relu
from .. import init
from ..module import Module
from .attention import MultiheadAttention
from .containers import ModuleList
from .dropout import Dropout
from .linear import Linear
from .normalization import LayerNorm


def _activation(activation: str | Callable) -> Callable:
    if callable(activation):
        return activation
    if activation == "relu":
        return relu
    if activation == "gelu":
        return gelu
    raise RuntimeError(f"activation should be relu/gelu, not {activation}")


def generate_square_subsequent_mask(sz: int, dtype=np.float32) -> np.ndarray:
    """The causal float mask [sz, sz]: 0 on and below the diagonal, -inf above
    (``nn.Transformer.generate_square_subsequent_mask``); a NumPy array, a constant of the
    program when used inside a traced forward."""
    return np.triu(np.full((sz, sz), -np.inf, dtype), 1)


def _detect_is_causal_mask(mask, is_causal: bool | None, size: int | None) -> bool:
    """torch's ``_detect_is_causal_mask``: the hint, or whether a mask known on the host
    (a NumPy array) is the causal one; a traced mask's values are unknown, so False."""
    if is_causal is not None or mask is None:
        return bool(is_causal)
    if isinstance(mask, np.ndarray):
        sz = size if size is not None else mask.shape[-2]
        causal = generate_square_subsequent_mask(sz)
        return mask.shape == causal.shape and bool(np.array_equal(mask, causal))
    return False


class TransformerEncoderLayer(Module):
    """Self-attention and a feed-forward block, each with a residual connection and
    LayerNorm (``torch.nn.TransformerEncoderLayer``; Vaswani et al. 2017).

    Shapes: src [S, N, E] ([N, S, E] with ``batch_first``, [S, E] unbatched); output alike.
    Submodules: ``self_attn``, ``linear1``, ``dropout``, ``linear2``, ``norm1``, ``norm2``,
    ``dropout1``, ``dropout2``.

    Args:
        d_model, nhead: E and the number of heads.
        dim_feedforward: the hidden width of the feed-forward block.
        dropout: on the attention weights, the feed-forward hidden layer and both residual
            branches (train mode).
        activation: ``"relu"``, ``"gelu"`` or a callable (``F.gelu``).
        layer_norm_eps, batch_first, bias: as torch.
        norm_first: pre-norm (LayerNorm before each block) instead of post-norm.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        dtype=None,
    ) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, dtype=dtype
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, dtype=dtype)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        """Args:
        src: the sequence, as in the class docstring.
        src_mask: [S, S] or [N * H, S, S]; bool (True = not allowed) or float (added).
        src_key_padding_mask: [N, S] ([S] unbatched); bool (True = padding) or float.
        is_causal: a hint that ``src_mask`` is the causal mask (it must be given, as torch).
        """
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(
            x,
            x,
            x,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            is_causal=is_causal,
        )[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerDecoderLayer(Module):
    """Self-attention, attention over ``memory`` and a feed-forward block, each with a
    residual connection and LayerNorm (``torch.nn.TransformerDecoderLayer``).

    Shapes: tgt [T, N, E], memory [S, N, E] (batch first with ``batch_first``; unbatched
    [T, E], [S, E]). Submodules as torch: ``self_attn``, ``multihead_attn``, ``linear1``,
    ``dropout``, ``linear2``, ``norm1``-``norm3``, ``dropout1``-``dropout3``. Arguments as
    :class:`TransformerEncoderLayer`.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"dropout": dropout, "batch_first": batch_first, "bias": bias, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, **kw)
        self.multihead_attn = MultiheadAttention(d_model, nhead, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, dtype=dtype)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.activation = _activation(activation)

    def forward(
        self,
        tgt,
        memory,
        tgt_mask=None,
        memory_mask=None,
        tgt_key_padding_mask=None,
        memory_key_padding_mask=None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ):
        """Masks as :meth:`TransformerEncoderLayer.forward`: ``tgt_mask`` [T, T],
        ``memory_mask`` [T, S], key padding masks [N, T] and [N, S]."""
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(
                self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal
            )
            return x + self._ff_block(self.norm3(x))
        x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(
            x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal)
        )
        return self.norm3(x + self._ff_block(x))

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(
            x,
            x,
            x,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            need_weights=False,
        )[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal):
        x = self.multihead_attn(
            x,
            mem,
            mem,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            need_weights=False,
        )[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))


def _seq_len(x, batch_first: bool) -> int:
    return x.shape[0] if x.ndim == 2 else x.shape[1 if batch_first else 0]


class TransformerEncoder(Module):
    """``num_layers`` copies of ``encoder_layer`` (``layers.0`` ...), then ``norm``
    (``torch.nn.TransformerEncoder``). ``enable_nested_tensor`` and ``mask_check`` are
    accepted for torch's signature; there is no nested-tensor path."""

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer,
        num_layers: int,
        norm: Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool | None = None):
        """``mask``, ``src_key_padding_mask`` and ``is_causal`` as the layer's ``src_mask``,
        ``src_key_padding_mask`` and ``is_causal``; ``is_causal=None`` detects a causal NumPy
        mask, as torch's ``_detect_is_causal_mask``."""
        first = self.layers[0] if len(self.layers) else None
        batch_first = first.self_attn.batch_first if first is not None else False
        is_causal = _detect_is_causal_mask(mask, is_causal, _seq_len(src, batch_first))
        out = src
        for mod in self.layers:
            out = mod(
                out, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask
            )
        return out if self.norm is None else self.norm(out)


class TransformerDecoder(Module):
    """``num_layers`` copies of ``decoder_layer``, then ``norm``
    (``torch.nn.TransformerDecoder``)."""

    def __init__(
        self, decoder_layer: TransformerDecoderLayer, num_layers: int, norm: Module | None = None
    ) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self,
        tgt,
        memory,
        tgt_mask=None,
        memory_mask=None,
        tgt_key_padding_mask=None,
        memory_key_padding_mask=None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ):
        """Arguments as :meth:`TransformerDecoderLayer.forward`; ``tgt_is_causal=None``
        detects a causal NumPy ``tgt_mask``."""
        first = self.layers[0] if len(self.layers) else None
        batch_first = first.self_attn.batch_first if first is not None else False
        tgt_is_causal = _detect_is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(tgt, batch_first))
        out = tgt
        for mod in self.layers:
            out = mod(
                out,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=tgt_is_causal,
                memory_is_causal=memory_is_causal,
            )
        return out if self.norm is None else self.norm(out)


class Transformer(Module):
    """Encoder-decoder transformer (``torch.nn.Transformer``): ``encoder`` and ``decoder``
    stacks with final LayerNorms, every parameter of two or more dims initialized by
    ``xavier_uniform_`` as torch's ``_reset_parameters``.

    Shapes: src [S, N, E], tgt [T, N, E] (batch first with ``batch_first``); output like tgt.
    """

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable = "relu",
        custom_encoder: Module | None = None,
        custom_decoder: Module | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation=activation,
            layer_norm_eps=layer_norm_eps,
            batch_first=batch_first,
            norm_first=norm_first,
            bias=bias,
            dtype=dtype,
        )
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            layer = TransformerEncoderLayer(d_model, nhead, **kw)
            norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
            self.encoder = TransformerEncoder(layer, num_encoder_layers, norm)
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            layer = TransformerDecoderLayer(d_model, nhead, **kw)
            norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
            self.decoder = TransformerDecoder(layer, num_decoder_layers, norm)
        self._reset_parameters()
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)

    def forward(
        self,
        src,
        tgt,
        src_mask=None,
        tgt_mask=None,
        memory_mask=None,
        src_key_padding_mask=None,
        tgt_key_padding_mask=None,
        memory_key_padding_mask=None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ):
        """Encode ``src``, decode ``tgt`` against it; masks as the stacks take them.

        Raises:
            RuntimeError: src and tgt of different batch sizes or feature sizes.
        """
        batched = src.ndim == 3
        if (
            batched
            and src.shape[0 if self.batch_first else 1] != tgt.shape[0 if self.batch_first else 1]
        ):
            raise RuntimeError("the batch number of src and tgt must be equal")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise RuntimeError("the feature number of src and tgt must be equal to d_model")
        memory = self.encoder(
            src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
        )
        return self.decoder(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )

    generate_square_subsequent_mask = staticmethod(generate_square_subsequent_mask)


__all__ = [
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
