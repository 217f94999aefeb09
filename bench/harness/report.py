"""The harness's markdown report: the privacy split per ε, test accuracy paired against the baseline (a) with the
share of the oracle gap closed, one line per row, and the planner's verdicts against the measured sign."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.context import Bench
from harness.modes import MODES, measured
from harness.runner import Cells
from harness.scheduled import hardware_table
from harness.stats import gap_share, paired_stats, significance

TITLES = {"a": "(a) baseline, whole ε", "o": "(o) oracle grid, test-scored (not private)"}
NOTE = ("Every final run trains on train ∪ validation with σ calibrated (``dptune.accounting.calibrate_final``, "
        "as ``dptune train --target-epsilon --train-on-validation``) so that everything the mode ran composed with "
        "it costs at most the total ε, asserted per row; test accuracy is the usual non-private held-out "
        "evaluation. Trials run in-process (``dptune.dpsgd.run_trial``), each in the worker of its task, with "
        "dptune's own draw (``make_draw``, the secret draw seed replaced by the row's: NOT PRIVATE, a bench) and "
        "accounting. Rows are split seeds, paired: the same split, final-training seed and draws in every mode.")


@dataclass
class Run:
    """What the report says about: the bench, the command, the modes run (task names), ε order, rows."""

    bench: Bench
    command: str
    tasks: list[str]
    epsilons: list[float]
    rows: list[tuple[float, int]]
    plans: dict[tuple[str, float], Any] = field(default_factory=dict)
    elapsed: float = 0.0
    jobs: int = 1
    verdicts: dict[tuple[str, float], Any] | None = None

    @property
    def modes(self) -> list[str]:
        """Reported modes: a, o (with a grid), then each task's."""
        return ["a", *(["o"] if self.bench.spec.grid else []), *(m for t in self.tasks for m in MODES[t].reports)]


def title(mode: str) -> str:
    return TITLES.get(mode) or next(t.titles[mode] for t in MODES.values() if mode in t.titles)


def values(cell: dict[str, dict[str, Any]], grid: int) -> dict[str, float] | None:
    """Per row: (a) = grid point 0, (o) = the best grid point on test, each tuned mode run; None without (a)/(o)."""
    if any(f"grid{i}" not in cell for i in range(grid + 1)):
        return None
    points = [cell[f"grid{i}"]["test"] for i in range(grid + 1)]
    out = {"a": points[0], "o": max(points)}
    for task, r in cell.items():
        if task in MODES:
            out.update({m: measured(r, m)["test"] for m in MODES[task].reports})
    return out


def _seeds(seeds: list[int]) -> str:
    runs, start = [], seeds[0]
    for a, b in zip(seeds, [*seeds[1:], None]):
        if b != a + 1:
            runs.append(f"{start}–{a}" if a != start else f"{a}")
            start = b  # type: ignore[assignment]
    return ", ".join(runs)


def _rng(v: list[float], digits: int = 3) -> str:
    if not v:
        return "–"
    return f"{min(v):.{digits}f}" if max(v) - min(v) < 0.5 * 10 ** -digits else f"{min(v):.{digits}f}–{max(v):.{digits}f}"


def privacy_table(run: Run, cells: Cells) -> list[str]:
    lines = ["## Privacy per ε (every row's composed total asserted ≤ ε)", "",
             "| ε | mode | plan | trial σ | search ε | final σ (rows) | final ε alone | composed total (max) |",
             "|---|---|---|---|---|---|---|---|"]
    grid = len(run.bench.spec.grid)
    for eps in run.epsilons:
        rows = [c for (e, _), c in sorted(cells.items()) if e == eps]
        pts = [c[f"grid{i}"] for c in rows for i in range(grid + 1) if f"grid{i}" in c]
        base = [c["grid0"] for c in rows if "grid0" in c]
        lines.append(f"| {eps:g} | a{' / o' if grid else ''} | baseline{', grid' if grid else ''}, no search | – | 0 | "
                     f"{_rng([r['sigma_final'] for r in base])} (a) | {_rng([r['eps_final'] for r in base])} | "
                     f"{_rng([r['eps_total'] for r in pts], 4)} |")
        for task in run.tasks:
            recs = [c[task] for c in rows if task in c]
            sub = [measured(r, m) for r in recs for m in MODES[task].reports]
            plan, sigma, search = MODES[task].privacy(run.bench, eps, run.plans.get((task, eps)), recs)
            finals = [r for r in sub if r.get("eps_final", 0) > 0]
            lines.append(f"| {eps:g} | {task} | {plan} | {sigma} | {search} | "
                         f"{_rng([r['sigma_final'] for r in finals]) if finals else '–'} | "
                         f"{_rng([r['eps_final'] for r in finals]) if finals else '0'} | "
                         f"{max((r['eps_total'] for r in sub), default=float('nan')):.4f} |")
    return lines


