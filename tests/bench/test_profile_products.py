"""``workloads_lib.ours.matmul_products``: a profile's matmul dispatches grouped by product and
plan, from ``Program.meta["matmuls"]`` (compiled for the H200's limits, no GPU run: the
timings are made up, the grouping and the arithmetic on them are what is checked)."""

from __future__ import annotations

import pytest

from bench.workloads_lib.ours import matmul_products
from meganeura.codegen.kernel import H200_LIMITS
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.runtime.profiler import DispatchTiming, Profile


def _program():
    b = GraphBuilder()
    x = b.input("x", (50, 720))
    h = x @ b.input("w1", (720, 2048))
    b.output("y", h @ b.input("w2", (2048, 720)))
    return compile(b.build(), CompileOptions(), H200_LIMITS)


def test_matmul_products_groups_dispatches_by_product_and_plan():
    program = _program()
    meta = {e["node"]: e for e in program.meta["matmuls"]}
    assert len(meta) == 2
    repeats, timings = 2, []
    for r in range(repeats):
        for i, d in enumerate(program.dispatches):
            # 10 us for the first dispatch, 20 for the second, ...
            timings.append(
                DispatchTiming(i, d.name, r, 0.0, 1e4 * (i + 1), d.flops, d.bytes, d.grid)
            )
    prof = Profile(tuple(timings), repeats, "test", 1.0, "test")
    rows = matmul_products(prof, program)
    step_ns = sum(1e4 * (i + 1) for i in range(len(program.dispatches)))
    by_product = {}
    for row in rows:
        by_product.setdefault(row["product"], []).append(row)
    assert set(by_product) == {"50x720x2048 nn b1", "50x2048x720 nn b1"}
    for i, d in enumerate(program.dispatches):
        node_ids = [int(t) for t in d.name.split()[0][1:].split("+")]
        entry = next(meta[n] for n in node_ids if n in meta)
        key = f"{entry['m']}x{entry['k']}x{entry['n']} {entry['layout']} b{entry['batch']}"
        row = next(
            r for r in by_product[key] if (r["plan"] == "sum_splits") == ("sum_splits" in d.name)
        )
        assert row["count"] >= 1
        if row["count"] == 1:
            assert row["us"] == pytest.approx(10.0 * (i + 1))
            assert row["share"] == pytest.approx(1e4 * (i + 1) / step_ns)
            assert row["TFLOP_per_s"] == pytest.approx(d.flops / (1e4 * (i + 1)) / 1e3)
            if row["plan"] != "sum_splits":
                assert row["plan"] == f"{entry['plan']} ({entry['source']})"
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
