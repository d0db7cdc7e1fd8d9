"""The main job: train the 784-128-10 MLP on MNIST with AdamW, evaluate, checkpoint, plot.

Everything a run needs to resume bit-identically lives in its checkpoint: parameters,
optimizer state, step counter, the data-order RNG state, the epoch reached and the
standardization statistics (so ``predict`` preprocesses exactly as training did).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..compile import CompileOptions
from ..data.mnist import iterate_batches, load_mnist, num_batches, standardize
from ..io.checkpoint import load_checkpoint
from ..models.mlp import build_mlp
from ..optim import AdamW
from ..optim.schedules import get_schedule
from ..random import manual_seed
from ..training import Trainer, compile_for


@dataclass(frozen=True)
class MnistConfig:
    """Recipe settings (defaults: the issue's recipe, AdamW lr 1e-3, batch 64, 10 epochs)."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    schedule: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    hidden: int = 128
    seed: int = 0
    data: str | None = None
    out: str = "runs/mnist"
    log_every: int = 10
    precision: str = "strict"  # CompileOptions.precision of the training and eval programs


def _schedule(cfg: MnistConfig, total_steps: int):
    if cfg.schedule == "constant":
        return get_schedule("constant", lr=cfg.lr)
    if cfg.schedule == "warmup":
        return get_schedule("warmup", lr=cfg.lr, warmup_steps=max(cfg.warmup_steps, 1))
    return get_schedule("cosine", lr=cfg.lr, total_steps=total_steps, warmup_steps=cfg.warmup_steps)


def predict_logits(
    params: dict[str, np.ndarray],
    x: np.ndarray,
    sizes,
    batch: int = 500,
    device=None,
    precision: str = "strict",
) -> np.ndarray:
    """Logits for standardized images ``x`` f32[N, 784] with an inference program.

    The last chunk is zero-padded to the program's static batch and the padding dropped.
    """
    net = build_mlp(batch, sizes, labels=False)
    _, session = compile_for(net.graph, CompileOptions(precision=precision), device)
    session.load_state_dict({k: params[k] for k in session.program.parameters})
    out = []
    for start in range(0, len(x), batch):
        chunk = x[start : start + batch]
        pad = batch - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, x.shape[1]), np.float32)])
        logits = session.run({"x": chunk}, ["logits"])["logits"]
        out.append(logits[: batch - pad])
    session.close()
    return np.concatenate(out)


def train(
    cfg: MnistConfig,
    resume: str | None = None,
    device=None,
    progress: bool = True,
    max_steps: int | None = None,
) -> dict:
    """Run the recipe; returns a summary dict (accuracy, losses, paths, timings).

    Args:
        cfg: settings.
        resume: checkpoint to continue from (its config must match ``cfg``'s model).
        device: runtime Device (default device when None).
        progress: show the tqdm bar.
        max_steps: stop after this many optimizer steps in total (tests use it).
    """
    data = load_mnist(cfg.data, seed=cfg.seed)
    x_train, mean, std = standardize(data.x_train)
    x_test, _, _ = standardize(data.x_test, mean, std)
    sizes = (784, cfg.hidden, 10)
    steps_per_epoch = num_batches(len(x_train), cfg.batch_size)
    total = steps_per_epoch * cfg.epochs

    manual_seed(cfg.seed)
    net = build_mlp(cfg.batch_size, sizes)
    trainer = Trainer(
        net.graph,
        AdamW(lr=cfg.lr, weight_decay=cfg.weight_decay),
        schedule=_schedule(cfg, total),
        max_grad_norm=cfg.max_grad_norm,
        device=device,
        precision=cfg.precision,
    )
    data_rng = np.random.default_rng(cfg.seed + 1)
    epoch0, losses = 0, []
    if resume:
        meta = trainer.load(resume)
        data_rng.bit_generator.state = meta["data_rng"]
        epoch0, losses = int(meta["epoch"]), list(meta.get("losses", []))
    else:
        trainer.load_parameters(net.state_dict())

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.safetensors"
    t_start = time.perf_counter()
    seen = 0
    stopped = False
    for epoch in range(epoch0, cfg.epochs):
        bar = tqdm(
            iterate_batches(len(x_train), cfg.batch_size, data_rng),
            total=steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=not progress,
            leave=False,
        )
        epoch_t = time.perf_counter()
        for k, idx in enumerate(bar):
            # Reading the loss back is a host round trip (~0.2 ms on the H200, a third of the
            # step): only every log_every-th step pays it, counted in global steps so a
            # resumed run samples the same steps.
            step = trainer.step_count
            log = step % cfg.log_every == 0
            result = trainer.step(
                {"x": x_train[idx], "y": data.y_train[idx]}, fetch=("loss",) if log else ()
            )
            seen += len(idx)
            if log:
                loss = float(result["loss"])
                losses.append([step, loss])
                rate = (k + 1) * cfg.batch_size / (time.perf_counter() - epoch_t)
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
            if max_steps is not None and trainer.step_count >= max_steps:
                stopped = True
                break
        bar.close()
        if stopped:
            break
        meta = _meta(cfg, epoch + 1, data_rng, losses, mean, std)
        trainer.save(ckpt, meta)
    train_s = time.perf_counter() - t_start

    params = trainer.parameters()
    logits = predict_logits(params, x_test, sizes, device=device, precision=cfg.precision)
    acc = float((logits.argmax(1) == data.y_test).mean())
    summary = {
        "test_accuracy": acc,
        "steps": trainer.step_count,
        "train_seconds": train_s,
        "samples_per_second": seen / train_s if train_s else 0.0,
        "checkpoint": str(ckpt),
        "final_loss": losses[-1][1] if losses else None,
        "memory": asdict(trainer.program.memory),
        "losses": losses,
    }
    png = out / "loss.png"
    if _plot(losses, steps_per_epoch // cfg.log_every, png):
        summary["loss_plot"] = str(png)
    return summary


def _meta(cfg, epoch, rng, losses, mean, std) -> dict:
    return {
        "config": asdict(cfg),
        "epoch": epoch,
        "data_rng": rng.bit_generator.state,
        "losses": losses,
        "mean": float(mean),
        "std": float(std),
        "model": "mlp",
        "sizes": [784, cfg.hidden, 10],
    }


def _plot(losses, samples_per_epoch: int, path: Path) -> bool:
    """Loss curve from ``[step, loss]`` pairs, with a running mean over one epoch's samples."""
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
    w = max(1, samples_per_epoch)
    if len(values) >= w > 1:
        smooth = np.convolve(values, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1 :], smooth, lw=1.5, label=f"mean of {w}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.set_title("meganeura: MNIST MLP 784-128-10, AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def predict(
    checkpoint: str,
    data: str | None = None,
    count: int = 10,
    device=None,
    precision: str = "strict",
) -> dict:
    """Reload a checkpoint and classify the test split; returns accuracy and predictions."""
    tensors, meta = load_checkpoint(checkpoint)
    sizes = tuple(meta["sizes"])
    seed = meta["config"]["seed"]
    ds = load_mnist(data if data is not None else meta["config"]["data"], seed=seed)
    x, _, _ = standardize(ds.x_test, meta["mean"], meta["std"])
    logits = predict_logits(tensors, x, sizes, device=device, precision=precision)
    pred = logits.argmax(1)
    return {
        "test_accuracy": float((pred == ds.y_test).mean()),
        "n": len(pred),
        "predictions": pred[:count].tolist(),
        "labels": ds.y_test[:count].tolist(),
    }
