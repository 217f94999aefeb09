"""The verdict's rehearsal as a simulation over many secret draws (issue 21): the search's gain on the public proxy
without the noise of a handful of draws.

``bench/proxy_priors.py --rehearse`` runs one whole search per proxy seed and ε, so its mean over 16 seeds is an
average of 16 draws of K and of the configs, and random search's gain is heavy-tailed (a rare under-trained
release decides it): its standard error was 0.6-1.2 points, and its sign missed MNIST's at every ε on fresh
seeds 53-56. Here every reachable config is trained once on the proxy instead, at the target's q and update noise
σ·C/B (``harness.proxy.carried``):

* the *grid*: every combination of the space's categorical values, and ``--lrs`` points log-spaced over its one
  float dimension (the final run's lr L); a searcher with fixed candidates (scaled) has exactly those;
* each grid point twice: as a trial (the space's σ_c(B, E) and transferred lr, ``plan_transfer``) giving its raw
  validation accuracy, and as the final run it releases (σ_f, lr L: ``released_params``) giving its test accuracy;
  the default's final run (released when K = 0) and the planner's baseline trained once with the whole ε too;
* then ``--draws`` searches are simulated through the real draw (``make_draw``: K and the configs), the real
  searcher (TPE's Optuna sampler asks and is told), the real score noise (Gaussian at the target's validation
  size) or noisy max, the real selection and release (``harness.searches.search_once``): a trial's validation
  accuracy and a release's test accuracy are read off the grid, linear in log L between grid points (a point
  whose nearest grid point diverged diverged).

The gain per proxy seed is the simulated searches' mean final test accuracy minus the baseline's; the verdict's
rehearsal is the mean over seeds, its standard error over seeds (training noise; the draws' noise is gone).
Simplifications, stated: one training run per grid point and seed (repeated trials of one config share it), and
scores of a trial read from one validation split.

    python bench/rehearsal_sim.py --space search_spaces/mnist.yaml --proxy mnist-public --seeds 100,101,102 \
        --epsilons 1,2,4 --lrs 4 --draws 2000 --jobs 2 --out bench/results/sim_mnist.md

``--from-json`` re-simulates from a run's records (the grid's accuracies) without training, and writes only the report;
a space that fixes a value a wider space searched (epochs 10 of 5 or 10) reads the wider grid's records at it.
``--stream`` appends each record as it finishes, ``--have`` skips the runs a cut-short run already recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from harness.context import parse_seeds
from harness.proxy import carried, final_run, merged, proxy_data, whole_budget

from dptune.accounting import lr_batch_scale, plan_search, plan_transfer, rehearsal_key
from dptune.config import SearchSpace, load_space, nominal_train_size
from dptune.config.searchers import searcher

RESULTS = Path(__file__).resolve().parent / "results"
TRIAL_SEED = 11  # a grid trial's seed: 11·seed + 1; final runs 7·seed + 1 (harness.proxy.final_run; public)


@functools.cache  # per process: planning the charge takes 2-7 s, and every run needs it
def space_at(path: str, eps: float) -> tuple[SearchSpace, Any, Any, int, int]:
    space = load_space(path).with_privacy(target_epsilon=eps)
    n_train = nominal_train_size(space.dataset)
    n_val = space.dataset.validation_size
    plan = plan_search(space, n_train, compare=False)
    return space, plan, plan_transfer(space, plan, final_n=n_train + n_val), n_train, n_val


def float_key(space: SearchSpace) -> str | None:
    """The one float dimension (interpolated in log), or None (every dimension categorical)."""
    floats = [k for k, d in space.space.items() if type(d).__name__ == "FloatDistribution"]
    others = [k for k, d in space.space.items() if k not in floats and type(d).__name__ != "CategoricalDistribution"]
    if len(floats) > 1 or others:
        raise SystemExit(f"--space: {', '.join(floats + others)}: only categorical values and one float are simulated")
    return floats[0] if floats else None


def grid(space: SearchSpace, n_lr: int) -> list[dict[str, Any]]:
    sr = searcher(space.searcher)
    if sr.fixed_candidates:
        return [dict(c) for c in sr.candidates(space)]
    fk = float_key(space)
    axes = {k: list(d.choices) for k, d in space.space.items() if k != fk}  # type: ignore[attr-defined]
    if fk is not None:
        d = space.space[fk]
        pts = np.geomspace(d.low, d.high, n_lr) if d.log else np.linspace(d.low, d.high, n_lr)  # type: ignore
        axes[fk] = [float(f"{x:.6g}") for x in pts]
    return [dict(zip(axes, vals, strict=True)) for vals in itertools.product(*axes.values())]


@functools.lru_cache(maxsize=4)
def _data(proxy: str, seed: int, validation: int) -> Any:
    return proxy_data(proxy, seed, validation)


def run_point(path: str, eps: float, seed: int, params: dict[str, Any], kind: str, proxy: str,
              validation: int, device: str | None = None) -> dict[str, Any]:
    """One grid run on the proxy: ``kind`` "trial" (σ_c, transferred lr: validation accuracy), "final" (the
    release's σ_f and lr L: test accuracy) or "baseline" (the planner's baseline with the whole ε)."""
    import torch

    from dptune.dpsgd import run_trial
    from dptune.release import released_params
    from dptune.trials import TrialRow

    torch.set_num_threads(1)
    space, _, tp, n_train_s, n_val_s = space_at(path, eps)
    data = _data(proxy, seed, validation)
    own = proxy != "digits"
    n_train_d, n_val_d = len(data.train[1]), len(data.val[1])
    t0 = time.time()
    out: dict[str, Any] = {"epsilon": eps, "seed": seed, "kind": kind, "params": params}
    if kind == "baseline":
        final = merged(data)
        out["test"] = whole_budget(space.baseline, eps, final, n_train_s + n_val_s, space.privacy.delta, seed, own,
                                   device)
    elif kind == "trial":
        cfg = tp.trial_config(space.fixed.replace(**params, seed=TRIAL_SEED * seed + 1))
        r = run_trial(carried(cfg, n_train_d / n_train_s, n_val_d / n_val_s, own), data, device=device)
        out.update(val=float(r.val_accuracy_raw), diverged=bool(r.diverged), lr=cfg.learning_rate,
                   sigma=cfg.noise_multiplier)
    else:
        row = TrialRow(index=0, params=dict(params), seed="", score=0.5, val_accuracy_raw=0.5)
        rel, _ = released_params(space, row, n_train_s, transfer=tp)
        cfg = space.fixed.replace(**rel)
        r = final_run(cfg, merged(data), n_train_s + n_val_s, seed, own, device)
        out.update(test=float(r.test_accuracy or 0.0), diverged=bool(r.diverged), lr=cfg.learning_rate,
                   sigma=cfg.noise_multiplier)
    out["seconds"] = round(time.time() - t0, 1)
    out["device"] = device or "cpu"
    if space.lr_reference_batch is not None:  # its params' learning_rate is L at this batch size (of_space)
        out["lr_scaling"] = [space.lr_reference_batch, space.lr_batch_power]
    return out


class Table:
    """A grid's accuracies for one (ε, seed), read off at any config (linear in log of the float dimension)."""

    def __init__(self, rows: list[dict[str, Any]], fk: str | None, value: str):
        self.fk = fk
        self.curves: dict[tuple[Any, ...], list[tuple[float, float, bool]]] = {}
        for r in rows:
            x = math.log(r["params"][fk]) if fk else 0.0
            self.curves.setdefault(self._combo(r["params"]), []).append((x, r[value], r["diverged"]))
        for c in self.curves.values():
            c.sort()

    def _combo(self, params: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(sorted((k, v) for k, v in params.items() if k != self.fk))

    def at(self, params: dict[str, Any]) -> tuple[float, bool]:
        curve = self.curves[self._combo(params)]
        x = math.log(params[self.fk]) if self.fk else 0.0
        xs = [p[0] for p in curve]
        nearest = min(curve, key=lambda p: abs(p[0] - x))
        ys = [p[1] if not p[2] else 0.1 for p in curve]  # a diverged point: chance level
        return float(np.interp(x, xs, ys)), nearest[2]


def of_space(space: SearchSpace, row: dict[str, Any]) -> dict[str, Any] | None:
    """A grid record as a point of ``space``: its params cut to the searched keys, or None where it ran another
    value of one the space fixes (a record of a wider space, e.g. epochs 5 where the space fixes 10). A record of
    a space with another lr batch scaling (``search.lr_reference_batch``; ``lr_scaling`` in the record, none in
    older ones) ran the same final lr and trial (same σ_c, σ_f and lr·σ) as this space's L = lr / its scale: it is
    read at that L, and dropped where that L is outside this space's range."""
    if row["kind"] == "baseline":
        return row
    params = dict(row["params"])
    if any(getattr(space.fixed, k) != v for k, v in params.items() if k not in space.space):
        return None
    ref, power = row.get("lr_scaling") or (None, 1.0)
    lr = space.space.get("learning_rate")
    if lr is not None and "learning_rate" in params and (ref, power) != (space.lr_reference_batch, space.lr_batch_power):
        b = params.get("batch_size", space.fixed.batch_size)
        final_lr = params["learning_rate"] * lr_batch_scale(b, ref, power)
        params["learning_rate"] = float(f"{final_lr / lr_batch_scale(b, space.lr_reference_batch, space.lr_batch_power):.6g}")
        low, high = getattr(lr, "low", -math.inf), getattr(lr, "high", math.inf)
        if not low * (1 - 1e-6) <= params["learning_rate"] <= high * (1 + 1e-6):
            return None
    return {**row, "params": {k: v for k, v in params.items() if k in space.space}}


def simulate(path: str, eps: float, seed: int, rows: list[dict[str, Any]], draws: int) -> dict[str, Any]:
    """``draws`` searches of the space at total ``eps`` on one proxy seed's grid: their gains over the baseline."""
    import optuna
    from harness.searches import search_once

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, plan, tp, n_train, n_val = space_at(path, eps)
    fk = float_key(space)
    mine = [p for r in rows if r["epsilon"] == eps and r["seed"] == seed and (p := of_space(space, r)) is not None]
    trials = Table([r for r in mine if r["kind"] == "trial"], fk, "val")
    finals = Table([r for r in mine if r["kind"] == "final"], fk, "test")
    base = next(r["test"] for r in mine if r["kind"] == "baseline")
    sn = float(space.privacy.score_noise or 0.0) / n_val
    largest = max(getattr(space.space.get("batch_size"), "choices", [0]))
    gains, ks, big = [], [], []
    for j in range(draws):
        rng = np.random.default_rng([seed, round(100 * eps), j])

        def trial(params: dict[str, Any], _seed: int) -> dict[str, Any]:
            val, diverged = trials.at(params)  # noqa: B023 (called within this draw)
            score = -math.inf if diverged else val + float(rng.normal(0.0, sn))  # noqa: B023
            return {"params": params, "score": score, "val_raw": val, "diverged": diverged}

        key = 1_000_003 * seed + 7_919 * j + round(100 * eps)  # public: simulated draws are not secret
        draw, _, params = search_once(space, plan, tp, key, trial, n_train, n_val, select_key=key + 1)
        test, _ = finals.at({k: params[k] for k in space.space})
        gains.append(test - base)
        ks.append(draw.k)
        big.append(params.get("batch_size", 0) == largest)
    return {"epsilon": eps, "seed": seed, "gain": float(np.mean(gains)), "k": float(np.mean(ks)),
            "largest_batch": float(np.mean(big)), "baseline": base,
            "quantiles": [float(q) for q in np.quantile(gains, [0.1, 0.5, 0.9])]}


def train_grid(args: argparse.Namespace, epsilons: list[float], seeds: list[int]) -> list[dict[str, Any]]:
    jobs: list[tuple[float, int, dict[str, Any], str]] = []
    for eps in epsilons:
        space = space_at(args.space, eps)[0]
        pts = grid(space, args.lrs)
        default = {k: getattr(space.default, k) for k in space.space}
        finals = pts + ([default] if default not in pts else [])
        for s in seeds:
            jobs += [(eps, s, {}, "baseline")] + [(eps, s, p, "trial") for p in pts]
            jobs += [(eps, s, p, "final") for p in finals]
    have = read_records(args.have) if args.have else []
    done = {_job_key(r["epsilon"], r["seed"], r["params"], r["kind"]) for r in have}
    jobs = [j for j in jobs if _job_key(*j) not in done]
    print(f"{len(jobs)} proxy runs ({len(have)} records given)", flush=True)
    out = [r for r in have if r["epsilon"] in epsilons and r["seed"] in seeds]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as ex, \
            open(args.stream, "a") if args.stream else contextlib.nullcontext() as stream:
        futs = [ex.submit(run_point, args.space, e, s, p, k, args.proxy, args.proxy_validation, args.device)
                for e, s, p, k in jobs]
        for f in as_completed(futs):  # each record as it finishes: a run cut short keeps what it trained
            out.append(f.result())
            if stream is not None:
                stream.write(json.dumps(out[-1]) + "\n")
                stream.flush()
    return out


def _job_key(eps: float, seed: int, params: dict[str, Any], kind: str) -> tuple[Any, ...]:
    return float(eps), int(seed), kind, json.dumps(params, sort_keys=True)


def read_records(files: str) -> list[dict[str, Any]]:
    """Records from comma-separated files: a JSON list, or one JSON record per line (``--stream``)."""
    rows: list[dict[str, Any]] = []
    for f in files.split(","):
        text = Path(f).read_text()
        rows += json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]
    return rows


