"""Image classification with ResNet: ``meganeura train resnet`` and ``meganeura classify``.

Training runs on the MNIST recipe's code path: ``mn.Trainer`` with AdamW and the same
schedules, fixed-size batches from a seeded permutation (``data.mnist.iterate_batches``), a
tqdm bar with the loss, atomic checkpoints (``Trainer.save``) after every epoch, and curves
(``recipes.plotting``): ``loss.png`` and ``accuracy.png`` (held-out accuracy per epoch, read
through the eval-mode program, whose BatchNorms ``passes.fold_batch_norm`` folds).

Data: an ImageFolder (``root/<class>/<image>``, ``data.images``) split 90/10 by a seeded
permutation, or by default the embedded digits (``data.images.load_digits``: the MNIST
subset as 32x32 RGB). The checkpoint's metadata carries what ``classify`` needs: the
architecture, the class names and the preprocessing (resize, crop, mean, std).

``classify`` also reads a checkpoint without the recipe's metadata (a torchvision state dict
saved as safetensors): the architecture, width and class count come from the tensor shapes,
the preprocessing is torchvision's ImageNet one, and class names from ``--labels`` (one per
line) or else indices.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageDataset,
    load_digits,
    load_image_folder,
    preprocess,
    read_image,
    split,
)
from ..data.mnist import iterate_batches, num_batches
from ..io.checkpoint import CheckpointError, check_count, check_rng_state, load_checkpoint
from ..models.resnet import CONFIGS, ResNet, ResNetConfig
from ..nn import functional as F
from ..nn.compiled import CompiledModule
from ..nn.compiled import compile as compile_module
from ..nn.init import empty_weights
from ..nn.module import StateDictError
from ..random import manual_seed
from .common import adamw_trainer, check_train_settings, data_parallel


@dataclass(frozen=True)
class ResNetTrainConfig:
    """Recipe settings. ``width`` is ``ResNetConfig.width`` (64: torchvision's models);
    ``image_size`` the side images are resized and cropped to."""

    arch: str = "resnet18"
    width: int = 64
    image_size: int = 32
    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    schedule: str = "cosine"
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    seed: int = 0
    data: str | None = None
    out: str = "runs/resnet"
    log_every: int = 10
    precision: str = "strict"
    test_fraction: float = 0.1
    # data-parallel over the ranks of ``mpiexec -n N`` (``meganeura.distributed``, initialized
    # first): each rank takes an equal shard of every global batch of ``batch_size`` images;
    # BatchNorm normalizes with each rank's shard, as PyTorch DDP without SyncBatchNorm
    distributed: bool = False


def check_config(cfg: ResNetTrainConfig) -> None:
    """Reject settings the recipe cannot run, before any data is read or program compiled.

    Raises:
        ValueError: an unknown architecture, or a size, count or rate out of range (the
            message names the setting, what it must be and what it is).
    """
    if cfg.arch not in CONFIGS:
        raise ValueError(f"--arch: unknown architecture {cfg.arch!r}; known: {sorted(CONFIGS)}")
    check_train_settings(cfg, (("--width", cfg.width, 1), ("--image-size", cfg.image_size, 1)))


def load_data(cfg: ResNetTrainConfig) -> tuple[ImageDataset, ImageDataset, dict]:
    """(train, test, preprocessing metadata) of ``cfg.data`` (an ImageFolder) or the digits.

    Raises:
        FileNotFoundError: ``cfg.data`` is not a folder.
        ValueError: it has no images, an image Pillow cannot read, or fewer than two classes
            with images (a classifier of one class learns nothing).
    """
    if cfg.data is None:
        train, test = load_digits(cfg.image_size, seed=cfg.seed)
        source = "digits (embedded MNIST subset, 32x32 RGB)"
    else:
        ds = load_image_folder(cfg.data, cfg.image_size)
        if len(ds.classes) < 2:
            raise ValueError(
                f"{cfg.data}: an ImageFolder needs images in two or more class subfolders, "
                f"found {len(ds.classes)} ({', '.join(ds.classes)})"
            )
        train, test = split(ds, cfg.test_fraction, 1)
        source = str(cfg.data)
    pre = {
        "resize": cfg.image_size,
        "crop": cfg.image_size,
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "source": source,
    }
    return train, test, pre


def build_model(arch: str, num_classes: int, width: int = 64) -> ResNet:
    """``models.resnet`` ``arch`` (resnet18 .. resnet101) at ``width``.

    Raises:
        ValueError: an unknown architecture (the message lists the known ones).
    """
    if arch not in CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(CONFIGS)}")
    base = CONFIGS[arch]
    return ResNet(ResNetConfig(base.block, base.layers, num_classes, width=width))


def loss_fn(model: ResNet, x, y):
    """Mean cross-entropy of the logits for images ``x`` f32[N, 3, S, S] and labels int[N]."""
    return F.cross_entropy(model(x), y)


def predict_logits(run: CompiledModule, x: np.ndarray, batch: int) -> np.ndarray:
    """Logits f32[N, classes], ``batch`` images per call (a shorter last chunk compiles once
    more)."""
    return np.concatenate([run(x[i : i + batch]) for i in range(0, len(x), batch)])


def _accuracy(model: ResNet, run: CompiledModule, ds: ImageDataset, batch: int) -> float:
    """Held-out accuracy through ``run`` (``model`` compiled), in eval mode."""
    if len(ds.y) == 0:
        return float("nan")
    model.eval()
    acc = float((predict_logits(run, ds.x, batch).argmax(1) == ds.y).mean())
    model.train()
    return acc


def _resume_meta(path: str, cfg: ResNetTrainConfig, classes) -> dict:
    """The recipe's metadata of a checkpoint, checked before the trainer loads anything.

    Raises:
        CheckpointError: not this recipe's for ``cfg``'s architecture, width and classes, or
            an epoch or data RNG state that is missing or malformed.
    """
    _, meta = load_checkpoint(path)
    want = {"model": "resnet", "arch": cfg.arch, "width": cfg.width, "classes": list(classes)}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise CheckpointError(
            f"{path}: holds {got}; this run trains {want} (pass the --arch, --width and "
            "--data it was trained with)"
        )
    check_count(path, meta, "epoch", "the epochs done")
    check_rng_state(path, meta, "data_rng", np.random.default_rng().bit_generator)
    return meta


def train(
    cfg: ResNetTrainConfig,
    resume: str | None = None,
    device=None,
    progress: bool = True,
    max_steps: int | None = None,
) -> dict:
    """Run the recipe; returns a summary (accuracies, losses, paths, seconds).

    Args:
        cfg: settings.
        resume: a checkpoint of this recipe to continue from: parameters, optimizer state,
            step counter, RNGs, epoch, losses and accuracies (``Trainer.load``); the run then
            continues bit-identically to the one that saved.
        device: runtime Device (default device when None).
        progress: show the tqdm bar.
        max_steps: stop after this many optimizer steps in total (tests use it).

    Raises:
        ValueError: settings ``check_config`` rejects; data ``load_data`` rejects.
        FileNotFoundError: ``cfg.data`` is not a folder.
        CheckpointError: a ``resume`` checkpoint that does not fit (nothing is loaded).
    """
    check_config(cfg)
    train_ds, test_ds, pre = load_data(cfg)
    classes = train_ds.classes
    resume_meta = _resume_meta(resume, cfg, classes) if resume else None  # before compiling
    batch = min(cfg.batch_size, len(train_ds.y))
    dp = data_parallel(cfg.distributed, batch, device)
    world, main, device = dp.world_size, dp.main, dp.device
    steps_per_epoch = num_batches(len(train_ds.y), batch)
    total = steps_per_epoch * cfg.epochs
    manual_seed(cfg.seed)
    model = build_model(cfg.arch, len(classes), cfg.width)
    trainer = adamw_trainer(model, loss_fn, cfg, total, device, cfg.distributed)
    run = compile_module(model, precision=cfg.precision, device=device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.safetensors"
    data_rng = np.random.default_rng(cfg.seed + 1)
    epoch0, losses, accuracy, seen = 0, [], [], 0
    if resume:
        meta = resume_meta
        trainer.load(resume)  # parameters, optimizer state, step counter, global RNG
        data_rng.bit_generator.state = meta["data_rng"]
        epoch0 = meta["epoch"]
        losses, accuracy = list(meta.get("losses", [])), list(meta.get("accuracy", []))
    t_start = time.perf_counter()
    reduce_s, ran = 0.0, 0
    for epoch in range(epoch0, cfg.epochs):
        bar = tqdm(
            iterate_batches(len(train_ds.y), batch, data_rng),
            total=steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            disable=not progress or not main,
            leave=False,
        )
        for idx in bar:
            step = trainer.step_count
            log = step % cfg.log_every == 0
            x, y = train_ds.x[idx], train_ds.y[idx]
            x, y = dp.shard(x), dp.shard(y)  # this rank's shard of the global batch
            loss = trainer.step(x, y, return_loss=log)
            seen += len(idx)
            reduce_s += getattr(trainer, "reduce_seconds", 0.0)
            ran += 1
            if log:
                losses.append([step, loss])
                shown = {"loss": f"{loss:.4f}"}
                if cfg.distributed:  # the reduce time the backward did not hide
                    shown["reduce_ms"] = f"{1e3 * trainer.reduce_seconds:.2f}"
                bar.set_postfix(shown)
            if max_steps is not None and trainer.step_count >= max_steps:
                break
        bar.close()
        accuracy.append([epoch + 1, _accuracy(model, run, test_ds, batch)])
        meta = _meta(cfg, classes, pre, epoch + 1, losses, accuracy, data_rng)
        trainer.save(ckpt, meta)
        if max_steps is not None and trainer.step_count >= max_steps:
            break
    train_s = time.perf_counter() - t_start
    summary = {
        "steps": trainer.step_count,
        "train_images": len(train_ds.y),
        "test_images": len(test_ds.y),
        "classes": list(classes),
        "test_accuracy": accuracy[-1][1] if accuracy else float("nan"),
        "final_loss": losses[-1][1] if losses else None,
        "losses": losses,
        "accuracy": accuracy,
        "train_seconds": train_s,
        "images_per_second": seen / train_s if train_s else 0.0,
        "checkpoint": str(ckpt),
        "world_size": world,
        "main": main,
    }
    if cfg.distributed:
        summary["reduce_ms_per_step"] = 1e3 * reduce_s / max(ran, 1)
        summary["reduce_bytes"] = trainer.reduce_bytes
    if not main:  # rank 0 alone draws
        return summary
    from .plotting import plot_curve, plot_losses

    title = f"meganeura: {cfg.arch} (width {cfg.width}), {pre['source']}"
    if plot_losses(losses, out / "loss.png", title, window=max(1, steps_per_epoch // 10)):
        summary["loss_plot"] = str(out / "loss.png")
    if plot_curve(accuracy, out / "accuracy.png", title, "epoch", "held-out accuracy"):
        summary["accuracy_plot"] = str(out / "accuracy.png")
    return summary


def _meta(cfg, classes, pre, epoch, losses, accuracy, data_rng) -> dict:
    return {
        "data_rng": data_rng.bit_generator.state,
        "model": "resnet",
        "arch": cfg.arch,
        "width": cfg.width,
        "num_classes": len(classes),
        "classes": list(classes),
        "preprocess": pre,
        "config": asdict(cfg),
        "epoch": epoch,
        "losses": losses,
        "accuracy": accuracy,
    }


# ---------------------------------------------------------------------------- classify
def infer_config(tensors: dict) -> tuple[str, int, int]:
    """(arch, width, num_classes) of a torchvision-named ResNet state dict, from its shapes.

    Raises:
        CheckpointError: the tensors are not a ResNet's, or its block counts are none of
            resnet18 .. resnet101's.
    """
    if "conv1.weight" not in tensors or "fc.weight" not in tensors:
        raise CheckpointError("not a ResNet state dict (no conv1.weight or fc.weight)")
    width = int(tensors["conv1.weight"].shape[0])
    block = "bottleneck" if "layer1.0.conv3.weight" in tensors else "basic"
    layers = tuple(
        len({k.split(".")[1] for k in tensors if k.startswith(f"layer{i}.")}) for i in (1, 2, 3, 4)
    )
    for name, c in CONFIGS.items():
        if (c.block, c.layers) == (block, layers):
            return name, width, int(tensors["fc.weight"].shape[0])
    raise CheckpointError(f"a {block} ResNet with blocks {layers} is none of {sorted(CONFIGS)}")


def load_model(checkpoint: str) -> tuple[ResNet, dict]:
    """The ResNet of ``checkpoint`` (this recipe's, or a bare torchvision-named state dict in
    safetensors) and its metadata (``{}`` for a bare one).

    Raises:
        CheckpointError: a missing or corrupt file, or tensors that are not a ResNet's.
    """
    try:
        tensors, meta = load_checkpoint(checkpoint)
    except CheckpointError as e:  # a bare safetensors file: tensors without our metadata
        try:
            from safetensors.numpy import load_file

            tensors, meta = load_file(checkpoint), {}
        except Exception:
            raise e from None
    if meta.get("model") == "resnet":
        arch, width, classes = meta["arch"], int(meta["width"]), int(meta["num_classes"])
    else:
        try:
            arch, width, classes = infer_config(tensors)
        except CheckpointError as e:
            raise CheckpointError(f"{checkpoint}: {e}") from None
    with empty_weights():  # every weight comes from the checkpoint
        model = build_model(arch, classes, width)
    state = {k: v for k, v in tensors.items() if not k.startswith("optimizer/")}
    try:
        model.load_state_dict(state, strict=True)
    except StateDictError as e:
        raise CheckpointError(f"{checkpoint}: {e}") from e
    return model.eval(), meta


def classify(
    images: list[str],
    checkpoint: str,
    top_k: int = 5,
    labels: str | None = None,
    device=None,
    precision: str = "strict",
) -> list[dict]:
    """Top-``k`` classes of each image: ``[{"image", "top": [(index, name, probability)]}]``.

    Preprocessing is the checkpoint's (``preprocess`` metadata), else torchvision's ImageNet
    evaluation transform (resize 256, center crop 224). Names come from ``labels`` (a text
    file, one name per line), else the checkpoint's ``classes``, else the indices.

    Raises:
        CheckpointError: as ``load_model``.
        ValueError: a ``labels`` file whose line count is not the class count; ``top_k < 1``.
        ImportError, FileNotFoundError: as ``data.images.read_image``.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    model, meta = load_model(checkpoint)
    n = model.fc.weight.shape[0]
    names = [str(i) for i in range(n)]
    if labels is not None:
        names = [ln.strip() for ln in Path(labels).read_text().splitlines() if ln.strip()]
        if len(names) != n:
            raise ValueError(f"{labels}: {len(names)} names for a model of {n} classes")
    elif meta.get("classes"):
        names = [str(c) for c in meta["classes"]]
    pre = meta.get("preprocess", {})
    x = np.stack(
        [
            preprocess(
                read_image(p),
                int(pre.get("resize", 256)),
                int(pre.get("crop", 224)),
                tuple(pre.get("mean", IMAGENET_MEAN)),
                tuple(pre.get("std", IMAGENET_STD)),
            )
            for p in images
        ]
    )
    logits = compile_module(model, precision=precision, device=device)(x).astype(np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    results = []
    for path, p in zip(images, probs, strict=True):
        top = np.argsort(-p, kind="stable")[: min(top_k, n)]
        results.append({"image": path, "top": [(int(i), names[i], float(p[i])) for i in top]})
    return results


def format_classify(results: list[dict]) -> str:
    """The lines ``meganeura classify`` prints: per image its name, then one line per class."""
    lines = []
    for r in results:
        lines.append(f"{r['image']}:")
        lines += [f"  {p:7.2%}  {name} ({i})" for i, name, p in r["top"]]
    return "\n".join(lines)


def format_train(s: dict) -> str:
    """The lines ``meganeura train resnet`` prints after training."""
    final = "-" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    lines = [
        f"data: {s['train_images']} training / {s['test_images']} held-out images, "
        f"{len(s['classes'])} classes",
        f"steps: {s['steps']}  final loss: {final}  throughput: "
        f"{s['images_per_second']:,.1f} images/s",
        f"checkpoint: {s['checkpoint']}",
    ]
    if "reduce_ms_per_step" in s:
        lines.insert(
            2,
            f"distributed: {s['world_size']} ranks, "
            f"{s['images_per_second'] / s['world_size']:,.1f} images/s per rank, "
            f"{s['reduce_ms_per_step']:.3f} ms per step of reading back and all-reducing "
            f"{s['reduce_bytes']:,} B of gradients not hidden by the backward pass",
        )
    for key, what in (("loss_plot", "loss curve"), ("accuracy_plot", "accuracy curve")):
        if key in s:
            lines.append(f"{what}: {s[key]}")
    lines.append(f"held-out accuracy: {100 * s['test_accuracy']:.2f}%")
    return "\n".join(lines)
