"""What leaves ``sealed/``: one home for every release decision of a search (rule 3). No Ray, no torch.

* :func:`select_best` — the best trial: highest released score, ties to the lowest index; crashed and
  diverged trials count with score −∞ (rule 5), so they are selected only when nothing else ran;
* :func:`select_noisy_max` — ``privacy.selection: noisy_max``: report-noisy-max over the trials' validation
  correct-counts (the exponential mechanism, charged once as ``NoisyMaxDpEvent``); :func:`select` picks
  the space's rule;
* :func:`released_params` — K = 0 releases the space's declared default (rule 1); with subsample tuning
  the transfer rule moves the selected config to the full data;
* :func:`release_document` — ``best_config.yaml``: the complete config, no seed, no internal field;
* :func:`search_certificate` — the certificate, built from the event the ledger charged;
* :func:`write_release` — the files, bound to the certificate, with mtime and atime set to the reservation
  time (the search's duration, and so roughly K, must not be readable from what is shipped), and
  :func:`pack_release` — ``release.tar`` beside the folder, whose only times are the reservation's (a
  file's ctime cannot be set: ship the archive, not the folder).

``dptune.search``, the Python API and ``bench/tuning_value.py`` all call these.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from dp_accounting import dp_event as de

from dptune.accounting import Plan, TransferPlan, transfer_config
from dptune.certificate import Certificate, load_certificate
from dptune.config import INTERNAL_FIELDS, DatasetSpec, SearchSpace, TrialConfig, coerce_value, later_defaults
from dptune.errors import ConfigError
from dptune.trials import TrialRow

__all__ = ["NOT_USER_SET", "Release", "load_release", "pack_release", "public_dataset", "release_document", "released_params",
           "search_certificate", "select", "select_best", "select_noisy_max", "user_config", "write_release"]

# TrialConfig fields no space sets: the trial's secret seed (never released), the score noise (derived from
# privacy:) and alc's per-layer clip norms (computed from public data). best_config.yaml keeps the last two
# (final training reads them); what a user is shown as the released config leaves them out.
NOT_USER_SET = (*INTERNAL_FIELDS, "score_noise", "layer_clip")


def select_best(rows: Sequence[TrialRow]) -> TrialRow | None:
    """The trial to release; None when K = 0 (no trial ran)."""
    return max(rows, key=lambda r: r.rank_key) if rows else None


def select_noisy_max(rows: Sequence[TrialRow], *, gumbel_scale: float, n_val: int,
                     seed: int) -> tuple[TrialRow | None, list[float]]:
    """Report-noisy-max: the trial maximising its validation correct-count plus Gumbel(0, ``gumbel_scale``)
    noise, and the noised counts (sealed: the noised values are not private to release, only the index is).

    The counts are the trials' raw validation accuracies × ``n_val`` (sealed; the trials released nothing).
    A crashed or diverged trial has count −∞ (rule 5: it counts, and is chosen only if nothing else ran;
    divergence is decided from the noised parameters, so which trials are eligible is post-processing of
    the charged training). Trial i gets the i-th draw of the stream ``seed`` (the sealed draw's 128-bit
    "selection" stream), so a resumed search selects exactly as an uninterrupted one. Ties: lowest index.
    """
    if not rows:
        return None, []
    if not (math.isfinite(gumbel_scale) and gumbel_scale > 0) or n_val < 1:
        raise ValueError(f"noisy max needs gumbel_scale > 0 and n_val >= 1, got {gumbel_scale!r}, {n_val!r}")
    k = max(r.index for r in rows) + 1
    gumbel = np.random.default_rng(seed).gumbel(0.0, gumbel_scale, size=k)
    noised = []
    for r in rows:
        raw = r.val_accuracy_raw
        ok = not (r.crashed or r.diverged) and raw is not None and math.isfinite(raw)
        noised.append(round(raw * n_val) + float(gumbel[r.index]) if ok else -math.inf)  # type: ignore[operator]
    best = max(range(len(rows)), key=lambda i: (noised[i], -rows[i].index))
    return rows[best], noised


def select(space: SearchSpace, rows: Sequence[TrialRow], *, n_val: int, seed: int) -> TrialRow | None:
    """The trial to release under the space's ``privacy.selection`` (``seed``: the sealed selection stream)."""
    if space.scheduler == "asha":  # the trials ASHA trained to the end, when there are any
        top = [r for r in rows if r.measured.get("rung", -1) == r.measured.get("rungs", 0) - 1]
        rows = top or rows
    if space.privacy.selection != "noisy_max":
        return select_best(rows)
    assert space.privacy.score_noise is not None  # config.check_privacy
    return select_noisy_max(rows, gumbel_scale=space.privacy.score_noise, n_val=n_val, seed=seed)[0]