def report(space: SearchSpace, sims: list[dict[str, Any]], rows: list[dict[str, Any]], cmd: str,
           minutes: float) -> str:
    epsilons = sorted({r["epsilon"] for r in sims})
    seeds = sorted({r["seed"] for r in sims})
    n_runs = len(rows)
    lines = [f"# The search of {space.name} simulated on the public proxy (bench/rehearsal_sim.py)", "",
             f"Command: `{cmd}` ({minutes:.1f} min, {n_runs} proxy runs). Proxy seeds {seeds}. Each row: the mean "
             "over the simulated draws of the released config's final test accuracy minus the baseline's.", "",
             "| ε | seed | baseline % | E[K] | P(largest B released) | mean gain | 10 % / 50 % / 90 % of gains |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(sims, key=lambda r: (r["epsilon"], r["seed"])):
        q = " / ".join(f"{100 * x:+.1f}" for x in r["quantiles"])
        lines.append(f"| {r['epsilon']:g} | {r['seed']} | {100 * r['baseline']:.1f} | {r['k']:.2f} | "
                     f"{r['largest_batch']:.2f} | {100 * r['gain']:+.2f} | {q} |")
    means, ses = {}, {}
    lines += ["", "| ε | seeds | rehearsed gain (points) | std error over seeds |", "|---|---|---|---|"]
    for e in epsilons:
        g = [r["gain"] for r in sims if r["epsilon"] == e]
        means[e] = float(np.mean(g))
        ses[e] = np.std(g, ddof=1) / math.sqrt(len(g)) if len(g) > 1 else float("nan")
        lines.append(f"| {e:g} | {len(g)} | {100 * means[e]:+.2f} | {100 * ses[e]:.2f} |")
    head = "The proxy's grid (accuracy %, trial validation / final test)"
    if space.lr_reference_batch is not None:
        head += (f"; each record as it ran (learning_rate: the space's that ran it), read by this space at its L = "
                 f"the final run's lr / (B/{space.lr_reference_batch})^{space.lr_batch_power:g}, where in its range")
    lines += ["", head + ":", "",
              "| ε | seed | config | trial val | final test |", "|---|---|---|---|---|"]
    def cell(r: dict[str, Any]) -> tuple[float, int, str]:
        return r["epsilon"], r["seed"], json.dumps(r["params"], sort_keys=True)

    finals = {cell(r): r for r in rows if r["kind"] == "final"}
    for r in sorted((r for r in rows if r["kind"] == "trial"), key=cell):
        f = finals.get(cell(r))
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(r["params"].items()))
        lines.append(f"| {r['epsilon']:g} | {r['seed']} | {shown} | {100 * r['val']:.1f}{' (div)' * r['diverged']} | "
                     + (f"{100 * f['test']:.1f}" if f else "–") + " |")
    lines += ["", "```yaml", "  rehearsal: {" + ", ".join(f"{e:g}: {m:.4f}" for e, m in sorted(means.items())) + "}",
              f'  rehearsal_of: "{rehearsal_key(space)}"',
              "  rehearsal_se: {" + ", ".join(f"{e:g}: {se:.4f}" for e, se in ses.items() if math.isfinite(se)) + "}",
              "```", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--space", required=True)
    p.add_argument("--proxy", choices=["digits", "mnist-public"], default="mnist-public")
    p.add_argument("--proxy-validation", type=int, default=400)
    p.add_argument("--seeds", default="100,101,102", help="proxy split seeds")
    p.add_argument("--epsilons", default="1,2,4")
    p.add_argument("--lrs", type=int, default=4, help="grid points over the float dimension (log-spaced)")
    p.add_argument("--draws", type=int, default=2000, help="simulated searches per (ε, seed); 0: train the grid only")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--device", help="torch device of the proxy runs (default cpu; e.g. cuda: many jobs share one GPU)")
    p.add_argument("--from-json", help="re-simulate from these comma-separated records files; nothing trains")
    p.add_argument("--have", help="records files already trained: their runs are not repeated, their records kept")
    p.add_argument("--stream", help="append each record to this file (one JSON per line) as it finishes")
    p.add_argument("--out", help="the report (default bench/results/sim_<space>.md; a trained grid's records beside it as .json)")
    args = p.parse_args(argv)
    space = load_space(args.space)
    if nominal_train_size(space.dataset) is None or not space.transfers:
        print("--space: give a space on a built-in dataset that plans its final run (privacy.search_share)")
        return 2
    float_key(space)
    t0 = time.time()
    if args.from_json:
        rows = read_records(args.from_json)
    else:
        rows = train_grid(args, [float(e) for e in args.epsilons.split(",")], parse_seeds(args.seeds))
    out = Path(args.out) if args.out else RESULTS / f"sim_{space.name}.md"
    if args.draws == 0:  # train only (e.g. on a machine with more cores): the records, simulated later
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        return 0
    cells = sorted({(r["epsilon"], r["seed"]) for r in rows})
    sims = [simulate(args.space, e, s, rows, args.draws) for e, s in cells]
    text = report(space, sims, rows, " ".join(["python", "bench/rehearsal_sim.py", *argv]), (time.time() - t0) / 60)
    out.write_text(text)
    if not args.from_json:  # the records of a re-simulation are its --from-json files, named in its command
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
