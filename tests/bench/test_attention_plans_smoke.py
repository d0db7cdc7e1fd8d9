"""Smoke test of ``bench/attention_plans.py --quick`` on the test adapter: every program it
compiled matched the reference, each kernel was timed at its default plan and at least one
other, and the result file has the summary; ``--record`` wrote the winners (>= ``MIN_GAIN``)
into the test adapter's tuning cache, which ``device_limits`` then reads. No timing is
asserted."""

from __future__ import annotations

import json

from bench.attention_plans import QUICK_SHAPES, main
from bench.attention_plans_summary import LABELS, MIN_GAIN, RECORD_LABELS, _dims
from meganeura.training import device_limits
from meganeura.tune import cache as tc


def test_attention_plans_quick(tmp_path, gpu_device):
    out = tmp_path / "attention_plans.json"
    tc.set_cache_dir(tmp_path / "tuning")
    main(["--quick", "--out", str(out), "--repeats", "1", "--warmup", "1", "--budget-s", "300",
          "--record"])  # fmt: skip
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
    # --record: exactly the kernels whose best plan beat the default by MIN_GAIN
    want = {}
    for shape in QUICK_SHAPES:
        d = _dims(shape)
        for mode, label in RECORD_LABELS.items():
            k = doc["summary"][shape[0]]["kernels"][label]
            if k["best_plan"] != k["default_plan"] and k["default_us"] / k["best_us"] >= MIN_GAIN:
                want[(mode, d.b, d.hkv, d.group, d.lq, d.lk, d.d, d.dv)] = tuple(k["best_plan"])
    cache = tc.load(tc.device_key(gpu_device))
    assert dict(cache.attention_plans()) == want
    assert dict(device_limits(gpu_device).attention_plans) == want
