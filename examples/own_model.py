"""Bring your own model: a PyTorch model factory written here, searched over the digits data.

A space names a user model as ``model: {factory: "module:function", kwargs: {...}}``; dptune calls
``function(num_classes, input_shape, groups, **kwargs)`` (``groups`` is searched like any hyperparameter)
and checks the model before anything is charged (no BatchNorm, no in-place ops, one per-example-gradient
step). The module must be importable where the search starts: running this file puts its folder on
``sys.path``, so it imports as ``own_model``, and the search ships it to every Ray worker. The space is a
plain Python dict with the keys of a YAML space file.

    python examples/own_model.py               # the real thing (ledger: runs/ledger.sqlite)
    python examples/own_model.py --smoke-test  # 1 epoch, a fixed draw, temp dirs: NOT PRIVATE
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

import dptune


def make_model(num_classes: int, input_shape: tuple[int, int, int], groups: int,
               width: int = 16) -> nn.Module:
    """Two conv layers with GroupNorm (per-example: no batch statistics) and Tanh; no in-place ops."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(groups, width), nn.Tanh(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.GroupNorm(groups, 2 * width), nn.Tanh(),
        nn.Flatten(), nn.Linear(2 * width * ((h + 1) // 2) * ((w + 1) // 2), num_classes))


SPACE: dict[str, Any] = {
    "name": "digits_own_model",
    "dataset": {"name": "digits", "validation_size": 180, "test_size": 360, "split_seed": 0},
    "model": {"factory": "own_model:make_model", "kwargs": {"width": 16}},
    "fixed": {"epochs": 15, "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.9, "batch_size": 256},
    "space": {"learning_rate": {"type": "float", "low": 0.5, "high": 1.2, "log": True},
              "groups": {"type": "categorical", "choices": [4, 8]},  # must divide the widths 16 and 32
              "noise_multiplier": {"type": "float", "low": 5.0, "high": 7.5}},
    "default": {"learning_rate": 0.6, "groups": 8, "noise_multiplier": 5.0},  # released when K = 0
    "privacy": {"delta": 1e-5, "stopping": "poisson", "mean": 2, "score_noise": 9.0},
}
TARGET_EPSILON = 8.0  # search + final training, composed
SMOKE_SEED = 2  # NOT PRIVATE, smoke test only: a fixed draw (one trial under Poisson(2))


def main(smoke_test: bool, work: Path) -> None:
    space = {**SPACE, "fixed": {**SPACE["fixed"], "epochs": 1}} if smoke_test else SPACE
    print(f"plan: the search costs epsilon {dptune.plan(space).search_epsilon:.3f}")
    found = dptune.search(space, budget_epsilon=30, ledger=work / "ledger.sqlite", runs_dir=work,
                          num_cpus=2 if smoke_test else None, seed=SMOKE_SEED if smoke_test else None)
    print(f"released config: { {k: found.config[k] for k in SPACE['space']} }")
    print(f"released score: {found.score} (noised validation accuracy)")
    model = dptune.train(found, target_epsilon=TARGET_EPSILON, train_on_validation=True,
                         seed=1 if smoke_test else None)
    print(f"test accuracy: {model.metrics['test_accuracy']:.4f}")
    print(f"total epsilon: {model.epsilon:.4f} (target {TARGET_EPSILON:g}); model: {model.model}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke-test", action="store_true", help="tiny and fast, NOT PRIVATE, temp dirs")
    if parser.parse_args().smoke_test:
        with tempfile.TemporaryDirectory(prefix="dptune-example-") as tmp:
            main(True, Path(tmp))
    else:
        main(False, Path("runs"))
