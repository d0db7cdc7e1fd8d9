"""Benchmark: memory-bound kernels as achieved TB/s, meganeura vs PyTorch, and each as a
fraction of our own copy bandwidth (the fast-kernels issue's target: >= 75% of copy).

Cases (f32; bytes = what an ideal kernel reads + writes once):
  copy         y = x * 1.0 (checked to compile to one dispatch; else y = x * s, s a scalar
               parameter)  vs torch y.copy_(x)                          8 B / element
  add          y = a + b                                              12 B / element
  softmax      rows of 1500 (Whisper scores) and 49152 (SmolLM2 logits)  8 B / element
  layer_norm   rows of 384 (Whisper), weight and bias                  8 B / element
  rms_norm     rows of 576 (SmolLM2), weight, eps 1e-5                 8 B / element
  group_norm   x [N, C, H, W], G groups, weight and bias: U-Net [4, 128, 64, 64] G32, ResNet
               [32, 256, 14, 14] G32 and a chunked one (groups of 2^17 elements, more than
               the teams hold in registers) [2, 256, 64, 64] G8        8 B / element
  group_norm_fb  the same forward plus the backward ops autodiff emits (dx, dweight, dbias)
               for an upstream gradient g, vs torch forward + autograd.grad; bytes of an
               ideal pair of kernels: x read, y written; x, g read, dx written  20 B / element
  embedding    SmolLM2 table [49152, 576], 65536 i32 ids        8 B / output element + ids
  adam         Adam update of one big parameter (p, g, m, v read; p, m, v written)
               vs torch.optim.Adam(fused=True)                        28 B / element
  sum_all      sum of one f32 vector of n elements                      4 B / element
  bias_relu    relu(x + bias), x [n / 1024, 1024]: a fused chain (vec4 path) 8 B / element
Ours: operands are parameters (uploaded once); GPU time from ``Session.profile``. Torch: CUDA
events around the op. Every case also checks our output against PyTorch's (``rel_err``).

Variants (--variants a,b or all) re-run add, bias_relu, sum_all and the row cases with codegen
switches flipped, suffixing the case name with @variant, to compare them with the default:
  scalar          no vec4 path (vector.ENABLED, reduce.VEC4 = False): scalar loads
  vpt1/vpt2/vpt8  vec4s per thread (vector.VEC_PER_THREAD; default 4)
  tree            team reductions through workgroup memory, no subgroups (rowwise.USE_SUBGROUPS)
  units2/units8   units per thread the team size aims at (rowwise.TARGET_UNITS; default 4)
  general         the general row kernels instead of the team kernels (rowwise.MAX_UNITS = 0,
                  CHUNKED = False)
  chunked         norms walk their rows in chunks whenever a thread would hold more than one
                  unit (rowwise.MAX_UNITS = 1); softmax then takes the general kernels
  nosplit         group_norm with one team per group, never split across workgroups
                  (norm.split.FORCE_CHUNKS = 1: the kernels before the split)
  split           group_norm split where its plan would (norm.split.SPLIT = True; off by
                  default since the H200 timed it slower)

Usage: python bench/bandwidth.py [--quick] [--repeats 10] [--out-name bandwidth] [--variants all]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    add_args,
    profile_ms,
    rel_err,
    resolve_args,
    result,
    start,
    time_torch,
    to_numpy,
)


def _data(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


VARIANTS = {
    "scalar": [("elementwise.vector", "ENABLED", False), ("reduce.reductions", "VEC4", False)],
    "vpt1": [("elementwise.vector", "VEC_PER_THREAD", 1)],
    "vpt2": [("elementwise.vector", "VEC_PER_THREAD", 2)],
    "vpt8": [("elementwise.vector", "VEC_PER_THREAD", 8)],
    "tree": [("rowwise.team", "USE_SUBGROUPS", False)],
    "units2": [("rowwise.team", "TARGET_UNITS", 2)],
    "units8": [("rowwise.team", "TARGET_UNITS", 8)],
    "general": [("rowwise.team", "MAX_UNITS", 0), ("rowwise.team", "CHUNKED", False)],
    "chunked": [("rowwise.team", "MAX_UNITS", 1)],
    "nosplit": [("norm.split", "FORCE_CHUNKS", 1)],
    "split": [("norm.split", "SPLIT", True)],
}


def set_variant(name: str | None) -> None:
    """Set the codegen switches of variant ``name`` (None: restore the defaults)."""
    import importlib

    for var in VARIANTS.values():
        for mod, attr, _ in var:
            m = importlib.import_module(f"meganeura.codegen.wgsl.{mod}")
            defaults = m.__dict__.setdefault("_bench_defaults", {})
            defaults.setdefault(attr, getattr(m, attr))
            setattr(m, attr, defaults[attr])
    for mod, attr, value in VARIANTS.get(name, []) if name else []:
        m = importlib.import_module(f"meganeura.codegen.wgsl.{mod}")
        setattr(m, attr, value)


def copy_graph(n: int, device):
    """y = x * 1.0, or y = x * s (s a parameter fed 1.0) should the compiler fold ``* 1.0``."""
    import meganeura as mn
    from meganeura.training import compile_for

    g = mn.GraphBuilder()
    x = g.parameter("x", (n,))
    g.output("y", x * 1.0)
    try:
        program, sess = compile_for(g.build(), device=device)
        if len(program.dispatches) == 1:
            return program, sess, "x * 1.0", {}
        sess.close()
    except ValueError:  # an output that became a view of a parameter, say
        pass
    g = mn.GraphBuilder()
    x = g.parameter("x", (n,))
    s = g.parameter("s", ())
    g.output("y", x * s)
    program, sess = compile_for(g.build(), device=device)
    return program, sess, "x * s (s = 1.0 parameter)", {"s": np.ones((), np.float32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "bandwidth")
    ap.add_argument("--variants", default="", help="comma list of VARIANTS, or 'all'")
    args = ap.parse_args()
    variants = (
        list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    )
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    resolve_args(args)
    import meganeura as mn
    import meganeura.nn.functional as F
    from meganeura.optim import Adam, apply_optimizer
    from meganeura.training import compile_for

    device, torch, dev, rec = start(args)
    tF = torch.nn.functional

    n = 1 << 16 if args.quick else 1 << 26  # 256 KiB / 256 MiB per f32 tensor
    n_big = 1 << 18 if args.quick else 1 << 28  # 1 MiB / 1 GiB
    vocab, emb, tokens = (1024, 64, 512) if args.quick else (49152, 576, 65536)
    copy_rate: dict[str, float] = {}

    def case(name, build, params, feeds, torch_fn, nbytes, ref_out=None, check=True, **info):
        """Compile ``build()`` (a GraphBuilder with output "y" or effects), time both sides."""
        t = time.perf_counter()
        built = build()
        if isinstance(built, tuple):
            program, sess = built
        else:
            program, sess = compile_for(built, device=device)
        compile_s = time.perf_counter() - t
        try:
            sess.load_state_dict(params, strict=False)
            err = None
            if check and "y" in program.outputs:
                ours_y = sess.run(feeds, fetch=("y",))["y"]
                err = rel_err(ours_y, to_numpy(torch_fn()))
            ours = profile_ms(sess, feeds, args.warmup, args.repeats)["all"]
            if check and ref_out is not None:  # effects: compare after the same steps
                err = ref_out(sess)
            theirs = time_torch(torch_fn, dev, args.warmup, args.repeats)
        finally:
            sess.close()
        o_rate = nbytes / ours["median"] / 1e9  # bytes/ms -> TB/s
        t_rate = nbytes / theirs["median"] / 1e9
        if name.startswith("copy"):
            copy_rate[name] = o_rate
            copy_rate["torch_" + name] = t_rate
        base, tbase = copy_rate.get("copy"), copy_rate.get("torch_copy")
        frac = f"{o_rate / base:6.1%}" if base else "   -  "
        nan = float("nan")
        line = (
            f"{name:<34} ours {o_rate:7.3f} TB/s ({frac} of copy)  torch {t_rate:7.3f} TB/s  "
            f"ours {ours['median'] * 1e3:9.1f} us  err {nan if err is None else err:.1e}"
        )
        rec.add(
            result(
                name,
                "TB/s",
                o_rate,
                t_rate,
                bytes=int(nbytes),
                ours_ms=ours["median"],
                torch_ms=theirs["median"],
                ours_min_ms=ours["min"],
                torch_min_ms=theirs["min"],
                frac_of_our_copy=o_rate / base if base else None,
                torch_frac_of_torch_copy=t_rate / tbase if tbase else None,
                rel_err=err,
                dispatches=[d.name for d in program.dispatches],
                compile_s=round(compile_s, 3),
                **info,
            ),
            line,
        )
        if err is not None and err > 1e-4:
            print(f"  WARNING {name}: rel_err {err:.2e} against PyTorch")

    # ---- copy (the reference every other case is a fraction of) --------------------------
    for name, size in (("copy", n), ("copy_big", n_big)):
        # 1 GiB of normals takes seconds to draw; the big copy is not checked, any bytes do.
        x = _data((size,), 1) if size <= n else np.full((size,), 0.5, np.float32)
        program, sess, how, extra_params = copy_graph(size, device)
        tx = torch.from_numpy(x).to(dev)
        ty = torch.empty_like(tx)
        case(
            name,
            lambda program=program, sess=sess: (program, sess),
            {"x": x, **extra_params},
            {},
            lambda tx=tx, ty=ty: ty.copy_(tx),
            8 * size,
            check=size <= n,
            op=how,
            elements=size,
        )
        del tx, ty, x

    # ---- add --------------------------------------------------------------------------
    def add_case(suffix=""):
        a, b = _data((n,), 2), _data((n,), 3)
        ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
        ty = torch.empty_like(ta)

        def add_graph():
            g = mn.GraphBuilder()
            g.output("y", g.parameter("a", (n,)) + g.parameter("b", (n,)))
            return g.build()

        case(
            "add" + suffix,
            add_graph,
            {"a": a, "b": b},
            {},
            lambda: torch.add(ta, tb, out=ty),
            12 * n,
            elements=n,
        )

    # ---- a fused chain: relu(x + bias) --------------------------------------------------
    def bias_relu_case(suffix=""):
        width = 1024
        rows = max(1, n // width)
        x, bias = _data((rows, width), 11), _data((width,), 12)
        tx, tb = torch.from_numpy(x).to(dev), torch.from_numpy(bias).to(dev)

        def build():
            g = mn.GraphBuilder()
            xs = g.parameter("x", (rows, width))
            g.output("y", F.relu(xs + g.parameter("b", (width,))))
            return g.build()

        case(
            "bias_relu" + suffix,
            build,
            {"x": x, "b": bias},
            {},
            lambda: torch.relu(tx + tb),
            8 * rows * width,
            shape=[rows, width],
        )

    add_case()
    bias_relu_case()

    # ---- row-wise kernels ---------------------------------------------------------------
    def rows_case(name, width, op, torch_op, affine):
        rows = max(2, n // width)
        x = _data((rows, width), 4)
        params = {"x": x}
        w = (1.0 + 0.1 * _data((width,), 5)) if affine else None
        bias = 0.1 * _data((width,), 6) if affine == "wb" else None
        if w is not None:
            params["w"] = w
        if bias is not None:
            params["b"] = bias

        def build():
            g = mn.GraphBuilder()
            xs = g.parameter("x", (rows, width))
            extra = [g.parameter(k, (width,)) for k in ("w", "b") if k in params]
            g.output("y", op(xs, *extra))
            return g.build()

        tx = torch.from_numpy(x).to(dev)
        textra = [torch.from_numpy(params[k]).to(dev) for k in ("w", "b") if k in params]
        case(
            name,
            build,
            params,
            {},
            lambda: torch_op(tx, *textra),
            8 * rows * width,
            shape=[rows, width],
        )

    def group_norm_case(name, shape, groups, backward):
        c = shape[1]
        x, up = _data(shape, 14), _data(shape, 15)
        w, bias = 1.0 + 0.1 * _data((c,), 16), 0.1 * _data((c,), 17)
        params = {"x": x, "w": w, "b": bias, **({"up": up} if backward else {})}
        numel = int(np.prod(shape))

        def build():
            g = mn.GraphBuilder()
            xs = g.parameter("x", shape)
            ws, bs = g.parameter("w", (c,)), g.parameter("b", (c,))
            y = F.group_norm(xs, groups, ws, bs, eps=1e-5)
            if not backward:
                g.output("y", y)
                return g.build()
            # The backward ops autodiff emits for group_norm (ops/norm.py's gradient rule).
            gy = g.parameter("up", shape)
            attrs = {"num_groups": groups, "eps": 1e-5}
            g.output("fwd", y)
            g.output("y", g.add("group_norm_backward", [xs, ws, gy], attrs))
            g.output("dw", g.add("group_norm_weight_backward", [xs, gy], attrs))
            g.output("db", F.sum(gy, (0, *range(2, len(shape)))))
            return g.build()

        tx, tup = torch.from_numpy(x).to(dev), torch.from_numpy(up).to(dev)
        tw, tb = torch.from_numpy(w).to(dev), torch.from_numpy(bias).to(dev)

        def torch_fn():
            if not backward:
                return tF.group_norm(tx, groups, tw, tb, eps=1e-5)
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(True) for t in (tx, tw, tb)]
                y = tF.group_norm(leaves[0], groups, leaves[1], leaves[2], eps=1e-5)
                return torch.autograd.grad(y, leaves, tup)[0]

        def check_all(sess) -> float:
            # Every output against torch: y (or dx), and with the backward dweight and dbias.
            if not backward:
                return rel_err(sess.run({}, fetch=("y",))["y"], to_numpy(torch_fn()))
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(True) for t in (tx, tw, tb)]
                y = tF.group_norm(leaves[0], groups, leaves[1], leaves[2], eps=1e-5)
                want = dict(zip(("y", "dw", "db"), torch.autograd.grad(y, leaves, tup)))
            got = sess.run({}, fetch=tuple(want))
            return max(rel_err(got[k], to_numpy(want[k])) for k in want)

        case(name, build, params, {}, torch_fn, (20 if backward else 8) * numel,
             ref_out=check_all, shape=list(shape), groups=groups)  # fmt: skip

    def group_norm_cases(suffix=""):
        if args.quick:
            shapes = (("unet", (1, 32, 32, 32), 8), ("resnet", (2, 64, 7, 7), 32),
                      ("chunked", (1, 80, 30, 30), 1))  # fmt: skip
        else:
            shapes = (("unet", (4, 128, 64, 64), 32), ("resnet", (32, 256, 14, 14), 32),
                      ("chunked", (2, 256, 64, 64), 8))  # fmt: skip
        for label, shape, groups in shapes:
            for backward in (False, True):
                kind = "group_norm_fb" if backward else "group_norm"
                group_norm_case(f"{kind}_{label}{suffix}", shape, groups, backward)

    def all_rows_cases(suffix=""):
        x_sum = _data((n,), 13)
        tx_sum = torch.from_numpy(x_sum).to(dev)

        def sum_graph():
            g = mn.GraphBuilder()
            g.output("y", F.sum(g.parameter("x", (n,))))
            return g.build()

        case("sum_all" + suffix, sum_graph, {"x": x_sum}, {}, lambda: tx_sum.sum(), 4 * n)
        rows_case(
            "softmax_rows1500" + suffix,
            1500,
            lambda x: F.softmax(x, -1),
            lambda x: torch.softmax(x, -1),
            None,
        )
        rows_case(
            "softmax_rows49152" + suffix,
            49152,
            lambda x: F.softmax(x, -1),
            lambda x: torch.softmax(x, -1),
            None,
        )
        rows_case(
            "layer_norm_rows384" + suffix,
            384,
            lambda x, w, b: F.layer_norm(x, 384, w, b, eps=1e-5),
            lambda x, w, b: tF.layer_norm(x, (384,), w, b, eps=1e-5),
            "wb",
        )
        rows_case(
            "rms_norm_rows576" + suffix,
            576,
            lambda x, w: F.rms_norm(x, 576, w, eps=1e-5),
            lambda x, w: tF.rms_norm(x, (576,), w, eps=1e-5),
            "w",
        )
        group_norm_cases(suffix)

    all_rows_cases()

    # ---- embedding gather ---------------------------------------------------------------
    def embedding_case():
        table = _data((vocab, emb), 7)
        ids = np.random.default_rng(8).integers(0, vocab, tokens).astype(np.int32)
        t_table = torch.from_numpy(table).to(dev)
        t_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)

        def emb_graph():
            g = mn.GraphBuilder()
            ids_in = g.input("ids", (tokens,), mn.i32)
            g.output("y", F.embedding(ids_in, g.parameter("w", table.shape)))
            return g.build()

        case(
            "embedding_gather",
            emb_graph,
            {"w": table},
            {"ids": ids},
            lambda: tF.embedding(t_ids, t_table),
            8 * tokens * emb + 4 * tokens,
            table=[vocab, emb],
            tokens=tokens,
        )

    embedding_case()

    # ---- Adam update --------------------------------------------------------------------
    p0, g0 = _data((n,), 9), 0.01 * _data((n,), 10)
    opt_cfg = Adam(lr=1e-3)
    hyper = {"optim.hyper": opt_cfg.hyper(0, opt_cfg.lr)}

    def adam_graph():
        g = mn.GraphBuilder()
        p = g.parameter("p", (n,))
        gr = g.parameter("grad", (n,))
        return apply_optimizer(g.build_unverified(), {p.id: gr.id}, opt_cfg)

    tp = torch.from_numpy(p0).to(dev).requires_grad_(True)
    tp.grad = torch.from_numpy(g0).to(dev)
    try:
        topt = torch.optim.Adam([tp], lr=1e-3, fused=True)
        fused = True
    except (RuntimeError, TypeError, ValueError):
        topt = torch.optim.Adam([tp], lr=1e-3, foreach=False)
        fused = False
    steps = args.warmup + args.repeats  # profile's warm-up and profiled steps

    def adam_check(sess) -> float:
        # Same number of steps with the same (step-0) hyper vector on a fresh torch copy.
        ref = torch.from_numpy(p0).to(dev).requires_grad_(True)
        ref.grad = torch.from_numpy(g0).to(dev)
        m = torch.zeros_like(ref)
        v = torch.zeros_like(ref)
        with torch.no_grad():
            lr, step_size, bc2 = (float(h) for h in hyper["optim.hyper"])
            for _ in range(steps):
                m.mul_(0.9).add_(ref.grad, alpha=0.1)
                v.mul_(0.999).addcmul_(ref.grad, ref.grad, value=0.001)
                ref.sub_(step_size * m / (v.sqrt() / bc2 + 1e-8))
        return rel_err(sess.read("p"), to_numpy(ref))

    with torch.no_grad():
        case(
            "adam_update",
            adam_graph,
            {"p": p0, "grad": g0},
            hyper,
            topt.step,
            28 * n,
            ref_out=adam_check,
            elements=n,
            torch_fused=fused,
        )

    # ---- codegen variants of the vec4 maps and the team row kernels -----------------------
    for v in variants:
        set_variant(v)
        try:
            add_case("@" + v)
            bias_relu_case("@" + v)
            all_rows_cases("@" + v)
        finally:
            set_variant(None)
    rec.finish()


if __name__ == "__main__":
    main()
