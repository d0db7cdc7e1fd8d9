"""mn.Trainer over nn.Modules on the GPU (lavapipe on CI), against torch.optim in float64: steps,
frozen parameters, gradients, accumulation, evaluation, batch-norm counters, bit-identical
resume and the errors a user meets."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.graph.builder import GraphTypeError
from meganeura.io.checkpoint import CheckpointError
from meganeura.nn import BatchNorm1d, Buffer, Linear, Module, Parameter
from meganeura.nn.tracing import current_trace
from meganeura.optim import SGD, AdamW
from meganeura.optim.schedules import CosineLR
from meganeura.runtime import InputError
from meganeura.training import GraphTrainer, Trainer

pytestmark = pytest.mark.gpu

rng = np.random.default_rng(5)
SIZES = (20, 16, 5)


class MLP(Module):
    def __init__(self, p_drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = Linear(SIZES[0], SIZES[1])
        self.fc2 = Linear(SIZES[1], SIZES[2])
        self.p_drop = p_drop

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.p_drop:
            h = F.dropout(h, self.p_drop, self.training)
        return self.fc2(h)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def _batch(n: int = 8):
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, rng.integers(0, SIZES[-1], n).astype(np.int32)


def _model(seed: int = 0, **kw) -> MLP:
    mn.manual_seed(seed)
    return MLP(**kw)


def _torch_twin(model: Module, p_drop: float = 0.0) -> torch.nn.Module:
    """The same architecture in torch, float64, loaded from the model's state dict."""
    layers = OrderedDict(fc1=torch.nn.Linear(*SIZES[:2]), relu=torch.nn.ReLU())
    if p_drop:
        layers["drop"] = torch.nn.Dropout(p_drop)
    layers["fc2"] = torch.nn.Linear(*SIZES[1:])
    net = torch.nn.Sequential(layers).double()
    net.load_state_dict({k: torch.from_numpy(v).double() for k, v in model.state_dict().items()})
    return net


def _torch_loss(net, x, y):
    return torch.nn.functional.cross_entropy(
        net(torch.from_numpy(x).double()), torch.from_numpy(y).long()
    )


