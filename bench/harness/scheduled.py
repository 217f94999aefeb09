"""Issue 60's modes: searches that stop trials early, run as a user runs them — ``dptune.search`` on a local Ray
(Ray Tune's own ASHAScheduler, the RDP filter actor, the sealed rows), then the final run ``dptune train
--target-epsilon --train-on-validation`` trains, calibrated after the search certificate's events.

Every mode is ``mnist_asha.yaml`` (beside ``--space``) with one edit; its trials at the space's fixed σ:

(RS) random search to the last epoch, random stopping, Poisson mean 4 (the fifo twin: what ASHA is measured against);
(OC) the same, each trial stopping itself on its own noised rung scores (``own_curve``, charged a score per rung);
(AH) ASHA under the RDP filter, a bound of 2 full trials' worth (the shipped space: half the twin's mean);
(AE) ASHA under the RDP filter, 4 full trials' worth (the twin's mean: equal trial-epochs).

A search's draw comes from the row seed and the mode's key (``dptune.search(seed=…)``: NOT PRIVATE, a bench); the
rows at every ε of one split seed run the same draw, only their final runs differ: a worker searches once per split
seed and mode, and the rows at a later ε (``search_reused``) train their final runs after that search's certificate.
Each record holds the hardware the search used: trial-epochs (each sealed row's steps over its steps per epoch, summed) and its wall time with Ray on
``num_cpus`` = 2.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.context import DRAW_SEED, Bench
from harness.modes import Mode, register

SPACE = "mnist_asha.yaml"
TWIN_MEAN = 4  # the fifo twin's Poisson mean: AE's bound, twice AH's
RAY_CPUS = 2
# (mode, split seed) -> its search in this worker: the record, and the certificate's events its final runs follow
SEARCHED: dict[tuple[str, int], tuple[dict[str, Any], list[Any]]] = {}


def _fifo(raw: dict[str, Any]) -> dict[str, Any]:
    raw["privacy"].update(stopping="poisson", mean=TWIN_MEAN)
    raw["search"] = {"searcher": "random", "scheduler": "fifo"}
    return raw


def _own_curve(raw: dict[str, Any]) -> dict[str, Any]:
    raw["privacy"].update(stopping="poisson", mean=TWIN_MEAN)
    raw["search"]["scheduler"] = "own_curve"
    return raw


def _asha_equal(raw: dict[str, Any]) -> dict[str, Any]:
    raw["privacy"]["mean"] = TWIN_MEAN
    return raw


class RaySearch(Mode):
    """One edit of ``mnist_asha.yaml`` searched through ``dptune.search`` on a local Ray, then its final run."""

    edit: Callable[[dict[str, Any]], dict[str, Any]] = staticmethod(lambda raw: raw)

    def raw(self, bench: Bench, eps: float, seed: int) -> dict[str, Any]:
        raw = self.edit(bench.raw(Path(bench.spec.space).parent / SPACE))
        raw["privacy"]["target_epsilon"] = eps
        raw["dataset"]["split_seed"] = seed
        if bench.spec.epochs is not None:  # --quick
            raw["fixed"]["epochs"] = max(1, int(bench.spec.epochs))
        return raw

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        raw = self.raw(bench, eps, seed)
        space = bench.same_data(bench.parse(raw), f"mode {self.name}")
        if (self.name, seed) not in SEARCHED:  # one search per split seed: its charge does not depend on the total ε
            SEARCHED[self.name, seed] = self.search(bench, raw, space, eps, seed)
        found, events = SEARCHED[self.name, seed]
        out = bench.final_run(space.fixed.replace(**found["released"]), events, eps, merged, seed)
        return {**found, "search_reused": eps != found["searched_at"], **out}

    def search(self, bench: Bench, raw: dict[str, Any], space: Any, eps: float, seed: int
               ) -> tuple[dict[str, Any], list[Any]]:
        """The search of row ``seed`` (``raw``, parsed: ``space``) through ``dptune.search`` on a local Ray: the
        hardware it used and what its final runs need (the release, the certificate's events)."""
        import dptune
        from dptune.trials import read_trials

        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            found = dptune.search(raw, budget_epsilon=100, ledger=Path(tmp) / "ledger.sqlite", runs_dir=Path(tmp),
                                  name=self.name, num_cpus=RAY_CPUS, seed=DRAW_SEED * (seed + 1) + sum(map(ord, self.name)))
            seconds = time.perf_counter() - t0
            sealed = found.run / "sealed" / "trials.parquet"
            rows = read_trials(sealed) if sealed.exists() else []
        per_epoch = {b: math.ceil(bench.n_train / b) for b in (256, 1024, space.default.batch_size)}
        trial_epochs = sum(r.steps / per_epoch[int(r.params.get("batch_size", space.default.batch_size))]
                           for r in rows if r.steps)
        record = {"trials": len(rows), "released": {k: found.config[k] for k in space.space},
                  "eps_search": found.epsilon, "trial_epochs": trial_epochs, "search_seconds": seconds, "searched_at": eps}
        return record, [e for _, e in found.certificate.events]

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        space = bench.parse(self.raw(bench, eps, 0))
        desc = (f"{SPACE}: {space.scheduler}, {space.accounting} (mean {space.privacy.mean:g}), "
                f"σ_s {space.privacy.score_noise:g}")
        search = [r["eps_search"] for r in records if "eps_search" in r]
        return desc, f"{space.fixed.noise_multiplier:g}", f"{max(search):.4f}" if search else "–"

    def cell(self, record: dict[str, Any]) -> str:
        rel = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in sorted(record["released"].items()))
        return (f"{record['trials']} rows, {record['trial_epochs']:.1f} trial-epochs, {record['search_seconds']:.0f} s: "
                f"{rel} → {100 * record['test']:.1f}")