def released_params(space: SearchSpace, best: TrialRow | None, n_train: int, *,
                    transfer: TransferPlan | None = None) -> tuple[dict[str, Any], float | None]:
    """(searched hyperparameters, score) to release. K = 0: the default config and no score.

    With ``search.tune_fraction`` f < 1 the trial ran on a Poisson subsample at q = B/(f·n); the transfer
    rule keeps q (batch size B/f on the full data), epochs, learning rate and σ (``transfer_config``).
    A search that planned its final run (``transfer``) releases the final-run config its best trial stood for
    (the trial ran it at the cheap σ_c, lr scaled) with the σ_f the budget leaves for it and the final run's lr. A noisy-max selection
    releases the index only: no score (the trial's sealed score is its raw validation accuracy).
    """
    params = {k: getattr(space.default, k) for k in space.space} if best is None else dict(best.params)
    if transfer is not None:  # the final run's σ_f and lr (L, or L·(B/ref)^p under search.lr_reference_batch)
        final = transfer.final_config(space.fixed.replace(**params))
        params.update(noise_multiplier=final.noise_multiplier, learning_rate=final.learning_rate)
    if best is None:
        return params, None
    if space.tune_fraction < 1:
        params = transfer_config(params, fraction=space.tune_fraction, n_train=n_train)
    score = best.rank_key[0]
    if space.privacy.selection == "noisy_max" or score == float("-inf"):
        return params, None
    return params, float(score)


def user_config(config: Mapping[str, Any], searched: Iterable[str] = ()) -> dict[str, Any]:
    """The hyperparameters of a released ``config`` that a user sets (a space's ``space:``, ``fixed:`` and
    ``model:`` keys), the ``searched`` ones first; nothing internal or derived (:data:`NOT_USER_SET`)."""
    first = sorted(k for k in set(searched) if k in config)
    rest = sorted(k for k in config if k not in first and k not in NOT_USER_SET)
    return {k: config[k] for k in [*first, *rest]}


def public_dataset(spec: DatasetSpec) -> dict[str, Any]:
    """A dataset spec as shared files carry it (best_config.yaml, model.pt): ``path`` cut to its last component
    (a local absolute path names the curator's machine and folders; final training reads the full path from
    the search's sealed record)."""
    out = dataclasses.asdict(spec)
    if out.get("path"):
        out["path"] = Path(str(out["path"]).rstrip("/")).name or None
    return out


