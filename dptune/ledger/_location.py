"""Where a ledger lives: a SQLite file (the embedded default, one curator) or a PostgreSQL database (a team's).

``--ledger`` takes either a path or a ``postgresql://`` (``postgres://``) URL, as libpq reads it. A password in the
URL is refused (exit 2, nothing charged: a command line is public to every local user and to Ray's dashboard); libpq's
own sources give it (``~/.pgpass`` / ``PGPASSFILE`` / ``passfile=``, ``PGPASSWORD``, a service in
``~/.pg_service.conf`` / ``PGSERVICEFILE`` with ``?service=NAME`` or ``PGSERVICE``). A :class:`LedgerLocation` prints as its password-free form
(``postgresql://alice@db.example:5432/dptune``): that form is what state files record and what a resumed search or
final training compare.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

__all__ = ["LedgerLocation", "canonical_url", "default_ledger_path", "ledger_location", "scrub"]

_SCHEMES = ("postgresql://", "postgres://")
_SECRET_KEYS = {"password", "passfile", "sslpassword"}


def default_ledger_path() -> Path:
    """The per-user ledger of every CLI and the API, absolute whatever the working directory (a relative one let
    a search started elsewhere open a fresh budget): ``$XDG_DATA_HOME`` if absolute, else ``~/.local/share``.
    ``DPTUNE_LEDGER`` (a path or a ``postgresql://`` URL), when set, wins: see :func:`ledger_location`."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "dptune" / "ledger.sqlite"


# libpq's key-value form ("host=db port=5432 dbname=dptune"): a string starting with one of its keywords and "="
_CONNINFO = re.compile(r"^\s*(host|hostaddr|port|dbname|user|service|sslmode|sslrootcert|target_session_attrs|passfile|"
                       r"connect_timeout|application_name|options)\s*=", re.I)


def is_url(given: object) -> bool:
    """Whether ``given`` names a PostgreSQL ledger: a ``postgresql://`` URL or libpq's key-value conninfo."""
    return isinstance(given, str) and (given.lower().startswith(_SCHEMES) or bool(_CONNINFO.match(given)))


@dataclass(frozen=True)
class LedgerLocation:
    """A ledger's address. ``shown`` is password-free (printing, state files, comparisons); ``target`` is what
    connects (the absolute path, or the URL as given, which may hold a password: never print it)."""

    kind: str  # "sqlite" | "postgresql"
    shown: str
    target: str = field(repr=False)
    params: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # parsed URL (no secrets), PostgreSQL only

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"LedgerLocation({self.shown!r})"

    @property
    def is_postgres(self) -> bool:
        return self.kind == "postgresql"

    @property
    def path(self) -> Path:
        if self.is_postgres:
            raise ValueError(f"{self.shown} is not a file")
        return Path(self.target)

    @property
    def host(self) -> str:
        """The server as a message names it (host:port, or the service)."""
        p = dict(self.params)
        if "host" not in p and "service" in p:
            return f"service {p['service']!r}"
        return f"{p.get('host') or os.environ.get('PGHOST') or 'localhost'}:{p.get('port') or os.environ.get('PGPORT') or 5432}"

    def same(self, other: LedgerLocation) -> bool:
        return self.shown == other.shown


def ledger_location(given: str | Path | LedgerLocation | None = None) -> LedgerLocation:
    """``given`` (a path, a URL, or None: ``$DPTUNE_LEDGER`` if set, else :func:`default_ledger_path`)."""
    if isinstance(given, LedgerLocation):
        return given
    field = "--ledger"
    if given is None or given == "":
        field = "DPTUNE_LEDGER"
        given = os.environ.get("DPTUNE_LEDGER") or default_ledger_path()
    if is_url(given):
        return _postgres(str(given), field)
    path = Path(given).expanduser().resolve()
    return LedgerLocation("sqlite", str(path), str(path))


def _postgres(url: str, field: str = "--ledger") -> LedgerLocation:
    from psycopg.conninfo import conninfo_to_dict

    from dptune.errors import ConfigError

    try:
        parts = {k: str(v) for k, v in conninfo_to_dict(url).items()}
    except Exception as e:  # libpq's parser: its message never echoes the password
        raise ConfigError(field, f"is not a PostgreSQL URL libpq can read ({scrub(str(e), url)})",
                          "give postgresql://USER@HOST:PORT/DBNAME (the password in ~/.pgpass, PGPASSFILE or "
                          "PGPASSWORD, or a service: postgresql:///?service=NAME)") from None
    if parts.get("password") or parts.get("sslpassword"):
        # a command line is every local user's to read (ps, /proc/*/cmdline), and Ray shows the driver's as its job's
        # entrypoint on the dashboard and /api/jobs/: a secret never rides on one (issue 64)
        raise ConfigError(field, "holds a password: a command line is visible to every local user (ps) and Ray shows "
                          "the search's as its job entrypoint on the dashboard; nothing was charged",
                          "remove it from the URL and let libpq find it: a line in ~/.pgpass (or the file PGPASSFILE "
                          "or passfile= names), a service in ~/.pg_service.conf (postgresql:///?service=NAME or "
                          "PGSERVICE), or PGPASSWORD in the environment") from None
    kept = tuple(sorted((k, v) for k, v in parts.items() if k not in _SECRET_KEYS))
    return LedgerLocation("postgresql", canonical_url(dict(kept)), url, kept)


def canonical_url(p: dict[str, str]) -> str:
    """The URL form of libpq parameters ``p`` (no secrets) that parses back to exactly ``p``: a socket directory or
    several hosts go in the query (``postgresql://alice@/dptune?host=/run/postgresql&port=5432``), not where a URL's
    host goes (``alice@/run/postgresql:5432/dptune`` reads as a database name). Tested form by form."""
    user = f"{quote(p['user'], safe='')}@" if p.get("user") else ""
    host, port = p.get("host", ""), p.get("port", "")
    in_query = {"host", "port"} if ("/" in host or "," in host or "," in port) else set()
    netloc = "" if in_query else (f"[{host}]" if ":" in host else quote(host, safe="")) + (f":{port}" if port else "")
    db = quote(p.get("dbname", ""), safe="")
    query = "&".join(f"{k}={quote(v, safe='/,')}" for k, v in sorted(p.items())
                     if k not in ("user", "dbname") and (k in in_query or k not in ("host", "port")) and v != "")
    return f"postgresql://{user}{netloc}/{db}" + (f"?{query}" if query else "")


def scrub(text: str, target: str) -> str:
    """``text`` with any password of ``target`` (a URL) removed: a driver's message, an argv echoed back."""
    if not is_url(target):
        return text
    try:
        from psycopg.conninfo import conninfo_to_dict

        secrets = [str(v) for k, v in conninfo_to_dict(target).items() if k in _SECRET_KEYS and v]
    except Exception:
        secrets = []
    m = re.match(r"^[a-z]+://[^@/]*?:([^@/]*)@", target, re.I)
    if m and m.group(1):
        secrets.append(m.group(1))
    for s in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(s, "***")
        text = text.replace(quote(s, safe=""), "***")
    return text
