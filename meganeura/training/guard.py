"""The host side of the non-finite guard (``optim.guard`` builds the GPU side).

Every training step checks its loss and its gradients' global sum of squares on the GPU and,
when either is inf or NaN, skips the update there (PyTorch's GradScaler ``found_inf``). The
GPU counts skipped steps; the trainers read the count in the same read as the loss, or, with
``return_loss=False``, at the next read of anything (a loss, ``evaluate``, ``save``,
``state_dict``, ``parameters``), and then:

  * ``on_nonfinite="raise"`` (the default): raise :class:`NonFiniteError`. The guard is
    sticky on the GPU: once a step trips, the later unread steps are skipped too, so
    parameters, optimizer state, BatchNorm's running statistics (``optim.guard.
    defer_update_stats``) and ``num_batches_tracked``, the step counter and the global RNG are
    as they were before the first bad step;
  * ``on_nonfinite="skip"``: warn (:class:`NonFiniteWarning`), add the steps to
    ``skipped_steps`` and continue. Skipped steps do not advance ``step_count``, which drives
    the learning-rate schedule and Adam's bias correction (Hugging Face's Trainer steps neither
    its scheduler nor the optimizer on a step GradScaler skipped).

:class:`StepGuard` holds the steps run since the last read (their step numbers, RNG states and
the (Program, feeds) of their runs, for the locator of issue 11 item 5).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..optim.guard import GUARD_MODES, GUARD_OUTPUT, GUARD_RESET_INPUT
from ..optim.scaler import SKIPPED_OUTPUT

# Steps whose (program, feeds) an unread record keeps; older unread records keep their
# step number only, so a long return_loss=False loop does not hold every batch alive.
KEEP_RUNS = 16
# A raised NonFiniteError names the first non-finite value itself (``NonFiniteError.locate``)
# when the step's programs hold at most this many bytes: the diagnostic program stores every
# intermediate apart and reads each back. Larger steps leave the call to the user.
AUTO_LOCATE_BYTES = 256 << 20


class StepRun(NamedTuple):
    """One program run of a guarded step, as the locator replays it.

    Attributes:
        program: the compiled Program that ran.
        feeds: its feeds by name (the optimizer's hyper vector and the guard's flag included).
        session: the Session it ran in (in ``"raise"`` mode its parameters and optimizer
            state are still those the step read).
        graph: the forward graph the program was compiled from (a module's traced graph).
        options: the CompileOptions it was compiled with.
    """

    program: Any
    feeds: Mapping[str, np.ndarray]
    session: Any
    graph: Any = None
    options: Any = None


class NonFiniteError(FloatingPointError):
    """A training step met an inf or NaN loss or gradient; its update was skipped on the GPU.

    Attributes:
        step: the first skipped step's number (``step_count`` when it ran, 0-based).
        steps: every skipped step's number (the later ones were skipped because the guard is
            sticky until the host reads it).
        loss: the loss read with the flag (a float; the last step's), or None.
        cause: ``"loss"``, ``"gradients"`` (the loss was finite), or None when unknown.
        gradients: names of the parameters whose gradient has an inf or NaN, when the step
            returned its gradients (``return_grads=True``), else None.
        runs: the first skipped step's :class:`StepRun` s (program, feeds, session, graph,
            options), one per program run in order (the micro-batches with accumulation), or
            None when no longer kept (older than the last ``KEEP_RUNS`` unread steps): what
            :meth:`locate` replays.
        nonfinite: the first non-finite value of the step (``meganeura.debug.NonFinite``),
            found when the error was raised if the step's programs hold at most
            ``AUTO_LOCATE_BYTES`` (256 MiB), else None until :meth:`locate` is called.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        steps: tuple[int, ...],
        loss: float | None = None,
        cause: str | None = None,
        gradients: tuple[str, ...] | None = None,
        runs: tuple | None = None,
    ) -> None:
        super().__init__(message)
        self.step, self.steps, self.loss, self.cause = step, steps, loss, cause
        self.gradients, self.runs = gradients, runs
        self.nonfinite = None

    def locate(self):
        """Replay the first skipped step unfused and name its first value (in program order)
        that holds an inf or a NaN (``meganeura.debug.find_nonfinite``, run on each of the
        step's program runs in turn with the parameters and optimizer state the step read).

        Returns:
            A ``meganeura.debug.NonFinite`` (also stored as ``self.nonfinite``), or None when
            the runs are no longer kept or the replay finds every value finite.
        """
        from ..debug import find_nonfinite

        for run in self.runs or ():
            if run.graph is None:
                continue
            found = find_nonfinite(
                run.graph,
                run.feeds,
                run.options,
                parameters=run.session.state_dict(),
                device=run.session.device,
            )
            if found is not None:
                self.nonfinite = found
                return found
        return None


