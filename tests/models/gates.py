"""The correctness gates of ``docs/workloads.md`` as assertions, shared by the model tests.

Forward: relative L2 error over the whole output; loss: relative error; backward: per
parameter gradient cosine and gradient-norm relative error, skipping parameters whose two
gradient norms are both below ``SKIP_NORM``. Strict f32 and fast (f16 storage) tolerances.
"""

from __future__ import annotations

import numpy as np

SKIP_NORM = 1e-5
STRICT = {"forward": 1e-4, "loss": 1e-5, "cosine": 0.999, "norm": 0.01}
FAST = {"forward": 1e-2, "loss": 1e-2, "cosine": 0.99, "norm": 0.10}


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / scale) if scale > 0 else float(np.linalg.norm(got))


def check_forward(got, want, gates: dict) -> float:
    err = rel_l2(got, want)
    assert err <= gates["forward"], f"forward relative L2 {err:.2e} > {gates['forward']}"
    return err


def check_loss(got: float, want: float, gates: dict) -> float:
    err = abs(got - want) / abs(want)
    assert err <= gates["loss"], f"loss {got} vs {want}: relative error {err:.2e}"
    return err


def check_grads(got: dict, want: dict, gates: dict) -> dict:
    """Per-parameter cosine and norm error; returns the worst of each and the count skipped."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    worst_cos, worst_norm, skipped = 1.0, 0.0, 0
    for k, w in want.items():
        g = np.asarray(got[k], np.float64).ravel()
        w = np.asarray(w, np.float64).ravel()
        ng, nw = np.linalg.norm(g), np.linalg.norm(w)
        if ng < SKIP_NORM and nw < SKIP_NORM:
            skipped += 1
            continue
        cos = float(g @ w / (ng * nw)) if ng > 0 and nw > 0 else 0.0
        norm = float(abs(ng - nw) / nw) if nw > 0 else float("inf")
        assert cos >= gates["cosine"], f"{k}: gradient cosine {cos:.6f} < {gates['cosine']}"
        assert norm <= gates["norm"], f"{k}: gradient norm error {norm:.2e} > {gates['norm']}"
        worst_cos, worst_norm = min(worst_cos, cos), max(worst_norm, norm)
    return {"cosine": worst_cos, "norm": worst_norm, "skipped": skipped}


def check_step(before: dict, got: dict, want: dict, gates: dict) -> dict:
    """One optimizer step: every updated parameter ``got`` against torch's ``want`` (relative
    L2 of the weights within the forward gate) and the update ``got - before`` against
    torch's (cosine and norm gates, skipping updates that are both below SKIP_NORM)."""
    worst_w, updates_got, updates_want = 0.0, {}, {}
    for k, w in want.items():
        err = rel_l2(got[k], w)
        assert err <= gates["forward"], f"{k}: weights after the step, relative L2 {err:.2e}"
        worst_w = max(worst_w, err)
        updates_got[k] = np.asarray(got[k], np.float64) - before[k]
        updates_want[k] = np.asarray(w, np.float64) - before[k]
    upd = check_grads(updates_got, updates_want, gates)
    return {"weights": worst_w, "update_cosine": upd["cosine"], "update_norm": upd["norm"]}
