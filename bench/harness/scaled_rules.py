"""Modes s and n (with f) of issue 13: learning-rate rules fitted on cheap trials, at a fixed batch size.

(s)  the linear scaling rule of Panda et al. (ICML 2024): B fixed at ``SCALED_BATCH``, ``SCALED_LRS`` tried at two
     small ε levels (σ₁ = 2σ₂), each trial's noised validation score released; at each level the best r = lr·T; the
     line r(ε) = a·ε + b through the two points (slope ≥ 0: the rule's premise) extrapolated to the final run's own
     ε; charged by RDP composition of all 2·|SCALED_LRS| trials (training + score release) and the final run — valid
     for adaptive choices;
(n)  the noise-scaled rule: B fixed at ``SCALED_BATCH``; final-run lr candidates ``NOISE_LRS``; the final run's σ_f
     is fixed in advance by the budget, so each candidate L is tried at two cheap levels (σ₁ = 2σ₂) at lr
     L·σ_f/σ_level, i.e. with the update noise lr·σ the final run would have; every trial's noised validation score
     released; the candidate with the best sum over both levels is trained at σ_f. Charged like (s);
(f)  the same trials, Panda et al.'s two-point fit in this parameterisation: each level's best candidate, the line
     through them in (log σ, log lr) extrapolated to σ_f (clamped to the candidates' range).

Both run ``--space`` with σ fixed (``fixed_sigma.fixed_sigma_space``) and its default's epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dptune.accounting import (
    calibrate_noise_multiplier,
    calibrate_sigma,
    epsilon,
    sampling_rate,
    trial_event,
    trial_steps,
)
from harness.context import Bench
from harness.fixed_sigma import fixed_sigma_space
from harness.modes import Mode, register, released_cell

SCALED_BATCH = 256  # the literature default's B 64 x 4 (DP-SGD favours larger batches)
SCALED_LRS = (0.2, 0.8, 3.2)  # around the linearly scaled default lr 0.1·256/64 = 0.4
SCALED_SHARE = 0.4  # of the total ε, for the cheap trials (RDP composition)
SCALED_SCORE_NOISE = 40.0  # std on the validation correct-count (1,000 examples: ±4 %)
NOISE_LRS = (0.2, 0.4, 0.8, 1.6, 3.2)  # final-run lr candidates: 0.4 (the default's lr scaled to B 256) × 2^k
NOISE_SHARE = 0.3


def _base(bench: Bench) -> Any:
    return fixed_sigma_space(bench, 1.0, SCALED_SCORE_NOISE)


def _cheap(bench: Bench, share: float, eps: float, lrs: tuple[float, ...]) -> tuple[float, list[Any], int]:
    """σ₂ of two cheap levels (σ₁ = 2σ₂) whose |lrs| trials each, composed, cost ``share``·ε; their events; T."""
    q = sampling_rate(batch_size=SCALED_BATCH, basis=bench.n_train)
    steps = trial_steps(epochs=_base(bench).fixed.epochs, batch_size=SCALED_BATCH, basis=bench.n_train)

    def events(s2: float) -> list[Any]:
        return [trial_event(noise_multiplier=s, sampling_rate=q, steps=steps, score_noise=SCALED_SCORE_NOISE)
                for s in (2 * s2, s2) for _ in lrs]

    s2 = calibrate_sigma(lambda s: epsilon(events(s), bench.delta), target_epsilon=share * eps, lo=0.3, hi=2000.0,
                         rel_tol=0.002)
    assert s2 is not None
    return s2, events(s2), steps


@dataclass(frozen=True)
class ScaledPlan:
    sigma2: float  # level 2 (σ₁ = 2σ₂)
    events: tuple[Any, ...]
    eps_levels: tuple[float, float]  # each level's training ε alone (the rule's x axis)
    epsilon: float
    steps: int


@dataclass(frozen=True)
class NoisePlan:
    sigmas: tuple[float, float]  # the two cheap levels (σ₁ = 2σ₂)
    sigma_final: float  # the final run's σ after the cheap trials (B SCALED_BATCH on train ∪ validation)
    events: tuple[Any, ...]
    epsilon: float
    steps: int

    def trial_lr(self, final_lr: float, level: int) -> float:
        """The cheap trial's lr for final-run candidate ``final_lr``: the same lr·σ (update noise)."""
        return final_lr * self.sigma_final / self.sigmas[level]


