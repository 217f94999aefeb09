"""Searches that plan their final run: the noise-scaled transfer (Panda et al., ICML 2024, "A New Linear Scaling
Rule for Private Adaptive Hyperparameter Optimization", at one cheap noise level), for every searcher.

When a space sets ``privacy.target_epsilon`` and ``privacy.search_share``, the final run's noise multiplier
σ_f(B, E) for each reachable batch size B and epochs E is known before anything runs: what the target leaves
after the search's charge (composed, at the smallest valid bound, exactly as ``dptune.train`` calibrates it).
The rule's premise is that the best learning rate scales inversely with the update noise, lr·σ constant. So a
trial that stands for the final-run config (B, E, groups, L) runs it at the cheap σ_c (the smallest σ whose
whole search costs the share, :func:`~dptune.accounting._planner.transfer_trial_sigma`) with lr = L·σ_f(B, E)/σ_c:
the update noise lr·σ that config's final run will have. The release carries L·σ_f, and final training sets
lr = L·σ_f/σ for the σ it calibrates. Random search (random stopping), TPE (composed) and the scaled searcher
(every combination of its categorical candidates once, composed, a noisy max) all run their trials this way.

:func:`advise_transfer` prices such a search against "train the baseline config once with the whole budget",
per searcher, with priors measured on a public proxy task (the space's ``planner`` section), and says whether
it is expected to pay (``dptune.search`` refuses one that is not, unless ``--tune-anyway``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dptune.accounting._advice import expected_max
from dptune.accounting._calibrate import calibrate_noise_multiplier
from dptune.accounting._catalogue import rule_of
from dptune.accounting._planner import Plan, plan_search
from dptune.config import ConfigError, SearchSpace, TrialConfig, nominal_train_size, support_values
from dptune.config.params import sampling_rate, trial_steps
from dptune.config.searchers import searcher
from dptune.errors import check_positive

__all__ = ["TransferAdvice", "TransferPlan", "advise_transfer", "lr_batch_scale", "plan_transfer"]


def lr_batch_scale(batch_size: float, reference: int | None, power: float = 1.0) -> float:
    """The final run's lr over the searched L at ``batch_size``: (B/``reference``)^``power``
    (``search.lr_reference_batch``, ``search.lr_batch_power``), 1 without a reference."""
    return 1.0 if reference is None else (batch_size / reference) ** power


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """The noise-scaled transfer of a search that plans its final run (``privacy.search_share`` set): every trial
    runs the final run's config (batch size B, epochs E, groups, learning rate L) at a cheap σ_c(B, E) (each
    (B, E) its own, all costing about the same: ``_planner.transfer_weights``), with lr = L·σ_f(B, E)/σ_c(B, E):
    the update noise lr·σ that config's final run will have. σ_f(B, E) is what ``privacy.target_epsilon`` leaves
    for that final run after the search's charge, known before anything runs. The release carries L·σ_f
    (``lr_times_sigma``): final training sets lr = L·σ_f/σ for the σ it calibrates."""

    sigmas: tuple[tuple[int, float, float, float], ...]  # (B, E, σ_c, σ_f) for every reachable (B, E)
    final_n: int  # the final run's training examples (train ∪ validation)
    candidates: tuple[dict[str, Any], ...] = ()  # the scaled searcher's fixed trials (final-run params), in order
    # search.lr_reference_batch: the searched L is the final run's lr at this batch size (lr = L·(B/ref)^power);
    # None: at any
    lr_reference_batch: int | None = None
    lr_batch_power: float = 1.0

    def _row(self, batch_size: int, epochs: float) -> tuple[int, float, float, float]:
        for row in self.sigmas:
            if row[0] == int(batch_size) and row[1] == float(epochs):
                return row
        raise ValueError(f"batch size {batch_size}, epochs {epochs:g}: not a reachable point of the planned search")

    @property
    def final_sigmas(self) -> tuple[tuple[int, float, float], ...]:
        return tuple((b, e, sf) for b, e, _, sf in self.sigmas)

    @property
    def trial_sigma(self) -> float:
        """The largest σ_c (the costliest point's)."""
        return max(sc for _, _, sc, _ in self.sigmas)

    def final_sigma(self, batch_size: int, epochs: float) -> float:
        return self._row(batch_size, epochs)[3]

    def trial_sigma_of(self, batch_size: int, epochs: float) -> float:
        return self._row(batch_size, epochs)[2]

    # The four learning rates of a planned search, each with its own name (one value, four meanings on its way):
    # searched_lr L (the space's learning_rate: the final run's lr at lr_reference_batch), final_lr (L scaled to
    # the run's batch), lr_times_sigma (final_lr·σ_f: the update noise the release keeps) and trial_lr
    # (lr_times_sigma/σ_c: what the cheap trial runs at).

    @staticmethod
    def searched_lr(config: TrialConfig) -> float:
        """L: the learning rate the searcher drew for ``config`` (the final run's lr at ``lr_reference_batch``)."""
        return config.learning_rate

    def final_lr(self, config: TrialConfig) -> float:
        """The final run's lr for searched config ``config``: L, or L·(B/``lr_reference_batch``)^``lr_batch_power``
        (power 1: the linear scaling rule) when the space gives one."""
        return self.searched_lr(config) * lr_batch_scale(config.batch_size, self.lr_reference_batch,
                                                         self.lr_batch_power)

    def lr_times_sigma(self, config: TrialConfig) -> float:
        """lr·σ_f(B, E) of the final run of searched config ``config``: the update noise the release's rule keeps."""
        return self.final_lr(config) * self.final_sigma(config.batch_size, config.epochs)

    def trial_lr(self, config: TrialConfig) -> float:
        """The lr the trial for searched ``config`` runs at: lr·σ_f(B, E)/σ_c(B, E) (the same update noise)."""
        return self.lr_times_sigma(config) / self.trial_sigma_of(config.batch_size, config.epochs)

    def trial_config(self, config: TrialConfig) -> TrialConfig:
        """The trial that stands for searched ``config``: σ_c(B, E), and its lr (``trial_lr``)."""
        return config.replace(noise_multiplier=self.trial_sigma_of(config.batch_size, config.epochs),
                              learning_rate=self.trial_lr(config))

    def final_config(self, config: TrialConfig) -> TrialConfig:
        """The final run the budget leaves for searched config ``config``: σ_f(B, E) and its lr (``final_lr``)."""
        return config.replace(noise_multiplier=self.final_sigma(config.batch_size, config.epochs),
                              learning_rate=self.final_lr(config))

    def describe(self) -> dict[str, Any]:
        return {"trial_noise_multiplier": self.trial_sigma, "planned_final_n": self.final_n,
                "lr_reference_batch": self.lr_reference_batch, "lr_batch_power": self.lr_batch_power,
                "points": [{"batch_size": b, "epochs": e, "trial_noise_multiplier": sc, "final_noise_multiplier": sf}
                           for b, e, sc, sf in self.sigmas]}


def plan_transfer(space: SearchSpace, plan: Plan, *, final_n: int) -> TransferPlan:
    """The transfer of a search ``plan`` (its charge, at σ_c) to final runs on ``final_n`` examples (the training
    split, plus validation when training on it)."""
    p = space.privacy
    assert space.transfers and p.target_epsilon is not None  # config.check_transfer
    by_qt = {(pt.sampling_rate, pt.steps): pt.noise_multiplier for pt in plan.points}
    rows = []
    for b in sorted({int(v) for v in _reachable(space, "batch_size")}):
        for e in sorted({float(v) for v in _reachable(space, "epochs")}):
            sigma_c = by_qt[sampling_rate(batch_size=b, basis=plan.n_train),
                            trial_steps(epochs=e, batch_size=b, basis=plan.n_train)]
            sigma_f = calibrate_noise_multiplier(
                [plan.search_event], sampling_rate=sampling_rate(batch_size=b, basis=final_n),
                steps=trial_steps(epochs=e, batch_size=b, basis=final_n), delta=plan.delta,
                target_epsilon=p.target_epsilon)
            rows.append((b, e, sigma_c, sigma_f))
    candidates = searcher(space.searcher).candidates(space)
    return TransferPlan(sigmas=tuple(rows), final_n=final_n, candidates=candidates,
                        lr_reference_batch=space.lr_reference_batch, lr_batch_power=space.lr_batch_power)


def _reachable(space: SearchSpace, key: str) -> list[Any]:
    dist = space.space.get(key)
    return [getattr(space.fixed, key)] if dist is None else list(support_values(dist))


@dataclass(frozen=True, kw_only=True)
class TransferAdvice:
    """A search that plans its final run, priced at one budget. Proxy (accuracy units, higher is better), with
    priors measured on a public proxy task (``accuracy_spread`` s: the std of accuracy across the space's
    configs; ``loss_per_noise_doubling`` ℓ: accuracy lost when the final model's noise-to-signal doubles):

    * ``noise_ratio`` = ν_f / ν_a: the final run's noise-to-signal σ/(B·√T) (geometric mean over the
      reachable (B, E)) over that of the baseline config trained once with the whole budget: the budget the
      search takes, net of the batch and epochs it can reach;
    * ``transfer`` r = σ_c / σ_f (geometric mean over the reachable (B, E)): at the same update noise lr·σ a cheap trial's gradient signal is 1/r of the
      final run's, so its ranking transfers imperfectly: discount 1/(1 + log₂ r);
    * ``expected_gain`` = ρ·s·E[e(K)]/(1 + log₂ r): picking the best of K trials (the scaled searcher's
      candidates, the composed count, or E over random stopping's K, e(0) = 0: the default is released) on
      scores with error err² = (σ_s/n_val)² + 1/(4 n_val) (σ_s: the score noise's std, or a noisy max's
      Gumbel std π·β/√6), ρ = s/√(s² + err²), e(K) = E[max of K standard normals];
    * ``proxy`` = expected_gain − ℓ·log₂(noise_ratio). Expected to pay when the proxy is at least ``min_gain``.

    A space whose ``planner.rehearsal`` holds the search rehearsed on the public proxy (its whole search and final
    run against the baseline, per total ε) is judged by that instead: ``rehearsed`` is the rehearsed gain at the
    target ε (linear in log ε between rehearsed points, the nearest point outside them), expected to pay when it
    is above its standard error over the proxy seeds (``rehearsed_se``, from ``planner.rehearsal_se``; above 0
    without one): a gain within one standard error of 0 is one the proxy cannot tell from none. It prices every
    cost: the search's share, the transfer, the selection noise. The analytic figures above are still computed
    and printed.
    """

    searcher: str
    target_epsilon: float
    delta: float
    plan: TransferPlan
    search_epsilon: float
    baseline_sigma: float
    noise_ratio: float
    transfer: float
    expected_trials: float
    expected_gain: float
    proxy: float
    min_gain: float
    priors: dict[str, Any]  # accuracy_spread, loss_per_noise_doubling, and the proxy that measured them
    rehearsed: float | None = None  # the rehearsed gain at the target ε, when the space's rehearsal applies
    rehearsal_basis: str = ""  # where ``rehearsed`` comes from, or why the space's rehearsal does not apply
    rehearsed_se: float | None = None  # its standard error over the proxy seeds, when the space gives one

    @property
    def pays(self) -> bool:
        if self.rehearsed is not None:
            return self.rehearsed > (self.rehearsed_se or 0.0)
        return self.proxy >= self.min_gain

    @property
    def verdict(self) -> str:
        p = self.plan
        head = (f"{self.searcher} searcher at total epsilon {self.target_epsilon:g}: trials at noise multiplier up to "
                f"{p.trial_sigma:.3g} (r = {self.transfer:.2f} x the final run's), final noise-to-signal "
                f"x{self.noise_ratio:.2f} of the baseline trained once (noise multiplier {self.baseline_sigma:.3g}); "
                f"proxy {self.proxy:+.4f}")
        if self.rehearsed is None and self.rehearsal_basis:
            head = f"{head}; {self.rehearsal_basis}"
        if self.rehearsed is not None:
            se = self.rehearsed_se
            head = (f"{head}; rehearsed on the public proxy: {100 * self.rehearsed:+.2f} points"
                    + (f" (std error {100 * se:.2f} over its proxy seeds)" if se else "")
                    + f" against the baseline ({self.rehearsal_basis})")
            bar = "its std error" if se else "0"
            if self.pays:
                return f"{head} > {bar}: expected to pay"
            return (f"{head} <= {bar}: not expected to pay — train the baseline config once with the whole budget, "
                    "or raise epsilon")
        if self.pays:
            return f"{head} >= {self.min_gain:g}: expected to pay"
        return (f"{head} < {self.min_gain:g}: not expected to pay — train the baseline config once with the "
                "whole budget, or raise epsilon")


def advise_transfer(space: SearchSpace, n_train: int, *, target_epsilon: float | None = None,
                    n_val: int | None = None, accuracy_spread: float | None = None,
                    loss_per_noise_doubling: float | None = None, min_gain: float | None = None,
                    baseline: TrialConfig | None = None, planned: tuple[Plan, TransferPlan] | None = None
                    ) -> TransferAdvice:
    """Price the search of ``space`` (one that plans its final run) at ``target_epsilon`` (default: the space's
    ``privacy.target_epsilon``), its final run on train ∪ validation (as ``dptune.search`` prints it), against
    ``baseline`` (default: the space's ``planner.baseline``, e.g. the literature's default, else the space's own
    default) trained once on the same
    examples with the whole budget. Priors default to the space's ``planner`` section (its proxy task).
    ``planned``: the search's plan and transfer when the caller has them (for this space and target)."""
    if not space.transfers:
        raise ConfigError("privacy.search_share", "this advice prices a search that plans its final run",
                          "set privacy.target_epsilon and privacy.search_share, or use advise()")
    pr = space.planner
    s = pr.accuracy_spread if accuracy_spread is None else accuracy_spread
    ell = pr.loss_per_noise_doubling if loss_per_noise_doubling is None else loss_per_noise_doubling
    min_gain = pr.min_gain if min_gain is None else min_gain
    for name, value in (("accuracy_spread", s), ("loss_per_noise_doubling", ell)):
        check_positive(name, value, "give a prior from a public proxy task, e.g. 0.02")
    if target_epsilon is not None:
        check_positive("target_epsilon", target_epsilon, "choose e.g. 2.0")
        space = space.with_privacy(target_epsilon=target_epsilon)
    p = space.privacy
    assert p.target_epsilon is not None and p.score_noise is not None  # config.check_transfer
    n_val = space.dataset.validation_size if n_val is None else n_val
    final_n = n_train + n_val
    if planned is not None and target_epsilon is None:
        plan, tp = planned
    else:
        plan = plan_search(space, n_train, compare=False)
        tp = plan_transfer(space, plan, final_n=final_n)
    d = baseline or space.baseline
    rehearsed, rehearsed_se, basis = _rehearsal_for(space, plan, d, n_train)
    if rehearsed is None and pr.kind_gain is not None and pr.kind_gain_se is not None:
        rehearsed, basis = _rehearsed_gain(pr.kind_gain, p.target_epsilon, "measured")
        rehearsed_se = _rehearsed_gain(pr.kind_gain_se, p.target_epsilon)[0]
        basis = f"searches by its rules on the public proxy of this kind of data, {basis}"

    t_a = trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=final_n)
    sigma_a = calibrate_noise_multiplier([], sampling_rate=sampling_rate(batch_size=d.batch_size, basis=final_n),
                                         steps=t_a, delta=plan.delta, target_epsilon=p.target_epsilon)
    nu_a = sigma_a / (d.batch_size * math.sqrt(t_a))
    log_nu = [math.log(sf / (b * math.sqrt(trial_steps(epochs=e, batch_size=b, basis=final_n))))
              for b, e, sf in tp.final_sigmas]
    ratio = math.exp(sum(log_nu) / len(log_nu)) / nu_a
    transfer = math.exp(sum(math.log(sc / sf) for _, _, sc, sf in tp.sigmas) / len(tp.sigmas))
    # the selection's noise per trial: a Gaussian score's std, or a Gumbel's (π/√6 × its scale)
    per_count = p.score_noise * (math.pi / math.sqrt(6) if p.selection == "noisy_max" else 1.0)
    err = math.hypot(per_count / n_val, math.sqrt(0.25 / n_val))
    rho = s / math.hypot(s, err)
    e_k, mean_k = _expected_best(space, plan, tp)
    gain = rho * s * e_k / (1 + math.log2(max(1.0, transfer)))
    return TransferAdvice(
        searcher=space.searcher, target_epsilon=p.target_epsilon, delta=plan.delta, plan=tp,
        search_epsilon=plan.search_epsilon, baseline_sigma=sigma_a, noise_ratio=ratio, transfer=transfer,
        expected_trials=mean_k, expected_gain=gain, proxy=gain - ell * math.log2(ratio), min_gain=min_gain,
        priors={"accuracy_spread": s, "loss_per_noise_doubling": ell, "proxy": pr.proxy, "rehearsal": pr.rehearsal,
                "rehearsal_of": pr.rehearsal_of, "rehearsal_se": pr.rehearsal_se},
        rehearsed=rehearsed, rehearsed_se=rehearsed_se, rehearsal_basis=basis)


