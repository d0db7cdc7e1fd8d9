"""Locating the first non-finite value of a program (PyTorch's analogue:
``torch.autograd.detect_anomaly``).

``find_nonfinite`` compiles a diagnostic variant of the program ``compile`` would build from
the same graph and options: the same differentiation, rewrites and f16 storage plan, but
unfused (every value is stored in its planned dtype, as an unfused program stores it) and
with every floating intermediate also fetched, widened to f32, as an output of its own. It
runs one step on the given feeds and names the first value, in program order, that holds
an inf or a NaN. For a value stored as f16 it also re-evaluates the op on its (finite)
operands in f32 with the op's NumPy reference: finite there but beyond f16's 65504 means the
f16 storage itself overflowed (a *narrowing overflow*), which the range rule of
``passes.ranges`` failed to foresee.

It runs after a failure, so it favours clarity over speed: the diagnostic program fetches
every intermediate and is compiled on each call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .compile import (
    CompileOptions,
    _assemble,
    _training_graph,
    simplify_program,
    storage_plan,
)
from .dtypes import DType
from .graph.builder import GraphBuilder
from .graph.ir import LEAF_OPS, Graph
from .graph.printer import format_node
from .graph.verify import verify
from .ops import OPS
from .optim import HYPER_INPUT
from .schedule.planner import plan_memory
from .schedule.schedule import schedule

F16_MAX = 65504.0


@dataclass(frozen=True)
class NonFinite:
    """The first value of a program that holds an inf or a NaN.

    Attributes:
        node: the value's id in the compiled graph (``line`` prints it).
        op: its op (``input`` or ``parameter`` when the host supplied the non-finite value).
        line: its printed IR line, with its storage dtype (``%7: f16[4,8] = mul %3, %3``).
        loc: ``file:line`` of the user code that created it, or ``""``.
        dtype: its storage dtype, ``"f16"`` or ``"f32"``.
        nan, posinf, neginf: how many of its elements are NaN, +inf and -inf.
        numel: its number of elements.
        overflow: True when the value is stored as f16 and is finite in f32 (its op
            re-evaluated in f32 on the stored operands) but beyond f16's 65504.
        f32_max_abs: the largest magnitude of that f32 re-evaluation (None when not run).
        operands: the printed IR lines of its operands.
    """

    node: int
    op: str
    line: str
    loc: str
    dtype: str
    nan: int
    posinf: int
    neginf: int
    numel: int
    overflow: bool
    f32_max_abs: float | None
    operands: tuple[str, ...]

    def __str__(self) -> str:
        what = ", ".join(
            f"{n} {k}"
            for n, k in ((self.nan, "NaN"), (self.posinf, "+inf"), (self.neginf, "-inf"))
            if n
        )
        at = f" at {self.loc}" if self.loc else ""
        text = [
            f"first non-finite value: %{self.node} ({self.op}{at}), stored {self.dtype}: "
            f"{what} of {self.numel} elements",
            f"  {self.line}",
        ]
        text += [f"    operand {x}" for x in self.operands]
        if self.overflow:
            text.append(
                f"  f16 overflow: finite in f32 (max |v| = {self.f32_max_abs:.6g}) but beyond "
                f"f16's {F16_MAX:g}; compile with precision='strict', or rescale the value"
            )
        return "\n".join(text)


def find_nonfinite(
    graph: Graph,
    feeds: Mapping[str, np.ndarray],
    options: CompileOptions | None = None,
    parameters: Mapping[str, np.ndarray] | None = None,
    state: Mapping[str, np.ndarray] | None = None,
    device=None,
) -> NonFinite | None:
    """Name the first value (in program order) of ``compile(graph, options)`` that holds an
    inf or a NaN when run on ``feeds``, or None when every value is finite.

    Args:
        graph: the forward graph given to ``compile`` (a module's: ``nn.trace``).
        feeds: every input by name, as ``Session.run`` takes them (a training program's
            ``optim.hyper`` defaults to the optimizer's first step at its ``lr``).
        options: the options the failing program was compiled with (default: inference,
            strict). A training program is differentiated as ``compile`` does; one step runs
            (its update writes only the diagnostic program's own copies).
        parameters: parameter values by name (e.g. ``trainer.parameters()``); parameters
            not given keep the values a new Session gives them.
        state: optimizer state by name (e.g. moments), if the step's values depend on it.
        device: a runtime Device; default ``runtime.get_device()``.

    Returns:
        A :class:`NonFinite` (``str()`` of it is a readable report), or None.
        ``precision="fast"`` on an adapter without ``shader-f16`` runs strict, as
        ``compile`` does.

    Raises:
        InputError: a missing or mistyped feed or parameter (``Session``'s checks).
        GraphError: ``graph`` breaks an IR invariant.
    """
    from .runtime import Session, get_device
    from .training import device_limits

    options = options or CompileOptions()
    device = device or get_device()
    limits = device_limits(device)
    precision = options.precision if limits.shader_f16 else "strict"

    feeds = dict(feeds)
    if options.optimizer is not None:  # the learning rate the step would have used
        feeds.setdefault(HYPER_INPUT, options.optimizer.hyper(0, options.optimizer.lr))
    host = _host_values(graph, feeds, parameters)  # a non-finite feed or weight comes first
    if host is not None:
        return host
    verify(graph, allow_unused_inputs=True)
    master: frozenset[int] = frozenset()
    if options.differentiates:
        graph, master = _training_graph(graph, options)
    graph, master = simplify_program(graph, master)
    observed, graph = _observe(graph)
    plan, narrowed = storage_plan(graph, master, options, precision)
    sched = schedule(plan, limits, fuse=False)
    program = _assemble(plan, sched, plan_memory(sched.intervals), limits, narrowed)
    with Session(program, device) as session:
        session.load_state_dict({**(parameters or {}), **(state or {})}, strict=False)
        values = session.run(feeds, list(observed.values()))
    values = {v: values[name] for v, name in observed.items()}
    for node in plan.nodes:
        if node.id in values and not np.all(np.isfinite(values[node.id])):
            return _report(plan, node.id, values, feeds, parameters or {})
    return None


def _host_values(graph: Graph, feeds, parameters) -> NonFinite | None:
    for node in graph.nodes:
        if node.op not in ("input", "parameter") or not node.type.dtype.is_floating:
            continue
        v = (feeds if node.op == "input" else parameters or {}).get(node.name)
        if v is not None and not np.all(np.isfinite(v)):
            return _describe(node, format_node(node), np.asarray(v), "f32", False, None, ())
    return None


def _observe(graph: Graph) -> tuple[dict[int, str], Graph]:
    """({value id: output name}, the graph with every floating computed value also output
    through a cast to f32: the cast's output is f32, so the value keeps its storage plan)."""
    b = GraphBuilder(graph)
    observed = {}
    for node in graph.nodes:
        d = OPS.get(node.op)
        if node.op in LEAF_OPS or not node.type.dtype.is_floating or (d and d.writes):
            continue
        observed[node.id] = f"debug.%{node.id}"
        b.output(observed[node.id], b.add("cast", [b.tensor(node.id)], {"dtype": DType.f32.value}))
    return observed, b.build_unverified()


def _report(plan: Graph, vid: int, values, feeds, parameters) -> NonFinite:
    node = plan[vid]
    overflow, peak = False, None
    if node.type.dtype is DType.f16:
        args = []
        for i in node.inputs:
            src = plan[i]
            if i in values:
                args.append(values[i].astype(np.float32))
            elif src.op == "constant":
                args.append(np.asarray(src.attr("value"), np.float32))
            elif src.op == "input" and src.name in feeds:
                args.append(np.asarray(feeds[src.name]))
            elif src.op == "parameter" and src.name in parameters:
                args.append(np.asarray(parameters[src.name], np.float32))
            else:
                args = None
                break
        if args is not None:
            with np.errstate(all="ignore"):
                ref = np.asarray(OPS[node.op].reference(args, node.attr_dict), np.float32)
            if np.all(np.isfinite(ref)):
                peak = float(np.abs(ref).max())
                overflow = peak > F16_MAX
    operands = tuple(format_node(plan[i]) for i in node.inputs)
    return _describe(
        node, format_node(node), values[vid], node.type.dtype.name, overflow, peak, operands
    )


def _describe(node, line, v, dtype, overflow, peak, operands) -> NonFinite:
    return NonFinite(
        node=node.id,
        op=node.op,
        line=line,
        loc=node.loc,
        dtype=dtype,
        nan=int(np.isnan(v).sum()),
        posinf=int(np.isposinf(v).sum()),
        neginf=int(np.isneginf(v).sum()),
        numel=int(v.size),
        overflow=overflow,
        f32_max_abs=peak,
        operands=operands,
    )