def scaled_lr(levels: tuple[float, float], best_r: tuple[float, float], eps_final: float, steps_final: int,
              lo: float, hi: float) -> float:
    """Panda et al.'s linear rule: r(ε) = a·ε + b through the two cheap levels (a ≥ 0), at the final ε."""
    (e1, e2), (r1, r2) = levels, best_r
    slope = max(0.0, (r2 - r1) / (e2 - e1))
    r = r2 + slope * (eps_final - e2)
    return float(min(hi, max(lo, r / steps_final)))


def noise_choices(scores: np.ndarray, sigmas: tuple[float, float], sigma_f: float) -> tuple[float, float]:
    """(pooled, fit) final lrs from the cheap scores (rows = levels, columns = ``NOISE_LRS``): the best summed
    score over both levels; each level's best, the line in (log σ, log lr) extrapolated to σ_f, clamped."""
    pooled = NOISE_LRS[int(np.argmax(scores.sum(axis=0)))]
    l1, l2 = (math.log(NOISE_LRS[int(np.argmax(row))]) for row in scores)
    s1, s2 = math.log(sigmas[0]), math.log(sigmas[1])
    fit = l2 + (l2 - l1) / (s2 - s1) * (math.log(sigma_f) - s2)
    return pooled, float(min(max(math.exp(fit), NOISE_LRS[0]), NOISE_LRS[-1]))


class LinearRule(Mode):
    name: ClassVar[str] = "s"
    reports = ("s",)
    titles = {"s": "(s) linear scaling rule (Panda et al.) + final"}
    doc = "(s) Panda et al.'s linear scaling rule at B 256, two cheap ε levels, composed with the final run."

    def plan(self, bench: Bench, eps: float) -> ScaledPlan:
        s2, evs, steps = _cheap(bench, SCALED_SHARE, eps, SCALED_LRS)
        q = sampling_rate(batch_size=SCALED_BATCH, basis=bench.n_train)
        lv = tuple(epsilon([trial_event(noise_multiplier=s, sampling_rate=q, steps=steps, score_noise=None)],
                           bench.delta) for s in (2 * s2, s2))
        return ScaledPlan(s2, tuple(evs), (lv[0], lv[1]), epsilon(evs, bench.delta), steps)

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        from dptune.dpsgd import run_trial

        p: ScaledPlan = plan
        space = _base(bench)
        trials, best_r = [], []
        for level, sigma in enumerate((2 * p.sigma2, p.sigma2)):
            scores = []
            for j, lr in enumerate(SCALED_LRS):
                cfg = space.fixed.replace(batch_size=SCALED_BATCH, learning_rate=lr, noise_multiplier=sigma,
                                          seed=31_337 * (seed + 1) + 10 * level + j)
                r = run_trial(cfg, data)
                assert r.steps == p.steps and r.applied_score_noise == SCALED_SCORE_NOISE
                scores.append(r.score if math.isfinite(r.score) else -math.inf)
                trials.append({"level": level, "lr": lr, "score": r.score, "val_raw": r.val_accuracy_raw})
            best_r.append(SCALED_LRS[int(np.argmax(scores))] * p.steps)
        steps_f = trial_steps(epochs=space.fixed.epochs, batch_size=SCALED_BATCH, basis=bench.n_final)
        q_f = sampling_rate(batch_size=SCALED_BATCH, basis=bench.n_final)
        sigma_f = calibrate_noise_multiplier(list(p.events), sampling_rate=q_f, steps=steps_f, delta=bench.delta,
                                             target_epsilon=eps)
        eps_f = epsilon([trial_event(noise_multiplier=sigma_f, sampling_rate=q_f, steps=steps_f, score_noise=None)],
                        bench.delta)
        spec = space.space["learning_rate"]
        lr = scaled_lr(p.eps_levels, (best_r[0], best_r[1]), eps_f, steps_f, spec.low, spec.high)  # type: ignore[attr-defined]
        cfg = space.fixed.replace(batch_size=SCALED_BATCH, learning_rate=lr)
        return {"trials": trials, "best_r": best_r, "eps_search": p.epsilon,
                **bench.final_run(cfg, list(p.events), eps, merged, seed)}

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        if plan is None:  # a report from records: no plan computed
            return super().privacy(bench, eps, plan, records)
        p: ScaledPlan = plan
        return (f"B {SCALED_BATCH}, lr {SCALED_LRS} at levels ε {p.eps_levels[0]:.3f} / {p.eps_levels[1]:.3f}, "
                f"σ_s {SCALED_SCORE_NOISE:g}", f"{2 * p.sigma2:.2f} / {p.sigma2:.2f}", f"{p.epsilon:.3f}")

    def cell(self, record: dict[str, Any]) -> str:
        r = record.get("best_r") or [math.nan, math.nan]
        return f"best r {r[0]:.0f}, {r[1]:.0f}: " + released_cell(record)


