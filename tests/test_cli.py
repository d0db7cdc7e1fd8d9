"""The command line: info, profile, and the parser (GPU tests skip without an adapter)."""

from __future__ import annotations

import json

import pytest

from meganeura.cli import build_parser, main


def test_parser_knows_every_command():
    p = build_parser()
    args = p.parse_args(["profile", "mnist", "--forward", "--repeats", "3", "--by", "op"])
    assert (args.command, args.job, args.mode, args.repeats, args.by) == (
        "profile",
        "mnist",
        "forward",
        3,
        "op",
    )
    assert p.parse_args(["profile", "mnist"]).mode == "train"
    with pytest.raises(SystemExit):
        p.parse_args(["profile", "mnist", "--train", "--forward"])
    for command in (["info"], ["train", "mnist"], ["predict", "--checkpoint", "c"]):
        assert p.parse_args(command).command == command[0]


@pytest.mark.gpu
def test_info_prints_the_adapter(gpu_device, capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"adapter:      {gpu_device.info.get('device', '')}" in out
    assert "timestamp-query=" in out


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["--train", "--forward"])
def test_profile_writes_a_trace(gpu_device, tmp_path, capsys, mode):
    if "timestamp-query" not in gpu_device.features:
        pytest.skip(f"{gpu_device.name} has no timestamp-query")
    trace = tmp_path / "trace.json"
    argv = ["profile", "mnist", mode, "--batch-size", "8", "--hidden", "16"]
    assert main([*argv, "--repeats", "2", "--warmup", "1", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "compile:" in out and "session:" in out and "step:" in out
    assert "matmul" in out
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert events and len(events) % 2 == 0  # one per dispatch per repeat
    assert {e["args"]["repeat"] for e in events} == {0, 1}
    assert all(e["dur"] >= 0 for e in events)
    names = {e["name"].split(" ", 1)[1] for e in events}
    assert "matmul" in names
    # training runs the four Adam updates as one kernel, "adam_update group of 4"
    assert any(n.startswith("adam_update") for n in names) == (mode == "--train")


@pytest.mark.gpu
def test_train_prints_a_compile_summary(gpu_device, tmp_path, capsys):
    argv = ["train", "mnist", "--epochs", "1", "--hidden", "16", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("compile:")]
    assert len(lines) == 1
    assert " s creating " in lines[0] and "pipelines" in lines[0]
