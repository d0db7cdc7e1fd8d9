"""``bench/lever_ab.py`` on lavapipe: the levers switch what compiles (the U-Net decoder's
broadcast copies come back with ``broadcast_views`` off), every switch is restored after a
build, and an unknown lever is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import lever_ab
from meganeura.passes import broadcast_views

ROOT = Path(__file__).resolve().parents[2]


def test_a_lever_changes_the_program_and_is_restored(tmp_path):
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "bench/lever_ab.py", "--quick", "--cases", "w5:fwd_small_b2",
           "--levers", "broadcast_views", "--rounds", "1", "--repeats", "2", "--warmup", "1",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "w5:fwd_small_b2" and row["off"] == ["broadcast_views"]
    # the nearest-2x upsample's broadcast_to copies run again with the lever off
    assert row["dispatches_off"] == row["dispatches_on"] + 4
    assert row["ms_on"] > 0 and row["ms_off"] > 0


def test_switch_sets_and_restores():
    lever_ab.switch("broadcast_views", False)
    try:
        assert broadcast_views.enabled() is False
    finally:
        lever_ab.switch("broadcast_views", True)
    assert broadcast_views.enabled() is True
    with pytest.raises(KeyError, match="unknown lever 'nope'; levers: norm_prologue"):
        lever_ab.switch("nope", True)
