"""The per-device tuning cache: matmul and attention lane plans measured on one adapter, read
by the next run.

One JSON file per device under the cache directory (``default_cache_dir()``,
``~/.cache/meganeura/tuning``; the CLI points it at ``$MEGANEURA_CACHE_DIR/tuning``, library
code reads no environment variable: ``set_cache_dir``). A device is its adapter name, driver
(wgpu's ``description``: the driver and its version) and backend, plus the PCI vendor and
device ids (``DeviceKey``); a new driver is a new device, so a driver update re-tunes. The file::

    {"format": 1,
     "device": {"adapter": ..., "driver": ..., "backend": ..., "vendor_id": ..., "device_id": ...},
     "matmul": {"M,K,N,layout,batch": {"plan": "64x64x16/s8", "gpu_us": 12.3,
                                       "default_plan": "64x64x16", "heuristic_us": 15.9,
                                       "timing": "timestamps", "measured": "2026-12-03"}},
     "attention": {"fwd,1,3,3,128,128,64,64": {"plan": "8x16x32", "gpu_us": 17.4,
                                               "default_plan": "4x16x32", "heuristic_us": 23.2,
                                               "timing": "timestamps", "measured": ...}}}

``heuristic_us`` is the time of the plan chosen without the cache (``default_plan``). The
``attention`` table (optional: files without it are valid, ``bench/attention_plans.py
--record`` writes it) keys a flash-attention lane kernel by its mode (``attention.plan``'s lane
modes: fwd, stats, lse, dq, dk, dv, dkv) and its ``attention.plan.Dims`` (batch, kv heads,
query heads per kv head, query and key lengths, head dims), its plan is ``ROWSxLANESxTILE``
(``attention_entries``).

Invariants:
  * a file is written to a temporary name in the same folder and renamed over the old one, so
    a reader sees the old file or the new one, never half of one;
  * a file that cannot be read (corrupt JSON, another format version, another device's key,
    a malformed entry) gives one ``TuningCacheWarning`` naming the file and is ignored, never
    an exception; a tuner writing the device's file replaces it;
  * nothing here imports wgpu: a device is seen through its ``info`` mapping.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .attention_entries import (
    AttentionEntry,
    AttentionKey,
    PlanEntry,
    format_attention_key,
    parse_attention_key,
    parse_lane_plan,
)

FORMAT = 1
LAYOUTS = ("nn", "nt", "tn", "tt")
# (M, K, N, layout, batch): the product after batch folding, as ``matmul.problem_of`` sees it
ShapeKey = tuple[int, int, int, str, int]


class TuningCacheWarning(UserWarning):
    """A tuning cache file was ignored (unreadable, another format or device, bad entry)."""


def default_cache_dir() -> Path:
    """``~/.cache/meganeura/tuning``."""
    return Path.home() / ".cache" / "meganeura" / "tuning"


_dir: list[Path | None] = [default_cache_dir()]


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Read and write tuning files in ``path`` from now on; None: no device cache at all
    (``choose_plan`` falls back to the static table, ``save`` refuses). The CLI calls this with
    ``$MEGANEURA_CACHE_DIR/tuning``; tests with a temporary folder."""
    _dir[0] = None if path is None else Path(path)


def cache_dir() -> Path | None:
    """The folder set by ``set_cache_dir`` (default ``default_cache_dir()``), or None."""
    return _dir[0]


@dataclass(frozen=True)
class DeviceKey:
    """What identifies a device's measurements: adapter, driver, backend, PCI ids."""

    adapter: str
    driver: str
    backend: str
    vendor_id: int = 0
    device_id: int = 0

    @property
    def slug(self) -> str:
        """The file name's stem: readable words of adapter, driver and backend, plus a short
        hash of every field (two keys whose words slug alike still get two files)."""
        words = "_".join(_slug(s) for s in (self.adapter, self.driver, self.backend) if s)
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"{words[:120]}_{digest[:10]}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.casefold()).strip("-")


