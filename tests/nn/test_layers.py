"""Each layer against its torch.nn twin, built with the same constructor arguments.

Per case: the state dicts have the same keys in the same order and the same shapes (and
torch's loads into ours); the forward of the NumPy interpreter (float64, no GPU) and of
compile-on-call (``ours(x)``, GPU) match torch in float64; the gradients of every parameter
and floating input match torch.autograd (interpreter, float64).
"""

from __future__ import annotations

import numpy as np
import pytest

from .harness import (
    GPU_RTOL,
    assert_close,
    build,
    check_gradients,
    f32,
    interpret_forward,
    torch_forward,
)

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")

rng = np.random.default_rng(3)

CPU_RTOL = 1e-10  # the float64 interpreter against float64 torch


def _case(id, name, args=(), kwargs=None, shape=(2, 3, 4), scale=1.0, cpu_rtol=CPU_RTOL):
    return pytest.param(name, args, kwargs or {}, shape, scale, cpu_rtol, id=id)


# Activations: values spread over several units so every branch is exercised (random values
# never sit exactly on a kink).
ACTIVATIONS = [
    _case("ReLU", "ReLU", scale=3),
    _case("ReLU6", "ReLU6", scale=5),
    _case("LeakyReLU-0.2", "LeakyReLU", (0.2,), scale=3),
    _case("PReLU-per_channel", "PReLU", (3,), shape=(2, 3, 4), scale=3),
    _case("PReLU-shared", "PReLU", shape=(2, 5), scale=3),
    _case("ELU-0.5", "ELU", (0.5,), scale=3),
    _case("CELU-2", "CELU", (2.0,), scale=3),
    _case("SELU", "SELU", scale=3),
    _case("GELU", "GELU", scale=3),
    _case("GELU-tanh", "GELU", ("tanh",), scale=3, cpu_rtol=1e-9),
    _case("SiLU", "SiLU", scale=3),
    _case("Mish", "Mish", scale=3),
    _case("Hardtanh", "Hardtanh", (-0.5, 0.7)),
    # ATen's hardsigmoid_backward multiplies by 1.0f / 6.0f, a float32 constant, even in float64.
    _case("Hardsigmoid", "Hardsigmoid", scale=5, cpu_rtol=1e-7),
    _case("Hardswish", "Hardswish", scale=5),
    _case("Tanh", "Tanh", scale=2),
    _case("Sigmoid", "Sigmoid", scale=3),
    _case("Softplus-beta2-threshold3", "Softplus", (2.0, 3.0), scale=3),
    _case("Softsign", "Softsign", scale=3),
    _case("LogSigmoid", "LogSigmoid", scale=5, cpu_rtol=1e-8),
    _case("Tanhshrink", "Tanhshrink", scale=2),
    _case("Softmax-dim1", "Softmax", (1,)),
    _case("Softmin-dim0", "Softmin", (0,)),
    _case("LogSoftmax-dim-1", "LogSoftmax", (-1,)),
    _case("GLU-dim1", "GLU", (1,), shape=(2, 4, 3)),
]

# LogSigmoid is -softplus(-x) with softplus's threshold 20; GELU-tanh's tanh is exact in
# float64 only up to the constant's rounding: both a few ulps short of 1e-10.

