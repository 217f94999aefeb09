"""Final DP training of a released config, charged and certified with the search (library side of
``python -m dptune.train`` and ``dptune.train()``).

release (best_config.yaml + certificate.json, ε recomputed) → the search's sealed record and ledger (the
certificate must be that ledger's authenticated charge for that search) → data (fingerprint must match) →
σ (released, or calibrated so search ⊕ training fits ``target_epsilon``) → the model checked as the search
checks it (``dpsgd.validate_model``: a model Opacus cannot train is exit 2, nothing charged) →
ledger.reserve (durable, before training) → DP-SGD with a fresh 128-bit secret seed (sealed) → ledger.commit
→ model.pt, metrics.json, composed and re-bound certificate.json (shareable: no seed, no ledger row, no
timing, no local path).
"""

from __future__ import annotations

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
from typing import Any, NoReturn

from dptune.accounting import TrialPoint, calibrate_final
from dptune.certificate import Certificate, guarantee, verify_binding
from dptune.config import DatasetSpec, TrialConfig, later_defaults
from dptune.errors import ConfigError
from dptune.ledger import Ledger, ledger_location
from dptune.release import Release, load_release, public_dataset
from dptune.rundir import RunDir, write_private

__all__ = ["RESULT_FILES", "FinalModel", "TrainRequest", "TrainingDiverged", "check_request", "checkpoint_config",
           "run_final"]

RESULT_FILES = ("model.pt", "metrics.json", "certificate.json")
TEST_NOTE = "usual non-private held-out evaluation on the test split (not charged, not DP)"


@dataclass(frozen=True)
class FinalModel:
    """What final training wrote (all shareable) and what it cost."""

    out: Path
    model: Path
    metrics: dict[str, Any]
    certificate: Certificate

    @property
    def epsilon(self) -> float:
        return self.certificate.epsilon


class TrainingDiverged(Exception):
    """Final training diverged (non-finite weights, decided from the noised parameters): its charge is
    committed (the training touched the data), ``out`` holds its certificate and a metrics.json saying it
    diverged, and no model."""

    def __init__(self, out: Path, certificate: Certificate) -> None:
        super().__init__(f"final training diverged (non-finite weights): no model was written. Its charge is spent "
                         f"and recorded (total epsilon = {certificate.epsilon:.4f}; {out}/certificate.json, "
                         f"{out}/metrics.json). Train again with a smaller learning rate or more noise "
                         "(a new charge), or use --use-best-checkpoint")
        self.out = out
        self.certificate = certificate


@dataclass(frozen=True)
class TrainRequest:
    """One final training (field names as the CLI's flags)."""

    release: str | Path
    out: str | Path
    ledger: str | Path | None = None  # only the ledger the search recorded is accepted
    run: str | Path | None = None  # the search's run dir (default: the release's parent)
    target_epsilon: float | None = None
    train_on_validation: bool = False
    use_best_checkpoint: bool = False
    epochs: float | None = None
    device: str | None = None
    seed: int | None = None  # NOT PRIVATE


def check_request(req: TrainRequest) -> None:
    if req.target_epsilon is not None and not (math.isfinite(req.target_epsilon) and req.target_epsilon > 0):
        raise ConfigError("--target-epsilon", f"{req.target_epsilon} must be > 0", "give a total ε, e.g. 8")
    if req.epochs is not None and not (math.isfinite(req.epochs) and req.epochs > 0):
        raise ConfigError("--epochs", f"{req.epochs} must be > 0", "give e.g. 15")
    if req.use_best_checkpoint:
        for flag in ("target_epsilon", "epochs", "seed"):
            if getattr(req, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')}", "has no effect with --use-best-checkpoint",
                                  "drop it: the checkpoint is exported as trained")
        if req.train_on_validation:
            raise ConfigError("--train-on-validation", "has no effect with --use-best-checkpoint",
                              "drop it: the checkpoint was trained on the training split only")
    out = Path(req.out)
    if out.exists() and (not out.is_dir() or any((out / f).exists() for f in RESULT_FILES)):
        raise ConfigError("--out", f"{str(out)!r} already holds a result", "choose a new --out directory")


