"""``python -m dptune.search``: private random search on Ray Tune, charged as a whole.

plan → ledger.reserve (refuses over budget before anything runs) → draw K once (sealed) → K i.i.d.
DP-SGD trials on Ray Tune → sealed/trials.parquet → release only the best → ledger.commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
import sys
from pathlib import Path
from typing import Any

from dptune.cli._common import add_space_arguments, auto_text, run_cli, space_from_args
from dptune.config import ACCOUNTING_MODES, SEARCHERS, SearchSpace, check_accounting, check_space
from dptune.errors import ConfigError, check_unit_interval, python_m
from dptune.tuning.driver import SearchRequest

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptune.search", description=__doc__.splitlines()[0])
    add_space_arguments(p)
    p.add_argument("--target-epsilon", type=float, help="with --data (or a space: auto file): the total budget "
                   "for the search and the final training")
    p.add_argument("--name", help="run name (default: <space>-<random>); outputs go to <runs-dir>/<name>")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--ledger", help="privacy ledger: a SQLite file or a team's postgresql://USER@HOST:PORT/DB (password "
                   "from ~/.pgpass or PGPASSFILE; never printed); default: $DPTUNE_LEDGER, else the per-user "
                   "$XDG_DATA_HOME/dptune/ledger.sqlite or ~/.local/share/dptune/ledger.sqlite")
    p.add_argument("--budget-epsilon", type=float, help="set the dataset's budget if it has none yet")
    p.add_argument("--budget-delta", type=float, help="δ of that budget (default: the space's δ)")
    p.add_argument("--accounting", choices=list(ACCOUNTING_MODES),
                   help="optional: must agree with the stopping rule, which decides it (--trials N: composed)")
    p.add_argument("--searcher", choices=list(SEARCHERS), help="override search.searcher")
    p.add_argument("--tune-anyway", action="store_true", help="run a search the planner does not expect to pay "
                   "(by default it is refused, exit 2, nothing charged)")
    p.add_argument("--trials", type=int, help="number of trials under composed accounting")
    p.add_argument("--address", help="join a Ray cluster: auto or HOST:PORT (default: start a local Ray)")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--num-gpus", type=int, help="GPUs of the local Ray (default: those it detects)")
    p.add_argument("--gpus-per-trial", default="auto",
                   help="auto (1 if the cluster has GPUs), 0, or a fraction: 0.25 packs four trials on each GPU")
    p.add_argument("--dashboard-host", default="127.0.0.1",
                   help="bind the local Ray dashboard here (default loopback; anything else is unauthenticated "
                        "remote access to your cluster)")
    p.add_argument("--dashboard-port", type=int)
    p.add_argument("--max-failures", type=int, default=3, help="retries per trial, for infrastructure failures")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint each N epochs (0: off)")
    p.add_argument("--group-trials", action="store_true",
                   help="train trials of one architecture together, one computation per group (each trial as if "
                        "alone; clipping auto runs whole-model vmap); not with an adaptive searcher or "
                        "--save-checkpoint, where trials run one at a time")
    p.add_argument("--save-checkpoint", action="store_true", help="release the best trial's model too")
    p.add_argument("--storage-path", help="Tune checkpoints on storage every node reaches: a shared (NFS) path or a "
                   "URI such as s3://bucket/dir (curator-only!); default: the run's sealed/ray (one machine)")
    p.add_argument("--resume", action="store_true", help="resume the sealed draw of --name (no new charge)")
    p.add_argument("--show-trials", action="store_true",
                   help="CURATOR ONLY: print every trial's result (private data) to the terminal")
    p.add_argument("--seed", type=int, help="NOT PRIVATE: fixed randomness for reproducibility/tests")
    p.add_argument("--smoke-test", action="store_true", help="2 epochs per trial (fast path for CI)")
    p.add_argument("--epochs", type=float, help="override the space's fixed epochs (charged accordingly)")
    p.add_argument("--tune-fraction", type=float,
                   help="search on a Poisson subsample of this fraction of the training data (0 < f <= 1; "
                        "overrides search.tune_fraction; charged accordingly)")
    return p


def _apply_overrides(space: SearchSpace, args: argparse.Namespace) -> SearchSpace:
    changes: dict[str, Any] = {}
    if args.searcher:
        changes["searcher"] = args.searcher
    privacy = space.privacy
    if args.trials is not None:
        if args.trials < 1:
            raise ConfigError("--trials", f"{args.trials} is < 1", "run at least one trial")
        privacy = dataclasses.replace(privacy, stopping="composed", mean=float(args.trials), stopping_settings=())
    elif args.accounting == "composed" and space.accounting != "composed":
        raise ConfigError("--trials", "composed accounting runs a fixed number of trials",
                          "give --trials N (each trial is charged by composition)")
    check_accounting("--accounting", args.accounting, privacy.stopping)  # the stopping rule decides it
    changes["privacy"] = privacy
    if args.tune_fraction is not None:
        changes["tune_fraction"] = check_unit_interval("--tune-fraction", args.tune_fraction,
                                                       "choose e.g. 0.25, or 1 for no subsampling", include_one=True)
    epochs = 2.0 if args.smoke_test else args.epochs
    if epochs is not None:
        if "epochs" in space.space:
            raise ConfigError("--epochs", "epochs is searched in this space", "drop --epochs or fix epochs in the space")
        if not (math.isfinite(epochs) and epochs > 0):
            raise ConfigError("--epochs", f"{epochs} must be > 0", "give e.g. 5")
        changes["fixed"] = space.fixed.replace(epochs=epochs)
        changes["default"] = space.default.replace(epochs=epochs)
    new = dataclasses.replace(space, **changes)
    check_space(new)  # the one validation path (the API and the search driver call it too)
    return new


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_cpus", "num_gpus", "max_failures", "checkpoint_every"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"{v} is negative", "give a number >= 0")
    if args.cpus_per_trial <= 0:
        raise ConfigError("--cpus-per-trial", f"{args.cpus_per_trial} must be > 0", "give e.g. 1")
    if args.budget_epsilon is not None and not (math.isfinite(args.budget_epsilon) and args.budget_epsilon > 0):
        raise ConfigError("--budget-epsilon", f"{args.budget_epsilon} must be > 0", "give a total budget, e.g. 8")
    if args.budget_delta is not None and not 0 < args.budget_delta < 1:
        raise ConfigError("--budget-delta", f"{args.budget_delta} is not in (0, 1)", "give e.g. 1e-5")
    if args.address and (args.checkpoint_every or args.save_checkpoint) and not args.storage_path:
        flag = "--checkpoint-every" if args.checkpoint_every else "--save-checkpoint"
        raise ConfigError(flag, "on a Ray cluster, trial checkpoints written to this machine's sealed/ are not "
                          "reachable from the other nodes (a retried trial or the release would miss them)",
                          "pass --storage-path with storage every node reaches (NFS path or s3://…), or drop " + flag)
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


def _storage(path: str | None) -> str | None:
    """A local --storage-path becomes an absolute path created owner-only (it holds per-trial results)."""
    if path is None or "://" in path and not path.startswith("file://"):
        return path
    local = Path(path.removeprefix("file://")).expanduser().resolve()
    local.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(local)


def _request(args: argparse.Namespace) -> SearchRequest:
    from dptune.tuning.driver import default_run_name
    from dptune.tuning.options import RayOptions

    _check_args(args)
    space = _apply_overrides(space_from_args(args, count=True), args)
    if args.target_epsilon is not None and space.auto is None:  # it would change nothing that runs
        raise ConfigError("--target-epsilon", "sets the budget of a space derived from the data (--data or a space: "
                          "auto file), and this space is written by hand", "set privacy.target_epsilon in the space")
    name = args.name or default_run_name(space)
    if args.resume and not args.name:
        raise ConfigError("--resume", "needs the --name of the interrupted search", "give --name NAME")
    ray = RayOptions(address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                     cpus_per_trial=args.cpus_per_trial,
                     gpus_per_trial=args.gpus_per_trial, dashboard_host=args.dashboard_host,
                     dashboard_port=args.dashboard_port, max_failures=args.max_failures,
                     checkpoint_every=args.checkpoint_every, save_model=args.save_checkpoint,
                     storage_path=_storage(args.storage_path), group_trials=args.group_trials)
    return SearchRequest(space=space, run_dir=Path(args.runs_dir) / name, ledger=_ledger_path(args.ledger),
                         budget_epsilon=args.budget_epsilon, budget_delta=args.budget_delta,
                         resume=args.resume, seed=args.seed,
                         show_trials=args.show_trials, ray=ray, tune_anyway=args.tune_anyway)


def _ledger_path(given: str | None) -> Any:
    from dptune.ledger import ledger_location

    return ledger_location(given)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args, argv))


def resume_command(argv: list[str], name: str) -> str:
    """The exact command that continues this search: the same flags, its --name, and --resume."""
    import shlex

    from dptune.ledger import is_url, ledger_location

    # a ledger URL is repeated without its password (it comes from ~/.pgpass, PGPASSFILE or PGPASSWORD)
    tokens = [str(ledger_location(t)) if is_url(t) else f"--ledger={ledger_location(t[9:])}"
              if t.startswith("--ledger=") and is_url(t[9:]) else t for t in argv if t != "--resume"]
    if not any(t == "--name" or t.startswith("--name=") for t in tokens):
        tokens += ["--name", name]
    return python_m("dptune.search") + " " + shlex.join([*tokens, "--resume"])


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    from dptune.tuning.driver import SearchStopped, run_search

    req = _request(args)
    if req.space.auto is not None:  # the space derived from public facts, before anything is charged
        from dptune.release import public_auto

        print(auto_text(public_auto(req.space)), flush=True)
    command = resume_command(argv, req.run_dir.name)
    try:
        out = run_search(dataclasses.replace(req, resume_command=command))
    except SearchStopped as e:
        if e.interrupted:
            print(f"interrupted; nothing was released. {e.charge[0].upper()}{e.charge[1:]}; the finished trials are "
                  f"sealed. Continue with: {command}", file=sys.stderr)
            return 130
        print(f"error: {e.cause}. Nothing was released; {e.charge}. Fix the cause, then continue with: {command}",
              file=sys.stderr)
        return 1
    _print_release(req, out)
    return 0


def _print_release(req: SearchRequest, out: Any) -> None:
    """The closing lines (what people paste into tickets): neither K nor the duration."""
    release = out.released
    rel = out.run.release
    print(f"released (everything else stays sealed in {out.run.sealed}):")
    print("  config: " + json.dumps({k: release["config"][k] for k in sorted(req.space.space)}))
    if release["score"] is not None:
        print(f"  score:  {release['score']:.4f} = the best trial's {release['score_kind']}; it ranks configs "
              "trained at the search's (noisier) settings and is not the final model's accuracy, which "
              "dptune.train reports on the test split")
    elif req.space.privacy.selection == "noisy_max":
        print(f"  score:  none — {release['score_kind']}")
    else:
        # the same words whether no trial was drawn or every drawn trial diverged: neither says what K was
        print("  score:  none (no trial produced a finite score — none was drawn, or every drawn trial diverged)")
    rule = release.get("scaling_rule")
    if rule is not None:
        print(f"  rule:   the final run sets learning_rate = {rule['lr_times_sigma']:.4g} / its noise multiplier "
              "(the update noise the winning trial had)")
    print(f"  privacy: epsilon = {out.epsilon:.4f}, delta = {out.delta:g}, {out.stopping}")
    print(f"  files:  {rel}/best_config.yaml, {rel}/certificate.json")
    target = req.space.privacy.target_epsilon
    if target is not None and target > out.epsilon:  # the release carries it: dptune train's default
        print(f"  next:   {python_m('dptune.train')} --release {rel} --out {out.run.root}/final --train-on-validation"
              f"   (calibrated to the release's target: search + training <= epsilon {target:g})")
    else:
        print(f"  next:   {python_m('dptune.train')} --release {rel} --out {out.run.root}/final --target-epsilon E "
              "(E = your total budget for search + final training)")


if __name__ == "__main__":
    sys.exit(main())