LAYERS = [
    _case("LayerNorm", "LayerNorm", (4,)),
    _case("LayerNorm-2d-no_bias", "LayerNorm", ((3, 4),), {"bias": False}),
    _case("LayerNorm-no_affine", "LayerNorm", (4,), {"elementwise_affine": False}),
    _case("RMSNorm-eps", "RMSNorm", ((3, 4),), {"eps": 1e-3}),
    # eps=None is float32's epsilon here and float64's in the torch reference.
    _case("RMSNorm-default_eps", "RMSNorm", (4,), cpu_rtol=1e-6),
    _case("GroupNorm", "GroupNorm", (2, 6), shape=(2, 6, 5)),
    _case("GroupNorm-no_affine", "GroupNorm", (3, 6), {"affine": False}, shape=(2, 6, 2, 2)),
    _case("BatchNorm1d-2d_input", "BatchNorm1d", (3,), shape=(5, 3)),
    _case("BatchNorm1d-3d_input", "BatchNorm1d", (3,), {"momentum": 0.3}, shape=(2, 3, 4)),
    _case("BatchNorm2d", "BatchNorm2d", (3,), shape=(2, 3, 4, 4)),
    _case(
        "BatchNorm2d-untracked",
        "BatchNorm2d",
        (3,),
        {"track_running_stats": False},
        shape=(2, 3, 2, 3),
    ),
    _case("BatchNorm3d-no_affine", "BatchNorm3d", (2,), {"affine": False}, shape=(2, 2, 2, 2, 3)),
    _case("Conv1d", "Conv1d", (3, 4, 3), shape=(2, 3, 9)),
    _case(
        "Conv1d-same-dilation-circular",
        "Conv1d",
        (2, 4, 4),
        {"padding": "same", "dilation": 2, "padding_mode": "circular"},
        shape=(2, 2, 9),
    ),
    _case(
        "Conv1d-stride-groups",
        "Conv1d",
        (4, 6, 3),
        {"stride": 2, "groups": 2, "bias": False},
        shape=(1, 4, 10),
    ),
    _case("Conv2d", "Conv2d", (3, 4, 3), shape=(2, 3, 6, 5)),
    _case(
        "Conv2d-tuple-args-groups",
        "Conv2d",
        (4, 6, (3, 2)),
        {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 2},
        shape=(2, 4, 7, 7),
    ),
    _case("Conv2d-same-even_kernel", "Conv2d", (2, 3, 4), {"padding": "same"}, shape=(1, 2, 6, 5)),
    _case(
        "Conv2d-valid-no_bias",
        "Conv2d",
        (2, 3, 3),
        {"padding": "valid", "bias": False},
        shape=(1, 2, 5, 5),
    ),
    _case(
        "Conv2d-reflect",
        "Conv2d",
        (2, 3, 3),
        {"padding": 2, "padding_mode": "reflect"},
        shape=(1, 2, 5, 4),
    ),
    _case(
        "Conv2d-replicate-unbatched",
        "Conv2d",
        (2, 3, 3),
        {"padding": (1, 2), "padding_mode": "replicate"},
        shape=(2, 5, 5),
    ),
    _case("ConvTranspose2d", "ConvTranspose2d", (3, 4, 3), shape=(2, 3, 4, 5)),
    _case(
        "ConvTranspose2d-stride-pad-outpad-groups-dilation",
        "ConvTranspose2d",
        (4, 6, (3, 2)),
        {
            "stride": (2, 3),
            "padding": (1, 0),
            "output_padding": (1, 2),
            "groups": 2,
            "dilation": (1, 2),
        },
        shape=(1, 4, 3, 4),
    ),
    _case(
        "ConvTranspose2d-no_bias-unbatched",
        "ConvTranspose2d",
        (2, 3, 2),
        {"stride": 2, "bias": False},
        shape=(2, 3, 3),
    ),
    _case("MaxPool2d", "MaxPool2d", (2,), shape=(2, 3, 6, 6)),
    _case(
        "MaxPool2d-stride-pad-dilation-ceil",
        "MaxPool2d",
        (3,),
        {"stride": 2, "padding": 1, "dilation": 2, "ceil_mode": True},
        shape=(1, 2, 9, 8),
    ),
    _case("MaxPool1d", "MaxPool1d", (3,), {"stride": 2, "padding": 1}, shape=(2, 3, 9)),
    _case("AvgPool2d", "AvgPool2d", (3,), {"stride": 2, "padding": 1}, shape=(1, 2, 7, 6)),
    _case(
        "AvgPool2d-exclude_pad-ceil",
        "AvgPool2d",
        ((3, 2),),
        {"padding": 1, "ceil_mode": True, "count_include_pad": False},
        shape=(1, 2, 7, 6),
    ),
    _case("AvgPool2d-divisor", "AvgPool2d", (2,), {"divisor_override": 3}, shape=(1, 2, 4, 4)),
    _case("AvgPool1d", "AvgPool1d", (3,), {"stride": 2, "padding": 1}, shape=(1, 2, 9)),
    _case("AdaptiveAvgPool2d", "AdaptiveAvgPool2d", ((3, None),), shape=(1, 2, 7, 5)),
    _case("AdaptiveAvgPool2d-global", "AdaptiveAvgPool2d", (1,), shape=(2, 3, 4, 4)),
    _case("AdaptiveAvgPool1d", "AdaptiveAvgPool1d", (4,), shape=(1, 2, 9)),
    _case("Upsample-nearest-scale", "Upsample", (), {"scale_factor": 2}, shape=(1, 2, 3, 4)),
    _case("Upsample-nearest-size", "Upsample", ((6, 12),), shape=(1, 2, 3, 4)),
    _case("Upsample-nearest-fractional", "Upsample", (), {"scale_factor": 1.5}, shape=(1, 2, 3, 4)),
    _case(
        "Upsample-bilinear",
        "Upsample",
        (),
        {"scale_factor": 2, "mode": "bilinear"},
        shape=(1, 2, 3, 4),
    ),
    _case("UpsamplingBilinear2d", "UpsamplingBilinear2d", ((5, 7),), shape=(2, 1, 3, 4)),
    _case(
        "UpsamplingNearest2d", "UpsamplingNearest2d", (), {"scale_factor": 3}, shape=(1, 1, 2, 2)
    ),
    _case(
        "Upsample-linear-align",
        "Upsample",
        (7,),
        {"mode": "linear", "align_corners": True},
        shape=(1, 2, 4),
    ),
    _case("Flatten", "Flatten", shape=(2, 3, 4)),
    _case("Identity", "Identity", shape=(2, 3)),
    _case("Linear", "Linear", (4, 3), shape=(2, 5, 4)),
]

