"""Correctness gates of ``docs/workloads.md`` (forward and backward gated independently).

Forward: relative L2 error over the entire output and the loss's relative error. Backward:
per-parameter gradient cosine and gradient-norm relative error, skipping parameters whose two
gradient norms are both < 1e-5; one optimizer step: every updated tensor (parameters and
BatchNorm running statistics) within the forward tolerance of PyTorch's, relative L2.

Thresholds (strict / fast): forward rel L2 <= 1e-4 (W1 1e-3) / 1e-2; loss rel <= 1e-5 (W1 1e-4)
/ 1e-2; gradient cosine >= 0.999 / 0.99; gradient-norm rel <= 1% / 10%.
"""

from __future__ import annotations

import numpy as np

GRAD_FLOOR = 1e-5


def thresholds(workload: str, precision: str) -> dict[str, float]:
    """The gate thresholds of one workload id (``"w1"``...) and precision."""
    if precision == "fast":
        return {"fwd_rel_l2": 1e-2, "loss_rel": 1e-2, "grad_cos": 0.99, "grad_norm_rel": 0.10}
    w1 = workload == "w1"
    return {
        "fwd_rel_l2": 1e-3 if w1 else 1e-4,
        "loss_rel": 1e-4 if w1 else 1e-5,
        "grad_cos": 0.999,
        "grad_norm_rel": 0.01,
    }


def rel_l2(ours, ref) -> float:
    a = np.asarray(ours, np.float64).ravel()
    b = np.asarray(ref, np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ, ours {a.shape} vs reference {b.shape}")
    den = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (den if den > 0 else 1.0)


def scalar_rel(ours: float, ref: float) -> float:
    return abs(float(ours) - float(ref)) / max(abs(float(ref)), 1e-30)


def forward_gate(th: dict, output=None, ref_output=None, loss=None, ref_loss=None) -> dict:
    """{"pass", "fwd_rel_l2", "loss_rel"}: output and/or loss against the reference."""
    figs: dict = {}
    ok = True
    if output is not None:
        figs["fwd_rel_l2"] = rel_l2(output, ref_output)
        ok &= figs["fwd_rel_l2"] <= th["fwd_rel_l2"]
    if loss is not None:
        figs["loss"], figs["ref_loss"] = float(loss), float(ref_loss)
        figs["loss_rel"] = scalar_rel(loss, ref_loss)
        ok &= figs["loss_rel"] <= th["loss_rel"]
    ok &= all(np.isfinite(v) for k, v in figs.items() if isinstance(v, float))
    return {"pass": bool(ok), **figs}


def backward_gate(th: dict, grads: dict, ref_grads: dict) -> dict:
    """Per-parameter cosine and norm error; the worst of each and the failing names.

    Raises:
        ValueError: the two sides name different parameters.
    """
    if set(grads) != set(ref_grads):
        missing = sorted(set(ref_grads) - set(grads))[:5]
        extra = sorted(set(grads) - set(ref_grads))[:5]
        raise ValueError(f"gradients: ours lacks {missing}, has extra {extra}")
    worst_cos, worst_norm, checked, skipped, failing = 1.0, 0.0, 0, 0, []
    for name in sorted(grads):
        g = np.asarray(grads[name], np.float64).ravel()
        r = np.asarray(ref_grads[name], np.float64).ravel()
        ng, nr = float(np.linalg.norm(g)), float(np.linalg.norm(r))
        if ng < GRAD_FLOOR and nr < GRAD_FLOOR:
            skipped += 1
            continue
        checked += 1
        cos = float(g @ r) / max(ng * nr, 1e-300)
        norm = abs(ng - nr) / max(nr, 1e-300)
        if not np.isfinite(cos) or not np.isfinite(norm):
            cos, norm = float("nan"), float("nan")
        worst_cos = min(worst_cos, cos) if np.isfinite(cos) else cos
        worst_norm = max(worst_norm, norm) if np.isfinite(norm) else norm
        if not (cos >= th["grad_cos"] and norm <= th["grad_norm_rel"]):
            failing.append(name)
    return {
        "pass": not failing and checked > 0,
        "grad_cos_min": worst_cos,
        "grad_norm_rel_max": worst_norm,
        "grads_checked": checked,
        "grads_skipped": skipped,
        "grads_failing": failing[:10],
    }


def step_gate(th: dict, after: dict, ref_after: dict, before: dict, adam: bool = False) -> dict:
    """One optimizer step: each updated float tensor within ``fwd_rel_l2`` of PyTorch's
    (relative L2; Adam: within ``grad_norm_rel``), plus the worst cosine of the updates
    themselves (after - before) where the update is resolvable in f32 (its norm > 1e-4 of the
    tensor's), as a figure.

    Adam's first step moves each element by ``lr * g / (|g| + eps)``: about ``lr`` whatever
    the gradient's size, so elements whose gradient is at rounding level move by ``+-lr`` on
    either side. On a small tensor (a BatchNorm bias of norm 0.06) that is a relative
    difference of ~1e-3 between two correct implementations (ResNet quick, strict: 5.7e-4,
    with every gradient's cosine >= 0.99999), hence the gradient tolerance for Adam."""
    tol = th["grad_norm_rel"] if adam else th["fwd_rel_l2"]
    worst, worst_name, delta_cos, failing = 0.0, None, 1.0, []
    for name in sorted(ref_after):
        if name not in after:
            raise ValueError(f"step gate: ours has no tensor {name!r} after the step")
        e = rel_l2(after[name], ref_after[name])
        if not e <= worst:
            worst, worst_name = e, name
        if not e <= tol:
            failing.append(name)
        b = np.asarray(before[name], np.float64)
        d_ours = np.asarray(after[name], np.float64) - b
        d_ref = np.asarray(ref_after[name], np.float64) - b
        n_ref, n_ours = np.linalg.norm(d_ref), np.linalg.norm(d_ours)
        if n_ref > 1e-4 * max(np.linalg.norm(b), 1e-30) and n_ours > 0:
            delta_cos = min(delta_cos, float((d_ours.ravel() @ d_ref.ravel()) / (n_ours * n_ref)))
    return {
        "pass": not failing,
        "weights_rel_l2_max": worst,
        "weights_tol": tol,
        "weights_worst": worst_name,
        "update_cos_min": delta_cos,
        "weights_failing": failing[:10],
    }


def verdict(parts: dict) -> str:
    """ "PASS" when every gate in ``parts`` ({"forward": {...}, ...}) passes, else "FAIL"."""
    return "PASS" if parts and all(p.get("pass") for p in parts.values()) else "FAIL"
