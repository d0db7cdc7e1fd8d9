"""Reading CTranslate2 model folders (``model.bin`` + ``config.json`` + vocabulary/tokenizer), and
mapping CTranslate2's Whisper variables to Hugging Face's ``WhisperForConditionalGeneration``
state-dict names.

The ``model.bin`` layout (binary version 6, written by ``ctranslate2.specs.model_spec``
``_serialize``; all integers little-endian):

    u32 version                  (1..6 are read; 6 is current)
    string spec name             (``u16 length + 1``, the UTF-8 bytes, a NUL)
    u32 spec revision            (version >= 2)
    u32 n; n x variable:         string name, u8 rank, rank x u32 dims,
                                 u8 dtype id (version >= 4: 0 f32, 1 i8, 2 i16, 3 i32, 4 f16,
                                 5 bf16; before: the item size), u32 byte count (version >= 4;
                                 before: the element count), the raw bytes
    u32 m; m x alias:            string alias, string target name   (version >= 3)

Scalars (rank 0) are the spec's attributes (``decoder/num_heads``, ``decoder/activation``...).
Floating variables come out as float32 (f16 and bf16 widened exactly); the others as stored.

Whisper (``WhisperSpec``): ``encoder/conv{1,2}``, ``encoder/position_encodings/encodings``,
``{encoder,decoder}/layer_N/self_attention/linear_0`` is the fused QKV projection (rows q, k, v;
the k bias stored as zeros), ``linear_1`` its output; the decoder's cross-attention
``decoder/layer_N/attention``: ``linear_0`` q, ``linear_1`` the fused KV, ``linear_2`` out;
``ffn/linear_{0,1}`` fc1/fc2; ``*/layer_norm/{gamma,beta}``; ``decoder/embeddings/weight``,
``decoder/position_encodings/encodings``; ``decoder/projection/weight`` an alias of the
embedding (the tied head).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CT2Checkpoint", "CT2FormatError", "load_ctranslate2", "read_model_bin"]

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bf16"}
_ITEMSIZE_DTYPES = {4: np.float32, 1: np.int8, 2: np.int16}  # versions < 4
# CTranslate2's ActivationType (include/ctranslate2/ops/activation.h): 3 is exact GELU.
_GELU = 3


class CT2FormatError(ValueError):
    """A ``model.bin`` this reader cannot parse, or a spec it cannot map (says where and why)."""


class _Reader:
    def __init__(self, data: memoryview, path: str):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise CT2FormatError(
                f"{self.path}: truncated at byte {self.pos} (needs {n} more, file has "
                f"{len(self.data)})"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> int:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("H")
        raw = bytes(self.take(n))
        if not n or raw[-1] != 0:
            raise CT2FormatError(f"{self.path}: string at byte {self.pos - n} is not NUL-ended")
        return raw[:-1].decode("utf-8")


def read_model_bin(path: str | os.PathLike[str]) -> tuple[str, int, dict[str, np.ndarray]]:
    """Parse a CTranslate2 ``model.bin``.

    Returns:
        (spec name, spec revision, variables): name -> array (floats as float32; aliases
        resolved to the same array).

    Raises:
        CT2FormatError: an unknown version or dtype, sizes that disagree, or truncation.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = memoryview(f.read())
    r = _Reader(data, path)
    version = r.unpack("I")
    if not 1 <= version <= 6:
        raise CT2FormatError(f"{path}: binary version {version} is not supported (1..6)")
    spec = r.string() if version >= 2 else ""
    revision = r.unpack("I") if version >= 2 else 1
    variables: dict[str, np.ndarray] = {}
    for _ in range(r.unpack("I")):
        name = r.string()
        shape = tuple(r.unpack("I") for _ in range(r.unpack("B")))
        type_id = r.unpack("B")
        count = int(np.prod(shape, dtype=np.int64))
        if version >= 4:
            if type_id not in _DTYPES:
                raise CT2FormatError(f"{path}: variable {name!r} has unknown dtype id {type_id}")
            dtype = _DTYPES[type_id]
            nbytes = r.unpack("I")
        else:
            if type_id not in _ITEMSIZE_DTYPES:
                raise CT2FormatError(f"{path}: variable {name!r} has item size {type_id}")
            dtype = _ITEMSIZE_DTYPES[type_id]
            nbytes = r.unpack("I") * type_id
        itemsize = 2 if dtype == "bf16" else np.dtype(dtype).itemsize
        if nbytes != count * itemsize:
            raise CT2FormatError(
                f"{path}: variable {name!r} of shape {list(shape)} has {nbytes} bytes, "
                f"expected {count * itemsize}"
            )
        raw = r.take(nbytes)
        if dtype == "bf16":  # the high half of a float32: widening is a shift, exact
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, np.dtype(dtype).newbyteorder("<"))
            arr = arr.astype(np.float32 if arr.dtype.kind == "f" else arr.dtype.newbyteorder("="))
        variables[name] = arr.reshape(shape)
    if version >= 3:
        for _ in range(r.unpack("I")):
            alias, target = r.string(), r.string()
            if target not in variables:
                raise CT2FormatError(f"{path}: alias {alias!r} names unknown {target!r}")
            variables[alias] = variables[target]
    if r.pos != len(data):
        raise CT2FormatError(f"{path}: {len(data) - r.pos} bytes after the last alias")
    return spec, revision, variables


