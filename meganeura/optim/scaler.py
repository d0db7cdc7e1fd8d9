"""Dynamic loss scaling on the GPU, with ``torch.amp.GradScaler``'s policy.

``CompileOptions(loss_scale=GradScaler(...))`` compiles a training step whose backward starts
from the current scale ``S`` instead of 1 (so the fast mode's f16 activation gradients stay in
f16's range, Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2) and
whose update multiplies the gradients by ``1 / S``. After the update the step adjusts ``S``
as ``GradScaler.update`` does (PyTorch 2.x, ``torch/amp/grad_scaler.py``,
``_amp_update_scale_``):

  * a step whose gradients (or loss) hold inf or NaN is skipped (parameters and optimizer
    state keep their bits), ``S *= backoff_factor`` and the count of clean steps restarts;
  * otherwise the count goes up by one, and when it reaches ``growth_interval``,
    ``S *= growth_factor`` and it restarts.

Everything stays on the GPU: no host round trip per step. The program gains the states
``_scaler.scale`` (``S`` once the first step has run), ``_scaler.ready`` (0 before it: the
scale is then ``init_scale``; states start at zero), ``_scaler.growth`` (clean steps since
the last change) and ``_scaler.skipped`` (steps the scaler skipped since the host last read,
restarting with the guard's ``guard.reset``), and the outputs ``loss_scale``, the scale after
this step's update, and ``loss_scale.skipped``, that count. The non-finite guard
(``optim.guard``) counts only a non-finite loss: an overflow of the scaled gradients is a
skip the scaler expects, as GradScaler's ``found_inf`` is; the trainers read the scaler's
count with the guard's and take those steps off ``step_count`` without a warning, as a
skipped ``optimizer.step`` leaves PyTorch's step count (Adam's bias correction, schedules).

Every factor is a power of two, so scaling and unscaling are exact: in strict f32 a step whose
scaled gradients stay finite gives the bits of an unscaled step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..graph.builder import GraphBuilder, Tensor
from ..graph.ir import Graph
from ..ops import functional as F
from .guard import GUARD_RESET_INPUT

SCALE_STATE = "_scaler.scale"
READY_STATE = "_scaler.ready"
GROWTH_STATE = "_scaler.growth"
SKIPPED_STATE = "_scaler.skipped"
SCALE_OUTPUT = "loss_scale"
SKIPPED_OUTPUT = "loss_scale.skipped"
SCALER_STATES = (SCALE_STATE, READY_STATE, GROWTH_STATE, SKIPPED_STATE)


# f32's normal range: a scale or factor outside it is 0 or inf on the GPU
LOWEST, HIGHEST = 2.0**-126, 2.0**127
# the clean-step count is an f32 state: exact up to 2**24
MAX_GROWTH_INTERVAL = 2**24


def is_power_of_two(x) -> bool:
    """Whether ``x`` (a Python or NumPy float or int, not a bool) equals ``2**k`` with
    ``2**-126 <= 2**k <= 2**127`` (a normal f32)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return False
    x = float(x)
    return LOWEST <= x <= HIGHEST and math.frexp(x)[0] == 0.5


@dataclass(frozen=True)
class GradScaler:
    """The dynamic loss scale's policy, named and defaulted as ``torch.amp.GradScaler``'s.

    Args:
        init_scale: the scale of the first step.
        growth_factor: what the scale is multiplied by after ``growth_interval`` clean steps
            in a row.
        backoff_factor: what it is multiplied by after a step with inf or NaN gradients.
        growth_interval: clean steps between two growths.

    Raises:
        ValueError: a factor or scale that is not a power of two between 2**-126 and 2**127
            (``growth_factor`` > 1, ``backoff_factor`` < 1; powers of two keep scaling
            exact, f32 holds them), or a ``growth_interval`` that is not an integer from 1
            to 2**24 (the count is kept in f32).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        checks = (
            ("init_scale", self.init_scale, True),
            ("growth_factor", self.growth_factor, self.growth_factor > 1),
            ("backoff_factor", self.backoff_factor, self.backoff_factor < 1),
        )
        for name, value, ok in checks:
            if not is_power_of_two(value) or not ok:
                bound = {"growth_factor": " above 1", "backoff_factor": " below 1"}.get(name, "")
                raise ValueError(
                    f"GradScaler {name} must be a power of two{bound}, from 2**-126 to "
                    f"2**127, got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        n = self.growth_interval
        if (
            isinstance(n, (bool, np.bool_))
            or not isinstance(n, (int, np.integer))
            or not 1 <= n <= MAX_GROWTH_INTERVAL
        ):
            raise ValueError(
                f"GradScaler growth_interval must be an integer from 1 to 2**24, got {n!r}"
            )
        object.__setattr__(self, "growth_interval", int(n))


def current_scale(b: GraphBuilder, scaler: GradScaler) -> Tensor:
    """The scale of this step (f32[]): ``init_scale`` before the first update, else the
    state. Declares the scaler's states in ``b``."""
    scale = b.state(SCALE_STATE, ())
    ready = b.state(READY_STATE, ())
    b.state(GROWTH_STATE, ())
    b.state(SKIPPED_STATE, ())
    return F.where(F.greater(ready, 0.5), scale, float(scaler.init_scale))


def append_scale_update(
    b: GraphBuilder, graph: Graph, scaler: GradScaler, scale: Tensor, coefficient: Tensor
) -> None:
    """Append the scale's update after the optimizer's (module docstring).

    Args:
        b: the training graph's builder, after the update ops.
        graph: the graph ``b`` extends, holding the scaler's states (``current_scale``).
        scaler: the policy.
        scale: this step's scale (``current_scale``).
        coefficient: the coefficient the update ops were given: non-finite when the step was
            skipped.
    """
    state = {n: b.tensor(graph.find(n, "state").id) for n in SCALER_STATES}
    reset = next(n for n in b.nodes if n.op == "input" and n.name == GUARD_RESET_INPUT)
    skipped = F.minimum(b.add("found_inf", [coefficient]), 1.0)  # 1 or 0
    clean = (state[GROWTH_STATE] + 1.0) * (1.0 - skipped)
    grow = F.where(F.greater_equal(clean, float(scaler.growth_interval)), 1.0, 0.0)
    # as GradScaler: a growth that would overflow f32 is not applied (the count restarts)
    finite = 1.0 - F.minimum(b.add("found_inf", [scale * float(scaler.growth_factor)]), 1.0)
    factor = F.where(
        F.greater(skipped, 0.5),
        float(scaler.backoff_factor),
        F.where(F.greater(grow * finite, 0.5), float(scaler.growth_factor), 1.0),
    )
    new = scale * factor
    one = b.constant(1.0)
    b.add("accumulate", [state[SCALE_STATE], new, one])  # accumulate with first = 1 assigns
    b.add("accumulate", [state[GROWTH_STATE], clean * (1.0 - grow), one])
    b.add("accumulate", [state[READY_STATE], one, one])
    # steps skipped for the gradients alone since the host last read (``guard.reset``); the
    # guard counts those whose loss was non-finite (its counted coefficient: guard_count's)
    counted = next(n for n in b.nodes if n.op == "guard_count").inputs[1]
    mine = skipped * (1.0 - F.minimum(b.add("found_inf", [b.tensor(counted)]), 1.0))
    count = F.where(F.greater(b.tensor(reset.id), 0.5), 0.0, state[SKIPPED_STATE]) + mine
    b.add("accumulate", [state[SKIPPED_STATE], count, one])
    b.output(SCALE_OUTPUT, new)
    b.output(SKIPPED_OUTPUT, state[SKIPPED_STATE])
