"""The global random generator: parameter initialization and dropout seeds.

``manual_seed(s)`` (as ``torch.manual_seed``) makes every default initialization and every
dropout mask that follows it reproducible. Draws happen on the host in NumPy (PCG64), so the
values differ from PyTorch's for the same seed; distributions and bounds are PyTorch's.
"""

from __future__ import annotations

import numpy as np

_generator = np.random.default_rng(0)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed the global generator; returns it.

    Raises:
        ValueError: ``seed`` is not an integer >= 0.
    """
    global _generator
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    _generator = np.random.default_rng(int(seed))
    return _generator


def default_generator() -> np.random.Generator:
    """The global generator (replaced by each ``manual_seed``)."""
    return _generator


def get_rng_state() -> dict:
    """The global generator's state, JSON-serializable (for checkpoints)."""
    return _generator.bit_generator.state


def set_rng_state(state: dict) -> None:
    """Restore a state from :func:`get_rng_state`."""
    _generator.bit_generator.state = state
