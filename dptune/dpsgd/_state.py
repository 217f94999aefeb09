"""What a trial mutates, its checkpoint, and the model file: the one place each schema is written and read."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptune.config import ConfigError, TrialConfig
from dptune.dpsgd._audit import AuditHooks
from dptune.dpsgd._engines import Engine
from dptune.dpsgd._optim import NoiseMeter
from dptune.dpsgd._streams import TrialStreams

__all__ = ["TrialRun", "TrialState", "load_model", "restore_checkpoint", "save_checkpoint", "save_model", "trial_identity"]


@dataclass
class TrialState:
    """Counters of a trial in progress."""

    steps: int = 0  # logical DP-SGD steps performed (optimizer steps that added noise)
    epochs_done: int = 0
    seconds: float = 0.0
    diverged: bool = False
    examples: int = 0  # examples in all logical (Poisson) batches so far: the realised batch rate


@dataclass
class TrialRun:
    """Everything a running trial mutates; a checkpoint holds exactly this (plus what identifies the trial)."""

    model: nn.Module
    engine: Engine
    streams: TrialStreams
    ema: dict[str, torch.Tensor] | None
    meter: NoiseMeter
    state: TrialState = field(default_factory=TrialState)
    audit: AuditHooks | None = None  # audit-only (dptune.audit); None in every search and final training

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(k, p) for k, p in self.model.named_parameters() if p.requires_grad]


def trial_identity(config: TrialConfig, n_train: int, basis: float) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the trial (seed included), its data size and q's basis."""
    return {"config": config.to_dict(), "n_train": n_train, "basis": basis}


def save_checkpoint(path: Path, run: TrialRun, identity: dict[str, Any]) -> None:
    st = run.state
    payload = {"identity": identity, "model": run.model.state_dict(),
               "optimizer": run.engine.optimizer.original_optimizer.state_dict(), "ema": run.ema,
               "state": dataclasses.asdict(st), "meter": run.meter.state(), "rng": run.streams.state()}
    _save_atomic(payload, path)


def _save_atomic(payload: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # atomic: a crash leaves the previous file intact


def restore_checkpoint(path: Path, run: TrialRun, identity: dict[str, Any], device: torch.device) -> None:
    # weights_only: a checkpoint is data, never code; CPU first (RNG states must stay CPU ByteTensors)
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if ck.get("identity") != identity:
        raise ConfigError("checkpoint_path", f"{path} belongs to another trial or dataset",
                          "delete it or pass this trial's own checkpoint")
    run.model.load_state_dict(ck["model"])
    run.engine.optimizer.original_optimizer.load_state_dict(ck["optimizer"])
    run.ema = None if ck["ema"] is None else {k: v.to(device) for k, v in ck["ema"].items()}
    run.state = TrialState(**ck["state"])
    run.meter.load_state(ck["meter"], device)
    run.streams.load_state(ck["rng"])


_MODEL_KEYS = ("model_state", "config")


def save_model(path: str | Path, state: Mapping[str, torch.Tensor], config_public_dict: Mapping[str, Any],
               **extra: Any) -> None:
    """The model file: ``{"model_state": state_dict of the unwrapped module, "config": the public trial
    config, **extra}``, plain tensors and builtins only, so ``torch.load(path, weights_only=True)`` reads it.
    The config must be the public one: a trial's seed reproduces its DP noise and never goes next to a model."""
    if "seed" in config_public_dict:
        raise ValueError("a model file never carries the trial's seed: pass config.to_public_dict()")
    clash = sorted(set(extra) & set(_MODEL_KEYS))
    if clash:
        raise ValueError(f"extra keys {clash} would overwrite the model file's own")
    payload = {"model_state": {k: v.detach().cpu() for k, v in state.items()}, "config": dict(config_public_dict),
               **extra}
    _save_atomic(payload, Path(path))


def load_model(path: str | Path) -> dict[str, Any]:
    """A model file written by :func:`save_model` (weights_only: data, never code)."""
    obj = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), dict) for k in _MODEL_KEYS):
        raise ConfigError(Path(path).name, "is not a dptune model file (model_state + config)",
                          "use the file dptune wrote, unmodified")
    return obj
