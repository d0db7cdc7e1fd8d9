"""PyTorch's side of a cell: precision settings, the execution modes and their step functions.

Modes: ``eager``; ``compile`` (``torch.compile(model)``); ``reduce_overhead``
(``torch.compile(model, mode="reduce-overhead")``: CUDA graphs); ``eager_bf16`` (eager under
``torch.autocast(bfloat16)``, fast precision only). The model is compiled, not the optimizer
step: the update runs eagerly after the compiled forward and backward in every mode.
"""

from __future__ import annotations

MODES = ("eager", "compile", "reduce_overhead", "eager_bf16")


def setup(precision: str, threads: int | None = None):
    """Import torch with TF32 off (strict) or on (fast); returns (torch, device string)."""
    import torch

    tf32 = precision == "fast"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if not torch.cuda.is_available():
        torch.set_num_threads(threads or 1)  # lavapipe shares the two CI cores
        return torch, "cpu"
    return torch, "cuda"


def compiled(m, mode: str):
    """``m`` itself (eager modes) or its ``torch.compile`` wrapper."""
    import torch

    if mode == "compile":
        return torch.compile(m)
    if mode == "reduce_overhead":
        return torch.compile(m, mode="reduce-overhead")
    return m


def make_optimizer(params, spec: tuple[str, float]):
    import torch

    kind, lr = spec
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}")


def steps(workload, case, m, batch, mode: str, dev: str):
    """{"run", "result"} of a generic case on PyTorch's side, ``m`` on ``dev``.

    ``run`` is one timed call: the forward (no grad), or a training step (zero_grad, forward,
    loss, backward, optimizer step, the loss read back), or forward + backward alone.
    """
    import torch

    fn = compiled(m, mode)
    bf16 = mode == "eager_bf16"
    mark = mode == "reduce_overhead"

    def autocast():
        return torch.autocast(dev, torch.bfloat16, enabled=bf16)

    out: dict = {}
    if case.kind == "fwd":

        def run():
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad(), autocast():
                out["y"] = workload.torch_forward(fn, *batch)
            return out["y"]

        return {"run": run, "result": lambda: out["y"].detach().float().cpu().numpy()}

    opt = make_optimizer(m.parameters(), case.optimizer)
    update = case.kind in ("train", "train_steps")
    n = case.params.get("steps", 1) if case.kind == "train_steps" else 1

    def one():
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = workload.torch_loss(fn, *batch)
        loss.backward()
        if update:
            opt.step()
        return loss

    def run():
        for _ in range(n - 1):
            one()
        out["loss"] = float(one().item())
        return out["loss"]

    return {"run": run, "result": lambda: out.get("loss")}


def reference(workload, case, m, batch) -> dict:
    """The gate's reference on the current device, strict f32 eager: the forward output, or
    the loss, every gradient and the state after one optimizer step (``train``: also
    ``train_steps``' loss after its steps)."""
    import torch

    if case.kind in ("fwd",):
        with torch.no_grad():
            return {"output": workload.torch_forward(m, *batch).detach().cpu().numpy()}
    before = {k: v.detach().cpu().numpy().copy() for k, v in m.state_dict().items()}
    opt = make_optimizer(m.parameters(), case.optimizer)
    opt.zero_grad(set_to_none=True)
    loss = workload.torch_loss(m, *batch)
    loss.backward()
    grads = {}
    for name, p in m.named_parameters():
        if p.requires_grad:
            g = p.grad
            grads[name] = (torch.zeros_like(p) if g is None else g).detach().cpu().numpy()
    opt.step()
    after, seen = {}, set()
    for k, v in m.state_dict().items():  # tied tensors (HF's lm_head) once, by first name
        if v.dtype.is_floating_point and v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            after[k] = v.detach().cpu().numpy().copy()
    ref = {"loss": float(loss.item()), "grads": grads, "before": before, "after": after}
    if case.kind == "train_steps":
        for _ in range(case.params["steps"] - 1):
            opt.zero_grad(set_to_none=True)
            loss = workload.torch_loss(m, *batch)
            loss.backward()
            opt.step()
        ref["final_loss"] = float(loss.item())
    return ref
