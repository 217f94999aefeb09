"""The Ray Tune function trainable: one dptune trial (a plain function of ``config``).

Runs inside a Ray worker. Only a data-dependent failure is a trial result: divergence (a non-finite loss,
decided from the noised parameters) scores −∞ and counts (rule 5). Anything that raises (an import, the
model factory, out of memory, a lost worker or node) does not depend on the data: it is infrastructure, so
the trial fails, Ray retries it from its last checkpoint with the same index, seed and hyperparameters, and
if it still fails the search stops with its charge reserved (nothing released) until ``--resume``.
A group of trials (``--group-trials``, ``dptune_group``) is one Ray trial under the same rule: a member whose own
computation raises (the others go on unchanged inside ``dpsgd.run_group``) fails the group as infrastructure,
retried from every member's checkpoint, exactly as that trial alone would fail. An exception is no noised
release: a −∞ score for it would let a raise on the private data pick the released config.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune

from dptune.config import TrialConfig, clipping

__all__ = ["dptune_asha_trial", "dptune_group", "dptune_trial", "stops_on_own_curve"]


def dptune_trial(config: dict[str, Any], *, data: Any, slots: list[dict[str, Any]], fixed: dict[str, Any],
                 threads: int = 1, save_model: bool = False, checkpoint_every: int = 0,
                 adaptive_seed_base: int = 0, sampling_basis: float | None = None,
                 charged_points: list[Any] | None = None, transfer: Any = None) -> None:
    started = time.time()
    import torch

    torch.set_num_threads(threads)
    if "trial_index" in config:  # random search: the i-th of the sealed i.i.d. draws
        index = int(config["trial_index"])
        slot = slots[index]
        params = dict(slot["params"])
    else:  # adaptive searcher (composed accounting): it chose the params; the seed is derived, secret
        index = -1
        slot = {"seed": _adaptive_seed(adaptive_seed_base), "params": {}}
        params = dict(config)
    # the work dir holds the trial's secrets (seed, RNG states): inside Ray's trial dir on this node (under
    # the search's owner-only Ray temp dir), never in /tmp, and removed whatever happens (finally)
    work = _work_dir()
    try:
        _trial_body(work, index, slot, params, started, data=data, fixed=fixed, save_model=save_model,
                    checkpoint_every=checkpoint_every, sampling_basis=sampling_basis, charged_points=charged_points,
                    transfer=transfer)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _work_dir() -> Path:
    trial_dir = Path(tune.get_context().get_trial_dir())
    trial_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="work-", dir=trial_dir))


def _trial_body(work: Path, index: int, slot: dict[str, Any], params: dict[str, Any], started: float, *, data: Any,
                fixed: dict[str, Any], save_model: bool, checkpoint_every: int, sampling_basis: float | None,
                charged_points: list[Any] | None, transfer: Any) -> None:

    from dptune import dpsgd

    ckpt_path = work / "trial.pt"
    attempts = _restore(work)
    device = _device()

    def on_epoch(epoch: int, metrics: dict[str, Any]) -> None:
        if checkpoint_every and epoch % checkpoint_every == 0:
            # intermediate reports carry no score: nothing data-dependent beyond the trial's own loss
            tune.report({"final": False, "epoch": epoch, "trial_index": index},
                        checkpoint=tune.Checkpoint.from_directory(str(work)))

    base: dict[str, Any] = {"final": True, "started": started, "trial_index": index, "params": params,
                            "seed": str(slot["seed"]),
                            "node_id": _node_id(), "attempts": attempts}
    cfg = TrialConfig.from_dict({**fixed, **params, "seed": int(slot["seed"])})
    if transfer is not None:  # params are the final run's: run them at σ_c with lr = L·σ_f(B, E)/σ_c
        cfg = transfer.trial_config(cfg)
    result = dpsgd.run_trial(cfg, data, checkpoint_path=ckpt_path, on_epoch=on_epoch, device=device,
                             return_model=save_model, sampling_basis=sampling_basis,
                             charged_points=charged_points or None)
    metrics = {**base, **_result_metrics(result, device)}
    if save_model and result.model_state is not None:
        out = work / "final"
        out.mkdir()
        dpsgd.save_model(out / "model.pt", result.model_state, cfg.to_public_dict())
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(out)))
        return
    tune.report(metrics)


class TrialRaised(RuntimeError):
    """A group member's own exception, re-raised for the group (its text goes to sealed/logs only)."""


