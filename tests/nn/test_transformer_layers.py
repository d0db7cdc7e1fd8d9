"""Transformer layers (``meganeura/nn/layers/transformer.py``) against torch.nn's: the same
arguments give the same state-dict layout and repr; with torch's weights loaded the outputs
match (NumPy interpreter in float64, compile-on-call on the GPU in f32, eval mode, so
torch's inference fast paths are what we compare with) and so do the gradients of every
parameter and input (float64, against torch.autograd).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import meganeura.nn as mnn
from meganeura.nn import functional as F

from .harness import (
    GPU_RTOL,
    assert_close,
    check_gradients,
    check_state_dict_layout,
    check_uniform,
    f32,
    interpret_forward,
    torch_forward,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*(deprecated|nested).*:UserWarning")
rng = np.random.default_rng(31)
E, H, FF, N, S, T = 8, 2, 16, 2, 5, 4
PAD = np.array([[False, False, False, True, True], [False, False, False, False, True]])
CAUSAL_BOOL = np.triu(np.ones((S, S), bool), 1)
CAUSAL = np.triu(np.full((S, S), -np.inf, np.float32), 1)
CAUSAL_T = np.triu(np.full((T, T), -np.inf, np.float32), 1)


def _r(*shape):
    return f32(rng.standard_normal(shape))


def _pair(cls: str, *args, **kwargs):
    """(torch module, ours) with torch's state dict loaded into ours, both in eval mode (our
    ``F.gelu`` as the activation is torch's for torch)."""
    tkw = {k: torch.nn.functional.gelu if v is F.gelu else v for k, v in kwargs.items()}
    theirs = getattr(torch.nn, cls)(*args, **tkw)
    ours = getattr(mnn, cls)(*args, **kwargs)
    check_state_dict_layout(theirs, ours)
    ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    return theirs.eval(), ours.eval()


def _stack(kind: str, num_layers: int, norm: bool, **kwargs):
    """TransformerEncoder/Decoder of ``num_layers`` copies, built alike on both sides."""
    layer_cls = f"Transformer{kind}Layer"
    theirs_layer = getattr(torch.nn, layer_cls)(E, H, FF, **kwargs)
    ours_layer = getattr(mnn, layer_cls)(E, H, FF, **kwargs)
    tn = torch.nn.LayerNorm(E) if norm else None
    on = mnn.LayerNorm(E) if norm else None
    extra = {"enable_nested_tensor": False} if kind == "Encoder" else {}
    theirs = getattr(torch.nn, f"Transformer{kind}")(theirs_layer, num_layers, tn, **extra)
    ours = getattr(mnn, f"Transformer{kind}")(ours_layer, num_layers, on)
    check_state_dict_layout(theirs, ours)
    ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    return theirs.eval(), ours.eval()


# id -> (constructor kwargs, inputs, forward kwargs)
ENCODER = {
    "post_norm-seq_first": ({}, lambda: [_r(S, N, E)], lambda: {}),
    "batch_first-padding": ({"batch_first": True}, lambda: [_r(N, S, E)],
                            lambda: {"src_key_padding_mask": PAD}),
    "norm_first-gelu-float_mask": ({"norm_first": True, "activation": "gelu"},
                                   lambda: [_r(S, N, E)], lambda: {"src_mask": _r(S, S)}),
    "causal_hint": ({"batch_first": True}, lambda: [_r(N, S, E)],
                    lambda: {"src_mask": CAUSAL, "is_causal": True}),
    "bool_mask-padding-no_bias": ({"batch_first": True, "bias": False}, lambda: [_r(N, S, E)],
                                  lambda: {"src_mask": CAUSAL_BOOL, "src_key_padding_mask": PAD}),
    "callable_activation-unbatched": ({"activation": F.gelu}, lambda: [_r(S, E)], lambda: {}),
}  # fmt: skip
DECODER = {
    "post_norm-seq_first": ({}, lambda: [_r(T, N, E), _r(S, N, E)],
                            lambda: {"tgt_mask": CAUSAL_T}),
    "batch_first-norm_first-masks": (
        {"batch_first": True, "norm_first": True},
        lambda: [_r(N, T, E), _r(N, S, E)],
        lambda: {"tgt_mask": CAUSAL_T, "tgt_is_causal": True, "memory_key_padding_mask": PAD,
                 "memory_mask": _r(T, S)},
    ),
    "gelu-unbatched": ({"activation": "gelu"}, lambda: [_r(T, E), _r(S, E)], lambda: {}),
}  # fmt: skip


# The layers print as the pinned torch (the test extra's 2.13) does; older torch prints fewer
# arguments (the norms' bias= came in 2.13's reprs), so only the values are compared there.
SAME_REPRS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _params(table):
    return [pytest.param(kw, xs, fkw, id=k) for k, (kw, xs, fkw) in table.items()]


@pytest.mark.parametrize("kwargs, inputs, forward_kwargs", _params(ENCODER))
def test_encoder_layer_matches_torch(kwargs, inputs, forward_kwargs):
    theirs, ours = _pair("TransformerEncoderLayer", E, H, FF, **kwargs)
    assert repr(ours) == repr(theirs) or not SAME_REPRS
    xs, fkw = inputs(), forward_kwargs()
    got, _ = interpret_forward(ours, xs, fkw)
    assert_close(got, torch_forward(theirs, xs, fkw), 1e-10)
    check_gradients(theirs, ours, xs, fkw)


