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
stopping by each rule's ``search_rdp`` (Papernot & Steinke 2022, Thms. 2 and 6), the conversion as everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dptune.accounting import _strictmath as strict
from dptune.accounting._amplify import amplify_log_moments, poisson_subsampled_rdp, top_order
from dptune.accounting._catalogue import comparison_rules
from dptune.accounting._convert import ORDERS, rdp_to_epsilon
from dptune.accounting._planner import reachable_points
from dptune.accounting._rules import StoppingRule
from dptune.config import ConfigError, SearchSpace
from dptune.config.params import sampling_rate, trial_steps
from dptune.errors import check_positive

__all__ = ["Advice", "Candidate", "advise"]

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
    ell = np.arange(top_order(ORDERS, _SGD_MAX_ORDER) + 1, dtype=np.float64)[None, :]
    return steps * amplify_log_moments(ell * (ell - 1) / s2, ORDERS, gauss, fraction=q, factor=1.0)


def expected_max(k: float) -> float:
    """E[max of k i.i.d. N(0, 1)] (real k ≥ 1 via the density k φ(x) Φ(x)^{k−1})."""
    from scipy.special import ndtr

    x = np.linspace(-9, 9, 3601)
    # scipy.stats.norm's pdf and cdf, as it computes them (import of scipy.stats: 0.5 s of a 2 s `dptune plan`)
    pdf = strict.exp(-x**2 / 2.0) / np.sqrt(2 * np.pi)
    dens = k * pdf * ndtr(x) ** (k - 1)
    return float(np.sum(x * dens) * (x[1] - x[0]))


def _first_fit(eps: np.ndarray, limit: float) -> int | None:
    """Index of the smallest σ (grids ascend) whose ε fits ``limit``."""
    ok = np.flatnonzero(eps <= limit)
    return int(ok[0]) if len(ok) else None


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
# pricing


@dataclass(frozen=True)
class _Budget:
    """What every candidate of one :func:`advise` call shares."""

    target_epsilon: float
    delta: float
    n_val: int
    base_noise: float
    shares: tuple[float, ...]
    accuracy_spread: float
    loss_per_noise_doubling: float
    gains: dict[float, float]  # mean number of trials -> E[max of K standard normals]


@dataclass(frozen=True)
class _Search:
    """One search plan priced over the σ grid ``sigmas`` (``curves``: one RDP curve per σ)."""

    rule: StoppingRule
    score_noise: float | None
    fraction: float
    sigmas: np.ndarray
    curves: np.ndarray
    trial_batch_size: int


def _final_recipe(space: SearchSpace, n_train: int, fraction: float) -> tuple[float, int, int]:
    """(q, batch size, steps) of final training after a search on ``fraction`` of the data, by the transfer
    rule (``transfer_config``: the trial's q and epochs kept, the batch scaled by 1/f)."""
    d = space.default
    basis = fraction * n_train
    q = sampling_rate(batch_size=d.batch_size, basis=basis)
    steps = trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=basis)
    return q, max(1, round(d.batch_size / fraction)), steps


def _price_fraction(space: SearchSpace, n_train: int, fraction: float, rules: tuple[StoppingRule, ...],
                    noises: list[float | None], b: _Budget) -> tuple[list[Candidate], list[float]]:
    """Candidates of a search on ``fraction`` of the data, and the ε of their score releases alone."""
    f = fraction
    try:
        points = reachable_points(space, n_train, tune_fraction=f)
        qf, bf, tf = _final_recipe(space, n_train, f)
    except ConfigError:
        return [], []  # the subsample is too small for the space's batches
    pts = sorted({(p.sampling_rate, p.steps) for p in points})
    sigma_low = min(p.noise_multiplier for p in points)
    sigmas = SEARCH_SIGMAS[sigma_low <= SEARCH_SIGMAS]  # the space's own lower bound is never lowered
    sgd = np.max([_sgd_curves(q, t, sigmas) for q, t in pts], axis=0)
    final_curves = _sgd_curves(qf, tf, FINAL_SIGMAS)
    candidates: list[Candidate] = []
    fixed_costs: list[float] = []
    for sn in noises:
        score = np.zeros_like(ORDERS) if sn is None else ORDERS / (2 * sn ** 2)
        for rule in rules:
            val = rule.search_rdp(score)  # the score releases are never amplified by subsampling
            search = rule.search_rdp(sgd + score[None, :])
            if f < 1:
                search = np.maximum(poisson_subsampled_rdp(ORDERS, search, fraction=f, max_order=_ZW_MAX_ORDER), val)
            fixed_costs.append(float(rdp_to_epsilon(ORDERS, val, delta=b.delta)))
            plan = _Search(rule=rule, score_noise=sn, fraction=f, sigmas=sigmas, curves=search,
                           trial_batch_size=space.default.batch_size)
            candidates += _candidates(plan, final_curves, bf, tf, b)
    return candidates, fixed_costs


