"""The main job: train the 784-128-10 MLP module on MNIST with AdamW (``mn.Trainer``),
evaluate, checkpoint, plot.

Everything a run needs to resume bit-identically lives in its checkpoint: parameters, optimizer
state, step counter and global RNG (``Trainer.save``), and the recipe's own metadata: the
data-order RNG state, the epoch reached, the losses so far and the standardization statistics
(so ``predict`` preprocesses exactly as training did). A resume checks that metadata before the
trainer loads anything.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..data.mnist import iterate_batches, load_mnist, num_batches, standardize
from ..io.checkpoint import CheckpointError, check_count, check_rng_state, load_checkpoint
from ..models.mlp import MLP
from ..nn import functional as F
from ..nn.compiled import CompiledModule
from ..nn.compiled import compile as compile_module
from ..nn.init import empty_weights
from ..nn.module import StateDictError
from ..random import manual_seed
from ..training import Trainer
from .common import adamw_trainer, check_train_settings, data_parallel


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
    # data-parallel over the ranks of ``mpiexec -n N`` (``meganeura.distributed``, initialized
    # first); batch_size is the global batch, split in equal shards across ranks
    distributed: bool = False

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (784, self.hidden, 10)


def init_model(cfg: MnistConfig) -> MLP:
    """The recipe's MLP with its initial weights drawn from ``cfg.seed`` (``mn.manual_seed``,
    then construction, as ``torch.manual_seed`` before ``nn.Linear``)."""
    manual_seed(cfg.seed)
    return MLP(cfg.sizes)


def loss_fn(model: MLP, x, y):
    """Mean cross-entropy of the model's logits for images ``x`` f32[N, 784] against digits
    ``y`` int[N] (the Trainer's ``loss_fn``)."""
    return F.cross_entropy(model(x), y)


def inference(model: MLP, device=None, precision: str = "strict") -> CompiledModule:
    """``model`` in eval mode, compiled on call for ``device`` and ``precision``."""
    model.eval()
    return compile_module(model, precision=precision, device=device)


def predict_logits(run: CompiledModule, x: np.ndarray, batch: int = 500) -> np.ndarray:
    """Logits f32[N, 10] for standardized images ``x`` f32[N, 784], ``batch`` rows per call
    of ``run`` (:func:`inference`; a shorter last chunk compiles once more)."""
    return np.concatenate([run(x[i : i + batch]) for i in range(0, len(x), batch)])


def _resume_meta(path: str, cfg: MnistConfig) -> dict:
    """The recipe's metadata of a checkpoint, checked before the trainer loads it.

    Raises:
        CheckpointError: not written by this recipe for ``cfg``'s model, or an epoch, data RNG
            state or loss history that is missing or malformed.
    """
    _, meta = load_checkpoint(path)
    sizes = meta.get("sizes")
    if meta.get("model") != "mlp" or sizes != list(cfg.sizes):
        raise CheckpointError(
            f"{path}: holds a {meta.get('model')} of sizes {sizes}; this run trains the MLP "
            f"{list(cfg.sizes)} (pass the --hidden it was trained with)"
        )
    check_count(path, meta, "epoch", "the epochs done")
    check_rng_state(path, meta, "data_rng", np.random.default_rng().bit_generator)
    losses = meta.get("losses", [])
    if not isinstance(losses, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], int)
        and not isinstance(p[0], bool)
        and isinstance(p[1], (int, float))
        and not isinstance(p[1], bool)
        for p in losses
    ):
        raise CheckpointError(
            f"{path}: metadata 'losses' is not a list of [step, loss] pairs (an int and a "
            "number each)"
        )
    return meta


def _step_memory(trainer: Trainer) -> dict | None:
    """The planned memory of the training step's program (None when no step ran)."""
    for entry in trainer.cache_info().entries:
        if entry.signature[0] in ("step", "accumulate"):  # accumulate: a distributed run's
            return asdict(entry.runner.program.memory)
    return None


def _compile_seconds(*caches) -> dict[str, float]:
    """Trace, compile (graph -> Program) and setup (Session) seconds over compiled programs."""
    entries = [e for c in caches for e in c.entries]
    return {
        "trace": sum(e.trace_seconds for e in entries),
        "compile": sum(e.compile_seconds for e in entries),
        "setup": sum(e.setup_seconds for e in entries),
    }


