"""Matmul groups: several matmuls reading one left operand, and the norm producing it, in one
kernel (``codegen.wgsl.matmul.horizontal``).

``plan_matmul_groups`` runs after ``fuse.plan_fusion`` and merges its matmul-anchored groups
(and bare matmuls) that read the same left operand ``x`` through the same strides:
``x @ Wq.mT``, ``x @ Wk.mT``, ``x @ Wv.mT`` become one dispatch writing three outputs, each
through its own epilogue. Epilogues that read one another (``silu(x @ Wg.mT) * (x @ Wu.mT)``)
put their matmuls in one *segment*: the same threads compute both products for the same
output element, so the epilogue reads both accumulators and the gate activation is never
stored. When ``x`` is a ``rms_norm`` or ``layer_norm`` over its last dim read by nothing but
the group's matmuls, the norm joins the group as a *prologue*: every workgroup recomputes
the rows' statistics and normalizes ``x`` as it loads it, and the normalized value is never
stored. Which matmuls qualify (the small-M ``gemv`` kernel, weights stored [N, K]; the
``tiled`` kernel for M > 8, unbatched, ``codegen.wgsl.matmul.tiled_group``) is the kernels'
choice, passed in as ``key``.

Right-shared groups (``shared="right"``, a second pass): weight gradients reading one right
operand, ``dQ.mT @ x``, ``dK.mT @ x``, ``dV.mT @ x`` with ``x`` the layer's normed input, run
as one dispatch (``codegen.wgsl.matmul.tiled_rgroup``) under the same invariants with the
operands' roles swapped; no norm joins them.

Invariants of every ``MatmulGroup`` (each check conservative; a rejected merge keeps the
groups ``plan_fusion`` made):
  * two or more matmuls, or one matmul and a norm prologue; every member is needed;
  * the matmuls share ``key`` (the bound left operand, its strides, M and K; right-shared:
    the bound right operand, its strides, N and K);
  * a segment's matmuls have one output shape; each epilogue member broadcasts to it; a
    member reads other members only directly (not through views), and only members of its
    own segment, or the norm as a matmul's left operand; no right operand (left operand, in
    right-shared groups) is a member;
  * every node outside the group reading a member (through views, and through nodes without
    a kernel) comes after the group's last member, where the kernel runs; the norm has no
    such reader and is no graph output;
  * no op with in-place effects lies between the first and the last member;
  * with ``max_bindings``, the kernel binds at most that many storage buffers (external
    inputs, views resolved and constants inlined, plus stored members).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ..graph.ir import VIEW_OPS, Graph, resolve_view
from ..ops import OPS
from .fuse import FusionGroup

NORM_OPS = ("rms_norm", "layer_norm")
PROLOGUES = [True]  # norms join groups as prologues (``set_prologues``: a bench A/B switch)
# Tiled groups (``tiled_group.tiled_key``: products past the GEMV kernels) leave the norm its
# own dispatch; GEMV groups (decoding) keep the prologue. On the H200 W4's fc1 (1500 x 384 x
# 1536) ran 137 us a layer with the layer-norm prologue against 88-95 us for the plain product
# (bench/results/sweeps/matmul_sweep*_h200.json) plus ~13 for the norm's dispatch, and W4's
# forward ran 5.3% faster without the prologue (bench/results/lever_ab_h200_norm_prologue.json;
# W1's and SmolVLA's forwards have no tiled prologue: their groups' products split K).
# ``set_tiled_norms_apart``: an A/B switch (lever ``tiled_norms_apart``).
TILED_NORMS_APART = [True]


def set_prologues(on: bool) -> None:
    """Let a norm read only by a left-shared group's matmuls join it as a prologue (on, the
    default; tiled groups only with ``set_tiled_norms_apart(False)``) or keep its own dispatch
    (off), for programs compiled from now on."""
    PROLOGUES[:] = [bool(on)]


def set_tiled_norms_apart(on: bool) -> None:
    """Keep a norm's own dispatch before a tiled group (on, the default) or let it join the
    group as a prologue like a GEMV group's (off), for programs compiled from now on."""
    TILED_NORMS_APART[:] = [bool(on)]


@dataclass(frozen=True)
class MatmulSegment:
    """Matmuls one set of threads computes element by element, and their epilogue.

    Attributes:
        anchors: the matmuls, in program order; they share an output shape.
        epilogue: elementwise members computed from the products, in program order.
        outputs: anchors and epilogue members the kernel stores, in program order.
    """

    anchors: tuple[int, ...]
    epilogue: tuple[int, ...]
    outputs: tuple[int, ...]

    def as_fusion_group(self, shape: tuple[int, ...]) -> FusionGroup:
        """The segment as a ``FusionGroup`` (for ``GroupBody``), anchored on its first matmul."""
        members = tuple(sorted(self.anchors + self.epilogue))
        return FusionGroup(members, self.outputs, shape, self.anchors[0])


