"""Does private tuning pay? dptune search + final training vs. a sensible default, at the same total ε.

Issue 7. On digits (train 1,257 / val 180 / test 360, GN CNN, SGD momentum 0.9, δ = 1e-5), for each total ε
and each paired seed (same data split seed, same training seed, same sealed-draw seed in every mode):

(a)  the digits space's declared default (search_spaces/digits.yaml: B 128, lr 0.5, 15 epochs, groups 4)
     trained once on train ∪ validation, σ calibrated so its ε equals the total;
(a2) reference, not a tuning mode: the bench space's own declared default trained the same way (shows how much
     of a gain comes from the narrower space itself rather than from searching it);
(b)  dptune search (random search, random stopping, noised validation score, charged at the worst case over
     the space exactly as ``dptune.search`` charges: ``plan_search`` with σ at the floor the search share
     affords) + final training of the released config on train ∪ validation with σ calibrated so that the
     RDP composition search ⊕ final ≤ total (as ``dptune.train --target-epsilon --train-on-validation``);
(c)  the whole budget to the search (TNB logarithmic stopping, K ≥ 1), the best trial's model released as is;
(d)  subsample tuning: the search on a Poisson subsample of fraction f (``subsampled_search_event``, trials with
     ``sampling_basis = f·n`` passed to the trainer so q = B/(f·n) as charged), final training of ``transfer_config(params, f)`` on
     train ∪ validation, σ calibrated against the composed total.

Stopping rule, mean, score noise σ_s, search share and f come from the planner's ``advise`` (best proxy) for
the bench space. Trials run in-process (``dptune.dpsgd.run_trial``, sequentially within a worker, torch at
``--threads`` threads), not through Ray: same draw code (``make_draw``, the secret seeds replaced by a seed
derived from the row), same accounting. Test accuracy is the usual non-private held-out evaluation.

    .venv/bin/python bench/tuning_value.py --quick                       # smoke check (1 seed, ε = 4, 3 epochs)
    .venv/bin/python bench/tuning_value.py --seeds 5 --epsilons 1,2,4   # the full run (~40 min on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dp_accounting import dp_event as de  # noqa: E402

from dptune._params import sampling_rate, trial_steps  # noqa: E402
from dptune.accounting import (  # noqa: E402
    StoppingRule,
    advise,
    calibrate_noise_multiplier,
    epsilon,
    plan_search,
    sigma_floor,
    stopping_rule,
    trial_event,
)
from dptune.config import (  # noqa: E402
    ConfigError,
    SearchSpace,
    load_space,
    parse_space,
)

DELTA = 1e-5
N_TRAIN = 1257  # digits: 1797 − 360 test − 180 validation (fixed sizes, any split seed)
N_FINAL = 1437  # train ∪ validation
DIGITS_SPACE = ROOT / "search_spaces" / "digits.yaml"
MODES = ("a", "a2", "b", "c", "d")
MODE_NAMES = {
    "a": "(a) digits default, whole budget, train ∪ val",
    "a2": "(a2) bench-space default, whole budget (reference)",
    "b": "(b) search + final training",
    "c": "(c) search only, best trial's model",
    "d": "(d) subsample search + final training",
}

# The bench space: narrow, around values that DP-SGD practice favours (larger batches, moderate lr; De et al.
# 2022, Sander et al. 2023) and a pilot at ε = 2 / 4 on the default split (seed 1, before any bench row ran):
# at a calibrated σ, B 256 / 512 with lr 0.5 beat the digits default (B 128: ε 2: 69.7 → 80.6 / 85.3 %;
# ε 4: 85.3 → 90.3 / 89.4 %), lr 1.0-2.0 was worse (46-81 %). Only lr and batch size are searched; σ is not searched (the trials run at the floor the search budget affords: a larger σ only
# wastes the budget), epochs, groups and the optimizer stay at the digits defaults.
BENCH_SPACE: dict[str, Any] = {
    "name": "digits-tuning-value",
    "dataset": {"name": "digits", "validation_size": 180, "test_size": 360, "public_validation": False,
                "split_seed": 0},
    "model": {"name": "gn_cnn"},
    "fixed": {"epochs": 15, "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.9, "physical_batch_size": 256,
              "clipping": "auto", "groups": 4, "noise_multiplier": 0.5},
    "space": {"learning_rate": {"type": "float", "low": 0.15, "high": 0.6, "log": True},
              "batch_size": {"type": "categorical", "choices": [256, 512]}},
    "default": {"learning_rate": 0.3, "batch_size": 512},
    "privacy": {"delta": DELTA, "stopping": "poisson", "mean": 2, "score_noise": 9.0},
    "search": {"accounting": "random_stopping", "searcher": "random", "scheduler": "fifo"},
}
FRACTIONS_D = (0.5, 0.25)  # subsample fractions priced for (d)
# Mean numbers of trials offered to the planner. Its default grid also has 5 and 8; at 15 epochs a row would then
# take > 10 min on the shared 2-core box, and a narrow space gains little from many draws (a quick run picked
# mean 8 with trial σ ≈ 12 at ε = 4: trials far noisier than the final run).
MEANS = (1.5, 2.0, 3.0)


# ---------------------------------------------------------------------------------------------------
# spaces and accounting (main process; no torch)


def bench_space(epochs: float, score_noise: float, sigma: float, fraction: float = 1.0) -> SearchSpace:
    """The bench space with its privacy settings; for a subsample search the batch choices are the trial
    batches on the subsample (B·f), so ``transfer_config`` maps them back to the full-data batches."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BENCH_SPACE.items()}
    raw["fixed"] = {**raw["fixed"], "epochs": epochs, "noise_multiplier": sigma}
    raw["privacy"] = {**raw["privacy"], "score_noise": float(score_noise)}
    if fraction < 1:
        sp = {k: dict(v) for k, v in raw["space"].items()}
        sp["batch_size"]["choices"] = [max(1, round(b * fraction)) for b in sp["batch_size"]["choices"]]
        raw["space"] = sp
        raw["default"] = {**raw["default"], "batch_size": max(1, round(raw["default"]["batch_size"] * fraction))}
        raw["fixed"]["physical_batch_size"] = 256
    return parse_space(raw, source=None)


