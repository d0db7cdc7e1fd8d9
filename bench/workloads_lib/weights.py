"""Deterministic weights and inputs shared by meganeura and PyTorch (``docs/workloads.md``,
Protocol).

Element j of a tensor named ``name`` is ``scale * sin(0.01 j + seed(name) + (sqrt(2) j^2 mod
2 pi))``, evaluated in float64 and rounded to float32 once, so both sides load the same bits.
The quadratic phase is our addition to workloads.md's ``sin(0.01 j + seed)``: with a linear
phase alone every weight matrix reshaped to [out, in] has rank 2 (``sin(a r + b c + s)`` is a
sum of two outer products), so activations and gradients would live in two dimensions and a
gate could pass a kernel that mixes rows up. With the quadratic term a 64 x 64 matrix has full
rank (condition number ~56) and unit-variance statistics (std 0.707 before ``scale``).

``seed(name)`` = crc32(name) / 2^32 * 2 pi. Scales per kind of tensor keep activations of the
deep models (30-layer Llama, ResNet-50) in range:

  * weights with 2+ dims (Linear [out, in], conv [out, in, k...], embedding [vocab, d]):
    ``sqrt(2 / fan_in)`` (fan_in = product of all dims but the first), so the elements have
    std ``1 / sqrt(fan_in)``;
  * 1-d ``*.weight`` (RMSNorm, LayerNorm, GroupNorm, BatchNorm scales): ``1 + 0.1 sin``;
  * ``*.bias``: ``0.02 sin``;
  * BatchNorm ``running_mean``: ``0.1 sin``; ``running_var``: ``1 + 0.2 sin`` (>= 0.8).

Tensors the caller marks as fixed (Whisper's sinusoidal ``embed_positions``) and integer
buffers (``num_batches_tracked``) keep their values.
"""

from __future__ import annotations

import zlib

import numpy as np

_CHUNK = 1 << 22


def seed(name: str) -> float:
    """Phase offset of tensor ``name``: crc32(name) mapped to [0, 2 pi)."""
    return zlib.crc32(name.encode()) / 2**32 * 2 * np.pi


def sin_tensor(shape, name: str, scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
    """f32 array of ``shape``: ``offset + scale * sin(0.01 j + seed(name) + (sqrt2 j^2 mod 2pi))``.

    Computed in float64 in chunks of 4 Mi elements (j^2 is exact below 2^53, so j < 9.4e7).
    """
    n = int(np.prod(shape, dtype=np.int64))
    if n >= 94_000_000:
        raise ValueError(f"sin_tensor {name!r}: {n} elements exceed the exact-j^2 range")
    out = np.empty(n, np.float32)
    s = seed(name)
    for a in range(0, n, _CHUNK):
        j = np.arange(a, min(n, a + _CHUNK), dtype=np.float64)
        phase = 0.01 * j + s + np.mod(np.sqrt(2.0) * j * j, 2 * np.pi)
        out[a : a + len(j)] = offset + scale * np.sin(phase)
    return out.reshape(shape)


def param_value(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The deterministic value of parameter or buffer ``name`` of ``shape`` (rules above)."""
    shape = tuple(int(d) for d in shape)
    if name.endswith("running_mean"):
        return sin_tensor(shape, name, 0.1)
    if name.endswith("running_var"):
        return sin_tensor(shape, name, 0.2, 1.0)
    if name.endswith("bias"):
        return sin_tensor(shape, name, 0.02)
    if len(shape) >= 2:
        fan_in = int(np.prod(shape[1:]))
        return sin_tensor(shape, name, float(np.sqrt(2.0 / fan_in)))
    return sin_tensor(shape, name, 0.1, 1.0)


def deterministic_state(reference: dict[str, np.ndarray], fixed=()) -> dict[str, np.ndarray]:
    """A state dict of the same names, shapes and dtypes as ``reference`` with every floating
    tensor replaced by :func:`param_value` (names in ``fixed`` and integer tensors copied)."""
    out = {}
    for name, v in reference.items():
        v = np.asarray(v)
        if name in fixed or v.dtype.kind not in "f":
            out[name] = v.copy()
        else:
            out[name] = param_value(name, v.shape).astype(v.dtype)
    return out


def sin_input(shape, k: float, scale: float = 1.0) -> np.ndarray:
    """A float input f32 of ``shape``: ``scale * sin(k i + (sqrt2 i^2 mod 2pi))`` (workloads.md's
    ``sin(k i)`` with the quadratic phase of the weights, for the same reason)."""
    return sin_tensor(shape, f"input:{k}", scale)


def token_ids(shape, vocab: int, salt: int = 0) -> np.ndarray:
    """i32 token ids ``(7919 i + 13 + salt) % vocab`` (deterministic, spread over the vocab)."""
    n = int(np.prod(shape))
    return (
        ((np.arange(n, dtype=np.int64) * 7919 + 13 + salt) % vocab).astype(np.int32).reshape(shape)
    )
