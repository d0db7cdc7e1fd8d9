"""One small training run per architecture family, through the real GPU path (lavapipe on CI):
the conv net module (BatchNorm, max pooling) for an epoch of the MNIST subset, and the two-layer
causal decoder module (RMSNorm, RoPE, grouped-query attention, SwiGLU), each checked step by step
against a torch float32 run of the same model. Both train with ``mn.Trainer``; the conv net then
classifies in eval mode with ``model(x)``, the decoder predicts the sequence it memorized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.data.mnist import iterate_batches, load_mnist, standardize
from meganeura.models.convnet import ConvNet
from meganeura.models.transformer import CausalLM, TransformerConfig, lm_loss
from meganeura.optim import AdamW

pytestmark = pytest.mark.gpu


class TorchConvNet(torch.nn.Module):
    """``ConvNet`` in plain PyTorch (same layers, same state-dict names), float32."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        pool = torch.nn.functional.max_pool2d
        x = pool(torch.relu(self.bn1(self.conv1(x))), 2)
        x = pool(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def test_convnet_mnist_trains_as_torch_does(gpu_device):
    # One epoch of the MNIST subset (62 full batches of 64) from one initial state, on the same
    # batches, here and in a float32 torch twin (AdamW with torch's defaults but weight decay
    # 1e-2, as ours). On lavapipe every loss agreed to 1e-6 relative and both nets classified
    # 90.5% of the test images (torch after one epoch, seeds 0-3: 90.5-92.2%); the bounds leave
    # room for other reduction orders.
    data = load_mnist(seed=0)
    x_train, mean, std = standardize(data.x_train)
    x_test, _, _ = standardize(data.x_test, mean, std)
    x_train = x_train.reshape(-1, 1, 28, 28)
    x_test = x_test.reshape(-1, 1, 28, 28)
    mn.manual_seed(0)
    model = ConvNet()
    ref = TorchConvNet()
    ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in model.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
    tr = mn.Trainer(
        model, AdamW(lr=1e-3), lambda m, x, y: F.cross_entropy(m(x), y), device=gpu_device
    )
    rng = np.random.default_rng(1)
    losses, ref_losses = [], []
    for idx in iterate_batches(len(x_train), 64, rng):
        losses.append(tr.step(x_train[idx], data.y_train[idx]))
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            ref(torch.from_numpy(x_train[idx])), torch.from_numpy(data.y_train[idx]).long()
        )
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    state = model.state_dict()
    assert int(state["bn1.num_batches_tracked"]) == len(losses) == 62
    np.testing.assert_allclose(  # running statistics, updated as torch's
        state["bn1.running_var"], ref.bn1.running_var.numpy(), rtol=0.05, atol=1e-3
    )
    model.eval()  # running statistics, read from the trainer's copy on the GPU
    pred = np.concatenate([model(x_test[i : i + 500]) for i in range(0, 1000, 500)]).argmax(1)
    acc = float((pred == data.y_test).mean())
    ref.eval()
    with torch.no_grad():
        ref_acc = float((ref(torch.from_numpy(x_test)).argmax(1).numpy() == data.y_test).mean())
    assert np.mean(losses[:10]) > 1.0 > np.mean(losses[-10:])
    assert acc >= 0.88, (acc, ref_acc)
    assert abs(acc - ref_acc) <= 0.01, (acc, ref_acc)


class TorchDecoder(torch.nn.Module):
    """The same decoder in plain PyTorch (HF Llama conventions), float32."""

    def __init__(self, cfg: TransformerConfig, params: dict[str, np.ndarray]):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict(
            {
                k.replace(".", "__"): torch.nn.Parameter(torch.from_numpy(v.copy()))
                for k, v in params.items()
            }
        )

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def rms(self, x, name):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_norm_eps) * self.w(name)

    def rope(self, x):
        d, seq = x.shape[-1], x.shape[-2]
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        f = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        emb = torch.cat([f, f], -1)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()

    def forward(self, ids):
        cfg = self.cfg
        bsz, seq = ids.shape
        hd = cfg.head_dim
        x = self.w("model.embed_tokens.weight")[ids]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            h = self.rms(x, f"{p}.input_layernorm.weight")

            def heads(t, n):
                return t.view(bsz, seq, n, hd).transpose(1, 2)

            q = self.rope(heads(h @ self.w(f"{p}.self_attn.q_proj.weight").T, cfg.num_heads))
            k = self.rope(heads(h @ self.w(f"{p}.self_attn.k_proj.weight").T, cfg.num_kv_heads))
            v = heads(h @ self.w(f"{p}.self_attn.v_proj.weight").T, cfg.num_kv_heads)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(bsz, seq, cfg.num_heads * hd)
            x = x + o @ self.w(f"{p}.self_attn.o_proj.weight").T
            h = self.rms(x, f"{p}.post_attention_layernorm.weight")
            g = torch.nn.functional.silu(h @ self.w(f"{p}.mlp.gate_proj.weight").T)
            u = h @ self.w(f"{p}.mlp.up_proj.weight").T
            x = x + (g * u) @ self.w(f"{p}.mlp.down_proj.weight").T
        return self.rms(x, "model.norm.weight") @ self.w("lm_head.weight").T


def test_transformer_loss_falls_and_matches_torch(gpu_device):
    cfg = TransformerConfig()
    text = b"the quick brown fox jumps over the lazy dog; " * 4
    tokens = np.frombuffer(text, np.uint8).astype(np.int32) % cfg.vocab_size
    seq = 32
    ids = tokens[:seq][None]
    labels = tokens[1 : seq + 1][None]
    mn.manual_seed(0)
    lm = CausalLM(cfg)
    params = lm.state_dict()
    tr = mn.Trainer(lm, AdamW(lr=1e-2, weight_decay=0.0), lm_loss, device=gpu_device)
    ours = [tr.step(ids, labels) for _ in range(40)]

    model = TorchDecoder(cfg, params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ref = []
    for _ in range(5):
        opt.zero_grad()
        logits = model(torch.from_numpy(ids).long())
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, cfg.vocab_size), torch.from_numpy(labels).long().reshape(-1)
        )
        loss.backward()
        opt.step()
        ref.append(loss.item())
    np.testing.assert_allclose(ours[:5], ref, atol=1e-4)
    assert ours[0] > 3.5  # ~ln(64) at initialization
    assert ours[-1] < 0.5, ours[-1]  # the 32-token sequence is memorized
    assert (lm(ids).argmax(-1) == labels).mean() >= 0.9
