"""Fast mode (f16 storage) against torch float64 for ResNets: the worst gradient cosine and
norm error per configuration, so the fast gate's margin is known beyond the CI-sized nets.

Usage: python bench/resnet_fast_gates.py [--configs resnet50,resnet18_w8] [--seeds 0,1,2]
Prints one line per (config, seed): forward error, loss error, and the three worst parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="resnet50,resnet18_w8,resnet18_w16")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--precision", default="fast", choices=["fast", "strict"])
    ap.add_argument("--size", type=int, default=0, help="image size (default 224, 64 if narrow)")
    args = ap.parse_args()
    import meganeura as mn
    from meganeura.models.resnet import ResNetConfig
    from tests.models import test_resnet as t

    configs = {
        "resnet50": ResNetConfig("bottleneck", (3, 4, 6, 3), num_classes=1000),
        "resnet18_w8": t.CONFIGS["resnet18_w8"],
        "resnet18_w16": ResNetConfig("basic", (2, 2, 2, 2), num_classes=10, width=16),
    }
    for name in args.configs.split(","):
        cfg = configs[name]
        size = args.size or (224 if cfg.width == 64 else 64)
        for seed in map(int, args.seeds.split(",")):
            theirs, ours = t.make_pair(cfg, seed=seed)
            x, y = t.batch(4, size, cfg.num_classes, seed=100 + seed)
            ours.train(), theirs.train()
            tr = mn.Trainer(ours, mn.optim.SGD(**t.SGD), t.loss_fn, precision=args.precision)
            loss, grads = tr.step(x, y, return_grads=True)
            want_loss, want, _ = t.torch_step(theirs, x, y)
            rows = []
            for k, w in want.items():
                g, w = np.asarray(grads[k], np.float64).ravel(), np.asarray(w).ravel()
                ng, nw = np.linalg.norm(g), np.linalg.norm(w)
                if ng < 1e-5 and nw < 1e-5:
                    continue
                rows.append((float(g @ w / (ng * nw)), abs(ng - nw) / nw, k))
            rows.sort()
            cmin, nmax = (0.99, 0.1) if args.precision == "fast" else (0.999, 0.01)
            fails = sum(c < cmin or n > nmax for c, n, _ in rows)
            worst = "; ".join(f"{k} cos {c:.4f} norm {n:.3f}" for c, n, k in rows[:3])
            loss_err = abs(loss - want_loss) / abs(want_loss)
            print(
                f"{name} seed {seed} {size}px: loss err {loss_err:.1e}; "
                f"{fails}/{len(rows)} parameters fail the {args.precision} gate; worst: {worst}",
                flush=True,
            )


if __name__ == "__main__":
    main()
