"""The loss curve every training recipe writes (``loss.png``) and other curves (the ResNet
recipe's ``accuracy.png``), with matplotlib (the ``plot`` extra) when it is installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_losses(losses, path: Path, title: str, window: int = 1) -> bool:
    """Plot ``[step, loss]`` pairs on a log scale, with their running mean over ``window``
    points when ``window > 1``; write a PNG to ``path``. Returns False (writing nothing)
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.array([p[0] for p in losses]) + 1
    values = np.array([p[1] for p in losses])
    ax.plot(steps, values, lw=0.6, alpha=0.5, label="every few steps")
    if len(values) >= window > 1:
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, lw=1.5, label=f"mean of {window}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_curve(points, path: Path, title: str, xlabel: str, ylabel: str) -> bool:
    """Plot ``[x, y]`` pairs (an accuracy per epoch, say) with markers; write a PNG to
    ``path``. Returns False (writing nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
