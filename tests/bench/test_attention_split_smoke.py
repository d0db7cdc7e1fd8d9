"""Smoke test of ``bench/attention_split.py --quick`` on the test adapter: the chunk count it
asks for is what the compiled forward runs (a partial kernel with that many chunks and a merge,
or the plain kernel for one chunk, even where the long split would apply by itself), and every
variant matches torch. No timing is asserted."""

from __future__ import annotations

from bench.attention_split import main


def test_attention_split_quick(gpu_device, monkeypatch):
    from meganeura.codegen.wgsl.attention import plan as attention_plan

    # as on a GPU, where the long split applies by itself: one chunk must still mean unsplit
    monkeypatch.setattr(attention_plan, "LONG_SPLIT_OVERRIDE", True)
    rows = main(["--quick", "--chunks", "1,3", "--plans", "16x2x16", "--repeats", "1",
                 "--warmup", "1", "--out-name", "attention_split_smoke"])  # fmt: skip
    plain, split = rows["sdpa_fwd_whisper_16x2x16_c1"], rows["sdpa_fwd_whisper_16x2x16_c3"]
    assert [k.split(" ", 1)[1] for k in plain["kernels"]] == ["scaled_dot_product_attention fwd"]
    assert [k.split(" ", 1)[1] for k in split["kernels"]] == [
        "scaled_dot_product_attention fwd split 3x32",
        "scaled_dot_product_attention merge 3",
    ]
    assert plain["merge_ms"] == 0 and split["merge_ms"] > 0
    assert max(plain["rel_err"], split["rel_err"]) <= 1e-5
    assert attention_plan.LONG_SPLIT_OVERRIDE is True  # restored after each variant