CASES = ACTIVATIONS + LAYERS
SIGNATURE = "name, args, kwargs, shape, scale, cpu_rtol"


def _input(shape, scale):
    return f32(rng.standard_normal(shape) * scale)


@pytest.mark.parametrize(SIGNATURE, CASES)
def test_forward_interpreter_matches_torch(name, args, kwargs, shape, scale, cpu_rtol):
    theirs, ours = build(name, args, kwargs)
    x = _input(shape, scale)
    got, _ = interpret_forward(ours, [x])
    assert_close(got, torch_forward(theirs, [x]), cpu_rtol)


@pytest.mark.parametrize(SIGNATURE, CASES)
def test_gradients_match_torch(name, args, kwargs, shape, scale, cpu_rtol):
    theirs, ours = build(name, args, kwargs)
    check_gradients(theirs, ours, [_input(shape, scale)], rtol=max(cpu_rtol, 1e-9))


@pytest.mark.parametrize(SIGNATURE, CASES)
def test_forward_on_gpu_matches_torch(gpu_device, name, args, kwargs, shape, scale, cpu_rtol):
    theirs, ours = build(name, args, kwargs)
    x = _input(shape, scale)
    assert_close(ours(x), torch_forward(theirs, [x]), GPU_RTOL)


# ---------------------------------------------------------------------------- Embedding
IDS = np.array([[1, 2, 3, 2], [0, 9, 2, 5]], np.int64)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="plain"),
        pytest.param({"padding_idx": 2}, id="padding_idx"),
        pytest.param({"padding_idx": -1}, id="padding_idx_negative"),
    ],
)
def test_embedding_matches_torch(kwargs):
    theirs, ours = build("Embedding", (10, 3), kwargs)
    assert ours.padding_idx == theirs.padding_idx
    got, _ = interpret_forward(ours, [IDS])
    assert_close(got, torch_forward(theirs, [IDS]), CPU_RTOL)
    # The padding row is read but gets no gradient, as in torch.
    check_gradients(theirs, ours, [IDS])


