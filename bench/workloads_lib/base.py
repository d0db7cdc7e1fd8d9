"""What a workload provides to the harness: its cases, both models with the same weights, the
batch of each case, and the loss on each side.

A :class:`Workload` builds meganeura's model (``ours_model``) and PyTorch's (``torch_model``,
on the CPU; the cell moves it), both loaded with :func:`weights.deterministic_state` by
state-dict name. Case kinds the cell runs generically:

  * ``fwd``: ``model(*batch)`` in eval mode, the whole output compared;
  * ``train``: ``Trainer.step`` (forward + backward + optimizer update) in train mode;
  * ``fwdbwd``: forward + backward alone (ours: a program with the loss and each gradient as
    outputs, no update; torch: ``loss.backward()``);
  * ``train_steps``: ``steps`` training steps per timed call (U-Net tiny, batch 4 x 20).

Workload-specific kinds (``decode``, ``denoise``) are implemented by the workload's
``custom_ours`` / ``custom_torch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .weights import deterministic_state


@dataclass(frozen=True)
class Case:
    """One inference case or training step of a workload.

    Attributes:
        name: short name, part of the row's case id (``fwd_seq128``).
        kind: see the module docstring.
        params: sizes of the case (``seq``, ``batch``, ``steps``...).
        optimizer: (``"sgd"`` | ``"adam"``, learning rate) for training kinds.
        quick_only: run only with ``--quick`` (none today).
    """

    name: str
    kind: str
    params: dict = field(default_factory=dict)
    optimizer: tuple[str, float] = ("sgd", 1e-5)

    @property
    def trains(self) -> bool:
        return self.kind in ("train", "fwdbwd", "train_steps")


class Workload:
    """Base class; subclasses set ``id``, ``name``, ``title`` and implement the hooks."""

    id = "w0"
    name = "base"
    title = ""
    #: state-dict names whose values are kept (fixed positions), not replaced by sin weights,
    #: and which are frozen on both sides
    fixed: tuple[str, ...] = ()
    #: PyTorch figures on the H200 from workloads.md (ms; first compiled step in s)
    paper: dict = {}

    def missing(self) -> str | None:
        """Why this workload cannot run here (a module not merged yet), or None."""
        return None

    def cases(self, quick: bool) -> list[Case]:
        raise NotImplementedError

    def headline(self, quick: bool) -> set[str]:
        """The cases the paper's table gives (its forward and training step, ``paper``), by
        their name at this size: the full-size case's place in :meth:`cases`."""
        full = [c.name for c in self.cases(False)]
        names = {v[0] for k, v in self.paper.items() if k in ("fwd", "train")}
        at = [c.name for c in self.cases(quick)]
        return {at[full.index(n)] for n in names if n in full}

    def case(self, name: str, quick: bool) -> Case:
        for c in self.cases(quick):
            if c.name == name:
                return c
        raise KeyError(f"{self.id}: no case {name!r}; known: {[c.name for c in self.cases(quick)]}")

    # ---------------------------------------------------------------- models
    def build_ours(self, case: Case, quick: bool):
        """meganeura's model with default initialization (weights replaced by the caller)."""
        raise NotImplementedError

    def build_torch(self, case: Case, quick: bool):
        """PyTorch's model on the CPU, same state-dict names."""
        raise NotImplementedError

    def ours_model(self, case: Case, quick: bool):
        """(meganeura model with the deterministic weights, that state dict)."""
        model = self.build_ours(case, quick)
        state = deterministic_state(model.state_dict(), self.fixed)
        model.load_state_dict(state)
        return model, state

    def torch_model(self, case: Case, quick: bool, state: dict | None = None):
        """PyTorch's model on the CPU with ``state`` (default: the deterministic weights of
        meganeura's model) loaded by name.

        Raises:
            ValueError: a PyTorch parameter that the state does not name, or a shape mismatch.
        """
        import torch

        if state is None:
            _, state = self.ours_model(case, quick)
        m = self.build_torch(case, quick)
        own = m.state_dict()
        load = {}
        for k, v in own.items():
            if k not in state:
                if k.endswith("num_batches_tracked"):
                    continue
                raise ValueError(f"{self.id}: PyTorch tensor {k!r} has no value in our state dict")
            src = np.asarray(state[k])
            if tuple(src.shape) != tuple(v.shape):
                raise ValueError(
                    f"{self.id}: {k!r} is {tuple(v.shape)} in PyTorch, {src.shape} in ours"
                )
            load[k] = torch.from_numpy(np.ascontiguousarray(src)).to(v.dtype)
        m.load_state_dict(load, strict=False)
        for name, p in m.named_parameters():
            if name in self.fixed:  # frozen on our side too: no gradient, no update
                p.requires_grad_(False)
        return m

    # ---------------------------------------------------------------- data
    def batch(self, case: Case, quick: bool) -> tuple[np.ndarray, ...]:
        """Forward arguments (``fwd``) or loss arguments (training kinds), NumPy."""
        raise NotImplementedError

    def ours_loss(self, model, *batch):
        """The training loss, a meganeura Tensor (a ``Trainer`` loss_fn after the model)."""
        raise NotImplementedError

    def torch_forward(self, m, *batch):
        return m(*batch)

    def torch_loss(self, m, *batch):
        raise NotImplementedError

    def ours_forward_fn(self, model):
        """The function a ``fwd`` case compiles: ``model.forward`` unless overridden."""
        return model.forward

    # custom kinds: return a dict {"run", "sync", "result", "sessions", ...}; see cell.py
    def custom_ours(self, case: Case, model, batch, precision: str, quick: bool):
        raise NotImplementedError(f"{self.id}: no custom kind {case.kind!r}")

    def custom_torch(self, case: Case, m, batch, mode: str, dev: str):
        raise NotImplementedError(f"{self.id}: no custom kind {case.kind!r}")


def to_torch(batch, dev: str):
    """NumPy arrays -> torch tensors on ``dev`` (int32 -> int64, as indices need)."""
    import torch

    out = []
    for a in batch:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if t.dtype == torch.int32:
            t = t.long()
        out.append(t.to(dev))
    return tuple(out)
