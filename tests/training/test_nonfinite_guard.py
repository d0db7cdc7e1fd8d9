"""The non-finite guard of every training step (issue 11 item 3; ``training.guard``).

A NaN or inf in a batch used to give a finite-looking loss (relu drops NaN in the forward)
and leave parameters partly NaN. Now the step's update is skipped on the GPU and the next read
raises ``NonFiniteError``, or, with ``on_nonfinite="skip"``, warns, counts and continues.
Everything is compared bit for bit: parameters and optimizer moments after a tripped step are
the bits they had before it, and a run that skipped a bad batch is the bits of a run that never
saw it.
"""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.nn import Dropout, Linear, Module
from meganeura.optim import SGD, Adam, AdamW
from meganeura.training import GraphTrainer, NonFiniteError, NonFiniteWarning, Trainer

pytestmark = pytest.mark.gpu

SIZES = (6, 5, 3)


class MLP(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(SIZES[0], SIZES[1])
        self.fc2 = Linear(SIZES[1], SIZES[2])

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def mse(model, x, t):
    return F.mse_loss(model(x), t)


def _batches(n: int, seed: int = 0, rows: int = 4):
    r = np.random.default_rng(seed)
    return [
        (
            r.standard_normal((rows, SIZES[0])).astype(np.float32),
            r.standard_normal((rows, SIZES[-1])).astype(np.float32),
        )
        for _ in range(n)
    ]


def _poison(batch, where: str):
    """A copy of ``batch`` with one NaN or inf in the input or in the target."""
    x, t = (a.copy() for a in batch)
    value = np.nan if where.endswith("nan") else np.inf
    (x if where.startswith("x") else t)[1, 2] = value
    return x, t


def _trainer(gpu_device, opt, **kw) -> Trainer:
    mn.manual_seed(0)
    return Trainer(MLP(), opt, mse, device=gpu_device, **kw)


def _bits(tr) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).view(np.uint32).copy() for k, v in tr.state_dict().items()}


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# (optimizer, max_grad_norm, where the bad value is): Adam, AdamW and SGD-momentum, clipping on
# and off, NaN and inf, in the input and in the target.
CASES = {
    "adam_x_nan": (Adam(lr=1e-2), None, "x_nan"),
    "adamw_clip_t_inf": (AdamW(lr=1e-2, weight_decay=0.1), 0.5, "t_inf"),
    "sgd_momentum_x_inf": (SGD(lr=0.1, momentum=0.9), None, "x_inf"),
    "sgd_momentum_clip_t_nan": (SGD(lr=0.1, momentum=0.9, weight_decay=1e-2), 0.5, "t_nan"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_batch_raises_and_leaves_every_bit(gpu_device, case):
    opt, clip, where = CASES[case]
    good = _batches(3)
    tr = _trainer(gpu_device, opt, max_grad_norm=clip)
    ref = _trainer(gpu_device, opt, max_grad_norm=clip)
    tr.step(*good[0])
    ref.step(*good[0])
    before, rng = _bits(tr), mn.random.get_rng_state()
    with pytest.raises(NonFiniteError, match=r"Trainer step 1: .*skipped on the GPU") as info:
        tr.step(*_poison(good[1], where))
    e = info.value
    assert isinstance(e, FloatingPointError) and e.step == 1 and e.steps == (1,)
    assert e.cause == "loss" and not np.isfinite(e.loss)  # relu passes NaN on, as torch's
    assert e.runs is not None and "x" in e.runs[0][1]  # what a locator replays
    assert tr.step_count == 1 and mn.random.get_rng_state() == rng
    _assert_same_bits(_bits(tr), before)  # parameters and every optimizer moment
    # the next good step is the step of a run that never saw the bad batch
    assert tr.step(*good[2]) == ref.step(*good[2])
    _assert_same_bits(_bits(tr), _bits(ref))


def test_a_bad_micro_batch_of_an_accumulated_step(gpu_device):
    good = _batches(2, rows=6)
    tr = _trainer(gpu_device, AdamW(lr=1e-2), accumulation_steps=3)
    tr.step(*good[0])
    before = _bits(tr)
    x, t = good[1][0].copy(), good[1][1]
    x[0, 0] = np.nan  # rows 0-1: the first micro-batch only (not the one that updates)
    with pytest.raises(NonFiniteError, match="step 1"):
        tr.step(x, t)
    _assert_same_bits(_bits(tr), before)
    assert tr.step_count == 1
    assert np.isfinite(tr.step(*good[1]))


def _sqrt_zero_loss(model, x, t):
    """A finite loss whose gradients are NaN: d sqrt(s)/ds is inf at s = 0, times the zero
    that scales s (as in torch: inf * 0 = NaN)."""
    y = model(x)
    return F.mse_loss(y, t) + F.sqrt((y * 0.0).sum())


def test_return_grads_names_the_non_finite_gradients(gpu_device):
    good = _batches(2)
    mn.manual_seed(0)
    tr = Trainer(MLP(), Adam(lr=1e-2), _sqrt_zero_loss, device=gpu_device)
    before = _bits(tr)
    with pytest.raises(NonFiniteError, match=r"the loss is finite .* gradients \(") as info:
        tr.step(*good[1], return_grads=True)
    e = info.value
    assert e.cause == "gradients" and np.isfinite(e.loss) and e.step == 0
    assert set(e.gradients) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    _assert_same_bits({k: v for k, v in _bits(tr).items() if k in before}, before)


def test_unread_steps_stop_at_the_first_bad_one(gpu_device):
    """return_loss=False: the guard stays tripped on the GPU until the next read, which names
    the first bad step; the steps after it were not applied either."""
    good = _batches(5)
    tr = _trainer(gpu_device, Adam(lr=1e-2))
    ref = _trainer(gpu_device, Adam(lr=1e-2))
    tr.step(*good[0], return_loss=False)
    ref.step(*good[0])
    rng = mn.random.get_rng_state()
    tr.step(*_poison(good[1], "x_inf"), return_loss=False)
    tr.step(*good[2], return_loss=False)
    tr.step(*good[3], return_loss=False)
    with pytest.raises(NonFiniteError, match=r"step 1: .*steps 2-3 ran after it") as info:
        tr.evaluate(*good[4])  # any read: here evaluate
    assert info.value.steps == (1, 2, 3) and tr.step_count == 1
    assert mn.random.get_rng_state() == rng
    _assert_same_bits(_bits(tr), _bits(ref))
    assert tr.step(*good[2]) == ref.step(*good[2])  # training goes on from step 1


def test_save_after_an_unread_bad_step_raises_and_writes_nothing(gpu_device, tmp_path):
    good = _batches(2)
    tr = _trainer(gpu_device, SGD(lr=0.1, momentum=0.9))
    tr.step(*good[0], return_loss=False)
    tr.step(*_poison(good[1], "t_inf"), return_loss=False)
    with pytest.raises(
        NonFiniteError, match="Trainer step 1: its loss or gradients hold inf or NaN"
    ):
        tr.save(tmp_path / "ck.safetensors")
    assert not (tmp_path / "ck.safetensors").exists() and tr.step_count == 1
    tr.save(tmp_path / "ck.safetensors")  # read: the error is not raised twice


def test_skip_mode_counts_warns_and_matches_a_run_without_the_bad_batch(gpu_device, tmp_path):
    good = _batches(4)
    tr = _trainer(gpu_device, Adam(lr=1e-2), on_nonfinite="skip")
    ref = _trainer(gpu_device, Adam(lr=1e-2))
    tr.step(*good[0])
    ref.step(*good[0])
    with pytest.warns(NonFiniteWarning, match=r"step 1 .*skipped \(on_nonfinite='skip'; 1"):
        loss = tr.step(*_poison(good[1], "t_nan"))
    assert np.isnan(loss) and tr.skipped_steps == 1
    assert tr.step_count == 1  # the schedule and Adam's bias correction did not advance
    _assert_same_bits(_bits(tr), _bits(ref))
    assert tr.step(*good[1]) == ref.step(*good[1])
    tr.save(tmp_path / "ck.safetensors")
    mn.manual_seed(3)
    resumed = Trainer(MLP(), Adam(lr=1e-2), mse, device=gpu_device, on_nonfinite="skip")
    meta = resumed.load(tmp_path / "ck.safetensors")
    assert meta["skipped_steps"] == 1 and resumed.skipped_steps == 1 and resumed.step_count == 2
    for t in (tr, resumed, ref):
        t.step(*good[2])
    _assert_same_bits(_bits(resumed), _bits(tr))
    _assert_same_bits(_bits(tr), _bits(ref))


class DropoutMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.drop = Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def test_skip_mode_puts_the_rng_back_for_dropout(gpu_device):
    """A skipped step's dropout seed is drawn again by the next step, so a model with dropout
    trains on as a run that never saw the bad batch (each run alone: they share the global
    RNG)."""
    good = _batches(3)

    def run(bad: bool):
        mn.manual_seed(0)
        tr = Trainer(DropoutMLP(), Adam(lr=1e-2), mse, device=gpu_device, on_nonfinite="skip")
        tr.step(*good[0])
        if bad:
            with pytest.warns(NonFiniteWarning):
                tr.step(*_poison(good[1], "t_nan"))  # the target: no dropout can hide it
        losses = [tr.step(*good[1]), tr.step(*good[2])]
        return losses, _bits(tr), mn.random.get_rng_state()

    skipped, clean = run(True), run(False)
    assert skipped[0] == clean[0] and skipped[2] == clean[2]
    _assert_same_bits(skipped[1], clean[1])


def test_skip_mode_learns_of_an_unread_skip_at_the_next_read(gpu_device):
    good = _batches(3)
    tr = _trainer(gpu_device, SGD(lr=0.1, momentum=0.9), on_nonfinite="skip")
    tr.step(*good[0], return_loss=False)
    tr.step(*_poison(good[1], "x_inf"), return_loss=False)
    tr.step(*good[2], return_loss=False)
    assert tr.step_count == 3 and tr.skipped_steps == 0  # not read yet
    with pytest.warns(NonFiniteWarning, match=r"1 of the steps 0-3 had a non-finite"):
        assert np.isfinite(tr.step(*good[0]))
    assert tr.skipped_steps == 1 and tr.step_count == 3  # 4 run, 3 applied
    assert all(np.isfinite(v).all() for v in tr.state_dict().values())


def test_check_finite_names_the_input_before_running(gpu_device):
    tr = _trainer(gpu_device, SGD(lr=0.1, momentum=0.9), check_finite=True)
    tr.step(*_batches(1)[0])
    before = _bits(tr)
    with pytest.raises(NonFiniteError, match=r"input 't' \(float32\[4, 3\]\) holds 1 non-finite"):
        tr.step(*_poison(_batches(1)[0], "t_inf"))
    assert tr.step_count == 1
    _assert_same_bits(_bits(tr), before)


def test_fast_precision(gpu_device):
    good = _batches(2)
    with pytest.warns() if "shader-f16" not in gpu_device.features else _no_warning():
        tr = _trainer(gpu_device, AdamW(lr=1e-2), precision="fast")
        tr.step(*good[0])
    before = _bits(tr)
    with pytest.raises(NonFiniteError, match="step 1"):
        tr.step(*_poison(good[1], "x_nan"))
    _assert_same_bits(_bits(tr), before)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _graph():
    b = GraphBuilder()
    x = b.input("x", (4, SIZES[0]))
    t = b.input("t", (4, SIZES[-1]))
    w = b.parameter("w", (SIZES[0], SIZES[-1]))
    b.output("loss", F.mse_loss(F.relu(x @ w), t))
    return b.build()


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_graph_trainer(gpu_device, mode):
    good = _batches(3)
    w = np.random.default_rng(1).standard_normal((SIZES[0], SIZES[-1])).astype(np.float32)
    tr = GraphTrainer(_graph(), Adam(lr=1e-2), device=gpu_device, on_nonfinite=mode)
    ref = GraphTrainer(_graph(), Adam(lr=1e-2), device=gpu_device)
    for g in (tr, ref):
        g.load_parameters({"w": w})
        g.step(dict(zip("xt", good[0])))
    before = _bits(tr)
    bad = dict(zip("xt", _poison(good[1], "x_nan")))
    if mode == "raise":
        with pytest.raises(NonFiniteError, match="GraphTrainer step 1"):
            tr.step(bad)
    else:
        with pytest.warns(NonFiniteWarning):
            tr.step(bad)
        assert tr.skipped_steps == 1
    assert tr.step_count == 1
    _assert_same_bits(_bits(tr), before)
    assert tr.step(dict(zip("xt", good[2]))) == ref.step(dict(zip("xt", good[2])))
    _assert_same_bits(_bits(tr), _bits(ref))


def _log_loss(model, x, t):
    return F.log(model(x) + 1.0).mean() + F.mse_loss(model(x), t)  # NaN where the output < -1


def test_the_error_names_the_first_non_finite_value(gpu_device):
    """A finite batch whose loss takes the log of a negative: the error names that log (the
    guard replays the step with ``meganeura.debug.find_nonfinite``), the input and the
    weights being finite; nothing changed."""
    mn.manual_seed(0)
    tr = Trainer(MLP(), Adam(lr=1e-2), _log_loss, device=gpu_device)
    x, t = _batches(1)[0]
    x = x * 50.0  # outputs far below -1
    before = _bits(tr)
    with pytest.raises(NonFiniteError, match=r"first non-finite value: %\d+ \(log") as info:
        tr.step(x, t)
    found = info.value.nonfinite
    assert found is not None and found.op == "log" and found.nan > 0 and not found.overflow
    assert "test_nonfinite_guard.py" in found.loc  # the user's line that took the log
    _assert_same_bits({k: v for k, v in _bits(tr).items() if k in before}, before)


def test_the_error_names_an_f16_overflow_in_fast_mode(gpu_device):
    """Fast mode: activations past f16's 65504 (inputs of 1e4 through weights of 20) become
    inf when stored as f16, which the range rule cannot foresee; the error says which value
    overflowed and that it is finite in f32."""
    if "shader-f16" not in gpu_device.features:
        pytest.skip("no shader-f16 on this adapter")
    mn.manual_seed(0)
    model = MLP()
    model.fc1.weight.data = np.full((SIZES[1], SIZES[0]), 20.0, np.float32)
    tr = Trainer(model, SGD(lr=0.1), mse, device=gpu_device, precision="fast")
    x, t = _batches(1)[0]
    with pytest.raises(NonFiniteError, match="f16 overflow") as info:
        tr.step(np.abs(x) * 1e4, t)
    found = info.value.nonfinite
    assert found.overflow and found.dtype == "f16" and found.f32_max_abs > 65504


def test_graph_trainer_error_names_the_first_non_finite_value(gpu_device):
    tr = GraphTrainer(_graph(), Adam(lr=1e-2), device=gpu_device)
    tr.load_parameters({"w": np.ones((SIZES[0], SIZES[-1]), np.float32)})
    x, t = _poison(_batches(1)[0], "x_nan")
    with pytest.raises(NonFiniteError, match="first non-finite value") as info:
        tr.step({"x": x, "t": t})
    assert info.value.nonfinite.op == "input" and info.value.nonfinite.nan == 1


def test_guard_ops_reference():
    """The NumPy references the interpreter runs: NaN clip when a checked value is non-finite,
    sticky until reset, and the count of skipped steps."""
    b = GraphBuilder()
    clip, skipped, reset, loss = (b.input(n, ()) for n in ("clip", "skipped", "reset", "loss"))
    b.output("raise", b.add("guard_clip", [clip, skipped, reset, loss], {"sticky": True}))
    b.output("skip", b.add("guard_clip", [clip, skipped, reset, loss], {"sticky": False}))
    g = b.build()

    def run(loss, skipped, reset):
        feeds = {"clip": np.float32(0.5), "skipped": np.float32(skipped)}
        feeds |= {"reset": np.float32(reset), "loss": np.float32(loss)}
        vals, _, _ = interpret(g, feeds)
        return [float(vals[v]) for _, v in g.outputs]

    assert run(1.0, 0, 0) == [0.5, 0.5]
    assert np.isnan(run(np.inf, 0, 1)).all()
    assert run(1.0, 2, 1) == [0.5, 0.5]  # the host read the count: the step runs
    raise_, skip = run(1.0, 2, 0)  # unread skipped steps: sticky skips, skip mode runs
    assert np.isnan(raise_) and skip == 0.5


_BIG = {"lane0": 5, "lane1": 262_144 + 7, "lane2": 524_288 + 11, "lane3": 786_432 + 13}
_BIG["after_lanes"] = 1_048_576 + 99  # the strides left one at a time


@pytest.mark.parametrize(
    "where",
    ["finite", "nan_last", "inf_first", "neg_inf_middle", *_BIG],
    ids=lambda w: w,
)
def test_found_inf_kernel_checks_every_element(gpu_device, where):
    """found_inf over operands larger than its 1024 x 256 threads (each thread strides), one
    of them tiny: inf when any element is non-finite, 0 for the largest finite floats. The
    largest operand (1.1M elements) has every thread take 4 strides at once (``UNROLL``)
    and then the strides left one by one: a non-finite value is found in each of the four
    loads and after them."""
    from meganeura.compile import compile
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    sizes = (300_001, 3, 70_000, 1_100_000)
    b = GraphBuilder()
    xs = [b.input(f"x{k}", (n,)) for k, n in enumerate(sizes)]
    b.output("found", b.add("found_inf", xs))
    from meganeura.codegen.wgsl import optim

    progs = []
    for unroll in (False, True):  # the lever's two kernels (bench/lever_ab.py)
        optim.set_found_inf_unroll(unroll)
        progs.append(compile(b.build(), limits=device_limits(gpu_device)))
    r = np.random.default_rng(2)
    feeds = {f"x{k}": r.standard_normal(n).astype(np.float32) for k, n in enumerate(sizes)}
    feeds["x1"][1] = np.finfo(np.float32).max
    feeds["x0"][7] = -np.finfo(np.float32).max
    bad = {"nan_last": ("x0", -1, np.nan), "inf_first": ("x1", 0, np.inf)}
    bad["neg_inf_middle"] = ("x2", 35_001, -np.inf)
    bad |= {k: ("x3", i, np.nan if i % 2 else -np.inf) for k, i in _BIG.items()}
    if where in bad:
        name, i, v = bad[where]
        feeds[name][i] = v
    for prog in progs:
        with Session(prog, gpu_device) as sess:
            for _ in range(3):  # repeated runs: nothing left over from the last one
                got = sess.run(feeds, ["found"])["found"]
                assert got == (0.0 if where == "finite" else np.inf)
    vals, _, _ = interpret(prog_graph := b.build(), feeds)
    assert vals[prog_graph.output_dict["found"]] == got
