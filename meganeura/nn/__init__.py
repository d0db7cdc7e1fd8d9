"""Models as PyTorch writes them: ``mn.nn.Module`` trees of layers with torch.nn's names, traced
into the typed graph on call (``meganeura.nn.compiled``).

``import meganeura.nn.functional as F`` gives the ops; ``meganeura.nn.init`` the initializers.
"""

from . import functional, init, lora
from .compiled import CacheInfo, CompiledModule, SignatureError, trace
from .layers import *  # noqa: F403 - the layers, listed in nn.layers
from .layers import __all__ as _layers_all
from .lora import LoRALinear
from .module import IncompatibleKeys, Module, StateDictError
from .parameter import Buffer, Parameter, UninitializedParameterError
from .tracing import TraceError

__all__ = [
    "Buffer",
    "CacheInfo",
    "CompiledModule",
    "IncompatibleKeys",
    "LoRALinear",
    "Module",
    "Parameter",
    "SignatureError",
    "StateDictError",
    "TraceError",
    "UninitializedParameterError",
    "functional",
    "init",
    "lora",
    "trace",
    *_layers_all,
]
