"""A team ledger's failures as an operator meets them (issue 64 item 4), on a real PostgreSQL server: each class its
own line and fix, exit 2, one connection attempt where waiting cannot help, and a release that survives a server
restart after its charge."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dptune.accounting import trial_event
from dptune.ledger import Ledger, LedgerUnavailable
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
FP = "fp-failures"


def _event() -> Any:
    return trial_event(noise_multiplier=1.0, sampling_rate=0.01, steps=100, score_noise=None)


def _login(pg: Any, name: str, extra: str = "", pgpass: bool = True) -> str:
    password = secrets.token_hex(8)
    pg.sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' {extra}")
    if pgpass:
        with open(os.environ["PGPASSFILE"], "a") as f:
            f.write(f"127.0.0.1:{pg.port}:*:{name}:{password}\n")
    return password


def _failed_logins(pg: Any, user: str) -> int:
    return pg.log.read_text().count(f'password authentication failed for user "{user}"')


def _user_url(pg: Any, pg_url: str, user: str, query: str = "") -> str:
    return pg_url.replace("postgresql://postgres@", f"postgresql://{user}@") + query


def test_a_wrong_password_is_its_own_line_tried_once(pg: Any, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    Ledger(pg_url)  # the owner sets the ledger up
    user = f"bob_{secrets.token_hex(3)}"
    _login(pg, user, pgpass=False)
    monkeypatch.setenv("PGPASSWORD", "not-" + secrets.token_hex(4))
    before = _failed_logins(pg, user)
    t0 = time.monotonic()
    with pytest.raises(LedgerUnavailable) as e:
        Ledger(_user_url(pg, pg_url, user))
    assert time.monotonic() - t0 < 5 and not e.value.retry
    assert f"refused the login {user!r}" in e.value.problem and "~/.pgpass" in e.value.fix, e.value
    assert "not-" not in str(e.value)
    time.sleep(0.3)  # the server's log line
    assert _failed_logins(pg, user) - before == 1  # one attempt: one line in the server's log (lockout policies)


def test_the_connection_limit_ssl_and_a_missing_database_are_each_named(pg: Any, pg_url: str) -> None:
    Ledger(pg_url)
    user = f"carol_{secrets.token_hex(3)}"
    _login(pg, user, "CONNECTION LIMIT 0")
    cases = [(_user_url(pg, pg_url, user), "connection limit", "max_connections"),
             (pg_url + "?sslmode=require", "refused the connection's SSL mode", "sslmode="),
             (pg_url.rsplit("/", 1)[0] + "/no_such_db_" + secrets.token_hex(3), "does not exist", "setup-team")]
    for url, said, fix in cases:
        t0 = time.monotonic()
        with pytest.raises(LedgerUnavailable) as e:
            Ledger(url)
        assert time.monotonic() - t0 < 5 and not e.value.retry, url
        assert said in e.value.problem and fix in e.value.fix, e.value


def test_a_read_only_login_is_told_to_use_the_primary(pg: Any, pg_url: str) -> None:
    Ledger(pg_url)
    user = f"dave_{secrets.token_hex(3)}"
    _login(pg, user, "SUPERUSER")
    pg.sql(f"ALTER ROLE {user} SET default_transaction_read_only = on")
    led = Ledger(_user_url(pg, pg_url, user))  # reading works
    assert led.charges() == []
    with pytest.raises(LedgerUnavailable) as e:
        led.set_budget(FP, 5.0, 1e-5, n=1000)
    assert "accepts no writes" in e.value.problem and "target_session_attrs=read-write" in e.value.fix, e.value
    assert Ledger(pg_url).charges() == []


@pytest.mark.db  # waits ~10 s on a port nothing answers, as a team-ledger test: not a unit test (make test-fast)
def test_no_server_is_retried_only_briefly_before_a_charge() -> None:
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(LedgerUnavailable) as e:
        Ledger(f"postgresql://alice@127.0.0.1:{port}/dptune")
    took = time.monotonic() - t0
    assert e.value.retry and "cannot reach" in e.value.problem and f"127.0.0.1:{port}" in e.value.problem
    assert 5 < took < 20, took  # ~10 s (CONNECT_WAIT): long enough for a blip, short before anything is charged


def test_a_charge_closes_across_a_20_second_server_stop(pg: Any, pg_url: str) -> None:
    """The server stops right after a search's charge and comes back 20 s later: closing the charge waits for it
    (DPTUNE_LEDGER_WAIT, default 120 s) and commits once; the release is not lost."""
    led = Ledger(pg_url)
    led.set_budget(FP, 50.0, 1e-5, n=1000)
    charge = led.reserve(FP, "s1", _event())
    pg.stop("fast")
    restart = threading.Timer(20.0, pg.start)
    restart.start()
    try:
        t0 = time.monotonic()
        led.commit(charge)
        took = time.monotonic() - t0
    finally:
        restart.join()
    assert 19 < took < 60, took
    assert [(c.id, c.status) for c in Ledger(pg_url).charges()] == [(charge, "committed")]


def test_the_cli_says_which_failure_and_that_nothing_was_charged(pg: Any, pg_url: str, tmp_path: Path) -> None:
    """A search whose login is refused stops before reading any data (in a few seconds), exit 2, one line naming
    the login and that nothing was charged."""
    Ledger(pg_url)
    user = f"erin_{secrets.token_hex(3)}"
    _login(pg, user, pgpass=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DPTUNE_"))}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), PGPASSWORD="wrong")
    env.pop("PGPASSFILE", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dptune.search", "--space", str(ROOT / "search_spaces" / "digits.yaml"),
                        "--runs-dir", str(tmp_path / "runs"), "--ledger", _user_url(pg, pg_url, user),
                        "--budget-epsilon", "20"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"refused the login {user!r}" in r.stderr and "nothing was charged" in r.stderr, r.stderr
    assert "loading the data" in r.stdout and not (tmp_path / "runs").exists()
    assert time.monotonic() - t0 < 30  # the interpreter's imports, then one refused attempt: no data was read


def test_ledger_check_answers_each_question_in_about_a_second(pg: Any, pg_url: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`dptune ledger check` (issue 64 item 5): reachable, login, role, ledger id, this machine's key, writable; each
    a line, exit 2 if any fails, about a second (in-process here: the command's imports aside)."""
    from dptune.cli.ledger import main
    from dptune.ledger import check

    owner = Ledger(pg_url)
    t0 = time.monotonic()
    found = {f.name: f for f in check(pg_url)}
    assert time.monotonic() - t0 < 1.5
    assert all(f.ok for f in found.values()) and owner.ledger_id in found["ledger"].said, found
    assert set(found) == {"reachable", "login", "role", "ledger", "key", "writable"}
    # a curator's login on a machine without the key, and one whose transactions are read-only
    assert main(["setup-team", "--ledger", pg_url]) == 0  # the curator role and its grants
    user = f"fay_{secrets.token_hex(3)}"
    _login(pg, user)
    monkeypatch.setenv("DPTUNE_LEDGER_KEY", str(tmp_path / "none.key"))
    found = {f.name: f for f in check(_user_url(pg, pg_url, user))}
    assert not found["role"].ok and f"GRANT dptune_curator TO {user}" in found["role"].said
    assert "key" not in found  # a login outside the role reads nothing more
    pg.sql(f"GRANT dptune_curator TO {user}")
    found = {f.name: f for f in check(_user_url(pg, pg_url, user))}
    assert found["role"].ok and not found["key"].ok and "has no key" in found["key"].said, found
    pg.sql(f"ALTER ROLE {user} SET default_transaction_read_only = on")
    assert not {f.name: f for f in check(_user_url(pg, pg_url, user))}["writable"].ok
    assert main(["check", "--ledger", _user_url(pg, pg_url, user)]) == 2
    monkeypatch.setenv("DPTUNE_LEDGER_KEY", str(owner.key_path))
    assert main(["check", "--ledger", pg_url]) == 0
    t0 = time.monotonic()
    [down] = check(f"postgresql://alice@127.0.0.1:{free_port()}/dptune")
    assert down.name == "reachable" and not down.ok and "cannot reach" in down.said and time.monotonic() - t0 < 2


