"""A NumPy interpreter over the IR: the oracle that GPU results are tested against.

``interpret`` evaluates every node with its op's NumPy reference. Ops with effects
(optimizer updates) write their new values into the ``parameters``/``state`` dicts passed in
(copies are made first, so the caller's arrays are never mutated); an update of a
``row_block`` of a leaf writes those rows of the leaf; ``index_copy_`` writes the state leaf it
updates (through earlier writes of it) and its value is the updated array. With ``float64=True``
floating values are computed in float64, for gradient checks.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .ir import ALIAS_OPS, Graph, resolve_view


def interpret(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    parameters: Mapping[str, np.ndarray] | None = None,
    state: Mapping[str, np.ndarray] | None = None,
    float64: bool = False,
) -> tuple[list[np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Evaluate ``graph``.

    Args:
        inputs: values of ``input`` leaves by name.
        parameters: values of ``parameter`` leaves by name.
        state: values of ``state`` leaves by name (missing ones start at zero).
        float64: compute floating values in float64.

    Returns:
        (values per node id, updated parameters, updated state).

    Raises:
        KeyError: when a leaf has no value.
    """
    from ..ops import OPS

    params = {k: np.array(v, copy=True) for k, v in (parameters or {}).items()}
    st = {k: np.array(v, copy=True) for k, v in (state or {}).items()}
    vals: list[np.ndarray] = []
    for n in graph.nodes:
        dt = n.type.dtype.numpy
        if float64 and n.type.dtype.is_floating:
            dt = np.dtype(np.float64)
        if n.op == "input":
            v = np.asarray(inputs[n.name])
        elif n.op == "parameter":
            v = params[n.name]
        elif n.op == "state":
            if n.name not in st:
                st[n.name] = np.zeros(n.type.shape, n.type.dtype.numpy)
            v = st[n.name]
        elif n.op == "constant":
            v = np.asarray(n.attr("value"))
        else:
            d = OPS[n.op]
            args = [vals[i] for i in n.inputs]
            if d.writes:
                new = d.reference(args, n.attr_dict)
                for pos, value in zip(d.writes, new):
                    leaf, rows = graph.nodes[resolve_view(graph, n.inputs[pos])], None
                    if leaf.op == "row_block":  # an update of rows of a leaf (split_bindings)
                        start = leaf.attr("start")
                        rows = slice(start, start + leaf.attr("length"))
                        leaf = graph.nodes[leaf.inputs[0]]
                    target = params if leaf.op == "parameter" else st
                    value = np.asarray(value, leaf.type.dtype.numpy)
                    if rows is not None:
                        block, value = value, np.array(target[leaf.name], copy=True)
                        value[rows] = block
                    target[leaf.name] = value
                # an in-place write returning its storage (index_copy_) has its new value
                v = new[0] if n.op in ALIAS_OPS else np.zeros((), np.uint32)
            elif (
                float64
                and n.op == "cast"
                and n.type.dtype.is_floating
                and args[0].dtype.kind == "f"
            ):
                v = args[0]  # float64 mode keeps full precision through float->float casts
            else:
                v = d.reference(args, n.attr_dict)
        vals.append(np.asarray(v).astype(dt, copy=False).reshape(n.type.shape))
    return vals, params, st
