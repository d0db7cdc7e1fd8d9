"""Module: the base class of models, mirroring ``torch.nn.Module``.

Assigning a Parameter, Buffer or Module to an attribute in ``__init__`` registers it under that
name; dotted paths (``layer1.0.conv1.weight``) are PyTorch's for the same architecture, so state
dicts move both ways. ``forward`` is written with ``meganeura.nn.functional`` ops on Tensors.

Calling a module with NumPy arrays (``model(x)``) traces ``forward`` for that signature,
compiles it, caches the program and returns NumPy (``meganeura.nn.compiled``); inside a traced
``forward`` calling a submodule just runs its ``forward``, and reading ``self.weight`` gives the
parameter's graph Tensor (``meganeura.nn.tracing``).
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .parameter import (
    VERSION,
    Buffer,
    Parameter,
    UninitializedParameterError,
    _as_array,
    bump_version,
    convert,
)
from .tracing import current_trace

# Keys PyTorch and Hugging Face checkpoints carry that are not parameters of the model, and the
# optimizer state of meganeura's Trainer checkpoints (``optimizer/<param>.<suffix>``,
# ``training.checkpoints.OPTIMIZER_PREFIX``; no module path holds a "/"): loaded when the model
# has them, skipped (not "unexpected") when it has not.
KNOWN_EXTRA_KEYS = (
    re.compile(r"(^|\.)num_batches_tracked$"),
    re.compile(r"(^|\.)position_ids$"),
    re.compile(r"(^|\.)attn\.(masked_)?bias$"),
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
    re.compile(r"^optimizer/"),
)


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` did not match (``torch.nn.modules.module._IncompatibleKeys``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateDictError(RuntimeError):
    """A state dict does not fit the model; nothing was loaded."""


class Module:
    """Base class of every layer and model (``torch.nn.Module``).

    Subclasses call ``super().__init__()`` first, assign parameters (:class:`Parameter`),
    buffers (:class:`Buffer` or ``register_buffer``) and submodules as attributes, and define
    ``forward``.

    Attributes:
        training: train mode (True, the default) or eval mode; ``train()`` / ``eval()`` set it
            on the whole tree. Dropout and BatchNorm read it while tracing.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_compiled", None)

    # ------------------------------------------------------------------ registration
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(
                f"cannot assign {name!r} before Module.__init__() (call super().__init__() first)"
            )
        bump_version()
        params, buffers, modules = self._parameters, self._buffers, self._modules
        kinds = ((Parameter, params), (Module, modules), (Buffer, buffers))
        table = next((t for cls, t in kinds if isinstance(value, cls)), None)
        if table is not None:
            # replacing keeps the entry's place, as in torch (Sequential indices, state_dict order)
            if name not in table:
                self._drop(name)
            table[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign {type(value).__name__} as parameter {name!r} "
                    "(a meganeura.nn.Parameter or None expected)"
                )
            params[name] = None
        elif name in buffers:
            if value is None:
                buffers[name] = None
            elif buffers[name] is None:
                buffers[name] = Buffer(value)
            else:
                buffers[name].copy_(value)
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as submodule {name!r}")
            modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def _drop(self, name: str) -> None:
        bump_version()
        for d in (self._parameters, self._buffers, self._modules):
            d.pop(name, None)
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str):
        d = self.__dict__
        if "_parameters" in d:
            for table in (d["_parameters"], d["_buffers"]):
                if name in table:
                    obj = table[name]
                    trace = current_trace()
                    if trace is not None and obj is not None:
                        return trace.leaf(obj, name, owner=self)
                    return obj
            if name in d["_modules"]:
                return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        bump_version()
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` (or None, a declared-absent parameter such as ``bias=False``)."""
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"parameter {name!r} must be a Parameter or None, got {param!r}")
        self._drop(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        """Register a non-trainable tensor (an array, a Buffer, or None)."""
        self._drop(name)
        if tensor is None or isinstance(tensor, Buffer):
            buf = tensor
            if buf is not None:
                buf.persistent = persistent
        else:
            buf = Buffer(_as_array(tensor), persistent)
        self._buffers[name] = buf

    def add_module(self, name: str, module: Module | None) -> None:
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module")
        self._drop(name)
        self._modules[name] = module

    register_module = add_module

    # ------------------------------------------------------------------ traversal
    def named_modules(
        self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Module]]:
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(
                    memo, f"{prefix}.{name}" if prefix else name, remove_duplicate
                )

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name, m in self._modules.items():
            if m is not None:
                yield name, m

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def _named(self, table: str, prefix: str, recurse: bool, remove_duplicate: bool):
        seen: set[int] = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
        for mprefix, m in mods if recurse else [(prefix, self)]:
            for name, v in getattr(m, table).items():
                if v is None or (remove_duplicate and id(v) in seen):
                    continue
                seen.add(id(v))
                yield (f"{mprefix}.{name}" if mprefix else name), v

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) pairs; a shared parameter once, under its first name."""
        yield from self._named("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True, _all=False
    ) -> Iterator[tuple[str, Buffer]]:
        """(dotted name, Buffer) pairs (``host_only`` buffers included only in state dicts)."""
        for name, b in self._named("_buffers", prefix, recurse, remove_duplicate):
            if _all or not b.host_only:
                yield name, b

    def buffers(self, recurse: bool = True) -> Iterator[Buffer]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> Module:
        m = self
        for part in target.split(".") if target else []:
            if part not in m._modules or m._modules[part] is None:
                raise AttributeError(f"{type(m).__name__} has no submodule {part!r} ({target})")
            m = m._modules[part]
        return m

    def get_parameter(self, target: str) -> Parameter:
        mod, _, name = target.rpartition(".")
        p = self.get_submodule(mod)._parameters.get(name)
        if p is None:
            raise AttributeError(f"no parameter {target!r}")
        return p

    def apply(self, fn) -> Module:
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> Module:
        """Set train mode (``mode=True``) or eval mode on every module of the tree."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be a bool, got {mode!r}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        bump_version()
        return self

    def eval(self) -> Module:
        """Eval mode: ``train(False)``."""
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Freeze (False) or unfreeze every parameter of the tree."""
        for p in self.parameters():
            p.requires_grad = bool(requires_grad)
        return self

    def signature_key(self) -> tuple[tuple[bool, ...], tuple[bool, ...], int]:
        """(train mode of every module, requires_grad of every parameter, structure token):
        part of every compiled signature. The structure token changes when the module tree,
        the identity of any parameter or buffer, or any public plain attribute a forward may
        read (numbers, strings, tuples; other objects by identity) changes, so a program traced
        before such a change is never run after it. Cached until something is assigned to a
        module, a mode or a flag changes."""
        cached = self.__dict__.get("_signature_key")
        if cached is not None and cached[0] == VERSION[0]:
            return cached[1]
        structure = tuple(
            (
                name,
                type(m),
                tuple((k, id(p)) for k, p in m._parameters.items()),
                tuple((k, id(b)) for k, b in m._buffers.items()),
                tuple(
                    (k, _static(v))
                    for k, v in m.__dict__.items()
                    if not k.startswith("_") and k != "training"
                ),
            )
            for name, m in self.named_modules()
        )
        token = _STRUCTURES.setdefault(structure, len(_STRUCTURES))
        key = (
            tuple(m.training for m in self.modules()),
            tuple(p.requires_grad for p in self.parameters()),
            token,
        )
        object.__setattr__(self, "_signature_key", (VERSION[0], key))
        return key

    # ------------------------------------------------------------------ state dicts
    def _state_items(self, prefix: str = "") -> Iterator[tuple[str, Parameter | Buffer]]:
        # PyTorch's order: a module's parameters, its persistent buffers, then each child.
        for name, p in self._parameters.items():
            if p is not None:
                yield prefix + name, p
        for name, b in self._buffers.items():
            if b is not None and b.persistent:
                yield prefix + name, b
        for name, m in self._modules.items():
            if m is not None:
                yield from m._state_items(f"{prefix}{name}.")

    def state_dict(self, prefix: str = "") -> OrderedDict[str, np.ndarray]:
        """Every parameter and persistent buffer by dotted name, as NumPy copies (PyTorch's
        names and order; a tied parameter appears under each of its names, as in PyTorch).

        Raises:
            UninitializedParameterError: a tensor was never initialized or loaded.
        """
        out = OrderedDict()
        for name, t in self._state_items(prefix):
            if not t.is_initialized:
                raise UninitializedParameterError(
                    f"{type(t).__name__.lower()} {name!r} was never initialized or loaded"
                )
            arr = t.data
            arr.setflags(write=True)
            out[name] = arr
        return out

    def load_state_dict(
        self, state_dict: Mapping | str | Path, strict: bool = True
    ) -> IncompatibleKeys:
        """Copy values from a state dict (``torch.nn.Module.load_state_dict``).

        Args:
            state_dict: name -> array (NumPy, or anything with ``__array__``: a torch state dict
                converted with ``.numpy()``, or torch tensors themselves), or the path of a
                ``.safetensors`` file. float16, bfloat16 and float64 values are converted to
                each parameter's dtype. Keys PyTorch and Hugging Face checkpoints carry beside
                parameters (``num_batches_tracked``, ``position_ids``, rotary ``inv_freq``) are
                loaded where the model has them and skipped where it has not. The optimizer
                state of a ``Trainer.save`` checkpoint (``optimizer/...``) is skipped too: a
                model loads its weights from such a file directly.
            strict: require the keys to match exactly (else missing keys keep their values and
                unexpected keys are ignored). Mis-shaped values are refused either way.

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)``.

        Raises:
            StateDictError: missing/unexpected keys (strict) or shape mismatches, all listed;
                raised before anything is written, so the model is unchanged.
            FileNotFoundError: a path that does not exist.
        """
        if isinstance(state_dict, (str, Path)):
            from ..io.safetensors_io import load_file

            state_dict = load_file(state_dict)
        targets = OrderedDict(self._state_items())
        skip = [k for k in state_dict if k not in targets and _known_extra(k)]
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets and k not in skip]
        problems = []
        ready = []
        for k, t in targets.items():
            if k not in state_dict:
                continue
            try:
                arr = _as_array(state_dict[k])
            except TypeError as e:
                problems.append(f"{k}: {e}")
                continue
            if arr.shape != t.shape:
                problems.append(
                    f"size mismatch for {k}: the checkpoint has shape {arr.shape}, "
                    f"the model {t.shape}"
                )
                continue
            if not (isinstance(t, Buffer) and t.host_only):
                try:
                    arr = convert(arr, t.dtype)
                except TypeError as e:
                    problems.append(f"{k}: {e}")
                    continue
            ready.append((t, arr))
        if strict:
            missing = [k for k in missing if not _known_extra(k)]
        if strict and (missing or unexpected):
            if missing:
                problems.insert(0, f"missing keys: {missing}")
            if unexpected:
                problems.insert(int(bool(missing)), f"unexpected keys: {unexpected}")
        if problems:
            raise StateDictError(
                f"cannot load the state dict into {type(self).__name__}:\n  "
                + "\n  ".join(problems)
            )
        for t, arr in ready:
            t.copy_(arr)
        return IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------------ calling
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args, **kwargs):
        """Inside a traced forward: run ``forward``. Outside, with NumPy arrays: trace (once per
        signature), compile, run, and return NumPy (``meganeura.nn.compiled``)."""
        if current_trace() is not None:
            return self.forward(*args, **kwargs)
        from .compiled import default_compiled

        return default_compiled(self)(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy of the tree with copies of its tensors (values read back from the GPU once
        resident) and no compiled programs, as ``copy.deepcopy`` of a torch module (what
        ``nn.TransformerEncoder`` does to its layer)."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            skip = k in ("_compiled", "_signature_key")
            object.__setattr__(new, k, None if skip else copy.deepcopy(v, memo))
        bump_version()
        return new

    # ------------------------------------------------------------------ printing
    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = []
        for name, m in self._modules.items():
            body = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {body}")
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"

    def __dir__(self):
        return sorted(
            set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules)
        )


_STRUCTURES: dict[tuple, int] = {}


def _static(v):
    """A hashable stand-in for an attribute's value: the value itself for plain data, the
    identity of anything else (arrays and objects are read by the trace as they are then)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return tuple(_static(x) for x in v)
    return ("object", id(v))


def _known_extra(key: str) -> bool:
    return any(p.search(key) for p in KNOWN_EXTRA_KEYS)