def test_embedding_on_gpu(gpu_device):
    theirs, ours = build("Embedding", (10, 3), {"padding_idx": 2})
    assert_close(ours(IDS), torch_forward(theirs, [IDS]), GPU_RTOL)


def test_embedding_from_pretrained():
    import torch

    import meganeura.nn as mnn

    w = rng.standard_normal((4, 3)).astype(np.float32)
    ours = mnn.Embedding.from_pretrained(w, padding_idx=1)
    theirs = torch.nn.Embedding.from_pretrained(torch.from_numpy(w), padding_idx=1)
    assert not ours.weight.requires_grad and not theirs.weight.requires_grad
    np.testing.assert_array_equal(ours.weight.data, w)  # from_pretrained does not zero the row
    assert repr(ours) == repr(theirs)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        pytest.param({"padding_idx": 10}, ValueError, id="padding_idx_too_large"),
        pytest.param({"max_norm": 1.0}, NotImplementedError, id="max_norm"),
        pytest.param({"scale_grad_by_freq": True}, NotImplementedError, id="scale_grad_by_freq"),
    ],
)
def test_embedding_refuses(kwargs, error):
    import meganeura.nn as mnn

    with pytest.raises(error):
        mnn.Embedding(10, 3, **kwargs)


def test_softmax_without_dim_picks_torchs_legacy_dim():
    theirs, ours = build("Softmax")
    x = _input((2, 3, 4), 1.0)  # 3-d: PyTorch's legacy rule picks dim 0
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        got, _ = interpret_forward(ours, [x])
    with pytest.warns(UserWarning):
        want = torch_forward(theirs, [x])
    assert_close(got, want, CPU_RTOL)


@pytest.mark.parametrize(
    "output_size",
    [
        pytest.param([10, 11], id="spatial"),
        pytest.param([1, 2, 9, 12], id="with_batch_and_channels"),
    ],
)
def test_conv_transpose_output_size_picks_output_padding(output_size):
    theirs, ours = build("ConvTranspose2d", (3, 2, 3), {"stride": 2, "padding": 1})
    x = _input((1, 3, 5, 6), 1.0)
    got, _ = interpret_forward(ours, [x], {"output_size": output_size})
    want = torch_forward(theirs, [x], {"output_size": output_size})
    assert got.shape[-2:] == tuple(output_size[-2:])
    assert_close(got, want, CPU_RTOL)


def test_conv_transpose_refuses_what_torch_refuses():
    import meganeura.nn as mnn
    from meganeura.nn.compiled import trace_call

    with pytest.raises(ValueError, match="zeros"):
        mnn.ConvTranspose2d(2, 2, 3, padding_mode="reflect")
    m = mnn.ConvTranspose2d(2, 2, 3, stride=2)
    with pytest.raises(ValueError, match="valid sizes range"):
        trace_call(m, m.forward, [np.zeros((1, 2, 4, 4), np.float32)], {"output_size": [20, 20]})


def test_embedding_of_ids_written_in_forward():
    """Position ids made with NumPy inside forward (as BERT's embeddings do) are constants."""
    import meganeura.nn as mnn

    class Positions(mnn.Module):
        def __init__(self):
            super().__init__()
            self.pos = mnn.Embedding(6, 3)

        def forward(self, x):
            return x + self.pos(np.arange(x.shape[1])[None])

    m = Positions()
    x = _input((2, 4, 3), 1.0)
    got, _ = interpret_forward(m, [x])
    want = x.astype(np.float64) + m.pos.weight.data[:4].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-12)