def _result_metrics(result: Any, device: str) -> dict[str, Any]:
    """A finished trial's report fields (``TrialRow.from_metrics``)."""
    return {"score": float(result.score), "val_accuracy_raw": float(result.val_accuracy_raw),
            "diverged": bool(result.diverged), "crashed": False, "error": "", "steps": int(result.steps),
            "sampling_rate": float(result.sampling_rate), "noise_multiplier": float(result.noise_multiplier),
            "seconds": float(result.seconds), "clipping_mode": result.clipping_mode,
            "measured": {**_measured(result), "device": device}}


def dptune_group(config: dict[str, Any], *, data: Any, slots: list[dict[str, Any]], groups: list[list[int]],
                 fixed: dict[str, Any], threads: int = 1, checkpoint_every: int = 0,
                 sampling_basis: float | None = None, charged_points: list[Any] | None = None,
                 transfer: Any = None) -> None:
    """A group of the sealed draw's trials (``tuning.grouping``) as one Ray trial: ``dpsgd.run_group`` trains them
    as one computation, each exactly as if it ran alone, and one final report carries each member's own row
    (``trials``). A member whose own computation raised, or anything else that raises, fails the group as
    infrastructure (Ray retries it from its members' checkpoints), as the trial alone would (module docstring)."""
    started = time.time()
    import torch

    torch.set_num_threads(threads)
    members = groups[int(config["group"])]
    work = _work_dir()
    try:
        _group_body(work, members, started, data=data, slots=slots, fixed=fixed, checkpoint_every=checkpoint_every,
                    sampling_basis=sampling_basis, charged_points=charged_points, transfer=transfer)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _group_body(work: Path, members: list[int], started: float, *, data: Any, slots: list[dict[str, Any]],
                fixed: dict[str, Any], checkpoint_every: int, sampling_basis: float | None,
                charged_points: list[Any] | None, transfer: Any) -> None:

    from dptune import dpsgd
    from dptune.tuning.grouping import group_clipping

    attempts = _restore(work)
    device = _device()
    configs = []
    for index in members:
        params = dict(slots[index]["params"])
        cfg = TrialConfig.from_dict({**fixed, **params, "seed": int(slots[index]["seed"])})
        if transfer is not None:
            cfg = transfer.trial_config(cfg)
        configs.append(group_clipping(cfg, lambda c: dpsgd.guarded_clipping(c, data.num_classes, data.input_shape),
                                      device))

    def on_epoch(epoch: int, metrics: dict[str, Any]) -> None:
        if checkpoint_every and epoch % checkpoint_every == 0:  # every member's checkpoint, no score
            tune.report({"final": False, "epoch": epoch}, checkpoint=tune.Checkpoint.from_directory(str(work)))

    results = dpsgd.run_group(configs, data, device=device, sampling_basis=sampling_basis,
                              charged_points=charged_points or None,
                              checkpoint_paths=[work / f"trial-{index}.pt" for index in members],
                              on_epoch=[on_epoch] * len(members))
    for index, result in zip(members, results, strict=True):
        if isinstance(result, dpsgd.TrialCrash):  # infrastructure, as the trial alone: never a −∞ result
            raise TrialRaised(f"trial {index} of this group raised {result.error}")
    rows = [{"final": True, "started": started, "trial_index": index, "params": dict(slots[index]["params"]),
             "seed": str(slots[index]["seed"]), "node_id": _node_id(), "attempts": attempts,
             **_result_metrics(result, device)} for index, result in zip(members, results, strict=True)]
    tune.report({"final": True, "trials": rows})


def _restore(work: Path) -> int:
    """After an infrastructure failure, the trial's last checkpoint into ``work``; the attempt number."""
    restored = tune.get_checkpoint()
    attempts = 1
    if restored is not None:  # resume the same trial (same index, seed, hyperparameters)
        d = Path(restored.to_directory(str(work / "restored")))  # inside the work dir: never a /tmp download
        for ckpt in d.glob("trial*.pt"):  # a trial's trial.pt, or each group member's trial-<index>.pt
            shutil.copy(ckpt, work / ckpt.name)
        if (d / "attempts").exists():
            attempts = int((d / "attempts").read_text()) + 1
        shutil.rmtree(d, ignore_errors=True)
    (work / "attempts").write_text(str(attempts))
    return attempts