def eps_of(event: de.DpEvent) -> float:
    return epsilon([event], DELTA)


def composed_eps(events: list[de.DpEvent]) -> float:
    return epsilon(events, DELTA)


def search_event(space: SearchSpace, rule: StoppingRule, sigma: float, fraction: float) -> de.DpEvent:
    """The charge of the search exactly as dptune.search/plan compute it (worst case over the space)."""
    space = dataclasses.replace(space, tune_fraction=fraction)
    return plan_search(space, N_TRAIN, rule, sigma_low=sigma, compare=False).search_event


def sigma_for_budget(space: SearchSpace, rule: StoppingRule, fraction: float, budget: float) -> float:
    """Smallest trial σ (to 0.2 %) whose exact search event costs ≤ budget (dptune's sigma_floor)."""
    sigma = sigma_floor(dataclasses.replace(space, tune_fraction=fraction), N_TRAIN, target_epsilon=budget,
                        stopping=rule, tolerance=0.002)
    if sigma is None:
        raise ConfigError("budget", f"the search cannot fit ε = {budget:.3g} at any σ the planner tries",
                          "raise the budget or the score noise")
    return sigma


@dataclass(frozen=True)
class SearchPlan:
    mode: str
    rule: StoppingRule
    score_noise: float
    fraction: float
    share: float  # the share of the total the search was given (1 for (c))
    sigma: float  # trial noise multiplier (the floor)
    event: Any  # de.DpEvent (the search's certificate event)
    epsilon: float  # ε of the search alone
    source: str  # where the choice came from


@dataclass(frozen=True)
class EpsPlan:
    epsilon: float
    epochs: float
    sigma_a: float
    sigma_a2: float
    searches: dict[str, SearchPlan]
    notes: tuple[str, ...]


def _advice_pick(space: SearchSpace, eps: float, fraction: float) -> tuple[StoppingRule, float, float, str]:
    adv = advise(space, N_TRAIN, target_epsilon=eps, fractions=(fraction,), means=MEANS)
    best = adv.best
    if best is None or best.score_noise is None:
        # documented fallback rule: Poisson mean 2, σ_s = 9 (5 % of the 180 validation examples), half the budget
        return stopping_rule("poisson", mean=2.0), 9.0, 0.5, f"fallback (planner found no fitting plan: {adv.verdict})"
    return best.stopping, float(best.score_noise), float(best.search_share), (
        f"advise: {best.label()}, proxy {best.proxy:+.3f}; verdict: {adv.verdict}")


