"""Whole torch.nn models ported to meganeura: the porting claim of issue 10, checked end to end.

ResNet-18, a pre-LN transformer and a U-Net are written once in ``port_sources`` and built
from torch.nn and from meganeura.nn; the library's ``meganeura.models.resnet``,
``meganeura.models.bert`` (against transformers' ``BertModel``) and ``meganeura.models.unet``
(against its twin in ``port_sources``) load the torch model's state dict. For each model:

(a) its state-dict keys (in order) and shapes are torch's, and torch's state dict, converted
    with ``.numpy()``, loads strictly and reads back unchanged;
(b) the forward output equals torch's (train-mode BatchNorm for the ResNet);
(c) one ``Trainer`` step gives torch's loss and every parameter's gradient (torch.autograd),
    its parameters are torch.optim's step (AdamW, or SGD with momentum for the ResNet) from
    those gradients, and BatchNorm's running statistics and ``num_batches_tracked`` are
    torch's;
(d) the eval-mode output after the step, whose program reads the parameters the step wrote.

Random weights (torch's initialization, then norms' affine parameters and running statistics
drawn away from their defaults), inputs rounded to float32 before either side sees them, torch
in float64. Errors are relative L2 norms. ``pytest -s`` prints each model's measured errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn as mnn
import meganeura.nn.functional as F

from .port_sources import define

pytestmark = pytest.mark.gpu

TORCH = define(torch.nn, torch.nn.functional, torch)
OURS = define(mnn, F, mn)

FWD_RTOL = 1e-5  # f32 kernels against float64 torch
GRAD_RTOL = 1e-5
F32_EPS = 2.0**-24  # float32's unit roundoff

rng = np.random.default_rng(23)


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / scale) if scale > 0 else float(np.linalg.norm(got))


def f32(a):
    return np.asarray(a, np.float32)


def t64(a):
    a = np.asarray(a)
    return torch.from_numpy(a.astype(np.float64 if a.dtype.kind == "f" else np.int64))


def numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def port(theirs: torch.nn.Module, ours: mnn.Module) -> None:
    """(a): the same keys in the same order and shapes; torch's state dict loads strictly and
    reads back bit for bit. Leaves ``theirs`` in float64."""
    want = numpy_state(theirs)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in want.items()
    ]
    result = ours.load_state_dict(want)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    theirs.double()


def perturb_norms(theirs: torch.nn.Module) -> None:
    """Affine parameters and running statistics away from 1 and 0, so a wrong one shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in theirs.modules():
            if getattr(m, "weight", None) is not None and isinstance(
                m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm, torch.nn.LayerNorm)
            ):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.4 * torch.rand(m.running_mean.shape, generator=g) - 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 1.5 + 0.5)


def rounding(before, update) -> float:
    """A bound on float32 rounding of ``before + update`` (L2 over the elements): a unit
    roundoff of the parameter and of the sum, which an update that nearly cancels the
    parameter leaves at the parameter's scale, and 8 of the update, which AdamW computes
    with a square root and a division (WGSL allows 2 and 2.5 ULP) and a few products."""
    return float(F32_EPS * np.linalg.norm(2 * np.abs(before) + 8 * np.abs(update)))


def torch_step(make_opt, before: dict, grads: dict) -> dict:
    """torch.optim's step (float64) from ``before`` with the given gradients."""
    params = {k: torch.tensor(before[k], dtype=torch.float64) for k in grads}
    for k, p in params.items():
        p.grad = torch.from_numpy(np.asarray(grads[k], np.float64))
    make_opt(list(params.values())).step()
    return {k: p.numpy() for k, p in params.items()}


def check_forward(ours, theirs, inputs, forward) -> float:
    """(b): ``forward(model, inputs)`` (a tuple of NumPy outputs) of ours against torch's."""
    want = forward(theirs, [t64(a) for a in inputs])
    errs = [rel_l2(g, w) for g, w in zip(forward(ours, inputs), want, strict=True)]
    assert max(errs) <= FWD_RTOL, errs
    return max(errs)


