"""Learning-rate schedules against torch.optim.lr_scheduler in float64 (no GPU)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from meganeura.optim.schedules import (
    ConstantLR,
    CosineLR,
    LinearWarmup,
    get_schedule,
)

STEPS = 50


def _torch_lrs(lr: float, make_scheduler, steps: int = STEPS) -> list[float]:
    """The lr of optimizer steps 0..steps-1 from a torch scheduler (Python floats = float64)."""
    param = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=lr)
    scheduler = make_scheduler(optimizer)
    lrs = []
    with warnings.catch_warnings():
        # torch warns when scheduler.step() precedes optimizer.step(); order is irrelevant here.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup_steps", [1, 7, 50, 80])
def test_linear_warmup_matches_torch_lambda_lr(warmup_steps):
    lr = 0.3
    schedule = LinearWarmup(lr=lr, warmup_steps=warmup_steps)
    expected = _torch_lrs(
        lr,
        lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup_steps)
        ),
    )
    ours = [schedule(s) for s in range(STEPS)]
    assert ours == pytest.approx(expected, rel=1e-14, abs=0)
    assert ours[0] == pytest.approx(lr / warmup_steps)
    if warmup_steps <= STEPS:
        assert ours[warmup_steps - 1] == lr and ours[-1] == lr


@pytest.mark.parametrize("min_lr", [0.0, 0.001])
def test_cosine_matches_torch_cosine_annealing(min_lr):
    lr = 0.1
    schedule = CosineLR(lr=lr, total_steps=STEPS, min_lr=min_lr)
    expected = _torch_lrs(
        lr,
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=min_lr),
    )
    ours = [schedule(s) for s in range(STEPS)]
    # torch updates the lr recursively, so rounding accumulates a little over 50 steps.
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert ours[0] == lr
    assert ours[STEPS // 2] == pytest.approx((lr + min_lr) / 2, rel=1e-15)
    assert all(a > b for a, b in zip(ours, ours[1:], strict=False))


def test_cosine_with_warmup_matches_torch_sequential_lr():
    lr, warmup, total, min_lr = 0.05, 10, STEPS, 0.002

    def make(opt):
        # LinearLR's factor start + (1 - start) * s / (W - 1) with start = 1/W is (s + 1) / W.
        warm = torch.optim.lr_scheduler.LinearLR(
            opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1
        )
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=total - warmup, eta_min=min_lr
        )
        return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[warmup])

    expected = _torch_lrs(lr, make)
    schedule = CosineLR(lr=lr, total_steps=total, warmup_steps=warmup, min_lr=min_lr)
    ours = [schedule(s) for s in range(total)]
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert ours[warmup] == lr and max(ours) == lr


def test_cosine_closed_form_and_tail():
    schedule = CosineLR(lr=1.0, total_steps=12, warmup_steps=4, min_lr=0.2)
    assert schedule(0) == 0.25 and schedule(3) == 1.0
    # t = 2 of T = 8: 0.2 + 0.8 * (1 + cos(pi / 4)) / 2
    assert schedule(6) == pytest.approx(0.2 + 0.4 * (1 + math.sqrt(0.5)), rel=1e-15)
    # After total_steps the lr holds min_lr instead of following the cosine back up as torch does.
    assert schedule(12) == schedule(1000) == 0.2
    assert schedule(11) > 0.2


def test_constant():
    schedule = ConstantLR(0.01)
    assert [schedule(s) for s in (0, 1, 10**9)] == [0.01, 0.01, 0.01]


def test_get_schedule_by_name():
    assert get_schedule("constant", lr=0.5) == ConstantLR(0.5)
    assert get_schedule("warmup", lr=0.5, warmup_steps=3)(0) == pytest.approx(0.5 / 3)
    cosine = get_schedule("cosine", lr=0.5, total_steps=10, warmup_steps=2)
    assert cosine == CosineLR(0.5, 10, 2)
    with pytest.raises(ValueError, match="'linear'.*'constant', 'cosine', 'warmup'"):
        get_schedule("linear", lr=0.1)
    with pytest.raises(TypeError, match="'constant'.*total_steps"):
        get_schedule("constant", lr=0.1, total_steps=10)


@pytest.mark.parametrize(
    "build, message",
    [
        pytest.param(lambda: ConstantLR(-1.0), "lr must be finite", id="constant-negative_lr"),
        pytest.param(lambda: ConstantLR(float("nan")), "lr must be finite", id="constant-nan_lr"),
        pytest.param(
            lambda: LinearWarmup(0.1, 0), "warmup_steps must be >= 1", id="warmup-zero_steps"
        ),
        pytest.param(
            lambda: CosineLR(0.1, total_steps=5, warmup_steps=5),
            "must exceed warmup_steps",
            id="cosine-warmup_not_below_total",
        ),
        pytest.param(
            lambda: CosineLR(0.1, total_steps=5, min_lr=0.2),
            "must not exceed lr",
            id="cosine-min_lr_above_lr",
        ),
        pytest.param(
            lambda: CosineLR(0.1, total_steps=5, warmup_steps=-1),
            "warmup_steps must be >= 0",
            id="cosine-negative_warmup",
        ),
    ],
)
def test_invalid_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_negative_step_and_frozen():
    schedule = CosineLR(0.1, 10)
    with pytest.raises(ValueError, match="from 0"):
        schedule(-1)
    with pytest.raises(AttributeError):
        schedule.lr = 1.0  # type: ignore[misc]
