"""A ledger operators can audit (issue 64 item 5): each charge records who (the database login, written by the
database itself) and when; `ledger history` filters by budget, time and login; a team ledger's schema has a version
and `ledger upgrade` migrates one written before it (tested from that schema, on a real server)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dptune.accounting import trial_event
from dptune.cli.ledger import main
from dptune.ledger import Ledger, history

FP = "fp-history"


def _event() -> Any:
    return trial_event(noise_multiplier=1.0, sampling_rate=0.01, steps=100, score_noise=None)


def _curator(pg: Any, pg_url: str) -> str:
    return str(pg.login(pg_url, "dptune_curator", prefix="hal"))


def test_each_charge_records_who_and_when_and_history_filters(pg: Any, pg_url: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["setup-team", "--ledger", pg_url]) == 0
    owner = Ledger(pg_url)
    owner.set_budget(FP, 50.0, 1e-5, n=1000, label="digits")
    t0 = time.time()
    owner.reserve(FP, "by-owner", _event())
    curator_url = _curator(pg, pg_url)
    curator = Ledger(curator_url)
    cid = curator.reserve(FP, "by-curator", _event())
    curator.commit(cid)
    # the login is the database's word: an explicit value in the INSERT is overwritten by the trigger
    import psycopg

    with psycopg.connect(curator_url, autocommit=True) as con:
        con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256, "
                    "login) SELECT fingerprint, 'forged', event, epsilon, 'reserved', created, md5(random()::text), "
                    "event_sha256, 'postgres' FROM charges WHERE id = %s", (cid,))
    rows = history(owner)
    who = {r["name"]: r["login"] for r in rows}
    login = curator_url.split("//")[1].split("@")[0]
    assert who == {"by-owner": "postgres", "by-curator": login, "forged": login}
    done = next(r for r in rows if r["name"] == "by-curator")
    assert done["status"] == "committed" and done["closed"] >= done["created"] >= time.strftime(
        "%Y-%m-%dT", time.gmtime(t0)) and done["created"].endswith("+00:00")
    assert [r["name"] for r in history(owner, login=login)] == ["by-curator", "forged"]
    assert history(owner, since="2099-01-01") == []
    assert len(history(owner, dataset_id=owner.dataset_id(FP))) == 3
    capsys.readouterr()
    assert main(["history", "--ledger", pg_url, "--login", login, "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["by-curator", "forged"]
    assert main(["history", "--ledger", pg_url, "--since", "yesterday"]) == 2


def test_upgrade_from_the_schema_before_versions(pg: Any, pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A ledger as the previous release wrote it (no login column or trigger, no version row): it keeps working
    (its charges' login unknown), and `ledger upgrade` migrates it in one transaction; charges after it carry logins."""
    led = Ledger(pg_url)
    for statement in ("DROP TRIGGER dptune_charges_valid ON charges",  # schema 3's (it reads the login)
                      "DROP TRIGGER dptune_charges_login ON charges", "DROP FUNCTION dptune_charges_login()",
                      "ALTER TABLE charges DROP COLUMN login", "DELETE FROM dptune_meta WHERE name = 'schema_version'"):
        pg.sql(statement, dbname=pg_url.rsplit("/", 1)[1])
    led.set_budget(FP, 50.0, 1e-5, n=1000)
    led.reserve(FP, "before", _event())  # the old schema still takes charges
    assert [(r["name"], r["login"]) for r in history(led)] == [("before", None)]
    capsys.readouterr()
    assert main(["upgrade", "--ledger", pg_url]) == 0
    assert "schema 1 -> 3" in capsys.readouterr().out
    led.reserve(FP, "after", _event())
    assert [(r["name"], r["login"]) for r in history(led)] == [("before", None), ("after", "postgres")]
    assert main(["upgrade", "--ledger", pg_url]) == 0 and "already current" in capsys.readouterr().out


def test_a_file_ledger_records_the_machines_user(tmp_path: Path) -> None:
    import getpass

    led = Ledger(tmp_path / "l.sqlite")
    led.set_budget(FP, 10.0, 1e-5, n=1000)
    led.reserve(FP, "s", _event())
    [row] = history(led)
    assert row["login"] == getpass.getuser() and row["status"] == "reserved"
