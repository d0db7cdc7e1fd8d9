"""Op-database entries for the shape and indexing family (``meganeura/ops/indexing.py`` and
``meganeura/ops/gather.py``): strided slices and ``Tensor.__getitem__``-style keys, narrow,
select, cat / stack, split / chunk, constant pad, squeeze / unsqueeze, gather /
take_along_dim, index_select and embedding.

Invariants of the samples: sizes 1, 3, 7 and 257; negative dims; steps 2 and 3; negative
starts and crops; cat of three and of nine operands (more than one kernel's worth of
bindings) with different sizes along the dim; index tensors with repeats, so the backward
scatter-adds must accumulate; an index_select with more indices (300) than one workgroup
scans at a time. Indices are always in range (out-of-range indices raise in PyTorch; what the
kernels do with them is tested in ``tests/codegen/test_indexing.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.ops import gather as G
from meganeura.ops import indexing as I  # noqa: E741 - the family module, as F is functional

from . import OpInfo, Sample


def _torch_slice(x, dim=0, start=None, end=None, step=1):
    key = [slice(None)] * x.ndim
    key[dim] = slice(start, end, step)
    return x[tuple(key)]


def _slice_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((1,)),), {"dim": 0, "start": 0, "end": 1}, name="size1"),
        Sample((r((7,)),), {"dim": 0, "start": 1, "end": None, "step": 2}, name="7_step2"),
        Sample((r((257, 3)),), {"dim": 0, "start": 5, "end": -7, "step": 3}, name="257x3_step3"),
        Sample((r((3, 257)),), {"dim": -1, "start": -100, "end": None}, name="3x257_neg_start"),
        Sample((r((2, 7, 3)),), {"dim": 1, "start": 2, "end": 6, "step": 3}, name="mid_dim_step3"),
        Sample((r((1, 7, 1)),), {"dim": -2, "start": 3, "end": 99}, name="unit_dims_clamped"),
    ]


def _index_samples(rng):
    x = rng.standard_normal((3, 7, 5))
    keys = [
        ((slice(None, None, 2), ..., slice(1, 4)), "steps_and_ellipsis"),
        ((..., -1), "last_int"),
        ((1, None, slice(-5, None, 3)), "int_newaxis_step3"),
        ((slice(1, 2), 6), "slice_int"),
    ]
    out = [Sample((x, k), name=n) for k, n in keys]
    out.append(Sample((rng.standard_normal((257,)), slice(3, None, 7)), name="257_step7"))
    return out


def _tensor_key_samples(rng):
    x = rng.standard_normal((3, 7, 5))
    i = np.array([[6, 0], [6, 2]])
    return [Sample((x, i), name="2d_index_with_repeats")]


def _narrow_select(rng):
    r = rng.standard_normal
    return [
        Sample((r((7, 3)), 0, -3, 2), name="narrow_negative_start"),
        Sample((r((2, 257)), -1, 250, 7), name="narrow_tail"),
    ]


def _select_samples(rng):
    r = rng.standard_normal
    return [Sample((r((7, 3)), 1, -1), name="last_col"), Sample((r((1, 5)), 0, 0), name="size1")]


def _cat_samples(rng):
    r = rng.standard_normal
    three = (r((2, 3, 5)), r((2, 1, 5)), r((2, 7, 5)))
    nine = tuple(r((3, k + 1)) for k in range(9))
    return [
        Sample(three, {"dim": 1}, name="three_mid_dim"),
        Sample((r((1, 4)), r((3, 4)), r((257, 4))), {"dim": -2}, name="rows_neg_dim"),
        Sample((r((7,)), r((1,))), {"dim": 0}, name="1d"),
        Sample(nine, {"dim": -1}, name="nine_operands"),
    ]


def _stack_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((3, 5)), r((3, 5)), r((3, 5))), {"dim": -1}, name="last"),
        Sample((r((7,)), r((7,))), {"dim": 0}, name="first"),
    ]


def _split_fn(split, torch_side: bool):
    """Every piece scaled by its position and concatenated back, so each one is checked."""

    def fn(x, size, dim):
        pieces = split(x, size, dim)
        scaled = [p * float(k + 1) for k, p in enumerate(pieces)]
        return torch.cat(scaled, dim) if torch_side else I.cat(scaled, dim)

    return fn


def _split_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((7, 3)), 3, 0), name="size3_remainder"),
        Sample((r((2, 257)), [1, 200, 56], -1), name="sections"),
    ]


def _chunk_samples(rng):
    return [Sample((rng.standard_normal((3, 7)), 3, 1), name="7_into_3")]


def _pad_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((3, 7)), (1, 2)), name="last_dim"),
        Sample((r((2, 3, 5)), (1, 1, 2, 0, 0, 3)), {"value": -1.5}, name="three_dims_value"),
        Sample((r((3, 257)), (-5, 2, 1, -1)), name="crop_and_pad"),
        Sample((r((1, 1)), (3, 0, 0, 7)), {"value": 0.25}, name="size1"),
    ]


def _squeeze_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((1, 7, 1)),), name="all"),
        Sample((r((3, 1, 5)), -2), name="dim"),
        Sample((r((1, 3, 1)), (0, 1)), name="dims_some_not_1"),
    ]


def _unsqueeze_samples(rng):
    r = rng.standard_normal
    return [Sample((r((3, 5)), -1), name="last"), Sample((r((7,)), 0), name="first")]


def _gather_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((3, 7, 5)), 1, rng.integers(0, 7, (3, 9, 5))), name="mid_dim_repeats"),
        Sample((r((3, 7, 5)), -1, rng.integers(0, 5, (2, 4, 3))), name="smaller_index"),
        Sample((r((257,)), 0, rng.integers(0, 257, (300,))), name="1d_257"),
        Sample((r((1, 3)), 0, np.zeros((4, 3), np.int64)), name="size1_all_same"),
    ]


def _take_along_dim_samples(rng):
    r = rng.standard_normal
    x = r((4, 7))
    return [
        Sample((x, np.argsort(x, axis=1)[:, :3], 1), name="topk_like"),
        Sample((x, rng.integers(0, 4, (5, 1)), 0), name="broadcast_index"),
        Sample((x, rng.integers(0, 28, (9,)), None), name="flattened"),
    ]


def _index_select_samples(rng):
    r = rng.standard_normal
    return [
        Sample((r((7, 5)), 0, np.array([6, 0, 6, 6, 3])), name="rows_repeats"),
        Sample((r((3, 7, 5)), -2, np.array([1, 1, 0])), name="mid_dim"),
        Sample((r((2, 257)), -1, rng.integers(0, 257, (9,))), name="last_dim"),
        Sample((r((257, 3)), 0, rng.integers(0, 257, (300,))), name="300_indices"),
    ]


def _embedding_samples(rng):
    r = rng.standard_normal
    return [
        Sample((rng.integers(0, 300, (2, 64)), r((300, 17))), name="2x64_tokens"),
        Sample((rng.integers(0, 40, (128,)), r((1000, 64))), name="128_tokens_repeats"),
        Sample((np.zeros((7,), np.int64), r((1, 3))), name="vocab1"),
    ]


GATHER_OPS = ("gather", "gather_backward")
SELECT_OPS = ("index_select", "index_select_backward")
SLICE_OPS = ("slice", "slice_backward")

ENTRIES: list[OpInfo] = [
    OpInfo("slice", I.slice, _torch_slice, _slice_samples, SLICE_OPS),
    OpInfo("index", I.index, lambda x, key: x[key], _index_samples, SLICE_OPS),
    OpInfo(
        "index_tensor_key",
        lambda x, i: I.index(x, (slice(None), i)),
        lambda x, i: x[:, i],
        _tensor_key_samples,
        SELECT_OPS,
    ),
    OpInfo("narrow", I.narrow, torch.narrow, _narrow_select, SLICE_OPS),
    OpInfo("select", I.select, torch.select, _select_samples, SLICE_OPS),
    OpInfo(
        "cat",
        lambda *xs, dim: I.cat(xs, dim),
        lambda *xs, dim: torch.cat(xs, dim),
        _cat_samples,
        ("cat", "slice"),
    ),
    OpInfo(
        "stack",
        lambda *xs, dim: I.stack(xs, dim),
        lambda *xs, dim: torch.stack(xs, dim),
        _stack_samples,
        ("cat", "slice"),
    ),
    OpInfo(
        "split",
        _split_fn(I.split, False),
        _split_fn(torch.split, True),
        _split_samples,
        ("slice", "cat"),
    ),
    OpInfo(
        "chunk", _split_fn(I.chunk, False), _split_fn(torch.chunk, True), _chunk_samples, ("slice",)
    ),
    OpInfo("pad", I.pad, torch.nn.functional.pad, _pad_samples, ("pad",)),
    OpInfo("squeeze", I.squeeze, torch.squeeze, _squeeze_samples, ("reshape",)),
    OpInfo("unsqueeze", I.unsqueeze, torch.unsqueeze, _unsqueeze_samples, ("reshape",)),
    OpInfo("gather", G.gather, torch.gather, _gather_samples, GATHER_OPS),
    OpInfo(
        "take_along_dim",
        G.take_along_dim,
        torch.take_along_dim,
        _take_along_dim_samples,
        GATHER_OPS,
    ),
    OpInfo("index_select", G.index_select, torch.index_select, _index_select_samples, SELECT_OPS),
    OpInfo(
        "embedding",
        G.embedding,
        torch.nn.functional.embedding,
        _embedding_samples,
        SELECT_OPS,
    ),
]
