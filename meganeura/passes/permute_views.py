"""Permutes around attention read and written in place: the head layout without copies.

Attention is written the way PyTorch users write it: project to [B, S, H*D], reshape to
[B, S, H, D], ``permute(0, 2, 1, 3)`` to the head layout [B, H, S, D] that
``scaled_dot_product_attention`` and ``apply_rotary_emb`` take, and permute the output back
before ``o_proj``. Each permute is a copy kernel of a few microseconds whatever its size
(SmolLM2-135M: 4 per layer forward, 8 per training step; a third of all dispatches after the
matmuls). This module decides which of them need no kernel, by one graph-local rule that the
scheduler (``codegen.wgsl.reads``: what kernels bind) and the kernels
(``codegen.wgsl.core.builder.KernelBuilder``) both consult, so they always agree:

  * a *read view*: an operand of a ``VIEW_READERS`` op (the attention ops, rotary embeddings,
    ``index_copy_``'s source) that is ``permute(x, dims)`` is read from ``x``'s buffer through
    the permute's strides (``read_view``); the permute gets no kernel when nothing else
    reads it (it is not needed, ``schedule.needed_nodes``);
  * a *placed output*: a ``PLACED_PRODUCERS`` node ``a`` (the attention forward, its
    gradients, a rotary embedding) whose value is read by exactly one ``p = permute(a,
    dims)`` and otherwise only by ``VIEW_READERS`` ops, and is no graph output, is written
    straight into ``p``'s buffer in ``p``'s layout (``placement``); ``p`` gets no kernel
    (``codegen.wgsl.lower`` returns none) and ``a`` no buffer: its other readers read it
    from ``p``'s buffer through the inverse strides (``read_view`` again).

The typed IR is not rewritten: the interpreter, autodiff and the op semantics see the
permutes; only what kernels bind and how they index changes (as ``matmul.problem
.fold_transpose`` reads a transposed operand in place). Kernels of these ops address every
operand through ``Src.at`` and every output through ``KernelBuilder.store``, which apply the
strides (``core.layout.strided_index``); vec4 bindings are never used for a strided value.

Invariants (each check conservative; a permute that fails one keeps its copy kernel):
  * the permute keeps its last dim last (rows of the head dim stay contiguous, so a kernel's
    4-element runs stay within one row of storage);
  * a read view's ``x`` is not itself placed (a placed value has no buffer of its own);
  * a placed ``a`` is read directly (not through views) by ``p`` and by view readers only
    (never as the storage ``index_copy_`` writes in place), so every kernel reading it applies
    the inverse strides; ``p`` reads ``a`` directly; ``p`` is
    not read through a view by a view reader (which would fold it into ``a``'s missing
    buffer: ``read_view`` refuses permutes of placed values);
  * the rule reads only the graph, so ``needed_nodes``, liveness and the kernels agree.

``ENABLED`` switches the rule off (tests compare the programs with and without it).
"""

from __future__ import annotations

from ..graph.ir import VIEW_OPS, Graph
from ..ops.attention import BWD_K, BWD_Q, BWD_V, DELTA, LSE, SDPA, STATS
from ..ops.inplace import INDEX_COPY

ROPE = "apply_rotary_emb"
# Ops whose kernels read every operand through ``Src.at`` of ``KernelBuilder.read`` (strides
# applied there), in every lowering of the op and of the groups they join.
VIEW_READERS = frozenset({SDPA, STATS, LSE, DELTA, BWD_Q, BWD_K, BWD_V, ROPE, INDEX_COPY})
# Ops whose kernels store their output only through ``KernelBuilder.store``.
PLACED_PRODUCERS = frozenset({SDPA, BWD_Q, BWD_K, BWD_V, ROPE})
# False: every permute is a copy kernel (the programs before this pass).
ENABLED = True


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _keeps_last(dims: tuple[int, ...]) -> bool:
    return len(dims) >= 1 and dims[-1] == len(dims) - 1


def _strip(graph: Graph, vid: int) -> int:
    while graph[vid].op in VIEW_OPS:
        vid = graph[vid].inputs[0]
    return vid


