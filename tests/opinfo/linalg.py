"""Op-database entries for ``matmul`` (``meganeura/ops/linalg.py``) and ``functional.linear``.

Invariants of the samples: sizes that are not multiples of the 64x64 (or 128x128) output
tile nor of the K step (1, 3, 7, 33, 65, 129, 257), 2-D and batched products, batch dims
broadcast both ways ([3,1,M,K] @ [1,4,K,N]) and a 2-D right operand shared by a batch,
operands transposed through ``.mT`` (which the kernel folds into its strides instead of
materializing a permute), one long inner dimension (K = 2000), and shapes that reach each
default kernel path of ``codegen/wgsl/matmul/``: vec4 loads, gemv (M <= 8) and split-K.
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.ops import functional as F

from . import OpInfo, Sample

# (shape a, shape b, name); b is stored [.., N, K] when the name ends in _bT, etc.
PRODUCTS = [
    ((1, 1), (1, 1), "1x1x1"),
    ((3, 7), (7, 5), "3x7x5"),
    ((1, 257), (257, 3), "1x257x3"),
    ((65, 33), (33, 67), "65x33x67"),
    ((129, 7), (7, 130), "129x7x130"),
    ((4, 2000), (2000, 3), "long_k"),
    ((2, 5, 7), (2, 7, 3), "batched"),
    ((4, 5, 7), (7, 3), "batch_times_2d"),
    ((7, 3), (4, 3, 5), "2d_times_batch"),
    ((3, 1, 5, 9), (1, 4, 9, 6), "broadcast_batch"),
    ((7, 1), (1, 5), "k1_outer"),
    ((2, 0), (0, 5), "k0_zeros"),
    ((0, 3), (3, 5), "m0_empty"),
    # kernel paths of the default plans: vec4 loads (dims multiples of 4), gemv for M <= 8
    # (vec4 and scalar), split-K (one 64x64 tile, K = 1024)
    ((36, 68), (68, 132), "vec4_aligned"),
    ((1, 576), (576, 36), "gemv_vec4"),
    ((5, 33), (33, 7), "gemv_scalar"),
    ((64, 1024), (1024, 64), "split_k"),
]


def _matmul_samples(rng):
    return [
        Sample((rng.normal(size=sa), rng.normal(size=sb)), name=name) for sa, sb, name in PRODUCTS
    ]


def _transposed_samples(rng):
    # a @ b.mT with b stored [..., N, K]; a.mT @ b with a stored [..., K, M].
    return [
        Sample((rng.normal(size=(5, 7)), rng.normal(size=(3, 7))), {"which": "b"}, name="b_2d"),
        Sample((rng.normal(size=(65, 33)), rng.normal(size=(67, 33))), {"which": "b"}, name="b_65"),
        Sample((rng.normal(size=(7, 5)), rng.normal(size=(7, 3))), {"which": "a"}, name="a_2d"),
        Sample(
            (rng.normal(size=(2, 9, 5)), rng.normal(size=(2, 9, 6))), {"which": "a"}, name="a_bat"
        ),
        Sample((rng.normal(size=(4, 3)), rng.normal(size=(3, 4))), {"which": "ab"}, name="ab_2d"),
        Sample(
            (rng.normal(size=(3, 1, 9, 5)), rng.normal(size=(1, 4, 6, 9))),
            {"which": "ab"},
            name="ab_broadcast",
        ),
    ]


def _mt(fn_matmul):
    def f(a, b, which):
        return fn_matmul(a.mT if "a" in which else a, b.mT if "b" in which else b)

    return f


def _linear_samples(rng):
    def case(x, out_features, bias, name):
        w = rng.normal(size=(out_features, x[-1])) / np.sqrt(x[-1])
        args = (rng.normal(size=x), w) + ((rng.normal(size=out_features),) if bias else ())
        return Sample(args, name=name)

    return [
        case((5, 7), 3, True, "5x7_to_3"),
        case((5, 7), 3, False, "no_bias"),
        case((1, 257), 1, True, "257_to_1"),
        case((2, 9, 33), 65, True, "batched"),
        case((64, 784), 10, True, "mnist_head"),
        case((2, 576), 36, True, "decode_gemv"),
    ]


ENTRIES: list[OpInfo] = [
    OpInfo("matmul", F.matmul, torch.matmul, _matmul_samples, ("matmul",)),
    OpInfo(
        "matmul_transposed",
        _mt(F.matmul),
        _mt(torch.matmul),
        _transposed_samples,
        ("matmul", "permute"),
    ),
    OpInfo(
        "linear",
        F.linear,
        torch.nn.functional.linear,
        _linear_samples,
        ("matmul", "permute", "add"),
    ),
]
