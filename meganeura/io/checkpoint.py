"""Training checkpoints: tensors in safetensors, everything else as one JSON metadata string.

Role in the pipeline: the persistence boundary of training. A checkpoint holds the host copies of
parameters and optimizer state (``tensors``) plus a JSON-serializable ``metadata`` dict (step,
epoch, config, RNG state, ...). The format is plain safetensors
(https://huggingface.co/docs/safetensors), so other tools can read the tensors; the metadata sits
in the header's ``__metadata__`` map as a single JSON string under the key ``"meganeura"``,
because safetensors metadata is str -> str only.

Invariants:
    * Saving is atomic: the bytes go to a temporary file in the destination directory, are
      flushed and fsync'ed, then ``os.replace``'d onto the path. A crash or error mid-save leaves
      the previous checkpoint untouched and removes the temporary file.
    * A save killed mid-write (SIGKILL, power loss) cannot remove its temporary file; the next
      save into that directory does (POSIX). Temporaries are named
      ``.<name>.meganeura-partial-<random>.tmp`` and their writer holds an exclusive ``flock``
      on them until the rename, so only files of that name that nobody holds locked are removed:
      never a user's file, nor the file of another process saving at the same time.
    * Loading either returns exactly what was saved or raises ``CheckpointError`` naming the
      path and the offending key; it never returns a partial or silently reshaped state.
    * Metadata round-trips through JSON: ints of any size (a PCG64 ``bit_generator.state`` holds
      128-bit ints) come back exact; tuples come back as lists.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

__all__ = [
    "METADATA_KEY",
    "CheckpointError",
    "check_count",
    "check_rng_state",
    "load_checkpoint",
    "remove_stale_temporaries",
    "save_checkpoint",
    "write_atomic",
]

METADATA_KEY = "meganeura"

# Writes go out in chunks so a failure can happen part-way through, as a full disk would.
_CHUNK_BYTES = 1 << 20

# Temporary files of a save: ".<target name>.meganeura-partial-<mkstemp's random part>.tmp".
_TMP_TAG = "meganeura-partial-"
_TMP_NAME = re.compile(r"\..+\." + _TMP_TAG + r"[A-Za-z0-9_]+\.tmp")

try:  # POSIX advisory locks tell a live writer's temporary file from a dead one's
    import fcntl
except ImportError:  # pragma: no cover - Windows: stale temporaries are left alone
    fcntl = None


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match what the caller expects."""


