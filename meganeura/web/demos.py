"""The bundles of the demo pages that ``meganeura export`` does not write: a byte-level causal
language model (``text.html``), a Llama of the model zoo (``meganeura.models.llama``) over a
256-token vocabulary where token ``i`` is the byte ``i`` (UTF-8 text needs no tokenizer).

Its weights are random (seeded), so the page's text is noise: the demo shows that a zoo
transformer's compiled program (embedding, RMSNorm, rotary attention, SwiGLU, LM head) runs in
the browser with the Python session's numbers, not a trained model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..export import export


def byte_lm(
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
):
    """A ``LlamaForCausalLM`` with a 256-token (byte) vocabulary and seeded random weights,
    in eval mode: ``forward(input_ids int32[1, S])`` -> logits f32[1, S, 256]."""
    from .. import manual_seed
    from ..models.llama import LlamaConfig, LlamaForCausalLM

    manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


def export_byte_lm(
    out: str | Path, seq_len: int = 16, seed: int = 0, target: str = "web", device=None
) -> Path:
    """Export :func:`byte_lm` for one sequence of ``seq_len`` tokens (input ``input_ids``
    int32[1, seq_len], output ``output`` f32[1, seq_len, 256]) as a bundle at ``out``
    (replaced if present). The manifest's ``meta``: ``model: byte-lm``, ``seq_len``, ``seed``.

    A page generates greedily with the fixed length: the logits at position ``i`` depend only
    on tokens ``0..i`` (causal attention), so the positions after the text may hold anything.
    """
    model = byte_lm(seed)
    ids = np.zeros((1, seq_len), np.int32)
    meta = {"model": "byte-lm", "seq_len": seq_len, "seed": seed, "vocab": "bytes"}
    return export(model, out, (ids,), target=target, overwrite=True, device=device, meta=meta)
