"""The user's side of a Trainer step: ``loss_fn`` bound to the model, its result checked, and a
batch split into micro-batches. Pure host code; errors name what the user wrote.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from ..graph.builder import Tensor
from ..nn.compiled import flatten_arguments


def fn_name(fn) -> str:
    """How errors name a user's function."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def bind_model(loss_fn, model) -> Callable:
    """``loss_fn`` with the model bound first, with the signature of the batch arguments (so
    input names and binding errors are those of ``loss_fn``).

    Raises:
        TypeError: ``loss_fn`` is not callable or takes no positional argument for the model.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, *batch), got {loss_fn!r}")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        sig = None
    params = list(sig.parameters.values()) if sig is not None else []
    first = params[0].kind if params else None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if sig is not None and first not in (*positional, inspect.Parameter.VAR_POSITIONAL):
        raise TypeError(
            f"loss_fn {fn_name(loss_fn)}{sig} must take the model as its first argument: "
            "loss_fn(model, *batch)"
        )

    def fn(*args, **kwargs):
        return loss_fn(model, *args, **kwargs)

    fn.__qualname__ = fn_name(loss_fn)
    if sig is not None:  # *args: the batch binds to it as it is
        fn.__signature__ = sig.replace(parameters=params[1:]) if first in positional else sig
    return fn


def check_loss(result) -> None:
    """Raise unless ``result`` (what ``loss_fn`` returned while tracing) is a scalar floating
    Tensor."""
    if not isinstance(result, Tensor):
        what = "None" if result is None else f"a {type(result).__name__}"
        raise TypeError(
            f"loss_fn returned {what}; it must return the loss as a scalar Tensor built with "
            "meganeura ops, e.g. F.cross_entropy(model(x), y)"
        )
    if result.shape != ():
        raise ValueError(
            f"loss_fn returned a Tensor of shape {list(result.shape)}; the loss must be a "
            "scalar (shape []): reduce it, e.g. with .mean()"
        )
    if not result.dtype.is_floating:
        raise TypeError(f"loss_fn returned a {result.dtype} Tensor; the loss must be floating")


def split_batch(fn, batch: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    """``(batch, kwargs)`` as ``k`` micro-batches: every array split along dim 0
    (``np.array_split`` sizes), static values repeated.

    Raises:
        ValueError: no array, a 0-d array, arrays of different lengths, fewer than ``k`` rows.
    """
    _, _, arrays = flatten_arguments(fn, batch, kwargs)
    where = f"accumulation_steps={k} splits every batch array along dim 0"
    rows = {}
    for name, a in arrays:
        if a.ndim == 0:
            raise ValueError(f"{where}, but {name} is a scalar")
        rows[name] = a.shape[0]
    if not rows:
        raise ValueError(f"{where}, but the batch holds no array")
    if len(set(rows.values())) > 1:
        raise ValueError(f"{where}, so the arrays need the same length; got {rows}")
    n = next(iter(rows.values()))
    if n < k:
        raise ValueError(f"{where}, so a batch needs at least {k} rows; got {n}")
    q, r = divmod(n, k)
    edges = np.cumsum([0] + [q + (i < r) for i in range(k)])
    return [(_take(batch, int(a), int(b)), _take(kwargs, int(a), int(b)))
            for a, b in zip(edges[:-1], edges[1:], strict=True)]  # fmt: skip


def _take(value, a: int, b: int):
    if isinstance(value, np.ndarray) or hasattr(value, "__array_interface__"):
        return np.asarray(value)[a:b]
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, a, b) for v in value)
    if isinstance(value, dict):
        return {key: _take(v, a, b) for key, v in value.items()}
    return value


def check_optimizer(path, meta, optimizer) -> None:
    """Check that checkpoint metadata ``meta`` was written by a trainer with ``optimizer``'s
    type (``meta["optimizer"]["type"]``, from ``Optimizer.config``).

    Raises:
        CheckpointError: missing, not an object, or another optimizer type.
    """
    from ..io.checkpoint import CheckpointError

    config = meta.get("optimizer")
    ours = type(optimizer).__name__
    if not isinstance(config, dict) or not isinstance(config.get("type"), str):
        raise CheckpointError(
            f"{path}: metadata 'optimizer' is {config!r}; expected the optimizer's config, "
            f"an object with a 'type' ({ours!r} for this trainer)"
        )
    if config["type"] != ours:
        raise CheckpointError(
            f"{path}: metadata 'optimizer' type is {config['type']!r}: written by a "
            f"{config['type']} trainer; this one uses {ours}"
        )
