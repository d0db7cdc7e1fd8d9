"""The built-in models ``meganeura tune MODEL`` tunes: their programs, compiled, never run.

A model here is only a source of matmul shapes: it is traced with empty weights
(``nn.init.empty_weights``: nothing is drawn or uploaded) and compiled for the device's
limits, for a training step (forward, backward, AdamW update, as ``Trainer`` compiles it:
parameters with ``requires_grad=False`` are not trained) and for the forward alone.

The paper's five workloads (``WORKLOADS``, W1-W5 of ``bench/workloads.py``) are here at the
sizes of their headline cells, which are their defaults (``SIZES``): ``meganeura tune whisper``
compiles exactly the programs whose products ``bench/workloads.py --cases w4:fwd,w4:train``
runs. Convolutions lower to conv2d gemm kernels, not to matmuls: they are not in
``Program.meta["matmuls"]`` and the matmul tuner does not see them (``conv_dispatches``
counts them); ``resnet50`` has only its classifier's products and ``unet`` none.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..codegen.kernel import Limits
from ..schedule.program import Program

MODELS = {
    "mnist": "the MNIST MLP, 784-HIDDEN-10 (meganeura train mnist); --batch-size rows "
    "(default 64), --hidden width (default 128)",
    "smollm2": "W1, SmolLM2-135M (meganeura generate/finetune); --batch-size (default 1) x "
    "--seq-len (default 128) tokens, --layers decoder layers (default 1: all layers have the "
    "same shapes)",
    "smolvla": "W2, the SmolVLA action expert (SmolVLAConfig: width 720, 16 layers); "
    "--batch-size (default 1) x --seq-len action tokens (the chunk, default 50) over a VLM "
    "context of 16 tokens, --layers (default 16)",
    "resnet50": "W3, ResNet-50 on 224 x 224 images, --batch-size (default 4); its "
    "convolutions are conv2d gemm kernels, not matmuls: only the classifier's products",
    "whisper": "W4, the Whisper-tiny encoder on 30 s of audio (80 mel bins x 3000 frames, 1500 "
    "positions), --batch-size (default 1), --layers (default 4); training adds a "
    "Linear(384 -> 64) head",
    "unet": "W5, the conv U-Net (UNetConfig, base 64) on 4 x 32 x 32 latents, --batch-size "
    "(default 2); convolutions only: no matmul products to tune",
}

# The sizes each model takes and their defaults: those of bench/workloads.py's headline cells
# for the workloads (w1:fwd_seq128/train_seq128, w2:fwd_chunk50/train_chunk50, w3:fwd_b4/
# train_b4, w4:fwd/train, w5:fwd_small_b2/train_small_b2).
SIZES: dict[str, dict[str, int]] = {
    "mnist": {"batch": 64, "hidden": 128},
    "smollm2": {"batch": 1, "seq": 128, "layers": 1},
    "smolvla": {"batch": 1, "seq": 50, "layers": 16},
    "resnet50": {"batch": 4},
    "whisper": {"batch": 1, "layers": 4},
    "unet": {"batch": 2},
}

# W1-W5, in the paper's order: what ``meganeura tune --workloads`` tunes.
WORKLOADS = ("smollm2", "smolvla", "resnet50", "whisper", "unet")

VLM_CONTEXT = 16  # W2's VLM keys/values per cross-attention layer (bench's VLM_CONTEXT)
WHISPER_HEAD = 64  # W4's training head: Linear(d_model -> 64), cross-entropy on t % 64


def model_programs(
    name: str,
    limits: Limits,
    batch: int | None = None,
    seq: int | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    modes: tuple[str, ...] = ("train", "forward"),
) -> dict[str, Program]:
    """Compiled programs of a built-in model, by mode (``"train"``, ``"forward"``).

    A size left None takes the model's default (``SIZES``: the workload cell's); a size the
    model does not take must be None.

    Args:
        name: a key of ``MODELS``.
        limits: the device's limits (``training.device_limits``).
        batch: rows (mnist), sequences (smollm2, smolvla), images (resnet50, unet) or audio
            clips (whisper) per step, >= 1.
        seq: tokens per sequence (smollm2) or action tokens per chunk (smolvla), >= 1.
        hidden: hidden width (mnist), >= 1.
        layers: decoder layers (smollm2), expert layers (smolvla), encoder layers (whisper).
        modes: which programs.

    Returns:
        {mode: Program}, compiled for ``limits`` (their ``meta["matmuls"]`` list the products).

    Raises:
        ValueError: an unknown model or mode, a size < 1, or a size the model does not take.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    bad = [m for m in modes if m not in ("train", "forward")]
    if bad:
        raise ValueError(f"modes are 'train' and 'forward', got {bad}")
    given = {"batch": batch, "seq": seq, "hidden": hidden, "layers": layers}
    extra = [k for k, v in given.items() if v is not None and k not in SIZES[name]]
    if extra:
        raise ValueError(
            f"{name} takes the sizes {sorted(SIZES[name])}, not {extra} (see tune.models.MODELS)"
        )
    sizes = {k: given[k] if given[k] is not None else v for k, v in SIZES[name].items()}
    for what, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be an int >= 1, got {v!r}")
    from .. import nn
    from ..compile import CompileOptions, compile
    from ..nn.compiled import trace_call
    from ..nn.parameter import Parameter
    from ..optim import AdamW

    programs = {}
    with nn.init.empty_weights():
        for mode in ("train", "forward"):
            if mode not in modes:
                continue
            model, fn, args = _BUILDERS[name](mode == "train", **sizes)
            traced = trace_call(model, fn, args, {})
            if mode == "train":
                trainable = tuple(  # as Trainer: frozen parameters get no gradient
                    n
                    for n, o in traced.trace.objects.items()
                    if isinstance(o, Parameter) and o.requires_grad
                )
                options = CompileOptions(loss="loss", optimizer=AdamW(lr=1e-3), trainable=trainable)
            else:
                options = CompileOptions()
            programs[mode] = compile(traced.graph, options, limits)
    return programs


