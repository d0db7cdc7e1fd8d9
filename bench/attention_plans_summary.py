"""What ``bench/attention_plans.py``'s sweep found per shape (``summarize``, ``print_table``,
``best_overrides``) and what ``--record`` writes into the device's tuning cache (``record``).
Rows are the sweep's: one per (program, kernel label) with the plan, its time and whether the
program's results matched the reference."""

from __future__ import annotations

import statistics

# label -> plan mode; the training program's kernels, then the forward program's
LABELS = {"fwd+lse": "fwd", "dq+delta": "dq", "dkv": "dkv", "dk": "dk", "dv": "dv", "fwd": "fwd"}
# mode -> the label whose times decide its recorded plan (``--record``): fwd+lse for fwd
RECORD_LABELS = {"fwd": "fwd+lse", "dq": "dq+delta", "dkv": "dkv", "dk": "dk", "dv": "dv"}
MIN_GAIN = 1.03  # a plan is recorded only when this much faster than the default (tune.matmul)


def _dims(shape):
    from meganeura.codegen.wgsl.attention.plan import Dims

    _, b, hq, hkv, lq, lk, d, _ = shape
    return Dims(b, hkv, hq // hkv, lq, lk, d, d)


def best_overrides(rows, name, defaults) -> dict[str, tuple[int, int, int]]:
    """Per training mode of shape ``name``, the plan with the lowest median time among the
    correct ones, where it is not the default plan (``RECORD_LABELS``' kernels)."""
    out = {}
    for mode, label in RECORD_LABELS.items():
        per_plan: dict[tuple, list[float]] = {}
        for r in rows:
            if r["shape"] == name and r["label"] == label and r["ok"]:
                per_plan.setdefault(tuple(r["plan"]), []).append(r["us"])
        if per_plan:
            plan = min(per_plan, key=lambda p: statistics.median(per_plan[p]))
            d = defaults[mode]
            if plan != (d.rows, d.lanes, d.tile):
                out[mode] = plan
    return out


def summarize(rows, name, defaults, left, rounds, seconds) -> dict:
    """Per label: the default plan's time (median of its samples), the best correct plan and
    its time; per shape: the training kernels' sum at the default and at the best plans."""
    out = {"rounds": rounds, "seconds": round(seconds, 2), "untimed_plans": left, "kernels": {}}
    for label, mode in LABELS.items():
        mine = [r for r in rows if r["shape"] == name and r["label"] == label]
        if not mine:
            continue
        dflt = [r["us"] for r in mine if r["default"]]
        per_plan: dict[tuple, list[float]] = {}
        for r in mine:
            if r["ok"]:
                per_plan.setdefault(tuple(r["plan"]), []).append(r["us"])
        if not per_plan:
            continue
        best = min(per_plan.items(), key=lambda kv: statistics.median(kv[1]))
        d = defaults[mode]
        out["kernels"][label] = {
            "default_plan": [d.rows, d.lanes, d.tile],
            "default_us": statistics.median(dflt) if dflt else None,
            "default_samples": len(dflt),
            "best_plan": list(best[0]),
            "best_us": statistics.median(best[1]),
            "plans_timed": len(per_plan),
        }
    k = out["kernels"]

    def total(key):
        if not all(lb in k for lb in ("fwd+lse", "dq+delta")):
            return None
        kv = [k[lb][key] for lb in ("dkv",) if lb in k]
        sep = [k[lb][key] for lb in ("dk", "dv") if lb in k]
        pair = min([*kv, sum(sep)] if len(sep) == 2 else kv or [0.0])
        return k["fwd+lse"][key] + k["dq+delta"][key] + pair

    out["train_us_default"], out["train_us_best"] = total("default_us"), total("best_us")
    return out


def print_table(s: dict) -> None:
    print(f"{'kernel':<10} {'default plan':>14} {'us':>8} {'best plan':>14} {'us':>8} "
          f"{'x':>6} {'plans':>6}")  # fmt: skip
    for label, k in s["kernels"].items():
        dp, bp = "x".join(map(str, k["default_plan"])), "x".join(map(str, k["best_plan"]))
        du = k["default_us"] or float("nan")
        print(f"{label:<10} {dp:>14} {du:8.1f} {bp:>14} {k['best_us']:8.1f} "
              f"{du / k['best_us']:6.2f} {k['plans_timed']:6d}")  # fmt: skip
    if s["train_us_default"]:
        print(
            f"training kernels (fwd+lse + dq+delta + min(dkv, dk+dv)): default "
            f"{s['train_us_default']:.1f} us, best {s['train_us_best']:.1f} us; "
            f"{s['rounds']} rounds in {s['seconds']:.1f} s, untimed {s['untimed_plans']}"
        )


def record(summary: dict, shapes, device, min_gain: float = MIN_GAIN) -> list[str]:
    """Write each (shape, mode)'s best plan of ``summary`` (``Sweep.summary``) into
    ``device``'s tuning cache where it beat the default by ``min_gain``; remove the entry of a
    key whose default won. Returns one line per key: what was recorded, kept or removed.

    Raises:
        ValueError: the tuning cache is off (``set_cache_dir(None)``).
        OSError: the cache file cannot be written.
    """
    from meganeura.tune import cache as tc
    from meganeura.tune.attention_entries import format_attention_key, format_lane_plan

    key = tc.device_key(device)
    cache = tc.load(key)
    timing = "timestamps" if "timestamp-query" in device.features else "wall"
    lines = []
    for shape in shapes:
        kernels = summary.get(shape[0], {}).get("kernels", {})
        dims = _dims(shape)
        for mode, label in RECORD_LABELS.items():
            k = kernels.get(label)
            if k is None:
                continue
            entry_key = (mode, dims.b, dims.hkv, dims.group, dims.lq, dims.lk, dims.d, dims.dv)
            text = f"{shape[0]} {label} ({format_attention_key(entry_key)})"
            default, best = format_lane_plan(k["default_plan"]), format_lane_plan(k["best_plan"])
            du, bu = k["default_us"], k["best_us"]
            if not du or not bu:
                lines.append(f"{text}: default plan not timed, left as it was")
                continue
            gain = du / bu
            if best != default and gain >= min_gain:
                cache.attention[entry_key] = tc.AttentionEntry(
                    best, round(bu, 3), default, round(du, 3), timing
                )
                lines.append(f"{text}: recorded {best} {bu:.1f} us (default {default} "
                             f"{du:.1f} us, {gain:.2f}x)")  # fmt: skip
            elif cache.attention.pop(entry_key, None) is not None:
                lines.append(f"{text}: default {default} kept ({gain:.2f}x < {min_gain}), "
                             "old entry removed")  # fmt: skip
            else:
                lines.append(f"{text}: default {default} kept ({gain:.2f}x < {min_gain})")
    path = tc.save(cache)
    lines.append(f"tuning cache: {path} ({len(cache.attention)} attention entries)")
    return lines
