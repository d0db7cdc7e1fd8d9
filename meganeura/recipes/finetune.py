"""``meganeura finetune``: next-token fine-tuning of a Llama-family model on a text file, in full
or with LoRA adapters on chosen projections (the base frozen).

The text is tokenized once (the tokenizer's ids, an end-of-sequence token after each blank-line
separated document) and cut into windows of ``seq_len + 1`` tokens, shuffled each epoch with a
seeded generator; each step trains on ``batch_size`` windows (inputs are a window's first
``seq_len`` tokens, labels its last ``seq_len``) with AdamW, linear warm-up then cosine decay
and gradient clipping at 1.0. The loss is read back every ``log_every`` steps for the progress
bar (loss, tokens/s) and the loss curve (``loss.png``).

Output folder: ``model/`` (an HF folder: config, safetensors, tokenizer; LoRA runs merge their
adapters into it unless ``--no-merge``) and, with LoRA, ``adapter/`` (PEFT's files), both
loadable by ``meganeura generate --model ...`` (``--lora-adapter`` for the unmerged adapter).

``distributed`` (``mpiexec -n N meganeura finetune --distributed``): data-parallel over the
ranks (``meganeura.distributed``). Every rank tokenizes the file and draws the same seeded
window order, so every rank holds the same global batch of ``batch_size`` windows; each takes
its equal shard of those windows (``distributed.shard``: whole sequences, never a cut
sequence) and a ``DistributedTrainer`` averages the gradients, so a step equals one process on
the global batch (Llama has no BatchNorm: every window's loss is its own). Rank 0 alone shows
the bar and writes the output folder; the others learn whether its writes succeeded.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class FinetuneConfig:
    """Settings of one fine-tuning run (the CLI's flags)."""

    model: str | None = None
    data: str = ""
    out: str = "runs/finetune"
    lora: bool = False
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    log_every: int = 5
    seed: int = 0
    merge: bool = True
    precision: str = "strict"
    # data-parallel over the ranks of ``mpiexec -n N`` (``meganeura.distributed``, initialized
    # first); batch_size is the global batch of windows, split in equal shards across ranks
    distributed: bool = False


def token_windows(ids: list[int], seq_len: int) -> np.ndarray:
    """Non-overlapping windows int32 [N, seq_len + 1] of a token stream (the tail that does
    not fill a window is dropped).

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens.
    """
    n = len(ids) // (seq_len + 1)
    if n == 0:
        raise ValueError(
            f"the data has {len(ids)} tokens, fewer than one window of seq_len + 1 = "
            f"{seq_len + 1} (use a smaller --seq-len or more text)"
        )
    return np.asarray(ids[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)


def tokenize_file(path: str, tokenizer) -> list[int]:
    """The ids of a UTF-8 text file: each blank-line separated document followed by eos."""
    text = Path(path).read_text(encoding="utf-8")
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for d in docs:
        ids += tokenizer.encode(d)
        if eos is not None:
            ids.append(eos)
    return ids


def finetune(cfg: FinetuneConfig, device=None, progress: bool = True) -> dict:
    """Run the recipe; returns a summary (steps, losses, tokens/s, paths).

    Raises:
        ValueError: bad settings or too little data (named).
        FileNotFoundError: no data file or model.
    """
    from tqdm import tqdm

    import meganeura as mn

    from ..models.llama import LlamaForCausalLM, lm_loss
    from ..nn import lora
    from ..optim.schedules import get_schedule
    from ..random import manual_seed
    from .common import data_parallel

    if cfg.batch_size < 1 or cfg.seq_len < 1 or cfg.epochs < 1 or cfg.log_every < 1:
        raise ValueError("batch_size, seq_len, epochs and log_every must be >= 1")
    if not Path(cfg.data).is_file():
        raise FileNotFoundError(f"no data file {cfg.data!r} (a UTF-8 text file)")
    dp = data_parallel(cfg.distributed, cfg.batch_size, device, "batch of windows")
    world, main, device = dp.world_size, dp.main, dp.device
    model = LlamaForCausalLM.from_pretrained(cfg.model)
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the model has no tokenizer to read the text with")
    windows = token_windows(tokenize_file(cfg.data, tok), cfg.seq_len)
    if len(windows) < cfg.batch_size:
        raise ValueError(
            f"{len(windows)} windows of {cfg.seq_len + 1} tokens, fewer than one batch of "
            f"{cfg.batch_size} (lower --batch-size or --seq-len)"
        )
    manual_seed(cfg.seed)  # the adapters' initial A (rank 0's are broadcast when distributed)
    if cfg.lora:
        lora.apply_lora(model, cfg.lora_targets, r=cfg.lora_r, alpha=cfg.lora_alpha)
    steps_per_epoch = len(windows) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:  # as transformers' Trainer: max_steps overrides epochs
        if cfg.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {cfg.max_steps}")
        total = cfg.max_steps
    trainer_cls = mn.Trainer
    if cfg.distributed:
        from ..distributed import DistributedTrainer as trainer_cls
    trainer = trainer_cls(
        model,
        mn.optim.AdamW(lr=cfg.lr, weight_decay=cfg.weight_decay),
        lm_loss,
        schedule=get_schedule(
            "cosine", lr=cfg.lr, total_steps=total, warmup_steps=min(cfg.warmup_steps, total - 1)
        ),
        max_grad_norm=cfg.max_grad_norm,
        device=device,
        precision=cfg.precision,
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rng = np.random.default_rng(cfg.seed)
    losses: list[list[float]] = []
    tokens = 0
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="finetune", disable=not progress or not main)
    step, reduce_s = 0, 0.0
    while step < total:
        order = rng.permutation(len(windows))
        for k in range(steps_per_epoch):
            if step >= total:
                break
            batch = windows[order[k * cfg.batch_size : (k + 1) * cfg.batch_size]]
            log = step % cfg.log_every == 0 or step == total - 1
            tokens += batch.shape[0] * cfg.seq_len  # the global batch's
            batch = dp.shard(batch)  # this rank's windows of the global batch
            loss = trainer.step(batch[:, :-1], batch[:, 1:], return_loss=log)
            reduce_s += getattr(trainer, "reduce_seconds", 0.0)
            step += 1
            bar.update(1)
            if log:
                losses.append([step, float(loss)])
                rate = tokens / (time.perf_counter() - t0)
                shown = {"loss": f"{loss:.4f}", "tokens_s": f"{rate:,.0f}"}
                if cfg.distributed:  # the reduce time the backward did not hide
                    shown["reduce_ms"] = f"{1e3 * trainer.reduce_seconds:.2f}"
                bar.set_postfix(shown)
    bar.close()
    seconds = time.perf_counter() - t0

    summary = {
        "steps": step,
        "trainable_parameters": int(trainable),
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "train_seconds": seconds,
        "final_loss": losses[-1][1] if losses else None,
        "losses": losses,
        "world_size": world,
        "main": main,
    }
    if cfg.distributed:
        summary["reduce_ms_per_step"] = 1e3 * reduce_s / max(step, 1)
        summary["reduce_bytes"] = trainer.reduce_bytes
    error = None
    if main:  # rank 0 alone writes; the parameters are the same bits on every rank
        try:
            _write_outputs(cfg, model, summary)
        except Exception as e:
            if not cfg.distributed:
                raise
            error = e
    if cfg.distributed:  # every rank learns whether rank 0's writes succeeded
        from ..distributed import DistributedError

        failed = dp.context.comm.bcast(
            None if error is None else f"{type(error).__name__}: {error}"
        )
        if error is not None:
            raise error
        if failed is not None:
            raise DistributedError(f"rank 0 failed writing {cfg.out}: {failed}", {0: failed})
    return summary


def _write_outputs(cfg: FinetuneConfig, model, summary: dict) -> None:
    """The output folder (module docstring) of a trained ``model``; adds its paths to
    ``summary``."""
    from ..nn import lora
    from .plotting import plot_losses

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    losses = summary["losses"]
    if cfg.lora:
        lora.save_lora(model, out / "adapter")
        summary["adapter"] = str(out / "adapter")
        if cfg.merge:
            lora.merge_lora(model)
    if not cfg.lora or cfg.merge:
        model.save_pretrained(out / "model")
        summary["model"] = str(out / "model")
    title = f"meganeura finetune ({f'LoRA r={cfg.lora_r}' if cfg.lora else 'full'})"
    if plot_losses(losses, out / "loss.png", title, window=max(1, len(losses) // 10)):
        summary["loss_plot"] = str(out / "loss.png")
    meta = {"config": asdict(cfg), **{k: v for k, v in summary.items() if k != "losses"}}
    from ..io.checkpoint import write_atomic

    write_atomic(out / "finetune.json", (json.dumps(meta, indent=2, default=str) + "\n").encode())
