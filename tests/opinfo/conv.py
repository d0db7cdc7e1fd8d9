"""Op-database entries for the conv/pool family (``meganeura/ops/conv.py``, ``ops/pool.py``).

Invariants of the samples: batch 1 and 3, channels 1, 3 and 7, spatial 1x1, 7x7 and 13x9,
stride 2 over odd sizes, dilation 2, groups 2 and depthwise (groups = C), a 1x1 conv, ResNet's
stem (7x7, stride 2, padding 3, 64 channels) on a 32x32 input, GEMM edges that are not tile
multiples (M = 70, N = 200), a weight gradient long enough to be split along K, unbatched
input, conv_transpose2d (PyTorch's weight layout, stride 2 with output_padding, groups with
dilation, output_padding >= stride allowed by the dilation, DCGAN's 1x1 -> 4x4, unbatched),
and max-pool windows full of ties (integer-valued inputs) whose gradient must go to the
first maximum in scan order as PyTorch's CPU kernel sends it. Interpolation: nearest by whole
factors (a broadcast), by fractions and sizes (gathers; 4-d keeps ATen's same-size copy),
1-d; bilinear to a size and by factors, align_corners both ways, down- and upsampling in
one call, recompute_scale_factor, a 1x1 input; linear (3-d) and trilinear (5-d). Everything
stays small: the family runs in seconds on lavapipe.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as TF

from meganeura.ops import conv as C
from meganeura.ops import conv_transpose as CT
from meganeura.ops import pool as P
from meganeura.ops import resample as R

from . import OpInfo, Sample


def _conv_case(rng, x, w, bias, name, **kw):
    args = (rng.normal(size=x), rng.normal(size=w) / np.sqrt(np.prod(w[1:])))
    if bias:
        args += (rng.normal(size=w[0]),)
    return Sample(args, kw, name=name)


def _conv2d_samples(rng):
    c = lambda *a, **k: _conv_case(rng, *a, **k)  # noqa: E731
    return [
        c((1, 1, 1, 1), (1, 1, 1, 1), False, "spatial_1x1"),
        c((1, 1, 5, 5), (2, 1, 3, 3), True, "b1_c1", padding=1),
        c((3, 3, 7, 7), (4, 3, 3, 3), True, "b3_c3_7x7", padding=1),
        c((2, 7, 13, 9), (5, 7, 3, 2), False, "c7_13x9", padding=(1, 0)),
        c((3, 3, 7, 9), (4, 3, 3, 3), True, "stride2_odd", stride=2, padding=1),
        c((1, 3, 9, 9), (3, 3, 3, 3), False, "dilation2", padding=2, dilation=2),
        c((2, 4, 7, 7), (6, 2, 3, 3), True, "groups2", padding=1, groups=2),
        c((2, 7, 7, 7), (7, 1, 3, 3), False, "depthwise", padding=1, groups=7),
        c((3, 7, 5, 5), (9, 7, 1, 1), True, "pointwise_1x1"),
        c((2, 8, 7, 7), (5, 8, 1, 1), False, "downsample_1x1_s2", stride=2),
        c((1, 3, 32, 32), (64, 3, 7, 7), False, "resnet_stem", stride=2, padding=3),
        c((2, 16, 10, 10), (70, 16, 3, 3), True, "ragged_tiles", padding=1),
        c((2, 4, 20, 20), (5, 4, 3, 3), False, "split_k_weight_grad", padding=1),
        c((1, 3, 8, 8), (4, 3, 3, 3), False, "padding_same", padding="same"),
        c((3, 6, 6), (2, 3, 3, 3), True, "unbatched", stride=(2, 1)),
    ]


def _conv_transpose_samples(rng):
    def c(x, w, bias, name, **kw):
        args = (rng.normal(size=x), rng.normal(size=w) / np.sqrt(np.prod(w[1:])))
        return Sample(args + ((rng.normal(size=w[1] * kw.get("groups", 1)),) if bias else ()),
                      kw, name=name)  # fmt: skip

    return [
        c((2, 3, 5, 5), (3, 4, 3, 3), True, "k3_bias"),
        c((1, 4, 4, 5), (4, 2, 3, 3), True, "s2_p1_outpad1", stride=2, padding=1, output_padding=1),
        c(
            (2, 4, 5, 4),
            (4, 3, 3, 2),
            False,
            "groups2_dil2_s21",
            groups=2,
            dilation=2,
            stride=(2, 1),
        ),  # fmt: skip
        c(
            (1, 2, 4, 4),
            (2, 3, 3, 3),
            True,
            "outpad_ge_stride",
            dilation=2,
            output_padding=1,
            padding=1,
        ),  # fmt: skip
        c((1, 2, 1, 1), (2, 3, 4, 4), False, "dcgan_1x1_to_4x4", stride=2),
        c((3, 4, 4), (3, 2, 2, 2), False, "unbatched_k2_s2", stride=2),
    ]


def _conv1d_samples(rng):
    c = lambda *a, **k: _conv_case(rng, *a, **k)  # noqa: E731
    return [
        c((1, 1, 1), (1, 1, 1), False, "len1"),
        c((2, 5, 17), (6, 5, 3), True, "k3_p1", padding=1),
        c((3, 6, 16), (4, 6, 3), True, "k3_s2_p1", stride=2, padding=1),
        c((1, 4, 13), (4, 2, 3), False, "dilation2_groups2", dilation=2, groups=2),
    ]


def _x(rng, shape, ties=False):
    return rng.integers(-2, 3, size=shape).astype(np.float64) if ties else rng.normal(size=shape)


def _max_pool_samples(rng):
    return [
        Sample((_x(rng, (2, 3, 9, 9)),), dict(kernel_size=3, stride=2, padding=1), name="resnet"),
        Sample(
            (_x(rng, (1, 3, 8, 8), True),), dict(kernel_size=3, stride=1, padding=1), name="ties"
        ),
        Sample((_x(rng, (3, 1, 7, 7)),), dict(kernel_size=2), name="k2_odd"),
        Sample(
            (_x(rng, (1, 7, 13, 9), True),),
            dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=2, ceil_mode=True),
            name="dilation_ceil_ties",
        ),
        Sample((_x(rng, (2, 3, 1, 1)),), dict(kernel_size=1), name="spatial_1x1"),
        Sample((_x(rng, (3, 7, 7)),), dict(kernel_size=3, stride=2), name="unbatched"),
        Sample((_x(rng, (1, 2, 13, 9)),), dict(kernel_size=2, stride=3), name="stride_gt_kernel"),
    ]


def _avg_pool_samples(rng):
    x = lambda s: _x(rng, s)  # noqa: E731
    return [
        Sample((x((2, 3, 9, 9)),), dict(kernel_size=3, stride=2, padding=1), name="include_pad"),
        Sample(
            (x((1, 3, 7, 7)),),
            dict(kernel_size=3, stride=2, padding=1, count_include_pad=False, ceil_mode=True),
            name="exclude_pad_ceil",
        ),
        Sample(
            (x((3, 7, 13, 9)),),
            dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True),
            name="13x9_ceil",
        ),
        Sample(
            (x((2, 1, 6, 6)),), dict(kernel_size=2, divisor_override=3), name="divisor_override"
        ),
        Sample((x((1, 3, 1, 1)),), dict(kernel_size=1), name="spatial_1x1"),
        Sample(
            (x((2, 2, 13, 9)),), dict(kernel_size=(2, 3), stride=(3, 4)), name="stride_gt_kernel"
        ),
    ]


def _adaptive_samples(rng):
    return [
        Sample((_x(rng, (2, 7, 7, 7)),), dict(output_size=1), name="global_7x7"),
        Sample((_x(rng, (3, 3, 13, 9)),), dict(output_size=(5, 4)), name="13x9_to_5x4"),
        Sample((_x(rng, (1, 2, 3, 2)),), dict(output_size=(5, 4)), name="upsampling"),
        Sample((_x(rng, (2, 3, 9, 6)),), dict(output_size=(2, None)), name="keep_width"),
    ]


def _interpolate_samples(rng):
    return [
        Sample((_x(rng, (2, 3, 4, 5)),), dict(scale_factor=2), name="x2"),
        Sample((_x(rng, (1, 7, 3, 2)),), dict(scale_factor=(3, 1)), name="x3_x1"),
        Sample((_x(rng, (3, 1, 1, 1)),), dict(scale_factor=3), name="spatial_1x1"),
        Sample((_x(rng, (1, 2, 3, 4)),), dict(size=(6, 12)), name="size"),
    ]


def _nearest_fraction_samples(rng):
    return [
        # 4-d: H 3 -> 3 is a copy (ATen's nearest_idx), W 5 -> 6 reads floor(dst / 1.3)
        Sample((_x(rng, (2, 3, 3, 5)),), dict(scale_factor=1.3), name="sf1.3_same_height"),
        Sample((_x(rng, (1, 2, 3, 5)),), dict(size=(7, 4)), name="size_7x4"),
        Sample((_x(rng, (2, 3, 9, 8)),), dict(scale_factor=(0.5, 0.4)), name="downsample"),
        Sample((_x(rng, (2, 3, 7)),), dict(scale_factor=2.2), name="1d_sf2.2"),
    ]


def _bilinear_samples(rng):
    ac = dict(mode="bilinear", align_corners=True)
    return [
        Sample((_x(rng, (2, 3, 3, 5)),), dict(size=(5, 7), mode="bilinear"), name="size"),
        Sample((_x(rng, (2, 3, 3, 5)),), dict(size=(5, 7), **ac), name="size_align"),
        Sample((_x(rng, (1, 2, 4, 3)),), dict(scale_factor=2.5, mode="bilinear"), name="sf2.5"),
        Sample(
            (_x(rng, (2, 1, 7, 9)),), dict(scale_factor=(0.6, 1.7), **ac), name="sf0.6x1.7_align"
        ),
        Sample(
            (_x(rng, (1, 3, 5, 4)),),
            dict(scale_factor=1.3, mode="bilinear", recompute_scale_factor=True),
            name="sf1.3_recompute",
        ),
        Sample((_x(rng, (2, 2, 1, 1)),), dict(size=(3, 2), mode="bilinear"), name="from_1x1"),
    ]


def _linear_samples(rng):
    return [
        Sample((_x(rng, (2, 3, 7)),), dict(scale_factor=1.6, mode="linear"), name="1d"),
        Sample(
            (_x(rng, (1, 2, 3, 4, 2)),),
            dict(size=(5, 3, 4), mode="trilinear", align_corners=True),
            name="3d_align",
        ),
    ]


def _interp_ref(x, size=None, scale_factor=None, **kw):
    return TF.interpolate(x, size=size, scale_factor=scale_factor, **kw)


ENTRIES: list[OpInfo] = [
    OpInfo(
        "conv2d",
        C.conv2d,
        TF.conv2d,
        _conv2d_samples,
        ("conv2d", "conv2d_backward_input", "conv2d_backward_weight", "sum"),
    ),
    OpInfo(
        "conv1d",
        C.conv1d,
        TF.conv1d,
        _conv1d_samples,
        ("conv2d", "conv2d_backward_input", "conv2d_backward_weight", "reshape"),
    ),
    OpInfo(
        "conv_transpose2d",
        CT.conv_transpose2d,
        TF.conv_transpose2d,
        _conv_transpose_samples,
        ("conv2d_backward_input", "conv2d", "conv2d_backward_weight", "pad"),
    ),
    OpInfo(
        "max_pool2d",
        P.max_pool2d,
        TF.max_pool2d,
        _max_pool_samples,
        ("max_pool2d", "max_pool2d_backward"),
    ),
    OpInfo(
        "avg_pool2d",
        P.avg_pool2d,
        TF.avg_pool2d,
        _avg_pool_samples,
        ("avg_pool2d", "avg_pool2d_backward"),
    ),
    OpInfo(
        "adaptive_avg_pool2d",
        P.adaptive_avg_pool2d,
        TF.adaptive_avg_pool2d,
        _adaptive_samples,
        ("adaptive_avg_pool2d", "adaptive_avg_pool2d_backward", "mean"),
    ),
    OpInfo(
        "interpolate_nearest",
        R.interpolate,
        _interp_ref,
        _interpolate_samples,
        ("broadcast_to", "sum"),
    ),
    OpInfo(
        "interpolate_nearest_fraction",
        R.interpolate,
        _interp_ref,
        _nearest_fraction_samples,
        ("arange", "index_select", "index_select_backward"),
    ),
    OpInfo(
        "interpolate_bilinear",
        R.interpolate,
        _interp_ref,
        _bilinear_samples,
        ("arange", "index_select", "index_select_backward", "clamp"),
    ),
    OpInfo(
        "interpolate_linear_trilinear",
        R.interpolate,
        _interp_ref,
        _linear_samples,
        ("arange", "index_select", "index_select_backward"),
    ),
]