def _candidates(s: _Search, final_curves: np.ndarray, final_batch: int, final_steps: int,
                b: _Budget) -> list[Candidate]:
    """The search ``s`` at each share of the budget, with the final training the rest affords."""
    search_eps = rdp_to_epsilon(ORDERS, s.curves, delta=b.delta)
    score_error = 0.0 if s.score_noise is None else s.score_noise / b.n_val
    err = math.sqrt(score_error ** 2 + 0.25 / b.n_val)
    rho = b.accuracy_spread / math.sqrt(b.accuracy_spread ** 2 + err ** 2)
    gain = rho * b.accuracy_spread * b.gains[s.rule.mean]
    out = []
    for share in b.shares:
        i = _first_fit(search_eps, share * b.target_epsilon)
        if i is None:
            continue
        total = rdp_to_epsilon(ORDERS, s.curves[i][None, :] + final_curves, delta=b.delta)
        j = _first_fit(total, b.target_epsilon)
        if j is None:
            continue
        noise = float(FINAL_SIGMAS[j]) / (final_batch * math.sqrt(final_steps))
        penalty = noise / b.base_noise
        trial_noise = float(s.sigmas[i]) / (s.trial_batch_size * math.sqrt(final_steps))  # default batch on X₁
        discount = 1 / (1 + math.log2(max(1.0, trial_noise / noise)))
        out.append(Candidate(
            stopping=s.rule, score_noise=s.score_noise, tune_fraction=s.fraction, search_share=share,
            search_sigma=float(s.sigmas[i]), search_epsilon=float(search_eps[i]),
            final_sigma=float(FINAL_SIGMAS[j]), final_batch_size=final_batch, final_steps=final_steps,
            total_epsilon=float(total[j]), score_error=score_error, final_noise=noise, noise_penalty=penalty,
            trial_noise=trial_noise, expected_gain=gain * discount,
            proxy=gain * discount - b.loss_per_noise_doubling * math.log2(max(penalty, 1e-12))))
    return out


