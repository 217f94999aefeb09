"""Does tuning pay? Paired-seed evaluation of any searcher against a baseline on any space, at the same total ε.

One row per (total ε, split seed s): every mode runs on split s of the space's data with the same final-training
seed and draws (paired), and is compared with the baseline (a) trained once with the whole ε; with ``--grid``,
also with the oracle (o), the best of a grid scored on the test split (not private). The data (dataset, split
sizes, path), model, fixed settings and δ come from the space file. Modes (``harness/``, one registry):

  a2, b, c, d     issue 7 (and b, d on MNIST in issue 13): the space's default; random search at the σ floor +
                  final training; the whole budget to the search; the search on a subsample (harness/fixed_sigma.py)
  s, n (+ f)      issue 13: Panda et al.'s linear scaling rule; the noise-scaled rule (harness/scaled_rules.py)
  search          the --space's own search as `dptune search` runs it, then the final run `dptune train` trains
  R, R2-R5, T, T2-T5, S, A  issue 21: the MNIST spaces' searches (mnist.yaml and mnist_tpe.yaml: first to fourth
                  and shipped fifth version; mnist_scaled.yaml, mnist_alc.yaml), each a space file beside --space
                  (harness/searches.py)
  m, g            issue 13: the lr-only scaled searcher with its noisy max, and with a Gaussian score per trial

Run from the repository root (dptune importable: the editable install, or PYTHONPATH=.):

    python bench/tuning_value.py --quick                 # smoke check: digits, 1 epoch, ε 4, one row (not a result)
    python bench/tuning_value.py --space search_spaces/digits_tuning_value.yaml --modes a2,b,c,d --seeds 0-4 \\
        --epsilons 2,4,1 --out bench/results/tuning_value.md                      # issue 7 (~35 min on 2 cores)
    python bench/tuning_value.py --space search_spaces/mnist.yaml --modes R3,T3,S --seeds 65-68 --epsilons 1,2,4 \\
        --grid 256:0.4,256:1.6,1024:3.2 --verdicts --out bench/results/tuning_value_profile_fresh11.md   # issue 21
    python bench/tuning_value.py --space search_spaces/mnist.yaml --modes T,S --seeds 21-24,29-32 \\
        --grid 256:0.4,256:1.6,1024:3.2 --from-json A.json,B.json --out P.md   # pool earlier records, no training

docs/results.md maps every command of the benches this replaced to its command here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from harness.context import BenchSpec, bench, parse_grid, parse_seeds
from harness.report import Run, report
from harness.runner import Cells, grid_tasks, load_modes, load_records, run_tasks, save_records

DIGITS = "search_spaces/digits_tuning_value.yaml"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(__doc__ or "")[
                                    (__doc__ or "").index("One row"):])
    p.add_argument("--space", default=DIGITS, help=f"the space file: data, model, fixed settings (default {DIGITS})")
    p.add_argument("--baseline", default="planner", help="mode (a): planner (the space's planner.baseline over its "
                   "default), default (its declared default) or another space file on the same data (its default)")
    p.add_argument("--modes", default="a2,b,c,d", help="comma-separated modes beside (a) (default: issue 7's)")
    p.add_argument("--seeds", default="0-4", help="split seeds, e.g. 0-4 or 21-24,29-32")
    p.add_argument("--epsilons", default="2,4,1", help="total ε values, in the order they run")
    p.add_argument("--grid", default="", help="the oracle's (B, lr) points beside (a), e.g. 256:0.4,1024:3.2")
    p.add_argument("--means", default="1.5,2,3", help="mean trial counts the planner's advise may pick (b, c, d)")
    p.add_argument("--fractions", default="0.5,0.25", help="subsample fractions mode d prices")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (tasks run in parallel)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (2 shared cores: 1)")
    p.add_argument("--quick", action="store_true", help="smoke check: the first seed, ε 4, 1 epoch (not a result)")
    p.add_argument("--out", help="the report (.md; the records go to the .json beside it); default "
                   "bench/results/tuning_value_<space>.md (--quick: runs/bench/)")
    p.add_argument("--resume", help="a .json this harness wrote: keep its records, run only the missing tasks")
    p.add_argument("--from-json", help="comma-separated .json records (this harness's or the benches it replaced): "
                   "the report of their rows for --seeds/--epsilons, with the planner's verdicts; no training")
    p.add_argument("--verdicts", action="store_true", help="add the planner's verdicts for the searches run")
    args = p.parse_args(argv)
    args.command = " ".join(["python", "bench/tuning_value.py", *argv])
    if args.quick:
        args.seeds, args.epsilons = args.seeds.split(",")[0].split("-")[0], "4"
    if args.out is None:  # a smoke check is not a result: it goes to runs/ (git-ignored)
        where = "runs/bench" if args.quick else "bench/results"
        args.out = f"{where}/tuning_value_{Path(args.space).stem}{'.quick' if args.quick else ''}.md"
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    spec = BenchSpec(space=args.space, baseline=args.baseline, grid=parse_grid(args.grid),
                     epochs=1.0 if args.quick else None, means=_floats(args.means), fractions=_floats(args.fractions))
    modes = load_modes()
    tasks = [t for t in args.modes.split(",") if t]
    unknown = sorted(set(tasks) - set(modes))
    if unknown:
        print(f"--modes: unknown {unknown}; choose from {','.join(modes)}", file=sys.stderr)
        return 2
    path = bench(spec).space.dataset.path
    if path and not Path(path).exists():
        print(f"{path} is not here: this space's data is missing (MNIST: the real test split, see the space file)",
              file=sys.stderr)
        return 2
    b = bench(spec)
    epsilons = list(_floats(args.epsilons))
    rows = [(eps, s) for eps in epsilons for s in parse_seeds(args.seeds)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(b, args.command, tasks, epsilons, rows, jobs=args.jobs)
    if args.from_json:  # the rows as they ran; only the report is recomputed
        from harness.searches import verdicts

        cells = load_records(args.from_json.split(","), rows)
        run.verdicts = verdicts(b, tasks, epsilons)
        return _write(out, run, cells, save=False)
    t0 = time.time()
    run.plans = {(t, eps): modes[t].plan(b, eps) for t in tasks for eps in epsilons}
    if args.verdicts:
        from harness.searches import verdicts

        run.verdicts = verdicts(b, tasks, epsilons)
    cells: Cells = load_records([args.resume], rows) if args.resume else {}
    order = [*tasks, *grid_tasks(spec)]  # the long tuned tasks first
    calls: list[tuple[Any, ...]] = [(spec, t, run.plans.get((t, eps)), eps, s) for eps, s in rows for t in order
                                    if t not in cells.get((eps, s), {})]

    def save() -> None:
        run.elapsed = time.time() - t0
        _write(out, run, cells, save=True, echo=False)

    run_tasks(calls, args.jobs, args.threads, cells, save)
    run.elapsed = time.time() - t0
    return _write(out, run, cells, save=True)


def _write(out: Path, run: Run, cells: Cells, *, save: bool, echo: bool = True) -> int:
    text = report(run, cells)
    out.write_text(text)
    if save:
        save_records(out.with_suffix(".json"), cells)
    if echo:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
