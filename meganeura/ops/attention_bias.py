"""Attention biases given as ``attn_mask`` (torch.nn.attention.bias, re-exported as
``meganeura.nn.attention``): ``causal_lower_right`` and ``causal_upper_left``.

A :class:`CausalBias` is not a tensor: ``scaled_dot_product_attention`` recognizes it and runs
the causal rule in its kernel (lower-right: ``is_causal=True`` with ``kv_length = Lk``; upper-
left: ``is_causal=True``), so no [Lq, Lk] mask is stored or read. ``to_bool()`` gives the mask
as NumPy, True where a query may attend, for other uses and for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CausalBias:
    """A causal mask of ``seq_len_q`` queries and ``seq_len_kv`` keys.

    Attributes:
        seq_len_q: Lq.
        seq_len_kv: Lk.
        lower_right: True: query i sees keys j <= i + Lk - Lq (the last query sees every
            key, as when the queries are the newest tokens after a cache); False: j <= i
            (PyTorch's ``is_causal``).
    """

    seq_len_q: int
    seq_len_kv: int
    lower_right: bool = True

    def to_bool(self) -> np.ndarray:
        """bool [Lq, Lk], True where query i may attend key j."""
        shift = self.seq_len_kv - self.seq_len_q if self.lower_right else 0
        i = np.arange(self.seq_len_q)[:, None]
        return np.arange(self.seq_len_kv)[None, :] <= i + shift

    def __array__(self, dtype=None, copy=None):
        m = self.to_bool()
        return m if dtype is None else m.astype(dtype)


def _lengths(seq_len_q: int, seq_len_kv: int) -> tuple[int, int]:
    lq, lk = int(seq_len_q), int(seq_len_kv)
    if lq < 1 or lk < 1:
        raise ValueError(f"sequence lengths must be positive, got Lq={seq_len_q}, Lk={seq_len_kv}")
    return lq, lk


def causal_lower_right(seq_len_q: int, seq_len_kv: int) -> CausalBias:
    """The causal mask aligned to the lower-right corner (torch.nn.attention.bias.
    causal_lower_right): query i sees keys ``j <= i + seq_len_kv - seq_len_q``; with
    ``seq_len_q > seq_len_kv`` the first queries see nothing (their outputs are zeros).

    Raises:
        ValueError: for lengths below 1.
    """
    return CausalBias(*_lengths(seq_len_q, seq_len_kv), lower_right=True)


def causal_upper_left(seq_len_q: int, seq_len_kv: int) -> CausalBias:
    """The causal mask aligned to the upper-left corner (torch.nn.attention.bias.
    causal_upper_left, the same as ``is_causal=True``): query i sees keys ``j <= i``.

    Raises:
        ValueError: for lengths below 1.
    """
    return CausalBias(*_lengths(seq_len_q, seq_len_kv), lower_right=False)
