"""Compile on call: a Module traced once per input signature, compiled, cached and replayed.

``model(x)`` with NumPy arrays, or the callable ``meganeura.compile(model)`` returns, looks up
the signature of the call (each array's shape and dtype, every other argument's value, each
module's train/eval mode, the precision): on a miss it traces ``forward`` (``nn.tracing``),
compiles the graph and opens a Session; on a hit it only feeds and runs. Every program of a
model binds the same GPU copy of its parameters and buffers (``runtime.shared``), so a training
step is seen by the next eval call without any copy.

Inputs: float64 arrays are fed as float32 and int64 as int32 (values must fit), as JAX does by
default; Python scalars, strings, None and tuples of them are static: part of the signature,
baked into the program. Outputs come back as NumPy in the structure ``forward`` returned
(a Tensor, or tuples, lists and dicts of them).
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..compile import CompileOptions
from ..compile import compile as compile_graph
from ..graph.builder import Tensor
from ..graph.ir import Graph
from .parameter import UninitializedParameterError, dtype_of, narrow_to_stored
from .tracing import CONSTANT_PREFIX, Trace, tracing


class SignatureError(TypeError):
    """An argument of a compiled call that cannot be an input or a static value."""


# ---------------------------------------------------------------------------- arguments
def _feed_array(x: np.ndarray, where: str) -> np.ndarray:
    try:
        x = narrow_to_stored(x, where)
    except ValueError as e:
        raise SignatureError(str(e)) from None
    if x.dtype.kind not in "fiub" or x.dtype.itemsize > 4 and x.dtype.kind != "b":
        raise SignatureError(f"{where}: arrays of {x.dtype} cannot be fed (use float32 or int32)")
    return np.require(x, requirements="C")


def _flatten(value, where: str, arrays: list):
    """A hashable spec of ``value`` with each array replaced by its slot; arrays appended."""
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy"):
        value = value.detach().cpu()  # a torch.Tensor: read on the host, as NumPy
        value = (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
    if isinstance(value, np.ndarray) or hasattr(value, "__array_interface__"):
        arr = _feed_array(np.asarray(value), where)
        arrays.append((where, arr))
        return ("array", arr.shape, arr.dtype.str)
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        return (kind, tuple(_flatten(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)))
    if isinstance(value, dict):
        return (
            "dict",
            tuple((k, _flatten(v, f"{where}[{k!r}]", arrays)) for k, v in sorted(value.items())),
        )
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return (
            "static",
            type(value).__name__,
            value.item() if isinstance(value, np.generic) else value,
        )
    if isinstance(value, Tensor):
        raise SignatureError(
            f"{where}: a traced Tensor passed to a compiled call (call the module inside a "
            "traced forward instead)"
        )
    raise SignatureError(
        f"{where}: {type(value).__name__} is neither an array nor a static Python value"
    )


def _rebuild(spec, tensors: list):
    """The argument tree with arrays replaced by graph Tensors, in order."""
    kind = spec[0]
    if kind == "array":
        return tensors.pop(0)
    if kind in ("tuple", "list"):
        items = [_rebuild(s, tensors) for s in spec[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _rebuild(s, tensors) for k, s in spec[1]}
    return spec[2]


# Weak keys: a Trainer's loss function is a closure over its model, so a strong key here kept
# every dropped Trainer's model, parameters and their GPU memory alive (issue 11, item 8).
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(fn) -> inspect.Signature:
    """``inspect.signature(fn)``, cached per function (bound methods: without ``self``)."""
    func = getattr(fn, "__func__", None)
    key = func if func is not None else fn
    try:
        sig = _SIGNATURES.get(key)
    except TypeError:  # an unhashable or not weakly referenceable callable
        return inspect.signature(fn)
    if sig is None:
        sig = inspect.signature(fn)
        _SIGNATURES[key] = sig
    return sig


def bind_arguments(fn, args, kwargs) -> inspect.BoundArguments:
    """The call ``fn(*args, **kwargs)`` bound to ``fn``'s signature (defaults applied).

    Raises:
        SignatureError: the arguments do not fit the signature.
    """
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise SignatureError(f"{getattr(fn, '__qualname__', fn)}: {e}") from None
    bound.apply_defaults()
    return bound


def flatten_arguments(fn, args, kwargs) -> tuple[inspect.BoundArguments, tuple, list]:
    """(bound call, hashable spec, [(input name, array)]) of a call of ``fn``."""
    bound = bind_arguments(fn, args, kwargs)
    arrays: list = []
    spec = tuple((name, _flatten(v, name, arrays)) for name, v in bound.arguments.items())
    return bound, spec, arrays


def _outputs(result, prefix: str, named: dict) -> object:
    """Name every Tensor of ``result``; returns its spec for ``_unflatten``."""
    if isinstance(result, Tensor):
        named[prefix] = result
        return ("tensor", prefix)
    if isinstance(result, (tuple, list)):
        return (
            type(result).__name__,
            tuple(_outputs(v, f"{prefix}.{i}", named) for i, v in enumerate(result)),
        )
    if isinstance(result, dict):
        return ("dict", tuple((k, _outputs(v, f"{prefix}.{k}", named)) for k, v in result.items()))
    return ("value", result)


def _unflatten(spec, values: Mapping):
    kind = spec[0]
    if kind == "tensor":
        return values[spec[1]]
    if kind in ("tuple", "list"):
        items = [_unflatten(s, values) for s in spec[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _unflatten(s, values) for k, s in spec[1]}
    return spec[1]


# ---------------------------------------------------------------------------- programs
@dataclass
class Traced:
    """A traced call: the graph, its leaves, and how to feed and read it."""

    graph: Graph
    trace: Trace
    inputs: list[str]  # graph input names fed from arguments, in argument order
    output_spec: object
    seconds: float


def trace_call(
    module, fn, args, kwargs, outputs_prefix: str = "output", check_result=None
) -> Traced:
    """Trace ``fn(*args, **kwargs)`` (``fn`` reads ``module``'s tensors) into a Graph.

    ``check_result(result)``, when given, sees what ``fn`` returned before it becomes the
    graph's outputs, and raises for results the caller cannot use.
    """
    t0 = time.perf_counter()
    bound, spec, arrays = flatten_arguments(fn, args, kwargs)
    trace = Trace(module)
    with tracing(trace):
        b = trace.builder
        tensors = [b.input(name, a.shape, _dtype(a)) for name, a in arrays]
        for name, s in spec:
            bound.arguments[name] = _rebuild(s, tensors)
        result = fn(*bound.args, **bound.kwargs)
        if check_result is not None:
            check_result(result)
    named: dict[str, Tensor] = {}
    if isinstance(result, dict):  # a dict's keys name the outputs themselves
        out_spec = ("dict", tuple((k, _outputs(v, str(k), named)) for k, v in result.items()))
    else:
        out_spec = _outputs(result, outputs_prefix, named)
    if not named:
        raise SignatureError(f"{getattr(fn, '__qualname__', fn)} returned no Tensor")
    for name, t in named.items():
        b.output(name, t)
    graph = b.build_unverified()
    return Traced(graph, trace, [n for n, _ in arrays], out_spec, time.perf_counter() - t0)


def trace(module, *args, fn=None, **kwargs) -> Graph:
    """The Graph of ``module.forward(*args, **kwargs)`` (or of ``fn(*args, **kwargs)``, a
    function reading ``module``'s tensors), as ``jax.make_jaxpr`` or ``torch.fx`` give theirs.

    Arrays in the arguments become inputs named by ``forward``'s parameter names (``x``,
    ``x[0]`` for a tuple's items); the result's Tensors become outputs named ``output`` (or
    ``output.0``, ... for a tuple; a dict's keys name its outputs); parameters and buffers
    become leaves with their dotted names. Example::

        graph = mn.nn.trace(model, x)                             # outputs["output"]
        graph = mn.nn.trace(model, x, y, fn=lambda x, y: {"loss": F.cross_entropy(model(x), y)})

    Raises:
        SignatureError: arguments that are neither arrays nor static Python values, or a
            result without a Tensor.
    """
    return trace_call(module, fn or module.forward, args, kwargs).graph


def _dtype(a: np.ndarray):
    return dtype_of(a, "input")


class ProgramRunner:
    """One compiled program of a model and its Session, bound to the shared parameter copy.

    Reopens its Session (carrying its private state and resident inputs) when the shared store
    moved a tensor it binds.

    Args:
        traced: the traced call.
        options: how to compile it.
        device: a runtime Device (default: the default device).
        shared: slot name -> key, for persistent slots the trace did not make that other
            programs must see too (a Trainer's optimizer moments and gradient accumulators,
            each a Buffer); None keeps a slot private to this program.
    """

    def __init__(self, traced: Traced, options: CompileOptions, device=None, shared=None) -> None:
        from ..runtime import get_device
        from ..runtime.shared import shared_store
        from ..training import device_limits

        self.traced, self.options = traced, options
        self.device = device or get_device()
        objects = traced.trace.objects
        for name, obj in objects.items():
            if not obj.is_initialized:
                raise UninitializedParameterError(
                    f"{type(obj).__name__.lower()} {name!r} was never initialized or loaded "
                    "(load a state dict, or build the model without skipping initialization)"
                )
        t0 = time.perf_counter()
        self.program = compile_graph(traced.graph, options, device_limits(self.device))
        self.compile_seconds = time.perf_counter() - t0
        self.store = shared_store(self.device)
        persistent = {**self.program.parameters, **self.program.state}
        self.keys = {n: objects[n] for n in persistent if n in objects}
        for n in persistent:
            key = None if n in self.keys or shared is None else shared(n)
            if key is not None:
                self.keys[n] = key
        self.private = [n for n in persistent if n not in self.keys]
        t0 = time.perf_counter()
        self.session = self._open({})
        for name, value in traced.trace.constants.items():
            if name in persistent:
                self.session.write(name, value)
        self.setup_seconds = time.perf_counter() - t0

    def _open(self, carry: Mapping[str, np.ndarray]):
        from ..runtime import Session

        external, self._token = self.store.external(self.program, self.keys, lambda obj: obj.data)
        for obj in self.keys.values():
            obj._store = self.store
            obj._host = None
        session = Session(self.program, self.device, external)
        for name, value in carry.items():
            session.write(name, value)
        return session

    def run(self, feeds: Mapping[str, np.ndarray], fetch) -> dict:
        return self.fresh_session().run(feeds, fetch)

    def fresh_session(self):
        """The Session, reopened (its private tensors and the inputs written to it carried
        over) if the shared store has moved the buffers it binds since it was opened."""
        if self.store.is_stale(self._token):
            keep = [*self.private, *self.session.resident_inputs]
            carry = {n: self.session.read(n) for n in keep}
            self.session.close()
            self.session = self._open(carry)
        return self.session

    def read_private(self) -> dict[str, np.ndarray]:
        """The program's own persistent tensors (those not shared), NumPy copies."""
        return {n: self.session.read(n) for n in self.private if not n.startswith(CONSTANT_PREFIX)}


@dataclass
class CacheEntry:
    """One compiled signature: how long it took and how often it ran."""

    signature: tuple
    trace_seconds: float
    compile_seconds: float
    setup_seconds: float
    calls: int = 0
    runner: ProgramRunner | None = field(default=None, repr=False)


@dataclass(frozen=True)
class CacheInfo:
    """``functools.lru_cache``-style counts of a compiled module's program cache."""

    hits: int
    misses: int
    currsize: int
    entries: tuple[CacheEntry, ...]


# Programs a compile-on-call cache keeps (a Trainer's or a CompiledModule's); the least recently
# used one is closed beyond this. Each program holds a Session with its activation buffers, so
# an unbounded cache grew by one Session per new input shape. 32 leaves room for the batch
# sizes, train/eval modes and accumulation programs of one model; a signature evicted and met
# again is traced and compiled again (its kernels come from the device's pipeline cache).
DEFAULT_MAX_PROGRAMS = 32


def check_max_programs(value, minimum: int = 1) -> int | None:
    """``max_programs`` as given to a cache: None (unbounded) or an int >= ``minimum``.

    Raises:
        ValueError: anything else.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"max_programs must be an int >= {minimum} or None, got {value!r}")
    if value is not None and value < minimum:
        raise ValueError(f"max_programs must be an int >= {minimum} or None, got {value!r}")
    return value


class ProgramCache(dict):
    """A dict of compiled programs in insertion order (``cache_info`` lists them so) that
    remembers when each was last used, for :meth:`touch`."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict = {}
        self._tick = 0

    def touch(self, key, limit: int | None, close) -> None:
        """Mark ``self[key]`` most recently used, then close (``close(value)``) and drop the
        least recently used entries beyond ``limit``."""
        self._tick += 1
        self._last[key] = self._tick
        while limit is not None and len(self) > limit:
            oldest = min(self._last, key=self._last.__getitem__)
            del self._last[oldest]
            close(self.pop(oldest))

    def clear(self) -> None:
        super().clear()
        self._last.clear()


class CompiledModule:
    """``model`` as a callable that compiles each new input signature once.

    Args:
        module: the model.
        precision: ``"strict"`` or ``"fast"`` (``CompileOptions.precision``).
        fuse: ``CompileOptions.fuse``.
        device: a runtime Device (default: the default device).
        max_programs: compiled signatures kept (default ``DEFAULT_MAX_PROGRAMS``, 32); the
            least recently called one is closed, freeing its GPU memory, when a new one
            would exceed it. None keeps every one.
        max_storage_binding_bytes: ``CompileOptions.max_storage_binding_bytes`` (None: the
            adapter's limit); tensors above it are bound in row blocks (docs/bindings.md).

    Raises:
        ValueError: ``max_programs`` is not an int >= 1 or None, or
            ``max_storage_binding_bytes`` is not a positive multiple of 4 or None.
    """

    def __init__(
        self,
        module,
        precision: str = "strict",
        fuse: bool = True,
        device=None,
        max_programs: int | None = DEFAULT_MAX_PROGRAMS,
        max_storage_binding_bytes: int | None = None,
    ):
        self.module = module
        self.options = CompileOptions(
            precision=precision,
            fuse=fuse,
            shared_parameters=True,
            max_storage_binding_bytes=max_storage_binding_bytes,
        )
        self.device = device
        self.max_programs = check_max_programs(max_programs)
        self._cache: ProgramCache = ProgramCache()
        self.hits = self.misses = 0

    def _lookup(self, args, kwargs, count: bool = True) -> tuple[CacheEntry, list]:
        _, spec, arrays = flatten_arguments(self.module.forward, args, kwargs)
        modes, _, structure = self.module.signature_key()  # requires_grad: training only
        key = (spec, modes, structure, self.options.precision, self.options.fuse)
        entry = self._cache.get(key)
        if entry is None:
            self.misses += 1
            traced = trace_call(self.module, self.module.forward, args, kwargs)
            runner = ProgramRunner(traced, self.options, self.device)
            entry = CacheEntry(
                key, traced.seconds, runner.compile_seconds, runner.setup_seconds, 0, runner
            )
            self._cache[key] = entry
        else:
            self.hits += count
        self._cache.touch(key, self.max_programs, _close_entry)
        return entry, arrays

    def precompile(self, *args, **kwargs) -> CacheEntry:
        """Trace and compile the signature of these arguments without running it."""
        return self._lookup(args, kwargs, count=False)[0]

    def __call__(self, *args, **kwargs):
        entry, arrays = self._lookup(args, kwargs)
        entry.calls += 1
        runner = entry.runner
        traced = runner.traced
        inputs = runner.program.inputs
        feeds = {n: a for n, (_, a) in zip(traced.inputs, arrays, strict=True) if n in inputs}
        rng = _rng()
        for name in traced.trace.seeds:
            seed = np.asarray(rng.integers(0, 2**32), np.uint32)
            if name in inputs:
                feeds[name] = seed
        out = runner.run(feeds, tuple(runner.program.outputs))
        for effect in traced.trace.host_effects:
            effect()
        return _unflatten(traced.output_spec, out)

    def cache_info(self) -> CacheInfo:
        """Hits, misses and the compiled signatures with their trace/compile/setup seconds."""
        return CacheInfo(self.hits, self.misses, len(self._cache), tuple(self._cache.values()))

    def cache_clear(self) -> None:
        for e in self._cache.values():
            if e.runner is not None:
                e.runner.session.close()
        self._cache.clear()
        self.hits = self.misses = 0


def _close_entry(entry: CacheEntry) -> None:
    if entry.runner is not None:
        entry.runner.session.close()


def _rng():
    from ..random import default_generator

    return default_generator()


def default_compiled(module) -> CompiledModule:
    """The CompiledModule ``module(x)`` uses (strict precision, made on first call)."""
    c = module.__dict__.get("_compiled")
    if c is None:
        c = CompiledModule(module)
        object.__setattr__(module, "_compiled", c)
    return c


def compile(target, *args, **kwargs):  # noqa: A001 - meganeura.compile
    """``meganeura.compile``: a Graph into a Program, or a Module into a compiled callable.

    ``compile(graph, options=None, limits=None)`` is ``meganeura.compile.compile`` (returns a
    Program). ``compile(model, *example_inputs, precision="strict", fuse=True, device=None,
    max_programs=32, max_storage_binding_bytes=None)`` returns a :class:`CompiledModule`; with
    example inputs (positional, as ``forward`` takes them) that signature is compiled now.
    """
    from .module import Module

    if isinstance(target, Module):
        names = ("precision", "fuse", "device", "max_programs", "max_storage_binding_bytes")
        opts = {k: kwargs.pop(k) for k in names if k in kwargs}
        if kwargs:
            raise TypeError(f"compile(model, ...): unknown options {sorted(kwargs)}")
        cm = CompiledModule(target, **opts)
        if args:
            cm.precompile(*args)
        return cm
    return compile_graph(target, *args, **kwargs)
