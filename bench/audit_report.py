"""The audit bench's pooling and report (``bench/audit.py`` runs the audits): the runs' canaries pooled into one
audit per setting, the verdict against the certificate, the markdown table of bench/results/audit.md."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from dptune.audit import Audit, FdpAudit, audit_epsilon, audit_fdp, guess_grid

DELTA = 1e-5
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Scale:
    """How big each audited run is. ``batch_size``: the single trial's expected batch (on the audit basis
    n + m/2, which the canaries enlarge); ``search_epochs``: the search trials' epochs (the digits space's
    batch choices are rescaled to keep its sampling rates); ``repeats``: independent runs per setting, whose
    canaries are pooled into one audit (valid: each canary is in exactly one run, and a run is (ε, δ)-DP
    with respect to each of its canaries whatever the other runs do)."""

    gradient: int  # Dirac canaries per run
    inputs: int  # input canaries per run
    batch_size: int
    epochs: float
    search_epochs: float
    repeats: int
    epsilons: tuple[float, ...] = (2.0, 4.0, 8.0)
    search_epsilon: float = 8.0


FULL = Scale(gradient=5000, inputs=1000, batch_size=1024, epochs=10, search_epochs=15, repeats=5)
QUICK = Scale(gradient=1000, inputs=500, batch_size=512, epochs=5, search_epochs=5, repeats=1)
BROKEN_AT = 2.0  # the certificate the broken trainers claim
# Full bench, estimated from a timed full-scale run of one single-trial setting (32 s on the shared 2-core
# machine, torch 1 thread): 25 single-trial runs (≈ 14 min) + 5 searches of E[K] = 2 trials (≈ 8 min).
FULL_MINUTES = 25


@dataclass
class Run:
    """One audited training run: each canary's score and inclusion bit, per threat model."""

    certified: float
    white: np.ndarray
    ideal: np.ndarray  # the same audit on a simulation of the certified mechanism (same inclusion bits)
    gradient_in: np.ndarray
    black: np.ndarray
    input_in: np.ndarray
    sigma: float
    q: float
    steps: int
    noise_ratio: float | None  # measured noise std / (σ·C) of the released trial
    seconds: float
    note: str = ""


@dataclass
class Row:
    setting: str
    trainer: str
    runs: list[Run]
    white: Audit  # the runs' canaries pooled into one audit
    ideal: Audit
    black: Audit
    per_run_white: list[float]
    white_fdp: FdpAudit  # the same guesses under the f-DP bound (Mahloujifar, Melis & Chaudhuri 2024)
    ideal_fdp: FdpAudit


def pooled(runs: list[Run], scores: str, included: str) -> Audit:
    s = np.concatenate([getattr(r, scores) for r in runs])
    inc = np.concatenate([getattr(r, included) for r in runs])
    return audit_epsilon(s, inc, ks=guess_grid(len(s)), delta=DELTA, confidence=CONFIDENCE)


def pooled_fdp(runs: list[Run], scores: str, included: str) -> FdpAudit:
    s = np.concatenate([getattr(r, scores) for r in runs])
    inc = np.concatenate([getattr(r, included) for r in runs])
    return audit_fdp(s, inc, ks=guess_grid(len(s)), delta=DELTA, confidence=CONFIDENCE)


def summarize(setting: str, trainer: str, runs: list[Run]) -> Row:
    per_run = [audit_epsilon(r.white, r.gradient_in, ks=guess_grid(len(r.white)), delta=DELTA).epsilon for r in runs]
    return Row(setting, trainer, runs, white=pooled(runs, "white", "gradient_in"),
               ideal=pooled(runs, "ideal", "gradient_in"), black=pooled(runs, "black", "input_in"),
               per_run_white=per_run, white_fdp=pooled_fdp(runs, "white", "gradient_in"),
               ideal_fdp=pooled_fdp(runs, "ideal", "gradient_in"))


def _g(a: Audit) -> str:
    return f"{a.guesses.correct}/{a.guesses.guesses}"


def _range(xs: list[float]) -> str:
    return f"{xs[0]:.2f}" if len(xs) == 1 else f"{min(xs):.2f}–{max(xs):.2f}"


def _fmt(xs: list[float], digits: int) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.{digits}f}" if round(lo, digits) == round(hi, digits) else f"{lo:.{digits}f}–{hi:.{digits}f}"


def certified(row: Row) -> float:
    return min(r.certified for r in row.runs)


def verdict(row: Row) -> str:
    best = max(row.white.epsilon, row.black.epsilon, row.white_fdp.epsilon)  # rigorous bounds only
    return "CAUGHT: lower bound > certificate" if best > certified(row) else "consistent"