def conv_dispatches(program: Program) -> int:
    """Dispatches of a program's convolutions (forward and backward, split-K sums included):
    conv2d gemm kernels, which the matmul tuner does not tune."""
    return sum(1 for d in program.dispatches if " conv" in f" {d.name}")


# ---------------------------------------------------------------------------- the builders
# Each returns (module, fn, args): ``fn(*args)`` is traced, reading ``module``; it returns
# {"loss": scalar} for training and the model's output for the forward.


def _mnist(train: bool, batch: int, hidden: int):
    from ..models.mlp import MLP
    from ..nn import functional as F

    model = MLP((784, hidden, 10))
    x = np.zeros((batch, 784), np.float32)
    if train:  # as models.mlp.build_mlp traces it

        def forward(x, y):
            logits = model(x)
            return {"logits": logits, "loss": F.cross_entropy(logits, y)}

        return model, forward, (x, np.zeros((batch,), np.int32))
    return model, lambda x: {"logits": model(x)}, (x,)


def _smollm2(train: bool, batch: int, seq: int, layers: int):
    from ..models.llama import SMOLLM2_135M, LlamaForCausalLM, lm_loss

    model = LlamaForCausalLM(replace(SMOLLM2_135M, num_hidden_layers=layers))
    ids = np.zeros((batch, seq), np.int32)
    if train:
        return model, lambda i, y: {"loss": lm_loss(model, i, y)}, (ids, ids)
    return model, lambda i: {"logits": model(i)}, (ids,)


def _smolvla(train: bool, batch: int, seq: int, layers: int):
    from ..models.smolvla import SmolVLAActionExpert, SmolVLAConfig, flow_loss

    cfg = replace(SmolVLAConfig(), chunk_size=seq, num_hidden_layers=layers)
    model = SmolVLAActionExpert(cfg)
    noisy = np.zeros((batch, seq, cfg.max_action_dim), np.float32)
    timestep = np.zeros((batch, 2 * cfg.hidden_size), np.float32)
    vlm_kv = np.zeros((batch, VLM_CONTEXT, cfg.vlm_kv_dim), np.float32)
    if train:
        fn = lambda x, t, kv, y: {"loss": flow_loss(model, x, t, kv, y)}  # noqa: E731
        return model, fn, (noisy, timestep, vlm_kv, noisy)
    return model, model.forward, (noisy, timestep, vlm_kv)


def _resnet50(train: bool, batch: int):
    from ..models.resnet import CONFIGS, ResNet
    from ..nn import functional as F

    model = ResNet(CONFIGS["resnet50"])
    x = np.zeros((batch, 3, 224, 224), np.float32)
    if train:
        model.train()
        labels = np.zeros((batch,), np.int32)
        return model, lambda x, y: {"loss": F.cross_entropy(model(x), y)}, (x, labels)
    return model.eval(), model.forward, (x,)


def _whisper(train: bool, batch: int, layers: int):
    from .. import nn
    from ..models.whisper import WhisperConfig, WhisperEncoder
    from ..nn import functional as F

    cfg = WhisperConfig(encoder_layers=layers)
    encoder = WhisperEncoder(cfg)
    mel = np.zeros((batch, cfg.num_mel_bins, 2 * cfg.max_source_positions), np.float32)
    if not train:
        return encoder.eval(), encoder.forward, (mel,)

    class WithHead(nn.Module):  # bench/workloads_lib/w4_whisper.py's training model
        def __init__(self):
            super().__init__()
            self.encoder = encoder
            self.head = nn.Linear(cfg.d_model, WHISPER_HEAD, bias=False)

        def forward(self, x):
            return self.head(self.encoder(x))

    model = WithHead().train()
    labels = np.zeros((batch * cfg.max_source_positions,), np.int32)

    def loss(x, y):
        return {"loss": F.cross_entropy(F.reshape(model(x), (-1, WHISPER_HEAD)), y)}

    return model, loss, (mel, labels)


def _unet(train: bool, batch: int):
    from ..models.unet import UNet, UNetConfig
    from ..nn import functional as F

    model = UNet(UNetConfig())
    x = np.zeros((batch, 4, 32, 32), np.float32)
    if train:
        model.train()
        return model, lambda x, y: {"loss": F.mse_loss(model(x), y)}, (x, x)
    return model.eval(), model.forward, (x,)


_BUILDERS = {
    "mnist": _mnist,
    "smollm2": _smollm2,
    "smolvla": _smolvla,
    "resnet50": _resnet50,
    "whisper": _whisper,
    "unet": _unet,
}
