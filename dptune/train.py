"""``python -m dptune.train``: final DP training of a released config, charged and certified with the search.

release (best_config.yaml + verified certificate.json) → data (fingerprint must match) → σ (released, or
calibrated so search ⊕ training fits ``--target-epsilon``) → ledger.reserve (durable, before training) →
DP-SGD with a fresh secret seed → ledger.commit → model.pt, metrics.json, composed certificate.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dptune._cli import run_cli
from dptune._params import sampling_rate, trial_steps
from dptune.accounting import calibrate_noise_multiplier, epsilon, trial_event
from dptune.certificate import Certificate, load_certificate
from dptune.config import ConfigError, DatasetSpec, TrialConfig, _coerce
from dptune.ledger import Ledger

__all__ = ["main"]

RESULT_FILES = ("model.pt", "metrics.json", "certificate.json", "private_seed.json")
TEST_NOTE = "usual non-private held-out evaluation on the test split (not charged, not DP)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptune.train", description=__doc__.splitlines()[0])
    p.add_argument("--release", required=True, help="a search's release dir, e.g. runs/<name>/release")
    p.add_argument("--out", required=True, help="where to write model.pt, metrics.json, certificate.json")
    p.add_argument("--ledger", default="runs/ledger.sqlite", help="the privacy ledger the search charged")
    p.add_argument("--target-epsilon", type=float,
                   help="calibrate the noise multiplier so that search + final training cost at most this ε")
    p.add_argument("--train-on-validation", action="store_true", help="train on train ∪ validation")
    p.add_argument("--use-best-checkpoint", action="store_true",
                   help="export the search's best checkpoint instead of training (no new charge)")
    p.add_argument("--epochs", type=float, help="override the released number of epochs")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, help="NOT PRIVATE: fixed DP noise, for tests/reproducibility only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


# --------------------------------------------------------------------------------------------------
# the release


@dataclass(frozen=True)
class Release:
    path: Path
    dataset: DatasetSpec
    config: TrialConfig  # seed 0 here: final training draws its own
    certificate: Certificate


def load_release(path: str | Path) -> Release:
    """Validate ``best_config.yaml`` and the certificate of a release directory (ConfigError otherwise)."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError("--release", f"{str(root)!r} is not a directory",
                          "point at runs/<name>/release, written by `python -m dptune.search`")
    cfg_file = root / "best_config.yaml"
    if not cfg_file.is_file():
        raise ConfigError("best_config.yaml", f"{str(cfg_file)!r} does not exist",
                          "point --release at a complete release directory written by `python -m dptune.search`")
    try:
        raw = yaml.safe_load(cfg_file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError("best_config.yaml", f"is corrupt ({str(e).splitlines()[0]})",
                          "use the file the search released, unmodified") from e
    if not isinstance(raw, dict):
        raise ConfigError("best_config.yaml", "is not a YAML mapping", "use the file the search released")
    for key in ("dataset", "config"):
        if not isinstance(raw.get(key), dict):
            raise ConfigError(f"best_config.{key}", "is missing or not a mapping", "use the file the search released")
    dataset = _dataset_spec(raw["dataset"])
    cfg = dict(raw["config"])
    if "seed" in cfg:
        raise ConfigError("best_config.config.seed", "a released config carries no seed (it drove a trial's noise)",
                          "remove it: final training draws a fresh secret seed")
    # every field must be given: a silently defaulted privacy or model setting would train something else
    missing = sorted({f.name for f in dataclasses.fields(TrialConfig)} - {"seed"} - set(cfg))
    if missing:
        raise ConfigError(f"best_config.config.{missing[0]}", "is missing", "use the file the search released")
    config = TrialConfig.from_dict(cfg, where="best_config.config")
    cert = load_certificate(root / "certificate.json")  # verifies ε against its events
    delta = (raw.get("privacy") or {}).get("delta", cert.delta)
    if delta != cert.delta:
        raise ConfigError("best_config.privacy.delta", f"{delta!r} differs from the certificate's δ = {cert.delta:g}",
                          "use the release's files together, unmodified")
    return Release(root, dataset, config, cert)


def _dataset_spec(raw: dict[str, Any]) -> DatasetSpec:
    fields = {f.name: f for f in dataclasses.fields(DatasetSpec)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"best_config.dataset.{unknown[0]}", "unknown key", f"use one of: {', '.join(fields)}")
    missing = sorted(set(fields) - set(raw))
    if missing:
        raise ConfigError(f"best_config.dataset.{missing[0]}", "is missing", "use the file the search released")
    return DatasetSpec(**{k: _coerce(f"best_config.dataset.{k}", v, fields[k].type) for k, v in raw.items()})


# --------------------------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    if args.target_epsilon is not None and not (math.isfinite(args.target_epsilon) and args.target_epsilon > 0):
        raise ConfigError("--target-epsilon", f"{args.target_epsilon} must be > 0", "give a total ε, e.g. 8")
    if args.epochs is not None and not (math.isfinite(args.epochs) and args.epochs > 0):
        raise ConfigError("--epochs", f"{args.epochs} must be > 0", "give e.g. 15")
    if args.use_best_checkpoint:
        for flag in ("target_epsilon", "epochs", "seed"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')}", "has no effect with --use-best-checkpoint",
                                  "drop it: the checkpoint is exported as trained")
        if args.train_on_validation:
            raise ConfigError("--train-on-validation", "has no effect with --use-best-checkpoint",
                              "drop it: the checkpoint was trained on the training split only")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any((out / f).exists() for f in RESULT_FILES)):
        raise ConfigError("--out", f"{str(out)!r} already holds a result", "choose a new --out directory")