def check_buffers(ours, theirs) -> None:
    """BatchNorm's running statistics to FWD_RTOL, ``num_batches_tracked`` exactly."""
    params = dict(theirs.named_parameters())
    want = numpy_state(theirs)
    for k, v in ours.state_dict().items():
        if k in params:
            continue
        if k.endswith("num_batches_tracked"):
            assert v == want[k], (k, v, want[k])
        else:
            assert rel_l2(v, want[k]) <= FWD_RTOL, (k, rel_l2(v, want[k]))


def check_step(tr, ours, theirs, make_opt, batch, torch_loss) -> dict:
    """(c): one Trainer step against torch.autograd and torch.optim in float64.

    Asserts the loss; every parameter's gradient (one whose torch gradient is zero up to
    float64 rounding -- a key bias, which softmax's shift invariance cancels -- must be zero
    up to float32 rounding of the whole gradient); that our parameters after the step are
    torch.optim's step from our gradients, to float32 rounding; and the buffers (BatchNorm's
    running statistics to FWD_RTOL, ``num_batches_tracked`` exactly).

    The parameters are then torch's own step up to what our gradients' float32 rounding does
    to torch.optim: for SGD the update's relative error is the gradient's; AdamW's first step
    divides each element by its magnitude plus eps, so an element whose gradient is near eps
    or at rounding level (a key bias) moves by up to lr either way, in float32 torch as here.

    Returns the measured errors: loss, worst gradient, worst optimizer error in units of its
    rounding bound, and per parameter the update's relative error against torch's own step,
    ours and torch.optim's from our gradients.
    """
    before = numpy_state(theirs)
    loss, grads = tr.step(*batch, return_grads=True)
    t_opt = make_opt(theirs.parameters())
    t_opt.zero_grad()
    want_loss = torch_loss(theirs, *[t64(a) for a in batch])
    want_loss.backward()
    want_grads = {k: p.grad.numpy().copy() for k, p in theirs.named_parameters()}
    t_opt.step()
    after = numpy_state(theirs)

    loss_err = abs(loss - want_loss.item()) / abs(want_loss.item())
    assert loss_err <= FWD_RTOL, (loss, want_loss.item())
    assert grads.keys() == want_grads.keys()
    total = np.sqrt(sum(np.sum(g**2) for g in want_grads.values()))
    grad_errs = {}
    for k, g in want_grads.items():
        if np.linalg.norm(g) <= 1e-12 * total:
            assert np.linalg.norm(grads[k]) <= GRAD_RTOL * total, k
            continue
        grad_errs[k] = rel_l2(grads[k], g)
        assert grad_errs[k] <= GRAD_RTOL, (k, grad_errs[k])

    mine = torch_step(make_opt, before, grads)
    got = ours.state_dict()
    opt_err, update_errs, from_ours = 0.0, {}, {}
    for k in grads:
        bound = rounding(before[k], mine[k] - before[k])
        opt_err = max(opt_err, np.linalg.norm(got[k] - mine[k]) / bound)
        assert opt_err <= 1, (k, opt_err)
        update_errs[k] = rel_l2(got[k] - before[k], after[k] - before[k])
        from_ours[k] = rel_l2(mine[k] - before[k], after[k] - before[k])
    check_buffers(ours, theirs)
    return {
        "loss": loss_err,
        "grad": max(grad_errs.values()),
        "optimizer/rounding": opt_err,
        "update": update_errs,
        "update from our gradients": from_ours,
    }