class NoiseRule(Mode):
    name: ClassVar[str] = "n"
    reports = ("n", "f")
    titles = {"n": "(n) noise-scaled rule, two levels pooled + final",
              "f": "(f) noise-scaled rule, per-level fit in log σ + final"}
    doc = "(n/f) the noise-scaled rule at B 256: candidates at two cheap σ levels, pooled (n) or fitted (f)."

    def plan(self, bench: Bench, eps: float) -> NoisePlan:
        s2, evs, steps = _cheap(bench, NOISE_SHARE, eps, NOISE_LRS)
        epochs = _base(bench).fixed.epochs
        sigma_f = calibrate_noise_multiplier(
            evs, sampling_rate=sampling_rate(batch_size=SCALED_BATCH, basis=bench.n_final),
            steps=trial_steps(epochs=epochs, batch_size=SCALED_BATCH, basis=bench.n_final), delta=bench.delta,
            target_epsilon=eps)
        return NoisePlan((2 * s2, s2), sigma_f, tuple(evs), epsilon(evs, bench.delta), steps)

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        from dptune.dpsgd import run_trial

        p: NoisePlan = plan
        space = _base(bench)
        trials, scores = [], np.full((2, len(NOISE_LRS)), -math.inf)
        for level, sigma in enumerate(p.sigmas):
            for j, lr_f in enumerate(NOISE_LRS):
                cfg = space.fixed.replace(batch_size=SCALED_BATCH, learning_rate=p.trial_lr(lr_f, level),
                                          noise_multiplier=sigma, seed=27_449 * (seed + 1) + 10 * level + j)
                r = run_trial(cfg, data)
                assert r.steps == p.steps and r.applied_score_noise == SCALED_SCORE_NOISE
                if math.isfinite(r.score):
                    scores[level, j] = r.score
                trials.append({"level": level, "lr_final": lr_f, "lr": cfg.learning_rate, "score": r.score,
                               "val_raw": r.val_accuracy_raw})
        pooled, fit = noise_choices(scores, p.sigmas, p.sigma_final)
        out: dict[str, Any] = {"trials": trials, "eps_search": p.epsilon}
        for mode, lr in (("n", pooled), ("f", fit)):
            cfg = space.fixed.replace(batch_size=SCALED_BATCH, learning_rate=lr)
            out[mode] = bench.final_run(cfg, list(p.events), eps, merged, seed)
            assert abs(out[mode]["sigma_final"] - p.sigma_final) < 1e-9
        out["test"] = out["n"]["test"]
        return out

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        if plan is None:  # a report from records: no plan computed
            return super().privacy(bench, eps, plan, records)
        p: NoisePlan = plan
        return (f"B {SCALED_BATCH}, final-lr candidates {NOISE_LRS}, each at trial lr L·σ_f/σ_level, 2 levels, "
                f"share {NOISE_SHARE:.0%}, σ_s {SCALED_SCORE_NOISE:g}; final σ {p.sigma_final:.3f}",
                f"{p.sigmas[0]:.2f} / {p.sigmas[1]:.2f}", f"{p.epsilon:.3f}")

    def cell(self, record: dict[str, Any]) -> str:
        return f"n {released_cell(record['n'])}; f {released_cell(record['f'])}"


for _mode in (LinearRule(), NoiseRule()):
    register(_mode)
