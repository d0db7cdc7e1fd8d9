"""The evaluation's table for ``docs/performance.md`` (``bench/report.py`` calls
:func:`markdown` for ``bench/results/workloads_*.json``) and the closing figures of issue 14:
strict-f32 inference cells won against the best PyTorch mode, the median training gap, and
compile times beside torch.compile's."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MODES = ("eager", "compile", "reduce_overhead", "eager_bf16")
HEADS = {
    "eager": "eager",
    "compile": "compile",
    "reduce_overhead": "CUDA graphs",
    "eager_bf16": "bf16",
}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _mib(v) -> str:
    return "-" if not v else f"{v / 2**20:.0f}"


def _cells(rows):
    cells: dict = {}
    for r in rows:
        if r.get("metric") in ("n/a", "s"):
            continue
        key = (r["workload"], r["cell"], r["precision"], r["metric"])
        cells.setdefault(key, {})[r["mode"]] = r
    return cells


def primary(modes: dict) -> dict:
    """The row of a cell that speaks for it: the fastest PyTorch mode's (its ``ours`` was
    measured in the same run), else the first."""
    timed = [r for r in modes.values() if r.get("torch")]
    return min(timed, key=lambda r: r["torch"]) if timed else next(iter(modes.values()))


def _headline(r: dict) -> bool:
    """Whether a row is one of the paper's cells (rows written before 2026-12-04's tenth
    session carry no ``headline``: their case name is the full-size one)."""
    if "headline" in r:
        return bool(r["headline"])
    from .registry import WORKLOADS

    wl = WORKLOADS.get(r.get("workload"))
    return wl is not None and r.get("cell") in wl.headline(False)


def summary(rows) -> dict:
    """Issue 14's closing figures from the rows of one result file.

    The paper's cells (``headline``: each workload's forward and training step, strict f32):
    inference cells won against the best PyTorch mode and the median training gap (ours /
    best PyTorch; < 1 is faster). The whole matrix (``matrix``): per precision, the timed
    metrics (a decode cell gives two) won, those with a passing gate, the failed gates, and
    the median gap of every training cell (``train`` and ``train_steps`` kinds). A cell's
    figure is its fastest PyTorch mode's row, whose ``ours`` was measured beside it. Compile
    times: the cold-cache rows against torch.compile."""
    cells = _cells(rows)
    won, inference, gaps, compile_rows = 0, 0, [], []
    matrix: dict = {}
    for (_w, _c, precision, metric), modes in cells.items():
        any_row = primary(modes)
        best, ours = any_row.get("torch"), any_row.get("ours")
        if best is None or ours is None:
            continue
        m = matrix.setdefault(precision, {"won": 0, "passed": 0, "failed": 0, "gaps": []})
        if any_row["gate"] != "PASS":
            m["failed"] += 1
            continue
        m["passed"] += 1
        m["won"] += ours < best
        if any_row.get("kind") in ("train", "train_steps"):
            m["gaps"].append(ours / best)
        if precision != "strict" or metric != "ms" or not _headline(any_row):
            continue
        # ours against the best mode from the same run (a cell's modes may come from runs at
        # different commits: each row's ours was measured beside its own torch figure)
        if any_row.get("kind") in ("fwd", "denoise", "decode"):
            inference += 1
            won += ours < best
        elif any_row.get("kind") in ("train", "train_steps"):
            gaps.append(ours / best)
    for m in matrix.values():
        g = m.pop("gaps")
        m["median_training_gap"] = statistics.median(g) if g else None
        m["training_cells"] = len(g)
    for r in rows:
        if r.get("metric") == "s" and r.get("mode") == "compile" and "_compile_cold_" in r["case"]:
            compile_rows.append((r["case"], r.get("ours"), r.get("torch")))
    return {
        "strict_inference_cells_won": won,
        "strict_inference_cells": inference,
        "median_training_gap": statistics.median(gaps) if gaps else None,
        "matrix": matrix,
        "compile_cold": compile_rows,
    }


def _compile_table(rows) -> list[str]:
    """Seconds to the first result, cold and warm caches: ours against torch.compile (default
    mode and reduce-overhead), with workloads.md's first compiled training step."""
    by: dict = {}
    for r in rows:
        if r.get("metric") != "s":
            continue
        when = "cold" if "_compile_cold_" in r["case"] else "warm"
        key = (r["workload"], r["cell"], r["precision"])
        d = by.setdefault(key, {})
        d[f"ours_{when}"] = r.get("ours")
        d[f"{r['mode']}_{when}"] = r.get("torch")
        if r.get("paper_torch_first_s") is not None:
            d["paper"] = r["paper_torch_first_s"]
    if not by:
        return []
    out = [
        "",
        "First call, s (ours: trace + compile + Session setup + first run with the driver's "
        "shader compile; torch: the first compiled call), cold caches / warm caches:",
        "",
        "| cell | prec | ours | torch.compile | reduce-overhead | paper first compiled step |",
        "|---|---|---|---|---|---|",
    ]
    for (w, c, p), d in by.items():

        def pair(k, d=d):
            return f"{_ms(d.get(k + '_cold'))} / {_ms(d.get(k + '_warm'))}"

        out.append(
            f"| {w} {c} | {p} | {pair('ours')} | {pair('compile')} | {pair('reduce_overhead')} "
            f"| {_ms(d.get('paper'))} |"
        )
    return out


