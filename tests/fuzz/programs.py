"""Random small programs for the fuzzer: what a program is, how hypothesis draws one, and how
one program is built twice, as a meganeura graph and as torch float64 code.

A ``Program`` is data: its inputs (shape and a NumPy seed; values are standard normal, rounded
to f32 before either side sees them) and a list of ``Step``s, each an entry of ``OPS``
applied to earlier values (by index: inputs first, then step results) with its keyword
arguments. The program's value is its last step's. ``OPS`` gives every entry twice, with the
same arguments: the meganeura function (``meganeura.nn.functional``) and the torch one, so one
table drives both sides and a printed Program is a complete reproduction.

Drawing runs the torch side eagerly, so each step is drawn knowing the shapes before it, and
a program whose values leave the range where f32 and float64 agree (``|v| > 1e4``, or a
non-finite value) is rejected (``assume``): finite inputs stay finite here, non-finite
semantics are tested elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as TF
from hypothesis import assume
from hypothesis import strategies as st

import meganeura.nn.functional as F

F32_EPS = float(np.finfo(np.float32).eps)
MAX_ABS = 1e4  # values beyond this are rejected: f32 rounding grows with them
DIMS = (1, 1, 2, 3, 4, 5)  # ones twice as likely: the bugs of issue 11 item 1 live there


@dataclass(frozen=True)
class Input:
    shape: tuple[int, ...]
    seed: int
    scale: float = 1.0

    def value(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return np.asarray(rng.standard_normal(self.shape) * self.scale, np.float32)


@dataclass(frozen=True)
class Step:
    op: str
    args: tuple[int | None, ...]  # value indices; None passes an absent optional tensor
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Program:
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    # Inputs that are not differentiated (attention masks).
    constant_inputs: tuple[int, ...] = ()

    def run(self, side: str, leaves: list):
        """Apply the steps to ``leaves`` (one value per input) with ``side`` ("mn" or
        "torch"); returns every value, inputs first."""
        vals = list(leaves)
        for s in self.steps:
            fn = OPS[s.op][0 if side == "mn" else 1]
            vals.append(fn(*(None if i is None else vals[i] for i in s.args), **s.kwargs))
        return vals


def _sq(x):
    return x * x


def _where_gt(lib):
    return lambda x, y: lib.where(x > y, x, y)


def _torch_group_norm(x, num_groups, w, b):
    # torch 2.13's group_norm backward fails ("tensor does not have a device") with a bias
    # and no weight; adding the bias outside is the same function.
    y = TF.group_norm(x, num_groups, w, None)
    return y if b is None else y + b.reshape((-1,) + (1,) * (x.ndim - 2))


# name -> (meganeura function, torch function); both take the same arguments.
OPS: dict[str, tuple] = {
    # elementwise unary
    "tanh": (F.tanh, torch.tanh),
    "sigmoid": (F.sigmoid, torch.sigmoid),
    "relu": (F.relu, torch.relu),
    "neg": (F.neg, torch.neg),
    "sin": (F.sin, torch.sin),
    "abs": (F.abs, torch.abs),
    "silu": (F.silu, TF.silu),
    "gelu": (F.gelu, TF.gelu),
    "softplus": (F.softplus, TF.softplus),
    "erf": (F.erf, torch.erf),
    "exp": (F.exp, torch.exp),
    "square": (_sq, _sq),
    "log1p_sq": (lambda x: F.log(x * x + 1.0), lambda x: torch.log(x * x + 1.0)),
    "rsqrt1": (lambda x: F.rsqrt(x * x + 0.5), lambda x: torch.rsqrt(x * x + 0.5)),
    "affine": (lambda x, a, c: x * a + c, lambda x, a, c: x * a + c),
    # elementwise binary (broadcasting)
    "add": (F.add, torch.add),
    "sub": (F.sub, torch.sub),
    "mul": (F.mul, torch.mul),
    "div1": (lambda x, y: x / (F.abs(y) + 1.0), lambda x, y: x / (torch.abs(y) + 1.0)),
    "maximum": (F.maximum, torch.maximum),
    "minimum": (F.minimum, torch.minimum),
    "where_gt": (_where_gt(F), _where_gt(torch)),
    # reductions
    "sum": (F.sum, torch.sum),
    "mean": (F.mean, torch.mean),
    "amax": (F.amax, torch.amax),
    "amin": (F.amin, torch.amin),
    "logsumexp": (F.logsumexp, torch.logsumexp),
    "var": (F.var, torch.var),
    "std": (F.std, torch.std),
    "max_dim": (
        lambda x, dim, keepdim: F.max(x, dim, keepdim)[0],
        lambda x, dim, keepdim: torch.max(x, dim, keepdim)[0],
    ),
    "softmax": (F.softmax, torch.softmax),
    "log_softmax": (F.log_softmax, torch.log_softmax),
    # views
    "reshape": (F.reshape, torch.reshape),
    "permute": (F.permute, torch.permute),
    "transpose": (F.transpose, torch.transpose),
    "slice": (
        lambda x, dim, start, end, step: F.slice(x, dim, start, end, step),
        lambda x, dim, start, end, step: x[(slice(None),) * dim + (slice(start, end, step),)],
    ),
    "expand": (F.broadcast_to, lambda x, shape: x.expand(shape)),
    "unsqueeze": (F.unsqueeze, torch.unsqueeze),
    "squeeze": (F.squeeze, torch.squeeze),
    # linear algebra
    "matmul": (F.matmul, torch.matmul),
    "linear": (F.linear, TF.linear),
    # norms
    "layer_norm": (
        lambda x, w, b, normalized_shape: F.layer_norm(x, normalized_shape, w, b),
        lambda x, w, b, normalized_shape: TF.layer_norm(x, normalized_shape, w, b),
    ),
    "rms_norm": (
        lambda x, w, normalized_shape: F.rms_norm(x, normalized_shape, w),
        # eps=None is the input dtype's epsilon: f32's, as meganeura's (not float64's)
        lambda x, w, normalized_shape: TF.rms_norm(x, normalized_shape, w, F32_EPS),
    ),
    "group_norm": (
        lambda x, w, b, num_groups: F.group_norm(x, num_groups, w, b),
        lambda x, w, b, num_groups: _torch_group_norm(x, num_groups, w, b),
    ),
    "batch_norm": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        lambda x, w, b: TF.batch_norm(x, None, None, w, b, training=True),
    ),
    # attention
    "sdpa": (F.scaled_dot_product_attention, TF.scaled_dot_product_attention),
    "sdpa_bool_mask": (
        lambda q, k, v, m, **kw: F.scaled_dot_product_attention(q, k, v, m > 0.0, **kw),
        lambda q, k, v, m, **kw: TF.scaled_dot_product_attention(q, k, v, m > 0.0, **kw),
    ),
}

UNARY = (
    "tanh sigmoid relu neg sin abs silu gelu softplus erf exp square log1p_sq rsqrt1 affine"
).split()
BINARY = "add sub mul div1 maximum minimum where_gt".split()
# Ties split the gradient (torch gives each operand half): these ops never get operands with
# equal elements. Random values never tie, but values equal by construction do (maximum(a,
# maximum(a, b)); attention over one key returns its value), and fast mode's f16 storage of
# one side breaks such a tie (tests/fuzz/test_found.py, "fast mode breaks ties").
DISTINCT_ARGS = {"maximum", "minimum", "where_gt"}


# ---- drawing ----------------------------------------------------------------------------------
class _Draft:
    """A program being drawn: inputs and steps in draw order, with the torch float64 value of
    each; ``program()`` renumbers them (inputs first)."""

    def __init__(self, draw):
        self.draw = draw
        self.inputs: list[Input] = []
        self.steps: list[Step] = []
        self.refs: list[tuple[str, int]] = []  # draft index -> ("in", k) or ("step", k)
        self.vals: list[torch.Tensor] = []
        self.constant: list[int] = []

    def new_input(self, shape, scale=1.0, constant=False) -> int:
        seed = self.draw(st.integers(0, 2**16))
        inp = Input(tuple(shape), seed, scale)
        if constant:
            self.constant.append(len(self.inputs))
        self.refs.append(("in", len(self.inputs)))
        self.inputs.append(inp)
        self.vals.append(torch.from_numpy(inp.value().astype(np.float64)))
        return len(self.vals) - 1

    def step(self, op: str, args, **kwargs) -> int:
        s = Step(op, tuple(args), kwargs)
        v = OPS[op][1](*(None if i is None else self.vals[i] for i in s.args), **kwargs)
        v = v.detach()
        assume(bool(torch.isfinite(v).all()) and float(v.abs().max()) <= MAX_ABS)
        self.refs.append(("step", len(self.steps)))
        self.steps.append(s)
        self.vals.append(v)
        return len(self.vals) - 1

    def pick(self) -> int:
        """A value index, shrinking towards the latest."""
        return len(self.vals) - 1 - self.draw(st.integers(0, len(self.vals) - 1))

    def program(self) -> Program:
        n = len(self.inputs)
        final = [k if kind == "in" else n + k for kind, k in self.refs]
        steps = tuple(
            Step(s.op, tuple(None if a is None else final[a] for a in s.args), s.kwargs)
            for s in self.steps
        )
        return Program(tuple(self.inputs), steps, tuple(self.constant))


def shapes(min_rank=1, max_rank=4):
    return st.lists(st.sampled_from(DIMS), min_size=min_rank, max_size=max_rank).map(tuple)


def _broadcast_partner(draw, shape) -> tuple[int, ...]:
    """A shape broadcastable with ``shape`` (dims kept or 1, leading dims dropped or added)."""
    drop = draw(st.integers(0, len(shape)))
    out = [d if draw(st.booleans()) else 1 for d in shape[drop:]]
    extra = draw(st.lists(st.sampled_from((1, 2)), max_size=max(0, 1 - len(shape) + 3)))
    return tuple(extra[:1]) + tuple(out) if drop == 0 else tuple(out)


def _dims(draw, ndim):
    """A reduction's ``dim``: None, an int (negative too) or a tuple."""
    kind = draw(st.sampled_from(("int", "neg", "tuple", "none")))
    if kind == "none" or ndim == 0:
        return None
    if kind == "int":
        return draw(st.integers(0, ndim - 1))
    if kind == "neg":
        return -draw(st.integers(1, ndim))
    return tuple(sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=1))))


