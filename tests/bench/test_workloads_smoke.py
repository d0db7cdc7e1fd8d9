"""Smoke test of the paper's evaluation harness (``bench/workloads.py``, issue 14 item 6): every
available workload at CPU size on lavapipe, in this process, PyTorch eager only: one forward
case and the training step of each (ResNet: the training step alone, whose loss gates its
train-mode forward; its eval forward costs lavapipe another 6 s), strict f32, and the U-Net
forward in fast mode. Checks that
every gate passes and that the result file has the agreed keys; no timing is asserted.

W2 (SmolVLA) and W4 (Whisper) are "not available" until their model modules are merged; the
test then checks that they are reported so, not that they ran.
"""

from __future__ import annotations

import json

import pytest

from bench.workloads import main
from bench.workloads_lib.registry import WORKLOADS
from bench.workloads_lib.rows import KEYS

SMOKE = [
    "w1:fwd_seq16",
    "w1:train_seq16",
    "w2:fwd_chunk10",
    "w2:train_chunk10",
    "w3:train_b4",
    "w4:fwd",
    "w4:train",
    "w5:fwd_small_b2",
    "w5:train_small_b2",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    request.getfixturevalue("gpu_device")
    out = tmp_path_factory.mktemp("workloads") / "workloads_smoke.json"
    common = ["--quick", "--in-process", "--modes", "eager", "--out", str(out)]
    main([*common, "--precision", "strict", "--cases", ",".join(SMOKE)])
    main([*common, "--precision", "fast", "--cases", "w5:fwd_small_b2"])
    return json.loads(out.read_text())


def test_workloads_smoke_every_gate_passes(results):
    rows = results["results"]
    for row in rows:
        assert set(KEYS) <= set(row), f"{row['case']}: missing {set(KEYS) - set(row)}"
        if row["gate"] == "not available":
            assert WORKLOADS[row["workload"]].missing(), row["case"]
            continue
        assert row["gate"] == "PASS", f"{row['case']}: {row['gate']} {row['gate_figures']}"
        assert row["ours"] > 0 and row["torch"] > 0 and row["speedup"] > 0, row["case"]
    ran = {(r["workload"], r.get("cell"), r.get("precision")) for r in rows if r["metric"] == "ms"}
    for entry in SMOKE:
        wid, case = entry.split(":")
        if WORKLOADS[wid].missing() is None:
            assert (wid, case, "strict") in ran, entry
    assert ("w5", "fwd_small_b2", "fast") in ran


def test_workloads_smoke_rows_carry_gate_figures_and_memory(results):
    rows = [r for r in results["results"] if r["metric"] == "ms"]
    train = [r for r in rows if r["kind"] == "train"]
    fwd = [r for r in rows if r["kind"] == "fwd"]
    assert train and fwd
    for r in train:
        figs = r["gate_figures"]
        assert {"forward", "backward", "step"} <= set(figs), r["case"]
        assert figs["backward"]["grads_checked"] > 0, r["case"]
        assert r["case"].endswith("_strict_vs_eager")
    for r in fwd:
        assert r["gate_figures"]["forward"]["fwd_rel_l2"] <= r["gate_figures"]["forward"].get(
            "fwd_rel_l2", 1
        )
        assert r["peak_bytes"]["ours"] > 0 and r["flops"] > 0
    assert results["protocol"]["quick"] is True
