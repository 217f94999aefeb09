"""The curator key: 256 bits of OS entropy that authenticate certificates (HMAC-SHA256) and key the ledger's record-id
digests and content signatures (:mod:`dptune.ledger._budgets`).

* A SQLite ledger keeps it beside the file (``<ledger>.key``, 0600): the file and its key travel together.
* A team ledger (PostgreSQL) never stores it in the database, which every database user with read access (a DBA, a
  backup) could read: the key is a file each curator holds like a credential (0600), ``$DPTUNE_LEDGER_KEY`` or
  ``~/.config/dptune/keys/<ledger id>.key`` (the random id the database holds), handed from the curator who set the ledger up (``python -m
  dptune.ledger setup-team`` writes it) over the channel the team uses for secrets. The database stores only a
  check value (HMAC of a constant under the key): a curator holding another key is refused at once (a wrong key
  would make every budget look unknown and open a fresh one), and the check value reveals nothing of the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from dptune.errors import ConfigError, python_m
from dptune.ledger._location import LedgerLocation

__all__ = ["key_check", "key_fits", "read_key", "team_key_path", "write_key"]


def team_key_path(location: LedgerLocation, ledger_id: str | None = None) -> Path:
    """Where this machine holds a team ledger's key: ``$DPTUNE_LEDGER_KEY``, else ``keys/<ledger id>.key`` under
    ``~/.config/dptune`` (the id the database holds: the same file however the ledger is reached, by URL, ``PG*``
    variables, a service or a socket), else, for a key saved before ledgers had ids, the name spelled from the URL."""
    given = os.environ.get("DPTUNE_LEDGER_KEY")
    if given:
        return Path(given).expanduser().resolve()
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".config"
    keys = base / "dptune" / "keys"
    p = dict(location.params)
    name = "-".join(x for x in (p.get("service") or p.get("host") or "localhost", p.get("port", "5432"),
                                p.get("dbname") or p.get("user") or "postgres") if x)
    spelled = keys / (re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".key")
    if ledger_id is None:
        return spelled
    by_id = keys / f"{ledger_id}.key"
    return spelled if spelled.exists() and not by_id.exists() else by_id


def key_check(key: bytes) -> str:
    """What the database stores to recognise the team's key: an HMAC of a constant, not the key."""
    return hmac.new(key, b"dptune-ledger-key-check/1", hashlib.sha256).hexdigest()


def key_fits(check_value: object, key: bytes) -> bool:
    """Whether ``key`` is the one a team ledger's check value was made from (no check value yet: any key fits)."""
    return check_value is None or hmac.compare_digest(str(check_value), key_check(key))


def read_key(path: Path) -> bytes:
    try:
        return bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ConfigError("--ledger", f"the curator key {str(path)!r} is not a dptune key (64 hex digits)",
                          "restore it from the team's copy") from None


def write_key(path: Path, key: bytes | None = None) -> bytes:
    """A fresh 256-bit key (or ``key``), 0600, appearing complete or not at all; an existing file is kept."""
    key = key if key is not None else secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.hex())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return read_key(path)
    finally:
        tmp.unlink(missing_ok=True)
    return key


def missing_team_key(location: LedgerLocation, path: Path) -> ConfigError:
    return ConfigError("--ledger", f"the team ledger {location} has a curator key, and this machine has none at "
                       f"{str(path)!r}",
                       "get the team's key file from the curator who set the ledger up (a secret: 0600, never "
                       "in a repository) and put it there, or point DPTUNE_LEDGER_KEY at it; nothing was charged")


def wrong_team_key(location: LedgerLocation, path: Path) -> ConfigError:
    return ConfigError("--ledger", f"the curator key {str(path)!r} is not the key of the team ledger {location}",
                       "use the team's key file (DPTUNE_LEDGER_KEY or the default path); another key would neither "
                       f"find the team's budgets nor verify its certificates; `{python_m('dptune.cli.ledger')} show` "
                       "needs no key")
