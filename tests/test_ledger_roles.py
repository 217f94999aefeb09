"""A team ledger no curator can rewrite (a red-team round, as a member of dptune_curator, on a real PostgreSQL server):
a curator opens budgets and charges but changes no budget row (each column, the key included), closes only the
charges its own login reserved, and cannot store a malformed event; an admin (dptune_admin) changes budgets, each
change logged (who, when, old -> new) in a log nobody can rewrite; a schema-2 ledger upgrades to this. The SQLite
ledger and `spent()` refuse an unreadable event with a message naming the charge, never a TypeError."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from dp_accounting import dp_event as de

from dptune import accounting as A
from dptune.cli.ledger import main
from dptune.errors import ConfigError
from dptune.ledger import (
    Ledger,
    UnreadableCharge,
    adopt_identity,
    adopt_records,
    budget_changes,
    budget_match,
    history,
)
from dptune.ledger._event_rules import EVENT_RULES, event_problem

FP = "fp-roles"
DELTA = 1e-5
BAD_EVENTS = {  # what the red team stored, and its cousins: every one refused by the database and by Python
    "count -3": {"type": "SelfComposedDpEvent", "event": {"type": "GaussianDpEvent", "noise_multiplier": 1.0},
                 "count": -3},
    "count 0.5": {"type": "SelfComposedDpEvent", "event": {"type": "NoOpDpEvent"}, "count": 0.5},
    "unknown kind": {"type": "LaplaceDpEvent", "parameter": 1.0},
    "NaN sigma (JSON NaN)": "NaN",
    "NaN sigma (a string)": {"type": "GaussianDpEvent", "noise_multiplier": "NaN"},
    "inf sigma": {"type": "GaussianDpEvent", "noise_multiplier": "inf"},
    "negative sigma": {"type": "GaussianDpEvent", "noise_multiplier": -1.0},
    "q = 1.5": {"type": "PoissonSampledDpEvent", "sampling_probability": 1.5, "event": {"type": "NoOpDpEvent"}},
    "q = 0": {"type": "PoissonSampledDpEvent", "sampling_probability": 0, "event": {"type": "NoOpDpEvent"}},
    "negative shape": {"type": "RepeatAndSelectDpEvent", "event": {"type": "NoOpDpEvent"}, "mean": 3, "shape": -1},
    "bad inside a composition": {"type": "ComposedDpEvent", "events": [
        {"type": "NoOpDpEvent"}, {"type": "WorstCaseDpEvent", "events": [
            {"type": "NoisyMaxDpEvent", "gumbel_scale": 0}]}]},
    "empty worst case": {"type": "WorstCaseDpEvent", "events": []},
    "missing field": {"type": "GaussianDpEvent"},
    "unknown field": {"type": "NoOpDpEvent", "eval": "x"},
    "too deep": json.loads('{"type": "SelfComposedDpEvent", "count": 1, "event": ' * 70 + '{"type": "NoOpDpEvent"}'
                           + "}" * 70),
    "not an object": [1, 2],
}


def _text(bad: Any) -> str:
    if bad == "NaN":
        return json.dumps({"type": "GaussianDpEvent", "noise_multiplier": math.nan})  # Python writes NaN
    return json.dumps(bad)


def _event(sigma: float = 1.5) -> de.DpEvent:
    return de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=sigma, sampling_rate=0.1, steps=150,
                                                   score_noise=6.0), 3.0, math.inf)


def _login(pg: Any, pg_url: str, role: str) -> str:
    """A new login in ``role`` (its password in the pgpass file): the URL it connects with."""
    return str(pg.login(pg_url, role))


def _who(url: str) -> str:
    return url.split("//")[1].split("@")[0]


@pytest.fixture
def team(pg: Any, pg_url: str) -> dict[str, str]:
    """A ledger set up by `setup-team` (the owner: postgres), two curators and an admin."""
    assert main(["setup-team", "--ledger", pg_url]) == 0
    return {"owner": pg_url, "alice": _login(pg, pg_url, "dptune_curator"),
            "bob": _login(pg, pg_url, "dptune_curator"), "admin": _login(pg, pg_url, "dptune_admin")}


def _row(url: str) -> tuple[Any, ...]:
    with psycopg.connect(url) as con:
        return tuple(con.execute("SELECT * FROM budgets ORDER BY fingerprint").fetchall())


class _Data:
    """Records as the ledger sees them: ids and one content signature each."""

    def __init__(self, tag: str, n: int = 200) -> None:
        self.record_ids: tuple[str, ...] | None = tuple(f"{tag}/{i}" for i in range(n))

    def content_signatures(self) -> list[tuple[bytes, ...]]:
        return [(hashlib.sha256(i.encode()).digest(),) for i in self.record_ids or ()]

    def example_digests(self) -> list[bytes]:
        return [hashlib.sha256(b"x" + i.encode()).digest() for i in self.record_ids or ()]


def test_a_curator_changes_no_budget_row_not_even_its_key(team: dict[str, str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    owner, alice = Ledger(team["owner"]), Ledger(team["alice"])
    owner.set_budget(FP, 10.0, DELTA, label="digits", n=1000, digests=[b"d" * 32], ids=[b"i" * 16],
                     content=b"c" * 16)
    cid = alice.reserve(FP, "s", _event())
    alice.commit(cid)
    spent, before = alice.spent(FP), _row(team["owner"])
    assert spent > 0
    attacks = ["fingerprint = 'renamed'", "epsilon = 1000", "delta = 0.5", "label = 'x'", "created = 0",
               "dataset_id = 'x'", "digests = NULL", "records = 1", "ids = NULL", "content = NULL",
               "content = '\\x00'::bytea", "ids = ids || ids"]
    for change in attacks:
        with psycopg.connect(team["alice"], autocommit=True) as con, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            con.execute(f"UPDATE budgets SET {change}")  # type: ignore[arg-type]
    for statement in ("DELETE FROM budgets", "TRUNCATE budgets", "ALTER TABLE budgets DISABLE TRIGGER ALL"):
        with psycopg.connect(team["alice"], autocommit=True) as con, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            con.execute(statement)  # type: ignore[arg-type]
    assert _row(team["owner"]) == before and alice.spent(FP) == spent  # nothing moved
    # through dptune: a clear refusal naming the admin role and the command, exit 2 at the CLI
    with pytest.raises(ConfigError, match="dptune_admin.*set-budget --ledger"):
        alice.set_budget(FP, 20.0, DELTA)
    capsys.readouterr()
    assert main(["set-budget", "--ledger", team["alice"], "--dataset-id", owner.dataset_id(FP), "--epsilon", "20",
                 "--delta", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert "GRANT dptune_admin TO" in err and f"set-budget --ledger {alice.path} --dataset-id" in err, err
    assert owner.budget(FP) == (10.0, DELTA)


def test_a_curator_closes_only_its_own_charges_and_an_admin_any(team: dict[str, str]) -> None:
    owner, alice, bob = Ledger(team["owner"]), Ledger(team["alice"]), Ledger(team["bob"])
    owner.set_budget(FP, 50.0, DELTA, n=1000)
    a, b = alice.reserve(FP, "alice's", _event()), bob.reserve(FP, "bob's", _event())
    spent = owner.spent(FP)
    with pytest.raises(ConfigError, match=f"reserved by login {_who(team['alice'])}, not by {_who(team['bob'])}.*"
                       "dptune_admin"):
        bob.abort(a)
    with psycopg.connect(team["bob"], autocommit=True) as con, \
            pytest.raises(psycopg.errors.InsufficientPrivilege, match="only that login"):
        con.execute("UPDATE charges SET status = 'aborted', closed = 0 WHERE status = 'reserved'")
    # nor by forging a group: a charge filed under alice's would make her close fail
    with psycopg.connect(team["bob"], autocommit=True) as con, \
            pytest.raises(psycopg.errors.InsufficientPrivilege, match="not a charge of login"):
        con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256, "
                    "group_id) SELECT fingerprint, 'forged', event, 0, 'reserved', 0, 'tok', 'sha', id FROM charges "
                    "WHERE id = %s", (a,))
    assert owner.spent(FP) == pytest.approx(spent, rel=1e-12)  # both reservations still count
    alice.commit(a)
    # bob's search crashed: an admin aborts its orphaned reservation, and the ledger says who did
    Ledger(team["admin"]).abort(b)
    closed = {r["name"]: (r["status"], r["login"], r["closed_by"]) for r in history(owner)}
    assert closed == {"alice's": ("committed", _who(team["alice"]), _who(team["alice"])),
                      "bob's": ("aborted", _who(team["bob"]), _who(team["admin"]))}
    assert owner.spent(FP) == pytest.approx(A.epsilon([_event()], DELTA), rel=1e-9)


def test_no_malformed_event_is_stored_and_an_unreadable_one_is_named(team: dict[str, str]) -> None:
    owner, alice = Ledger(team["owner"]), Ledger(team["alice"])
    owner.set_budget(FP, 50.0, DELTA, n=1000)
    good = alice.reserve(FP, "good", _event())
    for url in (team["alice"], team["owner"]):  # the trigger holds for the owner too
        for why, bad in BAD_EVENTS.items():
            with psycopg.connect(url, autocommit=True) as con, pytest.raises(psycopg.Error, match="malformed"):
                con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, "
                            "event_sha256) VALUES (%s, %s, %s, 0, 'committed', 0, %s, 'sha')",
                            (FP, why, _text(bad), secrets.token_hex(8)))
    assert [c.id for c in alice.charges()] == [good]
    # dptune's own side refuses such an event before storing it (both backends share the rules)
    with pytest.raises(ConfigError, match="malformed"):
        alice.reserve(FP, "bad", de.SelfComposedDpEvent(de.GaussianDpEvent(1.0), -3))
    # a row written around the trigger (the owner disabling it): spent() names the charge, no TypeError
    with psycopg.connect(team["owner"], autocommit=True) as con:
        con.execute("ALTER TABLE charges DISABLE TRIGGER dptune_charges_valid")
        con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256) "
                    "VALUES (%s, 'bad', %s, 0, 'committed', 0, 'tok-bad', 'sha')", (FP, _text(BAD_EVENTS["count -3"])))
        (bad_id,) = con.execute("SELECT id FROM charges WHERE token = 'tok-bad'").fetchone()
    with pytest.raises(UnreadableCharge, match=f"charge #{bad_id} .*count = -3"):
        alice.spent(FP)
    with pytest.raises(UnreadableCharge, match=f"charge #{bad_id}"):
        alice.reserve(FP, "after", _event())  # nothing is charged to a budget whose total cannot be composed


def test_the_file_ledger_refuses_the_same_events_and_names_an_unreadable_charge(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    led = Ledger(tmp_path / "l.sqlite")
    led.set_budget(FP, 50.0, DELTA, n=1000)
    led.commit(led.reserve(FP, "good", _event()))
    with pytest.raises(ConfigError, match="malformed"):
        led.reserve(FP, "bad", de.SelfComposedDpEvent(de.GaussianDpEvent(1.0), -3))
    con = sqlite3.connect(tmp_path / "l.sqlite")
    con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256) "
                "VALUES (?, 'edited', ?, 0, 'committed', 0, 'tok', 'sha')", (FP, _text(BAD_EVENTS["count -3"])))
    con.commit()
    con.close()
    with pytest.raises(UnreadableCharge, match="charge #2 .*count = -3"):
        led.spent(FP)
    capsys.readouterr()
    assert main(["show", "--ledger", str(tmp_path / "l.sqlite")]) == 2
    err = capsys.readouterr().err
    assert "charge #2" in err and "Traceback" not in err and "TypeError" not in err, err


def test_the_database_and_python_read_the_event_rules_alike(team: dict[str, str]) -> None:
    """One table of rules, two readings: each kind on the JSON allow-list has its fields; real events pass both;
    every bad one fails both."""
    import attr

    from dptune.accounting._events import _ALLOWED

    assert {k: sorted(v) for k, v in EVENT_RULES.items()} == {
        name: sorted(f.name for f in attr.fields(cls)) for name, cls in _ALLOWED.items()}
    real = [_event(), A.with_selection(_event(), A.NoisyMaxDpEvent(3.0)),
            de.SelfComposedDpEvent(A.trial_event(noise_multiplier=1.0, sampling_rate=1.0, steps=1, score_noise=None), 5),
            A.WorstCaseDpEvent((A.SubsampledMechanismDpEvent(_event(), 0.5), de.RepeatAndSelectDpEvent(
                de.GaussianDpEvent(2.0), 4.0, 0.0)))]
    with psycopg.connect(team["alice"]) as con:
        def db(text: str) -> str | None:
            return con.execute("SELECT dptune_event_problem(%s)", (text,)).fetchone()[0]  # type: ignore[index]

        for event in real:
            text = json.dumps(A.event_to_json(event))
            assert db(text) is None and event_problem(json.loads(text)) is None, text
        for why, bad in BAD_EVENTS.items():
            assert db(_text(bad)) is not None, why
            assert bad == "NaN" or event_problem(bad) is not None, why


def test_an_admin_changes_budgets_each_change_logged_in_a_log_nobody_rewrites(
        team: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    owner, admin = Ledger(team["owner"]), Ledger(team["admin"])
    Ledger(team["alice"]).set_budget(FP, 10.0, DELTA, label="digits", n=1000)  # a curator opens a budget
    admin.set_budget(FP, 20.0, DELTA, label="digits v2")
    with psycopg.connect(team["admin"], autocommit=True) as con, \
            pytest.raises(psycopg.errors.InsufficientPrivilege, match="never change"):
        con.execute("UPDATE budgets SET fingerprint = 'renamed'")  # its charges are filed under the key
    opened, changed = budget_changes(owner)
    assert (opened["op"], opened["login"], opened["changes"]["epsilon"]) == ("insert", _who(team["alice"]),
                                                                             [None, 10.0])
    assert (changed["op"], changed["login"], changed["changes"]) == (
        "update", _who(team["admin"]), {"epsilon": [10.0, 20.0], "label": ["digits", "digits v2"]})
    assert changed["at"] >= opened["at"] and changed["dataset_id"] == owner.dataset_id(FP)
    assert "fp-roles" not in json.dumps([opened, changed])  # the budget's key stays inside
    for url in (team["alice"], team["admin"], team["owner"]):
        for statement in ("UPDATE budget_changes SET login = 'someone'", "DELETE FROM budget_changes",
                          "TRUNCATE budget_changes", "INSERT INTO budget_changes (fingerprint, op, login, at, changes) "
                          "VALUES ('x', 'update', 'x', 0, '{}')"):
            with psycopg.connect(url, autocommit=True) as con, \
                    pytest.raises(psycopg.errors.InsufficientPrivilege):
                con.execute(statement)  # type: ignore[arg-type]
    assert budget_changes(owner) == [opened, changed]
    capsys.readouterr()
    assert main(["history", "--ledger", team["owner"], "--budgets"]) == 0
    out = capsys.readouterr().out
    assert f"update {_who(team['admin'])}" in out and "epsilon: 10 -> 20" in out and "label: digits -> digits v2" in out, out


def test_a_curators_search_flow_and_adopt(team: dict[str, str]) -> None:
    """Opening a budget, reserve -> commit, and adopting: a curator fills an older budget's empty signatures
    (what a search does on its own); adding to signatures a budget has is the admin's `adopt`."""
    owner, alice, admin = Ledger(team["owner"]), Ledger(team["alice"]), Ledger(team["admin"])
    alice.set_budget(FP, 10.0, DELTA, label="new", n=1000)
    alice.commit(alice.reserve(FP, "s", _event()))
    owner.set_budget("legacy", 10.0, DELTA, n=200)  # opened by an older dptune: no signatures
    data, copy = _Data("a"), _Data("b")
    adopt_identity(alice, "legacy", data)
    assert budget_match(alice, data, "other").overlapped == ["legacy"]
    adopt_identity(alice, "legacy", copy)  # signatures already there: nothing changes, nothing refused
    with pytest.raises(ConfigError, match="dptune_admin.*adopt --ledger .* --dataset-id .* --space S"):
        adopt_records(alice, "legacy", copy, command="adopt --space S")
    assert budget_match(alice, copy, "other").overlapped == []
    adopt_records(admin, "legacy", copy)
    assert budget_match(alice, copy, "other").overlapped == ["legacy"]
    assert [(r["login"], sorted(r["changes"])) for r in budget_changes(owner) if r["op"] == "update"] == [
        (_who(team["alice"]), ["content", "ids"]), (_who(team["admin"]), ["content", "ids"])]