def release_document(space: SearchSpace, params: dict[str, Any], score: float | None, *,
                     transfer: TransferPlan | None = None) -> dict[str, Any]:
    """The content of ``best_config.yaml`` (no seed: whoever trains the config draws a fresh one). A search
    that planned its final run adds its rule: final training sets lr = lr_times_sigma / σ."""
    private = not space.dataset.public_validation
    kind = "validation accuracy" + (f" + Gaussian noise (std {space.privacy.score_noise:g} on the correct-count)"
                                    if private else " (public split)")
    if space.privacy.selection == "noisy_max":
        kind = (f"not released: the candidate was chosen by report-noisy-max (Gumbel noise of scale "
                f"{space.privacy.score_noise:g} on each trial's validation correct-count), which releases only "
                "which candidate won")
    doc: dict[str, Any] = {
        "released_by": "dptune.search",
        "space": space.name,
        "dataset": public_dataset(space.dataset),
        "config": space.fixed.replace(**params).to_public_dict(),
        # the space's total budget (search + final training): dptune train's default target (bound with the file)
        "privacy": {"delta": space.privacy.delta, "target_epsilon": space.privacy.target_epsilon},
        "score": score,
        "score_kind": kind,
        "certificate": "certificate.json",
    }
    if space.tune_fraction < 1:
        doc["tuned_on_fraction"] = space.tune_fraction
    if transfer is not None:
        # params is the released final-run config (σ_f, the final run's lr): the rule keeps its lr·σ_f
        doc["scaling_rule"] = {"lr_times_sigma": params["learning_rate"] * params["noise_multiplier"],
                               "rule": "learning_rate = lr_times_sigma / noise_multiplier of the final run "
                                       "(the update noise lr x sigma the trial ran at; Panda et al. 2024)"}
    return doc


def search_certificate(space: SearchSpace, plan: Plan, charged_event: de.DpEvent, *, dataset_id: str,
                       reproducible: bool, created: str, transfer: TransferPlan | None = None,
                       engines: tuple[str, ...] = ()) -> Certificate:
    """The search's certificate. Its event is the one the ledger charged at reserve time (a resumed
    search was checked to plan the same event); the plan supplies only descriptive details. ``engines``: the
    clipping guard's notes (where auto ran another engine than its default, and why), from the public space."""
    details: dict[str, Any] = {
        "kind": "search", "space": space.name, "searcher": space.searcher, "accounting": space.accounting,
        "n_train": plan.n_train, "trial_epsilon": plan.trial_epsilon, "search_epsilon": plan.search_epsilon,
        "worst_case": [dataclasses.asdict(p) for p in plan.points],
    }
    if space.privacy.selection == "noisy_max":
        details["selection"] = {
            "rule": "noisy_max", "gumbel_scale": space.privacy.score_noise,
            "mechanism": "argmax of validation correct-count + Gumbel noise (exponential mechanism); only the "
                         "index is released",
            "charged_as": "NoisyMaxDpEvent: (1/scale)-bounded range, 1/(8 scale^2)-zCDP (Cesar & Rogers 2021), "
                          "(1/scale)-DP; once for the whole search"}
    details["training"] = {
        "program": "each model captured once with torch.fx (train and eval graphs over its own layers); trials and "
                   "scoring run the graphs, not the model's Python",
        "engines": "per-layer clipping engines (hooks, ghost, bookkeeping) only on graphs proven to keep the rows of "
                   "a batch apart for every batch size; otherwise functorch (each example alone)",
        "notes": list(engines)}
    if transfer is not None:
        details["transfer"] = transfer.describe()
    if space.auto is not None:  # space: auto: the public facts, the rules' version and the space derived
        details["auto"] = public_auto(space)
    if space.tune_fraction < 1:
        details.update({
            "tune_fraction": space.tune_fraction, "subsample_rule": "Poisson, drawn once from the sealed seed",
            "trial_sampling_rate_basis": "B/(f*n)",
            "amplification": "Zhu & Wang 2019 Thm 6 on the whole search; validation releases unamplified",
            "transfer_rule": "batch_size / f (same q = B/n), same epochs, learning rate, noise multiplier"})
    return Certificate.build(dataset_id, plan.delta, [("search", charged_event)], plan.stopping.describe(),
                             details, reproducible=reproducible, created=created)


def public_auto(space: SearchSpace) -> dict[str, Any]:
    """What a space derived by ``space: auto`` was derived from and what it is (``space.auto``), as it is released:
    the facts, the rules' version and the derived space file, without the dataset's local path."""
    assert space.auto is not None
    derived = dict(space.auto["space"])
    derived["dataset"] = {k: v for k, v in derived["dataset"].items() if k != "path"}
    return {"rules": space.auto["rules"], "facts": space.auto["facts"], "space": derived}