def make_plan(eps: float, epochs: float) -> EpsPlan:
    digits = load_space(DIGITS_SPACE)
    d = digits.default
    sig_a = calibrate_noise_multiplier([], sampling_rate=sampling_rate(batch_size=d.batch_size, basis=N_FINAL),
                                       steps=trial_steps(epochs=epochs, batch_size=d.batch_size, basis=N_FINAL),
                                       delta=DELTA, target_epsilon=eps)
    probe = bench_space(epochs, 9.0, 0.5)
    b2 = probe.default.batch_size
    sig_a2 = calibrate_noise_multiplier([], sampling_rate=sampling_rate(batch_size=b2, basis=N_FINAL),
                                        steps=trial_steps(epochs=epochs, batch_size=b2, basis=N_FINAL),
                                        delta=DELTA, target_epsilon=eps)
    notes = []
    searches: dict[str, SearchPlan] = {}

    rule, sn, share, src = _advice_pick(probe, eps, 1.0)
    sp = bench_space(epochs, sn, 0.5)
    sig = sigma_for_budget(sp, rule, 1.0, share * eps)
    ev = search_event(sp, rule, sig, 1.0)
    searches["b"] = SearchPlan("b", rule, sn, 1.0, share, sig, ev, eps_of(ev), src)

    # (c): no final training; K ≥ 1 needed (K = 0 would release no model), so TNB logarithmic with the same mean
    rule_c = stopping_rule("tnb", mean=rule.mean, eta=0.0)
    sig_c = sigma_for_budget(sp, rule_c, 1.0, eps)
    ev_c = search_event(sp, rule_c, sig_c, 1.0)
    searches["c"] = SearchPlan("c", rule_c, sn, 1.0, 1.0, sig_c, ev_c, eps_of(ev_c),
                               f"whole budget; {rule_c.label()} (mean of (b)), σ_s of (b)")

    best_d: tuple[float, SearchPlan] | None = None
    for f in FRACTIONS_D:
        try:
            probe_f = bench_space(epochs, 9.0, 0.5, f)
            adv = advise(probe_f, N_TRAIN, target_epsilon=eps, fractions=(f,), means=MEANS)
        except ConfigError as e:
            notes.append(f"(d) f = {f:g} not priced: {e}")
            continue
        if adv.best is None or adv.best.score_noise is None:
            notes.append(f"(d) f = {f:g}: no fitting plan ({adv.verdict})")
            continue
        c = adv.best
        sn_c = c.score_noise
        assert sn_c is not None
        if best_d is None or c.proxy > best_d[0]:
            spf = bench_space(epochs, sn_c, 0.5, f)
            sig_f = sigma_for_budget(spf, c.stopping, f, c.search_share * eps)
            ev_f = search_event(spf, c.stopping, sig_f, f)
            best_d = (c.proxy, SearchPlan("d", c.stopping, sn_c, f, float(c.search_share), sig_f,
                                          ev_f, eps_of(ev_f), f"advise (f ∈ {FRACTIONS_D}): {c.label()}, "
                                          f"proxy {c.proxy:+.3f}"))
    if best_d is None:
        rule_d, f = stopping_rule("poisson", mean=2.0), FRACTIONS_D[0]
        spf = bench_space(epochs, 9.0, 0.5, f)
        sig_f = sigma_for_budget(spf, rule_d, f, 0.5 * eps)
        ev_f = search_event(spf, rule_d, sig_f, f)
        best_d = (0.0, SearchPlan("d", rule_d, 9.0, f, 0.5, sig_f, ev_f, eps_of(ev_f),
                                  "fallback: poisson(mean=2), σ_s 9, f 0.5, share 50%"))
    searches["d"] = best_d[1]
    for s in searches.values():
        assert s.epsilon <= s.share * eps * (1 + 1e-9), (s.mode, s.epsilon, eps)
    return EpsPlan(eps, epochs, sig_a, sig_a2, searches, tuple(notes))