_SCHEMA_2 = """
CREATE TABLE budgets (fingerprint TEXT PRIMARY KEY, epsilon DOUBLE PRECISION NOT NULL,
    delta DOUBLE PRECISION NOT NULL, label TEXT, created DOUBLE PRECISION NOT NULL, dataset_id TEXT UNIQUE,
    digests BYTEA, records BIGINT, ids BYTEA, content BYTEA);
CREATE TABLE charges (id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    fingerprint TEXT NOT NULL, name TEXT NOT NULL, event TEXT NOT NULL, epsilon DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('reserved', 'committed', 'aborted')), created DOUBLE PRECISION NOT NULL,
    closed DOUBLE PRECISION, token TEXT UNIQUE NOT NULL, event_sha256 TEXT NOT NULL, group_id BIGINT, login TEXT);
CREATE TABLE dptune_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO dptune_meta VALUES ('schema_version', '2');
CREATE FUNCTION dptune_charges_login() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.login := session_user; RETURN NEW; END $$;
CREATE TRIGGER dptune_charges_login BEFORE INSERT ON charges FOR EACH ROW EXECUTE FUNCTION dptune_charges_login();
CREATE FUNCTION dptune_charges_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'UPDATE' OR OLD.status <> 'reserved' OR NEW.status NOT IN ('committed', 'aborted') THEN
        RAISE EXCEPTION 'dptune ledger: append-only' USING ERRCODE = '42501';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER dptune_charges_append_only BEFORE UPDATE OR DELETE ON charges
    FOR EACH ROW EXECUTE FUNCTION dptune_charges_append_only();
REVOKE ALL ON budgets, charges, dptune_meta FROM PUBLIC;
GRANT SELECT, INSERT ON charges, dptune_meta TO dptune_curator;
GRANT UPDATE (status, closed) ON charges TO dptune_curator;
GRANT SELECT, INSERT, UPDATE ON budgets TO dptune_curator;
GRANT USAGE ON SEQUENCE charges_id_seq TO dptune_curator;
"""