def check_eval(ours, theirs, inputs, forward) -> tuple[float, float]:
    """(d): the eval-mode output after the step against torch's model holding our updated
    parameters and buffers (to FWD_RTOL: the eval program reads what the step wrote) and
    against torch's own stepped model (reported; it differs by what ``check_step`` allows).
    ``forward(model, inputs)`` returns a tuple of NumPy outputs."""
    ours.eval(), theirs.eval()
    own = forward(theirs, [t64(a) for a in inputs])
    theirs.load_state_dict({k: t64(v) for k, v in ours.state_dict().items()})
    want = forward(theirs, [t64(a) for a in inputs])
    got = forward(ours, inputs)
    errs = [rel_l2(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) <= FWD_RTOL, errs
    return max(errs), max(rel_l2(g, w) for g, w in zip(got, own, strict=True))


def summary(name: str, fwd: float, step: dict, evals: tuple[float, float]) -> str:
    """One line of the measured errors (printed; ``pytest -s`` shows it)."""
    upd = step["update"]
    worst = max(upd, key=upd.get)
    return (
        f"{name}: forward {fwd:.1e}; loss {step['loss']:.1e}, worst gradient {step['grad']:.1e}, "
        f"optimizer {step['optimizer/rounding']:.2f} of rounding, update median "
        f"{np.median(list(upd.values())):.1e} worst {upd[worst]:.1e} ({worst}; torch.optim "
        f"from our gradients: {step['update from our gradients'][worst]:.1e}); "
        f"eval {evals[0]:.1e} (vs torch's own step {evals[1]:.1e})"
    )


def plain_forward(model, inputs) -> tuple:
    if isinstance(model, torch.nn.Module):
        with torch.no_grad():  # train-mode BatchNorm still updates its statistics
            return (model(*inputs).numpy(),)
    return (model(*inputs),)


def adamw(lr=1e-2, weight_decay=0.1):
    """(ours, a factory of torch's) with the same settings."""
    return (
        mn.optim.AdamW(lr=lr, weight_decay=weight_decay),
        lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
    )


# ---------------------------------------------------------------------------- ResNet-18
def _resnet_ours(source: str) -> mnn.Module:
    if source == "port_sources":
        return OURS["ResNet18"](num_classes=10)
    from meganeura.models.resnet import resnet

    return resnet("resnet18", num_classes=10)


def _resnet_loss(ce):
    return lambda model, x, y: ce(model(x), y)


@pytest.mark.xdist_group("ports-resnet18")  # one worker compiles the kernels both use
@pytest.mark.parametrize("source", ["port_sources", "models.resnet"])
def test_resnet18_matches_torch(gpu_device, source):
    torch.manual_seed(0)
    theirs = TORCH["ResNet18"](num_classes=10)
    perturb_norms(theirs)
    ours = _resnet_ours(source)
    port(theirs, ours)
    # 64x64 inputs, batch 4: layer4's BatchNorms see 4 * 2 * 2 = 16 values per channel
    # (train mode, batch statistics); fewer amplify float32 rounding past FWD_RTOL.
    x = f32(rng.standard_normal((4, 3, 64, 64)))
    y = rng.integers(0, 10, 4).astype(np.int32)

    fwd = check_forward(ours, theirs, [x], plain_forward)  # train mode: batch statistics
    check_buffers(ours, theirs)  # running statistics updated once, num_batches_tracked 1
    sgd = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    tr = mn.Trainer(ours, mn.optim.SGD(**sgd), _resnet_loss(F.cross_entropy), device=gpu_device)
    t_loss = _resnet_loss(torch.nn.functional.cross_entropy)
    step = check_step(tr, ours, theirs, lambda ps: torch.optim.SGD(ps, **sgd), (x, y), t_loss)
    print(summary(f"resnet18 ({source})", fwd, step, check_eval(ours, theirs, [x], plain_forward)))


# ---------------------------------------------------------------------------- pre-LN transformer
VOCAB, SEQ = 50, 12


def _lm_loss(reshape, ce):
    def loss_fn(model, ids, targets):
        return ce(reshape(model(ids), (-1, VOCAB)), reshape(targets, (-1,)))

    return loss_fn


def test_pre_ln_transformer_matches_torch(gpu_device):
    torch.manual_seed(1)
    theirs = TORCH["PreLNTransformer"](vocab=VOCAB, max_len=16)
    perturb_norms(theirs)
    ours = OURS["PreLNTransformer"](vocab=VOCAB, max_len=16)
    port(theirs, ours)
    ids = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)

    fwd = check_forward(ours.eval(), theirs.eval(), [ids], plain_forward)
    ours.train(), theirs.train()
    opt, t_opt = adamw()
    tr = mn.Trainer(ours, opt, _lm_loss(F.reshape, F.cross_entropy), device=gpu_device)
    t_loss = _lm_loss(torch.reshape, torch.nn.functional.cross_entropy)
    step = check_step(tr, ours, theirs, t_opt, (ids, targets), t_loss)
    print(summary("pre-LN transformer", fwd, step, check_eval(ours, theirs, [ids], plain_forward)))


# ---------------------------------------------------------------------------- U-Net
def _unet_loss(mse):
    return lambda model, x, target: mse(model(x), target)


