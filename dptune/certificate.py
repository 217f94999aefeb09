"""Privacy certificates: what was released, under which events, at what (ε, δ). Never the drawn K.

A certificate is a *claim* with two independent checks:

* anyone can recompute ε from the stored events (``verify``): a certificate cannot state less than its
  events cost;
* the curator's ledger authenticates it (``binding``): every event is bound to the ledger charge that paid
  for it (the charge's random token and the event's hash), under an HMAC with the curator key kept beside
  the ledger. The MAC covers every other field too (ε, δ, the guarantee and its ``reproducible`` flag and
  warning, the stopping rule, the details, the date, the versions) and the SHA-256 of each file released
  with it (``best_config.yaml``, ``best_checkpoint.pt``; after final training ``model.pt`` and
  ``metrics.json``). An edited certificate with recomputed ε, one copied from another, cheaper search, or
  another search's ``best_config.yaml`` beside it fails ``verify_binding`` — and ``dptune.train`` refuses
  it before calibrating anything from it.

A certificate bound by dptune before the binding covered its files (binding version 1: the MAC covered the
charges only) is still readable and its ε still verifies, but it cannot authorize final training: nothing
authenticates the ``best_config.yaml`` beside it.

Nothing in a certificate is computed from the private data: the dataset is named by a random id, the
charges by random tokens, and the date is the reservation's day (no time of day: a start and an end time
would give the search's duration, and so roughly K).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dp_accounting import dp_event as de

from dptune.accounting import accountant, certify, epsilon, event_from_json, event_to_json, round_up_epsilon
from dptune.config.stopping import reveals_k
from dptune.errors import ConfigError

if TYPE_CHECKING:
    from dptune.ledger import Charge, Ledger

__all__ = ["Certificate", "CertificateError", "file_sha256", "guarantee", "load_certificate", "verify_binding"]

FORMAT = "dptune-certificate/2"
BINDING_VERSION = 2  # 1 (no "version" key): the MAC covered the charges only, not the fields nor the files
# files a certificate may sit beside: each one present must be bound (a checkpoint added to a release that
# had none, or another search's config, is refused)
BOUND_FILES = ("best_config.yaml", "best_checkpoint.pt", "model.pt", "metrics.json", "auto_space.yaml")
_ACCOUNTANT_TEXT = {  # per ``bound``; "rdp" is the text certificates had before ``bound`` existed
    "rdp": "RDP (dp_accounting orders), Papernot-Steinke random stopping, composed over events",
    "pld": "PLD (dp_accounting, pessimistic), composed over events; the noisy max as pure (1/beta)-DP",
    "rdp+pld": "RDP part (Papernot-Steinke random stopping) as a privacy profile, convolved with the PLD of the rest",
    "profile": "random stopping from the trial's privacy profile (pessimistic PLD pair, pgf of K, every ranking)",
    "profile+pld": "the search's profile (the smaller of its RDP conversion and its privacy-profile bound), "
                   "convolved with the PLD of the rest",
}


class CertificateError(ConfigError):
    pass


def guarantee(*, reproducible: bool) -> dict[str, Any]:
    """What the (ε, δ) of a dptune certificate covers, in words (docs/privacy.md, "The certificate")."""
    return {
        "neighbouring_relation": "add or remove one example of the training split or of the validation split, "
                                 "the mechanism run at the published split sizes",
        "conditional_on": "the published split sizes (details.n_train; dataset.validation_size and test_size in "
                          "best_config.yaml): dptune computes the sampling rate q = B/n and the number of steps "
                          "from them and releases them, so the (epsilon, delta) holds for the mechanism run at "
                          "those sizes and does not hide the sizes themselves (whether the data hold n or n + 1 "
                          "examples is public)",
        "covers": "every output released under this certificate: the selected configuration, its noised "
                  "validation score and (if released) its checkpoint; after final training, the final model",
        "not_covered": "test-split accuracy (a non-private held-out evaluation, not charged); anything in sealed/",
        "reproducible": bool(reproducible),
        **({"warning": "NOT PRIVATE: the run's randomness was fixed (--seed or a test hook), so its noise is "
                       "known and the stated (epsilon, delta) does not hold"} if reproducible else {}),
    }


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(obj: Any) -> Any:
    """``obj`` as a JSON file stores it (tuples as lists, keys as strings), so a certificate read back from
    its file authenticates exactly as the one that was bound."""
    return json.loads(json.dumps(obj, default=str))


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
    """``events`` are composed to give ``epsilon`` at ``delta``; each has a role label. ``bound`` names the
    accountant whose bound ``epsilon`` is (a name in ``accounting.ACCOUNTANTS``: the smallest valid one,
    ``accounting.certify``);
    certificates written before it existed are RDP."""

    dataset_id: str
    delta: float
    events: list[tuple[str, de.DpEvent]]
    epsilon: float
    stopping: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    guarantee: dict[str, Any] = field(default_factory=lambda: guarantee(reproducible=False))
    binding: dict[str, Any] = field(default_factory=dict)  # {"charges": [{role, token, event_sha256}], "mac"}
    created: str = ""  # the day of the reservation, YYYY-MM-DD
    versions: dict[str, str] = field(default_factory=_versions)
    bound: str = "rdp"

    @classmethod
    def build(cls, dataset_id: str, delta: float, events: list[tuple[str, de.DpEvent]],
              stopping: dict[str, Any], details: dict[str, Any] | None = None, *, reproducible: bool = False,
              created: str = "") -> Certificate:
        forbidden = {key for key in (*stopping, *(details or {})) if reveals_k(key)}  # checked at registration too
        if forbidden:
            raise ValueError(f"a certificate must not reveal the drawn number of trials ({forbidden})")
        proved = certify([e for _, e in events], delta)
        return cls(dataset_id, float(delta), list(events), proved.epsilon, dict(stopping), dict(details or {}),
                   guarantee(reproducible=reproducible), {}, created, bound=proved.accountant)

    # --- binding to the ledger -----------------------------------------------------------------------

    def _bound_message(self, binding: Mapping[str, Any]) -> bytes:
        """What the MAC covers: every field but the MAC itself (the events through their charges' hashes)."""
        body = {"format": FORMAT, "dataset_id": self.dataset_id, "delta": self.delta, "epsilon": self.epsilon,
                "guarantee": self.guarantee, "stopping": self.stopping, "details": self.details,
                "created": self.created, "versions": self.versions, "bound": self.bound,
                "binding": {k: v for k, v in binding.items() if k != "mac"}}
        return json.dumps(_canonical(body), sort_keys=True, separators=(",", ":")).encode()

    def bind(self, ledger: Ledger, tokens: list[str], files: Mapping[str, str | Path] | None = None) -> Certificate:
        """This certificate bound to the ledger charges ``tokens`` (one per event, same order) and to the
        ``files`` released with it (name → path, hashed now: write them before binding)."""
        from dptune.ledger import event_sha256

        if len(tokens) != len(self.events):
            raise ValueError("one ledger charge per certificate event")
        unknown = sorted(set(files or {}) - set(BOUND_FILES))
        if unknown:
            raise ValueError(f"cannot bind {unknown}: not a file a certificate is released with")
        charges = [{"role": role, "token": t, "event_sha256": event_sha256(e)}
                   for (role, e), t in zip(self.events, tokens, strict=True)]
        binding: dict[str, Any] = {"version": BINDING_VERSION, "charges": charges,
                                   "files": {name: file_sha256(p) for name, p in sorted((files or {}).items())}}
        if ledger.ledger_id:  # a team ledger's identity (issue 64): the charges' own ledger
            binding["ledger"] = ledger.ledger_id
        return replace(self, binding={**binding, "mac": ledger.mac(self._bound_message(binding))})

    def compose_with(self, role: str, event: de.DpEvent, details: dict[str, Any] | None = None) -> Certificate:
        """A new (unbound) certificate whose events are these plus ``event`` (e.g. the final training)."""
        merged = {**self.details, **(details or {})}
        out = Certificate.build(self.dataset_id, self.delta, [*self.events, (role, event)], self.stopping, merged,
                                reproducible=bool(self.guarantee.get("reproducible")), created=self.created)
        return replace(out, binding={"charges": list(self.binding.get("charges", []))})

    def tokens(self) -> list[str]:
        return [str(c["token"]) for c in self.binding.get("charges", [])]

    # --- files ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "dataset_id": self.dataset_id,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": _ACCOUNTANT_TEXT[self.bound],
            "bound": self.bound,
            "guarantee": self.guarantee,
            "stopping": self.stopping,
            "events": [{"role": role, "event": event_to_json(e),
                        "epsilon_alone": epsilon([e], self.delta)} for role, e in self.events],
            "details": self.details,
            "binding": self.binding,
            "created": self.created,
            "versions": self.versions,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    def verify(self) -> None:
        """Recompute ε from the events with the accountant the certificate names; raise if the stated ε differs: it
        must be that ε on the charge grid (``accounting.round_up_epsilon``), the same on every CPU, or, for a
        certificate written before the grid, within 1e-6 of it."""
        acc = accountant(self.bound)
        events = [e for _, e in self.events]
        recomputed = acc.epsilon(events, delta=self.delta) if all(acc.can_account(e) for e in events) else None
        if recomputed is None:
            raise CertificateError("certificate.bound", f"the {self.bound} accountant cannot bound these events",
                                   "the certificate was modified or is corrupt; use the one the search released")
        on_grid = self.epsilon == round_up_epsilon(recomputed)
        if not (math.isfinite(self.epsilon)
                and (on_grid or math.isclose(recomputed, self.epsilon, rel_tol=1e-6, abs_tol=1e-9))):
            raise CertificateError(
                "certificate.epsilon",
                f"states ε = {self.epsilon!r} but its events cost ε = {recomputed:.6g} at δ = {self.delta:g}",
                "the certificate was modified or is corrupt; use the one the search released",
            )


def verify_binding(cert: Certificate, ledger: Ledger, folder: str | Path | None = None) -> list[Charge]:
    """The ledger charges that paid for ``cert``'s events; :class:`CertificateError` unless the curator key
    authenticates the binding (every field, and the files it names) and every event is the very event its
    (non-aborted) charge stored. With ``folder``: every file the binding names is there with its bound
    SHA-256, and no other file a certificate is released with sits beside it."""
    from dptune.ledger import event_sha256

    charges = cert.binding.get("charges")
    fix = "use the certificate the search (or final training) wrote, unmodified, with the ledger that charged it"
    if not isinstance(charges, list) or len(charges) != len(cert.events) or "mac" not in cert.binding:
        raise CertificateError("certificate.binding", "is missing or does not cover every event", fix)
    if cert.binding.get("version") != BINDING_VERSION:
        raise CertificateError(
            "certificate.binding", "was written by an older dptune whose binding covers neither the files released "
            "with it (best_config.yaml, best_checkpoint.pt) nor the guarantee: nothing authenticates the config "
            "beside it", "its ε still verifies (python -m dptune.report or load_certificate), but final training "
            "needs a release of this dptune: run a new search (a new charge)")
    if cert.binding.get("ledger") and cert.binding["ledger"] != ledger.ledger_id:
        raise CertificateError("certificate.binding", f"was charged to the ledger {cert.binding['ledger']}, not to "
                               f"{ledger.path} (ledger {ledger.ledger_id or 'without an id'})", fix)
    if not ledger.verify_mac(cert._bound_message(cert.binding), cert.binding["mac"]):
        raise CertificateError("certificate.binding", f"is not authenticated by the curator key of {ledger.path}",
                               fix)
    if folder is not None:
        _verify_files(cert, Path(folder))
    fingerprint = ledger.fingerprint_of(cert.dataset_id)
    found = []
    for (role, event), c in zip(cert.events, charges, strict=True):
        charge = ledger.charge_by_token(str(c.get("token")))
        if (charge is None or c.get("role") != role or c.get("event_sha256") != event_sha256(event)
                or event_sha256(charge.event) != event_sha256(event) or charge.fingerprint != fingerprint):
            raise CertificateError("certificate.events", f"the {role!r} event is not the charge {ledger.path} "
                                   "holds for it", fix)
        if charge.status == "aborted":
            raise CertificateError("certificate.binding", f"the {role!r} charge was aborted", "run a new search")
        found.append(charge)
    return found


def _verify_files(cert: Certificate, folder: Path) -> None:
    files = cert.binding.get("files")
    if not isinstance(files, dict):
        raise CertificateError("certificate.binding", "names no files", "use the certificate the search released")
    for name in BOUND_FILES:
        path = folder / name
        if name not in files:
            if path.exists():
                raise CertificateError(name, "was not released with this certificate (its binding does not "
                                       "name it)", f"use the release's own files together: remove {name}")
            continue
        if not path.is_file():
            raise CertificateError(name, f"is missing from {folder}", "use the release's files together, unmodified")
        if file_sha256(path) != files[name]:
            raise CertificateError(name, "is not the file this certificate was released with (its SHA-256 differs "
                                   "from the bound one): another search's or an edited file",
                                   "use the release's files together, unmodified")


def _bound(name: Any) -> str:
    if name not in _ACCOUNTANT_TEXT:
        raise ValueError(f"bound {name!r} is not one of {', '.join(_ACCOUNTANT_TEXT)}")
    return str(name)


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
        cert = Certificate(str(data["dataset_id"]), float(data["delta"]), events, float(data["epsilon"]),
                           dict(data["stopping"]), dict(data.get("details", {})), dict(data["guarantee"]),
                           dict(data.get("binding", {})), str(data.get("created", "")),
                           dict(data.get("versions", {})), bound=_bound(data.get("bound", "rdp")))
    except (ValueError, KeyError, TypeError) as e:
        raise CertificateError("certificate", f"{str(p)!r} is not a valid dptune certificate ({e})",
                               "use the certificate.json the search released, unmodified") from e
    if verify:
        cert.verify()
    return cert
