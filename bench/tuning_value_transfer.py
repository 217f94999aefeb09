"""Does the search over the whole space pay on MNIST? dptune's shipped searchers that plan their final run (issue 21),
against the literature default and an oracle grid, paired per split seed. Run: ``python bench/tuning_value_transfer.py``.

Pool, splits, model, final training and statistics as ``bench/tuning_value_mnist.py`` (8,000 train / 1,000 validation
/ 1,000 test per split seed, tanh CNN with GroupNorm, every final run on train ∪ validation with σ calibrated so that
search ⊕ final costs at most the total ε, asserted per row; test accuracy is the non-private held-out measurement).

Modes, paired per row (same split, same final-training seed):

(a)  the literature default (Opacus' MNIST example: B 64, lr 0.1, 10 epochs, groups 4), trained once with the whole ε;
(o)  oracle: ``GRID`` (fixed before any run on seeds 21+; contains (a)), every point trained with the whole ε and
     scored on the *test* split; the best. Not private: what tuning this space can reach (a lower bound of it);
(R)  ``search_spaces/mnist.yaml`` as shipped: random search with random stopping (Poisson, mean 3) over learning
     rate, batch size, groups and epochs, every trial at its (B, E)'s cheap σ_c with lr = L·σ_f(B, E)/σ_c, the best
     Gaussian-noised score released, final run at σ_f(B, E) with lr L;
(T)  ``search_spaces/mnist_tpe.yaml``: TPE (Optuna's sampler, as dptune builds it) under composition, 5 trials,
     the same space and transfer;
(S)  ``search_spaces/mnist_scaled.yaml``: the scaled searcher over batch size × learning rate (6 candidates), a
     report-noisy-max selection;
(m)  the lr-only scaled searcher of issue 13 (B 256, lr 0.2-3.2, 5 candidates, noisy max): the comparison the issue
     asks for ("not significantly worse than the lr-only scaled searcher").

The primary mode of each searcher is its shipped space, declared in the commit that adds this bench, before its
first run on any seed ≥ 21. Plans (σ_c, σ_f, charges) come from dptune's own ``plan_search`` / ``plan_transfer``;
draws from ``make_draw`` with the secret seed replaced by the row's; trials run in-process (``dpsgd.run_trial``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tuning_value import paired_stats  # noqa: E402
from tuning_value_mnist import (  # noqa: E402
    MNIST,
    N_FINAL,
    N_TRAIN,
    N_VAL,
    QUICK_ENV,
    ROOT,
    _data,
    _final,
    gap_share,
    lr_only_scaled,
    run_tasks,
)

from dptune.accounting import plan_search, plan_transfer  # noqa: E402
from dptune.config import SearchSpace, parse_space  # noqa: E402

GRID = ((64, 0.1), (256, 0.4), (256, 1.6), (1024, 3.2))  # (B, lr) at 10 epochs, groups 4; (a) first
SPACES = {"R": "mnist.yaml", "R2": "mnist.yaml", "T": "mnist_tpe.yaml", "S": "mnist_scaled.yaml",
          "m": "mnist_scaled.yaml", "A": "mnist_alc.yaml"}
# R2: mnist.yaml's random search with the batch sizes and learning rates fixed from split seeds 0-20 and the digits
# proxy, after R released B 64 with lr 3.6 on split seed 0 (61 % at total ε 2): the transfer gives a trial r times
# less gradient signal than its final run, so a large lr at a small batch looks fine in the trials and is unstable
# at the final noise. B ∈ {256, 1024} (seeds 0-20: every grid point there within 2.5 points of the best; digits:
# B 10 at lr >= 0.4 lost 20-70 points), lr log-uniform in [0.4, 3.2] (the range measured good at both batches on
# seeds 0-20), default the literature default's lr scaled linearly to B 256 (0.4). Declared before any run of R2.
R2 = {"learning_rate": {"type": "float", "low": 0.4, "high": 3.2, "log": True},
      "batch_size": {"type": "categorical", "choices": [256, 1024]}}  # = search_spaces/mnist.yaml since it shipped
R1 = {"learning_rate": {"type": "float", "low": 0.1, "high": 6.4, "log": True},  # mnist.yaml as first declared
      "batch_size": {"type": "categorical", "choices": [64, 256, 1024]}}
NAMES = {"a": "(a) literature default (Opacus MNIST), whole ε", "o": "(o) oracle grid, test-scored (not private)",
         "R": "(R) random search, random stopping, whole space (mnist.yaml as first declared)",
         "R2": "(R2) random search, random stopping, B ∈ {256, 1024}, lr 0.4-3.2 (mnist.yaml v2)",
         "T": "(T) TPE, composed, whole space (mnist_tpe.yaml)",
         "S": "(S) scaled searcher, B × lr, noisy max (mnist_scaled.yaml)",
         "m": "(m) lr-only scaled searcher, B 256 (issue 13)"}


def space_for(mode: str, eps: float) -> SearchSpace:
    raw = yaml.safe_load((ROOT / "search_spaces" / SPACES[mode]).read_text())
    raw["dataset"]["path"] = str(MNIST)
    raw["privacy"]["target_epsilon"] = eps
    if mode == "R":  # the first version of mnist.yaml (R2's space is the file's now)
        raw["space"].update(R1)
        raw["default"].update(batch_size=64, learning_rate=0.1)
    assert mode != "R2" or {k: raw["space"][k] for k in R2} == R2, "mnist.yaml is no longer R2's space"
    if mode == "m":  # the issue-13 lr-only searcher: B fixed at 256, five lr candidates
        raw = lr_only_scaled(raw)
    if os.environ.get(QUICK_ENV):  # smoke check only: 1 epoch everywhere
        raw = copy.deepcopy(raw)
        raw["space"].pop("epochs", None)
        raw["default"].pop("epochs", None)
        raw["fixed"]["epochs"] = float(os.environ[QUICK_ENV])
    return parse_space(raw, source=None)


# (a): Opacus' MNIST example, pinned here (mnist.yaml's own default may be another config of its space)
LITERATURE = {"batch_size": 64, "learning_rate": 0.1, "epochs": 10.0, "groups": 4}


def baseline_space() -> SearchSpace:
    """mnist.yaml with the literature default as its default (grid and (a) train it; verdicts price against it)."""
    raw = yaml.safe_load((ROOT / "search_spaces" / "mnist.yaml").read_text())
    raw["dataset"]["path"] = str(MNIST)
    raw["space"] = {}
    raw["default"] = {}
    raw["fixed"].update(LITERATURE)
    return parse_space(raw, source=None)


def _trial(space: SearchSpace, plan: Any, tp: Any, params: dict[str, Any], seed: int, data: Any) -> dict[str, Any]:
    from dptune.dpsgd import run_trial

    cfg = tp.trial_config(space.fixed.replace(**params, seed=seed))
    r = run_trial(cfg, data, charged_points=plan.points)
    return {"params": params, "lr": cfg.learning_rate, "sigma": cfg.noise_multiplier, "score": r.score,
            "val_raw": r.val_accuracy_raw, "diverged": r.diverged}


def search_once(space: SearchSpace, plan: Any, tp: Any, key: int, trial: Any, n_train: int, n_val: int, *,
                select_key: int, score_scale: float = 1.0) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """One search as ``dptune.search`` runs it (its draw, sampler and selection), every trial run by
    ``trial(params, seed) -> dict`` (score, val_raw, diverged); its draw, trials and released params.
    ``score_scale``: the noisy max's scale relative to the space's (a proxy with another validation size)."""
    from dptune.release import released_params, select_best, select_noisy_max
    from dptune.trials import TrialRow
    from dptune.tuning.draw import make_draw

    draw = make_draw(space, plan.stopping, seed=key)
    trials: list[dict[str, Any]] = []
    if space.searcher == "tpe":
        import optuna

        from dptune.searchers import seed_words, tpe_startup_trials

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        sampler = optuna.samplers.TPESampler(seed=seed_words(draw.stream_seed("sampler")),  # type: ignore[arg-type]
                                             n_startup_trials=tpe_startup_trials(space.privacy.mean))
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for t in draw.trials:
            ot = study.ask(fixed_distributions=dict(space.space))
            trials.append(trial(dict(ot.params), int(t["seed"]) % 2**63))
            s = trials[-1]["score"]
            study.tell(ot, s if math.isfinite(s) else -1.0)
    else:
        for t in draw.trials:
            trials.append(trial(dict(t["params"]), int(t["seed"]) % 2**63))
    rows = [TrialRow(index=i, params=t["params"], seed="", score=t["score"], val_accuracy_raw=t["val_raw"],
                     diverged=t["diverged"]) for i, t in enumerate(trials)]
    if space.privacy.selection == "noisy_max":
        best, _ = select_noisy_max(rows, gumbel_scale=float(space.privacy.score_noise or 0) * score_scale,
                                   n_val=n_val, seed=select_key)
    else:
        best = select_best(rows)
    params, _ = released_params(space, best, n_train, transfer=tp)
    return draw, trials, params


def run_search(mode: str, eps: float, seed: int, data: Any, merged: Any, key: str | None = None) -> dict[str, Any]:
    """One search exactly as ``dptune.search`` runs it (in-process), then the final run it prints. ``key``: the
    mode whose draw and selection randomness it shares (paired modes: default its own)."""
    space = space_for(mode, eps)
    if space.alc is not None:  # per-layer clip norms from the public data, as dptune.search computes them
        from dptune.tuning.precharge import with_layer_clip

        space = with_layer_clip(space, data)
    plan = plan_search(space, N_TRAIN, compare=False)
    tp = plan_transfer(space, plan, final_n=N_FINAL)
    k = sum(map(ord, key or mode))
    draw, trials, params = search_once(space, plan, tp, 7_919 * (seed + 1) + k,
                                       lambda prm, sd: _trial(space, plan, tp, prm, sd, data), N_TRAIN, N_VAL,
                                       select_key=91_367 * (seed + 1) + k)
    cfg = space.fixed.replace(**params)
    lr_sigma = tp.lr_times_sigma(cfg)
    out = _final(cfg, [plan.search_event], eps, merged, seed)  # σ calibrated as dptune.train does
    assert abs(out["sigma_final"] / cfg.noise_multiplier - 1) < 5e-3, (out["sigma_final"], cfg.noise_multiplier)
    assert abs(lr_sigma / out["sigma_final"] / cfg.learning_rate - 1) < 5e-3  # dptune.train: lr = lr·σ / σ
    return {"k": draw.k, "trials": trials, "eps_search": plan.search_epsilon, "released": params,
            "sigma_c": [list(r) for r in tp.sigmas], **out}


def run_task(eps: float, seed: int, task: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    data, merged = _data(seed)
    if task.startswith("grid"):
        b, lr = GRID[int(task[4:])]
        base = baseline_space()
        cfg = base.default.replace(batch_size=b, learning_rate=lr)
        if os.environ.get(QUICK_ENV):
            cfg = cfg.replace(epochs=float(os.environ[QUICK_ENV]))
        out = _final(cfg, [], eps, merged, seed)
    else:
        out = run_search(task, eps, seed, data, merged)
    return {"epsilon": eps, "seed": seed, "task": task, "seconds": time.time() - t0, **out}


def values(cell: dict[str, dict[str, Any]], modes: list[str]) -> dict[str, float] | None:
    if any(f"grid{i}" not in cell for i in range(len(GRID))) or any(m not in cell for m in modes):
        return None
    grid = [cell[f"grid{i}"]["test"] for i in range(len(GRID))]
    return {"a": grid[0], "o": max(grid), **{m: cell[m]["test"] for m in modes}}


def verdicts(epsilons: list[float], modes: list[str]) -> dict[tuple[str, float], Any]:
    """The planner's verdict per searcher and ε, as ``dptune.search`` prints it (priors from each space's public
    proxy, ``planner:``), against the literature default trained once with the whole ε (mode a)."""
    from dptune.accounting import advise_transfer

    base = baseline_space().default
    return {(m, eps): advise_transfer(space_for(m, eps), N_TRAIN, baseline=base) for m in modes for eps in epsilons}


def _agreement(cells: dict[tuple[float, int], dict[str, dict[str, Any]]], args: argparse.Namespace,
               modes: list[str]) -> list[str]:
    v = verdicts(args.epsilons, modes)
    lines = ["", "## The planner's verdict against the measured sign (mean difference to (a), fresh seeds)", "",
             "| ε | searcher | verdict (proxy) | measured − (a) | agrees |", "|---|---|---|---|---|"]
    agree = total = 0
    for eps in args.epsilons:
        rows = [values(c, modes) for (e, _), c in sorted(cells.items()) if e == eps]
        rows = [r for r in rows if r is not None]
        for m in modes:
            a = v[m, eps]
            if not rows:
                lines.append(f"| {eps:g} | {m} | {'pays' if a.pays else 'does not pay'} ({a.proxy:+.4f}) | – | – |")
                continue
            diff = float(np.mean([r[m] - r["a"] for r in rows]))
            ok = (diff > 0) == a.pays
            if m in ("R", "T", "S", "R2"):
                agree, total = agree + ok, total + 1
            lines.append(f"| {eps:g} | {m} | {'pays' if a.pays else 'does not pay'} ({a.proxy:+.4f}) | "
                         f"{100 * diff:+.1f} ({len(rows)} rows) | {'yes' if ok else '**no**'} |")
    lines += ["", f"Agreement over the shipped searchers (R, T, S): {agree} of {total} cells with rows."]
    return lines


def report(cells: dict[tuple[float, int], dict[str, dict[str, Any]]], args: argparse.Namespace, elapsed: float,
           modes: list[str]) -> str:
    lines = ["# Does the search over the whole space pay on MNIST? (bench/tuning_value_transfer.py, issue 21)", "",
             "" if not elapsed else f"Wall time so far {elapsed / 60:.1f} min ({args.jobs} workers, 1 torch thread each). Rows complete: "
             f"{sum(values(c, modes) is not None for c in cells.values())}/{len(args.rows)}.", "",
             f"Command: `{args.command}`", "", (__doc__ or "").split("\n\n", 1)[1].strip(), "",
             "## Test accuracy, paired difference to (a), share of the oracle gap closed", "",
             "| ε | mode | rows | test acc. % | − (a) [95 % CI] | paired t p | beats (a) | share of gap [95 % CI] | "
             "search ε |", "|---|---|---|---|---|---|---|---|---|"]
    for eps in args.epsilons:
        done = [(s, values(c, modes)) for (e, s), c in sorted(cells.items()) if e == eps]
        rows = [v for _, v in done if v is not None]
        if not rows:
            continue
        col = {m: np.array([r[m] for r in rows]) for m in ["a", "o", *modes]}
        for m in ["a", "o", *modes]:
            v = col[m]
            sd = f" ± {100 * v.std(ddof=1):.1f}" if len(v) > 1 else ""
            se = "–" if m in ("a", "o") else f"{cells[(eps, done[0][0])][m]['eps_search']:.3f}"
            if m == "a":
                lines.append(f"| {eps:g} | {NAMES[m]} | {len(v)} | {100 * v.mean():.1f}{sd} | – | – | – | 0 | – |")
                continue
            if len(v) > 1:
                mean, lo, hi, p = paired_stats(v - col["a"])
                sig = "yes" if (lo > 0 and p < 0.05) else ("worse" if (hi < 0 and p < 0.05) else "no")
                sh, slo, shi = gap_share(v, col["a"], col["o"]) if m != "o" else (1.0, 1.0, 1.0)
                stats = (f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {p:.3g} | {sig} | "
                         f"{sh:.2f} [{slo:.2f}, {shi:.2f}]")
            else:
                stats = f"{100 * float(v[0] - col['a'][0]):+.1f} | – | – | –"
            lines.append(f"| {eps:g} | {NAMES[m]} | {len(v)} | {100 * v.mean():.1f}{sd} | {stats} | {se} |")
        if "m" in modes and len(rows) > 1:
            for m in ("R", "T", "S"):
                if m in modes:
                    mean, lo, hi, p = paired_stats(col[m] - col["m"])
                    lines.append(f"| {eps:g} | {m} − (m) | {len(rows)} | – | {100 * mean:+.1f} [{100 * lo:+.1f}, "
                                 f"{100 * hi:+.1f}] | {p:.3g} | {'worse' if hi < 0 and p < 0.05 else 'not worse'} | – | – |")
    lines += ["", "## Per row (grid test % in GRID order; each search: K, released config → test %)", "",
              "| ε | seed | grid | " + " | ".join(modes) + " |", "|---|---|---|" + "---|" * len(modes)]
    for (eps, seed), c in sorted(cells.items()):
        grid = " ".join(f"{100 * c[f'grid{i}']['test']:.1f}" if f"grid{i}" in c else "…" for i in range(len(GRID)))
        cols = []
        for m in modes:
            if m not in c:
                cols.append("…")
                continue
            r = c[m]
            rel = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r["released"].items()))
            cols.append(f"K {r['k']}: {rel} → {100 * r['test']:.1f}")
        lines.append(f"| {eps:g} | {seed} | {grid} | " + " | ".join(cols) + " |")
    if getattr(args, "verdicts", False):
        lines += _agreement(cells, args, modes)
    lines += ["", f"GRID (B, lr): {GRID}. Beats (a) = 95 % bootstrap CI of the paired mean difference excludes 0 and "
              "paired t-test p < 0.05. Share of gap = (mean tuned − mean a) / (mean o − mean a).", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="21,22,23,24,25", help="split seeds (fresh: 21 and up)")
    p.add_argument("--epsilons", default="2,4,1", help="total ε, in the order they run")
    p.add_argument("--modes", default="R,T,S,m")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke check: 1 seed, ε = 4, 1 epoch (not a result)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tuning_value_transfer.md"))
    p.add_argument("--from-json", help="rewrite the report (with the planner's verdicts) from the .json files "
                   "(comma-separated) this bench wrote, for the --seeds given")
    p.add_argument("--resume", help="a .json this bench wrote: keep its rows, run only the missing tasks")
    args = p.parse_args(argv)
    if args.from_json:  # the rows as they ran; only the report is recomputed
        args.command = " ".join(["python", "bench/tuning_value_transfer.py", *[a for a in argv if a != args.from_json
                                                                               and a != "--from-json"]])
        args.epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
        modes = [m for m in args.modes.split(",") if m]
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.rows, args.jobs, args.verdicts = [(e, s) for e in args.epsilons for s in seeds], 2, True
        cells: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
        for path in args.from_json.split(","):  # several: rows pooled (each row's seed appears once)
            for r in json.loads(Path(path).read_text()):
                if r["seed"] in seeds:
                    cells.setdefault((r["epsilon"], r["seed"]), {})[r["task"]] = r
        text = report(cells, args, 0.0, modes)
        Path(args.out).write_text(text)
        print(text)
        return 0
    args.command = " ".join(["python", "bench/tuning_value_transfer.py", *argv])
    if args.quick:
        args.seeds, args.epsilons = "21", "4"
        args.out = str(Path(args.out).with_suffix(".quick.md"))
        os.environ[QUICK_ENV] = "1"
    if not MNIST.is_dir():
        print(f"{MNIST} is not here: this bench needs the real MNIST test split")
        return 2
    args.epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    modes = [m for m in args.modes.split(",") if m]
    args.rows = [(eps, s) for eps in args.epsilons for s in seeds]
    tasks = [*modes, *(f"grid{i}" for i in range(len(GRID)))]
    t0 = time.time()
    out = Path(args.out)
    cells: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
    for r in json.loads(Path(args.resume).read_text()) if args.resume else []:
        cells.setdefault((r["epsilon"], r["seed"]), {})[r["task"]] = r
    def save() -> None:
        out.write_text(report(cells, args, time.time() - t0, modes))
        out.with_suffix(".json").write_text(json.dumps([x for c in cells.values() for x in c.values()], indent=0,
                                                       default=str))

    run_tasks([(run_task, (eps, s, t)) for eps, s in args.rows for t in tasks if t not in cells.get((eps, s), {})],
              args.jobs, cells, t0, save)
    print(report(cells, args, time.time() - t0, modes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
