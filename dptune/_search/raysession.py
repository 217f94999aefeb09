"""Starting or joining Ray for a search, safely: token auth with an owner-only token, session files in an
owner-only temp dir, the dashboard on loopback, nothing printed that names trials."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray

from dptune._search.options import RayOptions, check_token_file

__all__ = ["RaySession"]


def _runtime_env(paths: tuple[str, ...]) -> dict[str, Any] | None:
    """Ray ships package directories as py_modules; a single-file module goes in a working_dir of its own
    (py_modules takes directories and wheels only)."""
    if not paths:
        return None
    env: dict[str, Any] = {"py_modules": [p for p in paths if Path(p).is_dir()]}
    files = [p for p in paths if not Path(p).is_dir()]
    if files:
        folder = Path(tempfile.mkdtemp(prefix="dptune-code-"))
        for f in files:
            shutil.copy(f, folder / Path(f).name)
        env["working_dir"] = str(folder)
    return {k: v for k, v in env.items() if v}


class RaySession:
    """``with RaySession(opts) as dashboard_url:`` a local Ray (or the cluster at ``opts.address``)."""

    def __init__(self, opts: RayOptions) -> None:
        self.opts = opts
        self.temp_dir: str | None = None
        self.code_dir: str | None = None  # a single-file module's working_dir: ours to remove
        self.dashboard: str | None = None

    def __enter__(self) -> str | None:
        opts = self.opts
        runtime_env = _runtime_env(opts.py_modules)
        self.code_dir = (runtime_env or {}).get("working_dir")
        job_config = ray.job_config.JobConfig(metadata=opts.job_metadata, runtime_env=runtime_env)
        check_token_file(create=not opts.address)
        if opts.address:
            ctx = ray.init(address=opts.address, log_to_driver=False, job_config=job_config,
                           configure_logging=True, logging_level=logging.WARNING)
        else:
            kwargs: dict[str, Any] = {}
            if opts.dashboard_port is not None:
                kwargs["dashboard_port"] = opts.dashboard_port
            # session logs and spilled objects in an owner-only dir (mkdtemp: 0700), not world-readable
            # /tmp/ray; kept short for the ~107-byte Unix socket path limit
            self.temp_dir = tempfile.mkdtemp(prefix="dptune-", dir="/tmp")
            # address="local": always a new private instance, never a Ray someone else advertised here
            ctx = ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=True,
                           dashboard_host=opts.dashboard_host, log_to_driver=False, job_config=job_config,
                           logging_level=logging.WARNING, _temp_dir=self.temp_dir, **kwargs)
        for name in ("ray.tune", "ray.train", "ray.air"):  # their warnings can count trials
            logging.getLogger(name).setLevel(logging.ERROR)
        check_token_file(create=False)  # whatever Ray wrote must be owner-only too
        url = getattr(ctx, "dashboard_url", None)
        if url and not str(url).startswith("http"):
            url = "http://" + str(url)
        self.dashboard = url
        return url

    def __exit__(self, *exc: object) -> None:
        if ray.is_initialized():
            ray.shutdown()
        for folder in (self.temp_dir, self.code_dir):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