def _write_payload(f, payload: bytes) -> None:
    """Write ``payload`` to the open binary file ``f``; tests replace it to simulate a crash."""
    view = memoryview(payload)
    for start in range(0, len(view), _CHUNK_BYTES):
        f.write(view[start : start + _CHUNK_BYTES])


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable on POSIX; Windows cannot open directories, so skip there.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    path: str | Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any]
) -> None:
    """Atomically write ``tensors`` and ``metadata`` to a safetensors file.

    Args:
        path: destination file; its directory must exist. An existing file is replaced only
            once the new one is completely on disk.
        tensors: name -> array of any dtype safetensors supports (bool, ints, float16/32/64).
            Non-contiguous arrays are copied; 0-d arrays keep shape ``()``.
        metadata: JSON-serializable mapping (str keys; lists, dicts, str, int, float, bool, None).
            Numpy scalars and arrays are not JSON: convert them (``.item()``, ``.tolist()``).

    Temporary files that earlier saves into the same directory left when they were killed
    are removed first (:func:`remove_stale_temporaries`).

    Raises:
        TypeError: a tensor is not a numpy array, or metadata is not JSON-serializable. Raised
            before anything is written.
        OSError: the file cannot be written; the previous checkpoint, if any, is intact.
    """
    path = Path(path)
    for name, value in tensors.items():
        if not isinstance(value, np.ndarray):
            raise TypeError(f"tensor {name!r} is {type(value).__name__}, expected np.ndarray")
    try:
        meta_json = json.dumps(dict(metadata), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata is not JSON-serializable: {e}") from e
    payload = safetensors.numpy.save(
        # Not np.ascontiguousarray: it turns 0-d arrays (a step counter) into shape [1].
        {name: np.require(value, requirements="C") for name, value in tensors.items()},
        metadata={METADATA_KEY: meta_json},
    )
    write_atomic(path, payload)


def write_atomic(path: str | Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` atomically: a locked temporary file in the same directory,
    flushed and fsync'ed, then ``os.replace``'d onto ``path`` (the module's invariants). Stale
    temporaries of killed saves into that directory are removed first.

    Raises:
        OSError: the file cannot be written; an existing file at ``path`` is intact and the
            temporary file is removed.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    remove_stale_temporaries(directory)
    # Same directory as the target: os.replace is atomic only within one filesystem.
    fd, tmp_name = _locked_temporary(directory, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_payload(f, payload)
            f.flush()
            os.fsync(f.fileno())
            if fcntl is not None:  # renamed while open: the lock is held until the name goes
                os.replace(tmp_name, path)
        if fcntl is None:  # Windows cannot rename an open file
            os.replace(tmp_name, path)
    except BaseException:
        # BaseException too: a KeyboardInterrupt mid-save must not leave a stray temp file.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _same_file(name: str, fd: int) -> bool:
    try:
        a, b = os.stat(name, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _locked_temporary(directory: Path, name: str) -> tuple[int, str]:
    """A new temporary file for ``name`` in ``directory``, exclusively locked (POSIX)."""
    while True:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{name}.{_TMP_TAG}", suffix=".tmp")
        if fcntl is None:
            return fd, tmp_name
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Another save's cleanup may have locked and removed it between mkstemp and flock.
        if _same_file(tmp_name, fd):
            return fd, tmp_name
        os.close(fd)


def remove_stale_temporaries(directory: str | Path) -> list[str]:
    """Remove the temporary files that killed saves left in ``directory``; returns their names.

    Only files named as :func:`save_checkpoint` names its temporaries, that are regular files
    and that no process holds locked (a live save holds its lock until the rename) are
    removed. Does nothing where ``fcntl`` is missing (Windows), and skips any file it cannot
    open, lock or remove: cleaning is best effort and never fails a save.
    """
    if fcntl is None:
        return []
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        if not _TMP_NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(entry.path, fd):  # still the file we locked, not a new one
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:  # locked by a live save, or not ours to remove
            pass
        finally:
            os.close(fd)
    return removed


def _read_metadata(path: Path, data: bytes) -> dict:
    # Header layout (safetensors spec): u64 little-endian length N, then N bytes of JSON.
    # safetensors.numpy.load has already validated it, so only our own key can be wrong here.
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    raw = (header.get("__metadata__") or {}).get(METADATA_KEY)
    if raw is None:
        raise CheckpointError(
            f"{path}: no {METADATA_KEY!r} metadata; not a checkpoint written by save_checkpoint"
        )
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: {METADATA_KEY!r} metadata is not valid JSON: {e}") from e
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: metadata is a {type(metadata).__name__}, expected object")
    return metadata


def _check_expected(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]],
) -> None:
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unknown:
            parts.append(f"unknown keys {unknown}")
        raise CheckpointError(f"{path}: {'; '.join(parts)}")
    mismatches = []
    for name in sorted(expected):
        shape, dtype = tuple(expected[name][0]), np.dtype(expected[name][1])
        actual = tensors[name]
        if actual.shape != shape or actual.dtype != dtype:
            mismatches.append(
                f"{name!r}: expected {dtype}{list(shape)}, got {actual.dtype}{list(actual.shape)}"
            )
    if mismatches:
        raise CheckpointError(f"{path}: shape/dtype mismatch: " + "; ".join(mismatches))


def load_checkpoint(
    path: str | Path,
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: the safetensors file.
        expected: optional name -> (shape, dtype) that the tensors must match exactly: the same
            set of names, and per name the same shape and dtype. ``None`` skips the check.

    Returns:
        ``(tensors, metadata)``: writable arrays by name (copies, not views), and the metadata
        dict as JSON decoded it.

    Raises:
        CheckpointError: the file is missing, unreadable, truncated or not safetensors; it lacks
            the ``"meganeura"`` metadata; or it disagrees with ``expected`` (missing or unknown
            keys listed, or per key the expected vs actual shape and dtype). Messages name
            ``path``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} does not exist") from e
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {e}") from e
    try:
        tensors = safetensors.numpy.load(data)
    except Exception as e:  # safetensors raises SafetensorError, ValueError, ... by version
        raise CheckpointError(
            f"{path}: corrupt or truncated safetensors file ({len(data)} bytes): {e}"
        ) from e
    metadata = _read_metadata(path, data)
    if expected is not None:
        _check_expected(path, tensors, expected)
    # np.frombuffer views can be read-only depending on the safetensors version; own the memory.
    tensors = {name: np.array(value, copy=True) for name, value in tensors.items()}
    return tensors, metadata


# ------------------------------------------------------------------ metadata checks
# A loader validates every value it will apply with these before it changes anything, so a bad
# file raises CheckpointError naming the key, what was expected and what was found.


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_count(path: str | Path, meta: Mapping, key: str, what: str, minimum: int = 0) -> int:
    """``meta[key]`` as a count: a Python int (not a bool, float or str) >= ``minimum``.

    Raises:
        CheckpointError: missing, or not such an int; names ``path``, ``key``, the expectation
            (``what``) and the value found.
    """
    if key not in meta:
        raise CheckpointError(f"{path}: metadata has no {key!r} ({what}, an integer >= {minimum})")
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(
            f"{path}: metadata {key!r} is {_shown(value)}; expected {what}, an integer >= {minimum}"
        )
    return value


def _is_uint(value: Any, bits: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << bits


def check_rng_state(path: str | Path, meta: Mapping, key: str, bit_generator) -> dict:
    """``meta[key]`` as a state of NumPy bit generator ``bit_generator``'s type
    (``bit_generator.state``'s form), checked without touching ``bit_generator``.

    PCG64 states (what ``meganeura.random`` and ``np.random.default_rng`` use) are checked
    field by field, as NumPy itself accepts floats, bools and out-of-range values in some
    fields (``numpy/random/_pcg64.pyx``, ``state.setter``): exactly the keys
    ``bit_generator``, ``state`` (``state`` and ``inc``, ints in [0, 2**128)),
    ``has_uint32`` (0 or 1) and ``uinteger`` (an int in [0, 2**32)). Other bit generators'
    states are checked by setting them on a fresh generator of the same type.

    Raises:
        CheckpointError: missing or malformed; names ``path``, ``key``, what was expected and
            the value found.
    """
    kind = type(bit_generator)
    value = meta.get(key)
    expected = f"expected a {kind.__name__} state ({kind.__name__}().state's form)"
    if key not in meta:
        raise CheckpointError(f"{path}: metadata has no {key!r}; {expected}")
    problem = None
    if kind.__name__ == "PCG64":
        fields = {"bit_generator", "state", "has_uint32", "uinteger"}
        inner = value.get("state") if isinstance(value, dict) else None
        if not isinstance(value, dict) or set(value) != fields:
            problem = (
                f"keys {sorted(value) if isinstance(value, dict) else None}, not {sorted(fields)}"
            )
        elif value["bit_generator"] != "PCG64":
            problem = f"bit_generator {value['bit_generator']!r}, not 'PCG64'"
        elif not isinstance(inner, dict) or set(inner) != {"state", "inc"}:
            problem = "'state' is not {'state': int, 'inc': int}"
        elif not (_is_uint(inner["state"], 128) and _is_uint(inner["inc"], 128)):
            problem = "'state' or 'inc' is not an integer in [0, 2**128)"
        elif value["has_uint32"] not in (0, 1) or isinstance(value["has_uint32"], (bool, float)):
            problem = f"has_uint32 {value['has_uint32']!r}, not 0 or 1"
        elif not _is_uint(value["uinteger"], 32):
            problem = f"uinteger {value['uinteger']!r}, not an integer in [0, 2**32)"
    if problem is None:
        try:
            kind().state = value
        except (TypeError, ValueError, KeyError, OverflowError) as e:
            problem = str(e)
    if problem is not None:
        raise CheckpointError(f"{path}: metadata {key!r} is {_shown(value)}; {expected}: {problem}")
    return value