def accuracy_table(run: Run, cells: Cells) -> list[str]:
    lines = ["## Test accuracy, paired difference to (a), share of the oracle gap closed", "",
             "| ε | mode | seeds | rows | test acc. % | − (a) [95 % CI] | paired t p | beats (a) | share of gap [95 % CI] |",
             "|---|---|---|---|---|---|---|---|---|"]
    grid = len(run.bench.spec.grid)
    for eps in run.epsilons:
        done = [(s, values(c, grid)) for (e, s), c in sorted(cells.items()) if e == eps]
        for m in run.modes:
            rows = [(s, v) for s, v in done if v is not None and m in v]
            if not rows:
                continue
            col = {k: np.array([v[k] for _, v in rows]) for k in ("a", "o", m)}
            v = col[m]
            head = f"| {eps:g} | {title(m)} | {_seeds([s for s, _ in rows])} | {len(v)} | {100 * v.mean():.1f}" + (
                f" ± {100 * v.std(ddof=1):.1f}" if len(v) > 1 else "")
            if m == "a":
                lines.append(f"{head} | – | – | – | {'0' if grid else '–'} |")
                continue
            if len(v) < 2:
                lines.append(f"{head} | {100 * float(v[0] - col['a'][0]):+.1f} | – | – | – |")
                continue
            mean, lo, hi, p = paired_stats(v - col["a"])
            share = "–"
            if grid and m != "o":
                sh, slo, shi = gap_share(v, col["a"], col["o"])
                share = f"{sh:.2f} [{slo:.2f}, {shi:.2f}]"
            elif m == "o":
                share = "1"
            lines.append(f"{head} | {100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {p:.3g} | "
                         f"{significance(lo, hi, p)} | {share} |")
        # issue 21: are the whole-space searches worse than the scaled searcher, lr-only (m) or B × lr (S)?
        for ref in [r for r in ("m", "S") if r in run.modes]:
            for m in [m for m in ("R", "R2", "R3", "R4", "R5", "T", "T2", "T3", "T4", "T5", "S") if m in run.modes and m != ref]:
                both = [v for _, v in done if v is not None and m in v and ref in v]
                if len(both) > 1:
                    mean, lo, hi, p = paired_stats(np.array([v[m] - v[ref] for v in both]))
                    worse = "worse" if hi < 0 and p < 0.05 else "not worse"
                    lines.append(f"| {eps:g} | ({m}) − ({ref}) | – | {len(both)} | – | {100 * mean:+.1f} "
                                 f"[{100 * lo:+.1f}, {100 * hi:+.1f}] | {p:.3g} | {worse} | – |")
    return lines


def row_table(run: Run, cells: Cells) -> list[str]:
    grid = len(run.bench.spec.grid)
    heads = ["grid: test % of (a), then the oracle's points" if grid else "(a) test %", *run.tasks]
    lines = ["## Per row (each mode: K drawn, released config → test %)", "",
             "| ε | seed | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for (eps, seed), c in sorted(cells.items(), key=lambda kv: (run.epsilons.index(kv[0][0])
                                                                 if kv[0][0] in run.epsilons else 99, kv[0][1])):
        pts = " ".join(f"{100 * c[f'grid{i}']['test']:.1f}" if f"grid{i}" in c else "…" for i in range(grid + 1))
        cols = [MODES[t].cell(c[t]) if t in c else "…" for t in run.tasks]
        lines.append(f"| {eps:g} | {seed} | {pts} | " + " | ".join(cols) + " |")
    return lines


