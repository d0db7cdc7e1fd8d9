"""The measured best conv GEMM plan per (kind, m, n, k, groups) on the H200, ahead of the rules
(``plan.plan_source``).

Keyed by what ``plan.plan_gemm`` sees: which product the GEMM is (``KIND`` of its op: the
forward, one stride phase of the input gradient, the weight gradient) and the ``plan.Gemm``
sizes m, n, k, groups; so any network with the same GEMM shapes takes an entry. Values are
``plan.Plan`` names (``plan.parse_plan``: tile, splits, prefetch mode). GPU adapters only: CPU
adapters (``Limits.cpu``) and any enclosing ``plan.force_plan`` ignore the table.
"""

from __future__ import annotations

KIND = {
    "conv2d": "fwd",
    "conv2d_backward_input": "bwd_input",
    "conv2d_backward_weight": "bwd_weight",
}

# Printed by ``python bench/conv_sweep.py --emit-table bench/results/conv_sweep_h200.json``
# (``bench/conv_table.py``) from the H200 sweep of 2026-12-03 (third session; ResNet-50 b4,
# U-Net small b2): each product's best variant where it beat today's rule plan (two-deep
# prefetch on the 64x64 and 16x256 tiles) by >= 3%; the shape and gain in the comment.
# Strided grad-inputs are left out: on GPU adapters their stride phases run as one dispatch
# (``phases.py``), which the same sweep timed against the phases apart: ResNet-50 grad-input
# 2.566 ms merged against 2.738 apart, U-Net 0.636 against 0.754. The emit tool's estimate of
# the weighted network conv time on the H200: ResNet-50 b4 7.951 -> 7.630 ms (x1.042; the best
# variant per shape 7.583, cuDNN 6.404), U-Net small b2 1.973 -> 1.945 (x1.014; 1.930, 1.620).
TUNED: dict[tuple[str, int, int, int, int], str] = {
    ("bwd_input", 4, 2048, 576, 1): "64x64x16/s2/np",  # unet_in_4_64_h32 x1.39
    ("bwd_input", 64, 2048, 36, 1): "64x64x16/pf",  # unet_3x3_64_4_h32 x1.06
    ("bwd_input", 64, 12544, 256, 1): "64x64x16/pf",  # l1_1x1_64_256 x1.04
    ("bwd_input", 128, 3136, 512, 1): "64x64x16/d2",  # l2_1x1_128_512 x1.10
    ("bwd_input", 128, 3136, 1152, 1): "64x64x16/s4/d2",  # l2_3x3_128 x1.19
    ("bwd_input", 192, 2048, 64, 1): "64x64x16/pf",  # unet_1x1_192_64_h32 x1.03
    ("bwd_input", 192, 2048, 576, 1): "64x64x16/d2",  # unet_3x3_192_64_h32 x1.05
    ("bwd_input", 256, 784, 2304, 1): "128x128x8/s9/pf",  # l3_3x3_256 x1.04
    ("bwd_input", 512, 196, 4608, 1): "64x64x16/s17/d2",  # l4_3x3_512 x1.07
    ("bwd_input", 1024, 784, 512, 1): "64x64x16/pf",  # l4_1x1_1024_512 x1.24
    ("bwd_input", 2048, 196, 512, 1): "64x64x16/pf",  # l4_1x1_2048_512 x1.08
    ("bwd_weight", 4, 576, 2048, 1): "64x64x16/s8/np",  # unet_3x3_64_4_h32 x1.31
    ("bwd_weight", 128, 1152, 3136, 1): "64x64x16/s12/d2",  # l2_3x3_128 x1.08
    ("bwd_weight", 128, 3456, 512, 1): "64x64x16/d2",  # unet_3x3_384_128_h16 x1.10
    ("bwd_weight", 256, 512, 3136, 1): "64x64x16/s12/d2",  # l3_1x1_512_256 x1.16
    ("bwd_weight", 256, 2304, 784, 1): "128x128x8/s3/pf",  # l3_3x3_256 x1.11
    ("bwd_weight", 512, 256, 3136, 1): "64x64x16/s12/d2",  # l2_ds_1x1s2_256_512 x1.15
    ("bwd_weight", 512, 1024, 784, 1): "64x64x16/d2",  # l4_1x1_1024_512 x1.19
    ("bwd_weight", 1024, 512, 784, 1): "64x64x16/d2",  # l3_ds_1x1s2_512_1024 x1.20
    ("bwd_weight", 2048, 1024, 196, 1): "128x128x8/pf",  # l4_ds_1x1s2_1024_2048 x1.13
    ("fwd", 4, 2048, 576, 1): "64x64x16/s2/pf",  # unet_3x3_64_4_h32 x1.33
    ("fwd", 64, 2048, 36, 1): "64x64x16/pf",  # unet_in_4_64_h32 x1.05
    ("fwd", 128, 3136, 512, 1): "64x64x16/d2",  # l2_1x1_512_128 x1.22
    ("fwd", 128, 3136, 1152, 1): "64x64x16/s4/d2",  # l2_3x3_128 x1.20
    ("fwd", 512, 196, 4608, 1): "64x64x16/s17/d2",  # l4_3x3_512 x1.07
    ("fwd", 1024, 784, 512, 1): "64x64x16/pf",  # l3_ds_1x1s2_512_1024 x1.23
    ("fwd", 2048, 196, 512, 1): "64x64x16/pf",  # l4_1x1_512_2048 x1.11
}
