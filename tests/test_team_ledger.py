"""A team's ledger on a real PostgreSQL server (issue 42; the server: tests/pg.py, one per session, a fresh database
per test). Item 1: a postgresql:// URL is a ledger, its password in no printed line, state file or certificate.
Item 2: append-only in the database (the curator role and the trigger). Item 4: migrate from SQLite. Item 5: a
server crash keeps a reservation; an unreachable server stops a search before anything (exit 2, the host named, the
password not). Item 6: a file ledger on a `ray up` node is warned about before the charge. The core ledger tests run
on both backends in tests/test_ledger.py; a search, a crash between reserve and commit, and a second curator's
final training: tests/test_team_search.py."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from dp_accounting import dp_event as de

from dptune import accounting as A
from dptune.errors import ConfigError
from dptune.ledger import Ledger, LedgerUnavailable, ledger_location
from tests.conftest import ROOT, digits_seed_with_k, free_port

FP = "f" * 64
DELTA = 1e-5
SPACE = str(ROOT / "search_spaces" / "digits.yaml")


def _event(sigma: float = 1.5) -> de.DpEvent:
    return de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=sigma, sampling_rate=0.1, steps=150,
                                                   score_noise=6.0), 3.0, math.inf)


def _cli_env(tmp_path: Path) -> dict[str, str]:
    """A curator's shell: own HOME (its key under ~/.config/dptune/keys), K = 0 (the whole CLI path, no Ray)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DPTUNE_"))}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), DPTUNE_TEST_DRAW_SEED=str(digits_seed_with_k(0, 0)))
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_postgres_url_is_a_ledger_and_its_password_is_never_on_a_command_line(pg: Any, pg_url: str,
                                                                               tmp_path: Path) -> None:
    """Item 1, and issue 64 item 3: `--ledger postgresql://user@host:port/db` charges the team database (not a SQLite
    file named after the URL), the password from libpq's own sources (here PGPASSWORD); a URL that holds the password
    is refused (exit 2, nothing charged, the alternatives named, the password not echoed): a command line is every
    local user's to read and Ray shows the driver's as its job entrypoint. The password is in no printed line, no
    file of the run (sealed/ and the certificate), nor the resume command or call."""
    from dptune.api import resume_call
    from dptune.cli.search import resume_command

    db = pg_url.rsplit("/", 1)[1]
    env = _cli_env(tmp_path)
    env.pop("PGPASSFILE", None)  # the password comes from the environment only
    args = ["-m", "dptune.search", "--space", SPACE, "--name", "s1", "--runs-dir", str(tmp_path / "runs"),
            "--budget-epsilon", "20"]
    for given in (pg.url(db, password=pg.password), f"{pg.url(db)}?password={pg.password}"):
        r = _run([*args, "--ledger", given], {**env, "PGPASSWORD": pg.password}, tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "--ledger: holds a password" in r.stderr and pg.password not in r.stdout + r.stderr
        assert all(w in r.stderr for w in ("~/.pgpass", "PGPASSWORD", "service")), r.stderr
        assert not (tmp_path / "runs").exists()
    r = _run([*args, "--ledger", pg.url(db)], {**env, "PGPASSWORD": pg.password}, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    url = pg.url(db)
    shown = f"postgresql://postgres@127.0.0.1:{pg.port}/{db}"
    assert f"ledger: {shown}" in r.stdout
    assert pg.password not in r.stdout + r.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("runs", "home")] == []  # no file named after it
    for f in (tmp_path / "runs").rglob("*"):
        if f.is_file():
            assert pg.password.encode() not in f.read_bytes(), f
    state = json.loads((tmp_path / "runs" / "s1" / "sealed" / "state.json").read_text())
    assert state["ledger"] == shown
    [charge] = Ledger(pg_url).charges()  # one: the refused runs charged nothing
    assert charge.status == "committed" and charge.name == "s1"
    cert = json.loads((tmp_path / "runs" / "s1" / "release" / "certificate.json").read_text())
    assert cert["binding"]["charges"][0]["token"] == charge.token  # bound to the team ledger's charge
    for text in (resume_command(["--space", SPACE, "--ledger", url], "s1"),
                 resume_command(["--space", SPACE, f"--ledger={url}"], "s1"),
                 resume_call({"space": SPACE, "ledger": url}, "s1"), repr(ledger_location(url))):
        assert pg.password not in text and shown in text, text
    r = _run(["-m", "dptune.cli.ledger", "show", "--ledger", url], {**env, "PGPASSWORD": pg.password}, tmp_path)
    assert r.returncode == 0 and shown in r.stderr and pg.password not in r.stdout + r.stderr, r.stderr
    r = _run(["-m", "dptune.cli.ledger", "show", "--ledger", pg.url(db, password=pg.password)], env, tmp_path)
    assert r.returncode == 2 and "holds a password" in r.stderr and pg.password not in r.stdout + r.stderr


def _login(pg: Any, name: str) -> tuple[str, str]:
    """A curator's own login (in the dptune_curator role), with its password in the pgpass file."""
    password = os.urandom(8).hex()
    pg.sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE dptune_curator")
    with open(os.environ["PGPASSFILE"], "a") as f:
        f.write(f"127.0.0.1:{pg.port}:*:{name}:{password}\n")
    return name, password


def test_charges_are_append_only_in_the_database_for_a_curator_login(pg: Any, pg_url: str, tmp_path: Path) -> None:
    """Item 2: after `setup-team`, a curator's login (role dptune_curator) opens budgets, reserves, commits and
    aborts through the ledger, but SQL cannot delete, truncate or rewrite a charge, reopen a closed one, or drop
    or disable the trigger that says so; the owner cannot delete or rewrite one either (the trigger)."""
    r = _run(["-m", "dptune.cli.ledger", "setup-team", "--ledger", pg_url], {**os.environ, "PYTHONPATH": str(ROOT)},
             tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        user, _ = _login(pg, "alice")
    except psycopg.errors.DuplicateObject:  # the role is cluster-wide: an earlier test made it
        user = "alice"
    db = pg_url.rsplit("/", 1)[1]
    alice = pg.url(db, user=user)
    led = Ledger(alice)
    led.set_budget(FP, 50.0, DELTA, label="team")
    a = led.reserve(FP, "a", _event())
    b = led.reserve(FP, "b", _event())
    led.commit(a)
    led.abort(b)
    assert [c.status for c in led.charges()] == ["committed", "aborted"]
    refused = ["DELETE FROM charges", "TRUNCATE charges", "UPDATE charges SET epsilon = 0",
               "UPDATE charges SET event = '{}'", f"UPDATE charges SET status = 'aborted' WHERE id = {a}",
               f"UPDATE charges SET status = 'reserved' WHERE id = {b}", "DROP TRIGGER dptune_charges_append_only ON charges",
               "ALTER TABLE charges DISABLE TRIGGER ALL", "DROP TABLE charges", "DELETE FROM budgets"]
    for statement in refused:
        with psycopg.connect(alice, autocommit=True) as con, pytest.raises(psycopg.errors.InsufficientPrivilege):
            con.execute(statement)  # type: ignore[arg-type]
    with psycopg.connect(pg_url, autocommit=True) as owner:
        for statement in ("DELETE FROM charges", f"UPDATE charges SET status = 'aborted' WHERE id = {a}",
                          "UPDATE charges SET epsilon = 0", "TRUNCATE charges"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only|closed once"):
                owner.execute(statement)  # type: ignore[arg-type]
    assert [(c.id, c.status) for c in Ledger(pg_url).charges()] == [(a, "committed"), (b, "aborted")]
    assert Ledger(pg_url).spent(FP) == pytest.approx(A.epsilon([_event()], DELTA), rel=1e-9)


def test_migrate_copies_budgets_charges_ids_and_key_once_and_leaves_the_file(pg_url: str, tmp_path: Path) -> None:
    """Item 4: `migrate --to` copies budgets (ids, labels, keyed record ids), charges (events, status, row ids,
    tokens) and the curator key; a second run copies nothing; the SQLite file is byte for byte unchanged; totals are
    equal; a certificate MAC made on the file verifies on the team ledger; a team ledger under another key is
    refused."""
    path = tmp_path / "l.sqlite"
    src = Ledger(path)
    src.set_budget(FP, 50.0, DELTA, label="digits", ids=[b"i" * 16, b"j" * 16], content=b"c" * 32, n=1797)
    src.set_budget("e" * 64, 30.0, DELTA, label="other")
    c1 = src.reserve(FP, "s1", _event())
    src.commit(c1)
    c2 = src.reserve([FP, "e" * 64], "both", _event(2.0))  # one reservation on two budgets, left open
    src.abort(src.reserve(FP, "gone", _event(3.0)))
    mac = src.mac(b"certificate")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = _run(["-m", "dptune.cli.ledger", "migrate", "--ledger", str(path), "--to", pg_url], env, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "copied 2 budgets and 4 charges; 0 were there already" in r.stdout
    team = Ledger(pg_url)
    assert [(c.id, c.name, c.status, c.token, c.fingerprint) for c in team.charges()] == \
        [(c.id, c.name, c.status, c.token, c.fingerprint) for c in src.charges()]
    for fp in (FP, "e" * 64):
        assert team.dataset_id(fp) == src.dataset_id(fp) and team.budget(fp) == src.budget(fp)
        assert team.spent(fp) == pytest.approx(src.spent(fp), rel=1e-12)
    assert team._read("SELECT ids, content, records FROM budgets WHERE fingerprint=?", (FP,)) == \
        [(b"i" * 16 + b"j" * 16, b"c" * 32, 1797)]
    assert team.verify_mac(b"certificate", mac)
    r = _run(["-m", "dptune.cli.ledger", "migrate", "--ledger", str(path), "--to", pg_url], env, tmp_path)
    assert r.returncode == 0 and "copied 0 budgets and 0 charges; 6 were there already" in r.stdout, r.stdout
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    team.commit(c2)  # the open reservation closes on the team ledger (both budgets' rows)
    assert [c.status for c in team.charges()] == ["committed", "committed", "committed", "aborted"]
    r = team.reserve(FP, "after", _event())  # new charges number after the copied ones
    assert r > max(c.id for c in src.charges())
    other = Ledger(tmp_path / "o.sqlite")  # another curator's file: another key
    other.set_budget("d" * 64, 5.0, DELTA)
    r2 = _run(["-m", "dptune.cli.ledger", "migrate", "--ledger", str(tmp_path / "o.sqlite"), "--to", pg_url], env, tmp_path)
    assert r2.returncode == 2 and "another curator key" in r2.stderr, r2.stderr
    assert Ledger(pg_url).budget("d" * 64) is None


def test_reservation_is_durable_across_a_server_crash_and_refused_while_it_is_down(pg: Any, pg_url: str) -> None:
    """Item 5: a reservation committed before the server crashes (immediate stop: no shutdown checkpoint) is there
    after WAL recovery, still counting, and closes; while the server is down a reservation is refused with a
    LedgerUnavailable (exit 2 in a CLI) that names the host, and nothing is stored."""
    led = Ledger(pg_url)
    led.set_budget(FP, 50.0, DELTA)
    cid = led.reserve(FP, "before the crash", _event())
    pg.restart()
    assert [(c.id, c.status) for c in led.charges()] == [(cid, "reserved")]
    assert led.spent(FP) == pytest.approx(A.epsilon([_event()], DELTA), rel=1e-9)
    pg.stop("immediate")
    try:
        with pytest.raises(LedgerUnavailable, match=f"127.0.0.1:{pg.port}") as e:
            led.reserve(FP, "while down", _event())
        assert isinstance(e.value, ConfigError) and e.value.field == "--ledger"
    finally:
        pg.start()
    led.commit(cid)
    assert [(c.name, c.status) for c in led.charges()] == [("before the crash", "committed")]


def test_a_connection_lost_inside_a_write_is_a_clear_error_and_stores_nothing(pg: Any, pg_url: str) -> None:
    """Item 5: the server ends the ledger's connection in the middle of a write transaction (another session
    terminates its backend): the write raises LedgerUnavailable, which says the connection was lost and names the
    host, not a driver traceback; nothing of it is stored, and the next write works."""
    led = Ledger(pg_url)
    led.set_budget(FP, 50.0, DELTA)

    def lost_midway(con: Any) -> None:
        con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256) "
                    "VALUES (%s, 'half-written', '{\"type\": \"NoOpDpEvent\"}', 1.0, 'reserved', 0, 'tok', 'sha')", (FP,))
        pid = con.execute("SELECT pg_backend_pid()").fetchone()[0]
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        con.execute("SELECT 1")

    with pytest.raises(LedgerUnavailable, match=f"was lost .*127.0.0.1:{pg.port}|127.0.0.1:{pg.port}.*was lost"):
        led._transact(lost_midway)
    assert led.charges() == []
    cid = led.reserve(FP, "after", _event())
    assert [(c.id, c.status) for c in led.charges()] == [(cid, "reserved")]


def test_unreachable_server_at_start_exits_2_naming_the_host_not_the_password(tmp_path: Path) -> None:
    """Item 5: a search whose team ledger cannot be reached stops with exit 2 before anything is charged or
    written (no run folder), with a message that names the server and never the password."""
    port = free_port()  # nothing listens there
    secret = "s3cret-" + os.urandom(6).hex()
    r = _run(["-m", "dptune.search", "--space", SPACE, "--name", "s1", "--runs-dir", str(tmp_path / "runs"),
              "--ledger", f"postgresql://alice@127.0.0.1:{port}/dptune", "--budget-epsilon", "20"],
             {**_cli_env(tmp_path), "PGPASSWORD": secret}, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "cannot reach the PostgreSQL ledger" in r.stderr
    assert secret not in r.stdout + r.stderr
    assert not (tmp_path / "runs").exists() and "charged to the ledger" not in r.stdout


@pytest.mark.integration  # make test-slow (CI runs it): a whole search command beside a server, ~17 s
def test_a_file_ledger_on_a_ray_up_node_is_warned_about_before_the_charge(pg_url: str, tmp_path: Path) -> None:
    """Item 6: on a node `ray up` created (~/ray_bootstrap_config.yaml), a search whose ledger is a local file
    says, before it is charged, that `ray down` loses the budget and how to use the team ledger (DPTUNE_LEDGER);
    with DPTUNE_LEDGER set to the team's URL it charges there and says nothing. cluster.yaml takes the URL from
    the environment (a secret), never a literal."""
    env = _cli_env(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "ray_bootstrap_config.yaml").write_text("cluster_name: dptune\n")
    args = ["-m", "dptune.search", "--space", SPACE, "--runs-dir", str(tmp_path / "runs"), "--budget-epsilon", "20"]
    r = _run([*args, "--name", "file"], env, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    warning = r.stdout.index("`ray down` deletes it")
    assert warning < r.stdout.index("charged to the ledger before any trial") and "DPTUNE_LEDGER" in r.stdout
    r = _run([*args, "--name", "team"], {**env, "DPTUNE_LEDGER": pg_url}, tmp_path)
    assert r.returncode == 0 and "ray down" not in r.stdout, r.stdout + r.stderr
    assert [c.name for c in Ledger(pg_url).charges()] == ["team"]
    cluster = (ROOT / "cluster.yaml").read_text()
    assert "DPTUNE_LEDGER" in cluster and "postgresql://" not in cluster.replace("postgresql://USER", "")