def _measured(result: Any) -> dict[str, Any]:
    """What the trainer measured of the run it did (noise additions and std, realised batch rate, steps)."""
    out = {}
    for name in ("noise_additions", "noise_std", "mean_batch_size", "applied_score_noise", "steps"):
        v = getattr(result, name, None)
        if v is not None:
            out[name] = v if isinstance(v, int) else float(v)
    return out


def _device() -> str:
    """``cuda`` where Ray gave this trial a GPU (and torch sees one), else ``cpu``."""
    import torch

    gpus = tune.get_context().get_trial_resources().required_resources.get("GPU", 0)
    return "cuda" if torch.cuda.is_available() and gpus > 0 else "cpu"


def _node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # pragma: no cover
        return ""


def _adaptive_seed(base: int) -> int:
    trial_id = tune.get_context().get_trial_id() or ""
    # keyed by the draw's 128-bit secret stream: as unpredictable as an OS draw, and replayed on resume
    digest = hashlib.sha256(f"{base}:{trial_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big")


def dptune_asha_trial(config: dict[str, Any], *, data: Any, slots: list[dict[str, Any]], fixed: dict[str, Any],
                      rungs: tuple[int, ...], filter_actor: Any, threads: int = 1,
                      charged_points: list[Any] | None = None) -> None:
    """One configuration of the sealed draw (``trial_index``), trained rung segment by rung segment: each admitted by
    the search's RDP filter (ASHA), or, with no filter (``own_curve``), all charged with the trial and the trial
    stopping itself at the first rung whose noised score is not above its previous rung's."""
    import torch

    from dptune import dpsgd
    from dptune.accounting import segment_costs
    from dptune.config.params import rung_steps

    started = time.time()
    torch.set_num_threads(threads)
    index = int(config["trial_index"])
    slot = slots[index]
    params = dict(slot["params"])
    cfg = TrialConfig.from_dict({**fixed, **params, "seed": int(slot["seed"])})
    work = _work_dir()
    try:
        attempts = _restore(work)
        mode, _ = dpsgd.guarded_clipping(cfg, data.num_classes, data.input_shape)
        basis = float(len(data.train[1]))
        costs = segment_costs(noise_multiplier=cfg.noise_multiplier / clipping.sensitivity(mode),
                              sampling_rate=cfg.batch_size / basis, score_noise=cfg.score_noise,
                              rung_steps=rung_steps(epochs=cfg.epochs, batch_size=cfg.batch_size, basis=basis,
                                                    rungs=rungs))

        def admit(k: int) -> bool:
            if filter_actor is None:  # own_curve: every segment is the trial's own, charged with it
                return True
            return bool(ray.get(filter_actor.admit.remote(f"{index}/{k}", [float(c) for c in costs[k]])))

        device = _device()
        base = {"final": True, "started": started, "trial_index": index, "params": params, "seed": str(slot["seed"]),
                "node_id": _node_id(), "attempts": attempts}

        scores: list[float] = []

        def report(k: int, result: Any) -> None:
            metrics = {**base, **_result_metrics(result, device), "epoch": rungs[k]}
            metrics["measured"] = {**metrics["measured"], "rung": k, "rungs": len(rungs)}
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(work)))
            scores.append(float(result.score))
            if filter_actor is None and stops_on_own_curve(scores):
                raise dpsgd.FilterRefused  # own_curve: its own noised curve stopped improving

        result = dpsgd.run_rungs(cfg, data, rungs, admit=admit, report=report, checkpoint_path=work / "trial.pt",
                                 device=device, charged_points=charged_points or None)
        if result is None:  # refused before its first segment: it touched no data
            tune.report({"final": True, "not_run": True, "trial_index": index, "epoch": 0, "score": float("-inf")})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stops_on_own_curve(scores: list[float]) -> bool:
    """``own_curve``: a trial stops at the first rung whose noised score is not above its previous rung's. It reads
    the trial's own releases only (no other trial's), so the trial stays one run of a fixed mechanism."""
    return len(scores) > 1 and not scores[-1] > scores[-2]