# ---------------------------------------------------------------------------------------------------
# one row (ε, seed): runs in a worker process


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_cell(plan: EpsPlan, seed: int, threads: int) -> dict[str, Any]:
    import torch

    from dptune.config import DatasetSpec
    from dptune.data import load_dataset, poisson_subsample
    from dptune.dpsgd import run_trial
    from dptune.release import released_params, select_best
    from dptune.trials import TrialRow
    from dptune.tuning.draw import make_draw

    torch.set_num_threads(threads)
    t0 = time.time()
    eps, epochs = plan.epsilon, plan.epochs
    data = load_dataset(DatasetSpec(name="digits", validation_size=180, test_size=360, split_seed=seed))
    assert len(data.train[1]) == N_TRAIN
    merged = dataclasses.replace(data, train=(torch.cat([data.train[0], data.val[0]]),
                                              torch.cat([data.train[1], data.val[1]])))
    train_seed = 1_000_003 * (seed + 1)  # the final/default run's DP-noise seed: the same in every mode
    draw_seed = 7_919 * (seed + 1)  # replaces make_draw's secret draw seed: the same in every mode
    out: dict[str, Any] = {"epsilon": eps, "seed": seed, "modes": {}}

    def final_run(cfg: Any, prior: list[de.DpEvent]) -> dict[str, Any]:
        q = sampling_rate(batch_size=cfg.batch_size, basis=N_FINAL)
        steps = trial_steps(epochs=cfg.epochs, batch_size=cfg.batch_size, basis=N_FINAL)
        sigma = calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=DELTA, target_epsilon=eps)
        ev = trial_event(noise_multiplier=sigma, sampling_rate=q, steps=steps, score_noise=None)
        total = composed_eps([*prior, ev])
        assert total <= eps * (1 + 1e-9), f"composed ε {total} > target {eps}"
        r = run_trial(cfg.replace(noise_multiplier=sigma, seed=train_seed, score_noise=None), merged,
                      evaluate_test=True)
        assert r.steps == steps, (r.steps, steps)
        return {"test": float(r.test_accuracy or 0.0), "sigma_final": sigma, "eps_final": eps_of(ev),
                "eps_total": total, "batch_size": cfg.batch_size, "lr": cfg.learning_rate, "diverged": r.diverged}

    digits = load_space(DIGITS_SPACE)
    out["modes"]["a"] = {**final_run(digits.default.replace(epochs=epochs), []), "eps_search": 0.0}
    sp_a2 = bench_space(epochs, 9.0, 0.5)
    out["modes"]["a2"] = {**final_run(sp_a2.default, []), "eps_search": 0.0}

    for mode in ("b", "c", "d"):
        sp_plan = plan.searches[mode]
        f = sp_plan.fraction
        space = bench_space(epochs, sp_plan.score_noise, sp_plan.sigma, f)
        draw = make_draw(space, sp_plan.rule, seed=draw_seed)
        tune_data = data if f == 1.0 else poisson_subsample(data, f, seed=draw_seed + 17)
        trials, rows = [], []
        for t in draw.trials:
            cfg = space.trial_config(t["params"], seed=int(t["seed"]))
            r = run_trial(cfg, tune_data, evaluate_test=True, sampling_basis=f * N_TRAIN if f < 1 else None)
            charged = trial_steps(epochs=cfg.epochs, batch_size=cfg.batch_size, basis=f * N_TRAIN)
            assert r.steps == charged, (r.steps, charged)
            trials.append({"params": t["params"], "score": r.score, "val_raw": r.val_accuracy_raw,
                           "test": float(r.test_accuracy or 0.0)})
            rows.append(TrialRow(index=len(rows), params=t["params"], seed=str(t["seed"]), score=r.score))
        best = select_best(rows)  # dptune.release: the search's own selection rule
        best_i = None if best is None else best.index
        row: dict[str, Any] = {"k": draw.k, "trials": trials, "eps_search": sp_plan.epsilon,
                               "sigma_search": sp_plan.sigma, "subsample_n": int(len(tune_data.train[1]))}
        if mode == "c":
            assert best_i is not None, "TNB draws K >= 1"
            row.update(test=trials[best_i]["test"], eps_final=0.0, eps_total=sp_plan.epsilon,
                       batch_size=trials[best_i]["params"]["batch_size"], lr=trials[best_i]["params"]["learning_rate"])
            assert sp_plan.epsilon <= eps * (1 + 1e-9)
        else:
            params, _ = released_params(space, best, N_FINAL)  # K = 0 default, subsample transfer rule
            final_cfg = bench_space(epochs, sp_plan.score_noise, sp_plan.sigma).fixed.replace(**params)
            row.update(final_run(final_cfg, [sp_plan.event]))
        out["modes"][mode] = row
    out["seconds"] = time.time() - t0
    return out


# ---------------------------------------------------------------------------------------------------
# statistics and report


