"""Vector norms along a dim and the functions built on them: ``normalize`` and
``cosine_similarity``, composites of existing ops (no op or kernel of their own).

The p-norm ``(sum |x|^p)^(1/p)`` is reduced with ``keepdim`` (a sum, or ``amax`` of ``|x|``
for p = inf); its root is taken of ``where(s > 0, s, 1)`` and the result set to 0 where
``s == 0``, so an all-zero vector has norm 0 and a zero gradient through the norm, as
PyTorch's ``norm_backward`` masks it (the root's own gradient is infinite at 0). Ties of the
inf-norm share the gradient equally, as there.
"""

from __future__ import annotations

import math

from ..graph.builder import Tensor
from . import elementwise as E
from . import functional as F


def _check_p(p: float, fn: str) -> float:
    p = float(p)
    if not p > 0:
        raise ValueError(f"{fn}: p must be positive or inf, got {p}")
    return p


def vector_norm_keepdim(x: Tensor, p: float, dim: int) -> Tensor:
    """``||x||_p`` along ``dim`` with the dim kept (torch.linalg.vector_norm(x, p, dim,
    keepdim=True)), zero gradient at an all-zero vector; p > 0 or inf."""
    a = E.abs(x) if p != 2.0 else None
    if math.isinf(p):
        return F.amax(a, dim, keepdim=True)
    if p == 1.0:
        return F.sum(a, dim, keepdim=True)
    s = F.sum(x * x if p == 2.0 else E.pow(a, p), dim, keepdim=True)
    live = F.ne(s, 0.0)  # s >= 0 or NaN; a NaN norm stays NaN (torch), so not s > 0
    safe = F.where(live, s, 1.0)
    root = F.sqrt(safe) if p == 2.0 else E.pow(safe, 1.0 / p)
    return F.where(live, root, 0.0)


def normalize(
    input: Tensor,  # noqa: A002 - PyTorch's name
    p: float = 2.0,
    dim: int = 1,
    eps: float = 1e-12,
) -> Tensor:
    """``input / max(||input||_p, eps)`` along ``dim`` (torch.nn.functional.normalize).

    The clamp is torch's ``clamp_min``: where the norm is below ``eps`` no gradient flows
    through it.

    Args:
        input: floating tensor of any shape with at least ``dim + 1`` dims.
        p: the norm's exponent, > 0 or ``math.inf``.
        dim: the dim normalized (negative counts from the end).
        eps: lower bound of the divisor.

    Returns:
        A tensor like ``input``.

    Raises:
        ValueError: for p <= 0 or NaN.
        IndexError: for a dim out of range.
    """
    p = _check_p(p, "normalize")
    d = F.normalize_dim(dim, input.ndim)
    return input / E.clamp(vector_norm_keepdim(input, p, d), min=float(eps))


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """``sum(x1 / max(||x1||, eps) * x2 / max(||x2||, eps), dim)``
    (torch.nn.functional.cosine_similarity, PyTorch 2.x's formula in ATen's Distance.cpp).

    ``x1`` and ``x2`` are broadcast to one shape first and each norm is clamped on its own;
    as in PyTorch, the clamp is applied without autograd, so the gradient flows through each
    norm as if unclamped (the divisor is ``n - stop_gradient(n) + stop_gradient(max(n, eps))``:
    the clamped value, the norm's derivative).

    Args:
        x1, x2: floating tensors of one dtype whose shapes broadcast.
        dim: the dim reduced, in the broadcast shape (negative counts from the end).
        eps: lower bound of each norm.

    Returns:
        The broadcast shape without ``dim``.

    Raises:
        ShapeError: shapes that do not broadcast.
        IndexError: a dim out of range.
    """
    shape = E.broadcast_shapes(x1.shape, x2.shape)
    x1, x2 = F.broadcast_to(x1, shape), F.broadcast_to(x2, shape)
    d = F.normalize_dim(dim, len(shape))

    def unit(x: Tensor) -> Tensor:
        n = vector_norm_keepdim(x, 2.0, d)
        frozen = F.stop_gradient(n)
        return x / (n - frozen + E.clamp(frozen, min=float(eps)))

    return F.sum(unit(x1) * unit(x2), d)
