"""Broadcasts read in place: the nearest-2x upsample and its concatenation without copies.

``interpolate(x, scale_factor=2, mode="nearest")`` is built, per spatial axis, as ``reshape``
(a size-1 dim after the axis) -> ``broadcast_to`` (that dim to 2) -> ``reshape`` (merge it
into the axis) (``ops.resample._nearest_axis``), and a U-Net decoder concatenates the result
with a skip. Each ``broadcast_to`` used to be a copy kernel (the reshape after it merges a
stride-0 dim into a strided one, which no single set of strides describes), a few microseconds
whatever its size. This module decides which of them need no kernel, by one graph-local rule
that the scheduler (``codegen.wgsl.lowering.reads``: what kernels bind) and the kernels
(``codegen.wgsl.core.builder.KernelBuilder.read``) both consult, so they always agree:

  * a *broadcast view*: an operand of a ``READERS`` op (``cat``, reductions that would read
    element by element) that is a chain of ``reshape`` / ``stop_gradient`` views and
    ``VIEWABLE`` copies (``broadcast_to``, ``slice``: an offset and steps) over a
    value ``x`` with at least one such copy on it is read from ``x``'s buffer through a
    *refined* shape and strides (``read_view``): the value's row-major elements enumerated
    over finer dims (each logical dim split into factors, e.g. [N, C, 2H, 2W] as [N, C, H, 2,
    W, 2]), each factor with its stride in ``x`` (0 on broadcast factors). The copies then get
    no kernel when nothing else reads them (they are not needed, ``schedule.needed_nodes``).

The typed IR is not rewritten: the interpreter, autodiff and every op's meaning still see the
broadcasts; only what the reading kernel binds and how ``Src.at`` maps its index changes, so
values are bit-identical (copies do not change values).

Invariants (each check conservative; a chain that fails one is read as before):
  * every reshape on the chain has a common refinement with the factors so far (its dims and
    the factors split each other evenly), else no view;
  * ``x`` is not a constant (inlined as a literal anyway) and not placed
    (``permute_views.placement``: a placed value has no buffer of its own);
  * ``x`` is never a split-K product read as its partials (``matmul.deferred``): its reader
    on the chain, the copy, is not needed, so ``deferred._sums`` refuses it;
  * the rule reads only the graph, so ``needed_nodes``, liveness and the kernels agree.

``set_enabled(False)`` switches the rule off (tests compare the programs with and without it).
"""

from __future__ import annotations

from ..graph.ir import VIEW_OPS, Graph
from .permute_views import placement

# Copy ops a chain may read through (their kernels are then not needed).
VIEWABLE = frozenset({"broadcast_to", "slice"})
REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "logsumexp")
# Ops whose kernels read every operand through ``Src.at`` of ``KernelBuilder.read`` at the
# operand's flat row-major index, in every lowering of the op. None joins a group in which
# another node's kernel would read the chain: a bias-gradient ``sum`` joins a norm's backward
# group (``passes.fuse_norm``) only reading the ``silu_backward`` in it, never a chain.
READERS = frozenset({"cat", *REDUCTIONS})
_ENABLED = [True]

Factors = list[list[tuple[int, int]]]  # per logical dim: (size, stride) factors, outer first


def set_enabled(on: bool) -> None:
    """Read broadcasts in place (True, the default) or copy them (False: the programs before
    this module)."""
    _ENABLED[0] = bool(on)


def enabled() -> bool:
    return _ENABLED[0]


def _contiguous(shape: tuple[int, ...]) -> Factors:
    out: Factors = []
    acc = 1
    for n in reversed(shape):
        out.append([(n, acc)] if n != 1 else [])
        acc *= n
    return list(reversed(out))


