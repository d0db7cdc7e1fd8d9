"""The GGUF container: header, key-values and tensor directory, parsed straight from a memory map.

gguf-py's ``GGUFReader`` builds a NumPy view for every element of every metadata array, which
takes about 3 s for the 98,000 token and merge strings of a small Llama's vocabulary; this
parser reads the same layout with ``struct`` in a tenth of that and leaves the tensor bytes in
the memory map. Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, v2 and v3,
little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key-value count; each
key-value is a string key, a u32 value type and the value (arrays: u32 item type, u64 count,
items; strings: u64 length, UTF-8 bytes); each tensor is a name, u32 dimension count, u64
dimensions fastest first, u32 ggml type, u64 offset into the data section, which starts at the
next multiple of ``general.alignment`` (default 32) after the directory.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF value type -> struct format of one scalar.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
_NUMPY |= {11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Bytes that do not follow the GGUF layout."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory.

    Attributes:
        name: the GGUF name, e.g. ``"blk.0.attn_q.weight"``.
        ggml_type: the ggml type id (``gguf.GGMLQuantizationType`` value).
        shape: dimensions slowest first (row-major; ``[out, in]`` for a matrix).
        data: the tensor's bytes in the memory map, uint8 ``[*shape[:-1], row_bytes]``.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: Any, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"{self.path}: header runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"{self.path}: a string runs past the end of the file")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown value type {kind} at byte {self.pos}")
        item, count = self.take("I"), self.take("Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFFormatError(f"{self.path}: an array runs past the end of the file")
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        return [self.value(item) for _ in range(count)]


def read_gguf(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The key-values (plain Python values, arrays as lists) and the tensor directory.

    Raises:
        GGUFFormatError: not GGUF, a version other than 2 or 3, big-endian, or truncated.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != _MAGIC:
        raise GGUFFormatError(f"{path}: no GGUF magic (starts with {bytes(buf[:4])!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        what = "a big-endian file" if swapped in (2, 3) else f"version {version}"
        raise GGUFFormatError(f"{path}: {what} is not supported; little-endian GGUF v2/v3 is")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": n_tensors,
        "GGUF.kv_count": n_kv,
    }
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    directory = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        directory.append((name, dims, cur.take("I"), cur.take("Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    body = np.frombuffer(buf, np.uint8)
    tensors = []
    for name, dims, ggml_type, offset in directory:
        shape = tuple(int(d) for d in reversed(dims))
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        nbytes = _nbytes(ggml_type, shape[-1] if shape else 1, path, name) * rows
        begin = start + offset
        if begin + nbytes > len(body):
            raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file")
        data = body[begin : begin + nbytes].reshape(*shape[:-1], -1)
        tensors.append(TensorInfo(name, ggml_type, shape, data))
    return metadata, tensors


def _nbytes(ggml_type: int, row: int, path: Path, name: str) -> int:
    """Bytes of one row of ``row`` values of this type (gguf's GGML_QUANT_SIZES)."""
    from meganeura.io._optional import require

    gguf = require("gguf")
    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
    except ValueError:
        raise GGUFFormatError(
            f"{path}: tensor {name!r} has unknown ggml type {ggml_type}"
        ) from None
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if row % block:
        raise GGUFFormatError(
            f"{path}: tensor {name!r} rows of {row} values are not whole {qtype.name} blocks "
            f"of {block}"
        )
    return row // block * size