def device_key(device_or_info: Any) -> DeviceKey:
    """The key of a runtime ``Device`` (or of an adapter ``info`` mapping)."""
    info = device_or_info if isinstance(device_or_info, Mapping) else device_or_info.info
    return DeviceKey(
        adapter=str(info.get("device") or info.get("vendor") or "unknown"),
        driver=str(info.get("description", "")),
        backend=str(info.get("backend_type", "")),
        vendor_id=int(info.get("vendor_id") or 0),
        device_id=int(info.get("device_id") or 0),
    )


@dataclass(frozen=True)
class MatmulEntry(PlanEntry):
    """One tuned product: a ``PlanEntry`` whose plans are ``matmul.plan.parse_plan``'s."""


@dataclass
class TuningCache:
    """A device's tuning file in memory: ``matmul`` maps shape keys to entries, ``attention``
    maps (mode, b, hkv, group, lq, lk, d, dv) keys to lane-plan entries."""

    key: DeviceKey
    matmul: dict[ShapeKey, MatmulEntry] = field(default_factory=dict)
    attention: dict[AttentionKey, AttentionEntry] = field(default_factory=dict)

    def plans(self) -> tuple[tuple[ShapeKey, str], ...]:
        """Sorted ``(shape key, plan)`` pairs: ``Limits.matmul_plans``."""
        return tuple(sorted((k, e.plan) for k, e in self.matmul.items()))

    def attention_plans(self) -> tuple[tuple[AttentionKey, tuple[int, int, int]], ...]:
        """Sorted ``(key, (rows, lanes, tile))`` pairs: ``Limits.attention_plans``."""
        return tuple(sorted((k, parse_lane_plan(e.plan)) for k, e in self.attention.items()))

    def to_json(self) -> dict:
        doc = {
            "format": FORMAT,
            "device": asdict(self.key),
            "matmul": {format_shape(k): asdict(e) for k, e in sorted(self.matmul.items())},
        }
        if self.attention:  # a file without attention entries reads as before
            doc["attention"] = {
                format_attention_key(k): asdict(e) for k, e in sorted(self.attention.items())
            }
        return doc


def format_shape(key: ShapeKey) -> str:
    """``(128, 576, 192, "nt", 1)`` -> ``"128,576,192,nt,1"``."""
    m, k, n, layout, batch = key
    return f"{m},{k},{n},{layout},{batch}"


