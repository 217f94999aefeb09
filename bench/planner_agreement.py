"""Does dptune's planner verdict agree with what the MNIST bench measured? (issue 13)

    python bench/planner_agreement.py [--out bench/results/planner_agreement.md]

Seconds, no training: reads the committed bench results, so the check is reproducible without the data.

1. Priors from the *first* bench run only (``bench/results/tuning_value_mnist.md``, split seeds 0-4):
   ``accuracy_spread`` = the mean over rows of the std of the 7-point oracle grid's test accuracies;
   ``loss_per_noise_doubling`` = minus the least-squares slope of the default's mean test accuracy against
   log2 of its noise multiplier across ε = 1, 2, 4 (the default's σ from dptune's own calibration).
2. dptune's planner at those priors (``min_gain`` at its default, half a point), for ε = 1, 2, 4: the scaled
   searcher as shipped (``search_spaces/mnist_scaled.yaml``, noisy-max selection) and with a Gaussian score per
   trial (the same space with ``selection: best_score``, score noise 40: mode (g)), both against the literature
   default of ``mnist.yaml``, and random search (``mnist.yaml``'s budget-split advice); also at the planner's
   default priors, for contrast.
3. The measured outcome, "beats (a)": the shipped scaled searcher's mode (m) on split seeds 16-20
   (``tuning_value_mnist_noisymax.md``); mode (g) pooled over every seed it ran on (5-9, 11-15, 16-20:
   ``tuning_value_mnist_pooled.md``); random search (b)/(d) on seeds 0-4 (``tuning_value_mnist.md``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dptune import accounting as A  # noqa: E402
from dptune._params import sampling_rate, trial_steps  # noqa: E402
from dptune.config import load_space  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FIRST, NOISY_MAX = RESULTS / "tuning_value_mnist.md", RESULTS / "tuning_value_mnist_noisymax.md"
POOLED = RESULTS / "tuning_value_mnist_pooled.md"
EPSILONS = (1.0, 2.0, 4.0)
N_TRAIN, N_VAL = 8000, 1000
DEFAULT_PRIORS = {"accuracy_spread": 0.10, "loss_per_noise_doubling": 0.15}


def grid_rows(path: Path, seeds: range) -> dict[float, list[list[float]]]:
    """Per ε, each row's oracle-grid test accuracies (%, the default first)."""
    out: dict[float, list[list[float]]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\| ([124]) \| (\d+) \| ([\d. ]+) \|", line)
        if m and int(m.group(2)) in seeds:
            out.setdefault(float(m.group(1)), []).append([float(x) for x in m.group(3).split()])
    return out


def measured(path: Path, mode: str) -> dict[float, tuple[str, str]]:
    """Per ε, (difference to (a) with CI, beats (a)) of ``mode`` from a report's summary table (a bench run's,
    8 columns, or ``bench/pooled_mnist.py``'s, 11 columns)."""
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not (re.fullmatch(r"[124]", cells[0]) and len(cells) > 1 and cells[1].startswith(f"({mode})")):
            continue
        if len(cells) == 8:
            out[float(cells[0])] = (cells[4], cells[6])
        elif len(cells) == 11:
            out[float(cells[0])] = (f"{cells[7]} ({cells[3]} rows)", cells[9])
    return out


def default_sigma(eps: float) -> float:
    d = load_space(ROOT / "search_spaces" / "mnist.yaml").default
    n = N_TRAIN + N_VAL
    return A.calibrate_noise_multiplier([], sampling_rate=sampling_rate(batch_size=d.batch_size, basis=n),
                                        steps=trial_steps(epochs=d.epochs, batch_size=d.batch_size, basis=n),
                                        delta=1e-5, target_epsilon=eps)


def fit_priors() -> tuple[dict[str, float], str]:
    rows = grid_rows(FIRST, range(5))
    spread = statistics.mean(statistics.stdev(r) for rs in rows.values() for r in rs) / 100
    x = np.array([np.log2(default_sigma(e)) for e in EPSILONS])
    y = np.array([statistics.mean(r[0] for r in rows[e]) for e in EPSILONS]) / 100
    slope = float(np.polyfit(x, y, 1)[0])
    how = (f"accuracy_spread {spread:.4f} (mean within-row std of the grid, {sum(map(len, rows.values()))} rows); "
           f"loss_per_noise_doubling {-slope:.4f} (default's accuracy {', '.join(f'{v:.1%}' for v in y)} at "
           f"sigma {', '.join(f'{2 ** v:.3f}' for v in x)})")
    return {"accuracy_spread": round(spread, 4), "loss_per_noise_doubling": round(-slope, 4)}, how


def verdicts(priors: dict[str, float]) -> dict[tuple[float, str], tuple[bool, float]]:
    mnist = load_space(ROOT / "search_spaces" / "mnist.yaml")
    scaled = load_space(ROOT / "search_spaces" / "mnist_scaled.yaml")
    gaussian = scaled.with_privacy(selection="best_score", score_noise=40.0)
    out = {}
    for eps in EPSILONS:
        for name, space in (("scaled (m)", scaled), ("scaled (g)", gaussian)):
            s = A.advise_scaled(space, N_TRAIN, target_epsilon=eps, baseline=mnist.default, **priors)
            out[(eps, name)] = (s.pays, s.proxy)
        r = A.advise(mnist, N_TRAIN, target_epsilon=eps, n_val=N_VAL, **priors)
        out[(eps, "random")] = (r.can_pay, r.best.proxy if r.best else float("nan"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "planner_agreement.md"))
    args = p.parse_args()
    priors, how = fit_priors()
    fitted, default = verdicts(priors), verdicts(DEFAULT_PRIORS)
    m, g = measured(NOISY_MAX, "m"), measured(POOLED, "g")
    b, d = measured(FIRST, "b"), measured(FIRST, "d")
    lines = ["# Planner verdict vs measured outcome on MNIST (bench/planner_agreement.py, issue 13)", "",
             "Command: `python bench/planner_agreement.py`", "",
             f"Priors fitted on the first bench run only (seeds 0-4): {how}.", "",
             "| ε | searcher | measured − (a) [95 % CI] | measured beats (a) | planner, fitted priors (proxy) "
             "| agrees | planner, default priors (proxy) | agrees |", "|---|---|---|---|---|---|---|---|"]
    agree = {}
    for eps in EPSILONS:
        for name, meas in (("scaled (m)", {"(m) seeds 16-20": m[eps]}), ("scaled (g)", {"(g) pooled": g[eps]}),
                           ("random", {"(b) seeds 0-4": b[eps], "(d) seeds 0-4": d[eps]})):
            pays = any(v[1] == "yes" for v in meas.values())
            diff = "; ".join(f"{k}: {v[0]}" for k, v in meas.items())
            beats = "; ".join(f"{v[1]}" for v in meas.values())
            cells = []
            for key, table in (("fitted", fitted), ("default", default)):
                says, proxy = table[(eps, name)]
                ok = says == pays
                agree[(key, eps, name)] = ok
                cells += [f"{'pays' if says else 'does not pay'} ({proxy:+.4f})", "yes" if ok else "**no**"]
            lines.append(f"| {eps:g} | {name} | {diff} | {beats} | " + " | ".join(cells) + " |")
    n_fit = sum(v for (k, _, _), v in agree.items() if k == "fitted")
    n_def = sum(v for (k, _, _), v in agree.items() if k == "default")
    n = len(agree) // 2
    at_1 = ", ".join(f"{name} {'agrees' if agree[('fitted', 1.0, name)] else 'DISAGREES'}"
                     for name in ("scaled (m)", "scaled (g)", "random"))
    lines += ["", f"Agreement: fitted priors {n_fit}/{n}, default priors {n_def}/{n}. At ε = 1 (the issue's check, "
              f"fitted priors): {at_1}."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
