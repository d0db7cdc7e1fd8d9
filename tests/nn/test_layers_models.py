"""Small models written once against an ``nn`` namespace and built from torch.nn and from
meganeura.nn: the same code, the same state-dict keys, the same outputs and gradients.

This is the porting promise at small scale: rename ``torch.nn`` to ``mn.nn``, load the torch
model's state dict, get the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch

import meganeura.nn as mnn

from .harness import (
    GPU_RTOL,
    assert_close,
    check_gradients,
    check_state_dict_layout,
    f32,
    interpret_forward,
    torch_forward,
)

rng = np.random.default_rng(13)


def convnet(nn):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding="same", groups=2, bias=False),
        nn.GroupNorm(2, 8),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(32, 10),
    )


def encoder_block(nn):
    class Block(nn.Module):
        """A pre-LN transformer block over [N, L, E]."""

        def __init__(self, e=16, heads=4):
            super().__init__()
            self.embed = nn.Embedding(20, e, padding_idx=0)
            self.ln1 = nn.LayerNorm(e)
            self.attn = nn.MultiheadAttention(e, heads, dropout=0.1, batch_first=True)
            self.ln2 = nn.LayerNorm(e)
            self.mlp = nn.Sequential(nn.Linear(e, 2 * e), nn.GELU("tanh"), nn.Linear(2 * e, e))
            self.norm = nn.RMSNorm(e, eps=1e-6)

        def forward(self, ids, pad):
            x = self.embed(ids)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
            x = x + self.mlp(self.ln2(x))
            return self.norm(x)

    return Block()


def _pair(factory):
    theirs, ours = factory(torch.nn), factory(mnn)
    check_state_dict_layout(theirs, ours)
    ours.load_state_dict({k: v.numpy() for k, v in theirs.state_dict().items()})
    return theirs, ours


def test_convnet_eval_matches_torch(gpu_device):
    theirs, ours = _pair(convnet)
    theirs.eval(), ours.eval()
    theirs[1].running_var.uniform_(0.5, 2.0)  # non-trivial statistics, loaded into ours
    ours.load_state_dict({k: v.numpy() for k, v in theirs.state_dict().items()})
    x = f32(rng.standard_normal((2, 3, 8, 8)))
    want = torch_forward(theirs, [x])
    assert_close(interpret_forward(ours, [x])[0], want, 1e-10)
    assert_close(ours(x), want, GPU_RTOL)


def test_convnet_train_gradients_match_torch():
    theirs, ours = _pair(convnet)
    theirs[9].p = ours[9].p = 0.0  # dropout masks differ between the two; BatchNorm trains
    check_gradients(theirs, ours, [f32(rng.standard_normal((2, 3, 8, 8)))])


IDS = np.array([[3, 7, 1, 0, 0], [5, 2, 9, 4, 0]], np.int64)
PAD = IDS == 0


def test_encoder_block_matches_torch(gpu_device):
    theirs, ours = _pair(encoder_block)
    theirs.eval(), ours.eval()
    want = torch_forward(theirs, [IDS, PAD])
    assert_close(interpret_forward(ours, [IDS, PAD])[0], want, 1e-10)
    assert_close(ours(IDS, PAD), want, GPU_RTOL)


def test_encoder_block_gradients_match_torch():
    theirs, ours = _pair(encoder_block)
    theirs.eval(), ours.eval()  # dropout off on both sides
    check_gradients(theirs, ours, [IDS, PAD])
