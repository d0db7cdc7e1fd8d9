"""Smoke test of ``bench/attention_split.py --quick`` on the test adapter: the chunk count it
asks for is what the compiled forward, dq and dkv half run (a partial kernel with that many
chunks and a merge or sum, or the plain kernel for one chunk, even where the long split would
apply by itself), prefetching chunks when asked, and every variant matches torch. No timing
is asserted."""

from __future__ import annotations

from bench.attention_split import main


def test_attention_split_quick(gpu_device, monkeypatch):
    from meganeura.codegen.wgsl.attention import dkv_half, tile_loads
    from meganeura.codegen.wgsl.attention import plan as attention_plan
    from meganeura.codegen.wgsl.attention import splits as attention_splits
    from meganeura.training import device_limits

    # as on a GPU, where the long split applies by itself: one chunk must still mean unsplit
    monkeypatch.setattr(attention_splits, "LONG_SPLIT_OVERRIDE", True)
    rows = main(["--quick", "--modes", "fwd,dq,dkv", "--chunks", "0,1,3", "--plans", "16x2x16",
                 "--prefetch", "0,1", "--repeats", "1", "--warmup", "1",
                 "--out-name", "attention_split_smoke"])  # fmt: skip
    sdpa, dq = "scaled_dot_product_attention", "scaled_dot_product_attention_backward_query"
    want = {
        "sdpa_fwd_whisper_16x2x16_c1": [f"{sdpa} fwd"],
        "sdpa_fwd_whisper_16x2x16_c3": [f"{sdpa} fwd split 3x32", f"{sdpa} merge 3"],
        "sdpa_fwd_whisper_16x2x16_c3_prefetch": [f"{sdpa} fwd split 3x32", f"{sdpa} merge 3"],
        "sdpa_dq_whisper_16x2x16_c1": [f"{dq} dq+delta"],
        "sdpa_dq_whisper_16x2x16_c3": [f"{dq} dq+delta split 3x32", f"{dq} dq+delta sum 3"],
        "sdpa_dq_whisper_16x2x16_c3_prefetch": [
            f"{dq} dq+delta split 3x32",
            f"{dq} dq+delta sum 3",
        ],
    }
    kv = "scaled_dot_product_attention_backward_key_value"
    # 0 chunks: the lane kernels (one lane dkv at 96 query rows: its registers' rule)
    want["sdpa_dkv_whisper_lane_c0"] = [f"{kv} dkv"]
    if device_limits(gpu_device).subgroups:  # the half kernel needs subgroups
        want["sdpa_dkv_whisper_32x2x16_c1"] = [f"{kv} dkv half"]
        want["sdpa_dkv_whisper_32x2x16_c3"] = [f"{kv} dkv half split 3x32", f"{kv} dkv half sum 3"]
    assert sorted(rows) == sorted(want)
    for case, kernels in want.items():
        row = rows[case]
        assert [k.split(" ", 1)[1] for k in row["kernels"]] == kernels, case
        assert (row["merge_ms"] > 0) == (row["chunks"] > 1), case
        assert row["rel_err"] <= 1e-5, case
    # every switch put back after each variant
    assert attention_splits.LONG_SPLIT_OVERRIDE is True
    assert attention_splits.LONG_SPLIT_CHUNKS == {} and attention_plan.LANE_OVERRIDE == {}
    assert tile_loads.SPLIT_PREFETCH == [True]
    assert dkv_half.QUERY_SPLIT_CHUNKS == [None] and attention_plan.DKV_HALF is None
