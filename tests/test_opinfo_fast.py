"""The op database in the fast mode (``CompileOptions(precision="fast")``): every sample runs
mid-graph (operands made by kernels, result consumed by kernels), so its operands, its
result and every intermediate of its backward are stored as f16, and every emitter is compiled
with f16 bindings. A raw read or store of an f16 binding is a WGSL type error, so this run
also proves that each emitter goes through ``KernelBuilder.load/store`` and ``Src.at``.

The float operands are rounded to f16 before either side sees them (so the f16 storage of
the operands is exact and both sides compute on identical values); the reference is PyTorch
in float64 as in ``test_opinfo``. Bounds are the fast mode's contract: forward relative
error <= 1e-2 (or the entry's own bound when looser), gradient cosine >= 0.99 and norm
relative error <= 5e-2. Samples whose operands or results lie outside f16's range (above
65504) are skipped: storing them as f16 is outside that contract by definition.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from .opinfo import DATABASE
from .opinfo.runner import check_forward, check_gradients, reference, run_forward, run_mid_graph
from .test_opinfo import BY_NAME, _xfail_reason, samples_of

F16_MAX = 65504.0
RTOL, GRAD_COS, GRAD_REL = 1e-2, 0.99, 5e-2
# Samples whose f16 storage costs more than the bounds above, with the reason, as
# (entry, sample) -> (forward rtol, gradient norm relative error).
LOOSER = {
    # sigmoid's backward reads its stored output s: at this sample's x = 6.844, s = 0.998935
    # is stored as 0.999 in f16, so the one-element gradient s(1 - s) is off by 8.3%.
    ("sigmoid", "scalar"): (RTOL, 0.15),
}
# Samples whose intermediates lie outside f16 by construction, with the reason.
OUTSIDE_F16 = {
    ("normalize", "zero_row"): "the divisor is eps = 1e-12, 0 in f16 (torch's float16 "
    "normalize gives NaN there too)",
    ("normalize", "norm_below_eps"): "a norm below eps = 1e-12: the row rounds to 0 in f16",
    ("cosine_similarity", "zero_row"): "the divisor is eps = 1e-8, 0 in f16 (torch's float16 "
    "cosine_similarity gives NaN there too)",
    ("cosine_similarity", "norm_below_eps"): "a row of ~1e-9, below f16's smallest subnormal",
}


def _cases() -> list:
    out = []
    for info in DATABASE:
        for s in samples_of(info.name):
            marks = []
            if _xfail_reason(info, s, "mid_graph" if info.mid_graph else "forward"):
                marks = [pytest.mark.skip(reason="an expected failure in strict mode")]
            elif (info.name, s.name) in OUTSIDE_F16:
                marks = [pytest.mark.skip(reason=OUTSIDE_F16[info.name, s.name])]
            out.append(pytest.param(info.name, s.name, id=f"{info.name}-{s.name}", marks=marks))
    return out


def _half_sample(entry: str, sample: str):
    info = BY_NAME[entry]
    (s,) = [s for s in samples_of(entry) if s.name == sample]
    args = []
    for a in s.args:
        if isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating):
            if not np.isfinite(a).all() or np.abs(a).max(initial=0) > F16_MAX:
                pytest.skip("operands outside f16's finite range")
            a = a.astype(np.float16).astype(np.float32)
        args.append(a)
    return info, dataclasses.replace(s, args=tuple(args))


@pytest.mark.gpu
@pytest.mark.parametrize("entry,sample", _cases())
def test_fast_mode(entry, sample, gpu_device):
    info, s = _half_sample(entry, sample)
    ref = np.asarray(reference(info, s))
    finite = ref[np.isfinite(ref)] if ref.dtype.kind == "f" else ref
    if ref.dtype.kind == "f" and finite.size and np.abs(finite).max() > F16_MAX:
        pytest.skip("the result exceeds f16's range")
    rtol_fast, rel_fast = LOOSER.get((entry, sample), (RTOL, GRAD_REL))
    rtol = max(s.rtol or info.rtol, rtol_fast)
    if not info.mid_graph:
        ours, ref = run_forward(info, s, gpu_device, precision="fast")
        check_forward(ours, ref, rtol, f"{entry}-{sample} fast")
        return
    res = run_mid_graph(info, s, gpu_device, precision="fast")
    check_forward(res.ours, res.ref, rtol, f"{entry}-{sample} fast mid-graph")
    grad_cos = min(info.grad_cos, GRAD_COS)
    grad_rel = max(info.grad_rel, rel_fast)
    check_gradients(res.grads, grad_cos, grad_rel, f"{entry}-{sample} fast mid-graph")