def _reduced(shape, dim) -> int:
    if dim is None:
        return math.prod(shape)
    dims = (dim,) if isinstance(dim, int) else dim
    return math.prod(shape[d] for d in dims)


def _draw_step(d: _Draft, family: str) -> None:
    draw = d.draw
    i = d.pick()
    x = d.vals[i]
    shape = tuple(x.shape)
    nd = len(shape)
    if family == "unary":
        op = draw(st.sampled_from(UNARY))
        if op == "affine":
            d.step(
                op,
                [i],
                a=draw(st.sampled_from((0.5, -2.0, 3.0))),
                c=draw(st.sampled_from((0.0, 1.0))),
            )
        else:
            d.step(op, [i])
    elif family == "binary":
        op = draw(st.sampled_from(BINARY))
        j = d.pick()
        if j == i or not _broadcasts(shape, tuple(d.vals[j].shape)):
            j = d.new_input(_broadcast_partner(draw, shape))
        if op in DISTINCT_ARGS and bool((x == d.vals[j]).any()):
            return  # equal by construction (maximum(a, maximum(a, b))): see DISTINCT_ARGS
        args = [i, j] if draw(st.booleans()) else [j, i]
        d.step(op, args)
    elif family == "matmul" and nd:
        _draw_matmul(d, i, shape)
    elif family == "reduce" and nd:
        op = draw(
            st.sampled_from(("sum", "mean", "amax", "amin", "logsumexp", "var", "std", "max_dim"))
        )
        keepdim = draw(st.booleans())
        if op == "max_dim":
            d.step(op, [i], dim=draw(st.integers(-nd, nd - 1)), keepdim=keepdim)
            return
        dim = _dims(draw, nd)
        if op == "logsumexp" and dim is None:
            dim = tuple(range(nd))
        if op in ("var", "std"):
            n = _reduced(shape, dim)
            correction = draw(st.sampled_from((0, 1)))
            if n - correction < 1 or (op == "std" and n < 2):
                return
            if _spread(torch.var(x, dim, correction=0)):
                d.step(op, [i], dim=dim, correction=correction, keepdim=keepdim)
            return
        d.step(op, [i], dim=dim, keepdim=keepdim)
    elif family == "softmax" and nd:
        d.step(
            draw(st.sampled_from(("softmax", "log_softmax"))),
            [i],
            dim=draw(st.integers(-nd, nd - 1)),
        )
    elif family == "view" and nd:
        _draw_view(d, i, shape)
    elif family == "norm" and nd:
        _draw_norm(d, i, shape)


