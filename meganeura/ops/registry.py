"""OpDef: everything that defines an op's meaning, in one record.

An OpDef bundles the type rule, the NumPy reference (the oracle the interpreter and tests
use) and the gradient rule written with the builder, or an explicit not-differentiable mark.
Kernels live elsewhere (``meganeura.codegen.wgsl``): kernels change for speed, ops for
meaning. ``OPS`` is assembled explicitly from each family module's ``DEFS`` list; nothing is
registered by import side effect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..graph.ir import Node, TensorType

if TYPE_CHECKING:
    from ..graph.builder import Tensor


class ShapeError(TypeError):
    """Raised by a type rule; the builder adds the op, operands and source line."""


TypeRule = Callable[[Sequence[TensorType], dict], TensorType]
Reference = Callable[[Sequence[np.ndarray], dict], np.ndarray]
# grad(node, inputs, output, output_grad) -> one gradient (or None) per input. ``inputs`` and
# ``output`` are tensors in the gradient graph; unbroadcasting happens centrally in autodiff.
GradRule = Callable[["Node", Sequence["Tensor"], "Tensor", "Tensor"], Sequence["Tensor | None"]]


@dataclass(frozen=True)
class OpDef:
    """Definition of one op.

    Attributes:
        name: the op's name, as PyTorch spells it where PyTorch has it.
        infer: type rule; raises ShapeError with a message on invalid operands.
        reference: NumPy implementation; for effect ops it returns the updated values of the
            written inputs as a tuple, in ``writes`` order.
        grad: gradient rule, or None.
        differentiable: False marks ops that have no gradient on purpose (comparisons,
            argmax, optimizer updates); an op with grad None and differentiable True is an
            error that the completeness test catches.
        writes: input positions this op updates in place (optimizer updates).
        arity: number of inputs, or None when variable.
    """

    name: str
    infer: TypeRule
    reference: Reference
    grad: GradRule | None = None
    differentiable: bool = True
    writes: tuple[int, ...] = ()
    arity: int | None = None


def float_unary(types: Sequence[TensorType], attrs: dict) -> TensorType:
    """Type rule of one-operand floating ops: the result is typed like the operand."""
    (t,) = types
    if not t.dtype.is_floating:
        raise ShapeError(f"expects a floating-point operand, got {t.dtype}")
    return t


def collect(*families: Sequence[OpDef]) -> dict[str, OpDef]:
    """Build the op table from family lists, rejecting duplicate names."""
    table: dict[str, OpDef] = {}
    for fam in families:
        for d in fam:
            if d.name in table:
                raise ValueError(f"op {d.name!r} defined twice")
            table[d.name] = d
    return table
