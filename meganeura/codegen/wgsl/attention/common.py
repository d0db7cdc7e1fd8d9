"""Helpers shared by the attention kernels (``lane``, ``lane_stream``, ``block``, ``decode``,
``dkv_half``, ``dq_delta``, ``rope_attention``, ``lowering``): the operands of each mode, the
running-max sentinel, problem sizes of a node, its optional operands, strided index sums and
row loads."""

from __future__ import annotations

from ....graph.ir import Graph
from ..core.builder import KernelBuilder, Src
from ..core.literals import f32_literal, u
from .plan import Dims

PARTIALS = "partials"  # scratch key of split-key partial states
LOWEST = f32_literal(-3.4028234663852886e38)  # running-max sentinel: below every finite score
XYZW = "xyzw"
# operand names after (q, k), per mode; an optional mask follows them
OPERANDS = {
    "fwd": ("v",),
    "stats": ("o", "dout"),
    "lse": (),
    "dq": ("v", "dout", "st"),
    "dk": ("v", "dout", "st"),
    "dv": ("dout", "st"),
    "dkv": ("v", "dout", "st"),  # the key-gradient node's operands
}


def load4(src: Src, base: str, c: int, n: int) -> str:
    """vec4 of elements 4c..4c+3 of a row starting at storage offset ``base``
    (``Src.row_offset``; 0 past the row's n)."""
    if 4 * c + 3 < n:
        return src.at4(base, 4 * c)
    comps = [
        src.at_offset(f"{base} + {u(4 * c + e)}") if 4 * c + e < n else "0.0" for e in range(4)
    ]
    return f"vec4<f32>({', '.join(comps)})"


def stride_sum(terms: list[tuple[str, int]]) -> str:
    """u32 expression ``sum(var * stride)`` without zero strides."""
    parts = [v if s == 1 else f"{v} * {u(s)}" for v, s in terms if s]
    return " + ".join(parts) or "0u"


def read_extras(kb: KernelBuilder, graph: Graph, extras) -> tuple[Src | None, Src | None]:
    """(mask, kv_length) sources of an attention node's operands after its fixed ones: an
    optional floating mask, then an optional i32 kv_length (the forward only)."""
    extras = list(extras)
    kvlen = None
    if extras and not graph[extras[-1]].type.dtype.is_floating:
        kvlen = kb.read(extras.pop(), "kvlen")
    return (kb.read(extras[0], "mask") if extras else None), kvlen


def kv_limit(kvlen: Src, lk: int) -> str:
    """WGSL statement defining ``kvl``: the batch row's key count clamped to [0, Lk] (``b``
    is the workgroup's batch row)."""
    n = kvlen.at("b" if kvlen.type.shape else "0u")
    return f"  let kvl = min(u32(max({n}, 0i)), {u(lk)});"


def key_end(kvlen: Src | None, causal: bool, rows: int, n_rows: int, lq: int, lk: int) -> list[str]:
    """WGSL statements defining ``s_end``, where the key loop of a query-row tile stops: the
    key count ``kvl`` with a runtime ``kvlen`` (``kv_limit``; with ``causal`` the lower-right
    limit of the tile's last query, ``kvl - Lq + i + 1``), else the tile's last query's keys
    when ``causal`` (``i + 1``, all keys when the tile spans two heads), else ``Lk``. ``rows``
    query rows per tile (``tile`` is the workgroup's tile index), ``n_rows`` of them in all."""
    if kvlen is None and not causal:
        return [f"  let s_end = {u(lk)};"]
    lines = [kv_limit(kvlen, lk)] if kvlen is not None else []
    if not causal:
        return lines + ["  let s_end = kvl;"]
    lines += [
        f"  let r_first = tile * {u(rows)};",
        f"  let r_last = min(r_first + {u(rows)}, {u(n_rows)}) - 1u;",
        f"  let one_head = r_first / {u(lq)} == r_last / {u(lq)};",
    ]
    if kvlen is not None:
        return lines + [
            f"  let lim = i32(kvl) - {lq}i + i32(r_last % {u(lq)}) + 1i;",
            "  let s_end = select(kvl, u32(clamp(lim, 0i, i32(kvl))), one_head);",
        ]
    return lines + [
        f"  let s_end = select({u(lk)}, min({u(lk)}, r_last % {u(lq)} + 1u), one_head);"
    ]


def dims_of(graph: Graph, node, mode: str) -> Dims:
    """Problem sizes of attention node ``node`` lowered in ``mode`` (dkv: the key-gradient
    node)."""
    ins = node.inputs
    b, hq, lq, d = graph[ins[0]].type.shape
    _, hkv, lk, _ = graph[ins[1]].type.shape
    # Dv: of the output (fwd, dv), of ``out`` (stats) or of ``v`` (dq, dk, dkv); lse has none
    if mode == "lse":
        return Dims(b, hkv, hq // hkv, lq, lk, d, d)
    dv = (node.type if mode in ("fwd", "dv") else graph[ins[2]].type).shape[3]
    return Dims(b, hkv, hq // hkv, lq, lk, d, dv)
