"""What every mode shares: the space file, the baseline and the oracle grid, one row's data, the final run.

Everything about the data (dataset, split sizes, path, model, fixed settings, δ) comes from the space file
(``--space``); a relative dataset path is resolved against the working directory (the repository root). A row
is a split seed s: the data split, the final/baseline training seed and every draw are derived from s, the same
in every mode (paired). Seeds are fixed: NOT PRIVATE, a bench.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dptune.accounting import calibrate_final
from dptune.config import SearchSpace, TrialConfig, nominal_train_size, parse_space

TRAIN_SEED = 1_000_003  # a row's final and baseline training seed is TRAIN_SEED·(s + 1), in every mode
DRAW_SEED = 7_919  # a row's sealed-draw seed (the secret one replaced) is DRAW_SEED·(s + 1) (+ a mode's key)


def parse_seeds(text: str) -> list[int]:
    """"0-4,16" → [0, 1, 2, 3, 4, 16]."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_grid(text: str) -> tuple[tuple[int, float], ...]:
    """"256:0.4,1024:3.2" → ((256, 0.4), (1024, 3.2)): the oracle grid's (B, lr) points."""
    return tuple((int(b), float(lr)) for b, _, lr in (p.partition(":") for p in text.split(",") if p.strip()))


@dataclass(frozen=True)
class BenchSpec:
    """The harness settings a worker needs (picklable; each process builds its :class:`Bench` once).

    Attributes:
        space: The space file: data, model, fixed settings, δ; the space the ``search`` mode runs.
        baseline: Mode (a)'s config: ``planner`` (the space's ``planner.baseline`` over its default), ``auto`` (the
            literature default ``space: auto`` derives for the data: ``dptune.config.auto``), ``default``
            (its declared default) or the path of another space file on the same data (that file's default).
        grid: The oracle's extra (batch size, learning rate) points, each the baseline's config otherwise.
        epochs: Every run's epochs (``--quick``); None: each space's own.
        means: The mean numbers of trials the planner's ``advise`` may choose from (modes b, d).
        fractions: The subsample fractions mode d prices (the one whose plan promises most runs).
    """

    space: str
    baseline: str = "planner"
    grid: tuple[tuple[int, float], ...] = ()
    epochs: float | None = None
    means: tuple[float, ...] = (1.5, 2.0, 3.0)
    fractions: tuple[float, ...] = (0.5, 0.25)


class Bench:
    """A :class:`BenchSpec` read: the space, its sizes, the baseline; data and final runs of one row."""

    def __init__(self, spec: BenchSpec) -> None:
        self.spec = spec
        self.space = self.parse(self.raw())
        self.delta = self.space.privacy.delta
        self.n_val = self.space.dataset.validation_size
        n = nominal_train_size(self.space.dataset)
        if n is None:  # a folder or a table: its size is read once (a bench, not a private run)
            from dptune.data import load_dataset

            n = len(load_dataset(self.space.dataset).train[1])
        self.n_train = int(n)
        self.n_final = self.n_train + self.n_val  # every final run trains on train ∪ validation
        self.baseline = self._baseline()

    def raw(self, path: str | Path | None = None) -> dict[str, Any]:
        """A space file's mapping (default ``--space``), its dataset path made absolute."""
        raw: dict[str, Any] = yaml.safe_load(Path(path or self.spec.space).read_text())
        dataset = raw.get("dataset") or {}
        if dataset.get("path"):
            dataset["path"] = str(Path(dataset["path"]).resolve())
        return raw

    def parse(self, raw: dict[str, Any]) -> SearchSpace:
        """A space mapping parsed, with ``--quick``'s epochs everywhere."""
        if self.spec.epochs is not None:
            raw.setdefault("space", {}).pop("epochs", None)
            (raw.get("default") or {}).pop("epochs", None)
            raw.setdefault("fixed", {})["epochs"] = float(self.spec.epochs)
        return parse_space(raw, source=None)

    def same_data(self, space: SearchSpace, what: str) -> SearchSpace:
        """``space``, refused unless it reads the data of ``--space`` (rows are splits of that data)."""
        mine, theirs = self.space.dataset, space.dataset
        if dataclasses.replace(theirs, split_seed=mine.split_seed) != mine:
            raise SystemExit(f"{what}: its dataset {theirs} is not the data of --space {self.spec.space}")
        return space

    def _baseline(self) -> TrialConfig:
        b = self.spec.baseline
        if b == "planner":
            config = self.space.baseline
        elif b == "auto":  # the literature default space: auto judges this data against (issue 43)
            from dptune.config import parse_space

            config = parse_space({"dataset": self.raw()["dataset"], "space": "auto", "privacy": {
                "target_epsilon": 1.0, "delta": self.delta}}, n_train=self.n_train).baseline
        elif b == "default":
            config = self.space.default
        else:
            config = self.same_data(self.parse(self.raw(b)), f"--baseline {b}").default
        return config if self.spec.epochs is None else config.replace(epochs=float(self.spec.epochs))

    def grid_config(self, i: int) -> TrialConfig:
        """Task ``grid{i}``: 0 the baseline (mode a), i ≥ 1 the oracle's i-th extra point (mode o)."""
        if i == 0:
            return self.baseline
        b, lr = self.spec.grid[i - 1]
        return self.baseline.replace(batch_size=int(b), learning_rate=float(lr))

    def splits(self, seed: int) -> tuple[Any, Any]:
        """Row ``seed``'s splits, and the same with the validation split added to the training split."""
        import torch

        from dptune.data import load_dataset

        data = load_dataset(dataclasses.replace(self.space.dataset, split_seed=seed))
        assert (len(data.train[1]), len(data.val[1])) == (self.n_train, self.n_val)
        merged = dataclasses.replace(data, train=(torch.cat([data.train[0], data.val[0]]),
                                                  torch.cat([data.train[1], data.val[1]])))
        return data, merged

    def final_run(self, config: TrialConfig, prior: list[Any], eps: float, merged: Any, seed: int) -> dict[str, Any]:
        """Train ``config`` on train ∪ validation with σ calibrated so that ``prior`` ⊕ this run costs ≤ ``eps``
        (``calibrate_final``: what ``dptune train --target-epsilon --train-on-validation`` trains); asserted."""
        from dptune.dpsgd import run_trial

        cal = calibrate_final(config.replace(seed=TRAIN_SEED * (seed + 1)), n_train=self.n_final, delta=self.delta,
                              prior_events=prior, target_epsilon=eps)
        total = cal.epsilon_total()
        assert total <= eps * (1 + 1e-9), f"composed ε {total} > target {eps}"
        r = run_trial(cal.config, merged, evaluate_test=True)
        assert r.steps == cal.steps == r.noise_additions, (r.steps, cal.steps, r.noise_additions)
        return {"test": float(r.test_accuracy or 0.0), "sigma_final": cal.config.noise_multiplier,
                "eps_final": cal.epsilon_alone(), "eps_total": total, "batch_size": cal.config.batch_size,
                "lr": cal.config.learning_rate, "diverged": r.diverged}


@functools.cache
def bench(spec: BenchSpec) -> Bench:
    """The :class:`Bench` of ``spec``, built once per process."""
    return Bench(spec)
