"""``bench/conv_table.py`` (``bench/conv_sweep.py --emit-table``): the committed conv plan table
(``conv/tuned.py``) is what the committed H200 sweep gives, and its estimate adds up. Lowering
only, no GPU."""

from __future__ import annotations

import os

from bench.conv_table import MIN_GAIN, emit, entries
from meganeura.codegen.wgsl.conv.tuned import TUNED

SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results",
                     "conv_sweep_h200.json")  # fmt: skip


def test_the_table_is_the_sweeps(capsys):
    tab, est = emit(SWEEP)
    printed = capsys.readouterr().out
    assert "TUNED: dict[" in printed and "resnet50_b4" in printed
    # regenerate conv/tuned.py when this fails: the sweep or the rules changed
    assert tab == TUNED
    for net, parts in est.items():
        r = parts["all"]
        assert r["best"] <= r["table"] <= r["rules"], (net, r)
        assert abs(sum(parts[p]["table"] for p in parts if p != "all") - r["table"]) < 1e-9
    assert est["resnet50_b4"]["all"]["rules"] / est["resnet50_b4"]["all"]["table"] > 1.03


def test_entries_are_single_gemms_that_beat_the_rules():
    import json

    with open(SWEEP) as f:
        rows, notes = entries(json.load(f))
    keyed = [r for r in rows if r["key"] is not None]
    assert keyed and all(r["gain"] >= MIN_GAIN and len(r["rule"]) == 1 for r in keyed)
    # a strided 3x3 grad-input is four stride-phase GEMMs, on GPU adapters in one merged
    # dispatch (conv/phases.py) that records no single-GEMM rule plan: never an entry
    strided = [r for r in rows if r["shape"] == "l2_3x3s2_128" and r["part"] == "bwd_input"]
    assert len(strided[0]["rule"]) != 1 and strided[0]["key"] is None