def _rehearsal_for(space: SearchSpace, plan: Plan, baseline: TrialConfig, n_train: int
                   ) -> tuple[float | None, float | None, str]:
    """The space's rehearsed gain at its target ε, its standard error (when given) and where they come from;
    ``None`` (and why) when its rehearsal does not apply: a rehearsal holds only for the search it rehearsed,
    priced against the baseline it ran."""
    pr, p = space.planner, space.privacy
    if pr.rehearsal is None:
        return None, None, ""
    if (rehearsal_key(space) != pr.rehearsal_of or _trained(baseline) != _trained(space.baseline)
            or plan.stopping != rule_of(p)  # a what-if stopping rule
            or n_train != nominal_train_size(space.dataset)):
        return None, None, ("the space's rehearsal (planner.rehearsal) is of another search or baseline, so the "
                            "analytic model judges")
    assert p.target_epsilon is not None
    gain, basis = _rehearsed_gain(pr.rehearsal, p.target_epsilon)
    se = None if pr.rehearsal_se is None else _rehearsed_gain(pr.rehearsal_se, p.target_epsilon)[0]
    return gain, se, basis


def _trained(config: TrialConfig) -> TrialConfig:
    """The baseline as it is trained once with the whole budget: its σ calibrated, its seed per run, no score."""
    return config.replace(noise_multiplier=1.0, seed=0, score_noise=None)


