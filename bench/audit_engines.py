"""The white-box one-run audit of every per-example clipping engine on its own code path: feature canaries
(``dptune.audit``, ordinary training examples of an audit model), one full-batch trial per engine and trainer.

    python bench/audit_engines.py [--canaries 16000] [--seed 0] [--epsilon 2] [--engines bookkeeping ghost hooks functorch]

At q = 1 (B = the audit basis) each step is a Gaussian mechanism on each canary's column, so the certified mechanism
is exactly μ-GDP with μ = √T/σ, as with Dirac canaries (``bench/audit_fdp.py``), and the f-DP audit's Gaussian
family is its own. Per engine: dptune's trainer at the certified ε, and the trainer with half its noise
(``noise_x0.5``, audit-only), which must be caught (a bound above the certificate). Columns: "a min", the smallest
size of a canary's clipped contribution on its column in units of C (1 = the whole clipped norm; the score uses the
exact value); "noise / σ", the std of the projected column sums of the excluded canaries over the noise the trainer
should add (σ, or σ/2 for noise_x0.5); then the bounds ("(ε, δ)" rigorous; "μ ≥" the μ-GDP bound, "GDP ε" its ε
at δ); "ideal": a simulation of the certified mechanism itself (every canary alone, a = 1, exactly σ). Every
engine runs with the same trial seed, hence the same noise: a trainer's rows agree across engines exactly when the
engines compute the same clipped sums (they do, to float rounding); the spread over noise draws is not shown here.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dptune.accounting import TrialPoint, calibrate_noise_multiplier, epsilon, trial_event
from dptune.audit import (
    FdpAudit,
    audit_epsilon,
    audit_fdp,
    draw_feature_canaries,
    feature_audit_basis,
    feature_signals,
    feature_white_box_scores,
    guess_grid,
    observed_feature_trial,
    sampling_rate,
    trial_steps,
)
from dptune.config import DatasetSpec, TrialConfig
from dptune.data import load_dataset, poisson_subsample

ROOT = Path(__file__).resolve().parent.parent
DELTA = 1e-5
ENGINES = ("bookkeeping", "ghost", "hooks", "functorch")
RESULTS = ROOT / "bench" / "results" / "audit_engines.md"


def _row(engine: str, trainer: str, scores: np.ndarray, inc: np.ndarray, cert: float, mu_cert: float,
         a_min: float | None, noise_ratio: float | None, seconds: float | None) -> str:
    ks = guess_grid(len(inc))
    steinke = audit_epsilon(scores, inc, ks=ks, delta=DELTA).epsilon
    f: FdpAudit = audit_fdp(scores, inc, ks=ks, delta=DELTA)
    verdict = ("CAUGHT: ε bound > certificate" if max(steinke, f.epsilon) > cert else
               "CAUGHT: μ bound > certified μ" if f.mu > mu_cert else "consistent")
    a = "—" if a_min is None else f"{a_min:.5f}"
    noise = "—" if noise_ratio is None else f"{noise_ratio:.4f}"
    secs = "—" if seconds is None else f"{seconds:.0f}"
    return (f"| {engine} | {trainer} | {a} | {noise} | {steinke:.3f} | {f.epsilon:.3f} | {f.mu:.3f} | "
            f"{f.gdp_epsilon:.3f} | {f.gdp_epsilon / cert:.0%} | {verdict} | {secs} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--canaries", type=int, default=16000)
    p.add_argument("--seed", type=int, default=0, help="canaries, coin flips and trial entropy (NOT PRIVATE)")
    p.add_argument("--epsilon", type=float, default=2.0, help="the certified ε the noise is calibrated to")
    p.add_argument("--epochs", type=float, default=4.0, help="T at q = 1")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--md", default=str(RESULTS))
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    t0 = time.time()
    data = poisson_subsample(load_dataset(DatasetSpec()), 0.2, seed=0)
    m = args.canaries
    rng = np.random.default_rng(args.seed)
    canaries = draw_feature_canaries(rng, canaries=m, num_classes=data.num_classes)
    inc = canaries.included
    basis = feature_audit_basis(len(data.train[1]), canaries)
    assert sampling_rate(batch_size=basis, basis=basis) == 1.0
    steps = trial_steps(epochs=args.epochs, batch_size=basis, basis=basis)
    sigma = calibrate_noise_multiplier([], sampling_rate=1.0, steps=steps, delta=DELTA, target_epsilon=args.epsilon)
    cert = epsilon([trial_event(noise_multiplier=sigma, sampling_rate=1.0, steps=steps, score_noise=None)], DELTA)
    mu_cert = math.sqrt(steps) / sigma
    point = TrialPoint(noise_multiplier=sigma, sampling_rate=1.0, steps=steps, score_noise=None)
    header = ("| engine | trainer | a min | noise / σ | Steinke ε ≥ | f-DP (ε, δ) ε ≥ | f-DP μ ≥ | GDP ε ≥ | "
              "GDP ε / certified | verdict | s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(header, flush=True)
    ideal = (inc[None, :] + rng.normal(0.0, sigma, size=(steps, m))).sum(0)  # each canary alone, a = 1, exactly σ
    lines.append(_row("—", "ideal", ideal, inc, cert, mu_cert, None, None, None))
    print(lines[-1], flush=True)
    for engine in args.engines:
        # ghost clips in one physical batch: it must hold the logical batch (B + 4√B, dptune's Poisson bound)
        physical = basis + 4 * math.isqrt(basis) + 8 if engine == "ghost" else 256
        config = TrialConfig(batch_size=basis, epochs=args.epochs, learning_rate=0.5, momentum=0.9, clipping=engine,
                             physical_batch_size=physical, score_noise=None, seed=args.seed + 7,
                             noise_multiplier=sigma)
        for bug, noise in ((None, sigma), ("noise_x0.5", sigma / 2)):
            t1 = time.time()
            obs = observed_feature_trial(config, data, canaries, bug=bug, charged_points=[point])
            if obs.result.clipping_mode != engine or obs.result.steps != steps:
                raise RuntimeError(f"ran {obs.result.clipping_mode} for {obs.result.steps} steps, not {engine}, {steps}")
            x, a = feature_signals(obs)
            scores = feature_white_box_scores(obs, noise_multiplier=sigma, sampling_rate=1.0)
            lines.append(_row(engine, bug or "dptune", scores, inc, cert, mu_cert, float(a.min()),
                              float(x[:, ~inc].std() / noise), time.time() - t1))
            print(lines[-1], flush=True)
    wall = time.time() - t0
    engines = " ".join(args.engines)
    command = (f"python bench/audit_engines.py --canaries {m} --seed {args.seed} --epsilon {args.epsilon:g} "
               f"--epochs {args.epochs:g}" + ("" if tuple(args.engines) == ENGINES else f" --engines {engines}"))
    doc = ["# The white-box one-run audit of every clipping engine (feature canaries, one full-batch trial each)", "",
           f"Command: `{command}`; wall time {wall:.0f} s on a shared 2-core CPU (1 torch thread; last column: "
           "seconds per trial, training and scoring).", "",
           (__doc__ or "").split("\n\n", 2)[2].strip(), "",
           f"Setting: digits (20 % subsample, {len(data.train[1])} real images) plus {m} feature canaries "
           f"(G = {canaries.value:g}), GN CNN (width 32), SGD (lr 0.5, momentum 0.9), C = 1, B = basis = {basis} "
           f"(q = 1), T = {steps}, σ = {sigma:.4f}, certified ε = {cert:.3f} at δ = {DELTA:g} (μ = {mu_cert:.3f}); "
           f"95 % confidence, Bonferroni over the {len(guess_grid(m))} guess pairs; seed {args.seed}.", "",
           *lines, ""]
    if args.md:
        Path(args.md).write_text("\n".join(doc))
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