def verdict_table(run: Run, cells: Cells) -> list[str]:
    if not run.verdicts:
        return []
    lines = ["## The planner's verdict against the measured sign (mean difference to (a))", "",
             "Two readings: by the sign of the mean difference (the verdict is right when it says \"pays\" and the "
             "mean gain is > 0), and by significance (right when it says \"pays\" exactly where the search beats "
             "(a): CI above 0 and p < 0.05, as in the accuracy table).", "",
             "| ε | search | verdict (proxy) | measured − (a) | agrees (sign) | beats (a) | agrees (significance) |",
             "|---|---|---|---|---|---|---|"]
    agree = total = agree_sig = 0
    grid = len(run.bench.spec.grid)
    for (m, eps), a in run.verdicts.items():
        rows = [v for (e, _), c in sorted(cells.items()) if e == eps and (v := values(c, grid)) and m in v]
        why = f"{a.proxy:+.4f}" if a.rehearsed is None else f"rehearsed {a.rehearsed:+.4f}" + (
            f" ± {a.rehearsed_se:.4f}" if a.rehearsed_se else "")
        said = f"{'pays' if a.pays else 'does not pay'} ({why})"
        if not rows:
            lines.append(f"| {eps:g} | {m} | {said} | – | – | – | – |")
            continue
        diffs = np.array([r[m] - r["a"] for r in rows])
        diff = float(diffs.mean())
        ok = (diff > 0) == a.pays
        beats = significance(*paired_stats(diffs)[1:]) if len(diffs) > 1 else "–"
        ok_sig = (beats == "yes") == a.pays
        agree, total, agree_sig = agree + ok, total + 1, agree_sig + (ok_sig and beats != "–")
        lines.append(f"| {eps:g} | {m} | {said} | {100 * diff:+.1f} ({len(rows)} rows) | {'yes' if ok else '**no**'} "
                     f"| {beats} | {'–' if beats == '–' else ('yes' if ok_sig else '**no**')} |")
    return [*lines, "", f"Agreement: {agree} of {total} cells with rows by sign, {agree_sig} by significance."]


def report(run: Run, cells: Cells) -> str:
    b = run.bench
    d = b.space.dataset
    grid = len(b.spec.grid)
    complete = sum(1 for k in run.rows if (c := cells.get(k)) and all(t in c for t in run.tasks)
                   and values(c, grid) is not None)
    base = b.baseline
    status = "complete" if complete == len(run.rows) else f"PARTIAL: {complete}/{len(run.rows)} rows"
    lines = [f"# Does tuning pay? {b.space.name} (bench/tuning_value.py)", "",
             f"Status: {status}" + (f"; wall time {run.elapsed / 60:.1f} min ({run.jobs} workers)" if run.elapsed
                                    else " (report from records)") + ".", "",
             f"Command: `{run.command}`", "",
             f"Space `{b.spec.space}`: {d.name}, train {b.n_train:,} / validation {b.n_val:,} / test {d.test_size:,} "
             f"per split seed, model {base.model}, δ = {b.delta:g}. Baseline (a) (`--baseline {b.spec.baseline}`): "
             f"B {base.batch_size}, lr {base.learning_rate:g}, {base.epochs:g} epochs, groups {base.groups}, trained "
             "once with the whole ε." + (" Oracle (o): the best of (a) and the grid (B, lr) "
                                         f"{', '.join(f'{x:g}:{y:g}' for x, y in b.spec.grid)}, each trained once "
                                         "with the whole ε and scored on the test split." if grid else ""), "",
             NOTE, "", *(f"- {MODES[t].doc}" for t in run.tasks), "",
             *privacy_table(run, cells), "", *accuracy_table(run, cells), "", *hardware_table(run.modes, cells), "",
             *row_table(run, cells), ""]
    if run.verdicts:
        lines += [*verdict_table(run, cells), ""]
    lines += ["Beats (a) = 95 % bootstrap CI of the paired mean difference excludes 0 and paired t-test p < 0.05. "
              "Share of gap = (mean tuned − mean a) / (mean o − mean a), CI by a paired bootstrap over rows.", ""]
    return "\n".join(lines)
