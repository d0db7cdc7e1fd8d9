"""Smoke test of ``bench/conv_sweep.py --quick`` on the test adapter: every variant's result
matched the default plan's, and the result file has the agreed keys. No timing is asserted."""

from __future__ import annotations

import json

from bench.conv_sweep import KEYS, PART_KEYS, SHAPE_KEYS, main


def test_conv_sweep_quick(tmp_path, gpu_device):
    out = tmp_path / "conv_sweep.json"
    main(["--quick", "--out", str(out), "--repeats", "1", "--warmup", "1"])
    doc = json.loads(out.read_text())
    assert set(KEYS) <= set(doc) and doc["complete"] and doc["quick"]
    assert len(doc["shapes"]) == 2
    for sh in doc["shapes"]:
        assert set(SHAPE_KEYS) <= set(sh), sh["name"]
        variants = sh["variants"]
        assert variants[0]["variant"] == "default/default/default"
        assert len(variants) > 4  # tilings x prefetch x splits, fewer the duplicates
        assert any("/pf" in p for v in variants for p in v["plans"]["fwd"])
        assert any("/s2/" in p for v in variants for p in v["plans"]["bwd_weight"])
        for v in variants:
            assert not v["rejected"] and v["max_rel_diff"] <= 1e-4, (sh["name"], v)
        for part, r in sh["parts"].items():
            assert set(PART_KEYS) <= set(r), (sh["name"], part)
            assert r["best_ms"] <= r["default_ms"]
    for net, parts in doc["summary"].items():
        assert "all" in parts and "fwd" in parts, net
        # every shape ran the default plans with each prefetch mode (no budget cut)
        assert all(parts["all"][f"default_as_{m}_ms"] is not None for m in ("np", "pf", "d2"))
