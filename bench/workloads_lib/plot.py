"""The picture of the evaluation: speedup of meganeura over each PyTorch mode per cell, log
scale, one bar per mode (matplotlib, Agg). Cells whose gate failed are drawn hatched at their
measured ratio and labelled FAIL; no speedup is claimed for them."""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {
    "eager": "#4477aa",
    "compile": "#ee6677",
    "reduce_overhead": "#228833",
    "eager_bf16": "#ccbb44",
}


def plot(result_path: Path, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(result_path).read_text())
    rows = [r for r in doc["results"] if r.get("metric") in ("ms", "ms_per_token")]
    cells = []
    for r in rows:
        key = (r["workload"], r["cell"], r["precision"], r["metric"])
        if key not in cells:
            cells.append(key)
    modes = [m for m in COLORS if any(r.get("mode") == m for r in rows)]
    width_in = min(max(8.0, 0.22 * len(cells) * max(len(modes), 1)), 32.0)
    fig, ax = plt.subplots(figsize=(width_in, 6))
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        for i, key in enumerate(cells):
            r = next(
                (
                    x
                    for x in rows
                    if (x["workload"], x["cell"], x["precision"], x["metric"]) == key
                    and x["mode"] == mode
                ),
                None,
            )
            if r is None:
                continue
            s = r.get("speedup") or r.get("speedup_unclaimed")
            if not s:
                continue
            failed = r.get("gate") != "PASS"
            ax.bar(
                i + (j - (len(modes) - 1) / 2) * width,
                s,
                width,
                color=COLORS[mode],
                hatch="//" if failed else None,
                edgecolor="black" if failed else None,
                label=mode if i == 0 or not ax.get_legend_handles_labels()[1].count(mode) else None,
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cells)))
    # where the file holds cells measured at different commits, each label says its commit
    at = {
        (r["workload"], r["cell"], r["precision"], r["metric"]): (r.get("measured") or {}).get(
            "commit", "?"
        )
        for r in rows
    }
    mixed = len(set(at.values())) > 1
    labels = [
        f"{w} {c} {p}" + ("" if m == "ms" else f" ({m})") + (f" @{at[w, c, p, m]}" if mixed else "")
        for w, c, p, m in cells
    ]
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup over PyTorch (torch ms / ours ms, log)")
    machine = doc.get("machine", {}).get("torch_device", "")
    ax.set_title(f"meganeura vs PyTorch per cell and mode ({machine}); hatched: gate FAIL")
    handles, labels_ = ax.get_legend_handles_labels()
    uniq = dict(zip(labels_, handles, strict=False))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