def rehearsal_key(space: SearchSpace) -> str:
    """What a rehearsal (``planner.rehearsal``) was of: a digest of everything that decides the search and its
    final run — the searched distributions, the fixed and default configs, the privacy settings but the total ε
    (rehearsed per ε), the searcher, the dataset's sizes (its training split's size as known without reading it,
    validation and test sizes), the planner's baseline and the layerwise-clipping section. Not the data's name,
    place or split seed: whether a rehearsal's proxy is like the data is the space's declaration
    (``planner.proxy``), as for every prior. Config only: nothing here is read from data."""
    d = space.dataset
    privacy = sorted((f.name, repr(getattr(space.privacy, f.name))) for f in dataclasses.fields(space.privacy)
                     if f.name != "target_epsilon")
    parts: tuple[Any, ...] = (sorted((k, repr(v)) for k, v in space.space.items()), repr(space.fixed), repr(space.default), privacy,
             space.searcher, space.scheduler, space.tune_fraction,
             (nominal_train_size(d), d.validation_size, d.test_size, d.public_validation), repr(space.baseline),
             repr(space.alc))
    if space.lr_reference_batch is not None:  # (a space without one keeps the key it had before the setting existed)
        parts = (*parts, ("lr_reference_batch", space.lr_reference_batch, space.lr_batch_power))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _rehearsed_gain(rehearsal: dict[float, float], epsilon: float, how: str = "rehearsed") -> tuple[float, str]:
    """The rehearsed gain at total ``epsilon`` — linear in log ε between the rehearsed points, the nearest point's
    value outside them — and which of these it is (``how`` the points were had: rehearsed, or measured)."""
    eps = sorted(rehearsal)
    if epsilon in rehearsal:
        return rehearsal[epsilon], f"{how} at epsilon {epsilon:g}"
    if epsilon < eps[0] or epsilon > eps[-1]:
        nearest = eps[0] if epsilon < eps[0] else eps[-1]
        return rehearsal[nearest], f"outside the {how} epsilons {', '.join(f'{e:g}' for e in eps)}: the nearest one's"
    hi = next(i for i, e in enumerate(eps) if e > epsilon)
    a, b = eps[hi - 1], eps[hi]
    w = math.log(epsilon / a) / math.log(b / a)
    return (1 - w) * rehearsal[a] + w * rehearsal[b], f"interpolated between epsilon {a:g} and {b:g}"


def _expected_best(space: SearchSpace, plan: Plan, tp: TransferPlan) -> tuple[float, float]:
    """(E[e(K)], E[K]) over the number of trials K the search runs (e(0) = 0: the default is released)."""
    if tp.candidates:
        return expected_max(len(tp.candidates)), float(len(tp.candidates))
    # the rule's own K distribution, sampled with a fixed public generator (nothing here is secret or private)
    rng = np.random.default_rng(0)
    ks = np.array([plan.stopping.draw_k(rng) for _ in range(4000)])
    values, counts = np.unique(ks, return_counts=True)
    e_k = sum(c * (expected_max(int(k)) if k else 0.0) for k, c in zip(values, counts, strict=True)) / len(ks)
    return float(e_k), float(ks.mean())
