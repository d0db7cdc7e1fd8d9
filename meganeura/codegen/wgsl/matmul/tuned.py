"""The measured best matmul plan per (M, K, N, layout), ahead of the heuristic
(``plan.choose_plan``)."""

from __future__ import annotations

# Measured best plan per (M, K, N, layout) of 2-D products (batch folded into M), layout
# "nn", "nt" (B stored [N, K]), "tn" (A stored [K, M]) or "tt". Paste the dict that
# ``bench/matmul_sweep.py`` prints. Shapes not listed fall back to ``heuristic_plan``.
# Measured best plans (bench/matmul_sweep.py on the H200, 2026-11-30; plans >= 3% faster than
# the heuristic's choice at the time; the gain over that choice in the comment). Re-swept with
# naga's runtime checks off (bench/results/sweeps/): 128x128x8 with prefetch became the best
# large plan (1.06-1.36x over /np), now the heuristic's, so the two square /np entries went;
# the small projections moved to 8-way splits ("re-swept"); the rest still held.
TUNED: dict[tuple[int, int, int, str], str] = {
    (512, 4096, 512, "nn"): "128x128x8/s8",  # long_k x1.15
    (128, 576, 576, "nt"): "64x64x16/s8",  # smollm2_q_o x1.04 (re-swept)
    (128, 576, 192, "nt"): "64x64x16/s8",  # smollm2_k_v x1.11 (re-swept)
    (128, 576, 1536, "nt"): "64x64x16/s4",  # smollm2_gate_up x1.11
    (1, 576, 192, "nt"): "gemv16",  # smollm2_dec_k_v x1.09
    (1, 576, 49152, "nt"): "gemv16",  # smollm2_dec_head x1.04
    (50, 720, 960, "nt"): "64x64x32/s8",  # smolvla_q x1.21 (re-swept)
    (50, 720, 320, "nt"): "64x64x32/s8",  # smolvla_k_v x1.21 (re-swept)
    (50, 960, 720, "nt"): "64x64x16/s8",  # smolvla_o x1.22 (re-swept)
    (50, 720, 2048, "nt"): "64x64x16/s8",  # smolvla_gate_up x1.08 (re-swept)
    (50, 2048, 720, "nt"): "64x64x16/s16",  # smolvla_down x1.06
    (16, 320, 320, "nt"): "64x64x16/s8",  # smolvla_cross_kv x1.21 (re-swept)
    (50, 720, 32, "nt"): "64x64x16/s8",  # smolvla_action_out x1.21 (re-swept)
    (1500, 384, 1152, "nt"): "128x128x16",  # whisper_qkv_fused x1.12
    (1500, 384, 1536, "nt"): "64x64x16",  # whisper_fc1 x1.17
    (1500, 1536, 384, "nt"): "64x64x16/s8",  # whisper_fc2 x1.29
    (1500, 384, 64, "nt"): "64x64x16/s8",  # whisper_train_head x1.25 (re-swept)
    (384, 1500, 1536, "tn"): "64x64x16/s8",  # whisper_dw_fc1 x1.46
    # the same projections written x @ W (W stored [K, N]), swept with --layout nn
    # (bench/results/sweeps/matmul_sweep_nn_h200.json): split-K pays even below SPLIT_MIN_WORK
    (128, 576, 576, "nn"): "64x64x16/s8",  # smollm2_q_o x1.05
    (128, 576, 192, "nn"): "64x64x16/s8",  # smollm2_k_v x1.62
    (50, 720, 960, "nn"): "64x64x32/s8",  # smolvla_q x1.09
    (50, 720, 320, "nn"): "64x64x16/s8",  # smolvla_k_v x2.06
    (50, 720, 2048, "nn"): "64x64x16/s8",  # smolvla_gate_up x1.13
    (50, 2048, 720, "nn"): "64x64x32/s8",  # smolvla_down x1.08
    (16, 320, 320, "nn"): "64x64x16/s8",  # smolvla_cross_kv x1.31
    (50, 720, 32, "nn"): "64x64x32/s8",  # smolvla_action_out x2.08
    (1500, 384, 64, "nn"): "64x64x16/s8/d2",  # whisper_train_head x1.27
}