class CT2Checkpoint:
    """A CTranslate2 model folder; build it with :func:`load_ctranslate2`.

    Attributes:
        path: the folder.
        spec: the spec name (``"WhisperSpec"``...), revision: its revision.
        variables: name -> array, as :func:`read_model_bin` gives them.
        config: the folder's ``config.json`` (CTranslate2's: suppress ids, ...) or {}.
    """

    def __init__(self, folder: str | os.PathLike[str]):
        self.path = Path(folder)
        model = self.path / "model.bin"
        if not model.is_file():
            raise FileNotFoundError(f"no model.bin in {self.path} (a CTranslate2 model folder)")
        self.spec, self.revision, self.variables = read_model_bin(model)
        config = self.path / "config.json"
        self.config: dict[str, Any] = (
            json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        )

    def __repr__(self) -> str:
        return f"CT2Checkpoint({str(self.path)!r}, {self.spec}, {len(self.variables)} variables)"

    def whisper_config(self) -> dict:
        """An HF ``WhisperConfig`` dict read from the variables' shapes and attributes (plus
        the suppress lists of ``config.json``). Special ids are those of the tokenizer's
        ``<|endoftext|>`` / ``<|startoftranscript|>`` when the folder has ``tokenizer.json``.

        Raises:
            CT2FormatError: not a ``WhisperSpec``, or attributes other than Whisper's
                (pre-norm, exact GELU, no embedding scale, no ALiBi).
        """
        if self.spec != "WhisperSpec":
            raise CT2FormatError(f"{self.path}: spec {self.spec!r} is not WhisperSpec")
        v = self.variables
        expect = {
            "decoder/pre_norm": 1,
            "decoder/activation": _GELU,
            "decoder/scale_embeddings": 0,
            "decoder/alibi": 0,
        }
        for name, want in expect.items():
            if name in v and int(v[name]) != want:
                raise CT2FormatError(f"{self.path}: {name} is {int(v[name])}, Whisper has {want}")

        def layers(stack: str) -> int:
            return len({m.group(1) for k in v if (m := re.match(rf"{stack}/layer_(\d+)/", k))})

        vocab, d = v["decoder/embeddings/weight"].shape
        cfg = {
            "model_type": "whisper",
            "vocab_size": int(vocab),
            "d_model": int(d),
            "num_mel_bins": int(v["encoder/conv1/weight"].shape[1]),
            "encoder_layers": layers("encoder"),
            "decoder_layers": layers("decoder"),
            "encoder_attention_heads": int(v["encoder/num_heads"]),
            "decoder_attention_heads": int(v["decoder/num_heads"]),
            "encoder_ffn_dim": int(v["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
            "decoder_ffn_dim": int(v["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
            "max_source_positions": int(v["encoder/position_encodings/encodings"].shape[0]),
            "max_target_positions": int(v["decoder/position_encodings/encodings"].shape[0]),
            "suppress_tokens": list(self.config.get("suppress_ids", [])),
            "begin_suppress_tokens": list(self.config.get("suppress_ids_begin", [])),
        }
        tok = self.path / "tokenizer.json"
        if tok.is_file():
            added = json.loads(tok.read_text(encoding="utf-8")).get("added_tokens", [])
            ids = {a["content"]: a["id"] for a in added}
            eot, sot = ids.get("<|endoftext|>"), ids.get("<|startoftranscript|>")
            if eot is not None and sot is not None:
                cfg.update(
                    pad_token_id=eot, eos_token_id=eot, bos_token_id=sot, decoder_start_token_id=sot
                )
        return cfg

    def whisper_state_dict(self) -> dict[str, np.ndarray]:
        """The variables under HF ``WhisperForConditionalGeneration`` names (f32), the fused
        projections split (see the module docstring).

        Raises:
            CT2FormatError: a fused k bias that is not zero (HF's k_proj has none), or a
                variable of an unexpected shape.
        """
        v = self.variables
        out: dict[str, np.ndarray] = {}

        def linear(src: str, dst: str) -> None:
            out[f"{dst}.weight"] = v[f"{src}/weight"]
            if f"{src}/bias" in v:
                out[f"{dst}.bias"] = v[f"{src}/bias"]

        def norm(src: str, dst: str) -> None:
            out[f"{dst}.weight"], out[f"{dst}.bias"] = v[f"{src}/gamma"], v[f"{src}/beta"]

        def fused(src: str, dst: str, parts: tuple[str, ...]) -> None:
            w, b = v[f"{src}/weight"], v[f"{src}/bias"]
            n = len(parts)
            if w.shape[0] % n or b.shape != (w.shape[0],):
                raise CT2FormatError(
                    f"{src}: fused weight {list(w.shape)} / bias {list(b.shape)} do not split "
                    f"into {n} equal parts"
                )
            for part, wi, bi in zip(parts, np.split(w, n), np.split(b, n)):
                out[f"{dst}.{part}.weight"] = wi
                if part == "k_proj":
                    if np.any(bi):
                        raise CT2FormatError(
                            f"{src}: the k bias is not zero (max |b| {np.abs(bi).max():.3g}); "
                            "Whisper's k_proj has no bias"
                        )
                else:
                    out[f"{dst}.{part}.bias"] = bi

        linear("encoder/conv1", "model.encoder.conv1")
        linear("encoder/conv2", "model.encoder.conv2")
        out["model.encoder.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
        out["model.decoder.embed_tokens.weight"] = v["decoder/embeddings/weight"]
        out["model.decoder.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
        out["proj_out.weight"] = v.get("decoder/projection/weight", v["decoder/embeddings/weight"])
        for stack in ("encoder", "decoder"):
            norm(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
            i = 0
            while f"{stack}/layer_{i}/ffn/linear_0/weight" in v:
                src, dst = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
                fused(f"{src}/self_attention/linear_0", f"{dst}.self_attn", QKV)
                linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
                norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
                if stack == "decoder":
                    linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                    fused(f"{src}/attention/linear_1", f"{dst}.encoder_attn", QKV[1:])
                    linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
                    norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
                linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
                norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
                i += 1
        return out

    def tokenizer(self):
        """The folder's ``tokenizer.json`` as a ``meganeura.io.tokenizer.Tokenizer``.

        Raises:
            FileNotFoundError: the folder has no ``tokenizer.json``.
        """
        from meganeura.io.tokenizer import Tokenizer

        return Tokenizer.from_file(self.path)


QKV = ("q_proj", "k_proj", "v_proj")


def load_ctranslate2(folder: str | os.PathLike[str]) -> CT2Checkpoint:
    """Open a CTranslate2 model folder (``model.bin``, optional ``config.json``).

    Raises:
        FileNotFoundError: no ``model.bin``.
        CT2FormatError: a file this reader cannot parse.
    """
    return CT2Checkpoint(folder)
