"""The built-in models ``meganeura tune MODEL`` tunes: their programs, compiled, never run.

A model here is only a source of matmul shapes: it is traced with empty weights
(``nn.init.empty_weights``: nothing is drawn or uploaded) and compiled for the device's
limits, for a training step (forward, backward, AdamW update) and for the forward alone.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..codegen.kernel import Limits
from ..schedule.program import Program

MODELS = {
    "mnist": "the MNIST MLP, 784-HIDDEN-10 (meganeura train mnist); --batch-size rows",
    "smollm2": "SmolLM2-135M (meganeura generate/finetune); --batch-size x --seq-len tokens, "
    "--layers decoder layers (all layers have the same shapes)",
}


def model_programs(
    name: str,
    limits: Limits,
    batch: int = 64,
    seq: int = 128,
    hidden: int = 128,
    layers: int | None = None,
    modes: tuple[str, ...] = ("train", "forward"),
) -> dict[str, Program]:
    """Compiled programs of a built-in model, by mode (``"train"``, ``"forward"``).

    Args:
        name: a key of ``MODELS``.
        limits: the device's limits (``training.device_limits``).
        batch: rows (mnist) or sequences (smollm2) per step, >= 1.
        seq: tokens per sequence (smollm2), >= 1.
        hidden: hidden width (mnist), >= 1.
        layers: decoder layers (smollm2; None: the model's 30).
        modes: which programs.

    Raises:
        ValueError: an unknown model or mode, or a size < 1.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    bad = [m for m in modes if m not in ("train", "forward")]
    if bad:
        raise ValueError(f"modes are 'train' and 'forward', got {bad}")
    for what, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("layers", layers or 1)):
        if v < 1:
            raise ValueError(f"{what} must be >= 1, got {v}")
    from .. import nn
    from ..compile import CompileOptions, compile
    from ..optim import AdamW

    train_options = CompileOptions(loss="loss", optimizer=AdamW(lr=1e-3))
    graphs = {}
    with nn.init.empty_weights():
        if name == "mnist":
            from ..models.mlp import build_mlp

            if "train" in modes:
                graphs["train"] = build_mlp(batch, (784, hidden, 10), labels=True).graph
            if "forward" in modes:
                graphs["forward"] = build_mlp(batch, (784, hidden, 10), labels=False).graph
        else:
            from ..models.llama import SMOLLM2_135M, LlamaForCausalLM, lm_loss

            cfg = (
                SMOLLM2_135M if layers is None else replace(SMOLLM2_135M, num_hidden_layers=layers)
            )
            model = LlamaForCausalLM(cfg)
            ids = np.zeros((batch, seq), np.int32)
            if "train" in modes:
                graphs["train"] = nn.trace(
                    model, ids, ids, fn=lambda i, y: {"loss": lm_loss(model, i, y)}
                )
            if "forward" in modes:
                graphs["forward"] = nn.trace(model, ids, fn=lambda i: {"logits": model(i)})
    return {
        mode: compile(g, train_options if mode == "train" else CompileOptions(), limits)
        for mode, g in graphs.items()
    }