@dataclass(frozen=True)
class _Curator:
    """What only the curator's machine has: the search's sealed record and the ledger that charged it."""

    run: RunDir
    state: dict[str, Any]
    ledger: Ledger


def _curator(req: TrainRequest, release: Release) -> _Curator:
    """The sealed record of the search that made ``release`` and its ledger; the certificate must be that
    ledger's authenticated charge for this very search (an edited or borrowed certificate is refused)."""
    run = RunDir(Path(req.run) if req.run else release.path.parent)
    state = run.read_state()
    if "charge_id" not in state:
        raise ConfigError("--release", f"no sealed search record at {run.state_file}: final training needs the "
                          "search's sealed/ directory and ledger (on the curator's machine)",
                          "point --release at runs/<name>/release beside its sealed/, or pass --run runs/<name>")
    where, given = ledger_location(state["ledger"]), ledger_location(req.ledger) if req.ledger else None
    if given is not None and not given.same(where) and not (  # recorded: the URL without a password, and its id
            given.is_postgres and Ledger(given, read_only=True).same_ledger(state["ledger"], state.get("ledger_id"))):
        # (read-only: comparing sets no database up; the same ledger however it is reached)
        raise ConfigError("--ledger", f"the search was charged to {where}, not {given}",
                          "drop --ledger: final training charges the ledger the search recorded")
    if not where.is_postgres and not where.path.is_file():
        raise ConfigError("--ledger", f"the search's ledger {str(where)!r} does not exist",
                          "restore it: every charge on this dataset is in it")
    ledger = Ledger(given or where)  # the same ledger, as given (a URL may carry how to log in)
    # the binding covers every field of the certificate and the files beside it (best_config.yaml, and
    # best_checkpoint.pt when released): another search's config or an edited guarantee is refused here
    charges = verify_binding(release.certificate, ledger, folder=release.path)
    if charges[0].id != int(state["charge_id"]):
        raise ConfigError("certificate.binding", f"certifies another search than {run.root.name!r}",
                          "use the certificate this search released, unmodified")
    _check_reproducible(run, release.certificate)
    return _Curator(run, state, ledger)


