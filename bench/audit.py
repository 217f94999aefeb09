"""Audit the privacy empirically: one-run ε lower bounds against dptune's certificates (issue "Audit the privacy
empirically").

Steinke, Nasr & Jagielski (NeurIPS 2023) audit a whole training run at once: m canaries, each included
independently with probability 1/2, ONE training run, a score per canary, guesses "in" on the highest and "out"
on the lowest scores, and the number of correct guesses turned into an ε lower bound at 95 % confidence
(``dptune.audit.epsilon_lower_bound``; the (k+, k−) pairs tried are fixed in advance and Bonferroni-corrected).
A lower bound above the certificate's ε proves that the trainer does not do what the certificate claims.

Every run is dptune's own trainer (``dptune.dpsgd.run_trial``: Poisson sampling on a fixed basis, Opacus
DPOptimizer clipping and noise, refused unless the accountant charged it) on the digits training split plus
the included canaries, with two threat models side by side:

* white-box, every intermediate model observed: "Dirac" gradient canaries (per-example gradient 10·C·e_j on a
  distinct parameter coordinate j, added before dptune clips and noises); score: the log-likelihood ratio of
  the noised steps recovered from consecutive models under the certified mechanism. Also shown: what the same
  audit gives on a simulation of the certified mechanism itself ("ideal"): what it shows for a trainer exactly
  as private as certified;
* black-box, the released model only: random-image canaries with random labels; score: minus the loss.

Settings: one DP-SGD trial at σ calibrated by dptune's accountant so its certificate reads ε = 2, 4, 8 at the
audited (q, T, δ = 1e-5); the same trial at ε = 2 with a deliberately broken trainer (``noise_x0.1``: a tenth
of the noise; ``no_clip``: no clipping; audit-only switches, ``dptune.dpsgd.AuditHooks``), which the audit must
catch (lower bound above the certificate); and a whole random search (the digits space with σ at the floor for
a search ε of 8, TNB geometric stopping so K >= 1, trials refused unless charged, the best trial by its noised
score released), certified by ``plan_search``.

    .venv/bin/python bench/audit.py --quick      # reduced run (≈ 2 min on 2 shared cores)
    .venv/bin/python bench/audit.py              # the full bench (≈ 25 min on 2 shared cores, ≤ 1 h)
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
import warnings
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from audit_report import (
    BROKEN_AT,
    DELTA,
    FULL,
    QUICK,
    Row,
    Run,
    Scale,
    markdown,
    print_row,
    summarize,
    verdict,
)

from dptune.accounting import (
    TrialPoint,
    calibrate_noise_multiplier,
    epsilon,
    plan_search,
    sampling_rate,
    sigma_floor,
    trial_event,
    trial_steps,
)
from dptune.audit import (
    Canaries,
    Observation,
    audit_basis,
    black_box_scores,
    draw_canaries,
    ideal_white_box_scores,
    observed_search,
    observed_trial,
    white_box_scores,
)
from dptune.config import DatasetSpec, SearchSpace, TrialConfig, parse_space
from dptune.data import Splits, load_dataset
from dptune.dpsgd import init_model

ROOT = Path(__file__).resolve().parents[1]  # the repository: its space files and results
DIGITS_SPACE = ROOT / "search_spaces" / "digits.yaml"
RESULTS = ROOT / "bench" / "results" / "audit.md"


def trial_config(scale: Scale, seed: int) -> TrialConfig:
    """The digits trial recipe (GN CNN, SGD momentum 0.9, C = 1), per-sample clipping (``hooks``: gradient
    canaries are added to per-example gradients), public validation (no score release in a single trial)."""
    return TrialConfig(model="gn_cnn", groups=4, batch_size=scale.batch_size, epochs=scale.epochs,
                       learning_rate=0.5, momentum=0.9, max_grad_norm=1.0, clipping="hooks",
                       physical_batch_size=256, score_noise=None, seed=seed)


def parameter_count(data: Splits, config: TrialConfig) -> int:
    return sum(p.numel() for p in init_model(config, data).parameters() if p.requires_grad)


def _canaries(scale: Scale, data: Splits, rng: np.random.Generator) -> Canaries:
    return draw_canaries(rng, gradient=scale.gradient, inputs=scale.inputs,
                         parameters=parameter_count(data, trial_config(scale, seed=0)),
                         input_shape=data.input_shape, num_classes=data.num_classes)


def _run(obs: Observation, data: Splits, canaries: Canaries, *, certified: float, q: float,
         rng: np.random.Generator, seconds: float, note: str = "") -> Run:
    sigma = obs.config.noise_multiplier
    std = obs.result.noise_std
    return Run(certified=certified, white=white_box_scores(obs, noise_multiplier=sigma, sampling_rate=q),
               ideal=ideal_white_box_scores(canaries.gradient_in, noise_multiplier=sigma, sampling_rate=q,
                                            steps=obs.result.steps, rng=rng),
               gradient_in=canaries.gradient_in, black=black_box_scores(obs, data, canaries),
               input_in=canaries.input_in, sigma=sigma, q=q, steps=obs.result.steps,
               noise_ratio=None if std is None else std / (sigma * obs.config.max_grad_norm), seconds=seconds,
               note=note)


def audit_trial(scale: Scale, data: Splits, target: float, bug: str | None, rng: np.random.Generator) -> Run:
    """One DP-SGD trial, σ calibrated so that its certificate reads ``target``, audited in one run."""
    t0 = time.perf_counter()
    canaries = _canaries(scale, data, rng)
    config = trial_config(scale, seed=int(rng.integers(2**63)))
    basis = audit_basis(len(data.train[1]), canaries)
    q = sampling_rate(batch_size=config.batch_size, basis=basis)
    steps = trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=basis)
    sigma = calibrate_noise_multiplier([], sampling_rate=q, steps=steps, delta=DELTA, target_epsilon=target)
    certified = epsilon([trial_event(noise_multiplier=sigma, sampling_rate=q, steps=steps, score_noise=None)], DELTA)
    point = TrialPoint(noise_multiplier=sigma, sampling_rate=q, steps=steps, score_noise=None)
    obs = observed_trial(config.replace(noise_multiplier=sigma), data, canaries, bug=bug, charged_points=[point])
    return _run(obs, data, canaries, certified=certified, q=q, rng=rng, seconds=time.perf_counter() - t0)


def search_space(scale: Scale, basis: int, n_train: int) -> SearchSpace:
    """The digits space (search_spaces/digits.yaml) as an audit runs it: batch choices rescaled to the audit
    basis (same q as on digits), per-sample clipping, TNB geometric stopping with the space's mean (K >= 1, so
    every search releases a model), σ searched in [floor, 1.5·floor] with the floor at a search ε of
    ``scale.search_epsilon`` (``sigma_floor``)."""
    raw: dict[str, Any] = yaml.safe_load(DIGITS_SPACE.read_text())
    raw["name"] = "digits-audit"
    raw["fixed"] = {**raw["fixed"], "clipping": "hooks", "epochs": scale.search_epochs}
    raw["space"] = dict(raw["space"])
    raw["space"]["batch_size"] = {"type": "categorical", "choices": [
        max(1, round(b * basis / n_train)) for b in raw["space"]["batch_size"]["choices"]]}
    raw["default"] = {**raw["default"], "batch_size": raw["space"]["batch_size"]["choices"][0]}
    raw["privacy"] = {**raw["privacy"], "stopping": "tnb", "eta": 1.0}
    raw["privacy"].pop("target_epsilon", None)
    space = parse_space(raw, source=None)
    floor = sigma_floor(space, basis, target_epsilon=scale.search_epsilon)
    if floor is None:
        raise SystemExit(f"no σ fits a search ε of {scale.search_epsilon}")
    raw["space"]["noise_multiplier"] = {"type": "float", "low": floor, "high": 1.5 * floor}
    raw["default"]["noise_multiplier"] = floor
    return parse_space(raw, source=None)


def audit_search(scale: Scale, data: Splits, rng: np.random.Generator) -> Run:
    """A whole random search (K trials, the best one released), audited on its release."""
    t0 = time.perf_counter()
    canaries = _canaries(scale, data, rng)
    n = len(data.train[1])
    basis = audit_basis(n, canaries)
    space = search_space(scale, basis, n)
    plan = plan_search(space, basis, compare=False)
    found = observed_search(space, plan, data, canaries, draw_seed=int(rng.integers(2**63)))
    obs = found.released
    if obs is None:  # pragma: no cover - TNB stopping draws K >= 1
        raise SystemExit("K = 0: nothing released")
    cfg = obs.config
    q = sampling_rate(batch_size=cfg.batch_size, basis=basis)
    alone = epsilon([trial_event(noise_multiplier=cfg.noise_multiplier, sampling_rate=q, steps=obs.result.steps,
                                 score_noise=None)], DELTA)
    note = (f"K = {found.k}, released trial {found.released_index} (B {cfg.batch_size}, lr {cfg.learning_rate:.3g}, "
            f"σ {cfg.noise_multiplier:.3g}, T {obs.result.steps}; that trial alone: ε {alone:.2f})")
    return _run(obs, data, canaries, certified=plan.search_epsilon, q=q, rng=rng,
                seconds=time.perf_counter() - t0, note=note)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced run: fewer canaries, shorter trials")
    p.add_argument("--seed", default="0", help="seed of canaries, coin flips and trial entropy (NOT PRIVATE: a "
                   "bench), or 'os' for OS entropy")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=0, help="runs per setting (default: 5 full, 1 --quick)")
    p.add_argument("--only", default="", help="comma-separated subset of: trials, broken, search")
    p.add_argument("--md", default=str(RESULTS), help="write the results table here ('' = don't)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus hooks, harmless here
    scale = QUICK if args.quick else FULL
    if args.repeats:
        scale = replace(scale, repeats=args.repeats)
    seed = secrets.randbits(128) if args.seed == "os" else int(args.seed)
    parts = set(args.only.split(",")) if args.only else {"trials", "broken", "search"}
    data = load_dataset(DatasetSpec())
    t0 = time.perf_counter()
    jobs: list[tuple[str, str, float | None, str | None]] = []
    if "trials" in parts:
        jobs += [(f"one trial, ε {e:g}", "dptune", e, None) for e in scale.epsilons]
    if "broken" in parts:
        jobs += [(f"one trial, ε {BROKEN_AT:g}", bug, BROKEN_AT, bug) for bug in ("noise_x0.1", "no_clip")]
    if "search" in parts:
        jobs.append(("search", "dptune", None, None))
    rows: list[Row] = []
    for setting, trainer, target, bug in jobs:
        runs = []
        for rep in range(scale.repeats):
            key = zlib.crc32(f"{setting}|{trainer}".encode())
            sub = np.random.default_rng([seed, key, rep])  # each run its own stream: reproducible alone
            runs.append(audit_search(scale, data, sub) if target is None else audit_trial(scale, data, target, bug, sub))
        if target is None:
            setting = f"search, TNB geometric (mean 2), ε {runs[0].certified:.2f}"
        row = summarize(setting, trainer, runs)
        print_row(row)
        rows.append(row)
    wall = time.perf_counter() - t0
    command = "python bench/audit.py" + (" --quick" if args.quick else "") + (
        f" --seed {args.seed}" if args.seed != "0" else "") + (f" --threads {args.threads}" if args.threads != 1 else "") + (
        f" --only {args.only}" if args.only else "") + (f" --repeats {args.repeats}" if args.repeats else "")
    if args.md:
        Path(args.md).write_text(markdown(rows, scale, args, wall, command))
        print(f"wrote {args.md}")
    print(f"wall time {wall / 60:.1f} min")
    bad = [r for r in rows if r.trainer == "dptune" and verdict(r) != "consistent"]
    missed = [r for r in rows if r.trainer != "dptune" and verdict(r) == "consistent"]
    return 1 if bad or missed else 0


if __name__ == "__main__":
    sys.exit(main())
