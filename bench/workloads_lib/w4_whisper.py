"""W4: the Whisper-tiny encoder, meganeura's ``meganeura.models.whisper.WhisperEncoder`` against
transformers' ``WhisperForConditionalGeneration(WhisperConfig(...)).get_encoder()`` (HF names on
both sides; the fixed sinusoidal ``embed_positions`` keep their values). Training: encoder +
``head`` Linear(384 -> 64, no bias) + cross-entropy on labels t % 64.

The adapter: :data:`OURS`; until the module is merged :meth:`Whisper.missing` reports it and
the harness skips W4.
"""

from __future__ import annotations

import importlib

import numpy as np

from .base import Case, Workload
from .weights import sin_input

OURS = {
    "module": "meganeura.models.whisper",
    "config": "WhisperConfig",
    "encoder": "WhisperEncoder",
}
FULL = dict(
    d_model=384,
    encoder_layers=4,
    encoder_attention_heads=6,
    encoder_ffn_dim=1536,
    num_mel_bins=80,
    max_source_positions=1500,
)
QUICK = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    num_mel_bins=8,
    max_source_positions=16,
    decoder_layers=1,
    decoder_attention_heads=2,
    decoder_ffn_dim=64,
)
HEAD = 64


def _module():
    return importlib.import_module(OURS["module"])


def _with_head(nn, encoder, d_model, hidden):
    """The training model, in ``nn`` (``meganeura.nn`` or ``torch.nn``): ``head(hidden(
    encoder(mel)))`` with ``head`` Linear(d_model -> HEAD, no bias), parameters ``encoder.*``
    and ``head.weight``; ``hidden`` takes the hidden states [B, T, d_model] out of the encoder's
    output (transformers': ``.last_hidden_state``). Returned in train mode."""

    class WithHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder
            self.head = nn.Linear(d_model, HEAD, bias=False)

        def forward(self, x):
            return self.head(hidden(self.encoder(x)))

    return WithHead().train()


class Whisper(Workload):
    id, name, title = "w4", "whisper_tiny_enc", "Whisper-tiny encoder"
    fixed = ("embed_positions.weight", "encoder.embed_positions.weight")
    paper = {"fwd": ("fwd", 3.2, 4.0), "train": ("train", 14.3, 13.9), "first_s": 7}

    def missing(self):
        try:
            mod = _module()
        except ImportError as e:
            return f"{OURS['module']} does not import ({e})"
        for key in ("config", "encoder"):
            if not hasattr(mod, OURS[key]):
                return f"{OURS['module']} has no {OURS[key]}"
        return None

    def sizes(self, quick):
        return QUICK if quick else FULL

    def cases(self, quick):
        return [
            Case("fwd", "fwd"),
            Case("train", "train"),
            Case("fwdbwd", "fwdbwd"),
            Case("train_adam", "train", {}, ("adam", 1e-5)),
        ]

    def build_ours(self, case, quick):
        import meganeura as mn
        from meganeura import nn

        mn.manual_seed(0)
        mod = _module()
        enc = getattr(mod, OURS["encoder"])(getattr(mod, OURS["config"])(**self.sizes(quick)))
        if not case.trains:
            return enc.eval()
        return _with_head(nn, enc, self.sizes(quick)["d_model"], lambda out: out)

    def build_torch(self, case, quick):
        import transformers
        from torch import nn

        cfg = transformers.WhisperConfig(**self.sizes(quick))
        enc = transformers.WhisperForConditionalGeneration(cfg).get_encoder()
        if not case.trains:
            return enc.eval()
        return _with_head(nn, enc, self.sizes(quick)["d_model"], lambda out: out.last_hidden_state)

    def batch(self, case, quick):
        s = self.sizes(quick)
        mel = sin_input((1, s["num_mel_bins"], 2 * s["max_source_positions"]), 1.0)
        if case.kind == "fwd":
            return (mel,)
        t = s["max_source_positions"]
        return mel, (np.arange(t) % HEAD).astype(np.int32)

    def torch_forward(self, m, mel):
        return m(mel).last_hidden_state

    def ours_loss(self, model, mel, labels):
        import meganeura.nn.functional as F

        logits = model(mel)
        return F.cross_entropy(F.reshape(logits, (-1, HEAD)), labels)

    def torch_loss(self, m, mel, labels):
        import torch

        return torch.nn.functional.cross_entropy(m(mel).reshape(-1, HEAD).float(), labels)