def day_of(timestamp: float) -> str:
    """The UTC day of a timestamp: the only time a release carries."""
    return time.strftime("%Y-%m-%d", time.gmtime(timestamp))


def write_release(release_dir: Path, document: dict[str, Any], certificate: Certificate, *, ledger: Any,
                  tokens: list[str], mtime: float, checkpoint: Path | None = None,
                  auto_space: dict[str, Any] | None = None) -> Certificate:
    """Write ``best_config.yaml`` (and ``best_checkpoint.pt``), then ``certificate.json`` bound to the ledger
    charges ``tokens`` and to those files' SHA-256 (another search's config beside it is refused by
    ``dptune.train``); every file and the directory stamped with ``mtime`` (the reservation time: reveals
    the start, never the duration). Returns the bound certificate. ``ledger``: the ``dptune.ledger.Ledger``
    that holds the charges (the driver's; this module does not open ledgers)."""
    release_dir.mkdir(exist_ok=True)
    cfg = release_dir / "best_config.yaml"
    # no local path in a shared file: the command names the folder the recipient has
    cfg.write_text("# Released by dptune.search: the best trial's complete config. The curator trains it with\n"
                   "#   python -m dptune.train --release <this folder> --out <a new folder>\n"
                   + yaml.safe_dump(document, sort_keys=False))
    files = {"best_config.yaml": cfg}
    if auto_space is not None:  # the space space: auto derived, beside the config (bound like it)
        files["auto_space.yaml"] = release_dir / "auto_space.yaml"
        files["auto_space.yaml"].write_text(
            "# The space dptune derived from the data's public facts (space: auto) and searched; the certificate "
            "binds it.\n" + yaml.safe_dump(auto_space, sort_keys=False))
    if checkpoint is not None:
        files["best_checkpoint.pt"] = release_dir / "best_checkpoint.pt"
        shutil.copyfile(checkpoint, files["best_checkpoint.pt"])
    bound = certificate.bind(ledger, tokens, files)
    bound.save(release_dir / "certificate.json")
    for f in [*files.values(), release_dir / "certificate.json", release_dir]:
        os.utime(f, (mtime, mtime))
    pack_release(release_dir, release_dir.parent / "release.tar", mtime=mtime)
    return bound