def _check_reproducible(run: RunDir, cert: Certificate) -> None:
    """The sealed draw says whether the search's randomness was fixed; the certificate must say the same
    (final training's own guarantee starts from the draw, not from the certificate's word)."""
    try:
        reproducible = json.loads(run.draw_file.read_text())["reproducible"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("--release", f"the search's sealed draw {run.draw_file} is missing or unreadable",
                          "final training needs the search's sealed/ directory, as the search left it") from e
    if not isinstance(reproducible, bool) or reproducible != bool(cert.guarantee.get("reproducible")):
        raise ConfigError("certificate.guarantee.reproducible", f"says {cert.guarantee.get('reproducible')!r}, but "
                          f"the search's sealed draw says {reproducible!r}",
                          "use the certificate this search released, unmodified")


def run_final(req: TrainRequest) -> FinalModel:
    check_request(req)
    release = load_release(req.release)
    if req.use_best_checkpoint and not (release.path / "best_checkpoint.pt").is_file():
        raise ConfigError("--use-best-checkpoint", f"{release.path}/best_checkpoint.pt does not exist",
                          "rerun the search with --save-checkpoint (charged again), or train without this flag")
    cur = _curator(req, release)
    os.umask(0o077)

    from dptune.data import load_dataset  # torch loads only once the inputs are known to be good

    data = load_dataset(_local_dataset(release, cur))
    if data.pool_fingerprint() != cur.state.get("fingerprint"):
        raise ConfigError("--release", "the data differ from what the search ran on",
                          "train on the data the search ran on, or run a new search on this data")
    out = Path(req.out)
    if req.use_best_checkpoint:
        return _export_checkpoint(release, data, out, req.device)
    return _train(req, release, data, cur, out)


def _local_dataset(release: Release, cur: _Curator) -> DatasetSpec:
    """The release's dataset at the path the search read (the sealed run spec: a shared release carries only
    the path's last component)."""
    sealed = (cur.state.get("run_spec") or {}).get("dataset") or {}
    path = sealed.get("path", release.dataset.path)
    if release.dataset.path and (not path or Path(str(path).rstrip("/")).name != release.dataset.path):
        raise ConfigError("best_config.dataset.path", "names another dataset than the search's sealed record",
                          "use the release this search wrote, unmodified")
    return dataclasses.replace(release.dataset, path=path)


def _calibrated(req: TrainRequest, release: Release, n: int, seed: int) -> tuple[TrialConfig, Any, dict]:
    cert = release.certificate
    target, source = release.final_target(req.target_epsilon)
    print(f"dptune train: total epsilon target {'-' if target is None else f'{target:g}'}, from {source}")
    config = release.config.replace(seed=seed)
    if req.epochs is not None:
        config = config.replace(epochs=float(req.epochs))
    try:  # σ after the search's events (no score: final training releases none), lr by the transfer rule
        cal = calibrate_final(config, n_train=n, delta=cert.delta, prior_events=[e for _, e in cert.events],
                              target_epsilon=target, lr_times_sigma=release.lr_times_sigma)
    except ConfigError as e:
        field = "--target-epsilon" if req.target_epsilon is not None else "best_config.privacy.target_epsilon"
        raise (e.renamed(field) if e.field == "target_epsilon" else e) from e
    config = cal.config
    summary = {"noise_multiplier": config.noise_multiplier, "sensitivity": cal.sensitivity,
               "sampling_rate": cal.sampling_rate, "steps": cal.steps, "epochs": config.epochs,
               "batch_size": config.batch_size, "n_train": n, "learning_rate": config.learning_rate,
               "train_on_validation": bool(req.train_on_validation), "target_epsilon": target,
               "epsilon_alone": cal.epsilon_alone()}
    return config, cal.event, summary


def _train(req: TrainRequest, release: Release, data: Any, cur: _Curator, out: Path) -> FinalModel:
    cert = release.certificate
    if req.train_on_validation:  # the validation split's scores were charged; now it is training data too
        import torch

        merged = (torch.cat([data.train[0], data.val[0]]), torch.cat([data.train[1], data.val[1]]))
        data = dataclasses.replace(data, train=merged)  # val stays for run_trial's internal, unreleased score
    n = int(len(data.train[1]))
    # the final training's DP noise: 128 bits of OS entropy (a narrow seed could be enumerated), sealed
    seed = req.seed if req.seed is not None else secrets.randbits(128)
    config, event, summary = _calibrated(req, release, n, seed)
    composed = cert.compose_with("final_training", event, details={"final_training": summary})
    if (target := summary["target_epsilon"]) is not None and composed.epsilon > target * (1 + 1e-9):
        raise AssertionError(f"calibration missed: {composed.epsilon} > {target}")  # pragma: no cover
    if req.seed is not None:
        print("WARNING: --seed fixes the final training's DP noise: NOT PRIVATE (tests/reproducibility only).",
              file=sys.stderr)
        composed = dataclasses.replace(composed, guarantee=guarantee(reproducible=True))
    from dptune import dpsgd

    # a model Opacus cannot train (BatchNorm, an unsupported layer, ...) is exit 2 here, nothing charged
    dpsgd.validate_model(config, data.num_classes, data.input_shape)
    out.mkdir(parents=True, exist_ok=True)
    sealed = _SealedFinal(cur.run, out, seed)
    # rule 4: the charge is durable before training touches data; refused (nothing stored) if over budget —
    # the ledger already holds every charge the certificate composes (verified above), so this checks the total
    # every budget the search was charged to (the data overlaps each) pays for final training too
    budgets = cur.state.get("budget_fingerprints") or [cur.state["budget_fingerprint"]]
    charge_id = cur.ledger.reserve(budgets, f"final_training:{cur.run.root.name}", event, n=n)
    sealed.write(ledger_charge=charge_id, started=time.time())
    print(f"dptune train: charged to the ledger {cur.ledger.path} before training: epsilon = {summary['epsilon_alone']:.4f} alone "
          f"(noise multiplier {config.noise_multiplier:.4f}, q = {summary['sampling_rate']:.4g}, "
          f"{summary['steps']} steps, n = {n})")
    try:
        charged = TrialPoint(noise_multiplier=config.noise_multiplier / summary["sensitivity"],
                             sampling_rate=summary["sampling_rate"],
                             steps=summary["steps"], score_noise=None)
        result = dpsgd.run_trial(config, data, device=_device(req.device), evaluate_test=True, return_model=True,
                                 charged_points=[charged])  # refuses to start unless it runs what was charged
    except BaseException:
        print("error: final training failed; its ledger charge stays reserved and counts "
              "(the training may have touched the data)", file=sys.stderr)
        raise
    cur.ledger.commit(charge_id)  # it ran (diverged or not): the charge is spent
    sealed.write(seconds=result.seconds, diverged=result.diverged, release=str(release.path))
    tokens = [*cert.tokens(), cur.ledger.charge(charge_id).token]
    if result.diverged:  # stopped at non-finite weights (post-processing of the noised parameters): no model
        _diverged(out, composed, cur.ledger, tokens, summary)
    assert result.model_state is not None and result.test_accuracy is not None
    if summary["steps"] != result.steps or summary["steps"] != result.noise_additions:  # the charge is what ran
        raise AssertionError(f"ran {result.steps} steps ({result.noise_additions} noise additions), "
                             f"charged {summary['steps']}")  # pragma: no cover
    _save_model(out / "model.pt", result.model_state, config, release.dataset)
    metrics = {"test_accuracy": result.test_accuracy, "test_accuracy_kind": TEST_NOTE,
               "clipping_mode": result.clipping_mode, **summary}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    composed = composed.bind(cur.ledger, tokens, {"model.pt": out / "model.pt", "metrics.json": out / "metrics.json"})
    composed.save(out / "certificate.json")
    _print_result(result, cert, composed, summary["epsilon_alone"], out, sealed.path)
    return FinalModel(out, out / "model.pt", metrics, composed)


def _diverged(out: Path, composed: Certificate, ledger: Ledger, tokens: list[str],
              summary: dict[str, Any]) -> NoReturn:
    """A diverged final training's result: its (committed) charge in a bound certificate, a metrics.json that
    says it diverged, no model; raises :class:`TrainingDiverged`."""
    metrics = {"diverged": True, "result": "final training diverged (non-finite weights): no model",
               "test_accuracy": None, **summary}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    composed = composed.bind(ledger, tokens, {"metrics.json": out / "metrics.json"})
    composed.save(out / "certificate.json")
    raise TrainingDiverged(out, composed)


class _SealedFinal:
    """Curator-side record of one final training (its seed, ledger row, timing): in the search's sealed/,
    never beside the model that a user will share."""

    def __init__(self, run: RunDir, out: Path, seed: int) -> None:
        folder = run.sealed / "final"
        folder.mkdir(mode=0o700, exist_ok=True)
        self.path = folder / f"{out.name}-{secrets.token_hex(4)}.json"
        self.record: dict[str, Any] = {"seed": str(seed), "out": str(out.resolve()),
                                       "note": "the seed drives the final training's DP noise: never publish it"}

    def write(self, **fields: Any) -> None:
        self.record.update(fields)
        write_private(self.path, json.dumps(self.record, indent=1))


def _print_result(result: Any, cert: Certificate, composed: Certificate, train_eps: float, out: Path,
                  sealed: Path) -> None:
    print(f"  test accuracy: {result.test_accuracy:.4f} ({TEST_NOTE})")
    print(f"  privacy: search epsilon = {cert.epsilon:.4f}, final training epsilon = {train_eps:.4f} alone, "
          f"total epsilon = {composed.epsilon:.4f} ({composed.bound.upper()} composition; the sum would be "
          f"{cert.epsilon + train_eps:.4f}), delta = {cert.delta:g}")
    print(f"  files: {out}/model.pt, {out}/metrics.json, {out}/certificate.json (shareable); "
          f"seed and run record sealed in {sealed}")


def checkpoint_config(release: Release) -> TrialConfig:
    """The config the released checkpoint was trained with. A search that planned its final run releases the
    final run's settings (its σ_f and the rule lr·σ = L·σ_f); its best trial, whose model the checkpoint is, ran
    the same config at the cheap trials' σ_c, with lr = L·σ_f/σ_c (the certificate's ``details.transfer``, or
    ``details.scaled`` in certificates from before every searcher could plan its final run)."""
    if release.lr_times_sigma is None:
        return release.config
    key = "transfer" if "transfer" in release.certificate.details else "scaled"
    planned = release.certificate.details.get(key) or {}
    c = release.config
    points = planned.get("points")
    if points is None:  # one σ_c for every trial (certificates from before each (B, E) had its own)
        sigma = planned.get("trial_noise_multiplier")
    else:  # σ_c of the released config's (B, E)
        sigma = next((p.get("trial_noise_multiplier") for p in points if isinstance(p, dict)
                      and p.get("batch_size") == c.batch_size and p.get("epochs") == c.epochs), None)
    if isinstance(sigma, bool) or not isinstance(sigma, int | float) or not 0 < sigma < math.inf:
        raise ConfigError(f"certificate.details.{key}.trial_noise_multiplier", f"{sigma!r} is not a positive number "
                          f"(for batch size {c.batch_size}, epochs {c.epochs:g})",
                          "use the certificate the search released, unmodified")
    return release.config.replace(noise_multiplier=float(sigma), learning_rate=release.lr_times_sigma / sigma)


def _export_checkpoint(release: Release, data: Any, out: Path, device: str | None) -> FinalModel:
    """The search's best model, released under the search's certificate: nothing new touches the data
    except the (non-private, uncharged) test evaluation."""
    import torch

    from dptune import dpsgd

    ckpt = dpsgd.load_model(release.path / "best_checkpoint.pt")
    # a checkpoint from before a later field existed was trained at that field's default
    trained = {**later_defaults(TrialConfig), **{k: v for k, v in dict(ckpt["config"]).items() if k != "seed"}}
    config = checkpoint_config(release)
    expected = config.to_public_dict()
    if {**trained, "learning_rate": 0} != {**expected, "learning_rate": 0} or not math.isclose(
            trained["learning_rate"], expected["learning_rate"], rel_tol=1e-9):
        raise ConfigError("best_checkpoint.pt", "was trained with another config than best_config.yaml",
                          "use the release's files together, unmodified")
    config = config.replace(learning_rate=float(trained["learning_rate"]))
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
    metrics = {"test_accuracy": accuracy, "test_accuracy_kind": TEST_NOTE, "steps": None,
               "source": "best_checkpoint.pt"}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    cert = release.certificate
    print("dptune train: exported the search's best checkpoint (no new charge)")
    print(f"  test accuracy: {accuracy:.4f} ({TEST_NOTE})")
    print(f"  privacy: epsilon = {cert.epsilon:.4f}, delta = {cert.delta:g} (the search's certificate, unchanged)")
    print(f"  files: {out}/model.pt, {out}/metrics.json, {out}/certificate.json")
    return FinalModel(out, out / "model.pt", metrics, cert)


# --------------------------------------------------------------------------------------------------


def _device(name: str | None) -> str:
    if name:
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _save_model(path: Path, state: dict[str, Any], config: TrialConfig, dataset: DatasetSpec) -> None:
    from dptune import dpsgd

    dpsgd.save_model(path, state, config.to_public_dict(), dataset=public_dataset(dataset))  # no local path


