"""How a search uses Ray (performance and placement knobs; none of them changes what is charged)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dptune.errors import ConfigError

__all__ = ["RayOptions", "check_auth_mode", "check_token_file"]


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None
    num_cpus: int | None = None
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
