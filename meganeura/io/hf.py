"""Reading Hugging Face model folders: ``config.json`` plus safetensors weights, any architecture.

A folder holds either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Files are
memory-mapped and each tensor is read when asked for; floating tensors come out as float32
(bfloat16 and float16 widened exactly), others (e.g. int64 ``position_ids`` buffers) as stored.
Names are PyTorch's, as in the files. The safetensors layout
(https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header
``{name: {dtype, shape, data_offsets}}``, then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meganeura.io.safetensors_io import _DTYPES, SafetensorsError

if TYPE_CHECKING:
    from meganeura.io.tokenizer import Tokenizer

__all__ = ["HFCheckpoint", "load_hf"]

_FLOATS = {"F16", "BF16", "F32", "F64"}


class _SafetensorsFile:
    """One memory-mapped safetensors file; ``tensor(name)`` reads one tensor."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if 8 + n > size:
                raise SafetensorsError(f"{path}: header of {n} bytes runs past the end")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header
        self._body = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else None

    def tensor(self, name: str, float_dtype: Any = np.float32) -> np.ndarray:
        info = self.header[name]
        dtype, shape = info["dtype"], tuple(info["shape"])
        start, end = info["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        length = 0 if self._body is None else len(self._body)
        if not 0 <= start <= end <= length:
            raise SafetensorsError(f"{self.path}: tensor {name!r} lies outside the file")
        raw = self._body[start:end] if self._body is not None else np.empty(0, np.uint8)
        if dtype == "BF16":
            itemsize = 2
        elif dtype in _DTYPES:
            itemsize = np.dtype(_DTYPES[dtype]).itemsize
        else:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has unknown dtype {dtype!r}")
        if end - start != itemsize * count:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} has {end - start} bytes, but {dtype}{list(shape)} "
                f"needs {itemsize * count}"
            )
        if dtype == "BF16":
            # A bfloat16 is the high half of a float32: widening is a shift, exact.
            wide = raw.view("<u2").astype(np.uint32) << 16
            out = wide.view(np.float32)
        else:
            out = raw.view(np.dtype(_DTYPES[dtype]).newbyteorder("<"))
        out = out.reshape(shape)
        if dtype in _FLOATS and float_dtype is not None:
            return np.array(out, dtype=float_dtype, copy=True)
        return np.array(out, dtype=out.dtype.newbyteorder("="), copy=True)


class HFCheckpoint:
    """A Hugging Face model folder; build it with :func:`load_hf`.

    Attributes:
        path: the folder.
        config: ``config.json`` as a dict.
        dtypes: tensor name -> safetensors dtype as stored (``"BF16"``, ``"F32"``...).
    """

    def __init__(self, folder: str | os.PathLike[str]):
        self.path = Path(folder)
        config = self.path / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"no config.json in {self.path}")
        self.config: dict[str, Any] = json.loads(config.read_text(encoding="utf-8"))
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        files: dict[str, _SafetensorsFile] = {}
        self._where: dict[str, _SafetensorsFile] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise SafetensorsError(f"{index}: no 'weight_map' of tensor name -> shard file")
            for name, shard in weight_map.items():
                if shard not in files:
                    if not (self.path / shard).is_file():
                        raise FileNotFoundError(
                            f"{index} puts {name!r} in shard {shard!r}, which is not in {self.path}"
                        )
                    files[shard] = _SafetensorsFile(self.path / shard)
                if name not in files[shard].header:
                    raise SafetensorsError(f"{index} puts {name!r} in {shard!r}, which lacks it")
                self._where[name] = files[shard]
        elif single.is_file():
            file = _SafetensorsFile(single)
            self._where = dict.fromkeys(file.header, file)
        else:
            found = sorted(p.name for p in self.path.iterdir())
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {self.path} "
                f"(it holds {found})"
            )
        self.dtypes = {name: f.header[name]["dtype"] for name, f in self._where.items()}

    def __repr__(self) -> str:
        return f"HFCheckpoint({str(self.path)!r}, {len(self._where)} tensors)"

    def keys(self) -> list[str]:
        """Tensor names in file order (shards in the index's order)."""
        return list(self._where)

    def tensor(self, name: str) -> np.ndarray:
        """One tensor as a new array: float32 for floating dtypes, else as stored.

        Raises:
            KeyError: no such tensor.
            SafetensorsError: its bytes do not match its dtype and shape.
        """
        if name not in self._where:
            raise KeyError(f"{name!r} is not a tensor of {self.path}")
        return self._where[name].tensor(name)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every tensor by PyTorch name (see :meth:`tensor`)."""
        return {name: self.tensor(name) for name in self._where}

    def tokenizer(self) -> Tokenizer:
        """The folder's ``tokenizer.json`` (+ ``tokenizer_config.json``) as a Tokenizer.

        Raises:
            FileNotFoundError: the folder has no ``tokenizer.json``.
        """
        from meganeura.io.tokenizer import Tokenizer

        return Tokenizer.from_file(self.path)


def load_hf(folder: str | os.PathLike[str]) -> HFCheckpoint:
    """Open a Hugging Face model folder (``config.json`` + safetensors, one file or shards).

    Raises:
        FileNotFoundError: no config.json, no weights, or a shard the index names is absent.
        SafetensorsError: a malformed file, or an index naming a tensor its shard lacks.
    """
    return HFCheckpoint(folder)