def _reshape(dims: Factors, shape: tuple[int, ...]) -> Factors | None:
    """``dims`` regrouped into ``shape``'s dims, factors split where a dim boundary falls
    inside one; None when the boundaries do not split each other evenly."""
    flat = [f for group in dims for f in group]
    out: Factors = []
    for want in reversed(shape):
        group: list[tuple[int, int]] = []
        have = 1
        while have < want:
            if not flat:
                return None
            n, s = flat.pop()
            need = want // have
            if want % have:
                return None
            if n <= need and need % n == 0:
                group.append((n, s))
                have *= n
            elif n % need == 0:  # split: the inner part joins this dim, the outer stays
                group.append((need, s))
                flat.append((n // need, s * need))
                have *= need
            else:
                return None
        if have != want:
            return None
        out.append(list(reversed(group)))
    if flat:
        return None
    return list(reversed(out))


def _broadcast(dims: Factors, src: tuple[int, ...], shape: tuple[int, ...]) -> Factors:
    pad = len(shape) - len(src)
    out: Factors = []
    for d, n in enumerate(shape):
        if d < pad or src[d - pad] == 1:
            out.append([(n, 0)] if n != 1 else [])
        else:
            out.append(dims[d - pad])
    return out


def _slice(dims: Factors, node) -> tuple[Factors, int] | None:
    """(``dims`` sliced as ``node`` says, the offset of its first element), or None when a
    dim cut is made of several factors."""
    out: Factors = []
    offset = 0
    for d, (group, m) in enumerate(zip(dims, node.type.shape, strict=True)):
        start, step = node.attr("start")[d], node.attr("step")[d]
        if start == 0 and m == _size(group):
            out.append(group)  # the whole dim
            continue
        if m == 0 or len(group) != 1:
            return None
        n, s = group[0]
        offset += start * s
        out.append([(m, s * step)] if m != 1 else [])
    return out, offset


def _size(group: list[tuple[int, int]]) -> int:
    size = 1
    for n, _ in group:
        size *= n
    return size


def _chain(graph: Graph, vid: int) -> tuple[int, list[int]] | None:
    """(the value the chain from ``vid`` starts at, the chain's nodes from it up to ``vid``),
    or None when no ``VIEWABLE`` copy is on it."""
    path = []
    while graph[vid].op in VIEW_OPS or graph[vid].op in VIEWABLE:
        path.append(vid)
        vid = graph[vid].inputs[0]
    if not any(graph[p].op in VIEWABLE for p in path):
        return None
    return vid, list(reversed(path))


def read_view(graph: Graph, vid: int) -> tuple[int, tuple[int, ...], tuple[int, ...], int] | None:
    """How a ``READERS`` kernel reads operand ``vid`` when not from its own buffer: (the value
    whose buffer it binds, the refined shape enumerating ``vid``'s elements in row-major order,
    the stride of each refined dim in that buffer, the offset of element 0 in it), or None for
    a plain read."""
    if not _ENABLED[0]:
        return None
    chain = _chain(graph, vid)
    if chain is None:
        return None
    x, path = chain
    if graph[x].op == "constant" or placement(graph, x) is not None:
        return None
    dims: Factors | None = _contiguous(graph[x].type.shape)
    offset = 0
    for p in path:
        node = graph[p]
        if node.op == "slice":
            cut = _slice(dims, node)
            if cut is None:
                return None
            dims, more = cut
            offset += more
        elif node.op == "broadcast_to":
            dims = _broadcast(dims, graph[node.inputs[0]].type.shape, node.type.shape)
        elif node.op == "reshape":
            dims = _reshape(dims, node.type.shape)
            if dims is None:
                return None
    flat = [f for group in dims for f in group]
    return x, tuple(n for n, _ in flat), tuple(s for _, s in flat), offset


def reads_in_place(graph: Graph, node_id: int) -> bool:
    """Whether node ``node_id``'s kernels read chains of its operands in place: a ``READERS``
    op, and for a reduction only one that would read its operand, stored, element by element
    (``reduce.reductions.takes_vec4``: the vec4 path sums in another order, so reading in
    place there would change the values)."""
    node = graph[node_id]
    if not _ENABLED[0] or node.op not in READERS:
        return False
    if node.op in REDUCTIONS:
        from ..codegen.wgsl.reduce.reductions import takes_vec4  # codegen imports this module

        return not takes_vec4(graph, node_id)
    return True


def view_reads(graph: Graph, node_id: int, ids: tuple[int, ...]) -> tuple[int, ...]:
    """``ids`` (operands of node ``node_id``) with each operand a ``READERS`` kernel reads
    through a broadcast view replaced by the value whose buffer it binds."""
    if not reads_in_place(graph, node_id):
        return ids
    out = []
    for i in ids:
        view = read_view(graph, i)
        out.append(i if view is None else view[0])
    return tuple(out)
