"""Op-database entries for the composites of ``meganeura/ops/distance.py``: ``normalize`` and
``cosine_similarity``, against torch.nn.functional in float64.

normalize samples: p = 2 (default dim 1), 1, 3 and inf (integer-valued input, so the
inf-norm has ties whose gradient is split), a negative dim, a 1-D input, a dim of size 1, an
all-zero row (norm 0: the output row is 0, the gradient g / eps) and a row of norm below eps
(the clamp is active and passes no gradient).

cosine_similarity samples: the default dim, a negative dim of a 3-d input, x1 broadcast along
the batch ([1, D] against [N, D]) and along the reduced dim ([N, 1] against [N, D]: the norm
is taken after broadcasting; x1's gradient is rounding noise there, so only x2's is
compared), a row of norm below eps (PyTorch clamps without autograd, so
the gradient through that norm is the unclamped one, ~1e8 here) and an all-zero row.
"""

from __future__ import annotations

import math

import numpy as np
import torch.nn.functional as TF

from meganeura.ops.distance import cosine_similarity, normalize

from . import OpInfo, Sample


def _normalize_samples(rng):
    r = rng.standard_normal
    zero_row, tiny_row = r((3, 4)), r((3, 4))
    zero_row[1] = 0.0
    tiny_row[2] *= 1e-14
    ties = rng.integers(-3, 4, size=(4, 6)).astype(np.float64)
    ties[0, :2] = (3.0, -3.0)
    return [
        Sample((r((3, 5)),), name="p2_default"),
        Sample((r((2, 7, 3)),), {"p": 1.0, "dim": -1}, name="p1_dim-1"),
        Sample((r((2, 3, 4)),), {"p": 3.0, "dim": 0}, name="p3_dim0"),
        Sample((ties,), {"p": math.inf}, name="pinf_ties"),
        Sample((r((9,)),), {"dim": 0}, name="1d"),
        Sample((r((5, 1)),), name="dim_size1", grad=()),  # sign(x): its gradient is 0
        Sample((zero_row,), name="zero_row"),
        Sample((tiny_row,), {"eps": 1e-12}, name="norm_below_eps"),
    ]


def _cosine_samples(rng):
    r = rng.standard_normal
    tiny, zero = r((3, 5)), r((3, 5))
    tiny[1] *= 1e-9
    zero[2] = 0.0
    return [
        Sample((r((4, 8)), r((4, 8))), name="default_dim"),
        Sample((r((2, 3, 5)), r((2, 3, 5))), {"dim": -1}, name="3d_dim-1"),
        Sample((r((1, 8)), r((5, 8))), name="broadcast_batch"),
        # x1's gradient is zero up to rounding there (x1 / ||x1|| is a constant): only x2's
        Sample((r((3, 1)), r((3, 6))), name="broadcast_reduced_dim", grad=(1,)),
        Sample((tiny, r((3, 5))), name="norm_below_eps"),
        Sample((zero, r((3, 5))), name="zero_row"),
    ]


ENTRIES = [
    OpInfo(
        "normalize",
        normalize,
        TF.normalize,
        _normalize_samples,
        ("sum", "amax", "pow", "sqrt", "clamp", "div"),
    ),
    OpInfo(
        "cosine_similarity",
        cosine_similarity,
        TF.cosine_similarity,
        _cosine_samples,
        ("sum", "sqrt", "clamp", "stop_gradient", "broadcast_to"),
    ),
]
