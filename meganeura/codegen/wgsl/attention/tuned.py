"""The measured best lane plan per (mode, problem sizes) on the H200, ahead of the automatic
rule (``plan.choose_plan``).

Keyed by the kernel's mode (``fwd`` also covers the forward that stores its log-sum-exp,
``dq`` the query gradient that computes its rows' delta) and its ``plan.Dims`` (batch, kv
heads, query heads per kv head, query and key lengths, head dims); values are
``(rows, lanes, tile)``. GPU adapters only: CPU adapters (``Limits.cpu``) ignore the table, an
entry the adapter cannot run (``plan.check_plan``) falls back to the rule, and
``plan.LANE_OVERRIDE`` wins over both. The plans measured on the adapter at hand
(``Limits.attention_plans``: its per-device tuning cache, which ``bench/attention_plans.py
--record`` writes) also win over this table; it is the fallback for GPUs without a cache, and
is not rewritten after each sweep. ``plan.set_tuned(False)`` turns off both.

From ``bench/attention_plans.py`` on the H200 (2026-12-03, fourth session,
``bench/results/attention_plans_h200.json``; per-kernel GPU time from profiler timestamps,
median of 10, the default plan timed in the same process; 7-9 of ~40 candidate plans per
kernel timed before the 90 s budget ran out): each kernel's best plan where it beat the rule's
plan by >= 3%, with both times in the comment. The automatic rule was tuned at L = 2048; at the
workloads' short sequences it picks 4 rows x 16 lanes with 32-entry tiles.
"""

from __future__ import annotations

from .plan import Dims

SMOLLM2 = Dims(b=1, hkv=3, group=3, lq=128, lk=128, d=64, dv=64)  # W1, causal
SMOLVLA_SELF = Dims(b=1, hkv=5, group=3, lq=50, lk=50, d=64, dv=64)  # W2 even layers, causal
SMOLVLA_CROSS = Dims(b=1, hkv=5, group=3, lq=50, lk=16, d=64, dv=64)  # W2 odd layers
WHISPER = Dims(b=1, hkv=6, group=1, lq=1500, lk=1500, d=64, dv=64)  # W4

TUNED: dict[tuple[str, Dims], tuple[int, int, int]] = {
    ("fwd", SMOLLM2): (8, 16, 32),  # fwd+lse 23.2 -> 17.4 us
    ("dq", SMOLLM2): (4, 16, 16),  # dq+delta 30.8 -> 23.9
    ("dkv", SMOLLM2): (2, 32, 32),  # 59.5 -> 54.0
    ("dk", SMOLLM2): (2, 32, 32),  # 38.8 -> 36.0
    ("dv", SMOLLM2): (4, 16, 64),  # 33.2 -> 30.4
    ("fwd", SMOLVLA_SELF): (4, 16, 16),  # fwd+lse 14.0 -> 12.7, fwd 15.4 -> 14.3
    ("dq", SMOLVLA_SELF): (4, 16, 16),  # dq+delta 18.6 -> 16.3
    ("dkv", SMOLVLA_SELF): (2, 32, 32),  # 36.8 -> 33.6
    ("dk", SMOLVLA_SELF): (2, 32, 32),  # 25.1 -> 22.5
    ("dv", SMOLVLA_SELF): (4, 16, 64),  # 21.3 -> 20.0
    ("fwd", SMOLVLA_CROSS): (16, 8, 16),  # fwd+lse 12.2 -> 11.6, fwd 14.0 -> 13.2
    ("dkv", SMOLVLA_CROSS): (2, 32, 32),  # 39.0 -> 37.4
    ("dk", SMOLVLA_CROSS): (2, 32, 32),  # 28.0 -> 25.6
    ("dv", SMOLVLA_CROSS): (8, 16, 32),  # 23.9 -> 22.1
}

# Lane kernels that split their keys over workgroups (``splits.choose_long_split``): (mode,
# Dims) -> (lane plan, chunks, whether the chunks prefetch their next key tile), measured on
# the H200 (bench/attention_split.py; partial kernel + merge or sum, us). The forward
# (attention_split_h200.json, seventh session; attention_split_h200_prefetch.json, eighth):
# 283 unsplit (32x2x16) -> 225 (32x1x8 in 3 chunks), 216 with prefetching chunks; 32x2x16 in
# 3: 248, in 4: 272. dq with its delta (attention_split_h200_dq.json, eighth session): 526
# unsplit (32x2x16, prefetching) -> 355 (32x1x8 in 3 chunks; 367 prefetching); 32x2x16 in 3:
# 468 prefetching, 872 not.
TUNED_SPLIT: dict[tuple[str, Dims], tuple[tuple[int, int, int], int, bool]] = {
    ("fwd", WHISPER): ((32, 1, 8), 3, True),
    ("dq", WHISPER): ((32, 1, 8), 3, False),
}

# dkv half's query split (``dkv_half.choose_query_split``) where its split kernel beat the lane
# dkv kernel the rule runs there: Dims -> chunks of each query head's rows. On the H200
# (bench/attention_split.py, attention_split_h200_dkv_short.json, ninth session; partial + sum,
# us): SmolLM2 54.5 lane -> 35.1 in 8 chunks (44.2 in 4, 110.6 unsplit); SmolVLA's cross
# attention 38.7 -> 31.6 in 4 (the same in 8). SmolVLA's self attention stays on the lane
# kernel (34.7 against 34.6 in 4 or 8).
TUNED_QUERY_SPLIT: dict[Dims, int] = {
    SMOLLM2: 8,
    SMOLVLA_CROSS: 4,
}