def _main(args: argparse.Namespace) -> int:
    _check_args(args)
    release = load_release(args.release)
    cert = release.certificate
    if args.use_best_checkpoint and not (release.path / "best_checkpoint.pt").is_file():
        raise ConfigError("--use-best-checkpoint", f"{release.path}/best_checkpoint.pt does not exist",
                          "rerun the search with --save-checkpoint (charged again), or train without this flag")
    ledger = None
    if not args.use_best_checkpoint:  # open no ledger when nothing will be charged
        if not Path(args.ledger).is_file():
            raise ConfigError("--ledger", f"{args.ledger!r} does not exist",
                              "pass the ledger the search charged, e.g. --ledger runs/ledger.sqlite")
        ledger = Ledger(args.ledger)

    from dptune.data import load_dataset  # torch loads only once the inputs are known to be good

    data = load_dataset(release.dataset)
    if data.pool_fingerprint() != cert.dataset_fingerprint:
        raise ConfigError("--release", "this release was certified for another dataset (fingerprint "
                          f"{cert.dataset_fingerprint[:12]} ≠ {data.pool_fingerprint()[:12]})",
                          "train on the data the search ran on, or run a new search on this data")
    out = Path(args.out)
    if args.use_best_checkpoint:
        return _export_checkpoint(release, data, out, args.device)
    assert ledger is not None
    return _train(args, release, data, ledger, out)


