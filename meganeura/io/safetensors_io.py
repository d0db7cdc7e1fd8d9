"""Reading safetensors files into NumPy, bfloat16 included.

``safetensors.numpy`` cannot return bfloat16 (NumPy has no such dtype), yet Hugging Face
checkpoints are often stored in it. This reader follows the format's specification
(https://huggingface.co/docs/safetensors: an 8-byte little-endian header length, a JSON header
of ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian bytes) and widens BF16
exactly to float32 (a bfloat16 is the high half of a float32). Every other dtype is returned
as stored.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "BOOL": np.bool_,
}


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; names the path and the problem."""


def load_file(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file, by name (BF16 widened to float32).

    Raises:
        FileNotFoundError: no such file.
        SafetensorsError: a truncated or malformed file, or an unknown dtype.
    """
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise SafetensorsError(f"{path}: {len(data)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise SafetensorsError(f"{path}: header of {n} bytes runs past the end of the file")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
    body = memoryview(data)[8 + n :]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info.get("dtype"), tuple(info.get("shape", ()))
        start, end = info.get("data_offsets", (0, -1))
        if not 0 <= start <= end <= len(body):
            raise SafetensorsError(f"{path}: tensor {name!r} lies outside the file")
        raw = body[start:end]
        count = int(np.prod(shape, dtype=np.int64))
        if dtype == "BF16":
            if len(raw) != 2 * count:
                raise SafetensorsError(f"{path}: tensor {name!r} has {len(raw)} bytes for {shape}")
            half = np.frombuffer(raw, "<u2", count).astype(np.uint32)
            out[name] = (half << 16).view(np.float32).reshape(shape)
            continue
        if dtype not in _DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        np_dtype = np.dtype(_DTYPES[dtype]).newbyteorder("<")
        if len(raw) != np_dtype.itemsize * count:
            raise SafetensorsError(f"{path}: tensor {name!r} has {len(raw)} bytes for {shape}")
        out[name] = np.frombuffer(raw, np_dtype, count).astype(np_dtype.newbyteorder("="))
        out[name] = out[name].reshape(shape)
    return out
