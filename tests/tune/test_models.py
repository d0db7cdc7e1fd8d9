"""The built-in models of ``meganeura tune`` (``tune.models``): each compiles at its workload
size and lists the products the benchmark runs; ``--dry-run`` lists them without timing or
writing, ``--workloads`` tunes the five workloads' products once each under one budget.

Nothing here times a plan except the last test (one tiny product, two plans); each test compiles
programs (no kernel runs), seconds on lavapipe.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.cli import main
from meganeura.training import device_limits
from meganeura.tune import shapes_of
from meganeura.tune.models import SIZES, WORKLOADS, conv_dispatches, model_programs

# distinct products of the training step + forward at the workload size, and how many of them
# the forward has; unet is convolutions only (conv2d gemm kernels, not matmuls)
EXPECTED = {
    "smolvla": (27, 10),
    "resnet50": (3, 1),  # the classifier; the 53 convolutions are conv2d gemm kernels
    "whisper": (12, 3),
    "unet": (0, 0),
}
# a product of each, from docs/workloads.md's sizes (TUNED's keys where it has them)
SAMPLE = {
    "smolvla": (50, 720, 960, "nt", 1),  # q_proj of 50 action tokens
    "resnet50": (4, 2048, 1000, "nt", 1),  # fc on batch 4
    "whisper": (1500, 384, 64, "nt", 1),  # the training head over 1500 positions
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dry_run_lists_a_workload_models_products(name, gpu_device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    assert main(["tune", name, "--dry-run"]) == 0
    out = capsys.readouterr().out
    products, forward = EXPECTED[name]
    head = next(line for line in out.splitlines() if line.startswith(f"{name} ("))
    assert f"train, forward): {products} distinct products" in head
    if name in SAMPLE:
        m, k, n, layout, batch = SAMPLE[name]
        assert f"  {m},{k},{n},{layout},{batch} " in out
    if name in ("resnet50", "unet"):
        assert "conv2d dispatches (not matmuls: not tuned)" in head
    assert f"{products} distinct products" in out.splitlines()[-1]
    assert not (tmp_path / "tuning").exists()  # a dry run writes nothing

    programs = model_programs(name, device_limits(gpu_device), modes=("forward",))
    assert len(shapes_of(programs.values())) == forward
    if products == 0:
        assert conv_dispatches(programs["forward"]) > 0


@pytest.mark.gpu
def test_workloads_dry_run_counts_each_product_once(gpu_device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    assert main(["tune", "--workloads", "whisper,unet,whisper", "--forward", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [line for line in out if line.startswith(("whisper (", "unet ("))]
    assert heads[0].startswith("whisper (batch 1, layers 4; forward): 3 distinct products, 3 not")
    assert "0 distinct products" in heads[1]
    assert heads[2].endswith("3 distinct products, 0 not seen before; 2 conv2d dispatches "
                             "(not matmuls: not tuned)")  # fmt: skip
    assert out[-1].startswith("3 distinct products, ")


@pytest.mark.gpu
def test_sizes_default_to_the_workload_cells_and_are_checked(gpu_device, capsys):
    assert set(WORKLOADS) <= set(SIZES) and SIZES["whisper"] == {"batch": 1, "layers": 4}
    limits = device_limits(gpu_device)
    shapes = shapes_of(model_programs("whisper", limits, batch=2, layers=1).values())
    assert (3000, 384, 384, "nt", 1) in shapes  # two clips of 1500 positions, batch folded
    with pytest.raises(ValueError, match=r"unet takes the sizes \['batch'\], not \['seq'\]"):
        model_programs("unet", limits, seq=4)
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        model_programs("resnet50", limits, batch=0)
    assert main(["tune", "resnet50", "--seq-len", "3", "--dry-run"]) == 2
    assert "resnet50 takes no --seq-len (its sizes: --batch-size)" in capsys.readouterr().err
    assert main(["tune", "--workloads", "--batch-size", "2", "--dry-run"]) == 2
    assert "give --batch-size with one MODEL" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("wid", ["w2", "w3", "w4", "w5"])
def test_the_shapes_are_those_the_benchmark_compiles(wid, gpu_device):
    """bench/workloads.py's own models and inputs (its headline forward and training cells)
    compile to the products ``meganeura tune`` lists for the workload."""
    from bench.workloads_lib.registry import WORKLOADS as BENCH
    from meganeura import nn
    from meganeura.compile import CompileOptions, compile
    from meganeura.nn.compiled import trace_call
    from meganeura.nn.parameter import Parameter
    from meganeura.optim import SGD

    wl = BENCH[wid]
    if wl.missing():
        pytest.skip(wl.missing())
    name = {"w2": "smolvla", "w3": "resnet50", "w4": "whisper", "w5": "unet"}[wid]
    limits = device_limits(gpu_device)
    fwd, train = (wl.case(wl.paper[k][0], False) for k in ("fwd", "train"))
    got = []
    with nn.init.empty_weights():
        for case in (train, fwd):
            model = wl.build_ours(case, False)
            batch = tuple(np.asarray(a) for a in wl.batch(case, False))
            fn = _loss_fn(wl, model) if case.trains else wl.ours_forward_fn(model)
            traced = trace_call(model, fn, batch, {})
            trainable = tuple(
                n
                for n, o in traced.trace.objects.items()
                if isinstance(o, Parameter) and o.requires_grad
            )
            options = (
                CompileOptions(loss="loss", optimizer=SGD(lr=1e-5), trainable=trainable)
                if case.trains
                else CompileOptions()
            )
            got.append(compile(traced.graph, options, limits))
    assert shapes_of(got) == shapes_of(model_programs(name, limits).values())


def _loss_fn(wl, model):
    def fn(*batch):  # what Trainer traces: the loss of the batch
        return {"loss": wl.ours_loss(model, *batch)}

    return fn


@pytest.mark.gpu
def test_tuning_prints_a_line_per_product_as_it_goes(gpu_device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    argv = ["tune", "--shapes", "16,64,32,nn", "3,64,48,nt", "--plans", "64x64x16/np",
            "--repeats", "1", "--warmup", "0", "--budget-s", "60"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "tuning 2 products"
    assert lines[2].startswith("[1/2] 16,64,32,nn,1 ") and lines[3].startswith("[2/2] 3,64,48,nt")
    assert all(" us -> " in line and " plans, " in line for line in lines[2:4])
    assert (tmp_path / "tuning").is_dir()  # saved (without --no-save)
