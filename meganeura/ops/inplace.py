"""In-place writes to persistent state that later ops of the same program read: ``index_copy_``
(torch.Tensor.index_copy_), the KV-cache write of decoding.

``index_copy_(input, index, source)`` (attr ``dim``) writes ``input[..., index[i], ...] =
source[..., i, ...]`` along ``dim`` into ``input``'s storage and returns that storage: its
value is ``input`` with the rows replaced. ``input`` must be a ``state`` leaf (a module
Buffer) or the value of an earlier ``index_copy_`` of one (``graph.verify``); the op is in
``graph.ir.ALIAS_OPS``, so its value owns no buffer and readers bind the state's buffer
(no copy of the whole tensor), and it has ``writes`` (an effect), so dead-code elimination
and CSE never remove or merge it. Program order is execution order: readers of the returned
value run after the write; readers of the older value must come before it (``verify``).
The write persists across runs and across programs binding the same shared buffer
(``runtime.shared``).

Out-of-range indices (outside ``[0, input.shape[dim])``): a host-fed index input is checked
before each run (the Session raises ``InputError`` naming it, as for ``index_select``); an
index computed on the GPU is not checked, and a row whose index is out of range is not
written (nothing outside ``input`` is ever touched). The NumPy reference raises IndexError.
Repeated indices: which source row lands is unspecified, as in PyTorch.
Not differentiable (the cache is not trained).
"""

from __future__ import annotations

import numpy as np

from ..graph.builder import Tensor, op_error
from ..graph.ir import TensorType
from .gather import check_dim, check_index
from .registry import OpDef, ShapeError

INDEX_COPY = "index_copy_"


def _index_copy_type(types, attrs):
    x, index, source = types
    dim = attrs.get("dim")
    check_dim(dim, x.ndim)
    check_index(index)
    if index.ndim != 1:
        raise ShapeError(f"index must be 1-D, got {index}")
    want = x.shape[:dim] + index.shape + x.shape[dim + 1 :]
    if source.shape != want or source.dtype is not x.dtype:
        raise ShapeError(
            f"source must be {TensorType(want, x.dtype)} (input's shape with dim {dim} of the "
            f"index's size {index.shape[0]}), got {source}"
        )
    return x


def _index_copy_np(xs, a):
    x, index, source = xs
    dim = a["dim"]
    bad = (index < 0) | (index >= x.shape[dim])
    if bad.any():
        raise IndexError(
            f"index_copy_: index {index[bad].flat[0]} out of range for dim {dim} of size "
            f"{x.shape[dim]}"
        )
    out = np.array(x, copy=True)
    np.moveaxis(out, dim, 0)[index.astype(np.int64)] = np.moveaxis(source, dim, 0)
    return (out,)


DEFS = [
    OpDef(INDEX_COPY, _index_copy_type, _index_copy_np, differentiable=False, writes=(0,), arity=3),
]


def index_copy_(input: Tensor, dim: int, index: Tensor, source: Tensor) -> Tensor:  # noqa: A002
    """Copy ``source``'s slices along ``dim`` into ``input`` at ``index``, in place
    (torch.Tensor.index_copy_): ``input[..., index[i], ...] = source[..., i, ...]``.

    Args:
        input: a module Buffer read in a traced ``forward`` (a graph ``state`` leaf), or the
            result of an earlier ``index_copy_`` of one; any dtype.
        dim: the indexed dim; negative counts from the end.
        index: i32 (or u32) [T], usually a graph input fed each run; values in
            ``[0, input.shape[dim])`` (see the module docstring for the others).
        source: ``input``'s dtype and shape with ``dim`` of size T.

    Returns:
        A tensor aliasing ``input``'s updated storage, typed like ``input``; read it (not
        ``input``) afterwards. Inside a Module trace, the Buffer itself reads as this new
        value from then on, so ``self.cache`` after ``self.cache.index_copy_(...)`` sees the
        write, as in PyTorch.

    Raises:
        GraphTypeError: for a dim out of range, a non-integer or non-1-D index, or a source
            of the wrong shape or dtype.
        GraphError (at compile): when ``input`` is not a state leaf or a later write of one,
            or an older version is read after the write.
    """
    from ..nn.tracing import current_trace
    from .gather import _dim

    if not isinstance(input, Tensor):
        trace = current_trace()
        if trace is None:
            raise op_error(INDEX_COPY, [input], {"dim": dim}, "input must be a Tensor", TypeError)
        input = trace.builder._operand(INDEX_COPY, input)  # a Buffer in a traced forward
    d = _dim(dim, input.ndim, INDEX_COPY, input)
    out = input.builder.add(INDEX_COPY, [input, index, source], {"dim": d})
    trace = current_trace()
    if trace is not None and trace.builder is input.builder:
        trace.advance(input, out)
    return out
