"""The scaled searcher's plan: the linear scaling rule of Panda et al. (ICML 2024, "A New Linear Scaling Rule
for Private Adaptive Hyperparameter Optimization"), at one cheap noise level.

With batch size and epochs fixed, the final run's noise multiplier σ_f is known before anything runs: it is
what ``privacy.target_epsilon`` leaves after the search (the search's charge composed with the final run, in
RDP, exactly as ``dptune.train`` calibrates it). The rule's premise is that the best learning rate scales
inversely with the update noise, lr·σ constant (Panda et al.'s r = lr·T growing linearly with ε, at fixed T).
So each learning-rate candidate L of the final run is tried once at the cheap σ_c
(:func:`~dptune.accounting._planner.scaled_trial_sigma`) with lr = L·σ_f/σ_c, the same update noise lr·σ
the final run would have; the candidate with the best noised score is released together with its product
L·σ_f, and final training sets lr = L·σ_f/σ for the σ it calibrates. Charged as ``mean`` composed trials
(the ``composed`` rule): valid for the adaptive choice.

:func:`advise_scaled` prices the same plan against the baseline "train the default config once with the
whole budget" with the quality proxy of :class:`~dptune.accounting._advice.Candidate`, adapted to this
searcher (see its docstring), and says whether it is expected to pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import optuna.distributions as od

from dptune._params import sampling_rate, trial_steps
from dptune.accounting._advice import expected_max
from dptune.accounting._calibrate import calibrate_noise_multiplier
from dptune.accounting._planner import Plan, plan_search
from dptune.config import ConfigError, SearchSpace, TrialConfig
from dptune.errors import check_positive

__all__ = ["ScaledAdvice", "ScaledPlan", "advise_scaled", "plan_scaled"]


@dataclass(frozen=True, kw_only=True)
class ScaledPlan:
    candidates: tuple[float, ...]  # the final run's learning-rate candidates, in trial order
    trial_sigma: float  # σ_c of every cheap trial
    final_sigma: float  # σ_f of the final run the budget leaves (on ``final_n`` examples)
    final_n: int

    def trial_learning_rate(self, candidate: float) -> float:
        """The cheap trial's lr for final-run candidate ``candidate``: the same update noise lr·σ."""
        return candidate * self.final_sigma / self.trial_sigma

    def lr_times_sigma(self, candidate: float) -> float:
        return candidate * self.final_sigma

    def trial_params(self) -> list[dict[str, float]]:
        """The trials, one per candidate, in order (trial i runs candidate i)."""
        return [{"learning_rate": self.trial_learning_rate(c), "noise_multiplier": self.trial_sigma}
                for c in self.candidates]


def plan_scaled(space: SearchSpace, plan: Plan, *, final_n: int) -> ScaledPlan:
    """The scaled searcher's trials and final σ, for the search ``plan`` (its composed charge at σ_c) and a
    final run on ``final_n`` examples (the training split, plus validation when training on it)."""
    lr = space.space["learning_rate"]
    assert isinstance(lr, od.CategoricalDistribution) and space.privacy.target_epsilon is not None
    f = space.fixed
    sigma_f = calibrate_noise_multiplier(
        [plan.search_event], sampling_rate=sampling_rate(batch_size=f.batch_size, basis=final_n),
        steps=trial_steps(epochs=f.epochs, batch_size=f.batch_size, basis=final_n), delta=plan.delta,
        target_epsilon=space.privacy.target_epsilon)
    (sigma_c,) = {p.noise_multiplier for p in plan.points}
    candidates = tuple(float(c) for c in lr.choices if isinstance(c, int | float))
    assert len(candidates) == len(lr.choices)  # config.check_scaled: numeric candidates
    return ScaledPlan(candidates=candidates, trial_sigma=sigma_c, final_sigma=sigma_f, final_n=final_n)