def paired_stats(diff: np.ndarray, reps: int = 10_000) -> tuple[float, float, float, float]:
    """mean, 95 % bootstrap CI (percentile), two-sided paired t-test p."""
    from scipy import stats

    n = len(diff)
    mean = float(diff.mean())
    if n < 2:
        return mean, math.nan, math.nan, math.nan
    rng = np.random.default_rng(12345)
    boot = diff[rng.integers(0, n, size=(reps, n))].mean(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    p = float(stats.ttest_rel(diff, np.zeros(n)).pvalue) if np.std(diff) > 0 else (0.0 if mean else 1.0)
    return mean, float(lo), float(hi), p


def report(plans: dict[float, EpsPlan], cells: list[dict[str, Any]], args: argparse.Namespace,
           expected: int, elapsed: float) -> str:
    lines = ["# Does private tuning pay? (bench/tuning_value.py, issue 7)", ""]
    status = "complete" if len(cells) == expected else f"PARTIAL: {len(cells)}/{expected} rows done"
    lines += [f"Status: {status}; wall time {elapsed / 60:.1f} min.", "",
              f"Command: `{args.command}`", "",
              "Digits (train 1,257 / val 180 / test 360 per split seed), GN CNN, SGD momentum 0.9, 15 epochs"
              f"{'' if not args.quick else ' (QUICK: ' + str(plans[next(iter(plans))].epochs) + ' epochs)'}, "
              f"clip 1.0, δ = {DELTA:g}. Row seed s: split seed s, final/default training seed and sealed-draw "
              "seed derived from s, identical in every mode (paired). Trials run in-process (dptune.dpsgd.run_trial, "
              f"sequentially per worker, {args.jobs} workers, torch threads {args.threads}), not through Ray; "
              "same draw code (make_draw with the secret draw seed replaced by the row's), same accounting "
              "(plan_search / subsampled_search_event, RDP composition with the final run). Test accuracy: "
              "non-private held-out evaluation.", "",
              "Bench space (searched: learning_rate log-uniform [0.15, 0.6], batch_size {256, 512}; fixed: 15 "
              "epochs, groups 4, σ at the floor the search budget affords); its declared default is lr 0.3, "
              "B 512 (mode a2). Baseline (a) is search_spaces/digits.yaml's declared default (lr 0.5, B 128, "
              "15 epochs, groups 4), unchanged.", ""]
    lines += ["## Privacy split per ε", "",
              "| ε | mode | plan (source) | trial σ | search ε | final σ | final ε alone | composed total (max over rows) |",
              "|---|---|---|---|---|---|---|---|"]
    by_eps: dict[float, list[dict[str, Any]]] = {}
    for c in cells:
        by_eps.setdefault(c["epsilon"], []).append(c)
    for eps, plan in plans.items():
        rows = sorted(by_eps.get(eps, []), key=lambda c: c["seed"])

        def rng_of(mode: str, key: str, rows: list[dict[str, Any]] = rows) -> str:
            v = [r["modes"][mode][key] for r in rows if mode in r["modes"]]
            if not v:
                return "–"
            return f"{min(v):.3f}" if max(v) - min(v) < 5e-4 else f"{min(v):.3f}–{max(v):.3f}"

        def mx(mode: str, rows: list[dict[str, Any]] = rows) -> str:
            v = [r["modes"][mode]["eps_total"] for r in rows if mode in r["modes"]]
            return f"{max(v):.4f}" if v else "–"

        lines.append(f"| {eps:g} | a | digits default, no search | – | 0 | {plan.sigma_a:.3f} | {eps:g} | {mx('a')} |")
        lines.append(f"| {eps:g} | a2 | bench default, no search | – | 0 | {plan.sigma_a2:.3f} | {eps:g} | {mx('a2')} |")
        for m in ("b", "c", "d"):
            s = plan.searches[m]
            desc = f"{s.rule.label()}, σ_s {s.score_noise:.3g}, f {s.fraction:g}, share {s.share:.0%} ({s.source})"
            fin_s = "–" if m == "c" else rng_of(m, "sigma_final")
            fin_e = "0" if m == "c" else rng_of(m, "eps_final")
            lines.append(f"| {eps:g} | {m} | {desc} | {s.sigma:.3f} | {s.epsilon:.4f} | {fin_s} | {fin_e} | {mx(m)} |")
        for n in plan.notes:
            lines.append(f"|  |  | note: {n} |  |  |  |  |  |")
    lines += ["", "## Test accuracy (mean ± std over rows) and paired difference to (a)", "",
              "| ε | mode | rows | test acc. | mean − (a) [95 % bootstrap CI] | paired t p | significant gain |",
              "|---|---|---|---|---|---|---|"]
    for eps in plans:
        rows = sorted(by_eps.get(eps, []), key=lambda c: c["seed"])
        if not rows:
            continue
        a = np.array([r["modes"]["a"]["test"] for r in rows])
        for m in MODES:
            v = np.array([r["modes"][m]["test"] for r in rows])
            sd = f" ± {100 * v.std(ddof=1):.1f}" if len(v) > 1 else ""
            if m == "a":
                lines.append(f"| {eps:g} | {MODE_NAMES[m]} | {len(v)} | {100 * v.mean():.1f}{sd} | – | – | – |")
                continue
            mean, lo, hi, p = paired_stats(v - a)
            sig = "yes" if (lo > 0 and p < 0.05) else ("worse" if (hi < 0 and p < 0.05) else "no")
            lines.append(f"| {eps:g} | {MODE_NAMES[m]} | {len(v)} | {100 * v.mean():.1f}{sd} | "
                         f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {p:.3g} | {sig} |")
    lines += ["", "## Per row: K drawn and released config", "",
              "| ε | seed | (a) | (a2) | (b) K: released → final | (c) K: best trial | (d) K (|X₁|): released → final |",
              "|---|---|---|---|---|---|---|"]
    for eps in plans:
        for r in sorted(by_eps.get(eps, []), key=lambda c: c["seed"]):
            md = r["modes"]

            def cfg(x: dict[str, Any]) -> str:
                return f"B {x['batch_size']}, lr {x['lr']:.3g} → {100 * x['test']:.1f}"

            lines.append(f"| {eps:g} | {r['seed']} | {100 * md['a']['test']:.1f} | {100 * md['a2']['test']:.1f} | "
                         f"{md['b']['k']}: {cfg(md['b'])} | {md['c']['k']}: {cfg(md['c'])} | "
                         f"{md['d']['k']} ({md['d']['subsample_n']}): {cfg(md['d'])} |")
    lines += ["", "Significant = 95 % bootstrap CI of the paired mean difference excludes 0 and paired t-test "
              "p < 0.05. (c) uses a TNB logarithmic rule because a Poisson K = 0 would release no model.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--dataset" in argv and argv[argv.index("--dataset") + 1:][:1] == ["mnist"]:
        import tuning_value_mnist  # the MNIST bench of issue 13 (its own modes and report)

        return tuning_value_mnist.main(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epsilons", default="1,2,4")
    p.add_argument("--quick", action="store_true", help="smoke check: 1 seed, ε = 4, 3 epochs")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tuning_value.md"))
    p.add_argument("--jobs", type=int, default=2, help="worker processes (rows run in parallel)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (1: on the shared 2-core box 2 threads ran 7-20x slower)")
    p.add_argument("--dataset", choices=("digits", "mnist"), default="digits", help="mnist: bench/tuning_value_mnist.py")
    args = p.parse_args(argv)
    args.command = " ".join(["python", "bench/tuning_value.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.seeds, args.epsilons = 1, "4"
    epochs = 3.0 if args.quick else 15.0
    epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    seeds = list(range(args.seeds))
    t0 = time.time()
    plans = {}
    for eps in epsilons:
        plans[eps] = make_plan(eps, epochs)
        pl = plans[eps]
        print(f"ε = {eps:g}: (a) σ {pl.sigma_a:.3f}; (a2) σ {pl.sigma_a2:.3f}; " + "; ".join(
            f"({m}) {s.rule.label()} σ_s {s.score_noise:.3g} f {s.fraction:g} share {s.share:.0%} trial σ {s.sigma:.3f} "
            f"search ε {s.epsilon:.3f}" for m, s in pl.searches.items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cells: list[dict[str, Any]] = []
    jobs = [(eps, s) for s in seeds for eps in epsilons]
    expected = len(jobs)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=get_context("spawn"),
                             initializer=_init_worker, initargs=(args.threads,)) as ex:
        futs: dict[Future[dict[str, Any]], tuple[float, int]] = {
            ex.submit(run_cell, plans[eps], s, args.threads): (eps, s) for eps, s in jobs}
        pending = set(futs)
        from concurrent.futures import FIRST_COMPLETED, wait

        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fu in done:
                c = fu.result()
                cells.append(c)
                md = c["modes"]
                print(f"[{len(cells)}/{expected}] ε {c['epsilon']:g} seed {c['seed']} ({c['seconds']:.0f} s): "
                      + ", ".join(f"{m} {100 * md[m]['test']:.1f}" for m in MODES)
                      + f"; K b/c/d = {md['b']['k']}/{md['c']['k']}/{md['d']['k']}", flush=True)
                out.write_text(report(plans, cells, args, expected, time.time() - t0))
    text = report(plans, cells, args, expected, time.time() - t0)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
