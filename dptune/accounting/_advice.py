"""Budget-split advice: should this budget pay for a private search at all, and how to split it.

For a total (ε, δ) and a search space, every candidate plan — stopping rule × mean number of trials × score
noise × search share × tune fraction f — is priced side by side:

* the σ lower bound the search can afford with ``share·ε`` (the space's other dimensions at their worst case,
  like :func:`sigma_floor`; never below the space's own lower bound), run on a Poisson subsample of rate f
  (Koskela & Kulkarni 2023; Zhu & Wang 2019, Thm. 6 — see ``_subsample``);
* the σ the final training can then afford: the smallest σ whose DP-SGD run, RDP-composed with the search's
  curve, still meets the total (ε, δ) (composition by adding RDP curves, never by adding ε);
* a documented quality proxy (:class:`Candidate`) against the baseline "train the default config once with
  the whole budget".

Pure and fast: every RDP curve here is a sound upper bound computed in closed form and vectorised over a
coarse σ grid — the Poisson-subsampled Gaussian exactly at integer orders (Mironov, Talwar & Zhang 2019,
Sec. 3.3; fractional orders take the next integer's value, RDP being non-decreasing in the order), random
stopping by Papernot & Steinke (2022) Thms. 2 and 6 as in ``_stopping``, the conversion as in dp_accounting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from dp_accounting import dp_event as de

from dptune._params import sampling_rate, trial_steps
from dptune.accounting._planner import (
    TrialPoint,
    _sigma_values,
    _values,
    smallest_fitting_sigma,
    worst_case_event,
)
from dptune.accounting._rdp import ORDERS
from dptune.accounting._rules import StoppingRule
from dptune.accounting._stopping import tnb_gamma
from dptune.accounting._subsample import (
    _top_order,
    amplify_log_moments,
    poisson_subsampled_rdp,
    subsample_sampling_rate,
    subsample_steps,
    subsampled_search_event,
)
from dptune.config import ConfigError, SearchSpace

__all__ = ["Advice", "Candidate", "advise", "final_event", "search_event_for", "subsampled_sigma_floor"]

SEARCH_SIGMAS = np.geomspace(0.5, 64.0, 27)  # ratio ≈ 1.2 between neighbours: a coarse, fast grid
FINAL_SIGMAS = np.geomspace(0.3, 64.0, 61)  # ratio ≈ 1.09
_SGD_MAX_ORDER = 256  # orders above keep the unsubsampled Gaussian bound (valid, only looser)
_ZW_MAX_ORDER = 64


# ---------------------------------------------------------------------------------------------------
# vectorised RDP curves (rows = σ values), each a sound upper bound


def _sgd_curves(q: float, steps: int, sigmas: np.ndarray) -> np.ndarray:
    """T steps of the Poisson-sampled Gaussian at each σ: Mironov et al. (2019) = Zhu & Wang Thm. 5."""
    s2 = 2 * np.asarray(sigmas, dtype=np.float64)[:, None] ** 2
    gauss = ORDERS[None, :] / s2
    if q >= 1:
        return steps * gauss
    ell = np.arange(_top_order(ORDERS, _SGD_MAX_ORDER) + 1, dtype=np.float64)[None, :]
    return steps * amplify_log_moments(ell * (ell - 1) / s2, ORDERS, gauss, q, 1.0, _SGD_MAX_ORDER)


def _random_stopping(rdp: np.ndarray, rule: StoppingRule) -> np.ndarray:
    """``_stopping.random_stopping_rdp`` (Papernot & Steinke Thms. 2, 6) for a batch of curves."""
    if rule.kind == "composed":
        return rule.mean * rdp
    lam = ORDERS[None, :]
    mean = rule.mean
    if rule.kind == "poisson":
        dhat = _delta_batch(rdp, np.log1p(1 / (ORDERS - 1)))
        out = rdp + mean * dhat + math.log(mean) / (lam - 1)
    else:
        gamma = tnb_gamma(mean, rule.eta)
        with np.errstate(invalid="ignore"):
            hat = (1 - 1 / lam) * rdp + math.log(1 / gamma) / lam
        c = (1 + rule.eta) * np.min(np.where(np.isfinite(hat), hat, np.inf), axis=1, keepdims=True)
        out = rdp + c + math.log(mean) / (lam - 1)
    return np.minimum.accumulate(out[:, ::-1], axis=1)[:, ::-1]


def _delta_batch(rdp: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """``_stopping._delta_at`` (δ(ε) of an RDP curve, as dp_accounting's compute_delta) for a batch."""
    a = ORDERS[None, None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        kl = np.where(rdp > 0, 0.5 * np.log1p(-np.exp(-rdp)), -np.inf)[:, None, :]
        # (a−1)(r − ε + log1p(−1/a)) − log a, split so the [N, E, O] work is one multiply-add
        part = ((ORDERS - 1) * (rdp + np.log1p(-1 / ORDERS)) - np.log(ORDERS))[:, None, :]
        bound = part - (a - 1) * eps[None, :, None]
        logdelta = np.where(a > 1.01, np.fmin(kl, bound), kl)
        logdelta = np.where(np.isnan(logdelta), 0.0, logdelta)
    return np.minimum(np.exp(logdelta.min(axis=2)), 1.0)


def _epsilon(rdp: np.ndarray, delta: float) -> np.ndarray:
    """dp_accounting's ``compute_epsilon`` (Balle et al. 2020, Prop. 12) for a batch of curves."""
    a = ORDERS[None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        eps = rdp + np.log1p(-1 / a) - np.log(delta * a) / (a - 1)
        eps = np.where(a > 1.01, eps, np.inf)
        eps = np.where(delta ** 2 + np.expm1(-rdp) > 0, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.maximum(0.0, eps.min(axis=1))


def _expected_max(k: float) -> float:
    """E[max of k i.i.d. N(0, 1)] (real k ≥ 1 via the density k φ(x) Φ(x)^{k−1})."""
    from scipy.stats import norm

    x = np.linspace(-9, 9, 3601)
    dens = k * norm.pdf(x) * norm.cdf(x) ** (k - 1)
    return float(np.sum(x * dens) * (x[1] - x[0]))


# ---------------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class Candidate:
    """One plan, priced. Quality proxy (higher is better, in accuracy units; priors documented in :func:`advise`):

    ``final_noise`` = σ_final / (B_final·√T_final): the noise-to-signal ratio of the sum of all final updates
    (per-step noise σC/B over T steps against T clipped-gradient means) — invariant under the linear
    batch/step scaling, so plans with different batches compare fairly. ``noise_penalty`` = final_noise /
    baseline_noise ≥ 1 is what the search takes from the final model. ``expected_gain`` = ρ·spread·e(K):
    picking the best of K configs whose true accuracies spread with std ``spread`` on scores with error
    err² = (σ_s/n_val)² + 1/(4 n_val) (release noise + validation sampling) yields ρ = spread/√(spread² + err²)
    times E[max of K standard normals] e(K) (K at its mean), discounted by 1/(1 + log₂ r) when the trials
    train with r = trial_noise / final_noise > 1 times the final model's noise-to-signal (a ranking made on
    much noisier trials transfers imperfectly). ``proxy`` = expected_gain − loss·log₂(noise_penalty).
    """

    stopping: StoppingRule
    score_noise: float | None
    tune_fraction: float
    search_share: float
    search_sigma: float
    search_epsilon: float
    final_sigma: float
    final_batch_size: int
    final_steps: int
    total_epsilon: float
    score_error: float
    final_noise: float
    noise_penalty: float
    trial_noise: float
    expected_gain: float
    proxy: float

    def label(self) -> str:
        s = "public" if self.score_noise is None else f"{self.score_noise:.3g}"
        return (f"{self.stopping.label()}, score noise {s}, f={self.tune_fraction:g}, "
                f"search share {self.search_share:.0%}")


@dataclass(frozen=True)
class Advice:
    target_epsilon: float
    delta: float
    n_train: int
    n_val: int
    baseline_sigma: float | None  # the default config trained once with the whole budget (no search)
    baseline_noise: float
    fixed_cost_epsilon: float  # cheapest search whose score error is acceptable, with training free
    candidates: tuple[Candidate, ...]  # fitting plans, best proxy first
    can_pay: bool
    verdict: str
    suggestions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


# ---------------------------------------------------------------------------------------------------


def _space_points(space: SearchSpace, n_train: int, fraction: float) -> list[tuple[float, int]]:
    """(q, T) of every reachable (batch size, epochs) on the subsample, worst epochs per batch."""
    out = set()
    for b in _values(space, "batch_size"):
        for ep in _values(space, "epochs"):
            if fraction == 1.0:
                out.add((sampling_rate(batch_size=int(b), basis=n_train), trial_steps(epochs=float(ep), batch_size=int(b), basis=n_train)))
            else:
                out.add((subsample_sampling_rate(int(b), n_train, fraction),
                         subsample_steps(float(ep), int(b), n_train, fraction)))
    return sorted(out)


def search_event_for(space: SearchSpace, n_train: int, rule: StoppingRule, sigma: float,
                     score_noise: float | None, fraction: float) -> de.DpEvent:
    """The search of a candidate as a dptune event (for ledgers and independent re-checks)."""
    points = [TrialPoint(sigma, q, t, score_noise) for q, t in _space_points(space, n_train, fraction)]
    return subsampled_search_event(rule.search_event(worst_case_event(points)), fraction)


def final_event(sigma: float, q: float, steps: int) -> de.DpEvent:
    """Final DP-SGD training (no score release)."""
    return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)


def _first_fit(eps: np.ndarray, limit: float) -> int | None:
    """Index of the smallest σ (grids ascend) whose ε fits ``limit``."""
    ok = np.flatnonzero(eps <= limit)
    return int(ok[0]) if len(ok) else None


def advise(space: SearchSpace, n_train: int, target_epsilon: float, *, delta: float | None = None,
           n_val: int | None = None, rules: tuple[StoppingRule, ...] | None = None,
           means: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 8.0), score_errors: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05),
           shares: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7), fractions: tuple[float, ...] = (1.0, 0.5, 0.25),
           accuracy_spread: float = 0.10, loss_per_noise_doubling: float = 0.15,
           max_fixed_share: float = 0.5) -> Advice:
    """Price every candidate plan for ``target_epsilon`` and say whether a private search can pay.

    ``score_errors`` are σ_s / n_val (score-release std in accuracy units); ``accuracy_spread`` is a prior on
    the std of validation accuracy across the space's configs, ``loss_per_noise_doubling`` a prior on the
    accuracy the final model loses when its noise-to-signal doubles — both should come from a public proxy
    task; the defaults (10 points, 15 points) fit small image tasks at ε ≈ 1–4. Tuning "cannot pay" when no
    plan's proxy beats the baseline (> 0), or when the cheapest search whose score error is acceptable costs
    more than ``max_fixed_share`` of ε with training free.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("--target-epsilon", f"{target_epsilon!r} must be > 0", "choose e.g. 2.0")
    delta = space.privacy.delta if delta is None else delta
    n_val = space.dataset.validation_size if n_val is None else n_val
    public = space.dataset.public_validation
    rules = rules or tuple(r for m in means for r in (StoppingRule("poisson", m), StoppingRule("tnb", m, 0.0),
                                                      StoppingRule("tnb", m, 1.0)))
    noises: list[float | None] = [None] if public else [e * n_val for e in score_errors]
    d = space.default
    sigma_low = _sigma_values(space, None)[0]

    def final_recipe(f: float) -> tuple[float, int, int]:  # transfer rule: q and epochs of the trial kept
        q = subsample_sampling_rate(d.batch_size, n_train, f) if f < 1 else sampling_rate(batch_size=d.batch_size, basis=n_train)
        steps = subsample_steps(d.epochs, d.batch_size, n_train, f) if f < 1 else trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=n_train)
        return q, max(1, round(d.batch_size / f)), steps

    q0, b0, t0 = final_recipe(1.0)
    base_eps = _epsilon(_sgd_curves(q0, t0, FINAL_SIGMAS), delta)
    i0 = _first_fit(base_eps, target_epsilon)
    base_sigma = None if i0 is None else float(FINAL_SIGMAS[i0])
    base_noise = (base_sigma or math.inf) / (b0 * math.sqrt(t0))

    gains = {m: _expected_max(m) for m in {r.mean for r in rules}}
    candidates: list[Candidate] = []
    fixed_costs: list[float] = []
    for f in fractions:
        try:
            pts = _space_points(space, n_train, f)
            qf, bf, tf = final_recipe(f)
        except ConfigError:
            continue  # the subsample is too small for the space's batches
        sigmas = SEARCH_SIGMAS[sigma_low <= SEARCH_SIGMAS]  # the space's own lower bound is never lowered
        sgd = np.max([_sgd_curves(q, t, sigmas) for q, t in pts], axis=0)
        final_curves = _sgd_curves(qf, tf, FINAL_SIGMAS)
        for sn in noises:
            score = np.zeros_like(ORDERS) if sn is None else ORDERS / (2 * sn ** 2)
            for rule in rules:
                val = _random_stopping(score[None, :], rule)[0]
                search = _random_stopping(sgd + score[None, :], rule)
                if f < 1:
                    search = np.maximum(poisson_subsampled_rdp(ORDERS, search, f, max_order=_ZW_MAX_ORDER), val)
                fixed_costs.append(float(_epsilon(val[None, :], delta)[0]))
                search_eps = _epsilon(search, delta)
                err = math.sqrt((0.0 if sn is None else sn / n_val) ** 2 + 0.25 / n_val)
                rho = accuracy_spread / math.sqrt(accuracy_spread ** 2 + err ** 2)
                gain = rho * accuracy_spread * gains[rule.mean]
                for share in shares:
                    fits = np.flatnonzero(search_eps <= share * target_epsilon)
                    if not len(fits):
                        continue
                    i = int(fits[0])
                    total = _epsilon(search[i][None, :] + final_curves, delta)
                    j = _first_fit(total, target_epsilon)
                    if j is None:
                        continue
                    noise = float(FINAL_SIGMAS[j]) / (bf * math.sqrt(tf))
                    penalty = noise / base_noise
                    trial_noise = float(sigmas[i]) / (d.batch_size * math.sqrt(tf))  # default batch on X₁
                    discount = 1 / (1 + math.log2(max(1.0, trial_noise / noise)))
                    candidates.append(Candidate(
                        stopping=rule, score_noise=sn, tune_fraction=f, search_share=share,
                        search_sigma=float(sigmas[i]), search_epsilon=float(search_eps[i]),
                        final_sigma=float(FINAL_SIGMAS[j]), final_batch_size=bf, final_steps=tf,
                        total_epsilon=float(total[j]), score_error=0.0 if sn is None else sn / n_val,
                        final_noise=noise, noise_penalty=penalty, trial_noise=trial_noise,
                        expected_gain=gain * discount,
                        proxy=gain * discount - loss_per_noise_doubling * math.log2(max(penalty, 1e-12))))
    candidates.sort(key=lambda c: (-c.proxy, c.total_epsilon))
    fixed = min(fixed_costs) if fixed_costs else math.inf
    return _verdict(space, target_epsilon, delta, n_train, n_val, base_sigma, base_noise, fixed,
                    tuple(candidates), max_fixed_share, public)


def _verdict(space: SearchSpace, eps: float, delta: float, n_train: int, n_val: int, base_sigma: float | None,
             base_noise: float, fixed: float, cands: tuple[Candidate, ...], max_fixed_share: float,
             public: bool) -> Advice:
    best = cands[0] if cands else None
    tips = []
    if not public:
        tips.append("public validation data: the score releases become free (they are never amplified by "
                    f"subsampling); today the cheapest acceptable search costs epsilon {fixed:.3g} with training free")
    tips.append("fewer trials (mean 1.5-2) and a narrower space (fewer batch sizes/epochs: the worst case is "
                "charged)")
    tips.append("tuning on a subsample (search.tune_fraction 0.25-0.5) cuts the training part of the search")
    if base_sigma is not None:
        tips.append(f"or skip the search: the default config alone affords noise_multiplier {base_sigma:.3g}")
    if base_sigma is None:
        verdict, can = (f"epsilon {eps:g} does not even pay for one run of the default config "
                        f"(noise_multiplier <= {FINAL_SIGMAS[-1]:g}); raise the budget"), False
    elif fixed > max_fixed_share * eps:
        verdict, can = (f"private tuning cannot pay at epsilon {eps:g}: releasing scores precise enough to "
                        f"choose (error <= 5% of {n_val} validation examples) already costs {fixed:.3g} "
                        f"(> {max_fixed_share:.0%} of the budget) before any training"), False
    elif best is None or best.proxy <= 0:
        verdict, can = (f"private tuning does not pay at epsilon {eps:g}: every plan leaves the final model so much "
                        "more noise than training the default config once that the expected selection gain "
                        "is lost"), False
    else:
        verdict, can = (f"tuning can pay at epsilon {eps:g}: best plan {best.label()} (proxy {best.proxy:+.3f}; "
                        f"final noise x{best.noise_penalty:.2f} of the untuned run)"), True
    return Advice(eps, delta, n_train, n_val, base_sigma, base_noise, fixed, cands, can, verdict, tuple(tips))


def subsampled_sigma_floor(space: SearchSpace, n_train: int, target_epsilon: float, rule: StoppingRule,
                           fraction: float, tolerance: float = 1e-3) -> float | None:
    """:func:`sigma_floor` for a search on a Poisson subsample (fast closed-form curves, sound upper bounds)."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("--target-epsilon", f"{target_epsilon!r} must be > 0", "choose e.g. 2.0")
    sn = space.fixed.score_noise
    score = np.zeros_like(ORDERS) if sn is None else ORDERS / (2 * sn ** 2)
    pts = _space_points(space, n_train, fraction)
    val = _random_stopping(score[None, :], rule)

    def cost(sigma: float) -> float:
        sgd = np.max([_sgd_curves(q, t, np.array([sigma])) for q, t in pts], axis=0)
        search = _random_stopping(sgd + score[None, :], rule)
        if fraction < 1:
            search = np.maximum(poisson_subsampled_rdp(ORDERS, search, fraction), val)
        return float(_epsilon(search, space.privacy.delta)[0])

    return smallest_fitting_sigma(cost, target_epsilon, tolerance)
