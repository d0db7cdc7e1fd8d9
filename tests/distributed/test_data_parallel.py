"""Data-parallel training on MPI (issue 17 item 4): ``mpiexec -n N`` runs of
``tests.distributed.worker`` against one process on the concatenated batch.

The reference is an ordinary ``Trainer`` in this process on each whole global batch (what
``DistributedTrainer`` must equal: the mean of the ranks' equal-shard means is the global
batch's mean), with the overlapped bucketed reduce (issue 17 item 2: the same bits as
without); for BatchNorm, one process with one micro-batch per rank (PyTorch DDP's local-batch
statistics) and rank 0's running statistics. Skipped, with the reason, where mpi4py or
mpiexec is missing; ``make setup`` installs both (the ``distributed`` extra), so they run in
CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meganeura.io.checkpoint import load_checkpoint
from meganeura.optim import AdamW
from meganeura.training import Trainer
from tests.distributed.workloads import (
    CONFIGS,
    STEPS,
    batches,
    loss_fn,
    make_bn_model,
    make_model,
)

pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'meganeura[distributed]')")
MPIEXEC = shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
if MPIEXEC is None:
    pytest.skip("no mpiexec on PATH (the mpich wheel provides one)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-6


def _mpiexec(n: int, mode: str, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "tests.distributed.worker", mode, str(out)]
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


_REFERENCE: dict = {}


def _reference(name: str, ranks: int) -> tuple[np.ndarray, dict]:
    """(losses f64[STEPS], state dict) of one process on the whole global batches."""
    make_opt, clip, k = CONFIGS[name]
    key = (name, k * ranks if k > 1 else 1)
    if key not in _REFERENCE:
        kwargs = dict(max_grad_norm=clip, accumulation_steps=key[1])
        with Trainer(make_model(), make_opt(), loss_fn, **kwargs) as t:
            losses = [t.step(x, y) for x, y in batches()]
            _REFERENCE[key] = (np.asarray(losses), t.state_dict())
    return _REFERENCE[key]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (the tensor's relative error; 0 for two zero tensors)."""
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / scale if scale else float(np.max(np.abs(a)))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3], ids=["ranks2", "ranks3"])
def test_equals_one_process_on_the_concatenated_batch(ranks, gpu_device, tmp_path):
    run = _mpiexec(ranks, "parity", tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    got = np.load(tmp_path / "parity.npz")
    assert int(got["world_size"]) == ranks
    assert bool(got["identical"]), "ranks ended with different parameters or optimizer state"
    assert bool(got["resume_identical"]), "a resumed run did not continue bit-identically"
    # the shared-memory reduce ("auto" on one host) sums in rank order whatever the vector's
    # length: float32 results with and without overlap are the same bits at any rank count
    assert bool(got["overlap_same_bits"]), "the overlapped reduce changed the results"
    assert bool(got["shm_exact"]), "the shared-memory reduce is not the rank-order sum"
    assert bool(got["hierarchical_exact"]), "the multi-host shared-memory reduce is wrong"
    assert bool(got["f64_overlap_same_bits"]), "float64 reduce: overlap changed the results"
    assert int(got["buckets"]) == 2, "the overlapped runs did not reduce in 2 buckets"
    # BatchNorm, as PyTorch DDP without SyncBatchNorm: each rank normalizes with its local
    # batch's statistics, so the update equals one process accumulating one micro-batch per
    # rank; the running statistics are rank 0's (after step 1: those of one process on
    # rank 0's shard), the same bits on every rank (got["identical"])
    with Trainer(
        make_bn_model(), AdamW(lr=1e-2, weight_decay=0.01), loss_fn, accumulation_steps=ranks
    ) as t:
        for x, y in batches():
            t.step(x, y)
        for key, want in t.state_dict().items():
            if key.endswith("num_batches_tracked"):  # rank 0's forwards: one per step
                assert int(got[f"bn/{key}"]) == STEPS, key
            elif "running_" not in key:
                rel = _rel(got[f"bn/{key}"], want)
                assert rel <= RTOL, f"BatchNorm model: {key} differs by {rel:.2e} (relative)"
    with Trainer(make_bn_model(), AdamW(lr=1e-2, weight_decay=0.01), loss_fn) as t:
        x, y = batches()[0]
        t.step(x[: len(x) // ranks], y[: len(y) // ranks])
        for key, want in t.model.state_dict().items():
            if "running_" in key:
                np.testing.assert_allclose(got[f"bn1/{key}"], want, rtol=RTOL, atol=1e-7)
    assert bool(got["nan_step_skipped_everywhere"]), "a NaN on one rank was not skipped on all"
    # dropout: one mask per rank (distinct local losses), repeatable under the seed
    local = got["dropout_local_losses"]
    assert len(set(local.tolist())) == ranks, f"ranks drew the same dropout masks: {local}"
    assert bool(got["dropout_repeats"]), "a run with dropout did not repeat bit for bit"
    # reduce="mpi" against the shared-memory reduce: within rounding (MPI's order may differ)
    for name in ("adamw_mpi0", "adamw_mpi1"):
        for key in ["losses", *_reference("adamw", ranks)[1]]:
            rel = _rel(got[f"{name}/{key}"], got[f"adamw/{key}"])
            assert rel <= RTOL, f"{name}: {key} differs from the shm reduce by {rel:.2e}"
    for name in [*CONFIGS, "adamw_f64", "adamw_mpi0", "adamw_mpi1"]:
        losses, sd = _reference(name.removesuffix("_f64").split("_mpi")[0], ranks)
        np.testing.assert_allclose(got[f"{name}/losses"], losses, rtol=RTOL, err_msg=name)
        assert len(got[f"{name}/losses"]) == STEPS
        for key, want in sd.items():
            rel = _rel(got[f"{name}/{key}"], want)
            assert rel <= RTOL, f"{name}: {key} differs by {rel:.2e} (relative)"


@pytest.mark.gpu
def test_a_full_dev_shm_falls_back_to_mpi_on_every_rank(gpu_device, tmp_path):
    run = _mpiexec(2, "shm_full", tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    got = np.load(tmp_path / "shm_full.npz")
    assert str(got["auto/via"]) == "mpi" and bool(got["auto/warned"])
    assert str(got["mpi/via"]) == "mpi" and not bool(got["mpi/warned"])
    np.testing.assert_array_equal(got["auto/losses"], got["mpi/losses"])
    assert bool(got["shm_raised_everywhere"]), "reduce='shm' did not raise on every rank"


@pytest.mark.gpu
def test_a_failing_rank_stops_every_rank_and_keeps_the_checkpoint(gpu_device, tmp_path):
    run = _mpiexec(2, "failure", tmp_path)
    assert run.returncode != 0
    for r in (0, 1):
        caught = tmp_path / f"caught-{r}.txt"
        assert caught.exists(), f"rank {r} did not raise DistributedError: {run.stderr[-4000:]}"
        message = caught.read_text()
        assert "step 2 failed on 1 of 2 ranks (rank 1: " in message, message
        assert "InputError: input 'y': class index 99" in message, message
    tensors, meta = load_checkpoint(tmp_path / "ckpt.safetensors")
    assert meta["at"] == 1 and meta["step"] == 2
    # the checkpoint holds the parameters after 2 steps: those of one process after 2 steps
    with Trainer(make_model(), AdamW(lr=1e-2), loss_fn) as t:
        for x, y in batches()[:2]:
            t.step(x, y)
        for key, want in t.model.state_dict().items():
            assert _rel(tensors[key], want) <= RTOL, key


@pytest.mark.gpu
def test_an_exception_outside_a_step_aborts_the_job(gpu_device, tmp_path):
    run = _mpiexec(2, "abort", tmp_path, timeout=120)  # a hang would raise TimeoutExpired
    shown = f"rc {run.returncode}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-4000:]}"
    assert run.returncode != 0, shown
    # The traceback reaches us through mpiexec's stdio forwarding, which Abort may cut short:
    # once in CI under load nothing at all came through (rc 1, empty stdout and stderr). The
    # job stopping and the checkpoint are what this test holds; an error's message on every
    # rank is held by the in-step failure test above, which reports through the allgather.
    if run.stderr.strip():
        assert "RuntimeError: rank 1 lost its data loader" in run.stderr, shown
    assert not list(tmp_path.glob("finished-*")), shown
    _, meta = load_checkpoint(tmp_path / "ckpt.safetensors")
    assert meta["at"] == 1 and meta["step"] == 2


@pytest.mark.gpu
def test_train_mnist_distributed_equals_one_process(gpu_device, tmp_path):
    """``mpiexec -n 2 meganeura train mnist --distributed``: the checkpoint after one epoch of
    8 steps (global batch 500, halves per rank) equals the recipe run in one process."""
    from meganeura.recipes.mnist import MnistConfig, train

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    flags = ["--epochs", "1", "--batch-size", "500", "--log-every", "1", "--no-progress"]
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "meganeura", "train", "mnist"]
    cmd += [*flags, "--distributed", "--out", str(tmp_path / "dist")]
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("test accuracy:") == 1  # rank 0 alone reports
    assert "distributed: 2 ranks" in run.stdout, run.stdout
    cfg = MnistConfig(epochs=1, batch_size=500, log_every=1, out=str(tmp_path / "one"))
    train(cfg, device=gpu_device, progress=False)
    got, meta = load_checkpoint(tmp_path / "dist" / "checkpoint.safetensors")
    want, want_meta = load_checkpoint(tmp_path / "one" / "checkpoint.safetensors")
    assert meta["step"] == want_meta["step"] == 8  # 4,000 training images
    np.testing.assert_allclose(
        [v for _, v in meta["losses"]], [v for _, v in want_meta["losses"]], rtol=RTOL
    )
    assert got.keys() == want.keys()
    # 1e-5, not 1e-6: over 8 AdamW steps, m / sqrt(v) of weights whose gradient is near
    # zero (MNIST's border pixels) amplifies the float32 rounding difference between the mean
    # over 500 rows and the mean of two means over 250 (measured: 2.3e-6 on fc1.weight).
    for key, value in want.items():
        assert _rel(got[key], value) <= 1e-5, f"{key} differs by {_rel(got[key], value):.2e}"


@pytest.mark.gpu
def test_train_resnet_distributed_equals_local_batch_statistics(gpu_device, tmp_path, monkeypatch):
    """``mpiexec -n 2 meganeura train resnet --distributed`` on a tiny ImageFolder: rank 0 alone
    reports, and the parameters equal one process taking each rank's shard as a micro-batch
    (``accumulation_steps=2``: BatchNorm over each shard, gradients averaged, as PyTorch DDP
    without SyncBatchNorm). Running statistics are left out: DDP keeps rank 0's, the
    one-process run updates them once per micro-batch."""
    pytest.importorskip("PIL.Image")
    from meganeura.recipes import resnet as recipe
    from meganeura.recipes.common import adamw_trainer
    from tests.recipes.test_resnet_recipe import _image_folder

    data = _image_folder(tmp_path / "images", per_class=5)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    flags = ["--data", str(data), "--width", "4", "--image-size", "16", "--epochs", "1"]
    flags += ["--batch-size", "4", "--log-every", "1", "--no-progress", "--lr", "1e-2"]
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "meganeura", "train", "resnet"]
    cmd += [*flags, "--distributed", "--out", str(tmp_path / "dist")]
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("held-out accuracy:") == 1, run.stdout  # rank 0 alone reports
    assert "distributed: 2 ranks" in run.stdout, run.stdout

    def two_micro_batches(*args, **kw):
        return adamw_trainer(*args, **kw, accumulation_steps=2)

    monkeypatch.setattr(recipe, "adamw_trainer", two_micro_batches)
    cfg = recipe.ResNetTrainConfig(  # the CLI's defaults where they differ (schedule)
        data=str(data),
        width=4,
        image_size=16,
        epochs=1,
        batch_size=4,
        log_every=1,
        lr=1e-2,
        schedule="constant",
        out=str(tmp_path / "one"),
    )
    recipe.train(cfg, device=gpu_device, progress=False)
    got, meta = load_checkpoint(tmp_path / "dist" / "checkpoint.safetensors")
    want, want_meta = load_checkpoint(tmp_path / "one" / "checkpoint.safetensors")
    assert meta["epoch"] == want_meta["epoch"] == 1
    np.testing.assert_allclose(
        [v for _, v in meta["losses"]], [v for _, v in want_meta["losses"]], rtol=1e-5
    )
    from meganeura.random import manual_seed

    manual_seed(cfg.seed)  # the recipe's initialization: training moved the parameters
    init = recipe.build_model("resnet18", 2, 4).state_dict()
    stats = ("running_mean", "running_var", "num_batches_tracked")
    params = [k for k in init if not k.endswith(stats)]
    assert len(params) > 20 and got.keys() == want.keys()
    # AdamW's moments too: the same gradients went in on both sides
    params += [k for k in want if k.startswith("optimizer/") and "running_" not in k]
    assert max(_rel(want[k], np.asarray(init[k])) for k in init if k in params) > 1e-3
    for key in params:
        assert _rel(got[key], want[key]) <= 1e-5, (
            f"{key} differs by {_rel(got[key], want[key]):.2e}"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_finetune_distributed_equals_one_process(mode, gpu_device, tmp_path):
    """``mpiexec -n 2 meganeura finetune --distributed`` on the LLM CLI tests' 2-layer model:
    rank 0 alone reports and writes, and the written model (LoRA: merged, and the adapters)
    equals the recipe run in one process on the same global batches of 4 windows (Llama has
    no BatchNorm: the mean of the two ranks' means over 2 windows is the mean over 4)."""
    from safetensors.numpy import load_file

    from meganeura.recipes.finetune import FinetuneConfig, finetune
    from tests.recipes.test_llm_cli import TEXT, make_small_folder

    folder = make_small_folder(tmp_path / "base")
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    lora = ["--lora"] if mode == "lora" else []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    flags = ["--model", str(folder), "--data", str(data), "--seq-len", "16", "--batch-size", "4"]
    flags += ["--max-steps", "3", "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "1"]
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "meganeura", "finetune", *flags, *lora]
    cmd += ["--no-progress", "--distributed", "--out", str(tmp_path / "dist")]
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("3 steps, final loss") == 1, run.stdout  # rank 0 alone reports
    assert "distributed: 2 ranks" in run.stdout, run.stdout
    cfg = FinetuneConfig(
        model=str(folder),
        data=str(data),
        out=str(tmp_path / "one"),
        lora=mode == "lora",
        max_steps=3,
        batch_size=4,
        seq_len=16,
        lr=1e-2,
        warmup_steps=1,
        log_every=1,
    )
    want_summary = finetune(cfg, device=gpu_device, progress=False)
    got_summary = json.loads((tmp_path / "dist" / "finetune.json").read_text())
    assert got_summary["world_size"] == 2 and got_summary["steps"] == 3
    np.testing.assert_allclose(got_summary["final_loss"], want_summary["final_loss"], rtol=1e-5)
    files = ["model/model.safetensors"] + (["adapter/adapter_model.safetensors"] if lora else [])
    # 5e-5, not 1e-6: over 3 AdamW steps at lr 1e-2, m / sqrt(v) of weights whose gradient is
    # near zero amplifies the float32 rounding difference between the mean over 4 windows and
    # the mean of two means over 2 (measured: 2.1e-5 on layers.1.mlp.up_proj.weight, 1.5e-5 on
    # a lora_A; every frozen weight of the LoRA run the same bits)
    for name in files:
        got = load_file(tmp_path / "dist" / name)
        want = load_file(tmp_path / "one" / name)
        assert got.keys() == want.keys() and got, name
        for key, value in want.items():
            rel = _rel(got[key], value)
            assert rel <= 5e-5, f"{name}: {key} differs by {rel:.2e} (relative)"
    init = load_file(folder / "model.safetensors")
    want = load_file(tmp_path / "one" / files[0])
    assert max(_rel(want[k], v) for k, v in init.items()) > 1e-3, "training moved nothing"


def test_finetune_distributed_rejects_a_batch_the_ranks_do_not_divide(tmp_path, monkeypatch):
    """A global batch of 4 windows over 3 ranks is refused before the model is read."""
    import meganeura.distributed as dist
    from meganeura.recipes.finetune import FinetuneConfig, finetune

    monkeypatch.setattr(dist, "init", lambda *a, **k: dist.Context(None, 0, 3, 0, None))
    data = tmp_path / "data.txt"
    data.write_text("some text")
    cfg = FinetuneConfig(model=str(tmp_path / "none"), data=str(data), distributed=True)
    with pytest.raises(ValueError, match="--batch-size 4 must be divisible by the 3 ranks"):
        finetune(cfg, progress=False)
