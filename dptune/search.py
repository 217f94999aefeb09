"""``python -m dptune.search``: private random search on Ray Tune, charged as a whole.

plan → ledger.reserve (refuses over budget before anything runs) → draw K once (sealed) → K i.i.d.
DP-SGD trials on Ray Tune → sealed/trials.parquet → release only the best → ledger.commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from dptune._cli import run_cli
from dptune.accounting import Plan, plan_search, stopping_rule
from dptune.certificate import Certificate
from dptune.config import ConfigError, SearchSpace, check_adaptive, load_space
from dptune.ledger import Ledger

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptune.search", description=__doc__.splitlines()[0])
    p.add_argument("--space", required=True, help="search-space YAML, e.g. search_spaces/digits.yaml")
    p.add_argument("--name", help="run name (default: <space>-<timestamp>); outputs go to <runs-dir>/<name>")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--ledger", default="runs/ledger.sqlite", help="privacy ledger (SQLite)")
    p.add_argument("--budget-epsilon", type=float, help="set the dataset's budget if it has none yet")
    p.add_argument("--budget-delta", type=float, help="δ of that budget (default: the space's δ)")
    p.add_argument("--accounting", choices=["random_stopping", "composed"], help="override search.accounting")
    p.add_argument("--searcher", choices=["random", "tpe"], help="override search.searcher")
    p.add_argument("--trials", type=int, help="number of trials under composed accounting")
    p.add_argument("--address", help="join a Ray cluster: auto or HOST:PORT (default: start a local Ray)")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", default="auto", help="auto (1 if the cluster has GPUs), 0, or a fraction")
    p.add_argument("--dashboard-host", default="127.0.0.1",
                   help="bind the local Ray dashboard here (default loopback; anything else is unauthenticated "
                        "remote access to your cluster)")
    p.add_argument("--dashboard-port", type=int)
    p.add_argument("--max-failures", type=int, default=3, help="retries per trial, for infrastructure failures")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint each N epochs (0: off)")
    p.add_argument("--save-checkpoint", action="store_true", help="release the best trial's model too")
    p.add_argument("--resume", action="store_true", help="resume the sealed draw of --name (no new charge)")
    p.add_argument("--show-trials", action="store_true",
                   help="CURATOR ONLY: print every trial's result (private data) to the terminal")
    p.add_argument("--seed", type=int, help="NOT PRIVATE: fixed randomness for reproducibility/tests")
    p.add_argument("--smoke-test", action="store_true", help="2 epochs per trial (fast path for CI)")
    p.add_argument("--epochs", type=float, help="override the space's fixed epochs (charged accordingly)")
    return p


def _apply_overrides(space: SearchSpace, args: argparse.Namespace) -> SearchSpace:
    changes: dict[str, Any] = {}
    if args.accounting:
        changes["accounting"] = args.accounting
    if args.searcher:
        changes["searcher"] = args.searcher
    privacy = space.privacy
    if args.trials is not None:
        if args.trials < 1:
            raise ConfigError("--trials", f"{args.trials} is < 1", "run at least one trial")
        privacy = dataclasses.replace(privacy, stopping="composed", mean=float(args.trials))
    elif args.accounting == "composed" and privacy.stopping != "composed":
        raise ConfigError("--trials", "composed accounting runs a fixed number of trials",
                          "give --trials N (each trial is charged by composition)")
    if args.accounting == "random_stopping" and privacy.stopping == "composed":
        raise ConfigError("--accounting", "the space's privacy.stopping is composed",
                          "use --accounting composed, or set privacy.stopping to poisson or tnb")
    changes["privacy"] = privacy
    epochs = 2.0 if args.smoke_test else args.epochs
    if epochs is not None:
        if "epochs" in space.space:
            raise ConfigError("--epochs", "epochs is searched in this space", "drop --epochs or fix epochs in the space")
        if not (math.isfinite(epochs) and epochs > 0):
            raise ConfigError("--epochs", f"{epochs} must be > 0", "give e.g. 5")
        changes["fixed"] = space.fixed.replace(epochs=epochs)
        changes["default"] = space.default.replace(epochs=epochs)
    new = dataclasses.replace(space, **changes)
    check_adaptive(new)
    if new.scheduler != "fifo":
        raise ConfigError("search.scheduler", f"{new.scheduler!r} is not implemented yet",
                          "use scheduler: fifo (ASHA would release a noised score per rung, each to be charged)")
    return new


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_cpus", "max_failures", "checkpoint_every"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"{v} is negative", "give a number >= 0")
    if args.cpus_per_trial <= 0:
        raise ConfigError("--cpus-per-trial", f"{args.cpus_per_trial} must be > 0", "give e.g. 1")
    if args.budget_epsilon is not None and not (math.isfinite(args.budget_epsilon) and args.budget_epsilon > 0):
        raise ConfigError("--budget-epsilon", f"{args.budget_epsilon} must be > 0", "give a total budget, e.g. 8")
    if args.budget_delta is not None and not 0 < args.budget_delta < 1:
        raise ConfigError("--budget-delta", f"{args.budget_delta} is not in (0, 1)", "give e.g. 1e-5")
    if args.name is not None and (not args.name or "/" in args.name or args.name.startswith(".")):
        raise ConfigError("--name", f"{args.name!r} is not a plain directory name", "use e.g. digits-1")
    try:
        loopback = ipaddress.ip_address(args.dashboard_host).is_loopback
    except ValueError:
        loopback = args.dashboard_host == "localhost"
    if not loopback:
        print(f"WARNING: the Ray dashboard will listen on {args.dashboard_host}. The dashboard and its job API are "
              "unauthenticated unless Ray token auth is on: anyone who reaches that address can run code on this "
              "machine. Prefer the default 127.0.0.1 and SSH port forwarding.", file=sys.stderr)


def _load_data(space: SearchSpace) -> Any:
    from dptune.data import load_dataset

    return load_dataset(space.dataset)


def _release_config(space: SearchSpace, params: dict[str, Any], score: float | None) -> dict[str, Any]:
    cfg = space.fixed.replace(**params).to_public_dict()
    return {
        "released_by": "dptune.search",
        "space": space.name,
        "source": space.source,
        "dataset": dataclasses.asdict(space.dataset),
        "config": cfg,
        "privacy": {"delta": space.privacy.delta},
        "score": None if score is None or not math.isfinite(score) else float(score),
        "score_kind": "validation accuracy" + (" (public split)" if space.dataset.public_validation else
                                               f" + Gaussian noise (std {space.privacy.score_noise:g} on the "
                                               "correct-count)"),
        "certificate": "certificate.json",
    }


def _certificate(space: SearchSpace, plan: Plan, fingerprint: str, name: str) -> Certificate:
    return Certificate.build(
        fingerprint, plan.delta, [("search", plan.search_event)], plan.stopping.describe(),
        details={"kind": "search", "run": name, "space": space.name, "space_sha256": _sha(space.source),
                 "searcher": space.searcher, "accounting": space.accounting, "n_train": plan.n_train,
                 "trial_epsilon": plan.trial_epsilon, "search_epsilon": plan.search_epsilon,
                 "worst_case": [dataclasses.asdict(p) for p in plan.points]})


def _sha(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and Path(path).is_file() else None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    from dptune._search.draw import Draw, make_draw
    from dptune._search.sealed import RunDir, write_trials

    _check_args(args)
    space = _apply_overrides(load_space(args.space), args)
    name = args.name or f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = RunDir(Path(args.runs_dir) / name)
    if args.resume and not run.draw_file.exists():
        raise ConfigError("--resume", f"{run.root} holds no sealed draw", "give the --name of an interrupted search")
    if not args.resume and run.root.exists():
        raise ConfigError("--name", f"{run.root} already exists", "choose a new --name, or --resume that search")
    if args.seed is not None:
        print("WARNING: --seed fixes K, the trial configs and all DP noise: NOT PRIVATE (tests/reproducibility).",
              file=sys.stderr)

    rule = stopping_rule(space.privacy.stopping, mean=space.privacy.mean, eta=space.privacy.eta)
    data = _load_data(space)
    n_train = int(len(data.train[1]))
    fingerprint = data.pool_fingerprint()
    released_space = space
    f = space.tune_fraction
    # with f < 1 the search runs on a Poisson subsample X₁ (Koskela & Kulkarni 2023): plan_search charges
    # trials at q = B/(f·n), fixed before X₁ is drawn, and amplifies the whole search (Zhu & Wang 2019)
    plan = plan_search(space, n_train, rule, compare=False)
    sampling_basis = f * n_train if f < 1 else None  # data-independent: q = B/(f·n), never B/|X₁|
    ledger = Ledger(args.ledger)

    if args.resume:
        state = run.read_state()
        if state.get("space_sha256") != _sha(space.source) or state.get("fingerprint") != fingerprint:
            raise ConfigError("--space", "differs from the space or data the interrupted search was charged for",
                              "resume with the same --space file and dataset")
        if state.get("status") == "released":
            raise ConfigError("--resume", f"{name} already finished", f"its release is in {run.release}")
        charge_id = int(state["charge_id"])
        if ledger.charge(charge_id).status == "aborted":
            raise ConfigError("--resume", "its ledger charge was aborted", "start a new search")
        draw = Draw.load(run.draw_file)
    else:
        if ledger.budget(fingerprint) is None:
            if args.budget_epsilon is None:
                raise ConfigError("--budget-epsilon", f"dataset {fingerprint[:12]} has no privacy budget in "
                                  f"{args.ledger}", "pass --budget-epsilon E (and --budget-delta) once, or use "
                                  "python -m dptune.ledger set-budget")
            ledger.set_budget(fingerprint, args.budget_epsilon, args.budget_delta or space.privacy.delta,
                              label=space.dataset.name)
        # rule 4: the charge is durable before anything touches data
        charge_id = ledger.reserve(fingerprint, name, plan.search_event)
        run.create()
        run.write_state(charge_id=charge_id, fingerprint=fingerprint, space_sha256=_sha(space.source),
                        status="reserved", ledger=str(Path(args.ledger).resolve()))
        draw = make_draw(space, rule, seed=args.seed)
        draw.save(run.draw_file)

    if f < 1:
        import numpy as np

        from dptune.data import poisson_subsample

        # X₁ is drawn once from the sealed (secret) draw seed, so a resumed search sees the same subsample
        data = poisson_subsample(data, f, int(np.random.default_rng([draw.draw_seed, 2]).integers(2**62)))
    print(f"dptune search {name!r}: space {space.name} ({space.searcher} search, {plan.stopping.label()})")
    print(f"  charged to the ledger before any trial: epsilon = {plan.search_epsilon:.4f}, delta = {plan.delta:g} "
          f"(one worst-case trial: epsilon = {plan.trial_epsilon:.4f})")
    dashboard = None
    rows: list[dict[str, Any]] = []
    if draw.k > 0:
        from dptune._search import runner

        opts = runner.RayOptions(
            address=args.address, num_cpus=args.num_cpus, cpus_per_trial=args.cpus_per_trial,
            gpus_per_trial=args.gpus_per_trial, dashboard_host=args.dashboard_host,
            dashboard_port=args.dashboard_port, max_failures=args.max_failures,
            checkpoint_every=args.checkpoint_every, save_model=args.save_checkpoint,
            job_metadata={"dptune_run": name, "dptune_space": space.name,
                          "dptune_epsilon": f"{plan.search_epsilon:.4f}", "dptune_delta": f"{plan.delta:g}",
                          "dptune_stopping": plan.stopping.label()})
        try:
            dashboard = runner.start_ray(opts)
            print(f"  Ray dashboard: {dashboard or 'see your cluster head'}")
            run.write_state(status="running", dashboard=dashboard)
            rows = runner.run_trials(space, draw, data, run, opts, show_trials=args.show_trials,
                                     resume=args.resume, sampling_basis=sampling_basis)
        finally:
            runner.shutdown()
        write_trials(run.trials_file, rows)
    else:
        write_trials(run.trials_file, [])

    # only the best trial leaves sealed/ (rule 3); K = 0 releases the space's default config (rule 1)
    if rows:
        best = max(rows, key=lambda r: (_score(r), -r["index"]))
        params, score = dict(best["params"]), _score(best)
        if f < 1:  # the transfer rule: keep q = B/n (batch scaled by 1/f), epochs, lr, σ
            from dptune.accounting import transfer_config

            params = transfer_config(params, fraction=f, n_train=n_train)
    else:
        best = None
        params = {k: getattr(space.default, k) for k in space.space}
        score = None
    run.release.mkdir(exist_ok=True)
    release = _release_config(released_space, params, score)
    if f < 1:
        release["tuned_on_fraction"] = f
    (run.release / "best_config.yaml").write_text(
        "# Released by dptune.search: the best trial's complete config. Train it with\n"
        f"#   python -m dptune.train --release {run.release}\n" + yaml.safe_dump(release, sort_keys=False))
    cert = _certificate(space, plan, fingerprint, name)
    if f < 1:
        cert = dataclasses.replace(cert, details={
            **cert.details, "tune_fraction": f, "subsample_rule": "Poisson, drawn once from the sealed seed",
            "trial_sampling_rate_basis": "B/(f*n)",
            "amplification": "Zhu & Wang 2019 Thm 6 on the whole search; validation releases unamplified",
            "transfer_rule": "batch_size / f (same q = B/n), same epochs, learning rate, noise multiplier"})
    cert.save(run.release / "certificate.json")
    if args.save_checkpoint and best is not None and best.get("checkpoint"):
        shutil.copy(Path(best["checkpoint"]) / "model.pt", run.release / "best_checkpoint.pt")
    ledger.commit(charge_id)
    run.write_state(status="released")

    print("released (everything else stays sealed in " f"{run.sealed}):")
    print("  config: " + json.dumps({k: release["config"][k] for k in sorted(space.space)}))
    if release["score"] is not None:
        print(f"  score:  {release['score']:.4f} ({release['score_kind']})")
    print(f"  privacy: epsilon = {cert.epsilon:.4f}, delta = {cert.delta:g}, {plan.stopping.label()}")
    print(f"  files:  {run.release}/best_config.yaml, {run.release}/certificate.json")
    if dashboard:
        print(f"  dashboard was at {dashboard}")
    return 0


def _score(row: dict[str, Any]) -> float:
    s = row.get("score")
    return float(s) if s is not None and math.isfinite(float(s)) else -math.inf


if __name__ == "__main__":
    sys.exit(main())
