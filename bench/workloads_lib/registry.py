"""The workloads by id (``docs/workloads.md``)."""

from __future__ import annotations

from .w1_llm import SmolLM2
from .w2_vla import SmolVLA
from .w3_resnet import ResNet50
from .w4_whisper import Whisper
from .w5_unet import UNetWorkload

WORKLOADS = {w.id: w for w in (SmolLM2(), SmolVLA(), ResNet50(), Whisper(), UNetWorkload())}
