"""Modes a2, b, c, d (issue 7 on digits; b and d also ran on MNIST in issue 13).

The ``--space`` made a search at a fixed σ: σ and epochs are not searched (σ is set to the floor the search share
affords — a larger σ only wastes the budget; epochs stay at the space's default), the space's final run is not
planned (``target_epsilon``/``search_share`` dropped). The stopping rule, its mean, the score noise σ_s and the
search share come from the planner's ``advise`` (its best plan among ``--means`` and, for d, ``--fractions``);
when it finds none: Poisson mean 2, σ_s 5 % of the validation split, half the budget. Each search is charged
exactly as ``dptune search`` charges it (``plan_search``, worst case over the space), run in-process with
``make_draw`` (the secret draw seed replaced by the row's), the best noised score released (``select_best``).

(a2) the space's declared default trained once with the whole ε (a reference, not a tuning mode);
(b)  the search + the final training of the released config, σ calibrated so that search ⊕ final ≤ ε;
(c)  the whole budget to the search (TNB logarithmic stopping with (b)'s mean, K ≥ 1), the best trial's model
     released as is;
(d)  the search on a Poisson subsample of fraction f (``subsampled_search_event``; trials at q = B/(f·n) as
     charged), the final training of the transferred config (``transfer_config``: the same q on the full data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dptune.accounting import (
    StoppingRule,
    advise,
    epsilon,
    plan_search,
    sigma_floor,
    stopping_rule,
    trial_steps,
)
from dptune.config import ConfigError, SearchSpace
from harness.context import DRAW_SEED, Bench
from harness.modes import Mode, register

FALLBACK = "poisson(mean=2), σ_s 5 % of the validation split, half the budget"


def fixed_sigma_space(bench: Bench, sigma: float, score_noise: float, fraction: float = 1.0) -> SearchSpace:
    """``--space`` with σ fixed at ``sigma``, epochs at the default's, the score noise ``score_noise``; on a
    subsample of ``fraction`` the batch choices are the trial batches B·f (``search.tune_fraction``)."""
    raw = bench.raw()
    raw.setdefault("default", {})
    for key in ("noise_multiplier", "epochs"):
        raw.setdefault("space", {}).pop(key, None)
        raw["default"].pop(key, None)
    raw["fixed"]["epochs"] = float(bench.space.default.epochs)
    raw["fixed"]["noise_multiplier"] = float(sigma)
    for key in ("target_epsilon", "search_share"):
        raw["privacy"].pop(key, None)
    raw["privacy"]["score_noise"] = float(score_noise)
    if fraction < 1:
        bs = raw["space"]["batch_size"]
        bs["choices"] = [max(1, round(b * fraction)) for b in bs["choices"]]
        raw["default"]["batch_size"] = max(1, round(bench.space.default.batch_size * fraction))
        raw.setdefault("search", {})["tune_fraction"] = fraction
    return bench.parse(raw)


@dataclass(frozen=True)
class SearchPlan:
    rule: StoppingRule
    score_noise: float
    fraction: float
    share: float  # of the total ε given to the search (1 for c)
    sigma: float  # the trials' σ: the floor
    event: Any  # the search's charge (dp_accounting DpEvent)
    epsilon: float  # of the search alone
    source: str  # where the choice came from


def _searched(bench: Bench, rule: StoppingRule, score_noise: float, fraction: float, budget: float,
              source: str, share: float) -> SearchPlan:
    """The smallest trial σ (to 0.2 %) whose search, charged as ``dptune search`` charges it, costs ≤ budget."""
    space = fixed_sigma_space(bench, 0.5, score_noise, fraction)
    sigma = sigma_floor(space, bench.n_train, target_epsilon=budget, stopping=rule, tolerance=0.002)
    if sigma is None:
        raise ConfigError("budget", f"the search cannot fit ε = {budget:.3g} at any σ the planner tries",
                          "raise the budget or the score noise")
    event = plan_search(space, bench.n_train, rule, sigma_low=sigma, compare=False).search_event
    plan = SearchPlan(rule, score_noise, fraction, share, sigma, event, epsilon([event], bench.delta), source)
    assert plan.epsilon <= budget * (1 + 1e-9), (plan.epsilon, budget)
    return plan


def _advised(bench: Bench, eps: float, fraction: float) -> tuple[Any, str]:
    probe = fixed_sigma_space(bench, 0.5, 0.05 * bench.n_val, fraction)
    adv = advise(probe, bench.n_train, target_epsilon=eps, fractions=(fraction,), means=bench.spec.means)
    return (adv.best if adv.best is not None and adv.best.score_noise is not None else None), adv.verdict


class FixedSigmaMode(Mode):
    reports: ClassVar[tuple[str, ...]]

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        if plan is None:  # a report from records: no plan computed
            return super().privacy(bench, eps, plan, records)
        s: SearchPlan = plan
        return (f"{s.rule.label()}, σ_s {s.score_noise:.3g}, f {s.fraction:g}, share {s.share:.0%} ({s.source})",
                f"{s.sigma:.3f}", f"{s.epsilon:.4f}")

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        from dptune.data import poisson_subsample
        from dptune.dpsgd import run_trial
        from dptune.release import released_params, select_best
        from dptune.trials import TrialRow
        from dptune.tuning.draw import make_draw

        s: SearchPlan = plan
        f = s.fraction
        space = fixed_sigma_space(bench, s.sigma, s.score_noise, f)
        draw_seed = DRAW_SEED * (seed + 1)
        draw = make_draw(space, s.rule, seed=draw_seed)
        tune = data if f == 1 else poisson_subsample(data, f, seed=draw_seed + 17)
        trials, rows = [], []
        for t in draw.trials:
            cfg = space.trial_config(t["params"], seed=int(t["seed"]))
            r = run_trial(cfg, tune, evaluate_test=self.name == "c", sampling_basis=f * bench.n_train if f < 1 else None)
            assert r.steps == trial_steps(epochs=cfg.epochs, batch_size=cfg.batch_size, basis=f * bench.n_train)
            trials.append({"params": t["params"], "score": r.score, "val_raw": r.val_accuracy_raw,
                           "test": float(r.test_accuracy or 0.0)})
            rows.append(TrialRow(index=len(rows), params=t["params"], seed=str(t["seed"]), score=r.score))
        best = select_best(rows)  # dptune.release: the search's own selection rule
        out: dict[str, Any] = {"k": draw.k, "trials": trials, "eps_search": s.epsilon, "sigma_search": s.sigma,
                               "subsample_n": int(len(tune.train[1]))}
        if self.name == "c":
            assert best is not None, "TNB draws K >= 1"
            p = trials[best.index]["params"]
            assert s.epsilon <= eps * (1 + 1e-9)
            return {**out, "test": trials[best.index]["test"], "eps_final": 0.0, "eps_total": s.epsilon,
                    "batch_size": p["batch_size"], "lr": p["learning_rate"]}
        params, _ = released_params(space, best, bench.n_train)  # K = 0: the default; subsample: transfer rule
        final = fixed_sigma_space(bench, s.sigma, s.score_noise).fixed.replace(**params)
        return {**out, **bench.final_run(final, [s.event], eps, merged, seed)}

    def cell(self, record: dict[str, Any]) -> str:
        size = f" (n₁ {record['subsample_n']})" if self.name == "d" and "subsample_n" in record else ""
        return f"K {record['k']}{size}: B {record['batch_size']}, lr {record['lr']:.3g} → {100 * record['test']:.1f}"


class DefaultOnce(Mode):
    name: ClassVar[str] = "a2"
    reports = ("a2",)
    titles = {"a2": "(a2) the space's declared default, whole ε (reference)"}
    doc = "(a2) the space's declared default trained once with the whole ε (a reference, not a tuning mode)."

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        return {**bench.final_run(bench.space.default, [], eps, merged, seed), "eps_search": 0.0}

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        return "the space's default, no search", "–", "0"


class Search(FixedSigmaMode):
    name: ClassVar[str] = "b"
    reports = ("b",)
    titles = {"b": "(b) search + final training"}
    doc = "(b) random search at the σ floor (planner-advised rule, σ_s, share) + final training."

    def plan(self, bench: Bench, eps: float) -> SearchPlan:
        best, verdict = _advised(bench, eps, 1.0)
        if best is None:
            return _searched(bench, stopping_rule("poisson", mean=2.0), 0.05 * bench.n_val, 1.0, 0.5 * eps,
                             f"fallback {FALLBACK} (planner found no fitting plan: {verdict})", 0.5)
        return _searched(bench, best.stopping, float(best.score_noise), 1.0, float(best.search_share) * eps,
                         f"advise: {best.label()}, proxy {best.proxy:+.3f}; verdict: {verdict}",
                         float(best.search_share))


class WholeBudget(FixedSigmaMode):
    name: ClassVar[str] = "c"
    reports = ("c",)
    titles = {"c": "(c) search only, best trial's model"}
    doc = "(c) the whole budget to the search (TNB logarithmic, (b)'s mean and σ_s), the best trial's model."

    def plan(self, bench: Bench, eps: float) -> SearchPlan:
        b = Search().plan(bench, eps)
        rule = stopping_rule("tnb", mean=b.rule.mean, eta=0.0)  # K = 0 would release no model
        return _searched(bench, rule, b.score_noise, 1.0, eps,
                         f"whole budget; {rule.label()} (mean of (b)), σ_s of (b)", 1.0)


class Subsample(FixedSigmaMode):
    name: ClassVar[str] = "d"
    reports = ("d",)
    titles = {"d": "(d) subsample search + final training"}
    doc = "(d) (b) on a Poisson subsample of the training split (the best of --fractions), transfer to the final run."

    def plan(self, bench: Bench, eps: float) -> SearchPlan:
        found: tuple[float, SearchPlan] | None = None
        for f in bench.spec.fractions:
            try:
                best, _ = _advised(bench, eps, f)
            except ConfigError:  # this fraction is not priced (e.g. the subsample too small for a batch)
                continue
            if best is not None and (found is None or best.proxy > found[0]):
                found = (best.proxy, _searched(
                    bench, best.stopping, float(best.score_noise), f, float(best.search_share) * eps,
                    f"advise (f ∈ {bench.spec.fractions}): {best.label()}, proxy {best.proxy:+.3f}",
                    float(best.search_share)))
        if found is None:
            f = bench.spec.fractions[0]
            return _searched(bench, stopping_rule("poisson", mean=2.0), 0.05 * bench.n_val, f, 0.5 * eps,
                             f"fallback {FALLBACK}, f {f:g}", 0.5)
        return found[1]


for _mode in (DefaultOnce(), Search(), WholeBudget(), Subsample()):
    register(_mode)