@dataclass(frozen=True)
class MatmulGroup:
    """Matmuls sharing a left (or right) operand, computed by one kernel.

    Attributes:
        members: every node the kernel computes, in program order.
        outputs: members the kernel stores.
        segments: in program order of their first matmul.
        norm: the ``rms_norm`` / ``layer_norm`` node computed in the prologue, or None.
        shared: ``"left"`` (the products read one left operand) or ``"right"`` (one right
            operand: weight gradients ``dY_i.mT @ x``; never with a norm).
    """

    members: tuple[int, ...]
    outputs: tuple[int, ...]
    segments: tuple[MatmulSegment, ...]
    norm: int | None = None
    shared: str = "left"

    @property
    def sink(self) -> int:
        """The last member: the kernel runs at its position."""
        return self.members[-1]

    @property
    def anchor(self) -> int:
        """The first matmul (names the kernel)."""
        return self.segments[0].anchors[0]


def _readers(graph: Graph, users: list[list[int]], vid: int) -> list[int]:
    out = []
    for u in users[vid]:
        out.extend(_readers(graph, users, u) if graph[u].op in VIEW_OPS else [u])
    return out


class _Merger:
    def __init__(
        self,
        graph: Graph,
        needed: Sequence[bool],
        max_bindings: int | None,
        accept: Callable[[MatmulGroup], bool],
        shared: str = "left",
    ) -> None:
        self.graph, self.needed, self.max_bindings = graph, needed, max_bindings
        self.accept, self.shared = accept, shared
        self.other = 1 if shared == "left" else 0  # the operand each product reads alone
        self.users = graph.users()
        self.out_roots = {resolve_view(graph, v) for _, v in graph.outputs}
        self.effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]

    def readers(self, vid: int) -> list[int]:
        return _readers(self.graph, self.users, vid)

    def kernel_readers(self, vid: int) -> list[int]:
        """The readers of ``vid`` that get kernels: a node without one (a ``permute`` folded
        into its reader, as a prefill's q reshaped into heads for ``rope_cache``) passes the
        read on to its own readers."""
        out = []
        for r in self.readers(vid):
            out.extend([r] if self.needed[r] else self.kernel_readers(r))
        return out

    def stored(self, members: set[int], m: int) -> bool:
        return m in self.out_roots or any(r not in members for r in self.readers(m))

    def build(
        self, units: list[tuple[int, tuple[int, ...]]], norm: int | None
    ) -> MatmulGroup | None:
        """The group of ``units`` ((matmul, epilogue members) each) and ``norm``, or None when
        an invariant of the module docstring fails."""
        g = self.graph
        members = {a for a, _ in units} | {m for _, e in units for m in e}
        if norm is not None:
            members.add(norm)
        seg_of = {}  # member -> index of its unit's segment (union-find over units)
        parent = list(range(len(units)))

        def find(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for k, (a, e) in enumerate(units):
            for m in (a, *e):
                seg_of[m] = k
        for k, (a, e) in enumerate(units):
            for m in e:
                for i in g[m].inputs:
                    r = resolve_view(g, i)
                    if r in members:
                        if i != r or r == norm:
                            return None  # a member read through a view, or the norm by a map
                        parent[find(k)] = find(seg_of[r])
            if _bound(g, g[a].inputs[self.other]) in members:
                return None
        segments: dict[int, list[int]] = {}
        for k in range(len(units)):
            segments.setdefault(find(k), []).append(k)
        last, first = max(members), min(members)
        if any(first < e < last for e in self.effects):
            return None
        if norm is not None and (norm in self.out_roots or any(
            r not in members for r in self.readers(norm)
        )):  # fmt: skip
            return None
        stored = {m for m in members if m != norm and self.stored(members, m)}
        for m in members:
            if any(r not in members and r < last for r in self.kernel_readers(m)):
                return None
        out = []
        for ks in segments.values():
            anchors = tuple(sorted(units[k][0] for k in ks))
            shape = g[anchors[0]].type.shape
            if any(g[a].type.shape != shape for a in anchors):
                return None
            epi = tuple(sorted(m for k in ks for m in units[k][1]))
            if any(m in stored and g[m].type.shape != shape for m in epi):
                return None
            outs = tuple(m for m in sorted(anchors + epi) if m in stored)
            out.append(MatmulSegment(anchors, epi, outs))
        out.sort(key=lambda s: s.anchors[0])
        group = MatmulGroup(
            tuple(sorted(members)), tuple(sorted(stored)), tuple(out), norm, self.shared
        )
        if self.max_bindings is not None and self.bindings(group) > self.max_bindings:
            return None
        return group if self.accept(group) else None

    def bindings(self, group: MatmulGroup) -> int:
        g, members = self.graph, set(group.members)
        external = set()
        for m in group.members:
            for i in g[m].inputs:
                r = _bound(g, i) if g[m].op == "matmul" else resolve_view(g, i)
                if r not in members and g[r].op != "constant":
                    external.add(r)
        return len(external) + len(group.outputs)


def _bound(graph: Graph, vid: int) -> int:
    """The value a matmul kernel binds for operand ``vid``: views resolved, and a transpose of
    the last two dims read in place (``matmul.problem.fold_transpose``)."""
    r = resolve_view(graph, vid)
    node = graph[r]
    if node.op == "permute":
        dims = tuple(node.attr("dims"))
        n = len(dims)
        if n >= 2 and dims == tuple(range(n - 2)) + (n - 1, n - 2):
            return resolve_view(graph, node.inputs[0])
    return r


def plan_matmul_groups(
    graph: Graph,
    groups: Sequence[FusionGroup],
    needed: Sequence[bool],
    key: Callable[[int], Hashable | None],
    max_bindings: int | None = None,
    norm_max_k: int = 0,
    accept: Callable[[MatmulGroup], bool] = lambda _: True,
    shared: str = "left",
) -> tuple[FusionGroup | MatmulGroup, ...]:
    """Merge matmuls sharing a left operand, with their epilogues and the norm producing the
    operand, into ``MatmulGroup``s (the invariants are in the module docstring); with
    ``shared="right"``, matmuls sharing a right operand (no norm prologue), run after the
    left pass on its result: matmuls already in a ``MatmulGroup`` stay there.

    Greedy, in program order per key: each matmul joins the open group of its key when the
    merged group stays valid, else opens a new one; then a group whose left operand is a
    last-dim ``rms_norm`` / ``layer_norm`` of at most ``norm_max_k`` elements per row absorbs
    it when still valid.

    Args:
        graph: a verified graph.
        groups: ``plan_fusion``'s groups (matmul anchors become units with their epilogue).
        needed: per node, whether it gets kernels.
        key: matmul node id -> a key equal for matmuls one kernel can compute together
            (``horizontal.gemv_key``: the bound left operand, strides, M, K;
            ``tiled_group.tiled_key`` adds a tag), None when the matmul cannot join a group;
            the left operand's value id, strides, M and K must be ``key[:5]`` (with
            ``shared="right"``, ``tiled_rgroup.right_key``: the right operand's).
        max_bindings: the adapter's storage-buffer limit per kernel (None: no bound).
        norm_max_k: the longest norm row absorbed as a prologue (0: none).
        accept: the kernel's last word on a group (``horizontal.group_fits``: workgroup
            memory).
        shared: ``"left"`` or ``"right"``: which operand ``key`` compares (for ``"right"``,
            ``key`` describes the right operand and no norm joins).

    Raises:
        ValueError: for ``shared`` other than ``"left"`` or ``"right"``.

    Returns:
        ``groups`` less those merged, plus the new ``MatmulGroup``s, ordered by last member.
    """
    if shared not in ("left", "right"):
        raise ValueError(f"shared must be 'left' or 'right', got {shared!r}")
    merger = _Merger(graph, needed, max_bindings, accept, shared)
    epilogue_of = {
        grp.anchor: tuple(m for m in grp.members if m != grp.anchor)
        for grp in groups
        if isinstance(grp, FusionGroup)
        and grp.anchor is not None
        and graph[grp.anchor].op == "matmul"
    }
    grouped = {m for grp in groups if isinstance(grp, MatmulGroup) for m in grp.members}
    buckets: dict[Hashable, list[list[tuple[int, tuple[int, ...]]]]] = {}
    for node in graph.nodes:
        if node.op != "matmul" or not needed[node.id] or node.id in grouped:
            continue
        k = key(node.id)
        if k is None:
            continue
        unit = (node.id, epilogue_of.get(node.id, ()))
        runs = buckets.setdefault(k, [])
        if runs and merger.build(runs[-1] + [unit], None) is not None:
            runs[-1].append(unit)
        else:
            runs.append([unit])
    merged: list[MatmulGroup] = []
    for k, runs in buckets.items():
        for units in runs:
            group = None
            if shared == "left" and _prologue_ok(graph, k, needed, norm_max_k):  # type: ignore[arg-type]
                group = merger.build(units, resolve_view(graph, k[0]))  # type: ignore[index]
            if group is None and len(units) > 1:
                group = merger.build(units, None)
            if group is not None:
                merged.append(group)
    taken = {m for grp in merged for m in grp.members}
    kept = [grp for grp in groups if not taken.intersection(grp.members)]
    return tuple(sorted([*kept, *merged], key=lambda grp: grp.sink))


def _prologue_ok(graph: Graph, key: tuple, needed: Sequence[bool], max_k: int) -> bool:
    """Whether the left operand of ``key`` ((value, row stride, column stride, M, K, ...)) is a
    needed norm over rows of its last dim, of K <= ``max_k`` elements, read as M contiguous
    rows of K."""
    if not PROLOGUES[0]:
        return False
    if TILED_NORMS_APART[0] and "tiled" in key[5:]:
        return False
    value, rows, cols, m, k = key[:5]
    nid = resolve_view(graph, value)
    node = graph[nid]
    if node.op not in NORM_OPS or not needed[nid] or node.attr("normalized_ndim") != 1:
        return False
    return node.type.shape[-1] == k == rows and cols == 1 and node.type.numel == m * k <= m * max_k