class NonFiniteWarning(UserWarning):
    """``on_nonfinite="skip"``: a step's update was skipped for an inf or NaN."""


def check_mode(on_nonfinite: str) -> str:
    if on_nonfinite not in GUARD_MODES:
        raise ValueError(f"on_nonfinite must be one of {GUARD_MODES}, got {on_nonfinite!r}")
    return on_nonfinite


def check_finite_feeds(feeds: Mapping[str, Any], step: int, owner: str) -> None:
    """Raise NonFiniteError naming the first floating feed holding inf or NaN (the
    ``check_finite`` option: one pass over the batch on the host, before anything runs)."""
    for name, a in feeds.items():
        a = np.asarray(a)
        if a.dtype.kind != "f" or name == GUARD_RESET_INPUT:
            continue
        bad = ~np.isfinite(a)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise NonFiniteError(
                f"{owner} step {step}: input {name!r} ({a.dtype}{list(a.shape)}) holds "
                f"{int(bad.sum())} non-finite value(s), the first {a[where]} at index "
                f"{list(where)} (check_finite=True); nothing was run or changed",
                step=step,
                steps=(step,),
                cause="input",
            )


@dataclass
class _Record:
    step: int
    rng: Any  # global RNG state before the step (None: not tracked)
    runs: tuple | None
    host: dict | None = None  # host-only counters before the step ran (None: not tracked)


# Reads and writes the host-only state a step's forwards change (BatchNorm's
# ``num_batches_tracked``), so a skipped step can be taken off it as the GPU took it off the
# running statistics.
HostState = tuple[Callable[[], dict], Callable[[dict], None]]