def advise(space: SearchSpace, n_train: int, *, target_epsilon: float, delta: float | None = None,
           n_val: int | None = None, rules: tuple[StoppingRule, ...] | None = None,
           means: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 8.0), score_errors: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05),
           shares: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7), fractions: tuple[float, ...] = (1.0, 0.5, 0.25),
           accuracy_spread: float = 0.10, loss_per_noise_doubling: float = 0.15,
           max_fixed_share: float = 0.5, min_gain: float = 0.005) -> Advice:
    """Price every candidate plan for ``target_epsilon`` and say whether a private search can pay.

    ``rules`` default to every random-stopping rule of the catalogue at each of ``means``. ``score_errors``
    are σ_s / n_val (score-release std in accuracy units); ``accuracy_spread`` is a prior on the std of
    validation accuracy across the space's configs, ``loss_per_noise_doubling`` a prior on the accuracy the
    final model loses when its noise-to-signal doubles — both should come from a public proxy task; the
    defaults (10 points, 15 points) fit small image tasks at ε ≈ 1–4 (MNIST measured 1.2 and 1.85 points: see
    the README). Tuning "does not pay" when no plan's proxy reaches ``min_gain`` (half a point: a smaller
    expected gain is not worth a search whose pick can also go wrong), "cannot pay" when the cheapest search whose score error is acceptable costs more
    than ``max_fixed_share`` of ε with training free.
    """
    check_positive("target_epsilon", target_epsilon, "choose e.g. 2.0")
    delta = space.privacy.delta if delta is None else delta
    n_val = space.dataset.validation_size if n_val is None else n_val
    public = space.dataset.public_validation
    rules = rules or tuple(r for m in means for r in comparison_rules(m) if r.random_stopping)
    noises: list[float | None] = [None] if public else [e * n_val for e in score_errors]
    q0, b0, t0 = _final_recipe(space, n_train, 1.0)
    i0 = _first_fit(rdp_to_epsilon(ORDERS, _sgd_curves(q0, t0, FINAL_SIGMAS), delta=delta), target_epsilon)
    base_sigma = None if i0 is None else float(FINAL_SIGMAS[i0])
    budget = _Budget(target_epsilon=target_epsilon, delta=delta, n_val=n_val,
                     base_noise=(base_sigma or math.inf) / (b0 * math.sqrt(t0)), shares=shares,
                     accuracy_spread=accuracy_spread, loss_per_noise_doubling=loss_per_noise_doubling,
                     gains={m: expected_max(m) for m in {r.mean for r in rules}})
    candidates: list[Candidate] = []
    fixed_costs: list[float] = []
    for f in fractions:
        cands, fixed = _price_fraction(space, n_train, f, rules, noises, budget)
        candidates += cands
        fixed_costs += fixed
    candidates.sort(key=lambda c: (-c.proxy, c.total_epsilon))
    fixed_cost = min(fixed_costs) if fixed_costs else math.inf
    return _verdict(space, target_epsilon, delta, n_train, n_val, base_sigma, budget.base_noise, fixed_cost,
                    tuple(candidates), max_fixed_share, public, min_gain)


def _verdict(space: SearchSpace, eps: float, delta: float, n_train: int, n_val: int, base_sigma: float | None,
             base_noise: float, fixed: float, cands: tuple[Candidate, ...], max_fixed_share: float,
             public: bool, min_gain: float) -> Advice:
    best = cands[0] if cands else None
    tips = []
    if not public:
        tips.append("public validation data: the score releases become free (they are never amplified by "
                    f"subsampling); today the cheapest acceptable search costs epsilon {fixed:.3g} with training free")
    tips.append("fewer trials (mean 1.5-2) and a narrower space (fewer batch sizes/epochs: the worst case is "
                "charged)")
    tips.append("tuning on a subsample (search.tune_fraction 0.25-0.5) cuts the training part of the search")
    tips.append("to tune only the learning rate at fixed batch and epochs, the scaled searcher (search.searcher: "
                "scaled) tries each candidate at the final run's update noise lr x sigma: see "
                "search_spaces/mnist_scaled.yaml")
    if base_sigma is not None:
        tips.append(f"or skip the search: the default config alone affords noise_multiplier {base_sigma:.3g}")
    if base_sigma is None:
        verdict, can = (f"epsilon {eps:g} does not even pay for one run of the default config "
                        f"(noise_multiplier <= {FINAL_SIGMAS[-1]:g}); raise the budget"), False
    elif fixed > max_fixed_share * eps:
        verdict, can = (f"private tuning cannot pay at epsilon {eps:g}: releasing scores precise enough to "
                        f"choose (error <= 5% of {n_val} validation examples) already costs {fixed:.3g} "
                        f"(> {max_fixed_share:.0%} of the budget) before any training"), False
    elif best is None or best.proxy <= 0 or best.proxy < min_gain:
        verdict, can = (f"private tuning does not pay at epsilon {eps:g}: every plan leaves the final model so much "
                        "more noise than training the default config once that the expected selection gain "
                        f"is lost or below {min_gain:g} (best proxy "
                        f"{'none' if best is None else format(best.proxy, '+.4f')})"), False
    else:
        verdict, can = (f"tuning can pay at epsilon {eps:g}: best plan {best.label()} (proxy {best.proxy:+.3f}; "
                        f"final noise x{best.noise_penalty:.2f} of the untuned run)"), True
    return Advice(eps, delta, n_train, n_val, base_sigma, base_noise, fixed, cands, can, verdict, tuple(tips))
