"""Result rows from the children's documents, the merged result file, and the profiles of
cells where we are slower than the best PyTorch mode."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

KEYS = ("case", "metric", "ours", "torch", "speedup", "gate", "gate_figures", "peak_bytes")


_WALL = (
    "process_wall_s",
    "child_wall_s",
    "lock_wait_s",
    "build_wall_s",
    "timing_wall_s",
    "gate_wall_s",
)


def case_id(wl, case_name: str, precision: str, mode: str, metric: str = "ms") -> str:
    mid = "" if metric == "ms" else f"_{metric}"
    return f"{wl.id}_{wl.name}_{case_name}{mid}_{precision}_vs_{mode}"


def _tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if flops and ms else None


def rows_for(wl, case, precision, docs: dict, quick: bool = False) -> list[dict]:
    """One row per PyTorch mode and metric of the cell, plus compile-time rows (metric "s")."""
    ours = docs.get("ours", {})
    if "error" in ours:
        gate, figs = "ERROR", {"error": ours["error"], "traceback": ours.get("traceback")}
    else:
        gate, figs = ours.get("gate", "ERROR"), ours.get("gate_figures", {})
    out = []
    for mode, doc in docs.items():
        if mode == "ours":
            continue
        for metric, mine in (ours.get("metrics") or {"ms": None}).items():
            theirs = (doc.get("metrics") or {}).get(metric)
            o = mine["median"] if mine else None
            t = theirs["median"] if theirs else None
            ratio = t / o if o and t else None
            row = {
                "case": case_id(wl, case.name, precision, mode, metric),
                "metric": metric if metric.endswith("ms") else f"{metric}",
                "ours": o,
                "torch": t,
                "speedup": ratio if gate == "PASS" else None,
                "gate": gate,
                "gate_figures": figs,
                "peak_bytes": {"ours": ours.get("peak_bytes"), "torch": doc.get("peak_bytes")},
                "workload": wl.id,
                "cell": case.name,
                "kind": case.kind,
                "headline": case.name in wl.headline(quick),
                "precision": precision,
                "mode": mode,
                "ours_min": mine["min"] if mine else None,
                "torch_min": theirs["min"] if theirs else None,
                "n": mine["n"] if mine else None,
            }
            if gate != "PASS":
                row["speedup_unclaimed"] = ratio
            if metric == "ms":
                flops = ours.get("flops")
                row["flops"] = flops
                row["tflops"] = {"ours": _tflops(flops, o), "torch": _tflops(flops, t)}
            row["compile_s"] = {
                "ours_cold": ours.get("first_call_s"),
                "ours_warm": ours.get("warm_first_call_s"),
                "torch_cold": doc.get("first_call_s"),
                "torch_warm": doc.get("warm_first_call_s"),
            }
            if doc.get("first_call_overlapped"):  # --overlap-compile: not a compile figure
                row["compile_s"]["torch_cold_overlapped"] = row["compile_s"].pop("torch_cold")
                row["compile_s"]["torch_cold"] = None
            row["ours_stages"] = ours.get("stages")
            # where each child's wall time went (the harness's own cost, for run planning)
            row["wall_s"] = {
                "ours": {k: ours.get(k) for k in _WALL},
                "torch": {k: doc.get(k) for k in _WALL},
            }
            row["ours_precision"] = ours.get("precision_compiled")
            if "loss_scale" in ours:  # --loss-scale: the fast mode's static loss scale
                row["loss_scale"] = ours["loss_scale"]
            prof = ours.get("profile") or {}
            if "top" in prof and metric in ("ms", "ms_per_token"):
                row["ours_profile"] = {
                    k: prof[k] for k in ("gpu_ms", "span_ms", "wall_ms", "host_share", "dispatches")
                }
                row["ours_profile"]["top"] = prof["top"][:5]
            paper = None if quick else _paper(wl, case, precision, mode)
            if paper is not None and metric == "ms":
                row["paper_torch_ms"] = paper
            for k in ("skipped", "error", "traceback", "torch_model"):
                if k in doc:
                    row[k if k == "torch_model" else f"torch_{k}"] = doc[k]
            out.append(row)
        compiled = mode in ("compile", "reduce_overhead") and "first_call_s" in doc
        if compiled and not doc.get("first_call_overlapped"):
            for when in ("cold", "warm"):
                o = ours.get("first_call_s" if when == "cold" else "warm_first_call_s")
                t = doc.get("first_call_s" if when == "cold" else "warm_first_call_s")
                if o is None and t is None:
                    continue
                out.append(_compile_row(wl, case, precision, mode, when, o, t, gate, quick))
    return out


def _compile_row(wl, case, precision, mode, when, ours, torch, gate, quick) -> dict:
    """The first-call row (metric "s") of a cell's compiling mode, ``when`` "cold" or
    "warm"."""
    return {
        "case": case_id(wl, case.name, f"{precision}_compile_{when}", mode),
        "metric": "s",
        "ours": ours,
        "torch": torch,
        "speedup": torch / ours if ours and torch and gate == "PASS" else None,
        "gate": gate,
        "gate_figures": {},
        "peak_bytes": None,
        "workload": wl.id,
        "cell": case.name,
        "precision": precision,
        "mode": mode,
        "paper_torch_first_s": _paper_first(wl, case, precision, mode, when, quick),
        "note": "first call: ours trace + compile + Session setup + first run "
        "(driver shader compile); torch the first compiled call, "
        f"{'fresh' if when == 'cold' else 'reused'} caches",
    }


def warm_rows(wl, case, precision, docs: dict, existing: list[dict], quick: bool) -> list[dict]:
    """``--compile-warm``: the rows of the cell's compiling modes in ``existing`` (the result
    file's), copied with the warm first-call figures of ``docs`` in ``compile_s``, and a
    warm row (metric "s") per mode; the timing rows keep their ``measured`` stamp. A mode
    whose cell has no timing row in ``existing`` gives none (nothing to attach it to)."""
    ours = docs.get("ours", {}).get("warm_first_call_s")
    out = []
    for mode, doc in docs.items():
        if mode == "ours":
            continue
        mine = [
            r
            for r in existing
            if (r.get("workload"), r.get("cell"), r.get("precision"), r.get("mode"))
            == (wl.id, case.name, precision, mode)
            and not _is_warm(r)
        ]
        timing = [r for r in mine if r.get("metric") not in ("s", "n/a")]
        if not timing:
            continue
        theirs = doc.get("warm_first_call_s")
        for r in mine:
            r = copy.deepcopy(r)
            if r.get("metric") != "s":
                r["compile_s"] = {**(r.get("compile_s") or {}), "ours_warm": ours}
                r["compile_s"]["torch_warm"] = theirs
            out.append(r)
        gate = timing[0].get("gate")
        out.append(_compile_row(wl, case, precision, mode, "warm", ours, theirs, gate, quick))
    return out


def _paper(wl, case, precision, mode):
    """workloads.md's indicative PyTorch ms for this cell and mode (strict f32 only)."""
    if precision != "strict" or mode not in ("eager", "compile"):
        return None
    for key in ("fwd", "train"):
        entry = wl.paper.get(key)
        if entry and entry[0] == case.name:
            return entry[1] if mode == "eager" else entry[2]
    return None