def check_config(cfg: MnistConfig) -> None:
    """Reject settings the recipe cannot run, before data is read or a program compiled.

    Raises:
        ValueError: a size, count or rate out of range (the message names the flag, what it
            must be and what it is).
    """
    check_train_settings(cfg, (("--hidden", cfg.hidden, 1),))


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
        resume: checkpoint to continue from (written by this recipe for ``cfg``'s model).
        device: runtime Device (default device when None).
        progress: show the tqdm bar.
        max_steps: stop after this many optimizer steps in total (tests use it).

    Raises:
        ValueError: settings ``check_config`` rejects.
        FileNotFoundError: ``cfg.data`` lacks an MNIST file.
        CheckpointError: a ``resume`` checkpoint that does not fit (nothing is loaded).
    """
    check_config(cfg)
    dp = data_parallel(cfg.distributed, cfg.batch_size, device)
    world, main, device = dp.world_size, dp.main, dp.device
    data = load_mnist(cfg.data, seed=cfg.seed)
    x_train, mean, std = standardize(data.x_train)
    x_test, _, _ = standardize(data.x_test, mean, std)
    steps_per_epoch = num_batches(len(x_train), cfg.batch_size)
    total = steps_per_epoch * cfg.epochs

    model = init_model(cfg)
    trainer = adamw_trainer(model, loss_fn, cfg, total, device, cfg.distributed)
    data_rng = np.random.default_rng(cfg.seed + 1)
    epoch0, losses = 0, []
    if resume:
        meta = _resume_meta(resume, cfg)
        trainer.load(resume)  # parameters, optimizer state, step counter, global RNG
        data_rng.bit_generator.state = meta["data_rng"]
        epoch0, losses = meta["epoch"], list(meta.get("losses", []))

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.safetensors"
    t_start = time.perf_counter()
    seen = 0
    reduce_s, ran = 0.0, 0
    stopped = False
    for epoch in range(epoch0, cfg.epochs):
        bar = tqdm(
            iterate_batches(len(x_train), cfg.batch_size, data_rng),
            total=steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=not progress or not main,
            leave=False,
        )
        epoch_t = time.perf_counter()
        for k, idx in enumerate(bar):
            # Reading the loss back is a host round trip (~0.2 ms on the H200, a third of the
            # step): only every log_every-th step pays it, counted in global steps so a
            # resumed run samples the same steps.
            step = trainer.step_count
            log = step % cfg.log_every == 0
            x, y = x_train[idx], data.y_train[idx]
            x, y = dp.shard(x), dp.shard(y)  # this rank's shard of the global batch
            loss = trainer.step(x, y, return_loss=log)
            seen += len(idx)
            reduce_s += getattr(trainer, "reduce_seconds", 0.0)
            ran += 1
            if log:
                losses.append([step, loss])
                rate = (k + 1) * cfg.batch_size / (time.perf_counter() - epoch_t)
                shown = {"loss": f"{loss:.4f}", "samples_s": f"{rate:,.0f}"}
                if cfg.distributed:  # per rank, and the reduce time the backward did not hide
                    shown["rank_samples_s"] = f"{rate / world:,.0f}"
                    shown["reduce_ms"] = f"{1e3 * trainer.reduce_seconds:.2f}"
                bar.set_postfix(shown)
            if max_steps is not None and trainer.step_count >= max_steps:
                stopped = True
                break
        bar.close()
        if stopped:
            break
        trainer.save(ckpt, _meta(cfg, epoch + 1, data_rng, losses, mean, std))
    train_s = time.perf_counter() - t_start

    run = inference(model, device, cfg.precision)
    acc = float((predict_logits(run, x_test).argmax(1) == data.y_test).mean())
    summary = {
        "test_accuracy": acc,
        "steps": trainer.step_count,
        "train_seconds": train_s,
        "samples_per_second": seen / train_s if train_s else 0.0,
        "checkpoint": str(ckpt),
        "final_loss": losses[-1][1] if losses else None,
        "memory": _step_memory(trainer),
        "compile_seconds": _compile_seconds(trainer.cache_info(), run.cache_info()),
        "losses": losses,
        "world_size": world,
        "main": main,
    }
    if cfg.distributed:
        summary["reduce_ms_per_step"] = 1e3 * reduce_s / max(ran, 1)
        summary["reduce_bytes"] = trainer.reduce_bytes
    png = out / "loss.png"
    if main and _plot(losses, steps_per_epoch // cfg.log_every, png):
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
        "sizes": list(cfg.sizes),
    }


def _plot(losses, samples_per_epoch: int, path: Path) -> bool:
    """Loss curve from ``[step, loss]`` pairs, with a running mean over one epoch's samples."""
    from .plotting import plot_losses

    title = "meganeura: MNIST MLP 784-128-10, AdamW"
    return plot_losses(losses, path, title, window=max(1, samples_per_epoch))


def load_model(checkpoint: str) -> tuple[MLP, dict]:
    """The MLP of a checkpoint written by :func:`train` (or, before the module Trainer, by the
    graph trainer: the parameter names are the same), and the checkpoint's metadata.

    Raises:
        CheckpointError: a corrupt file, another recipe's checkpoint, or one without the
            model's parameters (or with mis-shaped ones).
    """
    tensors, meta = load_checkpoint(checkpoint)
    if "sizes" not in meta:
        raise CheckpointError(
            f"{checkpoint}: not a checkpoint of train mnist (no 'sizes' in its metadata; it "
            f"holds a {meta.get('model', 'different')!r} model)"
        )
    with empty_weights():  # every weight comes from the checkpoint
        model = MLP(meta["sizes"])
    try:  # strict=False: the graph trainer kept optimizer state as "<param>.exp_avg" keys
        missing, _ = model.load_state_dict(tensors, strict=False)
    except StateDictError as e:
        raise CheckpointError(f"{checkpoint}: {e}") from e
    if missing:
        raise CheckpointError(f"{checkpoint}: has no {missing}")
    return model, meta


def predict(
    checkpoint: str,
    data: str | None = None,
    count: int = 10,
    device=None,
    precision: str = "strict",
) -> dict:
    """Reload a checkpoint and classify the test split; returns accuracy and predictions."""
    model, meta = load_model(checkpoint)
    ds = load_mnist(
        data if data is not None else meta["config"]["data"], seed=meta["config"]["seed"]
    )
    x, _, _ = standardize(ds.x_test, meta["mean"], meta["std"])
    pred = predict_logits(inference(model, device, precision), x).argmax(1)
    return {
        "test_accuracy": float((pred == ds.y_test).mean()),
        "n": len(pred),
        "predictions": pred[:count].tolist(),
        "labels": ds.y_test[:count].tolist(),
    }
