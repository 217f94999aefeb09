"""How a search uses Ray (performance and placement knobs; none of them changes what is charged)."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dptune.errors import ConfigError

__all__ = ["RayOptions", "check_auth_mode", "check_gpus", "check_token_file", "gpus_per_trial"]


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None
    num_cpus: int | None = None
    # GPUs a local Ray offers (default: the GPUs it detects); a trial asks for gpus_per_trial of them, so a
    # fraction g packs floor(1/g) trials on each GPU, CPUs allowing (cpus_per_trial each)
    num_gpus: int | None = None
    cpus_per_trial: float = 1.0
    gpus_per_trial: str = "auto"
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int | None = None
    max_failures: int = 3
    checkpoint_every: int = 0
    save_model: bool = False
    # where Tune keeps trial checkpoints: None = sealed/ray on the driver (single machine); on a multi-node
    # cluster, storage every node reaches (an NFS path, or a URI pyarrow's filesystems understand: s3://, gs://)
    storage_path: str | None = None
    # the user's own code every Ray worker must import (a model factory's top-level package or module),
    # shipped with Ray's runtime_env py_modules
    py_modules: tuple[str, ...] = ()
    job_metadata: dict[str, str] = field(default_factory=dict)
    # trials of one architecture trained together, one Ray trial per group (tuning.grouping; random search and the
    # scaled searcher, not an adaptive one, nor --save-checkpoint): each trial's result is its own alone
    group_trials: bool = False


def gpus_per_trial(value: str, cluster_gpus: float) -> float:
    """The GPUs each trial asks Ray for: ``auto`` is 1 where the cluster has a GPU, else 0; a number is taken as
    given (0.25: four trials share each GPU)."""
    if value == "auto":
        return 1.0 if cluster_gpus >= 1 else 0.0
    try:
        g = float(value)
    except ValueError as e:
        raise ConfigError("--gpus-per-trial", f"{value!r} is not a number",
                          "give auto, 0, a fraction like 0.25 (four trials per GPU), or a whole number") from e
    if not math.isfinite(g) or g < 0:
        raise ConfigError("--gpus-per-trial", f"{value} is not a number >= 0", "give auto, 0, or e.g. 0.25 or 1")
    if g > 1 and not g.is_integer():
        raise ConfigError("--gpus-per-trial", f"{g:g} is above 1 but not whole (Ray grants a fraction of one GPU, "
                          "or whole GPUs)", f"give {math.floor(g)} or {math.ceil(g)}, or a fraction <= 1")
    if g > 0 and cluster_gpus == 0:
        raise ConfigError("--gpus-per-trial", f"{g:g} GPU(s) per trial requested but the Ray cluster has no GPU",
                          "use --gpus-per-trial 0 (CPU) or auto, or run where Ray has GPUs")
    return g


def check_gpus(opts: RayOptions) -> None:
    """``--gpus-per-trial`` against the GPUs a local Ray will have (``num_gpus``, else the GPUs torch sees),
    before anything is charged: a trial that asks for more than there is would wait for ever. A cluster
    (``address``) is checked once Ray has joined it (:mod:`dptune.tuning.runner`); it may also grow."""
    if opts.num_gpus is not None and opts.num_gpus < 0:
        raise ConfigError("--num-gpus", f"{opts.num_gpus} is negative", "give a number >= 0, or leave it out")
    if opts.address:
        gpus_per_trial(opts.gpus_per_trial, 1.0)  # its form only
        return
    if opts.gpus_per_trial == "auto" or gpus_per_trial(opts.gpus_per_trial, 1.0) == 0:
        return  # nothing to count: auto asks for what there is, 0 for none (and torch stays unloaded until the data)
    have = opts.num_gpus
    if have is None:
        import torch

        have = torch.cuda.device_count()
    g = gpus_per_trial(opts.gpus_per_trial, float(have))
    if g > have:
        raise ConfigError("--gpus-per-trial", f"{g:g} GPUs per trial but this machine's Ray has {have}",
                          f"give at most {have}, or a fraction such as 0.25 to pack trials on a GPU")


def check_auth_mode() -> None:
    """Ray honours ``RAY_AUTH_MODE`` from the environment: anything but ``token`` (e.g. ``disabled`` left in a
    shell) would start or join Ray without token authentication, and anyone reaching its ports could submit
    a job that reads sealed/. Refused before anything is charged; dptune sets ``token`` when it is unset."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.strip().lower() != "token":
        raise ConfigError("RAY_AUTH_MODE", f"is {mode!r} in this environment: Ray would run without token "
                          "authentication (anyone who reaches its ports could run jobs that read sealed/)",
                          "unset RAY_AUTH_MODE (dptune turns token authentication on) or set RAY_AUTH_MODE=token")


def _token_path() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def check_token_file(create: bool) -> Path | None:
    """The Ray auth token must be readable by the curator only: the dashboard's job API runs code as the
    curator for whoever holds it. A missing token is created 0600 in a 0700 directory (``create``); an
    existing one with looser modes is refused. Returns the token file (None: the token is in the env)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = _token_path()
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for p, mode, what in ((path.parent, 0o700, "directory"), (path, 0o600, "file")):
        if p.exists() and stat.S_IMODE(p.stat().st_mode) & 0o077:
            raise ConfigError("ray auth token", f"the token {what} {p} is readable by other users (mode "
                              f"{stat.S_IMODE(p.stat().st_mode):o}): any local user could drive the dashboard's "
                              "job API as you", f"run: chmod {mode:o} {p}")
    if not path.exists():
        import secrets

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # the format of `ray get-auth-token --generate`
    return path
