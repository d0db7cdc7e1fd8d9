"""Generic tests over the op database (``tests/opinfo``): every sample of every entry runs
forward against its PyTorch float64 reference, its gradients against torch.autograd, and the
op mid-graph (operands made by kernels, result consumed by kernels), all on the GPU.

The no-GPU checks keep the database honest: entry and sample names are unique, every xfail
key names a real sample, and each entry's ``ops`` really occur in the graphs its samples build
(the completeness test trusts that field).

Sample data is generated once per entry from a seed derived from the entry's name, so test
ids and values are stable across runs and processes (pytest-xdist safe).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from .opinfo import DATABASE, FAMILIES, OpInfo, Sample
from .opinfo.runner import (
    check_forward,
    check_gradients,
    entry_samples,
    grad_positions,
    run_forward,
    run_gradients,
    run_mid_graph,
    symbolic_graph,
)

MODES = ("forward", "gradients", "mid_graph")
BY_NAME = {info.name: info for info in DATABASE}


@cache
def samples_of(name: str) -> tuple[Sample, ...]:
    """The entry's samples (deterministic: the generator is seeded by the entry's name)."""
    return tuple(entry_samples(BY_NAME[name]))


def _xfail_reason(info: OpInfo, sample: Sample, mode: str) -> str | None:
    return info.xfail.get(f"{sample.name}:{mode}") or info.xfail.get(sample.name)


def _cases(mode: str) -> list:
    out = []
    for info in DATABASE:
        if mode == "gradients" and not info.differentiable:
            continue
        if mode == "mid_graph" and not info.mid_graph:
            continue
        for s in samples_of(info.name):
            if mode == "gradients" and not grad_positions(s):
                continue
            reason = _xfail_reason(info, s, mode)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(info.name, s.name, id=f"{info.name}-{s.name}", marks=marks))
    return out


def _get(entry: str, sample: str) -> tuple[OpInfo, Sample]:
    info = BY_NAME[entry]
    (s,) = [s for s in samples_of(entry) if s.name == sample]
    return info, s


@pytest.mark.gpu
@pytest.mark.parametrize("entry,sample", _cases("forward"))
def test_forward(entry, sample, gpu_device):
    info, s = _get(entry, sample)
    ours, ref = run_forward(info, s, gpu_device)
    check_forward(ours, ref, s.rtol or info.rtol, f"{entry}-{sample}")


@pytest.mark.gpu
@pytest.mark.parametrize("entry,sample", _cases("gradients"))
def test_gradients(entry, sample, gpu_device):
    info, s = _get(entry, sample)
    pairs = run_gradients(info, s, gpu_device)
    if not pairs:
        pytest.skip("the op's value is empty: no gradient to compare")
    check_gradients(pairs, info.grad_cos, info.grad_rel, f"{entry}-{sample}")


@pytest.mark.gpu
@pytest.mark.parametrize("entry,sample", _cases("mid_graph"))
def test_mid_graph(entry, sample, gpu_device):
    info, s = _get(entry, sample)
    res = run_mid_graph(info, s, gpu_device)
    check_forward(res.ours, res.ref, s.rtol or info.rtol, f"{entry}-{sample} mid-graph")
    check_gradients(res.grads, info.grad_cos, info.grad_rel, f"{entry}-{sample} mid-graph")


# ---- the database itself (no GPU) -------------------------------------------------------------
def test_every_family_module_is_in_the_database():
    here = Path(__file__).parent / "opinfo"
    modules = {p.stem for p in here.glob("*.py")} - {"__init__", "runner"}
    unlisted = sorted(modules - set(FAMILIES))
    assert not unlisted, f"tests/opinfo modules missing from FAMILIES: {unlisted}"


def test_names_are_unique_and_xfail_keys_exist():
    names = [info.name for info in DATABASE]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for info in DATABASE:
        snames = [s.name for s in samples_of(info.name)]
        assert snames and all(snames), f"{info.name}: samples need non-empty names"
        assert len(snames) == len(set(snames)), f"{info.name}: duplicate sample names"
        for key in info.xfail:
            base, _, mode = key.partition(":")
            assert base in snames, f"{info.name}: xfail key {key!r} names no sample"
            assert mode in ("", *MODES), f"{info.name}: xfail key {key!r}: unknown test {mode!r}"


@pytest.mark.parametrize("entry", sorted(BY_NAME))
def test_entry_ops_occur_in_its_graphs(entry):
    """Each op an entry claims to cover appears in some sample's forward or backward graph."""
    info = BY_NAME[entry]
    seen = {n.op for s in samples_of(entry) for n in symbolic_graph(info, s).nodes}
    missing = set(info.ops) - seen
    assert not missing, f"{entry} lists ops its samples never build: {sorted(missing)}"