class StepGuard:
    """Steps run since the last read of the GPU's skipped-step count, and what to do with it.

    Args:
        mode: ``"raise"`` or ``"skip"``.
        owner: how messages name the trainer (``"Trainer"``, ``"GraphTrainer"``).
        host_state: (read, write) of the host-only counters a step's forwards advance (the
            Trainer's BatchNorm ``num_batches_tracked``), or None. A skipped step's advance is
            taken back when the count is read (``settle``), as the GPU skipped its
            running-statistics updates.
    """

    def __init__(self, mode: str, owner: str, host_state: HostState | None = None) -> None:
        self.mode = check_mode(mode)
        self.owner = owner
        self._host = host_state
        self.skipped_steps = 0
        self._pending: list[_Record] = []

    @property
    def pending(self) -> bool:
        """Whether steps ran since the count was last read."""
        return bool(self._pending)

    def reset_feed(self) -> np.ndarray:
        """The ``guard.reset`` feed of the next step: 1 when the count was read since."""
        return np.asarray(0.0 if self._pending else 1.0, np.float32)

    def ran(self, step: int, rng=None, runs: tuple | None = None, host: dict | None = None) -> None:
        """Record a step submitted to the GPU; ``host``: the host-only counters before its
        first run (``host_state``'s read), taken back to if the step was skipped."""
        self._pending.append(_Record(step, rng, runs, host))
        if len(self._pending) > KEEP_RUNS:
            self._pending[-KEEP_RUNS - 1].runs = None

    def forget(self) -> None:
        """Drop the unread steps (a checkpoint was loaded: the count restarts)."""
        self._pending.clear()

    def settle(
        self,
        out: Mapping[str, np.ndarray],
        loss: float | None = None,
        grads: Mapping[str, np.ndarray] | None = None,
        rewind: Callable[[int, Any], None] | None = None,
        restore_rng: Callable[[Any], None] | None = None,
    ) -> int:
        """Act on a read count (``out[GUARD_OUTPUT]``); returns how many of the unread steps
        were skipped (the caller takes them off its step counter).

        Raises:
            NonFiniteError: in ``"raise"`` mode when a step was skipped, after calling
                ``rewind(first skipped step, its RNG state)`` (the caller restores its step
                counter and the RNG).

        In ``"skip"`` mode, when every unread step was skipped (always so with a read every
        step), ``restore_rng(the first one's RNG state)`` puts the global RNG back as before
        it, so the next step draws the dropout seed a run that never saw the bad batch would
        draw. When only some unread steps were skipped the GPU does not say which, and the RNG
        is left as it is.

        Warns:
            NonFiniteWarning: in ``"skip"`` mode when a step was skipped.
        """
        records, self._pending = self._pending, []
        n = int(np.asarray(out[GUARD_OUTPUT]).reshape(()))
        # steps a dynamic loss scale skipped for overflowing gradients (optim.scaler): taken
        # off the counters like skipped ones, without a warning or an error
        raw = out.get(SKIPPED_OUTPUT)
        silent = 0 if raw is None else int(np.asarray(raw).reshape(()))
        if n + silent == 0 or not records:
            return 0
        if n == 0 or self.mode == "skip":
            total = min(n + silent, len(records))
            self._take_back(records, total)
            if n == 0:  # the RNG stays advanced, as a forward PyTorch ran advanced it
                return total
        n = min(n, len(records))
        if self.mode == "skip":
            self.skipped_steps += n
            if n == len(records) and restore_rng is not None and records[0].rng is not None:
                restore_rng(records[0].rng)
            span = _span(records)
            what = f"step {span}" if len(records) == 1 else f"{n} of the steps {span}"
            warnings.warn(
                f"{self.owner}: {what} had a non-finite loss or gradient; its update was "
                f"skipped (on_nonfinite='skip'; {self.skipped_steps} skipped in all)",
                NonFiniteWarning,
                stacklevel=4,  # the user's step() call
            )
            return total
        self._take_back(records, n)
        skipped = records[len(records) - n :]  # sticky: the tail from the first bad step
        first = skipped[0]
        cause = None
        if loss is not None and n == 1:
            cause = "gradients" if math.isfinite(loss) else "loss"
        bad_grads = None
        if grads is not None and n == 1:
            bad_grads = tuple(k for k, g in grads.items() if not np.isfinite(g).all())
        if cause == "loss":
            what = f"the loss is {loss}"
        elif cause == "gradients":
            named = f" ({', '.join(bad_grads)})" if bad_grads else ""
            what = (
                f"the loss is finite ({loss:.6g}) but the gradients{named} hold inf or NaN, "
                "or their sum of squares exceeds float32's range"
            )
        else:
            what = "its loss or gradients hold inf or NaN"
        later = (
            f"; steps {_span(skipped[1:])} ran after it without reading the loss and were "
            "skipped too (the guard stops updating at the first bad step)"
            if n > 1
            else ""
        )
        if rewind is not None:
            rewind(first.step, first.rng)
        error = NonFiniteError(
            f"{self.owner} step {first.step}: {what}. The update was skipped on the GPU"
            f"{later}: parameters, optimizer state, the step counter ({first.step}) and the "
            "RNG are as before that step, and so are BatchNorm's running statistics and "
            "num_batches_tracked. Find the bad values with check_finite=True (inputs) or "
            "lower the learning rate; on_nonfinite='skip' skips such steps with a warning "
            "instead",
            step=first.step,
            steps=tuple(r.step for r in skipped),
            loss=loss,
            cause=cause,
            gradients=bad_grads,
            runs=first.runs,
        )
        if first.runs and _footprint(first.runs) <= AUTO_LOCATE_BYTES:
            try:
                found = error.locate() or "a replay of the step found every value finite"
            except Exception as e:  # the replay must never hide the error it explains
                found = f"locating the first non-finite value failed: {e!r}"
            error.args = (f"{error.args[0]}.\n{found}",)
        elif first.runs:
            error.args = (f"{error.args[0]}; e.locate() names the first non-finite value",)
        raise error

    def _take_back(self, records: list[_Record], n: int) -> None:
        """Take the last ``n`` records' advances off the host-only counters.

        In ``"raise"`` mode the skipped steps are the tail (the guard is sticky), so this
        restores the counters as they were before the first skipped step. In
        ``"skip"`` mode the GPU reports only how many unread steps it skipped, not which:
        with a read every step (the default) that is exact; over unread steps it takes back
        the advances of the last ``n``, which is exact whenever every step advances a counter
        alike (the same BatchNorms run in every step's forward).
        """
        if self._host is None or any(r.host is None for r in records):
            return
        read, write = self._host
        snaps = [r.host for r in records] + [read()]
        now = snaps[-1]
        back = {
            k: sum(snaps[i + 1][k] - snaps[i][k] for i in range(len(records) - n, len(records)))
            for k in now
        }
        write({k: now[k] - back[k] for k in now})


def guard_outputs(outputs) -> tuple[str, ...]:
    """The counts a guarded step reads with its loss: the guard's, and a dynamic loss
    scale's (``optim.scaler``) where the program has one."""
    return (GUARD_OUTPUT,) + ((SKIPPED_OUTPUT,) if SKIPPED_OUTPUT in outputs else ())


def _footprint(runs) -> int:
    """Bytes of every value of the runs' programs, stored apart (the diagnostic's need)."""
    return sum(r.program.memory.naive_bytes + r.program.memory.pinned_bytes for r in runs)


def _span(records: list[_Record]) -> str:
    lo, hi = records[0].step, records[-1].step
    return str(lo) if lo == hi else f"{lo}-{hi}"