def test_a_schema_2_ledger_upgrades_and_its_curators_keep_searching(
        pg: Any, pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    pg.sql("DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dptune_curator') THEN "
           "CREATE ROLE dptune_curator NOLOGIN; END IF; END $$")
    pg.sql(_SCHEMA_2, dbname=pg_url.rsplit("/", 1)[1])  # the tables and grants as the previous release left them
    curator_url = _login(pg, pg_url, "dptune_curator")
    alice = Ledger(curator_url)
    alice.set_budget(FP, 50.0, DELTA, n=1000)
    before = alice.reserve(FP, "before", _event())
    capsys.readouterr()
    assert main(["upgrade", "--ledger", pg_url]) == 0
    assert "schema 2 -> 3" in capsys.readouterr().out
    alice.commit(before)  # a reservation made before the upgrade closes after it
    alice.commit(alice.reserve(FP, "after", _event()))
    alice.set_budget("another", 5.0, DELTA, n=1000)
    with psycopg.connect(curator_url, autocommit=True) as con, pytest.raises(psycopg.errors.InsufficientPrivilege):
        con.execute("UPDATE budgets SET epsilon = 1000")
    with psycopg.connect(curator_url, autocommit=True) as con, pytest.raises(psycopg.Error, match="malformed"):
        con.execute("INSERT INTO charges (fingerprint, name, event, epsilon, status, created, token, event_sha256) "
                    "VALUES (%s, 'x', %s, 0, 'committed', 0, 'tok', 'sha')", (FP, _text(BAD_EVENTS["count -3"])))
    assert [r["status"] for r in history(alice)] == ["committed", "committed"]
    assert alice.spent(FP) == pytest.approx(A.epsilon([_event(), _event()], DELTA), rel=1e-9)
    assert main(["upgrade", "--ledger", pg_url]) == 0 and "already current" in capsys.readouterr().out
