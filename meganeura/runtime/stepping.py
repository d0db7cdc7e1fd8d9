"""How a Session submits each step: the chunks of its command buffers and whether they are
recorded ahead of the call. Each setting is read when a Session is created; results never
depend on them (``tests/runtime/test_submit_chunks.py``, ``test_prepared_steps.py``).
"""

from __future__ import annotations

import os

#: ``(first, size)`` of the step's submissions (:func:`.fastpath.chunk_bounds`): the first
#: ``first`` dispatches, then ``size`` at a time; ``size`` 0 submits the step as one command
#: buffer. ``MEGANEURA_SUBMIT_CHUNKS="first,size"`` (or ``"0"``) overrides it when a Session is
#: created. Measured on the H200 machine (``bench/submit_chunks.py``,
#: ``bench/results/submit_chunks_h200.json``, settings interleaved in one process): against one
#: command buffer, ResNet-50 train batch 4 (670 dispatches) 12.78 -> 10.65 ms, SmolVLA expert train
#: (903) 13.74 -> 9.56, SmolLM2 prefill 128 (663) 6.52 -> 5.04; (16, 64) was best or within 1% of
#: the best of (16, 128), (32, 256), (8, 32) in each.
SUBMIT_CHUNKS = (16, 64)

#: Record each step's command buffers right after the previous step is submitted, while the
#: GPU runs it (:meth:`.fastpath.Recorder.prepare`), so that a call only ends, finishes and
#: submits them. Read when a Session is created (:func:`set_pre_encode`); results do not
#: depend on it. Measured on the H200 (``bench/results/lever_ab_h200_pre_encode.json``,
#: interleaved, off / on): W5 fwd 1.245, W2 fwd 1.187, W3 train 1.065, W4 fwd 1.031.
PRE_ENCODE = True


#: With :data:`PRE_ENCODE`, a step of ``2 * first`` to ``first + size`` dispatches (one
#: command buffer otherwise) is submitted as its first ``first`` and the rest
#: (``chunk_bounds(split_short=True)``): a call's host work before the GPU starts is then
#: finishing ``first`` dispatches, not all of them (finishing costs ~3 us a dispatch on the H200:
#: ``bench/results/call_phases_h200.json``). Read when a Session is created. Measured on the
#: H200 (``lever_ab_h200_split_short.json``, off / on): W5 fwd (49 dispatches) 1.091, W4 fwd
#: (44) 1.001.
SPLIT_SHORT = True


def set_split_short(on: bool) -> None:
    """Switch :data:`SPLIT_SHORT` for Sessions created from now on."""
    global SPLIT_SHORT
    SPLIT_SHORT = bool(on)


def set_pre_encode(on: bool) -> None:
    """Switch :data:`PRE_ENCODE` for Sessions created from now on."""
    global PRE_ENCODE
    PRE_ENCODE = bool(on)


def submit_chunks() -> tuple[int, int]:
    """``(first, size)`` from ``MEGANEURA_SUBMIT_CHUNKS`` or :data:`SUBMIT_CHUNKS`.

    Raises:
        ValueError: the variable is not ``"0"`` or two non-negative integers ``"first,size"``.
    """
    raw = os.environ.get("MEGANEURA_SUBMIT_CHUNKS")
    if raw is None:
        return SUBMIT_CHUNKS
    parts = raw.replace(" ", "").split(",")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        vals = []
    if vals == [0]:
        return (0, 0)
    if len(vals) != 2 or min(vals) < 0:
        raise ValueError(
            f'MEGANEURA_SUBMIT_CHUNKS must be "0" or "first,size" (non-negative integers), '
            f"got {raw!r}"
        )
    return vals[0], vals[1]