def pack_release(release_dir: Path, out: Path, *, mtime: float) -> Path:
    """``out``: ``release_dir`` as a ustar archive whose only times are ``mtime``: what to ship.

    The folder itself cannot be shipped as is without its local times: a file's ctime is the moment it was
    written (the search's end, so roughly K) and no call sets it; ``tar --format=pax`` and GNU tar's
    defaults copy atime and ctime into the archive. ustar has one time field per entry (mtime, set here),
    no atime or ctime; owner 0, no user or group names, entries sorted."""
    import tarfile

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = int(mtime)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    tmp = out.with_name(f".{out.name}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        tar.add(release_dir, arcname="release", recursive=False, filter=clean)
        for f in sorted(release_dir.iterdir()):
            tar.add(f, arcname=f"release/{f.name}", recursive=False, filter=clean)
    os.replace(tmp, out)
    os.utime(out, (mtime, mtime))
    return out


# ---------------------------------------------------------------------------------------------------
# reading a release back (final training)


@dataclasses.dataclass(frozen=True)
class Release:
    path: Path
    dataset: DatasetSpec
    config: TrialConfig  # seed 0 here: final training draws its own
    certificate: Certificate
    lr_times_sigma: float | None = None  # the scaled searcher's rule: final lr = lr_times_sigma / σ
    target_epsilon: float | None = None  # the space's privacy.target_epsilon: final training's default target

    def final_target(self, explicit: float | None) -> tuple[float | None, str]:
        """The total ε final training calibrates to, and where it comes from: ``explicit`` (``--target-epsilon``),
        else the target this release carries (bound with best_config.yaml), else none (the released σ is kept)."""
        if explicit is not None:
            said = self.target_epsilon
            over = f", instead of the release's {said:g}" if said is not None and said != explicit else ""
            return explicit, f"--target-epsilon {explicit:g}{over}"
        if self.target_epsilon is not None:
            return self.target_epsilon, "the release's privacy.target_epsilon"
        return None, "none (the release names no target): the released noise multiplier"


def load_release(path: str | Path) -> Release:
    """Validate ``best_config.yaml`` and the certificate of a release directory (ConfigError otherwise).
    The certificate's ε is recomputed here; its binding to the ledger is checked by the caller."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError("--release", f"{str(root)!r} is not a directory",
                          "point at runs/<name>/release, written by `python -m dptune.search`")
    raw = _read_yaml(root / "best_config.yaml")
    for key in ("dataset", "config"):
        if not isinstance(raw.get(key), dict):
            raise ConfigError(f"best_config.{key}", "is missing or not a mapping", "use the file the search released")
    dataset = _dataset_spec(raw["dataset"])
    cfg = dict(raw["config"])
    for key in INTERNAL_FIELDS:
        if key in cfg:
            raise ConfigError(f"best_config.config.{key}", "is internal to dptune and never released (a seed drove "
                              "a trial's noise; the sampling basis is the search's own)",
                              "remove it: use the file the search released, unmodified")
    # every field must be given (a silently defaulted privacy or model setting would train something else),
    # except those added since a release was written: read at their defaults, what ran before they existed
    missing = sorted({f.name for f in dataclasses.fields(TrialConfig)} - set(INTERNAL_FIELDS) - set(cfg)
                     - set(later_defaults(TrialConfig)))
    if missing:
        raise ConfigError(f"best_config.config.{missing[0]}", "is missing", "use the file the search released")
    config = TrialConfig.from_dict(cfg, where="best_config.config")
    cert = load_certificate(root / "certificate.json")  # verifies ε against its events
    delta = (raw.get("privacy") or {}).get("delta", cert.delta)
    if delta != cert.delta:
        raise ConfigError("best_config.privacy.delta", f"{delta!r} differs from the certificate's δ = {cert.delta:g}",
                          "use the release's files together, unmodified")
    return Release(root, dataset, config, cert, _scaling_rule(raw), _target(raw))


def _target(raw: dict[str, Any]) -> float | None:
    """``privacy.target_epsilon`` (None: the space set none, or the release predates it)."""
    value = (raw.get("privacy") or {}).get("target_epsilon")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not (math.isfinite(value) and value > 0)):
        raise ConfigError("best_config.privacy.target_epsilon", f"{value!r} is not a positive number",
                          "use the file the search released, unmodified")
    return None if value is None else float(value)


def _scaling_rule(raw: dict[str, Any]) -> float | None:
    rule = raw.get("scaling_rule")
    if rule is None:
        return None
    value = rule.get("lr_times_sigma") if isinstance(rule, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ConfigError("best_config.scaling_rule.lr_times_sigma", f"{value!r} is not a positive number",
                          "use the file the search released, unmodified")
    return float(value)


def _read_yaml(cfg_file: Path) -> dict[str, Any]:
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
    return raw


def _dataset_spec(raw: dict[str, Any]) -> DatasetSpec:
    fields = {f.name: f for f in dataclasses.fields(DatasetSpec)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"best_config.dataset.{unknown[0]}", "unknown key", f"use one of: {', '.join(fields)}")
    missing = sorted(set(fields) - set(raw) - set(later_defaults(DatasetSpec)))
    if missing:
        raise ConfigError(f"best_config.dataset.{missing[0]}", "is missing", "use the file the search released")
    return DatasetSpec(**{k: coerce_value(f"best_config.dataset.{k}", v, fields[k].type) for k, v in raw.items()})
