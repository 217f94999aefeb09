"""How a search uses Ray (performance and placement knobs; none of them changes what is charged)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RayOptions"]


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
    job_metadata: dict[str, str] = field(default_factory=dict)