def _torch_steps(net, opt, batches, clip=None, sched=None):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = _torch_loss(net, x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _assert_params(model: Module, net: torch.nn.Module, rtol=1e-5, atol=1e-6):
    ours = model.state_dict()
    for k, v in net.state_dict().items():
        np.testing.assert_allclose(ours[k], v.numpy(), rtol=rtol, atol=atol, err_msg=k)


CASES = {
    "sgd_momentum": (SGD(lr=0.1, momentum=0.9), torch.optim.SGD, {"momentum": 0.9}),
    "adamw_clip": (AdamW(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, {"weight_decay": 0.1}),
    "sgd_cosine": (
        SGD(lr=0.1, momentum=0.5, nesterov=True),
        torch.optim.SGD,
        {"momentum": 0.5, "nesterov": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_three_steps_match_torch_optim(gpu_device, case):
    opt, topt, kw = CASES[case]
    clip = 0.5 if "clip" in case else None
    sched = CosineLR(lr=0.1, total_steps=3) if "cosine" in case else None
    model = _model()
    net = _torch_twin(model)
    tr = Trainer(model, opt, loss_fn, schedule=sched, max_grad_norm=clip, device=gpu_device)
    batches = [_batch() for _ in range(3)]
    losses = [tr.step(x, y) for x, y in batches]
    t_opt = topt(net.parameters(), lr=opt.lr, **kw)
    t_sched = None
    if sched is not None:
        t_sched = torch.optim.lr_scheduler.LambdaLR(t_opt, lambda s: sched(s) / 0.1)
    ref = _torch_steps(net, t_opt, batches, clip, t_sched)
    assert all(isinstance(v, float) for v in losses)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    _assert_params(model, net)
    assert tr.step_count == 3 and tr.cache_info().misses == 1 and tr.cache_info().hits == 2


def test_other_batch_size_continues_the_same_moments(gpu_device):
    model = _model()
    net = _torch_twin(model)
    tr = Trainer(model, SGD(lr=0.1, momentum=0.9), loss_fn, device=gpu_device)
    batches = [_batch(8), _batch(5), _batch(8)]
    losses = [tr.step(x, y) for x, y in batches]
    ref = _torch_steps(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), batches)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    _assert_params(model, net)
    info = tr.cache_info()
    assert (info.misses, info.hits) == (2, 1)
    assert len(tr.state_dict()) == 4 + 4  # one momentum buffer per parameter, not per program


def test_frozen_parameters_and_unfreezing(gpu_device):
    model = _model()
    net = _torch_twin(model)
    model.fc1.requires_grad_(False)
    net.fc1.requires_grad_(False)
    frozen = model.fc1.state_dict()
    tr = Trainer(model, SGD(lr=0.1, momentum=0.9), loss_fn, device=gpu_device)
    t_opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = [_batch() for _ in range(3)]
    for x, y in batches[:2]:
        tr.step(x, y)
    _torch_steps(net, t_opt, batches[:2])
    for k, v in model.fc1.state_dict().items():
        np.testing.assert_array_equal(v, frozen[k], err_msg=k)
    assert not any(k.startswith("optimizer/fc1") for k in tr.state_dict())
    _assert_params(model, net)

    model.fc1.weight.requires_grad = True  # takes effect at the next step, as in torch
    net.fc1.weight.requires_grad_(True)
    tr.step(*batches[2])
    _torch_steps(net, t_opt, batches[2:])
    assert not np.array_equal(model.fc1.weight.data, frozen["weight"])
    np.testing.assert_array_equal(model.fc1.bias.data, frozen["bias"])
    _assert_params(model, net)
    assert tr.cache_info().misses == 2


def test_return_grads_are_torch_autograd_gradients_before_clipping(gpu_device):
    model = _model()
    net = _torch_twin(model)
    tr = Trainer(model, SGD(lr=0.1), loss_fn, max_grad_norm=0.1, device=gpu_device)
    x, y = _batch()
    loss, grads = tr.step(x, y, return_grads=True)
    ref = _torch_loss(net, x, y)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    want = {k: p.grad.numpy() for k, p in net.named_parameters()}
    assert grads.keys() == want.keys()
    for k, g in want.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-5, atol=1e-7, err_msg=k)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    _assert_params(model, net)
    assert isinstance(tr.step(x, y), float)  # without return_grads: its own, cheaper program


@pytest.mark.parametrize(
    "opt",
    [SGD(lr=0.1, momentum=0.9), AdamW(lr=1e-2, weight_decay=0.1)],
    ids=["sgd_momentum", "adamw"],
)
def test_micro_batches_equal_one_full_batch(gpu_device, opt):
    full, micro = _model(), _model()
    a = Trainer(full, opt, loss_fn, device=gpu_device)
    b = Trainer(micro, opt, loss_fn, accumulation_steps=4, device=gpu_device)
    batches = [_batch() for _ in range(3)]
    for x, y in batches[:2]:
        assert b.step(x, y) == pytest.approx(a.step(x, y), rel=1e-6)
    la, grads_a = a.step(*batches[2], return_grads=True)
    lb, grads_b = b.step(*batches[2], return_grads=True)  # the mean over the micro-batches
    assert lb == pytest.approx(la, rel=1e-6)
    assert grads_b.keys() == grads_a.keys() == full.state_dict().keys()
    for k, g in grads_a.items():
        np.testing.assert_allclose(grads_b[k], g, rtol=1e-5, atol=1e-7, err_msg=k)
    got, want = micro.state_dict(), full.state_dict()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert b.step_count == 3
    assert b.cache_info().misses == 3  # accumulate, update, update with gradients


def test_uneven_micro_batches_average_their_gradients(gpu_device):
    """8 rows in 3 micro-batches (3, 3, 2): the update uses the mean of the three micro-batch
    gradients (Hugging Face's semantics), as torch gets by backpropagating loss / 3 of each."""
    model = _model()
    net = _torch_twin(model)
    tr = Trainer(model, SGD(lr=0.1, momentum=0.9), loss_fn, accumulation_steps=3, device=gpu_device)
    t_opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        x, y = _batch(8)
        loss = tr.step(x, y)
        t_opt.zero_grad()
        ref = 0.0
        for lo, hi in ((0, 3), (3, 6), (6, 8)):
            part = _torch_loss(net, x[lo:hi], y[lo:hi]) / 3
            part.backward()
            ref += part.item()
        t_opt.step()
        assert loss == pytest.approx(ref, rel=1e-5)
    _assert_params(model, net)


def test_keyword_batches_step_as_positional_ones_and_share_their_program(gpu_device):
    pos, kw = _model(), _model()
    a = Trainer(pos, SGD(lr=0.1, momentum=0.9), loss_fn, device=gpu_device)
    b = Trainer(kw, SGD(lr=0.1, momentum=0.9), loss_fn, accumulation_steps=2, device=gpu_device)
    c = Trainer(_model(), SGD(lr=0.1, momentum=0.9), loss_fn, device=gpu_device)
    for i in range(2):
        x, y = _batch()
        want = a.step(x, y)
        assert b.step(y=y, x=x) == pytest.approx(want, rel=1e-6)  # split by name too
        assert (c.step(x, y=y) if i else c.step(x=x, y=y)) == pytest.approx(want, rel=1e-6)
    assert c.cache_info().misses == 1 and c.cache_info().hits == 1  # one signature
    for k, v in pos.state_dict().items():
        np.testing.assert_allclose(kw.state_dict()[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    x, y = _batch()
    assert a.evaluate(x=x, y=y) == pytest.approx(a.evaluate(x, y), rel=1e-7)
    loss, grads = c.step(x=x, y=y, return_grads=True)
    assert set(grads) == set(pos.state_dict())
    with pytest.raises(TypeError, match="missing a required argument"):  # binds as loss_fn
        c.step(x=x, z=y)


def test_evaluate_runs_the_eval_program_on_the_same_parameters(gpu_device):
    model = _model(p_drop=0.5)
    tr = Trainer(model, AdamW(lr=1e-2), loss_fn, device=gpu_device)
    x, y = _batch()
    for _ in range(2):
        tr.step(x, y)
        got = tr.evaluate(x, y)
        net = _torch_twin(model, p_drop=0.5).eval()
        assert got == pytest.approx(_torch_loss(net, x, y).item(), rel=1e-5)
        assert tr.evaluate(x, y) == got  # no dropout in eval mode
        assert all(m.training for m in model.modules())  # modes restored
    assert tr.cache_info().misses == 2  # one train and one eval program


class TinyBatchNorm(Module):
    """BatchNorm1d as a layer would write it: running statistics on the GPU, the counter on
    the host, incremented by an effect the trace replays after each run of the program."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = Parameter(np.ones(c, np.float32))
        self.bias = Parameter(np.zeros(c, np.float32))
        self.running_mean = Buffer(np.zeros(c, np.float32))
        self.running_var = Buffer(np.ones(c, np.float32))
        self.num_batches_tracked = Buffer(np.array(0, np.int64), host_only=True)

    def forward(self, x):
        w, b, rm, rv = self.weight, self.bias, self.running_mean, self.running_var
        if self.training:
            counter = self._buffers["num_batches_tracked"]
            current_trace().on_run(lambda: counter.copy_(counter.data + 1))
        return F.batch_norm(x, rm, rv, w, b, self.training, 0.1, 1e-5)


class BNNet(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = Linear(SIZES[0], SIZES[-1])
        self.bn = TinyBatchNorm(SIZES[-1])
        self.unused = TinyBatchNorm(3)  # never called: its counter stays

    def forward(self, x):
        return self.bn(self.fc(x))


def test_batch_norm_counters_count_train_mode_steps(gpu_device):
    mn.manual_seed(0)
    model = BNNet()
    net = torch.nn.Sequential(
        OrderedDict(fc=torch.nn.Linear(SIZES[0], SIZES[-1]), bn=torch.nn.BatchNorm1d(SIZES[-1]))
    ).double()
    sd = {k: torch.from_numpy(np.asarray(v)) for k, v in model.state_dict().items()}
    net.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in sd.items()
                         if not k.startswith("unused")})  # fmt: skip
    tr = Trainer(model, SGD(lr=0.1), loss_fn, device=gpu_device)
    t_opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [_batch() for _ in range(4)]
    for x, y in batches[:3]:
        tr.step(x, y)
    _torch_steps(net, t_opt, batches[:3])
    assert int(model.bn.num_batches_tracked.data) == 3 == int(net.bn.num_batches_tracked)
    assert int(model.unused.num_batches_tracked.data) == 0
    _assert_params(model, net)  # running statistics included

    tr.evaluate(*batches[3])
    model.eval()
    net.eval()
    tr.step(*batches[3])  # a step in eval mode: running statistics and counter stay
    _torch_steps(net, t_opt, batches[3:])
    assert int(model.bn.num_batches_tracked.data) == 3
    _assert_params(model, net)


class TwiceNormed(Module):
    """One BatchNorm1d called twice per forward: torch counts both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = Linear(SIZES[0], SIZES[-1])
        self.bn = BatchNorm1d(SIZES[-1])

    def forward(self, x):
        return self.bn(self.bn(self.fc(x)))


def test_batch_norm_counts_every_forward_with_accumulation(gpu_device):
    mn.manual_seed(0)
    model = TwiceNormed()
    tr = Trainer(model, SGD(lr=0.1), loss_fn, accumulation_steps=2, device=gpu_device)
    for _ in range(3):
        tr.step(*_batch())
    # 3 steps x 2 micro-batches x 2 calls, as torch.nn.BatchNorm1d counts them
    assert int(model.bn.num_batches_tracked.data) == 12
    tr.evaluate(*_batch())  # eval mode: no count
    model.eval()
    tr.step(*_batch())
    assert int(model.bn.num_batches_tracked.data) == 12


def test_return_loss_false_reads_nothing_back(gpu_device):
    model, (x, y) = _model(), _batch()
    twin = _model()
    a = Trainer(model, SGD(lr=0.1), loss_fn, device=gpu_device)
    b = Trainer(twin, SGD(lr=0.1), loss_fn, device=gpu_device)
    assert a.step(x, y, return_loss=False) is None
    b.step(x, y)
    assert a.step_count == 1
    loss, grads = a.step(x, y, return_grads=True, return_loss=False)
    assert loss is None and set(grads) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    b.step(x, y)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, twin.state_dict()[k], err_msg=k)


def test_resume_is_bit_identical(gpu_device, tmp_path):
    batches = [_batch() for _ in range(4)]
    model = _model(p_drop=0.3)  # dropout draws from the global RNG: it must resume too
    a = Trainer(model, AdamW(lr=1e-2), loss_fn, schedule=CosineLR(1e-2, 4), device=gpu_device)
    for x, y in batches[:2]:
        a.step(x, y)
    a.save(tmp_path / "ck.safetensors", {"note": "half way"})
    losses_a = [a.step(x, y) for x, y in batches[2:]]

    fresh = _model(seed=7, p_drop=0.3)
    b = Trainer(fresh, AdamW(lr=1e-2), loss_fn, schedule=CosineLR(1e-2, 4), device=gpu_device)
    meta = b.load(tmp_path / "ck.safetensors")
    assert meta["note"] == "half way" and b.step_count == 2
    losses_b = [b.step(x, y) for x, y in batches[2:]]
    assert losses_a == losses_b
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and len(sa) == 4 + 8
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def test_a_model_loads_its_weights_from_a_trainer_checkpoint(gpu_device, tmp_path):
    model, (x, y) = _model(), _batch()
    tr = Trainer(model, AdamW(lr=1e-2), loss_fn, device=gpu_device)
    tr.step(x, y)
    tr.save(tmp_path / "ck.safetensors")
    restored = _model(seed=7)
    keys = restored.load_state_dict(tmp_path / "ck.safetensors")  # strict: optimizer/ skipped
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(restored.state_dict()[k], v, err_msg=k)
    np.testing.assert_array_equal(restored(x), model(x))


def test_load_checks_everything_before_applying(gpu_device, tmp_path):
    from meganeura.io.checkpoint import load_checkpoint, save_checkpoint

    model = _model()
    tr = Trainer(model, AdamW(lr=1e-2), loss_fn, device=gpu_device)
    tr.step(*_batch())
    tr.save(tmp_path / "ck.safetensors")
    tr.step(*_batch())
    before, rng_before = tr.state_dict(), mn.random.get_rng_state()
    tensors, meta = load_checkpoint(tmp_path / "ck.safetensors")
    bad = {
        "shape": ({**tensors, "fc2.bias": np.zeros(4, np.float32)}, meta, "fc2.bias"),
        "moment": ({**tensors, "optimizer/fc9.weight.exp_avg": tensors["fc1.bias"]}, meta, "fc9"),
        "step": (tensors, {**meta, "step": -1}, "'step'"),
        "optimizer": (tensors, {**meta, "optimizer": {"type": "SGD"}}, "SGD"),
    }
    for name, (t, m, match) in bad.items():
        save_checkpoint(tmp_path / f"{name}.safetensors", t, m)
        with pytest.raises(CheckpointError, match=match):
            tr.load(tmp_path / f"{name}.safetensors")
        after = tr.state_dict()
        assert tr.step_count == 2 and mn.random.get_rng_state() == rng_before, name
        for k in before:
            np.testing.assert_array_equal(after[k], before[k], err_msg=f"{name}: {k}")


def test_errors_say_what_the_user_wrote(gpu_device):
    model = _model()
    x, y = _batch()
    cases = [
        (lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), ValueError, r"shape \[8\]"),
        (lambda m, x, y: 1.0, TypeError, "returned a float"),
        (lambda m, x, y: (loss_fn(m, x, y), m(x)), TypeError, "returned a tuple"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            Trainer(model, SGD(lr=0.1), fn, device=gpu_device).step(x, y)
    with pytest.raises(TypeError, match="first argument"):
        Trainer(model, SGD(lr=0.1), lambda: None)

    tr = Trainer(model, SGD(lr=0.1), loss_fn, device=gpu_device)
    tr.step(x, y)
    before = model.state_dict()
    with pytest.raises(GraphTypeError) as info:
        tr.step(x[:, :19], y)  # compiled for 20 features
    assert "x: float32[8, 19], y: int32[8]" in "\n".join(info.value.__notes__)
    with pytest.raises(InputError, match="'y'"):
        tr.step(x, np.full(8, SIZES[-1], np.int32))  # class index out of range
    with pytest.raises(ValueError, match="at least 2 rows"):
        Trainer(model, SGD(lr=0.1), loss_fn, accumulation_steps=2).step(x[:1], y[:1])
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        tr.step(x, y)
    model.requires_grad_(True)
    assert tr.step_count == 1
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_a_graph_gives_the_graph_trainer(gpu_device):
    from meganeura.models.mlp import build_mlp

    tr = mn.Trainer(build_mlp(8, SIZES).graph, SGD(lr=0.1), device=gpu_device)
    assert isinstance(tr, GraphTrainer) and tr.inputs == ["x", "y"]