def _train(args: argparse.Namespace, release: Release, data: Any, ledger: Ledger, out: Path) -> int:
    cert = release.certificate
    fingerprint = cert.dataset_fingerprint
    budget = ledger.budget(fingerprint)
    if budget is None:
        raise ConfigError("--ledger", f"dataset {fingerprint[:12]} has no privacy budget in {args.ledger}",
                          "pass --ledger the search charged, or set a budget: python -m dptune.ledger set-budget "
                          f"--ledger {args.ledger} --fingerprint {fingerprint} --epsilon E --delta D")
    run_name = str(cert.details.get("run", release.path.parent.name))
    if not any(c.name == run_name for c in ledger.charges(fingerprint)):
        print(f"WARNING: {args.ledger} holds no charge for search {run_name!r}: is it the ledger the search used? "
              "(otherwise this ledger undercounts what was spent on the dataset)", file=sys.stderr)
    if args.train_on_validation:  # the validation split's scores were charged; now it is training data too
        import torch

        merged = (torch.cat([data.train[0], data.val[0]]), torch.cat([data.train[1], data.val[1]]))
        data = dataclasses.replace(data, train=merged)  # val stays for run_trial's internal, unreleased score
    n = int(len(data.train[1]))
    seed = args.seed if args.seed is not None else secrets.randbits(62)  # drives the DP noise: secret
    # no score is released by final training: score_noise None, and the event has no score part
    config = release.config.replace(seed=seed, score_noise=None)
    if args.epochs is not None:
        config = config.replace(epochs=float(args.epochs))
    q = sampling_rate(batch_size=config.batch_size, basis=n)
    steps = trial_steps(epochs=config.epochs, batch_size=config.batch_size, basis=n)
    prior = [e for _, e in cert.events]
    if args.target_epsilon is not None:
        try:
            sigma = calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=cert.delta,
                                               target_epsilon=args.target_epsilon)
        except ConfigError as e:
            raise (e.renamed("--target-epsilon") if e.field == "target_epsilon" else e) from e
        config = config.replace(noise_multiplier=sigma)
    event = trial_event(noise_multiplier=config.noise_multiplier, sampling_rate=q, steps=steps, score_noise=None)
    train_eps = epsilon([event], cert.delta)
    summary = {"noise_multiplier": config.noise_multiplier, "sampling_rate": q, "steps": steps,
               "epochs": config.epochs, "batch_size": config.batch_size, "n_train": n,
               "train_on_validation": bool(args.train_on_validation), "target_epsilon": args.target_epsilon,
               "epsilon_alone": train_eps}
    composed = cert.compose_with("final_training", event, details={"final_training": summary})
    if args.target_epsilon is not None and composed.epsilon > args.target_epsilon * (1 + 1e-9):
        raise AssertionError(f"calibration missed: {composed.epsilon} > {args.target_epsilon}")  # pragma: no cover

    if args.seed is not None:
        print("WARNING: --seed fixes the final training's DP noise: NOT PRIVATE (tests/reproducibility only).",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    _write_private(out / "private_seed.json", {"seed": seed, "note": "drives the final training's DP noise: keep "
                                               "it private; publishing it with the model voids the guarantee"})
    # rule 4: the charge is durable before training touches data; refused (nothing stored) if over budget
    charge_id = ledger.reserve(fingerprint, f"final_training:{run_name}", event)
    print(f"dptune train: charged to the ledger before training (#{charge_id}): epsilon = {train_eps:.4f} alone "
          f"(noise multiplier {config.noise_multiplier:.4f}, q = {q:.4g}, {steps} steps, n = {n})")
    started = time.time()
    from dptune import dpsgd

    try:
        result = dpsgd.run_trial(config, data, device=_device(args.device), evaluate_test=True, return_model=True)
    except BaseException:
        print(f"error: final training failed; ledger charge #{charge_id} stays reserved and counts "
              "(the training may have touched the data)", file=sys.stderr)
        raise
    ledger.commit(charge_id)
    assert result.model_state is not None and result.test_accuracy is not None
    if result.steps != steps:  # the accountant must have charged exactly what ran
        raise AssertionError(f"ran {result.steps} steps, charged {steps}")  # pragma: no cover

    _save_model(out / "model.pt", result.model_state, config, release.dataset)
    metrics = {"test_accuracy": result.test_accuracy, "test_accuracy_kind": TEST_NOTE, "steps": result.steps,
               "seconds": result.seconds, "started": started, "diverged": result.diverged,
               "clipping_mode": result.clipping_mode, "ledger_charge": charge_id, "release": str(release.path),
               **{k: v for k, v in summary.items() if k != "steps"}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    composed.save(out / "certificate.json")

    if result.diverged:
        print("WARNING: training diverged (non-finite loss or weights); the charge is spent all the same",
              file=sys.stderr)
    print(f"  test accuracy: {result.test_accuracy:.4f} ({TEST_NOTE})")
    print(f"  privacy: search epsilon = {cert.epsilon:.4f}, final training epsilon = {train_eps:.4f} alone, "
          f"total epsilon = {composed.epsilon:.4f} (RDP composition; the sum would be "
          f"{cert.epsilon + train_eps:.4f}), delta = {cert.delta:g}")
    print(f"  files: {out}/model.pt, {out}/metrics.json, {out}/certificate.json "
          f"({out}/private_seed.json is private)")
    return 0


def _export_checkpoint(release: Release, data: Any, out: Path, device: str | None) -> int:
    """The search's best model, released under the search's certificate: nothing new touches the data
    except the (non-private, uncharged) test evaluation."""
    import torch

    from dptune import dpsgd

    ckpt = torch.load(release.path / "best_checkpoint.pt", map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "model_state" not in ckpt or "config" not in ckpt:
        raise ConfigError("best_checkpoint.pt", "is not a dptune checkpoint", "use the file the search released")
    trained = {k: v for k, v in dict(ckpt["config"]).items() if k != "seed"}
    expected = release.config.to_public_dict()
    if trained != expected:
        raise ConfigError("best_checkpoint.pt", "was trained with another config than best_config.yaml",
                          "use the release's files together, unmodified")
    config = release.config
    dev = torch.device(_device(device))
    model = dpsgd.init_model(config, data).to(dev)
    model.load_state_dict(ckpt["model_state"])
    model.eval()
    correct = 0
    x, y = data.test
    with torch.no_grad():
        for i in range(0, len(y), 1024):
            correct += int((model(x[i:i + 1024].to(dev)).argmax(1).cpu() == y[i:i + 1024]).sum())
    accuracy = correct / len(y)

    out.mkdir(parents=True, exist_ok=True)
    _save_model(out / "model.pt", ckpt["model_state"], config, release.dataset)
    shutil.copyfile(release.path / "certificate.json", out / "certificate.json")  # unchanged: no new charge
    metrics = {"test_accuracy": accuracy, "test_accuracy_kind": TEST_NOTE, "steps": None, "seconds": 0.0,
               "source": "best_checkpoint.pt", "release": str(release.path)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    cert = release.certificate
    print("dptune train: exported the search's best checkpoint (no new charge)")
    print(f"  test accuracy: {accuracy:.4f} ({TEST_NOTE})")
    print(f"  privacy: epsilon = {cert.epsilon:.4f}, delta = {cert.delta:g} (the search's certificate, unchanged)")
    print(f"  files: {out}/model.pt, {out}/metrics.json, {out}/certificate.json")
    return 0


# --------------------------------------------------------------------------------------------------


def _device(name: str | None) -> str:
    if name:
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _save_model(path: Path, state: dict[str, Any], config: TrialConfig, dataset: DatasetSpec) -> None:
    import torch

    torch.save({"model_state": state, "config": config.to_public_dict(), "dataset": dataclasses.asdict(dataset)},
               path)


def _write_private(path: Path, payload: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # owner-only from the first byte
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
