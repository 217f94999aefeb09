"""One identity per team ledger, from the server (issue 64 item 2): the database holds a random id; the key file, a
resume's and final training's "same ledger" use it, however the ledger is reached (URL spelled with 127.0.0.1 or
localhost, libpq's PG* variables, a service, the Unix socket); a dump restored elsewhere is the same ledger."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dptune.accounting import trial_event
from dptune.ledger import Ledger

FP = "fp-identity"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A curator's own config folder: keys under it, named by the ledger's id (no DPTUNE_LEDGER_KEY)."""
    monkeypatch.delenv("DPTUNE_LEDGER_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGSERVICE", "PGSERVICEFILE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "config"


def _spellings(pg: Any, db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    service = tmp_path / "pg_service.conf"
    service.write_text(f"[team]\nhost=127.0.0.1\nport={pg.port}\ndbname={db}\nuser=postgres\n")
    monkeypatch.setenv("PGSERVICEFILE", str(service))
    with open(os.environ["PGPASSFILE"], "a") as f:  # libpq matches .pgpass by the host as spelled
        f.write(f"localhost:{pg.port}:*:postgres:{pg.password}\n")
    return {
        "localhost": f"postgresql://postgres@localhost:{pg.port}/{db}",
        "socket": f"postgresql://postgres@/{db}?host={pg.socket_dir}&port={pg.port}",
        "service": "postgresql:///?service=team",
    }


def test_the_key_and_the_ledger_are_found_however_it_is_reached(pg: Any, pg_url: str, home: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    first = Ledger(pg_url)
    assert first.ledger_id is not None and re.fullmatch(r"[0-9a-f]{32}", first.ledger_id)
    assert first.key_path == home / "dptune" / "keys" / f"{first.ledger_id}.key" and first.key_path.exists()
    first.set_budget(FP, 10.0, 1e-5, n=1000)
    db = pg_url.rsplit("/", 1)[1]
    for how, url in _spellings(pg, db, tmp_path, monkeypatch).items():
        other = Ledger(url)
        assert other.ledger_id == first.ledger_id and other.key_path == first.key_path, how
        assert other.key() == first.key(), how  # found, and the database's check value accepts it
        assert other.same_ledger(str(first.location), first.ledger_id), how
    # libpq's environment: a bare URL, everything from PG* variables
    monkeypatch.setenv("PGHOST", "127.0.0.1")
    monkeypatch.setenv("PGPORT", str(pg.port))
    monkeypatch.setenv("PGUSER", "postgres")
    monkeypatch.setenv("PGDATABASE", db)
    env_ledger = Ledger("postgresql:///")
    assert env_ledger.ledger_id == first.ledger_id and env_ledger.key() == first.key()
    # shown as the server libpq reached (not postgresql:///), a form that parses back to it
    assert str(env_ledger.location) == f"postgresql://postgres@127.0.0.1:{pg.port}/{db}"
    for name in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE"):
        monkeypatch.delenv(name)
    assert Ledger(str(env_ledger.location)).ledger_id == first.ledger_id


def test_another_ledger_is_not_the_same_even_when_spelled_alike(pg: Any, pg_url: str, home: Path) -> None:
    first = Ledger(pg_url)
    other_db = pg.new_database()
    try:
        second = Ledger(pg.url(other_db))
        assert second.ledger_id != first.ledger_id and second.key_path != first.key_path
        assert not second.same_ledger(str(first.location), first.ledger_id)
    finally:
        pg.drop_database(other_db)


def test_a_restored_dump_is_the_same_ledger(pg: Any, pg_url: str, home: Path, tmp_path: Path) -> None:
    """pg_dump -Fc, pg_restore into a new database: the same id, so the same key file and "same ledger"."""
    led = Ledger(pg_url)
    led.set_budget(FP, 10.0, 1e-5, n=1000)
    led.reserve(FP, "s1", trial_event(noise_multiplier=1.0, sampling_rate=0.01, steps=100, score_noise=None))
    dump = tmp_path / "ledger.dump"
    db = pg_url.rsplit("/", 1)[1]
    env = {**os.environ, "PGPASSFILE": os.environ["PGPASSFILE"]}
    bindir = Path(pg.bindir)
    subprocess.run([str(bindir / "pg_dump"), "-Fc", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres",
                    "-f", str(dump), db], check=True, env=env, capture_output=True)
    restored = pg.new_database("restored")
    try:
        subprocess.run([str(bindir / "pg_restore"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres",
                        "-d", restored, str(dump)], check=True, env=env, capture_output=True)
        back = Ledger(pg.url(restored))
        assert back.ledger_id == led.ledger_id and back.key_path == led.key_path and back.key() == led.key()
        assert [c.name for c in back.charges()] == ["s1"]
    finally:
        pg.drop_database(restored)


FORMS = ["postgresql://alice@/dptune?host=/run/postgresql&port=5432",
         "postgresql://alice@%2Frun%2Fpostgresql:5432/dptune",
         "host=/run/postgresql port=5432 dbname=dptune user=alice",
         "host=db.example port=5433 dbname=dptune user=alice sslmode=verify-full sslrootcert=/etc/ssl/ca.pem",
         "postgresql:///?service=team", "postgresql:///",
         "postgresql://alice@h1:5432,h2:5433/dptune?target_session_attrs=read-write",
         "postgresql://alice@[::1]:5432/dptune", "postgresql://alice@127.0.0.1:5432/my%20ledger?sslmode=require"]


@pytest.mark.parametrize("given", FORMS)
def test_every_shown_form_parses_back_to_the_same_connection(given: str) -> None:
    """What dptune prints (messages, state.json, the resume and train commands) is a URL libpq reads back as the very
    parameters given: a socket directory or several hosts in the query, key-value conninfo as a URL (issue 64 item 1:
    a socket ledger's printed URL used to read back as a database name)."""
    from psycopg.conninfo import conninfo_to_dict

    from dptune.ledger import ledger_location

    loc = ledger_location(given)
    assert loc.is_postgres and loc.shown.startswith("postgresql://")
    assert conninfo_to_dict(loc.shown) == conninfo_to_dict(given)
    assert ledger_location(loc.shown).shown == loc.shown


def test_a_socket_ledgers_printed_url_reaches_it(pg: Any, pg_url: str, home: Path) -> None:
    db = pg_url.rsplit("/", 1)[1]
    first = Ledger(f"postgresql://postgres@/{db}?host={pg.socket_dir}&port={pg.port}")
    again = Ledger(str(first.location))  # the form the resume and train commands print
    assert again.ledger_id == first.ledger_id is not None and again.key() == first.key()
    assert str(pg.socket_dir) in str(first.location) and f"/{db}?" in str(first.location)


def test_a_certificate_names_its_ledger_by_id(pg: Any, pg_url: str, home: Path) -> None:
    """The binding (under the MAC) carries the team ledger's id: verified against another ledger — even one holding
    the same key, as a copy made with another id would — it is refused by name, before any other check."""
    from dptune.certificate import Certificate, CertificateError, verify_binding

    led = Ledger(pg_url)
    led.set_budget(FP, 10.0, 1e-5, n=1000)
    event = trial_event(noise_multiplier=1.0, sampling_rate=0.01, steps=100, score_noise=None)
    cid = led.reserve(FP, "s1", event)
    cert = Certificate.build(led.dataset_id(FP), 1e-5, [("search", event)], {"rule": "none"}).bind(
        led, [led.charge(cid).token])
    assert cert.binding["ledger"] == led.ledger_id
    assert [c.id for c in verify_binding(cert, led)] == [cid]
    other_db = pg.new_database()
    try:
        other = Ledger(pg.url(other_db))
        with pytest.raises(CertificateError, match=f"charged to the ledger {led.ledger_id}"):
            verify_binding(cert, other)
    finally:
        pg.drop_database(other_db)


def test_a_read_only_look_at_another_database_sets_nothing_up(pg: Any, pg_url: str, home: Path) -> None:
    """How dptune train compares a --ledger spelled otherwise with the search's: read-only, so a typo'd database gets
    no tables, id or key, and is not the same ledger."""
    import psycopg

    first = Ledger(pg_url)
    other_db = pg.new_database()
    try:
        look = Ledger(pg.url(other_db), read_only=True)
        assert look.ledger_id is None and not look.same_ledger(str(first.location), first.ledger_id)
        with psycopg.connect(pg.url(other_db), autocommit=True) as con:
            assert con.execute("SELECT to_regclass('charges')").fetchone() == (None,)
        assert Ledger(pg_url, read_only=True).same_ledger(str(first.location), first.ledger_id)
    finally:
        pg.drop_database(other_db)
