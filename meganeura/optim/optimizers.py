"""Optimizers: each appends its update ops to the training graph, so the update runs on the
GPU in the same submission as forward and backward.

An optimizer describes (a) which state tensors it keeps per parameter, (b) how it appends
one update op per parameter, and (c) the per-step host vector ``hyper`` (learning rate and
bias corrections), computed in float64 on the host from the step number and fed each step,
so the learning rate can change every step without recompiling. Formulas: ops/update.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from ..graph.builder import GraphBuilder, Tensor


@dataclass(frozen=True)
class Optimizer:
    """Base class. ``lr`` is the base learning rate (a schedule may override it per step)."""

    lr: float = 1e-3

    op: ClassVar[str] = ""
    hyper_size: ClassVar[int] = 0
    state_suffixes: ClassVar[tuple[str, ...]] = ()

    def attrs(self) -> dict:
        raise NotImplementedError

    def hyper(self, step: int, lr: float) -> np.ndarray:
        """The f32 hyper vector for optimizer step ``step`` (0-based) at learning rate ``lr``."""
        raise NotImplementedError

    def append_update(
        self, b: GraphBuilder, param: Tensor, grad: Tensor, hyper: Tensor, clip: Tensor
    ) -> Tensor:
        state = [
            b.state(f"{param.node.name}.{s}", param.shape, param.dtype) for s in self.state_suffixes
        ]
        return b.add(self.op, [param, grad, hyper, clip, *state], self.attrs())

    def config(self) -> dict:
        """JSON-serializable description (stored in checkpoints)."""
        return {
            "type": type(self).__name__,
            **{f.name: getattr(self, f.name) for f in fields(self)},
        }


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, Nesterov momentum and
    L2 weight decay, as torch.optim.SGD."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"invalid SGD settings: {self}")

    hyper_size: ClassVar[int] = 2

    @property
    def op(self) -> str:  # type: ignore[override]
        return "sgd_momentum_update" if self.momentum else "sgd_update"

    @property
    def state_suffixes(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum else ()

    def attrs(self) -> dict:
        return {
            "momentum": float(self.momentum),
            "dampening": float(self.dampening),
            "weight_decay": float(self.weight_decay),
            "nesterov": bool(self.nesterov),
            "maximize": bool(self.maximize),
        }

    def hyper(self, step: int, lr: float) -> np.ndarray:
        return np.array([lr, 1.0 if step == 0 else 0.0], np.float32)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction; ``weight_decay`` is L2 added to the
    gradient, as torch.optim.Adam."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False

    decoupled: ClassVar[bool] = False

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if (
            not (0 <= b1 < 1 and 0 <= b2 < 1)
            or self.eps < 0
            or self.lr < 0
            or self.weight_decay < 0
        ):
            raise ValueError(f"invalid {type(self).__name__} settings: {self}")
        object.__setattr__(self, "betas", (float(b1), float(b2)))

    op: ClassVar[str] = "adam_update"
    hyper_size: ClassVar[int] = 3
    state_suffixes: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    def attrs(self) -> dict:
        return {
            "beta1": self.betas[0],
            "beta2": self.betas[1],
            "eps": float(self.eps),
            "weight_decay": float(self.weight_decay),
            "decoupled": self.decoupled,
            "maximize": bool(self.maximize),
        }

    def hyper(self, step: int, lr: float) -> np.ndarray:
        t = step + 1
        bc1 = 1 - self.betas[0] ** t
        bc2 = 1 - self.betas[1] ** t
        return np.array([lr, lr / bc1, math.sqrt(bc2)], np.float32)


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019), as torch.optim.AdamW:
    the parameter is first scaled by ``1 - lr * weight_decay``."""

    weight_decay: float = 1e-2
    decoupled: ClassVar[bool] = True