def markdown(path: Path) -> str:
    """A markdown section: one line per cell (workload, case, precision, metric) with our time
    (from the fastest PyTorch mode's run, ``primary``), each PyTorch mode's time and speedup
    (each against ours of its own run), the gate, peak memory and compile times."""
    doc = json.loads(Path(path).read_text())
    rows = doc["results"]
    m = doc.get("machine", {})
    lines = [
        f"### {Path(path).stem}",
        "",
        f"Machine: {m.get('adapter')}; PyTorch on {m.get('torch_device')}; "
        + ", ".join(f"{k} {v}" for k, v in doc.get("versions", {}).items())
        + f". Median of {doc.get('protocol', {}).get('repeats')} timed runs after "
        f"{doc.get('protocol', {}).get('warmup')} warm-ups; ms; speedup = torch / ours; a gate "
        "FAIL claims no speedup (the ratio is shown struck through). `bench/workloads.py`.",
        "",
    ]
    missing = [r for r in rows if r.get("metric") == "n/a"]
    for r in missing:
        lines.append(f"- {r['case']}: not available ({r['gate_figures'].get('reason', '')})")
    if missing:
        lines.append("")
    head = "| cell | prec | gate | ours | " + " | ".join(HEADS[x] for x in MODES)
    head += " | paper eager / compile | MiB ours / torch | TFLOP/s | first call s: ours / compile |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for (w, c, p, metric), modes in _cells(rows).items():
        r0 = primary(modes)
        gate = r0["gate"]
        cols = []
        for mode in MODES:
            r = modes.get(mode)
            if r is None or r.get("torch") is None:
                cols.append("-" if r is None else "err" if r.get("torch_error") else "-")
                continue
            if r.get("speedup") is not None:
                cols.append(f"{_ms(r['torch'])} ({r['speedup']:.2f}x)")
            else:
                ratio = r.get("speedup_unclaimed")
                cols.append(f"{_ms(r['torch'])} (~~{ratio:.2f}x~~)" if ratio else _ms(r["torch"]))
        paper = " / ".join(
            _ms(modes[x].get("paper_torch_ms")) if x in modes else "-" for x in ("eager", "compile")
        )
        peak = r0.get("peak_bytes") or {}
        torch_peak = max((x.get("peak_bytes") or {}).get("torch") or 0 for x in modes.values())
        tf = (r0.get("tflops") or {}).get("ours")
        cs = r0.get("compile_s") or {}
        tc = (modes.get("compile") or {}).get("compile_s") or {}
        first = f"{_ms(cs.get('ours_cold'))} / {_ms(tc.get('torch_cold'))}"
        name = c if metric == "ms" else f"{c} ({metric})"
        lines.append(
            f"| {w} {name} | {p} | {gate} | {_ms(r0.get('ours'))} | "
            + " | ".join(cols)
            + f" | {paper} | {_mib(peak.get('ours'))} / {_mib(torch_peak)} | "
            f"{'-' if tf is None else f'{tf:.3g}'} | {first} |"
        )

    def _how(at: dict) -> str:
        if not at.get("jobs"):
            return ""
        if at.get("quiet") is False:  # the first overlapped run, before quiet sections
            return (
                f", --jobs {at['jobs']} without quiet sections: host-bound eager and"
                " torch.compile figures perturbed by the others' start"
            )
        if at.get("gpu_overlap"):
            more = " --overlap-compile" if at.get("overlap_compile") else ""
            return f", --jobs {at['jobs']} --gpu-overlap{more}"
        return f", --jobs {at['jobs']}"

    stamps: dict = {}
    for (w, c, p, _), modes in _cells(rows).items():
        by_stamp: dict = {}
        for mode, r in modes.items():
            at = r.get("measured") or {}
            key = f"{at.get('commit', 'unrecorded')} ({at.get('date', '?')}{_how(at)})"
            by_stamp.setdefault(key, []).append(HEADS.get(mode, mode))
        for key, heads in by_stamp.items():  # a cell's modes from several runs: say which
            which = "" if len(by_stamp) == 1 else f" [{', '.join(heads)}]"
            named = stamps.setdefault(key, [])
            if f"{w} {c} {p}{which}" not in named:  # a cell's metrics (decode) once
                named.append(f"{w} {c} {p}{which}")
    if len(stamps) > 1:
        lines += [
            "",
            "Measured at: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in stamps.items()),
        ]
    elif stamps:
        lines += ["", f"Measured at {next(iter(stamps))}."]
    lines += _compile_table(rows)
    s = summary(rows)

    def gap(v):
        return "-" if v is None else f"{v:.2f}x"

    lines += [
        "",
        f"The paper's cells, strict f32: inference cells faster than the best PyTorch mode "
        f"{s['strict_inference_cells_won']} of {s['strict_inference_cells']} (gates passed); "
        f"median training gap (ours / best PyTorch) {gap(s['median_training_gap'])}. "
        "The paper: strict f32 wins 12 of 20 minimal-latency cells, median training gap "
        "1.8x, compilation 0.1-2.4 s against 6-96 s for torch.compile.",
    ]
    for p, m in s["matrix"].items():
        lines += [
            "",
            f"Every {p} cell: {m['won']} of {m['passed']} timed figures faster than the best "
            f"PyTorch mode (gates passed; {m['failed']} more failed their gate); median "
            f"training gap {gap(m['median_training_gap'])} over {m['training_cells']} "
            "training cells.",
        ]
    return "\n".join(lines) + "\n"