def _broadcasts(a, b) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _draw_view(d: _Draft, i: int, shape) -> None:
    draw = d.draw
    nd = len(shape)
    kind = draw(
        st.sampled_from(
            ("reshape", "permute", "transpose", "slice", "expand", "unsqueeze", "squeeze")
        )
    )
    if kind == "reshape":
        n = math.prod(shape)
        options = [(n,), (1, n), (n, 1)]
        if nd >= 2:
            options.append(shape[:-2] + (shape[-2] * shape[-1],))
            options.append((shape[0] * shape[1],) + shape[2:])
        options += [(f, n // f) for f in (2, 3, 4) if n % f == 0 and n > f]
        d.step("reshape", [i], shape=draw(st.sampled_from(options)))
    elif kind == "permute":
        d.step("permute", [i], dims=tuple(draw(st.permutations(range(nd)))))
    elif kind == "transpose" and nd >= 2:
        d0, d1 = draw(st.lists(st.integers(0, nd - 1), min_size=2, max_size=2, unique=True))
        d.step("transpose", [i], dim0=d0, dim1=d1)
    elif kind == "slice":
        dim = draw(st.integers(0, nd - 1))
        n = shape[dim]
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        d.step("slice", [i], dim=dim, start=start, end=end, step=draw(st.sampled_from((1, 2))))
    elif kind == "expand":
        new = tuple(draw(st.sampled_from((2, 3))) if s == 1 else s for s in shape)
        lead = (2,) if draw(st.booleans()) and nd < 4 else ()
        d.step("expand", [i], shape=lead + new)
    elif kind == "unsqueeze" and nd < 4:
        d.step("unsqueeze", [i], dim=draw(st.integers(-nd - 1, nd)))
    elif kind == "squeeze" and 1 in shape:
        d.step(
            "squeeze", [i], dim=draw(st.sampled_from([k for k, s in enumerate(shape) if s == 1]))
        )


MIN_SPREAD = 0.05


def _spread(var: torch.Tensor) -> bool:
    """Whether every group's variance ``var`` allows normalizing it (std, var, the norms):
    ``(x - mean) / std`` amplifies round-off in ``x`` by ``1 / std`` (and a std of 0 has a NaN
    gradient in torch too), so over nearly equal values f32 and float64 differ by
    conditioning, not by a bug; such steps are left out."""
    return var.numel() > 0 and float(var.min()) >= MIN_SPREAD**2


def _draw_norm(d: _Draft, i: int, shape) -> None:
    """A norm of ``x`` with an optional weight and bias drawn as new inputs (None: absent)."""
    draw = d.draw
    x = d.vals[i]
    nd = len(shape)
    kind = draw(st.sampled_from(("layer_norm", "rms_norm", "group_norm", "batch_norm")))
    kw = {}
    if kind in ("layer_norm", "rms_norm"):
        k = draw(st.integers(1, min(nd, 2)))
        kw["normalized_shape"] = pshape = shape[nd - k :]
    elif kind == "group_norm" and nd >= 2:
        c = shape[1]
        kw["num_groups"] = g = draw(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]))
        pshape = (c,)
        if shape[0] * (c // g) * math.prod(shape[2:]) < 2:
            return  # torch refuses a single value per group ("more than 1 value per channel")
    elif kind == "batch_norm" and nd >= 2 and math.prod(shape) // shape[1] > 1:
        pshape = (shape[1],)
    else:
        return
    w = d.new_input(pshape, 0.5) if draw(st.booleans()) else None
    b = d.new_input(pshape, 0.5) if kind != "rms_norm" and draw(st.booleans()) else None
    if kind in ("layer_norm", "rms_norm"):
        dims = tuple(range(nd - len(pshape), nd))
        spread = (x * x).mean(dims) if kind == "rms_norm" else x.var(dims, correction=0)
    elif kind == "group_norm":
        spread = x.reshape(shape[0], kw["num_groups"], -1).var(-1, correction=0)
    else:
        spread = x.transpose(0, 1).reshape(shape[1], -1).var(-1, correction=0)
    if _spread(spread):
        d.step(kind, [i, w] if kind == "rms_norm" else [i, w, b], **kw)


def _draw_matmul(d: _Draft, i: int, shape) -> None:
    """``x @ w`` (w a new input: vector, matrix or a batch broadcasting against x's) or
    ``linear(x, weight, bias)``."""
    draw = d.draw
    k = shape[-1]
    n = draw(st.sampled_from((1, 2, 3, 5)))
    if draw(st.booleans()) and len(shape) >= 1:
        w = d.new_input((n, k), 0.5)
        b = d.new_input((n,), 0.5) if draw(st.booleans()) else None
        d.step("linear", [i, w, b])
        return
    if len(shape) == 1 or draw(st.booleans()):
        wshape = (k,) if draw(st.booleans()) else (k, n)
    else:
        batch = _broadcast_partner(draw, shape[:-2]) if len(shape) > 2 else ()
        wshape = tuple(batch) + (k, n)
    d.step("matmul", [i, d.new_input(wshape, 0.5)])


def _draw_attention(d: _Draft) -> None:
    """scaled_dot_product_attention on new inputs: grouped-query heads, cross attention,
    causal, an additive or a bool mask (never both with causal: torch refuses that)."""
    draw = d.draw
    b, hkv, group = (
        draw(st.sampled_from((1, 2))),
        draw(st.sampled_from((1, 2))),
        draw(st.sampled_from((1, 2, 3))),
    )
    lq, lk = draw(st.sampled_from((1, 2, 3, 5))), draw(st.sampled_from((1, 2, 3, 5)))
    dk, dv = draw(st.sampled_from((1, 2, 4, 8))), draw(st.sampled_from((1, 3, 4)))
    q = d.new_input((b, hkv * group, lq, dk))
    k = d.new_input((b, hkv, lk, dk))
    v = d.new_input((b, hkv, lk, dv))
    kw = {}
    if group > 1:
        kw["enable_gqa"] = True
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from((0.25, 1.0)))
    mask = draw(st.sampled_from(("none", "causal", "float", "bool")))
    if mask == "causal":
        d.step("sdpa", [q, k, v], is_causal=True, **kw)
    elif mask == "none":
        d.step("sdpa", [q, k, v], **kw)
    else:
        mshape = draw(
            st.sampled_from(((lq, lk), (1, lk), (b, 1, lq, lk), (b, hkv * group, lq, lk)))
        )
        m = d.new_input(mshape, constant=True)
        d.step("sdpa" if mask == "float" else "sdpa_bool_mask", [q, k, v, m], **kw)


FAMILIES = ("unary", "binary", "reduce", "softmax", "view", "norm", "matmul")


@st.composite
def programs(draw, families=FAMILIES, max_steps=5, attention=False) -> Program:
    """A random Program: one input of a drawn shape (or an attention call on new inputs),
    then up to ``max_steps`` steps of the given families."""
    d = _Draft(draw)
    if attention:
        _draw_attention(d)
    else:
        d.new_input(draw(shapes()))
    for _ in range(draw(st.integers(1, max_steps))):
        _draw_step(d, draw(st.sampled_from(families)))
    assume(d.steps)
    return d.program()