def test_setup_team_without_createrole_names_what_to_grant_and_creates_nothing(
        pg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A delegated owner (owns the database, no CREATEROLE): setup-team checks every privilege first and stops
    before any table or key exists, naming the statement to run (issue 64: it ended in a traceback half set up)."""
    from dptune.cli.ledger import main

    owner = f"gus_{secrets.token_hex(3)}"
    _login(pg, owner)
    db = pg.new_database()
    try:
        pg.sql(f'ALTER DATABASE "{db}" OWNER TO {owner}')
        pg.sql(f"GRANT CREATE ON SCHEMA public TO {owner}", dbname=db)
        pg.sql("DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dptune_team_x') THEN "
               "DROP ROLE dptune_team_x; END IF; END $$")
        monkeypatch.setenv("DPTUNE_LEDGER_KEY", str(tmp_path / "k.key"))
        url = f"postgresql://{owner}@127.0.0.1:{pg.port}/{db}"
        assert main(["setup-team", "--ledger", url, "--role", "dptune_team_x"]) == 2
        err = capsys.readouterr().err
        assert "nothing was created" in err and "CREATE ROLE dptune_team_x NOLOGIN" in err and "CREATEROLE" in err, err
        assert not (tmp_path / "k.key").exists()
        import psycopg

        with psycopg.connect(pg.url(db), autocommit=True) as con:
            assert con.execute("SELECT to_regclass('charges')").fetchone() == (None,)
        pg.sql(f"ALTER ROLE {owner} CREATEROLE")
        assert main(["setup-team", "--ledger", url, "--role", "dptune_team_x"]) == 0
        assert (tmp_path / "k.key").exists()
    finally:
        pg.drop_database(db)
        pg.sql("DROP ROLE IF EXISTS dptune_team_x")


def test_an_over_budget_refusal_on_a_team_ledger_does_not_tell_a_curator_to_raise_it(pg: Any, pg_url: str) -> None:
    from dptune.ledger import BudgetExceeded

    led = Ledger(pg_url)
    led.set_budget(FP, 0.01, 1e-5, n=1000)
    with pytest.raises(BudgetExceeded) as e:
        led.reserve(FP, "s", _event())
    assert "owner's to raise" in e.value.fix and "set-budget" not in e.value.fix, e.value