@dataclass(frozen=True, kw_only=True)
class ScaledAdvice:
    """The scaled searcher priced at one budget. Proxy (accuracy units, higher is better), with the priors of
    :func:`~dptune.accounting._advice.advise` (``accuracy_spread`` s, ``loss_per_noise_doubling`` ℓ):

    * ``noise_ratio`` = ν_f / ν_a, the final run's noise-to-signal σ/(B·√T) over that of the baseline config
      trained once with the whole budget: the budget the search takes, net of the batch change;
    * ``transfer`` r = σ_c / σ_f: at the same update noise lr·σ a cheap trial's gradient signal is 1/r of the
      final run's, so its ranking transfers imperfectly: discount 1/(1 + log₂ r);
    * ``expected_gain`` = ρ·s·e(K)/(1 + log₂ r): picking the best of the K candidates on scores with error
      err² = (σ_s/n_val)² + 1/(4 n_val) (σ_s: the score noise's std, or a noisy max's Gumbel std π·β/√6),
      ρ = s/√(s² + err²), e(K) = E[max of K standard normals];
    * ``proxy`` = expected_gain − ℓ·log₂(noise_ratio). The search is expected to pay when the proxy is at
      least ``min_gain``: a gain smaller than that is not worth a search whose pick can also go wrong.
    """

    target_epsilon: float
    delta: float
    plan: ScaledPlan
    search_epsilon: float
    baseline_sigma: float
    noise_ratio: float
    transfer: float
    expected_gain: float
    proxy: float
    min_gain: float
    priors: dict[str, float]

    @property
    def pays(self) -> bool:
        return self.proxy >= self.min_gain

    @property
    def verdict(self) -> str:
        p = self.plan
        head = (f"scaled searcher at epsilon {self.target_epsilon:g}: {len(p.candidates)} cheap trials at noise "
                f"multiplier {p.trial_sigma:.3g} (r = {self.transfer:.2f} x the final run's {p.final_sigma:.3g}), "
                f"final noise-to-signal x{self.noise_ratio:.2f} of the baseline trained once "
                f"(noise multiplier {self.baseline_sigma:.3g}); proxy {self.proxy:+.4f}")
        if self.pays:
            return f"{head} >= {self.min_gain:g}: expected to pay"
        return (f"{head} < {self.min_gain:g}: not expected to pay — train the baseline config once with the "
                "whole budget, or raise epsilon")


def advise_scaled(space: SearchSpace, n_train: int, *, target_epsilon: float | None = None, n_val: int | None = None,
                  accuracy_spread: float = 0.10, loss_per_noise_doubling: float = 0.15,
                  min_gain: float = 0.005, baseline: TrialConfig | None = None) -> ScaledAdvice:
    """Price the scaled searcher of ``space`` (``search.searcher: scaled``) at ``target_epsilon`` (default: the
    space's ``privacy.target_epsilon``), its final run on train ∪ validation (as ``dptune.search`` prints it),
    against ``baseline`` (default: the space's own default; e.g. a literature default at another batch size)
    trained once on the same examples with the whole budget."""
    if space.searcher != "scaled":
        raise ConfigError("search.searcher", f"{space.searcher!r}: this advice prices the scaled searcher",
                          "use advise() for random search, or set search.searcher: scaled")
    for name, value in (("accuracy_spread", accuracy_spread), ("loss_per_noise_doubling", loss_per_noise_doubling)):
        check_positive(name, value, "give a prior from a public proxy task, e.g. 0.02")
    if target_epsilon is not None:
        check_positive("target_epsilon", target_epsilon, "choose e.g. 2.0")
        space = space.with_privacy(target_epsilon=target_epsilon)
    p = space.privacy
    assert p.target_epsilon is not None and p.score_noise is not None  # config.check_scaled
    n_val = space.dataset.validation_size if n_val is None else n_val
    final_n = n_train + n_val
    plan = plan_search(space, n_train, compare=False)
    scaled = plan_scaled(space, plan, final_n=final_n)
    d, f = baseline or space.default, space.fixed
    t_a = trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=final_n)
    sigma_a = calibrate_noise_multiplier([], sampling_rate=sampling_rate(batch_size=d.batch_size, basis=final_n),
                                         steps=t_a, delta=plan.delta, target_epsilon=p.target_epsilon)
    t_f = trial_steps(epochs=f.epochs, batch_size=f.batch_size, basis=final_n)
    ratio = (scaled.final_sigma / (f.batch_size * math.sqrt(t_f))) / (sigma_a / (d.batch_size * math.sqrt(t_a)))
    transfer = scaled.trial_sigma / scaled.final_sigma
    # the selection's noise per candidate: a Gaussian score's std, or a Gumbel's (π/√6 × its scale)
    per_count = p.score_noise * (math.pi / math.sqrt(6) if p.selection == "noisy_max" else 1.0)
    err = math.hypot(per_count / n_val, math.sqrt(0.25 / n_val))
    rho = accuracy_spread / math.hypot(accuracy_spread, err)
    gain = rho * accuracy_spread * expected_max(len(scaled.candidates)) / (1 + math.log2(max(1.0, transfer)))
    return ScaledAdvice(
        target_epsilon=p.target_epsilon, delta=plan.delta, plan=scaled, search_epsilon=plan.search_epsilon,
        baseline_sigma=sigma_a, noise_ratio=ratio, transfer=transfer, expected_gain=gain,
        proxy=gain - loss_per_noise_doubling * math.log2(ratio), min_gain=min_gain,
        priors={"accuracy_spread": accuracy_spread, "loss_per_noise_doubling": loss_per_noise_doubling})
