"""Regenerate docs/performance.md's result tables from bench/results/*.json.

Usage: python bench/report.py   (rewrites the block between the GENERATED markers)
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def _fmt(v) -> str:
    """A table cell: 4 significant digits; "-" where a row has no value (a case with no
    PyTorch counterpart, as an A/B of two of our variants)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(path: Path) -> str:
    doc = json.loads(path.read_text())
    m, v = doc["machine"], doc["versions"]
    lines = [
        f"### {path.stem}",
        "",
        f"Machine: {m.get('adapter')}"
        + (f" ({m['backend']}, driver {m['driver']})" if m.get("driver") else "")
        + f"; PyTorch on {m.get('torch_device')}; "
        + ", ".join(f"{k} {val}" for k, val in v.items()),
        "",
        "| case | metric | meganeura | PyTorch | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        speedup = "n/a" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"| {r['case']} | {r['metric']} | {_fmt(r['ours'])} | {_fmt(r.get('torch'))} "
            f"| {speedup} |"
        )
    return "\n".join(lines) + "\n"


def section(path: Path) -> str:
    """The table of one result file: the evaluation's own layout for ``workloads_*.json``."""
    if path.stem.startswith("workloads_"):
        import sys

        sys.path.insert(0, str(ROOT))
        from bench.workloads_lib.table import markdown

        return markdown(path)
    return table(path)


def main() -> None:
    import json

    # result files in the common shape (``bench.common.write``); other JSON there (the
    # dispatch-count listings of bench/dispatch_counts.py) are documents of their own
    files = [
        f
        for f in sorted((ROOT / "bench" / "results").glob("*.json"))
        if "results" in json.loads(f.read_text())
    ]
    body = "\n".join(section(f) for f in files)
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{body}{END}{tail}")
    print(f"updated {DOC} from {len(files)} result files")


if __name__ == "__main__":
    main()