def _paper_first(wl, case, precision, mode, when, quick):
    """workloads.md's first compiled training step (s), beside the cold compile of that cell."""
    train = wl.paper.get("train")
    if quick or when != "cold" or mode != "compile" or precision != "strict":
        return None
    return wl.paper.get("first_s") if train and train[0] == case.name else None


def missing_row(wl, reason: str) -> dict:
    return {
        "case": f"{wl.id}_{wl.name}",
        "metric": "n/a",
        "ours": None,
        "torch": None,
        "speedup": None,
        "gate": "not available",
        "gate_figures": {"reason": reason},
        "peak_bytes": None,
        "workload": wl.id,
    }


def _clean(v):
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


def _cell_mode(r: dict) -> tuple:
    return (r.get("workload"), r.get("cell"), r.get("precision"), r.get("mode"))


def _is_warm(r: dict) -> bool:
    return r.get("metric") == "s" and "_compile_warm_" in r.get("case", "")


def merge_write(path: Path, rows: list[dict], header: dict, fresh: bool) -> Path:
    """Merge ``rows`` into the result file at ``path`` (same case ids replaced, and every
    row of a (workload, cell, precision, mode) that ``rows`` measure again; rows of
    workloads now available replace their "not available" row), atomically."""
    doc = {"results": []}
    if path.exists() and not fresh:
        doc = json.loads(path.read_text())
    new = {r["case"] for r in rows}
    # a re-measured (cell, mode) replaces every row it had, so one whose metrics changed
    # (an ERROR row, "ms", against decode's "ms_per_token" and "ttft_ms") leaves none behind
    measured = {_cell_mode(r) for r in rows if r.get("metric") != "n/a"}
    workloads = {r.get("workload") for r in rows if r.get("metric") != "n/a"}
    # a first-call row (metric "s", cold or warm) is replaced only by a row of its own case
    # id: a re-measure that took no such figure (``--no-warm``, ``--overlap-compile``) leaves
    # the cell's latest one, with its own ``measured`` stamp
    kept = [
        r
        for r in doc.get("results", [])
        if r["case"] not in new
        and not (r.get("metric") not in ("n/a", "s") and _cell_mode(r) in measured)
        and not (r.get("metric") == "n/a" and r.get("workload") in workloads)
    ]
    doc.update(header)
    # a re-measured cell keeps its place in the file (and so in the generated table)
    place: dict = {}
    for r in doc.get("results", []):
        place.setdefault((r.get("workload"), r.get("cell"), r.get("precision")), len(place))
    merged = kept + rows
    doc["results"] = sorted(
        merged,
        key=lambda r: place.get((r.get("workload"), r.get("cell"), r.get("precision")), len(place)),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def write_profiles(folder: Path, wl, case, precision, docs: dict) -> Path | None:
    """The per-kernel profile of a cell where ours is slower than the best PyTorch mode; a
    cell measured at least as fast removes its older profile (it no longer applies)."""
    ours = docs.get("ours", {})
    path = folder / f"{wl.id}_{wl.name}_{case.name}_{precision}.txt"
    prof = ours.get("profile")
    metric = next(iter(ours.get("metrics") or {}), None)  # "ms", or "ms_per_token" (decode)
    mine = (ours.get("metrics") or {}).get(metric)
    if not prof or not mine or "text" not in prof:
        return None
    best = [
        (d["metrics"][metric]["median"], m)
        for m, d in docs.items()
        if m != "ours" and metric in (d.get("metrics") or {})
    ]
    if not best or min(best)[0] >= mine["median"]:
        if best and "error" not in ours:
            path.unlink(missing_ok=True)
        return None
    t, mode = min(best)
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"{wl.title} {case.name} {precision}: ours {mine['median']:.3f} {metric}, best PyTorch "
        f"{mode} {t:.3f} ({t / mine['median']:.2f}x)\n{prof['text']}\n"
    )
    return path
