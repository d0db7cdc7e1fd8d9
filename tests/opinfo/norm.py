"""Op-database entries for the normalization family (``meganeura/ops/norm.py``) and dropout.

Invariants of the samples: normalized sizes 1, 3, 7, 257 and 1000 for the row norms; group_norm
with one group, with one group per channel and with N = 1; batch_norm with N = 1 and spatial
positions, with [N, C] inputs, and with a channel of exactly 2 values; plain (no weight/bias)
forms; one input with a large common offset (|mean| >> std) that an E[x^2] - E[x]^2 variance
would get wrong. Samples stay small (< 1e4 elements) so the whole family runs in seconds, except
the long groups of the row archetype (``codegen/wgsl/norm/team.py``): a group of 32
channels x 32x32 held in registers, and groups of more than 65536 elements (more than 16 units
per thread of a 1024-thread team) walked in chunks, in vec4 and in scalar units with ragged
last chunks (group_norm ``chunked_*``, batch_norm ``chunked``).

batch_norm in training mode creates its running statistics as ``state`` leaves inside the
entry function; their update is checked against torch in ``tests/codegen/test_norm.py``.
dropout's reference applies the mask of ``meganeura.ops.dropout.keep_mask`` (the same hash,
so the comparison is exact); its agreement with torch's statistics is tested separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF

from meganeura.dtypes import DType
from meganeura.ops.dropout import dropout, keep_mask
from meganeura.ops.norm import RMS_EPS_F32, batch_norm, group_norm, layer_norm, rms_norm

from . import OpInfo, Sample


def _affine(rng, shape):
    return rng.uniform(0.5, 1.5, shape), rng.standard_normal(shape)


# ---- layer_norm / rms_norm --------------------------------------------------------------------
ROW_SHAPES = [((6, 1), (1,)), ((4, 3), (3,)), ((2, 3, 7), (7,)), ((3, 257), (257,)),
              ((2, 1000), (1000,)), ((2, 3, 7), (3, 7))]  # fmt: skip


def _name(shape, ns) -> str:
    return "x".join(map(str, shape)) + "_n" + "x".join(map(str, ns))


def _layer_norm_samples(rng):
    out = []
    for shape, ns in ROW_SHAPES:
        w, b = _affine(rng, ns)
        out.append(Sample((rng.standard_normal(shape), ns, w, b), name=_name(shape, ns)))
    out.append(Sample((rng.standard_normal((5, 7)), (7,)), name="plain"))
    out.append(Sample((rng.standard_normal((3, 7)), 7, None, None), {"eps": 1e-2}, "eps"))
    x = 50.0 + 0.01 * rng.standard_normal((3, 257))
    out.append(Sample((x, (257,), *_affine(rng, (257,))), name="offset"))
    return out


def _rms_norm_samples(rng):
    out = []
    for shape, ns in ROW_SHAPES:
        w, _ = _affine(rng, ns)
        # Over one element y = x / sqrt(x^2 + eps) is flat and dx is the eps-sized residue of
        # cancelling terms; eps = 1e-3 keeps that sample well conditioned enough for f32.
        eps = 1e-3 if ns == (1,) else 1e-5
        out.append(Sample((rng.standard_normal(shape), ns, w), {"eps": eps}, _name(shape, ns)))
    out.append(Sample((rng.standard_normal((5, 7)), 7), name="plain_default_eps"))
    return out


def _rms_norm_ref(x, ns, w=None, eps=None):
    ns = (ns,) if isinstance(ns, int) else tuple(ns)
    return TF.rms_norm(x, ns, w, eps=RMS_EPS_F32 if eps is None else eps)


def _layer_norm_ref(x, ns, w=None, b=None, eps=1e-5):
    ns = (ns,) if isinstance(ns, int) else tuple(ns)
    return TF.layer_norm(x, ns, w, b, eps)


# ---- group_norm / batch_norm ------------------------------------------------------------------
def _group_norm_samples(rng):
    cases = [((2, 6, 5), 3, "g3"), ((2, 4, 3, 3), 1, "one_group"), ((2, 4, 7), 4, "g_eq_c"),
             ((1, 6, 9), 2, "n1"), ((3, 8, 2, 2), 4, "4d"), ((2, 6), 2, "no_spatial"),
             ((4, 32, 7, 7), 8, "resnet_ragged"), ((1, 32, 32, 32), 1, "long_32x32x32"),
             ((1, 80, 30, 30), 1, "chunked_vec4"),
             ((1, 33, 47, 47), 3, "chunked_scalar")]  # fmt: skip
    out = []
    for shape, g, name in cases:
        w, b = _affine(rng, (shape[1],))
        out.append(Sample((rng.standard_normal(shape), g, w, b), name=name))
    out.append(Sample((rng.standard_normal((2, 4, 5)), 2), {"eps": 1e-3}, "plain"))
    x = -30.0 + 0.05 * rng.standard_normal((2, 4, 65))
    out.append(Sample((x, 2, *_affine(rng, (4,))), name="offset"))
    return out


def _bn_cases():
    return [((4, 3), "nc"), ((1, 3, 5, 5), "n1_spatial"), ((3, 2, 7), "ncl"),
            ((2, 5, 3, 3), "nchw"), ((3, 1, 1), "three_values"), ((8, 4, 33), "long"),
            ((3, 4, 5, 7), "ragged_segments"), ((2, 2, 180, 190), "chunked")]  # fmt: skip


def _batch_norm_train_samples(rng):
    out = []
    for shape, name in _bn_cases():
        w, b = _affine(rng, (shape[1],))
        out.append(Sample((rng.standard_normal(shape), w, b), {"momentum": 0.3}, name))
    out.append(Sample((rng.standard_normal((3, 4, 2)), None, None), {"eps": 1e-3}, "plain"))
    # Two values per channel: xhat = +-1 and dx is only the eps-sized residue of cancelling
    # terms (ill-conditioned: 3.5e-5 norm error with eps = 1e-5 on lavapipe, exact centring
    # keeps it that low); the large-eps twin is well conditioned.
    x, (w, b) = rng.standard_normal((2, 3)), _affine(rng, (3,))
    out.append(Sample((x, w, b), {"eps": 0.5}, "two_values_eps"))
    out.append(Sample((x, w, b), name="two_values_tiny_eps"))
    x = 20.0 + 0.01 * rng.standard_normal((4, 3, 20))
    out.append(Sample((x, *_affine(rng, (3,))), name="offset"))
    return out


def _batch_norm_train(x, weight=None, bias=None, **kw):
    b, c = x.builder, x.shape[1]
    rm, rv = b.state("bn.running_mean", (c,)), b.state("bn.running_var", (c,))
    return batch_norm(x, rm, rv, weight, bias, training=True, **kw)


def _batch_norm_train_ref(x, weight=None, bias=None, momentum=0.1, eps=1e-5):
    return TF.batch_norm(x, None, None, weight, bias, True, momentum, eps)


def _batch_norm_eval_samples(rng):
    out = []
    for shape, name in _bn_cases():
        c = shape[1]
        stats = (rng.standard_normal(c), rng.uniform(0.2, 3.0, c))
        args = (rng.standard_normal(shape), *stats, *_affine(rng, (c,)))
        out.append(Sample(args, name=name, grad=(0, 3, 4)))
    x = rng.standard_normal((2, 3, 4))
    stats = (rng.standard_normal(3), rng.uniform(0.2, 3.0, 3))
    out.append(Sample((x, *stats), {"eps": 1e-3}, "plain", grad=(0,)))
    return out


def _batch_norm_eval(x, mean, var, weight=None, bias=None, **kw):
    return batch_norm(x, mean, var, weight, bias, training=False, **kw)


def _batch_norm_eval_ref(x, mean, var, weight=None, bias=None, eps=1e-5):
    return TF.batch_norm(x, mean, var, weight, bias, False, 0.1, eps)


# ---- dropout ----------------------------------------------------------------------------------
DROPOUT_SEED = 1234567


def _dropout_samples(rng):
    cases = [((7,), 0.5), ((3, 257), 0.1), ((1000,), 0.9), ((2, 3, 5, 7), 0.25), ((1,), 0.5)]
    return [
        Sample((rng.standard_normal(s), p), name="x".join(map(str, s)) + f"_p{p}") for s, p in cases
    ]


def _dropout(x, p):
    return dropout(x, p, True, seed=x.builder.constant(DROPOUT_SEED, DType.u32))


def _dropout_ref(x, p):
    mask = torch.from_numpy(keep_mask(DROPOUT_SEED, tuple(x.shape), p))
    return torch.where(mask, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype))


ENTRIES = [
    OpInfo(
        "layer_norm",
        layer_norm,
        _layer_norm_ref,
        _layer_norm_samples,
        ("layer_norm", "layer_norm_backward", "layer_norm_weight_backward"),
    ),
    OpInfo(
        "rms_norm",
        rms_norm,
        _rms_norm_ref,
        _rms_norm_samples,
        ("rms_norm", "rms_norm_backward", "rms_norm_weight_backward"),
    ),
    OpInfo(
        "group_norm",
        group_norm,
        TF.group_norm,
        _group_norm_samples,
        ("group_norm", "group_norm_backward", "group_norm_weight_backward"),
    ),
    OpInfo(
        "batch_norm_train",
        _batch_norm_train,
        _batch_norm_train_ref,
        _batch_norm_train_samples,
        (
            "batch_norm",
            "batch_norm_backward",
            "batch_norm_weight_backward",
            "batch_norm_update_stats",
        ),
    ),
    OpInfo(
        "batch_norm_eval",
        _batch_norm_eval,
        _batch_norm_eval_ref,
        _batch_norm_eval_samples,
        ("batch_norm",),
    ),  # fmt: skip
    OpInfo("dropout", _dropout, _dropout_ref, _dropout_samples, ("dropout",)),
]