@pytest.mark.parametrize("kwargs, inputs, forward_kwargs", _params(DECODER))
def test_decoder_layer_matches_torch(kwargs, inputs, forward_kwargs):
    theirs, ours = _pair("TransformerDecoderLayer", E, H, FF, **kwargs)
    assert repr(ours) == repr(theirs) or not SAME_REPRS
    xs, fkw = inputs(), forward_kwargs()
    got, _ = interpret_forward(ours, xs, fkw)
    assert_close(got, torch_forward(theirs, xs, fkw), 1e-10)
    check_gradients(theirs, ours, xs, fkw)


@pytest.mark.parametrize("norm", [False, True], ids=["no_norm", "norm"])
def test_encoder_stack_matches_torch(norm):
    theirs, ours = _stack("Encoder", 2, norm, batch_first=True)
    assert list(ours.state_dict())[0] == "layers.0.self_attn.in_proj_weight"
    assert ours.layers[0].linear1.weight is not ours.layers[1].linear1.weight
    xs, fkw = [_r(N, S, E)], {"mask": CAUSAL, "src_key_padding_mask": PAD}
    got, _ = interpret_forward(ours, xs, fkw)
    assert_close(got, torch_forward(theirs, xs, fkw), 1e-10)
    check_gradients(theirs, ours, xs, fkw)


def test_decoder_stack_matches_torch():
    theirs, ours = _stack("Decoder", 2, True)
    xs, fkw = [_r(T, N, E), _r(S, N, E)], {"tgt_mask": CAUSAL_T}
    got, _ = interpret_forward(ours, xs, fkw)
    assert_close(got, torch_forward(theirs, xs, fkw), 1e-10)
    check_gradients(theirs, ours, xs, fkw)


def test_transformer_matches_torch_and_initializes_as_torch():
    kw = dict(d_model=E, nhead=H, num_encoder_layers=2, num_decoder_layers=1,
              dim_feedforward=FF, batch_first=True)  # fmt: skip
    fresh = mnn.Transformer(**kw)
    w = fresh.encoder.layers[0].linear1.weight.data
    check_uniform(w, np.sqrt(6.0 / (E + FF)))  # xavier_uniform_, as torch's _reset_parameters
    theirs, ours = _pair("Transformer", **kw)
    mask = mnn.Transformer.generate_square_subsequent_mask(T)
    np.testing.assert_array_equal(mask, torch.nn.Transformer.generate_square_subsequent_mask(T))
    # memory_key_padding_mask too: torch's nested-tensor encoder path zeroes padded positions
    fkw = {"tgt_mask": mask, "src_key_padding_mask": PAD, "memory_key_padding_mask": PAD}
    xs = [_r(N, S, E), _r(N, T, E)]
    got, _ = interpret_forward(ours, xs, fkw)
    assert_close(got, torch_forward(theirs, xs, fkw), 1e-10)


def test_dropout_in_train_mode_changes_the_output_and_eval_does_not():
    layer = mnn.TransformerEncoderLayer(E, H, FF, dropout=0.5, batch_first=True)
    x = _r(N, S, E)
    a, b = layer(x), layer(x)
    assert not np.allclose(a, b)
    layer.eval()
    np.testing.assert_array_equal(layer(x), layer(x))


def test_errors_as_torch():
    with pytest.raises(RuntimeError, match="relu/gelu"):
        mnn.TransformerEncoderLayer(E, H, activation="tanh")
    layer = mnn.TransformerEncoderLayer(E, H, FF)
    with pytest.raises(RuntimeError, match="attn_mask"):
        interpret_forward(layer, [_r(S, N, E)], {"is_causal": True})


def test_a_layer_that_has_run_can_be_copied():
    layer = mnn.TransformerEncoderLayer(E, H, FF, batch_first=True).eval()
    x = _r(N, S, E)
    before = layer(x)
    twin = copy.deepcopy(layer)
    np.testing.assert_allclose(twin(x), before, rtol=1e-6)
    layer.linear2.bias.data = np.ones(E, np.float32)  # the copy has its own tensors
    np.testing.assert_allclose(twin(x), before, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["batch_first-padding", "norm_first-gelu-float_mask"])
def test_encoder_layer_on_the_gpu(gpu_device, case):
    kwargs, inputs, forward_kwargs = ENCODER[case]
    theirs, ours = _pair("TransformerEncoderLayer", E, H, FF, **kwargs)
    xs, fkw = inputs(), forward_kwargs()
    assert_close(ours(*xs, **fkw), torch_forward(theirs, xs, fkw), GPU_RTOL)


@pytest.mark.gpu
def test_encoder_decoder_on_the_gpu(gpu_device):
    theirs, ours = _pair("Transformer", d_model=E, nhead=H, num_encoder_layers=1,
                         num_decoder_layers=1, dim_feedforward=FF)  # fmt: skip
    xs, fkw = [_r(S, N, E), _r(T, N, E)], {"tgt_mask": CAUSAL_T}
    assert_close(ours(*xs, **fkw), torch_forward(theirs, xs, fkw), GPU_RTOL)
