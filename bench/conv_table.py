"""The conv GEMM plan table (``meganeura/codegen/wgsl/conv/tuned.py``) from a conv sweep's JSON.

``bench/conv_sweep.py --emit-table PATH`` calls ``emit``: for each shape of the sweep it
lowers the shape's program (``bench/conv.build``: forward, grad-input, grad-weight) for the
H200's limits under the rules alone (``force_plan()``, which the table yields to), and
records each conv GEMM's op, sizes and rule plan (``conv.gemm.record_choices``). Per part:

- the baseline is the sweep variant whose plans equal today's rule plans (after the sweep the
  rules changed to two-deep prefetch on the 64x64 and 16x256 tiles: ``dflt/d2``); a part with
  no such variant (a budget cut) has no entry;
- a part whose rule tilings or splits differ from the sweep's default (the rules changed
  since) is left out: its timings are of other plans;
- a part of several GEMMs (a strided grad-input's stride phases, one dispatch each) is left
  out: the best variant forced one plan on all phases and timed their sum, and the phases
  are to merge into one dispatch (strided grad-input work on the ``wt-convs2`` branch);
- otherwise the sweep's best variant becomes the entry of (kind, m, n, k, groups) (kind: the
  part, ``tuned.KIND`` of the op) when it beat
  the baseline by at least ``MIN_GAIN``. Two shapes with the same key keep the entry that
  saves more count-weighted time (printed).

Then per network and part the count-weighted conv time (the first conv's grad-input left
out, as the sweep counts it): today's rules (the baseline; the sweep's default where no
baseline was timed), with the table, the best variant per shape, cuDNN.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.conv import OPS, PARTS, build  # noqa: E402
from meganeura.codegen.wgsl.conv.tuned import KIND  # noqa: E402

MIN_GAIN = 1.03  # as the matmul table and the tuning cache (``tune.MIN_GAIN``)


def h200_limits():
    """The H200's codegen limits (Vulkan, as ``scripts/wgsl_digest.py`` has them): the
    workgroup memory decides which prefetching tiles fit, the binding size the split cap."""
    from meganeura.codegen.kernel import Limits

    return Limits(
        max_workgroup_storage_size=49152,
        max_invocations_per_workgroup=1024,
        max_storage_buffer_binding_size=2**31 - 4,
        max_storage_buffers_per_shader_stage=32,
        shader_f16=True,
        subgroups=True,
    )


def rule_choices(shape: dict, limits) -> list[dict]:
    """``record_choices`` rows of one sweep shape's program under the rules alone; the phases
    of a merged strided input gradient (source ``"merged"``) left out: they take no table
    plan, so they never make an entry."""
    import meganeura as mn
    from meganeura.codegen.wgsl.conv import gemm

    graph = build(shape["n"], shape["c"], shape["oc"], shape["k"], shape["stride"], shape["h"])
    with gemm.record_choices() as rows, gemm.force_plan():
        mn.compile(graph, None, limits)
    return [r for r in rows if r["source"] != "merged"]


def _base(name: str) -> str:
    """A plan name without its prefetch mode: ``"64x64x16/s2/d2"`` -> ``"64x64x16/s2"``."""
    return name.rsplit("/", 1)[0]


def entries(doc: dict, limits=None) -> tuple[list[dict], list[str]]:
    """(one row per part of every shape, notes). A row: ``network``, ``shape``, ``part``,
    ``count``, ``counted``, ``key`` (kind, m, n, k, groups; None when the part is left out),
    ``rule`` (today's rule plans), ``base_ms`` (their time, None when not timed),
    ``best``/``best_ms`` (the sweep's best variant), ``cudnn_ms``, ``default_ms`` and
    ``gain`` (base / best)."""
    limits = limits or h200_limits()
    rows, notes = [], []
    for sh in doc["shapes"]:
        choices = rule_choices(sh, limits)
        for p in PARTS:
            r = sh["parts"][p]
            mine = [c for c in choices if c["op"] == OPS[p]]
            rule = [c["plan"] for c in mine]
            timed = [v["ms"][p] for v in sh["variants"]
                     if not v["rejected"] and v["plans"][p] == rule]  # fmt: skip
            base_ms = min(timed) if timed else None
            row = {"network": sh["network"], "shape": sh["name"], "part": p,
                   "count": sh["count"], "counted": r["counted"], "key": None, "rule": rule,
                   "base_ms": base_ms, "best": r["best_plans"], "best_ms": r["best_ms"],
                   "cudnn_ms": r["cudnn_ms"], "default_ms": r["default_ms"],
                   "gain": 1.0}  # fmt: skip
            if base_ms is not None and r["best_ms"] > 0:
                row["gain"] = base_ms / r["best_ms"]
            rows.append(row)
            where = f"{sh['name']} {p}"
            if [_base(n) for n in rule] != [_base(n) for n in r["default_plans"]]:
                notes.append(f"{where}: rules now {rule}, swept {r['default_plans']}: left out")
            elif len(mine) != 1:
                if row["gain"] >= MIN_GAIN:
                    notes.append(f"{where}: {len(mine)} GEMMs (stride phases) x{row['gain']:.2f}"
                                 " left out")  # fmt: skip
            elif base_ms is None:
                notes.append(f"{where}: today's rule plan {rule} was not timed: left out")
            elif row["gain"] >= MIN_GAIN:
                c = mine[0]
                row["key"] = (KIND[c["op"]], c["m"], c["n"], c["k"], c["groups"])
    return rows, notes


def table(rows: list[dict]) -> tuple[dict, list[str]]:
    """({key: (plan name, comment)}, notes on keys two shapes share)."""
    out: dict = {}
    saved: dict = {}
    notes = []
    for row in rows:
        key = row["key"]
        if key is None:
            continue
        save = row["count"] * (row["base_ms"] - row["best_ms"])
        comment = f"{row['shape']} x{row['gain']:.2f}"
        if key in out:
            same = "the same plan" if out[key][0] == row["best"][0] else "different plans"
            notes.append(f"{key}: {out[key][1]} and {comment}, {same}: kept the larger saving")
            if save <= saved[key]:
                continue
        out[key], saved[key] = (row["best"][0], comment), save
    return out, notes


def estimate(rows: list[dict], tab: dict) -> dict:
    """Per network and part (and ``all``): count-weighted ms of today's rules (``rules``), with
    the table (``table``), of the best variant per shape (``best``) and of cuDNN (``cudnn``).
    A part without a timed baseline counts the sweep's default time in both of the first."""
    out: dict = {}
    for row in rows:
        if not row["counted"]:
            continue
        base = row["base_ms"] if row["base_ms"] is not None else row["default_ms"]
        key = row["key"]
        with_table = row["best_ms"] if key is not None and tab[key][0] == row["best"][0] else base
        net = out.setdefault(row["network"], {})
        for part in (row["part"], "all"):
            acc = net.setdefault(part, dict.fromkeys(("rules", "table", "best", "cudnn"), 0.0))
            for name, ms in (("rules", base), ("table", with_table), ("best", row["best_ms"]),
                             ("cudnn", row["cudnn_ms"])):  # fmt: skip
                acc[name] += row["count"] * ms
    return out


def format_table(tab: dict, doc: dict) -> str:
    """``TUNED``'s Python text, for pasting into ``conv/tuned.py``."""
    lines = [f"# {doc['machine'].get('adapter', '?')}, driver {doc['machine'].get('driver', '?')}"
             f": {len(tab)} entries (bench/conv_table.py)",
             "TUNED: dict[tuple[str, int, int, int, int], str] = {"]  # fmt: skip
    for key in sorted(tab):
        name, comment = tab[key]
        lines.append(f"    {key!r}: {name!r},  # {comment}")
    lines.append("}")
    return "\n".join(lines)


def emit(path: str, limits=None) -> tuple[dict, dict]:
    """Print the table and the estimate for the sweep JSON at ``path``; return (table: key ->
    plan name, estimate)."""
    with open(path) as f:
        doc = json.load(f)
    rows, notes = entries(doc, limits)
    tab, clashes = table(rows)
    print(format_table(tab, doc))
    for note in notes + clashes:
        print(f"# note: {note}")
    est = estimate(rows, tab)
    print(f"\n# weighted network conv time (ms) from {os.path.basename(path)}:")
    print(f"# {'network':<16} {'part':<10} {'rules':>8} {'table':>8} {'gain':>6} "
          f"{'best':>8} {'cuDNN':>8}")  # fmt: skip
    for net, parts in est.items():
        for p in (*PARTS, "all"):
            r = parts[p]
            gain = r["rules"] / r["table"]
            print(f"# {net:<16} {p:<10} {r['rules']:>8.3f} {r['table']:>8.3f} {gain:>6.3f} "
                  f"{r['best']:>8.3f} {r['cudnn']:>8.3f}")  # fmt: skip
    return {k: v[0] for k, v in tab.items()}, est
