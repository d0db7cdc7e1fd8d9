"""``CompileOptions.loss_scale``: a static loss scale for the fast mode's f16 activation
gradients (Micikevicius et al. 2018, section 3.2; torch.amp.GradScaler with a fixed scale).

A two-layer MLP whose loss is ``1e-7 * mse``: its activation gradients (~1e-10) lie below
f16's smallest subnormal (6e-8), so unscaled fast-mode gradients flush to zero, while a scale
of 2**24 brings them back to float64 torch's. In strict f32 any exact scale gives the same
bits (outputs, a clipped AdamW step, its ``grad_norm``). A scale that overflows f16 trips the
non-finite guard and leaves the parameters as they were. Both trainers take the scale.

Dynamic (``GradScaler``, ``optim.scaler``): the scale backs off after an overflow and grows
after ``growth_interval`` clean steps as torch.amp.GradScaler's does, on the GPU; a strict run
through an overflow gives the unscaled run's parameters bit for bit; a Trainer's programs
share one scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura import nn
from meganeura.compile import CompileOptions, grad_output
from meganeura.optim import SGD, AdamW, GradScaler
from meganeura.optim.apply import HYPER_INPUT
from meganeura.optim.guard import GUARD_OUTPUT, GUARD_RESET_INPUT
from meganeura.training import compile_for

TINY = 1e-7  # the loss factor that puts the activation gradients below f16's range


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _fresh(seed: int):
    """(a new _MLP, x f32[16, 32], y f32[16, 8]), seeded."""
    mn.manual_seed(seed)
    model = _MLP()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    return model, x, rng.standard_normal((16, 8)).astype(np.float32)


def _case(seed: int = 0):
    model, x, y = _fresh(seed)
    graph = nn.trace(model, x, y, fn=lambda x, y: {"loss": F.mse_loss(model(x), y) * TINY})
    params = {k: np.array(v) for k, v in model.state_dict().items()}
    return graph, params, {"x": x, "y": y}


def _torch_grads(params, feeds) -> dict[str, np.ndarray]:
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    x, y = (torch.tensor(feeds[k], dtype=torch.float64) for k in ("x", "y"))
    h = torch.relu(x @ p["fc1.weight"].T + p["fc1.bias"])
    loss = torch.nn.functional.mse_loss(h @ p["fc2.weight"].T + p["fc2.bias"], y) * TINY
    loss.backward()
    return {k: v.grad.numpy() for k, v in p.items()}


def _grads(graph, params, feeds, device, **options) -> dict[str, np.ndarray]:
    opts = CompileOptions(loss="loss", output_grads=True, shared_parameters=True, **options)
    program, session = compile_for(graph, opts, device)
    with session:
        session.load_state_dict(params, strict=False)
        out = session.run(feeds, [grad_output(k) for k in params])
    return {k: out[grad_output(k)] for k in params}


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    n = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / n) if n else 0.0


@pytest.mark.gpu
def test_fast_mode_gradients_underflow_without_a_scale_and_not_with_one(gpu_device):
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    graph, params, feeds = _case()
    want = _torch_grads(params, feeds)
    assert all(np.abs(g).max() > 1e-9 for g in want.values())
    plain = _grads(graph, params, feeds, gpu_device, precision="fast")
    scaled = _grads(graph, params, feeds, gpu_device, precision="fast", loss_scale=2.0**24)
    strict = _grads(graph, params, feeds, gpu_device, loss_scale=2.0**24)
    for k, g in want.items():
        # unscaled: fc1's gradients come from an f16 activation gradient that is all zeros
        assert _cos(scaled[k], g) >= 0.999, (k, _cos(scaled[k], g))
        np.testing.assert_allclose(strict[k], g, rtol=1e-4, atol=1e-6 * np.abs(g).max())
    assert not np.any(plain["fc1.weight"]) and not np.any(plain["fc1.bias"])


@pytest.mark.gpu
def test_strict_results_do_not_depend_on_an_exact_scale(gpu_device):
    graph, params, feeds = _case(1)
    one = _grads(graph, params, feeds, gpu_device)
    many = _grads(graph, params, feeds, gpu_device, loss_scale=2.0**12)
    for k in params:
        np.testing.assert_array_equal(many[k], one[k])
    # one clipped AdamW step: the same parameters and grad_norm, bit for bit
    after, norms = [], []
    for scale in (1.0, 2.0**12):
        opt = AdamW(lr=1e-2)
        options = CompileOptions(
            loss="loss", optimizer=opt, max_grad_norm=1e-8, loss_scale=scale, nonfinite_guard="skip"
        )
        program, session = compile_for(graph, options, gpu_device)
        with session:
            session.load_state_dict(params, strict=False)
            hyper = opt.hyper(1, opt.lr)
            run_feeds = {**feeds, HYPER_INPUT: hyper, GUARD_RESET_INPUT: np.float32(1)}
            out = session.run(run_feeds, ["grad_norm", GUARD_OUTPUT])
            assert out[GUARD_OUTPUT] == 0
            norms.append(float(out["grad_norm"]))
            after.append({k: session.read(k) for k in params})
    assert norms[0] == norms[1] > 0
    for k in params:
        np.testing.assert_array_equal(after[1][k], after[0][k])
        assert not np.array_equal(after[0][k], params[k])


@pytest.mark.gpu
def test_an_overflowing_scale_trips_the_guard_and_keeps_the_parameters(gpu_device):
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    graph, params, feeds = _case(2)
    opt = AdamW(lr=1e-2)
    options = CompileOptions(
        loss="loss", optimizer=opt, precision="fast", loss_scale=2.0**60, nonfinite_guard="skip"
    )
    program, session = compile_for(graph, options, gpu_device)
    with session:
        session.load_state_dict(params, strict=False)
        run_feeds = {**feeds, HYPER_INPUT: opt.hyper(1, opt.lr), GUARD_RESET_INPUT: np.float32(1)}
        assert session.run(run_feeds, [GUARD_OUTPUT])[GUARD_OUTPUT] == 1
        for k in params:
            np.testing.assert_array_equal(session.read(k), params[k])


@pytest.mark.parametrize(
    "scale", [3.0, 0.0, -2.0, float("inf"), float("nan"), True, "2", 2.0**128, 2.0**-127]
)
def test_loss_scale_must_be_a_power_of_two_f32_holds(scale):
    with pytest.raises(ValueError, match="loss_scale must be a power of two from 2..-126"):
        CompileOptions(loss="loss", loss_scale=scale)


def test_loss_scale_takes_numpy_scalars_and_scales_below_one():
    assert CompileOptions(loss="loss", loss_scale=np.float32(1024)).loss_scale == 1024.0
    assert type(CompileOptions(loss="loss", loss_scale=np.int64(8)).loss_scale) is float
    CompileOptions(loss="loss", loss_scale=2.0**-3)
    assert GradScaler(init_scale=np.float32(256), growth_interval=np.int64(10)) == GradScaler(
        init_scale=256.0, growth_interval=10
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "scale",
    [1.0, 2.0**24, GradScaler(init_scale=2.0**24)],
    ids=["unscaled", "static", "dynamic"],
)
def test_trainer_takes_the_scale(gpu_device, scale):
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")
    _, params, feeds = _case(3)
    want = _torch_grads(params, feeds)
    mn.manual_seed(3)
    model = _MLP()
    lr = 1e6  # the gradients are ~1e-9: a step of ~1e-3 stays visible in f32 weights

    def loss_fn(m, x, y):
        return F.mse_loss(m(x), y) * TINY

    tr = mn.Trainer(
        model, SGD(lr=lr), loss_fn, precision="fast", loss_scale=scale, device=gpu_device
    )
    tr.step(feeds["x"], feeds["y"])
    after = {k: np.array(v) for k, v in model.state_dict().items()}
    got = {k: (params[k].astype(np.float64) - after[k]) / lr for k in params}
    if scale == 1.0:
        assert not np.any(got["fc1.weight"])  # its f16 activation gradient flushed to zero
    else:
        for k, g in want.items():
            assert _cos(got[k], g) >= 0.999, (k, _cos(got[k], g))


def test_distributed_trainer_refuses_a_scale():
    # its update program's surrogate loss would scale the reduced gradients a second time
    from meganeura.distributed.trainer import DistributedTrainer

    with pytest.raises(ValueError, match="does not take a loss_scale"):
        DistributedTrainer(_MLP(), SGD(lr=1.0), lambda m, x, y: F.mse_loss(m(x), y), loss_scale=2.0)


# ---- dynamic: GradScaler's policy on the GPU (optim.scaler) --------------------------------


def _run(graph, params, feeds, device, loss_scale, steps, max_grad_norm=1e9):
    """(parameters after each step, the ``loss_scale`` output of each step, guard counts)."""
    opt = SGD(lr=0.1)
    options = CompileOptions(
        loss="loss",
        optimizer=opt,
        max_grad_norm=max_grad_norm,  # 1e9: no clipping, but S**2 overflows the sum of squares
        loss_scale=loss_scale,
        nonfinite_guard="raise",
    )
    after, scales, skipped = [], [], []
    program, session = compile_for(graph, options, device)
    with session:
        session.load_state_dict(params, strict=False)
        fetch = [GUARD_OUTPUT] + (["loss_scale"] if isinstance(loss_scale, GradScaler) else [])
        for step in range(steps):
            hyper = opt.hyper(step, opt.lr)
            run = {**feeds, HYPER_INPUT: hyper, GUARD_RESET_INPUT: np.float32(1)}
            out = session.run(run, fetch)
            skipped.append(float(out[GUARD_OUTPUT]))
            scales.append(float(out.get("loss_scale", 1.0)))
            after.append({k: session.read(k) for k in params})
    return after, scales, skipped


@pytest.mark.gpu
def test_dynamic_scale_backs_off_grows_and_keeps_strict_bits(gpu_device):
    model, x, y = _fresh(4)
    feeds = {"x": x, "y": y}
    graph = nn.trace(model, x, y, fn=lambda x, y: {"loss": F.mse_loss(model(x), y)})
    params = {k: np.array(v) for k, v in model.state_dict().items()}
    # 2**100: the gradients' sum of squares (2**200 times theirs) overflows f32 at step 0
    scaler = GradScaler(init_scale=2.0**100, backoff_factor=2.0**-64, growth_interval=2)
    got, scales, skipped = _run(graph, params, feeds, gpu_device, scaler, 5)
    want, _, _ = _run(graph, params, feeds, gpu_device, 1.0, 4)
    # GradScaler.update: backoff after the skipped step, growth after every 2 clean ones
    assert [np.log2(s) for s in scales] == [36, 36, 37, 37, 38]
    assert skipped == [0] * 5  # an overflow is the scaler's business, not the guard's count
    for k in params:
        np.testing.assert_array_equal(got[0][k], params[k])  # the skipped step wrote nothing
        for i in range(4):  # then the unscaled run's steps, bit for bit
            np.testing.assert_array_equal(got[i + 1][k], want[i][k])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 3.0},
        {"init_scale": 0.0},
        {"growth_factor": 1.0},
        {"growth_factor": 0.5},
        {"backoff_factor": 2.0},
        {"backoff_factor": 0.3},
        {"growth_interval": 0},
        {"growth_interval": 2.5},
        {"growth_interval": 2**24 + 1},
        {"init_scale": 2.0**128},
        {"growth_factor": 2.0**128},
        {"backoff_factor": 2.0**-127},
    ],
    ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()),
)
def test_grad_scaler_rejects_what_would_not_scale_exactly(kwargs):
    with pytest.raises(ValueError, match="GradScaler"):
        GradScaler(**kwargs)


def test_a_dynamic_scale_needs_an_update_step_and_the_guard():
    with pytest.raises(ValueError, match="needs an optimizer"):
        CompileOptions(loss="loss", output_grads=True, loss_scale=GradScaler())
    with pytest.raises(ValueError, match="needs an optimizer"):
        CompileOptions(
            loss="loss", optimizer=SGD(lr=1.0), accumulation_steps=2, loss_scale=GradScaler()
        )
    with pytest.raises(ValueError, match="needs nonfinite_guard"):
        CompileOptions(loss="loss", optimizer=SGD(lr=1.0), loss_scale=GradScaler())


@pytest.mark.gpu
def test_the_trainers_programs_share_one_dynamic_scale(gpu_device):
    # step 0 (the plain program) overflows at 2**100 and backs off to 2**36; step 1 runs the
    # return_grads program, which must start from 2**36 (its own scale would be 2**100 again
    # and skip that step too); on_nonfinite="raise" raises for neither
    model, x, y = _fresh(6)
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    scaler = GradScaler(init_scale=2.0**100, backoff_factor=2.0**-64)
    with mn.Trainer(
        model,
        SGD(lr=0.1),
        lambda m, x, y: F.mse_loss(m(x), y),
        max_grad_norm=1e9,
        loss_scale=scaler,
        device=gpu_device,
    ) as tr:
        tr.step(x, y)
        skipped = {k: np.array(v) for k, v in model.state_dict().items()}
        _, grads = tr.step(x, y, return_grads=True)
        tr.check_nonfinite()
        evaluated = tr.evaluate(x, y)  # the eval program compiles without the scale
    after = {k: np.array(v) for k, v in model.state_dict().items()}
    h = np.maximum(x @ after["fc1.weight"].T + after["fc1.bias"], 0)
    mse = float(np.mean((h @ after["fc2.weight"].T + after["fc2.bias"] - y) ** 2))
    assert evaluated == pytest.approx(mse, rel=1e-5)
    want = _torch_grads_unscaled(before, x, y)
    for k in before:
        np.testing.assert_array_equal(skipped[k], before[k])
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(after[k], before[k] - 0.1 * want[k], rtol=1e-5, atol=1e-6)


def _torch_grads_unscaled(params, x, y) -> dict[str, np.ndarray]:
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    h = torch.relu(torch.tensor(x, dtype=torch.float64) @ p["fc1.weight"].T + p["fc1.bias"])
    out = h @ p["fc2.weight"].T + p["fc2.bias"]
    torch.nn.functional.mse_loss(out, torch.tensor(y, dtype=torch.float64)).backward()
    return {k: v.grad.numpy() for k, v in p.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_step_the_scaler_skips_does_not_count_for_adam(gpu_device, on_nonfinite):
    # as a skipped optimizer.step leaves PyTorch's step count: Adam's bias correction of the
    # first applied step is that of step 1, so the run equals the unscaled one bit for bit
    runs = []
    for scale in (GradScaler(init_scale=2.0**100, backoff_factor=2.0**-64), 1.0):
        model, x, y = _fresh(7)
        with mn.Trainer(
            model,
            AdamW(lr=1e-2),
            lambda m, x, y: F.mse_loss(m(x), y),
            max_grad_norm=1e9,
            loss_scale=scale,
            on_nonfinite=on_nonfinite,
            device=gpu_device,
        ) as tr:
            counts = []
            for _ in range(3 if scale == 1.0 else 4):
                tr.step(x, y)
                counts.append(tr.step_count)
            assert tr.skipped_steps == 0  # the scaler's skips are not the guard's
        runs.append(({k: np.array(v) for k, v in model.state_dict().items()}, counts))
    (scaled, scaled_counts), (plain, plain_counts) = runs
    assert scaled_counts == [0, 1, 2, 3] and plain_counts == [1, 2, 3]
    for k in plain:
        np.testing.assert_array_equal(scaled[k], plain[k])


@pytest.mark.gpu
def test_the_scale_does_not_grow_past_float32(gpu_device):
    # GradScaler applies a growth only where the grown scale is finite: 2**127 stays
    model, x, y = _fresh(8)
    y = y * 0.01
    graph = nn.trace(model, x, y, fn=lambda x, y: {"loss": F.mse_loss(model(x), y) * 0.01})
    params = {k: np.array(v) for k, v in model.state_dict().items()}
    scaler = GradScaler(init_scale=2.0**126, growth_interval=1)
    after, scales, skipped = _run(graph, params, {"x": x, "y": y}, gpu_device, scaler, 4, None)
    assert [np.log2(s) for s in scales] == [127, 127, 127, 127]
    assert not any(np.array_equal(after[0][k], params[k]) for k in params)  # step 0 applied


@pytest.mark.gpu
def test_graph_trainer_checkpoints_move_between_scaled_and_unscaled(gpu_device, tmp_path):
    # the scale is not in the checkpoint (a resume starts from init_scale), so loss scaling
    # can be switched on or off when resuming
    graph, params, feeds = _case(9)
    scaled = GradScaler(init_scale=2.0**20)
    trainers = {
        s: mn.Trainer(graph, SGD(lr=1e6), loss_scale=s, device=gpu_device) for s in (1.0, scaled)
    }
    for s, tr in trainers.items():
        tr.load_parameters(params)
        out = tr.step(feeds, ["loss"] + (["loss_scale"] if s is scaled else []))
        assert "_scaler.scale" not in tr.state_dict()
        tr.save(tmp_path / f"{s is scaled}.ckpt")
    assert float(out["loss_scale"]) == 2.0**20  # no overflow, no growth yet
    for s, tr in trainers.items():
        other = tmp_path / f"{s is not scaled}.ckpt"
        tr.load(other)
        assert tr.step_count == 1
        np.testing.assert_array_equal(
            tr.parameters()["fc1.bias"], trainers[1.0].parameters()["fc1.bias"]
        )
    for tr in trainers.values():
        tr.close()
