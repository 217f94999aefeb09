"""Privacy certificates: what was released, under which events, at what (ε, δ). Never the drawn K.

``verify`` recomputes ε from the stored events and fails on any mismatch, so a certificate cannot claim
less than its events cost.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from dp_accounting import dp_event as de

from dptune.accounting import epsilon, event_from_json, event_to_json
from dptune.config import ConfigError

__all__ = ["Certificate", "CertificateError", "load_certificate"]

FORMAT = "dptune-certificate/1"


class CertificateError(ConfigError):
    pass


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("dptune", "opacus", "dp-accounting", "torch", "ray"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


@dataclass(frozen=True)
class Certificate:
    """``events`` are composed (RDP) to give ``epsilon`` at ``delta``; each has a role label."""

    dataset_fingerprint: str
    delta: float
    events: list[tuple[str, de.DpEvent]]
    epsilon: float
    stopping: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=_versions)
    created: float = field(default_factory=time.time)

    @classmethod
    def build(cls, dataset_fingerprint: str, delta: float, events: list[tuple[str, de.DpEvent]],
              stopping: dict[str, Any], details: dict[str, Any] | None = None) -> Certificate:
        forbidden = {"k", "K", "num_trials_drawn", "trials_drawn"} & set(stopping) | (
            {"k", "K", "num_trials_drawn", "trials_drawn"} & set(details or {}))
        if forbidden:
            raise ValueError(f"a certificate must not reveal the drawn number of trials ({forbidden})")
        eps = epsilon([e for _, e in events], delta)
        return cls(dataset_fingerprint, float(delta), list(events), eps, dict(stopping), dict(details or {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "dataset_fingerprint": self.dataset_fingerprint,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": "RDP (dp_accounting orders), Papernot-Steinke random stopping, composed over events",
            "stopping": self.stopping,
            "events": [{"role": role, "event": event_to_json(e),
                        "epsilon_alone": epsilon([e], self.delta)} for role, e in self.events],
            "details": self.details,
            "versions": self.versions,
            "created": self.created,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    def verify(self) -> None:
        """Recompute ε from the events; raise if the stated ε differs."""
        recomputed = epsilon([e for _, e in self.events], self.delta)
        if not (math.isfinite(self.epsilon) and math.isclose(recomputed, self.epsilon, rel_tol=1e-6, abs_tol=1e-9)):
            raise CertificateError(
                "certificate.epsilon",
                f"states ε = {self.epsilon!r} but its events cost ε = {recomputed:.6g} at δ = {self.delta:g}",
                "the certificate was modified or is corrupt; use the one the search released",
            )

    def compose_with(self, role: str, event: de.DpEvent, details: dict[str, Any] | None = None) -> Certificate:
        """A new certificate whose events are these plus ``event`` (e.g. the final training)."""
        merged = {**self.details, **(details or {})}
        return Certificate.build(self.dataset_fingerprint, self.delta, [*self.events, (role, event)],
                                 self.stopping, merged)


def load_certificate(path: str | Path, verify: bool = True) -> Certificate:
    p = Path(path)
    if not p.is_file():
        raise CertificateError("certificate", f"{str(p)!r} does not exist",
                               "point at a release directory written by `python -m dptune.search`")
    try:
        data = json.loads(p.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r} is not {FORMAT}")
        events = [(str(x["role"]), event_from_json(x["event"])) for x in data["events"]]
        cert = Certificate(str(data["dataset_fingerprint"]), float(data["delta"]), events, float(data["epsilon"]),
                           dict(data["stopping"]), dict(data.get("details", {})), dict(data.get("versions", {})),
                           float(data.get("created", 0.0)))
    except (ValueError, KeyError, TypeError) as e:
        raise CertificateError("certificate", f"{str(p)!r} is not a valid dptune certificate ({e})",
                               "use the certificate.json the search released, unmodified") from e
    if verify:
        cert.verify()
    return cert


