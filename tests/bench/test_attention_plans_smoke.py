"""Smoke test of ``bench/attention_plans.py --quick`` on the test adapter: every program it
compiled matched the reference, each kernel was timed at its default plan and at least one
other, and the result file has the summary. No timing is asserted."""

from __future__ import annotations

import json

from bench.attention_plans import LABELS, QUICK_SHAPES, main


def test_attention_plans_quick(tmp_path, gpu_device):
    out = tmp_path / "attention_plans.json"
    main(["--quick", "--out", str(out), "--repeats", "1", "--warmup", "1", "--budget-s", "300"])
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["quick"] and doc["errors"] == 0
    assert all(max(p["rel_errs"].values()) <= 1e-4 for p in doc["programs"])
    assert set(doc["summary"]) == {s[0] for s in QUICK_SHAPES}
    for shape, s in doc["summary"].items():
        assert set(s["kernels"]) == set(LABELS), shape
        assert not s["untimed_plans"], shape
        for label, k in s["kernels"].items():
            assert k["default_us"] is not None and k["plans_timed"] >= 2, (shape, label)
            assert k["best_us"] <= k["default_us"], (shape, label)
    plans = {tuple(r["plan"]) for r in doc["rows"] if not r["default"]}
    assert plans and all(r["n"] == 1 for r in doc["rows"])
