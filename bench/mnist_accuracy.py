"""Accuracy check of the main job: meganeura vs PyTorch trained with the same recipe, the same
initial weights and the same batch order (AdamW lr 1e-3, weight decay 0.01, batch 64,
10 epochs, standardized pixels), over several seeds.

Usage: python bench/mnist_accuracy.py [--seeds 0 1 2] [--epochs 10]
Writes bench/results/mnist_accuracy.json (metric "accuracy"; speedup = ours / torch).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write  # noqa: E402
from meganeura.data.mnist import iterate_batches, load_mnist, standardize  # noqa: E402
from meganeura.recipes.mnist import MnistConfig, init_model, train  # noqa: E402
from meganeura.runtime import get_device  # noqa: E402


def torch_accuracy(cfg: MnistConfig) -> float:
    """The recipe in PyTorch: same initial weights (the recipe's init_model), same batch order."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    data = load_mnist(cfg.data, seed=cfg.seed)
    x_train, mean, std = standardize(data.x_train)
    x_test, _, _ = standardize(data.x_test, mean, std)
    init = init_model(cfg).state_dict()
    model = torch.nn.Sequential(
        torch.nn.Linear(784, cfg.hidden), torch.nn.ReLU(), torch.nn.Linear(cfg.hidden, 10)
    ).to(dev)
    with torch.no_grad():
        for name, p in zip(
            ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], model.parameters()
        ):
            p.copy_(torch.from_numpy(init[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed + 1)  # the recipe's data-order generator
    xt = torch.from_numpy(x_train).to(dev)
    yt = torch.from_numpy(data.y_train).long().to(dev)
    for _ in range(cfg.epochs):
        for idx in iterate_batches(len(x_train), cfg.batch_size, rng):
            i = torch.from_numpy(idx).to(dev)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[i]), yt[i]).backward()
            opt.step()
    with torch.no_grad():
        pred = model(torch.from_numpy(x_test).to(dev)).argmax(1).cpu().numpy()
    return float((pred == data.y_test).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out-name", default="mnist_accuracy")
    ap.add_argument("--adapter", default=os.environ.get("MEGANEURA_ADAPTER"))
    args = ap.parse_args()
    device = get_device(args.adapter)
    results = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = MnistConfig(epochs=args.epochs, seed=seed, out=tmp)
            ours = train(cfg, device=device, progress=False)["test_accuracy"]
        theirs = torch_accuracy(cfg)
        results.append(
            {
                "case": f"mnist_mlp_seed{seed}",
                "metric": "accuracy",
                "ours": ours,
                "torch": theirs,
                "speedup": ours / theirs,
            }
        )
        print(f"seed {seed}: meganeura {100 * ours:.2f}%   torch {100 * theirs:.2f}%")
    print(f"wrote {write(args.out_name, device, results)}")


if __name__ == "__main__":
    main()
