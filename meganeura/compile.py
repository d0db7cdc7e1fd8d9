"""The pipeline in one place: graph -> (differentiate -> apply_optimizer) -> simplify ->
hoist (elementwise nodes a fusion group could take, moved next to it, ``passes.hoist``) ->
(narrow_storage, fast mode) -> split_bindings (tensors over one storage binding, in row
blocks) -> schedule -> plan_memory -> lower to WGSL -> Program -> pack (independent
dispatches a few positions apart as one, ``schedule.pack``).

Every stage is a pure function; ``compile`` only strings them together, times each stage and
assembles the Program's buffer table. Nothing here touches a GPU: adapter limits come in as
a ``Limits`` value (``Session`` users get them from ``meganeura.runtime.get_device``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Literal

from .autodiff import differentiate, missing_loss
from .codegen.kernel import ArenaRef, Limits, ScratchRef, ValueRef
from .codegen.wgsl.conv.gemm import record_choices
from .codegen.wgsl.elementwise.maps import FUSIBLE
from .codegen.wgsl.matmul.lowering import matmul_choices
from .dtypes import DType
from .graph.builder import GraphBuilder
from .graph.ir import PLACED_OPS, SUBRANGE_OPS, Graph, resolve_view
from .graph.verify import verify
from .optim import Optimizer, apply_optimizer
from .optim.accumulate import add_to_accumulators, mean_with_accumulators
from .optim.guard import GUARD_MODES, defer_update_stats
from .optim.scaler import GradScaler, current_scale, is_power_of_two
from .passes import cse, dce, fold_permutes
from .passes.fold_batch_norm import fold_batch_norm
from .passes.hoist import hoist_fusible
from .passes.precision import narrow_storage
from .passes.split_bindings import split_bindings
from .schedule.pack import pack_program
from .schedule.planner import plan_memory
from .schedule.program import (
    BufferSpec,
    Dispatch,
    LabelCheck,
    MemoryReport,
    Program,
    TensorSlot,
    binding_conflict,
)
from .schedule.schedule import schedule
from .schedule.update_groups import arena_roles, arena_value


@dataclass(frozen=True)
class CompileOptions:
    """What to build from a graph.

    Attributes:
        loss: name of the scalar output to minimize; None compiles inference only.
        optimizer: the update appended after the backward pass (needs ``loss``).
        max_grad_norm: clip gradients by global L2 norm before the update (None: no clip).
        trainable: names of the parameters to train; None trains every parameter.
        fuse: run chains of elementwise ops, and matmul epilogues (bias, activation,
            residual), as one kernel each (``passes.fuse``); False gives one kernel per node.
        precision: ``"strict"`` stores and computes every floating value in f32. ``"fast"``
            stores activations and activation gradients as f16, and in programs without an
            optimizer the parameters too, while every kernel still computes and accumulates
            in f32 (``passes.precision`` lists what stays f32: inputs, fetched outputs, f32
            master weights, their gradients and optimizer state, sums and losses, and values
            that may leave f16's range, ``passes.ranges``). It needs the adapter's
            ``shader-f16`` feature; without it the program is compiled strict and a
            ``PrecisionFallbackWarning`` is issued. ``Program.meta["precision"]`` says which
            precision the program got. ``meganeura.debug.find_nonfinite`` names the first
            value of a program that holds an inf or a NaN.
        shared_parameters: keep parameters and state in their declared dtype in every
            program (fast mode otherwise stores an inference program's parameters as f16), so
            several programs of one model can bind the same buffers (``runtime.shared``).
        output_grads: also output each trained parameter's gradient as ``<name>.grad``
            (``grad_output``): before clipping, and with accumulation the mean over the
            micro-batches. Outputs are pinned and cannot join an update group, so this costs
            memory and kernels; compile it only when gradients are read.
        accumulation_steps: micro-batches per update, ``k`` (``optim.accumulate``). With
            ``k > 1`` the program is the last micro-batch's: the update uses
            ``(<name>.grad_accum + g) / k`` and the ``loss`` output is the mean loss.
        accumulate_grads: compile the other micro-batches' program instead: forward and
            backward, gradients and loss added into the accumulators, no update (needs
            ``optimizer=None``).
        nonfinite_guard: ``"raise"`` or ``"skip"``: check the loss and the gradients' global
            sum of squares on the GPU and skip the update when either is inf or NaN
            (``optim.guard``; the Trainers set it); None: no guard. A program without an
            optimizer (inference, ``accumulate_grads``) has no update to guard and ignores it:
            the last micro-batch's program checks the mean of all micro-batches. A skipped
            step writes no running statistics either (``optim.guard.defer_update_stats``):
            with the guard, an ``accumulate_grads`` program stages BatchNorm's updates in the
            state ``<statistic>.pending`` and the last micro-batch's program commits them, so
            the caller must share those states between the programs and compile both with the
            guard.
        max_storage_binding_bytes: the most bytes one kernel may bind as one storage buffer;
            None: the adapter's ``max_storage_buffer_binding_size`` (``Limits``). A smaller
            value makes ``passes.split_bindings`` split smaller tensors (tests use it); a
            larger one than the adapter's is refused by ``compile``. Tensors above the limit
            (up to the adapter's ``max_buffer_size``) are bound in row blocks
            (docs/bindings.md).
        fold_batch_norm: in programs without a backward pass, fold each eval-mode
            BatchNorm that follows a convolution into a per-channel scale and shift of the
            convolution's output, which the kernel of the following elementwise ops (ReLU,
            residual add) computes (``passes.fold_batch_norm``); False keeps the BatchNorm
            kernels.
        loss_scale: a static loss scale ``S`` (a power of two): the backward pass starts from
            ``S`` instead of 1, so every gradient it stores is ``S`` times larger, which keeps
            the f16 activation gradients of the fast mode above f16's smallest subnormal
            (6e-8) where they would flush to zero (Micikevicius et al., "Mixed Precision
            Training", ICLR 2018, section 3.2; torch.amp.GradScaler with a fixed scale). The
            parameter gradients are unscaled before anything sees them: the optimizer's
            coefficient carries ``1 / S`` (clipping and ``grad_norm`` see the true norm), the
            ``<name>.grad`` outputs are multiplied by ``1 / S``. A gradient that overflows
            (f16 beyond 65504) trips the non-finite guard. 1.0: no scaling; strict-f32
            results are the same bits for any scale that neither overflows nor underflows
            f32. A ``GradScaler`` instead: a dynamic scale, backed off after an overflow and
            grown after ``growth_interval`` clean steps on the GPU (``optim.scaler``); it
            needs an optimizer, ``nonfinite_guard`` and no gradient accumulation.
    """

    loss: str | None = None
    optimizer: Optimizer | None = None
    max_grad_norm: float | None = None
    trainable: tuple[str, ...] | None = None
    fuse: bool = True
    precision: Literal["strict", "fast"] = "strict"
    shared_parameters: bool = False
    output_grads: bool = False
    accumulation_steps: int = 1
    accumulate_grads: bool = False
    nonfinite_guard: str | None = None
    max_storage_binding_bytes: int | None = None
    fold_batch_norm: bool = True
    loss_scale: float | GradScaler = 1.0

    def __post_init__(self) -> None:
        if self.precision not in ("strict", "fast"):
            raise ValueError(f"precision must be 'strict' or 'fast', got {self.precision!r}")
        k = self.accumulation_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, got {k!r}")
        if k > 1 and self.optimizer is None:
            raise ValueError("accumulation_steps > 1 compiles the update step; it needs optimizer")
        if self.accumulate_grads and (self.optimizer is not None or self.output_grads):
            raise ValueError(
                "accumulate_grads compiles a micro-batch without an update or gradient outputs; "
                "leave optimizer None and output_grads False"
            )
        m = self.max_storage_binding_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 4 or m % 4):
            raise ValueError(
                f"max_storage_binding_bytes must be None or a positive multiple of 4, got {m!r}"
            )
        scale = self.loss_scale
        if isinstance(scale, GradScaler):
            if self.optimizer is None or self.accumulate_grads or k > 1:
                raise ValueError(
                    "a dynamic loss_scale (GradScaler) needs an optimizer and no gradient "
                    "accumulation (a static power of two works with both)"
                )
            if self.nonfinite_guard is None:
                raise ValueError(
                    "a dynamic loss_scale (GradScaler) needs nonfinite_guard ('raise' or "
                    "'skip'): it skips the steps whose scaled gradients overflow"
                )
        elif is_power_of_two(scale):
            object.__setattr__(self, "loss_scale", float(scale))  # NumPy scalars too
        else:
            raise ValueError(
                f"loss_scale must be a power of two from 2**-126 to 2**127 (scaling and "
                f"unscaling are then exact) or a GradScaler, got {scale!r}"
            )
        if self.nonfinite_guard is not None and self.nonfinite_guard not in GUARD_MODES:
            raise ValueError(
                f"nonfinite_guard must be None or one of {GUARD_MODES}, got "
                f"{self.nonfinite_guard!r}"
            )

    @property
    def differentiates(self) -> bool:
        """Whether the program runs a backward pass."""
        return self.optimizer is not None or self.accumulate_grads or self.output_grads


def grad_output(name: str) -> str:
    """The output name of parameter ``name``'s gradient (``CompileOptions.output_grads``)."""
    return f"{name}.grad"


class PrecisionFallbackWarning(UserWarning):
    """``precision="fast"`` was asked for an adapter without ``shader-f16``; compiled strict."""


def build_training_graph(
    graph: Graph, options: CompileOptions, limits: Limits | None = None
) -> Graph:
    """Forward graph -> forward + backward + optimizer update (unsimplified)."""
    return _training_graph(graph, options, limits)[0]


def _training_graph(
    graph: Graph, options: CompileOptions, limits: Limits | None = None
) -> tuple[Graph, frozenset[int]]:
    """(training graph, ids of the parameter gradients and of every node appended after them:
    accumulation, clipping, the optimizer; what the fast mode keeps in f32)."""
    if options.loss is None or not options.differentiates:
        raise ValueError(
            "training needs CompileOptions.loss and an optimizer (or accumulate_grads or "
            "output_grads)"
        )
    if options.loss not in graph.output_dict:
        raise missing_loss(graph, options.loss)
    params = [
        n
        for n in graph.leaves("parameter")
        if options.trainable is None or n.name in options.trainable
    ]
    if options.trainable is not None:
        missing = set(options.trainable) - {n.name for n in params}
        if missing:
            raise ValueError(f"trainable names not parameters of the graph: {sorted(missing)}")
    # Parameters that do not reach the loss get no update (PyTorch: .grad stays None).
    scaler = options.loss_scale if isinstance(options.loss_scale, GradScaler) else None
    static = 1.0 if scaler is not None else options.loss_scale
    scale_node = seed_node = None
    if scaler is not None or static != 1.0:
        # the backward's seed, marked so that the range rule lets the gradients it scales
        # stay f16 (passes.ranges): a node of its own, not the shared constant
        b = GraphBuilder(graph)
        scale = current_scale(b, scaler) if scaler is not None else b.constant(float(static))
        seed_node = b.add("broadcast_to", [scale], {"shape": (), "seed": True}).id
        scale_node = scale.id if scaler is not None else None
        graph = b.build_unverified()
    g, grads = differentiate(
        graph,
        options.loss,
        [p.id for p in params],
        unreachable="omit",
        seed_node=seed_node,
    )
    backward_end, raw = len(g.nodes), set(grads.values())
    if options.accumulate_grads:
        g = add_to_accumulators(g, grads, options.loss)
    elif options.accumulation_steps > 1:
        g, grads = mean_with_accumulators(g, grads, options.loss, options.accumulation_steps)
    if options.output_grads:
        b = GraphBuilder(g)
        for p, gid in grads.items():
            t = b.tensor(gid)
            constant = g[resolve_view(g, gid)].op == "constant"  # d(loss)/d(scalar) = seed
            if scale_node is not None:
                t = t * (1.0 / b.tensor(scale_node))
            elif static != 1.0:
                t = t * (1.0 / static)
            if constant:  # give it storage
                t = b.add("broadcast_to", [t], {"shape": t.shape})
            b.output(grad_output(g[p].name), t)
        g = b.build_unverified()
    if options.optimizer is not None:
        g = apply_optimizer(
            g,
            grads,
            options.optimizer,
            options.max_grad_norm,
            loss=options.loss,
            guard=options.nonfinite_guard,
            max_bindings=(limits or Limits()).max_storage_buffers_per_shader_stage,
            loss_scale=static,
            scaler=scaler,
            scale_node=scale_node,
        )
    master = raw | set(range(backward_end, len(g.nodes)))
    if seed_node is not None:  # the scale itself: 2**16 is beyond f16's 65504
        master.add(seed_node)
    if options.nonfinite_guard is not None and (
        options.optimizer is not None or options.accumulate_grads
    ):
        # A skipped step must leave BatchNorm's running statistics as it leaves parameters.
        if options.accumulate_grads:
            accumulation = "stage"
        else:
            accumulation = "commit" if options.accumulation_steps > 1 else None
        g, id_map = defer_update_stats(g, accumulation)
        master = {id_map[i] for i in master if i in id_map}
    return g, frozenset(master)


def compile(
    graph: Graph,
    options: CompileOptions | None = None,  # noqa: A001
    limits: Limits | None = None,
    graph_seconds: float | None = None,
) -> Program:
    """Compile ``graph`` into a Program.

    Args:
        graph: a verified forward graph (from ``GraphBuilder.build``).
        options: what to build; default inference only.
        limits: adapter limits; default WebGPU's minimums.
        graph_seconds: time the caller spent building ``graph``, recorded as stage ``graph``.

    Returns:
        A Program whose ``meta["compile_seconds"]`` holds wall seconds per stage, in order:
        ``graph`` (only when given), ``autodiff`` (backward + optimizer, 0 for inference),
        ``passes`` (fold_batch_norm, fold_permutes, dce, cse, split_bindings), ``codegen``
        (schedule + lowering to WGSL), ``plan_memory``,
        ``assemble`` (buffer table and dispatches), ``pack`` (independent neighbouring
        dispatches run as one: ``schedule.pack``); ``meta`` also holds the options.

        ``meta["precision"]`` is the precision compiled (``"strict"`` or ``"fast"``) and
        ``meta["precision_requested"]`` the one asked for. ``meta["matmuls"]`` lists each
        matmul's shape and plan with the plan's source (``matmul.lowering.matmul_choices``),
        ``meta["convs"]`` each conv GEMM's op, sizes, plan and source, in lowering order
        (``conv.gemm.record_choices``).

    Raises:
        GraphError: when ``graph`` breaks an IR invariant (a cycle, a mis-typed node, an
            unknown op: ``graph.verify``); graphs reach ``compile`` without the builder too.
        ValueError: for inconsistent options (a ``loss`` that names no output: the message
            lists the outputs, a ``max_storage_binding_bytes`` above the adapter's), or a
            tensor larger than one buffer (``Limits.max_buffer_size``).
        BindingSplitError: (a ValueError) a tensor larger than one storage binding that an
            op reading it cannot split into row blocks (``passes.split_bindings``; the message
            names the tensor, its size, the limit and the op).

    Warns:
        PrecisionFallbackWarning: ``precision="fast"`` without ``limits.shader_f16``.
    """
    options = options or CompileOptions()
    limits = binding_limits(limits or Limits(), options)
    times: dict[str, float] = {} if graph_seconds is None else {"graph": float(graph_seconds)}
    t0 = time.perf_counter()
    verify(graph, allow_unused_inputs=True)  # an unverified graph gave KeyErrors or wrong values
    master: frozenset[int] = frozenset()
    if options.differentiates:
        graph, master = _training_graph(graph, options, limits)
    times["autodiff"] = time.perf_counter() - t0

    t = time.perf_counter()
    if options.fold_batch_norm and not options.differentiates:
        graph = fold_batch_norm(graph)[0]
    graph, master = simplify_program(graph, master)
    if options.fuse:  # blocked elementwise nodes next to their operands, for fusion
        bound = limits.max_storage_buffers_per_shader_stage
        graph, id_map = hoist_fusible(graph, FUSIBLE, bound)
        master = frozenset(id_map[i] for i in master)
    precision = options.precision
    if precision == "fast" and not limits.shader_f16:
        warnings.warn(
            "precision='fast' needs the adapter's shader-f16 feature; compiling strict f32",
            PrecisionFallbackWarning,
            stacklevel=2,
        )
        precision = "strict"
    graph, narrowed = storage_plan(graph, master, options, precision)
    unsplit = graph  # label checks read the token ids the split index_selects clamp
    graph, kept = split_bindings(graph, limits)
    narrowed = frozenset(kept[i] for i in narrowed if i in kept)
    times["passes"] = time.perf_counter() - t

    t = time.perf_counter()
    with record_choices() as convs:
        sched = schedule(graph, limits, fuse=options.fuse)
    times["codegen"] = time.perf_counter() - t

    t = time.perf_counter()
    plan = plan_memory(sched.intervals)
    times["plan_memory"] = time.perf_counter() - t

    t = time.perf_counter()
    program = _assemble(graph, sched, plan, limits, narrowed, unsplit)
    times["assemble"] = time.perf_counter() - t

    t = time.perf_counter()
    program = pack_program(program, limits)
    times["pack"] = time.perf_counter() - t
    meta = dict(program.meta)
    meta["precision"] = precision
    meta["precision_requested"] = options.precision
    meta["compile_seconds"] = times
    meta["num_nodes"] = len(graph.nodes)
    meta["max_storage_binding_bytes"] = limits.max_storage_buffer_binding_size
    meta["matmuls"] = matmul_choices(graph, limits)
    meta["convs"] = convs
    if options.optimizer is not None:
        meta["optimizer"] = options.optimizer.config()
        meta["max_grad_norm"] = options.max_grad_norm
        meta["nonfinite_guard"] = options.nonfinite_guard
    return program.replace(meta=meta)


def binding_limits(limits: Limits, options: CompileOptions) -> Limits:
    """``limits`` with ``options.max_storage_binding_bytes`` as the storage binding limit.

    Raises:
        ValueError: the option exceeds the adapter's ``max_storage_buffer_binding_size``.
    """
    want = options.max_storage_binding_bytes
    if want is None:
        return limits
    if want > limits.max_storage_buffer_binding_size:
        raise ValueError(
            f"max_storage_binding_bytes={want:,} exceeds the adapter's "
            f"max_storage_buffer_binding_size of {limits.max_storage_buffer_binding_size:,}"
        )
    return dataclasses.replace(limits, max_storage_buffer_binding_size=want)


def simplify_program(graph: Graph, master: frozenset[int]) -> tuple[Graph, frozenset[int]]:
    """The type-checked rewrites every program gets (fold_permutes, dce, cse, dce).

    Returns:
        (the rewritten graph, ``master`` mapped to its node ids).
    """
    for rewrite in (fold_permutes, dce, cse, dce):
        graph, id_map = rewrite(graph)
        master = frozenset(id_map[i] for i in master if i in id_map)
    return graph, master


def storage_plan(
    graph: Graph, master: frozenset[int], options: CompileOptions, precision: str
) -> tuple[Graph, frozenset[int]]:
    """(storage plan, ids stored as f16): ``narrow_storage`` in the fast mode, else as is."""
    if precision != "fast":
        return graph, frozenset()
    parameters = options.optimizer is None and not options.shared_parameters
    return narrow_storage(graph, master, parameters=parameters)


def _assemble(
    graph: Graph, sched, plan, limits: Limits, narrowed=frozenset(), unsplit: Graph | None = None
) -> Program:
    buffers: list[BufferSpec] = []
    place: dict[int, tuple[int, int]] = {}  # pinned root -> (buffer, byte offset)
    slots = {"input": {}, "parameter": {}, "state": {}}
    outputs: dict[str, TensorSlot] = {}

    def new_buffer(size: int, role, name=None) -> int:
        # A buffer may exceed one binding (split_bindings binds row blocks of it), not this.
        if size > limits.max_buffer_size:
            raise ValueError(
                f"tensor {name or 'intermediate'} needs {size:,} bytes, more than the adapter's "
                f"largest buffer ({limits.max_buffer_size:,} bytes, max_buffer_size)"
            )
        buffers.append(BufferSpec(len(buffers), max(4, (size + 3) // 4 * 4), role, name))
        return len(buffers) - 1

    # Optimizer group arenas first: member k of a group sits at the same offset in each.
    arena_of: dict[tuple, int] = {}
    arena_buffers: set[int] = set()
    for grp in sched.update_groups:
        itemsize = graph[graph[grp.members[0]].inputs[0]].type.dtype.itemsize
        for role in arena_roles(graph, grp):
            kind = ARENA_BUFFER_ROLES.get(role, "state")
            buf = new_buffer(grp.length * itemsize, kind, f"optim group {grp.index} {role}")
            arena_of[grp.arena_key(role)] = buf
            arena_buffers.add(buf)
            for m, off in zip(grp.members, grp.offsets, strict=True):
                place[arena_value(graph, m, role)] = (buf, off * itemsize)

    for node in graph.nodes:
        if node.op in slots:
            if node.id not in place:
                place[node.id] = (new_buffer(node.type.nbytes, node.op, node.name), 0)
            b, off = place[node.id]
            # A parameter narrowed to f16 storage is still f32 to the host (Session converts).
            host = DType.f32 if node.id in narrowed else None
            slots[node.op][node.name] = TensorSlot(
                b, node.type.shape, node.type.dtype, off, host_dtype=host
            )
    # A row block of a leaf (split_bindings) is bound as its byte range of the leaf's buffer.
    blocks: set[int] = set()
    for node in graph.nodes:
        if node.op in SUBRANGE_OPS:
            leaf = graph[resolve_view(graph, node.inputs[0])]
            buf, off = place[leaf.id]
            row_bytes = leaf.type.nbytes // leaf.type.shape[0]
            place[node.id] = (buf, off + node.attr("start") * row_bytes)
            blocks.add(node.id)
    for name, v in graph.outputs:
        r = sched.root[v]
        if r not in place:
            place[r] = (new_buffer(graph.nodes[r].type.nbytes, "output", name), 0)
        t = graph.nodes[v].type
        outputs[name] = TensorSlot(place[r][0], t.shape, t.dtype, place[r][1])
    # A placed concatenation's operands are written in place, each at its rows of its buffer.
    for node in graph.nodes:
        if node.op in PLACED_OPS:
            buf, off = place[node.id]
            row_bytes = node.type.nbytes // node.type.shape[0]
            for i in node.inputs:
                place[i] = (buf, off)
                blocks.add(i)
                off += graph[i].type.shape[0] * row_bytes
    pinned_bytes = sum(b.size for b in buffers)

    pool = [new_buffer(size, "intermediate") for size in plan.buffer_sizes]

    dispatches: list[Dispatch] = []
    for nid, ks in sched.dispatches:
        spans: list[tuple[int, int, int]] = []  # (buffer, offset, size; 0 = to the end)
        for bnd in ks.bindings:
            if isinstance(bnd, ValueRef):
                r = sched.root[bnd.node]
                if r in place:
                    buf, off = place[r]
                    # a value in an arena is bound as its own sub-range, whole buffers whole
                    size = max(4, (graph.nodes[r].type.nbytes + 3) // 4 * 4)
                    own = buf in arena_buffers or r in blocks
                    spans.append((buf, off, size if own else 0))
                else:
                    spans.append((pool[plan.assignment[r]], 0, 0))
            elif isinstance(bnd, ArenaRef):
                spans.append((arena_of[bnd.key], 0, 0))
            else:
                assert isinstance(bnd, ScratchRef)
                spans.append((pool[plan.assignment[bnd.slot(nid)]], 0, 0))
        _check_disjoint(ks.name, spans, [bnd.write for bnd in ks.bindings], buffers)
        ids = tuple(b for b, _, _ in spans)
        offsets = tuple(o for _, o, _ in spans)
        sizes = tuple(z for _, _, z in spans)
        partial = any(offsets) or any(sizes)
        dispatches.append(
            Dispatch(
                ks.name,
                ks.wgsl,
                ids,
                tuple(bnd.write for bnd in ks.bindings),
                ks.grid,
                ks.flops,
                ks.bytes,
                offsets if partial else (),
                sizes if partial else (),
            )
        )

    checks: dict[tuple, LabelCheck] = {}  # one per (input, bound, ignore_index)
    graph = unsplit or graph
    for node in graph.nodes:
        # Class indices, token ids and gather/index_select/index_copy_ indices fed by the host
        # are range-checked before a step runs: out of range, the kernels would read zeros (or
        # write nothing).
        target = bound = ignore = None
        if node.op == "cross_entropy" and graph.nodes[node.inputs[1]].type.dtype.is_integer:
            target = graph.nodes[resolve_view(graph, node.inputs[1])]
            bound = graph.nodes[node.inputs[0]].type.shape[1]
            ignore = node.attr("ignore_index")
        elif node.op in ("gather", "index_select", "index_copy_"):
            target = graph.nodes[resolve_view(graph, node.inputs[1])]
            bound = graph.nodes[node.inputs[0]].type.shape[node.attr("dim")]
        if target is not None and target.op == "input":
            op = node.origin or node.op  # embedding, not the index_select it lowers to
            at = f" at {node.loc}" if node.loc else ""
            what = INDEX_MEANING.get(op, "index")
            check = LabelCheck(target.name, bound, ignore, f"{op} %{node.id}{at}", what)
            checks.setdefault((target.name, bound, ignore), check)

    return Program(
        buffers=tuple(buffers),
        dispatches=tuple(dispatches),
        inputs=slots["input"],
        outputs=outputs,
        parameters=slots["parameter"],
        state=slots["state"],
        label_checks=tuple(checks.values()),
        memory=MemoryReport(plan.planned_bytes, plan.naive_bytes, pinned_bytes),
    )


# What an index input's values are to the op reading them, for range-check errors
# (LabelCheck.what); any other reader (gather, index_select) reads an "index".
INDEX_MEANING = {"cross_entropy": "class index", "embedding": "token id"}

# Buffer role of each optimizer-group arena (``schedule.update_groups``); states are "state".
ARENA_BUFFER_ROLES = {"param": "parameter", "grad": "gradient"}


def _check_disjoint(name: str, spans: list[tuple[int, int, int]], writes, buffers) -> None:
    """Raise AssertionError when two bindings of one kernel conflict (``binding_conflict``)."""
    ranges = [(buf, off, off + (size or buffers[buf].size - off)) for buf, off, size in spans]
    i = binding_conflict(ranges, writes)
    if i is not None:
        raise AssertionError(f"kernel {name} binds buffer {ranges[i][0]} twice in conflict")
