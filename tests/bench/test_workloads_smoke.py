"""Smoke test of the paper's evaluation harness (``bench/workloads.py``, issue 14 item 6): every
available workload at CPU size on lavapipe, in this process, PyTorch eager only: one forward
case and the training step of each, strict f32, and the U-Net forward in fast mode. Checks that
every gate passes and that the result file has the agreed keys; no timing is asserted.

W4 (Whisper) is "not available" until ``meganeura.models.whisper`` is merged; the test then
checks that it is reported so, not that it ran.
"""

from __future__ import annotations

import json

import pytest

from bench.workloads import main
from bench.workloads_lib.registry import WORKLOADS
from bench.workloads_lib.rows import KEYS

# one worker runs every test here under `make test` (--dist loadgroup): the module-scoped
# results fixture, the expensive part, then runs once
pytestmark = pytest.mark.xdist_group("bench_workloads")

SMOKE = [
    "w1:fwd_seq16",
    "w1:train_seq16",
    "w2:fwd_chunk10",
    "w2:train_chunk10",
    "w3:fwd_b4",
    "w3:train_b4",
    "w4:fwd",
    "w4:train",
    "w5:fwd_small_b2",
    "w5:train_small_b2",
]
SMOKE_HEADLINE = {c.split(":")[1] for c in SMOKE}
# the cases whose sides are the workload's own (greedy decode, the unrolled denoising loop)
SMOKE_CUSTOM = ["w1:decode32", "w2:denoise10"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    request.getfixturevalue("gpu_device")
    out = tmp_path_factory.mktemp("workloads") / "workloads_smoke.json"
    common = ["--quick", "--in-process", "--modes", "eager", "--out", str(out)]
    main([*common, "--precision", "strict", "--cases", ",".join(SMOKE + SMOKE_CUSTOM)])
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
    figures = {(r["workload"], r.get("cell"), r["metric"]) for r in rows}
    assert {("w1", "decode32", "ms_per_token"), ("w1", "decode32", "ttft_ms")} <= figures
    assert ("w2", "denoise10", "ms") in figures


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


def test_workloads_table_and_chart_from_the_smoke_results(results, tmp_path):
    from bench.workloads_lib.plot import plot
    from bench.workloads_lib.table import markdown, summary

    path = tmp_path / "workloads_smoke.json"
    path.write_text(json.dumps(results))
    text = markdown(path)
    assert "| w5 fwd_small_b2 | fast | PASS |" in text
    s = summary(results["results"])
    # the paper's cells at CPU size: each workload's forward and training step
    assert s["strict_inference_cells"] == 5 and s["median_training_gap"] > 0
    assert all(r["headline"] == (r["cell"] in SMOKE_HEADLINE) for r in results["results"]
               if r["metric"] != "n/a")  # fmt: skip
    m = s["matrix"]["strict"]
    # decode gives two timed figures (ms per token, time to the first token)
    assert m["passed"] + m["failed"] == len(SMOKE) + 3 and m["training_cells"] == 5
    png = plot(path, tmp_path / "speedup.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_deterministic_weights_are_full_rank_with_fan_in_scale():
    import numpy as np

    from bench.workloads_lib.weights import param_value, sin_tensor

    w = param_value("layers.0.mlp.up_proj.weight", (64, 64))
    assert w.dtype == np.float32 and np.linalg.matrix_rank(w.astype(np.float64)) == 64
    assert abs(w.std() * np.sqrt(64) - 1.0) < 0.05  # std 1/sqrt(fan_in)
    assert np.array_equal(w, param_value("layers.0.mlp.up_proj.weight", (64, 64)))
    assert not np.array_equal(w, param_value("layers.1.mlp.up_proj.weight", (64, 64)))
    # workloads.md's linear phase alone: rank 2, which the quadratic term avoids
    j = np.arange(64 * 64)
    assert np.linalg.matrix_rank(np.sin(0.01 * j + 1.0).reshape(64, 64)) == 2
    assert sin_tensor((3,), "x").tolist() == sin_tensor((3,), "x").tolist()


def test_gates_fail_on_a_wrong_gradient_and_skip_vanishing_ones():
    import numpy as np

    from bench.workloads_lib import gates

    th = gates.thresholds("w3", "strict")
    rng = np.random.default_rng(0)
    ref = {"a": rng.normal(size=10), "b": rng.normal(size=5), "c": np.full(3, 1e-7)}
    ok = gates.backward_gate(th, {k: v * (1 + 1e-5) for k, v in ref.items()}, ref)
    assert ok["pass"] and ok["grads_checked"] == 2 and ok["grads_skipped"] == 1
    bad = dict(ref, b=ref["b"][::-1].copy())  # a permuted gradient: same norm, wrong direction
    res = gates.backward_gate(th, bad, ref)
    assert not res["pass"] and res["grads_failing"] == ["b"] and res["grad_norm_rel_max"] < 1e-12
    fwd = gates.forward_gate(th, np.ones(4) * (1 + 2e-4), np.ones(4))
    assert not fwd["pass"] and abs(fwd["fwd_rel_l2"] - 2e-4) < 1e-9
    assert gates.forward_gate(gates.thresholds("w3", "fast"), np.ones(4) * 1.002, np.ones(4))[
        "pass"
    ]


def test_result_file_merges_runs_and_resume_skips_measured_cells(results, tmp_path):
    from bench.workloads_lib.rows import merge_write
    from bench.workloads_lib.runner import done_cells

    rows = [r for r in results["results"] if r["metric"] != "n/a"]
    path = tmp_path / "w.json"
    merge_write(path, rows[1:], {"machine": {}}, fresh=True)
    merge_write(path, rows[:2], {"machine": {}}, fresh=False)  # row 1 replaced, row 0 added
    doc = json.loads(path.read_text())
    cases = [r["case"] for r in doc["results"]]
    assert sorted(cases) == sorted(r["case"] for r in rows) and len(set(cases)) == len(cases)

    def cell(r):
        return (r["workload"], r["cell"], r["precision"])

    # a re-measured cell keeps its place: the cells appear in the first file's order, then
    # the new ones
    order = list(dict.fromkeys(cell(r) for r in rows[1:]))
    order += [c for c in dict.fromkeys(cell(r) for r in rows[:1]) if c not in order]
    assert list(dict.fromkeys(cell(r) for r in doc["results"])) == order
    first = rows[0]
    key = cell(first)
    assert key in done_cells(path, {key: ["eager"]})
    assert key not in done_cells(path, {key: ["eager", "compile"]})
    # --skip-done --commit: rows of another commit do not count as measured
    doc["results"] = [dict(r, measured={"commit": "aaa", "date": "x"}) for r in doc["results"]]
    path.write_text(json.dumps(doc))
    assert key in done_cells(path, {key: ["eager"]}, ["aaa"])
    assert key not in done_cells(path, {key: ["eager"]}, ["bbb"])
    # --done-commits: rows of any commit listed count
    assert key in done_cells(path, {key: ["eager"]}, ["bbb", "aaa"])


def test_a_remeasured_cell_mode_leaves_none_of_its_old_rows(tmp_path):
    """An ERROR row (metric "ms", as a failed decode child leaves) is replaced by the cell's
    later rows under other metrics; the other modes' and cells' rows stay."""
    from bench.workloads_lib.rows import merge_write

    def row(cell, mode, metric, gate="PASS"):
        case = f"w1_x_{cell}{'' if metric == 'ms' else '_' + metric}_strict_vs_{mode}"
        return {"case": case, "workload": "w1", "cell": cell, "precision": "strict",
                "mode": mode, "metric": metric, "gate": gate}  # fmt: skip

    path = tmp_path / "w.json"
    old = [row("decode32", "eager", "ms", "ERROR"), row("decode32", "compile", "ms", "ERROR")]
    old.append(row("fwd_seq1", "eager", "ms"))
    merge_write(path, old, {"machine": {}}, fresh=True)
    new = [row("decode32", "eager", "ms_per_token"), row("decode32", "eager", "ttft_ms")]
    merge_write(path, new, {"machine": {}}, fresh=False)
    got = {(r["cell"], r["mode"], r["metric"]) for r in json.loads(path.read_text())["results"]}
    assert got == {
        ("decode32", "eager", "ms_per_token"),
        ("decode32", "eager", "ttft_ms"),
        ("decode32", "compile", "ms"),  # not re-measured: kept
        ("fwd_seq1", "eager", "ms"),
    }


def test_a_remeasure_without_warm_figures_keeps_the_warm_first_call_row(tmp_path):
    """``--no-warm`` re-measures a cell's timing but not its warm first call (nor, with
    ``--overlap-compile``, its cold one): the old first-call rows stay; a re-measure with a
    first-call row replaces that row."""
    from bench.workloads_lib.rows import merge_write

    def row(metric, value, warm=False, cold=False):
        kind = "_compile_warm" if warm else "_compile_cold" if cold else ""
        case = "w4_x_fwd_strict" + kind + "_vs_compile"
        return {"case": case, "workload": "w4", "cell": "fwd", "precision": "strict",
                "mode": "compile", "metric": metric, "ours": value}  # fmt: skip

    path = tmp_path / "w.json"
    first = [row("ms", 2.6), row("s", 2.3, warm=True), row("s", 3.1, cold=True)]
    merge_write(path, first, {"machine": {}}, fresh=True)
    merge_write(path, [row("ms", 2.5)], {"machine": {}}, fresh=False)
    got = {(r["metric"], r["ours"]) for r in json.loads(path.read_text())["results"]}
    assert got == {("ms", 2.5), ("s", 2.3), ("s", 3.1)}
    again = [row("ms", 2.4), row("s", 2.0, warm=True)]
    merge_write(path, again, {"machine": {}}, fresh=False)
    got = {(r["metric"], r["ours"]) for r in json.loads(path.read_text())["results"]}
    assert got == {("ms", 2.4), ("s", 2.0), ("s", 3.1)}