def print_row(row: Row) -> None:
    c = certified(row)
    noise = [r.noise_ratio for r in row.runs if r.noise_ratio is not None]
    print(f"{row.setting:<40} {row.trainer:<11} certified ε {c:6.3f} | white-box ≥ {row.white.epsilon:5.2f} "
          f"({_g(row.white):>11}; ×{row.white.epsilon / c:.2f} of the certificate; per run {_range(row.per_run_white)})"
          f" ideal ≥ {row.ideal.epsilon:5.2f} | f-DP white-box ≥ {row.white_fdp.epsilon:5.2f} (GDP "
          f"{row.white_fdp.gdp_epsilon:5.2f}), ideal {row.ideal_fdp.epsilon:5.2f} (GDP {row.ideal_fdp.gdp_epsilon:5.2f})"
          f" | black-box ≥ {row.black.epsilon:5.2f} ({_g(row.black)}) | noise ×"
          f"{_fmt(noise, 3) if noise else '–'} | {sum(r.seconds for r in row.runs):5.0f} s | {verdict(row)}", flush=True)
    for r in row.runs:
        if r.note:
            print(f"    {r.note}", flush=True)


def markdown(rows: list[Row], scale: Scale, args: argparse.Namespace, wall: float, command: str) -> str:
    status = ("REDUCED run (`--quick`): fewer canaries and shorter trials than the full bench (sizes at the end)"
              if args.quick else "full bench")
    lines = [
        "# Audited: empirical ε lower bounds against dptune's certificates",
        "",
        f"Status: {status}; wall time {wall / 60:.1f} min on a shared 2-core CPU machine (torch threads "
        f"{args.threads}).",
        "",
        f"Command: `{command}` (from the repository root; results are reproducible for a given `--seed`).",
        "",
        "**Method.** The one-run audit of Steinke, Nasr & Jagielski (NeurIPS 2023). Each of m canaries is included "
        "in the training data independently with probability 1/2; ONE training run with dptune's own trainer "
        "(`dptune.dpsgd.run_trial`: Poisson sampling, Opacus clipping and noise, refused unless the accountant "
        "charged its (σ, q, T)); a score per canary; guesses \"in\" on the k+ highest and \"out\" on the k− lowest "
        "scores; the number of correct guesses turned into an ε lower bound at 95 % confidence "
        "(`dptune.audit.epsilon_lower_bound`: their tail bound with δ = 1e-5, Appendix D procedure; it reproduces the "
        "paper's examples 0.702, 0.699, 0.673 and 2.675, tests/test_audit.py). The (k+, k−) "
        "pairs tried are fixed in advance (`dptune.audit.guess_grid`) and Bonferroni-corrected, so the best one "
        f"may be reported. {scale.repeats} independent run(s) per setting, their canaries pooled into one audit "
        "(each canary is in exactly one run). A lower bound above the certified ε proves the trainer is less "
        "private than certified.",
        "",
        f"- **white-box** (every intermediate model observed): {scale.gradient} \"Dirac\" gradient canaries per run "
        "(per-example gradient 10·C on one parameter coordinate, added before dptune clips and noises); score: "
        "log-likelihood ratio, under the certified mechanism, of each step's noised gradient recovered from "
        "consecutive models. **ideal**: the same audit on a simulation of the certified mechanism itself (each "
        "canary alone, exactly σ, q, T): what this audit can show for a trainer exactly as private as certified.",
        f"- **black-box** (released model only): {scale.inputs} random-image canaries with random labels per run; "
        "score: minus the canary's loss.",
        f"- **Data and trial**: digits training split (1,257 real images) plus the included canaries; q = B / (n + "
        f"m/2), fixed before the coin flips. GN CNN, SGD momentum 0.9, lr 0.5, C = 1, B {scale.batch_size}, "
        f"{scale.epochs:g} epochs, per-sample clipping (`hooks`); σ from dptune's accountant for ε = 2, 4, 8 at δ = "
        "1e-5.",
        "- **Broken trainers** (audit-only switch `AuditHooks(bug=…)`, unreachable from a search space, a release "
        f"or a CLI): `noise_x0.1` adds a tenth of the noise, `no_clip` does not clip; both claim the ε {BROKEN_AT:g} "
        "certificate. \"noise ×\": the noise std the trial measured on its own tensors, over σ·C.",
        f"- **Search**: search_spaces/digits.yaml as an audit runs it (batch choices rescaled to the audit basis, "
        f"{scale.search_epochs:g} epochs, per-sample clipping, TNB geometric stopping with mean 2 so K ≥ 1, σ in "
        f"[floor, 1.5·floor] with the floor at a search ε of {scale.search_epsilon:g}); the best trial by its "
        "noised validation score is released and audited (white-box: all its intermediate models, which the "
        "trial's DP-SGD event covers; ideal: a simulation of that trial alone); certificate: `plan_search` (worst "
        "case over the space, Papernot–Steinke random stopping).",
        "",
        "**f-DP columns.** The same guesses under the f-DP bound of Mahloujifar, Melis & Chaudhuri (\"Auditing "
        "f-Differential Privacy in One Run\", 2024; `dptune.audit.audit_fdp`): \"(ε, δ)\" rejects every (ε', δ)-DP "
        "claim below it (rigorous, like the Steinke column); \"GDP\" is the ε at δ of the largest μ-GDP claim "
        "rejected, a lower bound for mechanisms with a Gaussian tradeoff curve (DP-SGD's is close to one).",
        "",
        "| setting | trainer | certified ε | white-box ε ≥ (correct/guesses) | per run | ideal white-box ε ≥ | "
        "f-DP white-box ε ≥ (ε, δ) / GDP | f-DP ideal (ε, δ) / GDP | "
        "black-box ε ≥ (correct/guesses) | σ | q | T | noise × | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        noise = [x.noise_ratio for x in r.runs if x.noise_ratio is not None]
        lines.append(
            f"| {r.setting} | {r.trainer} | {certified(r):.3f} | {r.white.epsilon:.2f} ({_g(r.white)}) | "
            f"{_range(r.per_run_white)} | {r.ideal.epsilon:.2f} | {r.white_fdp.epsilon:.2f} / "
            f"{r.white_fdp.gdp_epsilon:.2f} | {r.ideal_fdp.epsilon:.2f} / {r.ideal_fdp.gdp_epsilon:.2f} | "
            f"{r.black.epsilon:.2f} ({_g(r.black)}) | "
            f"{_fmt([x.sigma for x in r.runs], 3)} | {_fmt([x.q for x in r.runs], 4)} | "
            f"{_fmt([float(x.steps) for x in r.runs], 0)} | {_fmt(noise, 3) if noise else '–'} | {verdict(r)} |")
    notes = [(r.setting, x.note) for r in rows for x in r.runs if x.note]
    if notes:
        lines += ["", *[f"- {s}: {n}" for s, n in notes]]
    real = [r for r in rows if r.trainer == "dptune"]
    broken = [r for r in rows if r.trainer != "dptune"]
    reading = []
    if real:
        ok = all(verdict(r) == "consistent" for r in real)
        reading.append(("dptune's trainer stays below its certificate in every setting and both threat models"
                        if ok else "**dptune's trainer is CAUGHT in: " + ", ".join(
                            r.setting for r in real if verdict(r) != "consistent") + "**") + ".")
        ratios = ", ".join(f"{r.white.epsilon:.2f} vs {r.ideal.epsilon:.2f}" for r in real)
        reading.append("One-run audits are loose by construction: each canary yields one bit, and with a few "
                       "thousand canaries the bound saturates far below large certificates. What matters is the "
                       "comparison with the \"ideal\" column, the same audit of a simulation of the certified "
                       f"mechanism itself (white-box vs ideal: {ratios}; a one-run audit varies by a few tenths from "
                       "run to run, see the per-run column when a setting has several runs). Where they are of one "
                       "size, dptune's trainer leaks no more than the certified mechanism as far as this audit can "
                       "resolve, and the gap to the certificate is the method's, not the trainer's. A black-box "
                       "audit of the released model alone is far weaker still.")
    if broken:
        caught = [r for r in broken if verdict(r) != "consistent"]
        reading.append(f"{len(caught)} of {len(broken)} deliberately broken trainers are caught (lower bound above "
                       "the ε they claim): " + ", ".join(f"{r.trainer} {r.white.epsilon:.2f} > {certified(r):.2f}"
                                                         for r in caught) + ".")
    lines += ["", "**Reading.** " + " ".join(reading), ""]
    if args.quick:
        lines += [
            "**Reduced vs full.** This is the reduced run; the full bench (`python bench/audit.py`, expected "
            f"≈ {FULL_MINUTES} min on this machine, at most 1 h) differs only in size:",
            "",
            "| | reduced (`--quick`) | full |",
            "|---|---|---|",
            *[f"| {name} | {getattr(scale, f)} | {getattr(FULL, f)} |" for name, f in (
                ("Dirac canaries per run", "gradient"), ("input canaries per run", "inputs"),
                ("single-trial B", "batch_size"), ("single-trial epochs", "epochs"),
                ("search trial epochs", "search_epochs"), ("runs per setting (pooled)", "repeats"))],
            "",
        ]
    return "\n".join(lines)