def _unet_pair(source: str):
    if source == "port_sources":
        return TORCH["UNet"](), OURS["UNet"]()
    from meganeura.models.unet import UNet, UNetConfig

    cfg = UNetConfig(3, 3, base_channels=8, channel_mult=(1, 2), num_groups=4)
    args = (cfg.in_channels, cfg.out_channels, cfg.base_channels, cfg.channel_mult)
    return TORCH["W5UNet"](*args, cfg.num_groups, cfg.eps), UNet(cfg)


@pytest.mark.parametrize("source", ["port_sources", "models.unet"])
def test_unet_matches_torch(gpu_device, source):
    """port_sources' U-Net has ConvTranspose2d, Upsample, GroupNorm and MaxPool2d;
    models.unet (workload W5) is checked against its twin in port_sources."""
    torch.manual_seed(2)
    theirs, ours = _unet_pair(source)
    perturb_norms(theirs)
    port(theirs, ours)
    x = f32(rng.standard_normal((2, 3, 16, 16)))
    target = f32(rng.standard_normal((2, 3, 16, 16)))

    fwd = check_forward(ours.eval(), theirs.eval(), [x], plain_forward)
    ours.train(), theirs.train()
    opt, t_opt = adamw()
    tr = mn.Trainer(ours, opt, _unet_loss(F.mse_loss), device=gpu_device)
    t_loss = _unet_loss(torch.nn.functional.mse_loss)
    step = check_step(tr, ours, theirs, t_opt, (x, target), t_loss)
    print(summary(f"U-Net ({source})", fwd, step, check_eval(ours, theirs, [x], plain_forward)))


# ---------------------------------------------------------------------------- BERT
BERT = dict(
    vocab_size=60,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,  # so a train-mode step is comparable without torch's masks
    attention_probs_dropout_prob=0.0,
)


def _bert_pair():
    import transformers

    from meganeura.models import bert

    cfg = transformers.BertConfig(**BERT, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(4)
    theirs = transformers.BertModel(cfg)
    perturb_norms(theirs)
    return theirs, bert.BertModel(bert.BertConfig(**BERT))


def _bert_batch():
    """ids, attention_mask (the second sequence: 6 tokens, 4 pads), token_type_ids (two
    segments) and the random weights of the loss."""
    ids = rng.integers(1, BERT["vocab_size"], (2, 10)).astype(np.int32)
    mask = np.ones((2, 10), np.int32)
    mask[1, 6:] = 0
    types = np.zeros((2, 10), np.int32)
    types[:, 4:] = 1
    ids[mask == 0] = types[mask == 0] = 0
    r_h = f32(rng.standard_normal((2, 10, BERT["hidden_size"])))
    r_p = f32(rng.standard_normal((2, BERT["hidden_size"])))
    return ids, mask, types, r_h, r_p


def _bert_forward(model, inputs) -> tuple:
    ids, mask, types = inputs
    if isinstance(model, torch.nn.Module):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
        return out.last_hidden_state.numpy(), out.pooler_output.numpy()
    out = model(ids, attention_mask=mask, token_type_ids=types)
    return out["last_hidden_state"], out["pooler_output"]


def _ours_bert_loss(model, ids, mask, types, r_h, r_p):
    out = model(ids, attention_mask=mask, token_type_ids=types)
    return F.sum(out["last_hidden_state"] * r_h) + F.sum(out["pooler_output"] * r_p)


def _torch_bert_loss(model, ids, mask, types, r_h, r_p):
    out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return (out.last_hidden_state * r_h).sum() + (out.pooler_output * r_p).sum()


def test_bert_encoder_matches_transformers(gpu_device):
    theirs, ours = _bert_pair()
    port(theirs, ours)
    batch = _bert_batch()

    fwd = check_forward(ours.eval(), theirs.eval(), batch[:3], _bert_forward)
    ours.train(), theirs.train()
    opt, t_opt = adamw()
    tr = mn.Trainer(ours, opt, _ours_bert_loss, device=gpu_device)
    step = check_step(tr, ours, theirs, t_opt, batch, _torch_bert_loss)
    print(summary("BERT", fwd, step, check_eval(ours, theirs, batch[:3], _bert_forward)))