def parse_shape(text: str) -> ShapeKey:
    """``"M,K,N,layout[,batch]"`` -> a shape key (batch 1 when left out).

    Raises:
        ValueError: not that form, a size < 1, or a layout outside nn, nt, tn, tt.
    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (4, 5):
        raise ValueError(f"a matmul shape is M,K,N,layout[,batch], got {text!r}")
    m, k, n, layout, *rest = parts
    try:
        dims = [int(m), int(k), int(n), int(rest[0]) if rest else 1]
    except ValueError:
        raise ValueError(f"M, K, N and batch must be integers in {text!r}") from None
    if min(dims) < 1:
        raise ValueError(f"M, K, N and batch must be >= 1 in {text!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r} in {text!r}")
    return dims[0], dims[1], dims[2], layout, dims[3]


def cache_path(key: DeviceKey, directory: str | os.PathLike | None = None) -> Path:
    """The file of ``key`` in ``directory`` (default ``cache_dir()``).

    Raises:
        ValueError: no directory given and the cache is off (``set_cache_dir(None)``).
    """
    folder = Path(directory) if directory is not None else cache_dir()
    if folder is None:
        raise ValueError("the tuning cache is off (set_cache_dir(None)); pass a directory")
    return folder / f"{key.slug}.json"


def load(key: DeviceKey, directory: str | os.PathLike | None = None) -> TuningCache:
    """The device's cache; empty when there is no file, or when it cannot be used (then with a
    ``TuningCacheWarning`` naming the file and why). Entries with a key or plan this version
    does not parse (matmul or attention) are dropped with a warning; the rest are kept. An
    ``attention`` table that is not an object is dropped with a warning, the matmul entries
    kept."""
    if directory is None and cache_dir() is None:
        return TuningCache(key)
    path = cache_path(key, directory)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return TuningCache(key)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return _ignored(key, path, f"unreadable ({e})")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        return _ignored(key, path, f"format {found!r}, this version reads {FORMAT}")
    if doc.get("device") != asdict(key):
        return _ignored(key, path, f"written for device {doc.get('device')!r}")
    cache = TuningCache(key)
    table = doc.get("matmul")
    if not isinstance(table, dict):
        return _ignored(key, path, "no 'matmul' table")
    cache.matmul.update(_entries(path, "entry", table, _matmul_entry))
    table = doc.get("attention", {})
    if not isinstance(table, dict):
        warnings.warn(
            f"tuning cache {path}: 'attention' table ignored (not an object)",
            TuningCacheWarning,
            2,
        )
        table = {}
    cache.attention.update(_entries(path, "attention entry", table, _attention_entry))
    return cache


def _matmul_entry(text: str, raw) -> tuple[ShapeKey, MatmulEntry]:
    from ..codegen.wgsl.matmul.plan import parse_plan

    shape = parse_shape(text)
    entry = MatmulEntry(**raw)
    parse_plan(entry.plan)
    return shape, entry


def _attention_entry(text: str, raw) -> tuple:
    key = parse_attention_key(text)
    entry = AttentionEntry(**raw)
    parse_lane_plan(entry.plan)
    return key, entry


def _entries(path: Path, what: str, table: dict, read) -> dict:
    """``{key: entry}`` of ``table``'s items through ``read(text, raw)``; an item it refuses
    (TypeError, ValueError) is dropped with a ``TuningCacheWarning`` naming it."""
    out = {}
    for text, raw in table.items():
        try:
            key, entry = read(text, raw)
        except (TypeError, ValueError) as e:
            warnings.warn(
                f"tuning cache {path}: {what} {text!r} ignored ({e})", TuningCacheWarning, 3
            )
            continue
        out[key] = entry
    return out


def _ignored(key: DeviceKey, path: Path, why: str) -> TuningCache:
    warnings.warn(
        f"tuning cache {path} ignored: {why}; plans fall back to the defaults "
        "(`meganeura tune --clear` removes it, a new tune replaces it)",
        TuningCacheWarning,
        3,
    )
    return TuningCache(key)


def save(cache: TuningCache, directory: str | os.PathLike | None = None) -> Path:
    """Write ``cache`` atomically (temporary file in the same folder, then ``os.replace``).

    Returns:
        The file's path.

    Raises:
        ValueError: the cache is off and no directory is given.
        OSError: the folder cannot be created or written.
    """
    path = cache_path(cache.key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cache.to_json(), indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic within one filesystem: same folder
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def clear(key: DeviceKey, directory: str | os.PathLike | None = None) -> bool:
    """Remove the device's file; True when there was one."""
    path = cache_path(key, directory)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


# (matmul plans, attention plans) per (file, modification time, size): ``device_limits`` runs
# at every compile.
_loaded: dict[tuple, tuple[tuple, tuple]] = {}


def _device_tables(device: Any) -> tuple[tuple, tuple]:
    """(matmul plans, attention plans) of a runtime Device's cache file, ((), ()) without
    one. Reads the file again only when it changed, so a corrupt file warns once."""
    folder = cache_dir()
    if folder is None:
        return (), ()
    key = device_key(device)
    path = cache_path(key)
    try:
        st = path.stat()
    except OSError:
        return (), ()
    stamp = (str(path), st.st_mtime_ns, st.st_size)
    if stamp not in _loaded:
        cache = load(key)
        _loaded[stamp] = cache.plans(), cache.attention_plans()
    return _loaded[stamp]


def device_plans(device: Any) -> tuple[tuple[ShapeKey, str], ...]:
    """``Limits.matmul_plans`` of a runtime Device: its cache's plans, () without one."""
    return _device_tables(device)[0]


def device_attention_plans(device: Any) -> tuple[tuple[AttentionKey, tuple[int, int, int]], ...]:
    """``Limits.attention_plans`` of a runtime Device: its cache's attention lane plans,
    ``((mode, b, hkv, group, lq, lk, d, dv), (rows, lanes, tile))`` pairs sorted, () without
    a file or a table."""
    return _device_tables(device)[1]
