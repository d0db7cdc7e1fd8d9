"""Default initialization follows PyTorch's reset_parameters (distributions and bounds), and
``repr`` (``extra_repr``) reads as torch's for the same constructor call.

The draws come from meganeura's generator, so values differ from torch's; what must agree is
the distribution: the bound of each uniform (every value within it, the largest close to
it), the std of each normal, and the constants.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn as mnn

from .harness import check_uniform


def test_conv_weight_and_bias_bounds():
    mn.manual_seed(1)
    convs = (mnn.Conv2d(4, 8, (3, 5), groups=2), mnn.Conv1d(6, 16, 3))
    # ConvTranspose2d's weight is [in, out / groups, kh, kw]; PyTorch's fan_in reads dim 1.
    for m in (*convs, mnn.ConvTranspose2d(16, 8, 3, groups=2)):
        fan_in = m.weight.shape[1] * math.prod(m.weight.shape[2:])
        check_uniform(m.weight.data, 1 / math.sqrt(fan_in))  # kaiming_uniform_(a=sqrt(5))
        check_uniform(m.bias.data, 1 / math.sqrt(fan_in))


def test_embedding_is_standard_normal_with_a_zero_padding_row():
    mn.manual_seed(2)
    w = mnn.Embedding(200, 50, padding_idx=3).weight.data
    np.testing.assert_array_equal(w[3], 0)
    rest = np.delete(w, 3, axis=0)
    assert abs(rest.mean()) < 0.05 and abs(rest.std() - 1) < 0.05


def test_norm_layers_start_as_identity_transforms():
    for m in (mnn.LayerNorm(5), mnn.GroupNorm(2, 4), mnn.BatchNorm2d(4), mnn.RMSNorm(3)):
        np.testing.assert_array_equal(m.weight.data, 1)
        if "bias" in m._parameters:
            np.testing.assert_array_equal(m.bias.data, 0)
    bn = mnn.BatchNorm1d(3)
    np.testing.assert_array_equal(bn.running_mean.data, 0)
    np.testing.assert_array_equal(bn.running_var.data, 1)


def test_prelu_init():
    np.testing.assert_array_equal(mnn.PReLU(3, init=0.1).weight.data, np.float32(0.1))


def test_empty_weights_skips_drawing():
    with mnn.init.empty_weights():
        conv = mnn.Conv2d(2, 3, 3)
        emb = mnn.Embedding(5, 2, padding_idx=0)
    assert not conv.weight.is_initialized and not emb.weight.is_initialized
    with pytest.raises(mnn.UninitializedParameterError):
        conv.state_dict()


# ---------------------------------------------------------------------------- repr
REPRS = [
    ("ReLU", (), {"inplace": True}),
    ("LeakyReLU", (0.2,), {}),
    ("GELU", ("tanh",), {}),
    ("Hardtanh", (-2.0, 2.0), {}),
    ("ReLU6", (), {}),
    ("ELU", (), {"alpha": 0.5}),
    ("Softplus", (), {"beta": 2.0}),
    ("Softmax", (), {"dim": -1}),
    ("PReLU", (4,), {}),
    ("GLU", (), {}),
    ("Embedding", (10, 3), {"padding_idx": -2}),
    ("LayerNorm", ((3, 4),), {"bias": False}),
    ("RMSNorm", (8,), {}),
    ("GroupNorm", (2, 4), {"affine": False}),
    ("BatchNorm2d", (3,), {"momentum": None}),
    ("BatchNorm1d", (3,), {"track_running_stats": False, "bias": False}),
    ("Conv2d", (3, 4, 3), {"padding": "same", "bias": False}),
    ("Conv2d", (4, 4, (3, 1)), {"stride": 2, "padding": 1, "dilation": 2, "groups": 4}),
    ("Conv1d", (3, 4, 3), {"padding_mode": "reflect", "padding": 1}),
    ("ConvTranspose2d", (4, 2, 3), {"stride": 2, "output_padding": 1, "groups": 2}),
    ("MaxPool2d", (3,), {"stride": 2}),
    ("MaxPool1d", (3,), {}),
    ("AvgPool2d", ((2, 3),), {"padding": 1}),
    ("AvgPool1d", (2,), {}),
    ("AdaptiveAvgPool2d", ((3, None),), {}),
    ("Upsample", (), {"scale_factor": 2, "mode": "nearest"}),
    ("UpsamplingBilinear2d", ((4, 6),), {}),
    ("Dropout", (0.1,), {}),
    ("Linear", (4, 3), {"bias": False}),
]


@pytest.mark.parametrize(
    "name, args, kwargs", [pytest.param(*r, id=f"{r[0]}-{i}") for i, r in enumerate(REPRS)]
)
def test_repr_reads_as_torch(name, args, kwargs):
    # The layers follow the pinned torch (the test extra's); older torch prints, and accepts,
    # fewer arguments (the norms' bias= came in 2.13's reprs).
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        pytest.skip(f"reprs are those of torch 2.13; this is torch {torch.__version__}")
    ours, theirs = getattr(mnn, name)(*args, **kwargs), getattr(torch.nn, name)(*args, **kwargs)
    assert repr(ours) == repr(theirs)