_USERS: dict[int, tuple[Graph, list[list[int]]]] = {}  # id(graph) -> (graph, its users)


def _users(graph: Graph) -> list[list[int]]:
    """``graph.users()``, kept for the last few graphs (the rule is asked once per operand)."""
    hit = _USERS.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(_USERS) >= 8:
        _USERS.pop(next(iter(_USERS)))
    users = graph.users()
    _USERS[id(graph)] = (graph, users)
    return users


def placement(graph: Graph, producer: int) -> int | None:
    """The permute node whose buffer ``producer``'s kernel writes, or None when it writes its
    own (see the module docstring for the rule)."""
    node = graph[producer]
    if not ENABLED or node.op not in PLACED_PRODUCERS or node.type.numel == 0:
        return None
    if any(v == producer for _, v in graph.outputs):
        return None
    perm = None
    for uid in dict.fromkeys(_users(graph)[producer]):
        user = graph[uid]
        if user.op == "permute":
            if perm is not None or not _keeps_last(tuple(user.attr("dims"))):
                return None
            perm = user.id
        elif user.op not in VIEW_READERS:
            return None
        elif user.op == INDEX_COPY and user.inputs[0] == producer:
            return None  # written in place: its new version would alias a missing buffer
    return perm


def placed_source(graph: Graph, permute: int) -> int | None:
    """The producer written straight into permute node ``permute``'s buffer, or None."""
    node = graph[permute]
    if node.op != "permute" or not ENABLED:
        return None
    src = node.inputs[0]
    return src if placement(graph, src) == permute else None


def read_view(graph: Graph, vid: int) -> tuple[int, tuple[int, ...]] | None:
    """How a ``VIEW_READERS`` kernel reads operand ``vid`` when not from its own buffer:
    (the value whose buffer it binds, the strides of ``vid``'s logical dims in that buffer),
    or None for a plain read.

    ``vid`` (views followed) is ``permute(x, dims)`` keeping its last dim, ``x`` not placed:
    ``x``'s buffer, dim k at ``x``'s stride of dim ``dims[k]``. Or ``vid`` is a placed
    producer: its permute's buffer, dim ``dims[k]`` at the permute's stride of dim k.
    """
    if not ENABLED:
        return None
    root = _strip(graph, vid)
    node = graph[root]
    if node.type.shape != graph[vid].type.shape:
        return None  # a reshape of a permute: not one set of strides
    if node.op == "permute" and _keeps_last(tuple(node.attr("dims"))):
        if placed_source(graph, root) is not None:
            return None  # its buffer is real: the producer writes it
        x = node.inputs[0]
        if placement(graph, _strip(graph, x)) is not None:
            return None
        st = _contiguous(graph[x].type.shape)
        return _strip(graph, x), tuple(st[d] for d in node.attr("dims"))
    perm = placement(graph, root)
    if perm is not None and root == vid:
        dims = graph[perm].attr("dims")
        st = _contiguous(graph[perm].type.shape)
        strides = [0] * len(dims)
        for k, d in enumerate(dims):
            strides[d] = st[k]
        return perm, tuple(strides)
    return None


def write_view(graph: Graph, vid: int) -> tuple[int, tuple[int, ...]] | None:
    """(the permute whose buffer a kernel writing ``vid`` binds, the strides of ``vid``'s
    dims in it), or None when ``vid`` is written to its own buffer."""
    perm = placement(graph, vid)
    if perm is None:
        return None
    view = read_view(graph, vid)
    assert view is not None and view[0] == perm
    return view


def view_reads(graph: Graph, node_id: int, ids: tuple[int, ...]) -> tuple[int, ...]:
    """``ids`` (operands of node ``node_id``) with each operand a view reader reads through
    strides replaced by the value whose buffer it binds; a placed permute reports its
    producer (whose kernel writes it), so that the producer stays needed."""
    node = graph[node_id]
    if node.op == "permute":
        src = placed_source(graph, node_id)
        return ids if src is None else (src,)
    if node.op not in VIEW_READERS or not ENABLED:
        return ids
    out = []
    for i in ids:
        view = read_view(graph, i)
        out.append(i if view is None else view[0])
    return tuple(out)