def _mode(name: str, edit: Callable[[dict[str, Any]], dict[str, Any]], title: str) -> RaySearch:
    return type(f"Ray_{name}", (RaySearch,), {"name": name, "reports": (name,), "titles": {name: title},
                                              "doc": title, "edit": staticmethod(edit)})()


for _m in (_mode("RS", _fifo, f"(RS) {SPACE}'s fifo twin: random search to the last epoch, random stopping, "
                 f"Poisson mean {TWIN_MEAN}"),
           _mode("OC", _own_curve, "(OC) (RS) with each trial stopping itself on its own noised rung scores "
                 "(own_curve)"),
           _mode("AH", lambda raw: raw, f"(AH) ASHA under the RDP filter, {SPACE} as shipped (2 full trials' worth)"),
           _mode("AE", _asha_equal, f"(AE) ASHA under the RDP filter, {TWIN_MEAN} full trials' worth")):
    register(_m)


def hardware_table(modes: list[str], cells: dict[tuple[float, int], dict[str, dict[str, Any]]]) -> list[str]:
    """Per ε: each Ray mode's test accuracy paired against (RS), its trial-epochs and search wall time (issue 60's
    goal: not significantly worse at ≤ 0.5× the trial-epochs, or significantly better at equal trial-epochs)."""
    import numpy as np

    from harness.stats import paired_stats, significance

    ray = [m for m in ("RS", "OC", "AH", "AE") if m in modes]
    if "RS" not in ray or len(ray) < 2:
        return []
    lines = ["## Early stopping against the fifo twin (RS): accuracy, trial-epochs, wall time", "",
             "| ε | mode | rows | test % − (RS) [95 % CI] | paired t p | better / worse | search ε | "
             "trial-epochs (mean) | × (RS)'s | search wall s (mean) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for eps in sorted({e for e, _ in cells}):
        pairs = [c for (e, _), c in sorted(cells.items()) if e == eps and "RS" in c]
        for m in ray:
            both = [(c[m], c["RS"]) for c in pairs if m in c]
            if not both:
                continue
            d = np.array([a["test"] - b["test"] for a, b in both])
            te = float(np.mean([a["trial_epochs"] for a, _ in both]))
            te0 = float(np.mean([b["trial_epochs"] for _, b in both]))
            mean, lo, hi, p = paired_stats(d) if m != "RS" else (0.0, math.nan, math.nan, math.nan)
            verdict = "–" if m == "RS" or len(d) < 2 else significance(lo, hi, p)
            lines.append(f"| {eps:g} | {m} | {len(both)} | {100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | "
                         f"{p:.3g} | {verdict} | {max(a['eps_search'] for a, _ in both):.3f} | {te:.1f} | "
                         f"{te / te0:.2f} | {np.mean([a['search_seconds'] for a, _ in both]):.0f} |")
    return lines
