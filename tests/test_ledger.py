"""The ledger: durable reservations, RDP totals, refusals that store nothing, concurrent writers. The core tests run on
both backends (``ledger_at``: a SQLite file, and a fresh database on a real PostgreSQL server, tests/pg.py)."""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from dp_accounting import dp_event as de

from dptune import accounting as A
from dptune.ledger import BudgetExceeded, Ledger

FP = "f" * 64
DELTA = 1e-5


def search_event(sigma: float = 1.2) -> de.DpEvent:
    return de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=sigma, sampling_rate=0.1, steps=150, score_noise=6.0), 3.0, math.inf)


def test_reserve_commit_and_totals_compose(ledger_at: str) -> None:
    led = Ledger(ledger_at)
    led.set_budget(FP, 50.0, DELTA)
    a = led.reserve(FP, "s1", search_event())
    b = led.reserve(FP, "s2", search_event(2.0))
    led.commit(a)
    assert [c.status for c in led.charges(FP)] == ["committed", "reserved"]  # unclosed still listed
    composed = A.epsilon([de.ComposedDpEvent([search_event(), search_event(2.0)])], DELTA)
    assert led.spent(FP) == pytest.approx(composed, rel=1e-9)
    summed = A.epsilon([search_event()], DELTA) + A.epsilon([search_event(2.0)], DELTA)
    assert led.spent(FP) < summed  # composition in RDP, not addition of ε
    led.abort(b)
    assert led.spent(FP) == pytest.approx(A.epsilon([search_event()], DELTA), rel=1e-9)
    led.commit(a)  # idempotent
    with pytest.raises(ValueError):
        led.commit(b)


def test_over_budget_is_refused_and_stores_nothing(ledger_at: str) -> None:
    led = Ledger(ledger_at)
    led.set_budget(FP, 10.0, DELTA)
    led.reserve(FP, "ok", search_event(2.0))
    before = led.charges(FP)
    with pytest.raises(BudgetExceeded) as e:
        led.reserve(FP, "too much", search_event(0.6))
    assert "budget" in str(e.value)
    assert led.charges(FP) == before


def test_no_budget_is_refused(ledger_at: str) -> None:
    led = Ledger(ledger_at)
    with pytest.raises(Exception, match="no privacy budget"):
        led.reserve(FP, "x", search_event())
    assert led.charges() == []


def test_reservation_survives_sigkill(ledger_at: str) -> None:
    path = ledger_at
    Ledger(path).set_budget(FP, 50.0, DELTA)
    code = textwrap.dedent(f"""
        import math, os, signal, sys
        from dp_accounting import dp_event as de
        from dptune import accounting as A
        from dptune.ledger import Ledger
        led = Ledger({str(path)!r})
        led.reserve({FP!r}, "killed", de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=1.2, sampling_rate=0.1, steps=150, score_noise=6.0), 3.0, math.inf))
        print("reserved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert "reserved" in proc.stdout
    led = Ledger(path)
    [charge] = led.charges(FP)
    assert charge.status == "reserved" and charge.name == "killed"
    assert led.spent(FP) == pytest.approx(A.epsilon([search_event()], DELTA), rel=1e-9)


def _reserve_many(path: str, worker: int, n: int, out: mp.Queue) -> None:
    led = Ledger(path)
    ok = refused = 0
    for i in range(n):
        try:
            led.reserve(FP, f"w{worker}-{i}", search_event(1.5))
            ok += 1
        except BudgetExceeded:
            refused += 1
    out.put((ok, refused))


def test_concurrent_writers_lose_nothing_and_never_overspend(ledger_at: str) -> None:
    path = ledger_at
    led = Ledger(path)
    one = A.epsilon([search_event(1.5)], DELTA)
    led.set_budget(FP, 4.5 * one, DELTA)  # fits some but not all of the 2 x 8 attempts
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_reserve_many, args=(str(path), w, 8, q)) for w in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    ok = sum(r[0] for r in results)
    assert ok == len(led.charges(FP))  # no lost entry
    assert sum(r[0] + r[1] for r in results) == 16
    assert 4 <= ok < 16
    assert led.spent(FP) <= 4.5 * one  # no overspend
    assert len({c.name for c in led.charges(FP)}) == ok


def test_ledger_cli(ledger_at: str, tmp_path: Path) -> None:
    path = ledger_at
    Ledger(path).set_budget(FP, 4.0, 1e-5, label="digits")
    dataset_id = Ledger(path).dataset_id(FP)
    env = {**os.environ}
    run = [sys.executable, "-m", "dptune.cli.ledger"]
    r = subprocess.run(run + ["set-budget", "--ledger", str(path), "--dataset-id", dataset_id, "--epsilon", "8",
                              "--delta", "1e-5"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(run + ["show", "--ledger", str(path), "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and '"budget_epsilon": 8.0' in r.stdout
    r = subprocess.run(run + ["set-budget", "--ledger", str(path), "--dataset-id", dataset_id, "--epsilon", "-1",
                              "--delta", "1e-5"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--epsilon" in r.stderr
    r = subprocess.run(run + ["show", "--ledger", str(tmp_path / "missing.sqlite")], capture_output=True, text=True)
    assert r.returncode == 2 and "--ledger" in r.stderr


def test_set_budget_of_an_id_that_names_no_budget_is_refused(ledger_at: str) -> None:
    """Issue 22 item 23: `set-budget` with the id `ledger show` prints changes that budget; an id that names
    no budget is refused (exit 2) instead of opening a phantom budget beside the real one."""
    path = ledger_at
    led = Ledger(path)
    led.set_budget(FP, 4.0, 1e-5, label="digits")
    dataset_id = led.dataset_id(FP)
    run = [sys.executable, "-m", "dptune.cli.ledger", "set-budget", "--ledger", str(path)]
    r = subprocess.run(run + ["--fingerprint", dataset_id, "--epsilon", "6", "--delta", "1e-5"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert led.budget(FP) == (6.0, 1e-5) and len(led.fingerprints()) == 1
    for unknown in (dataset_id[:12], "0" * 32, "digits"):
        r = subprocess.run(run + ["--dataset-id", unknown, "--epsilon", "9", "--delta", "1e-5"],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "--dataset-id" in r.stderr and "new-budget" in r.stderr, r.stderr
    assert led.budget(FP) == (6.0, 1e-5) and len(led.fingerprints()) == 1  # nothing opened, nothing changed


def test_budget_delta_at_or_above_one_over_n_is_refused(ledger_at: str) -> None:
    """Issue 22 item 4: a budget's δ obeys the per-search rule δ < 1/n (and 0 < δ < 1): `--budget-delta 0.5`
    is refused, and a budget stored with such a δ refuses every charge; under a proper δ three searches that
    compose (RDP) above the budget are refused at the first one that would exceed it."""
    from dptune.errors import ConfigError

    led = Ledger(ledger_at)
    for bad in (0.5, 1e-3, 1.0, 0.0, -1e-5):
        with pytest.raises(ConfigError, match="--delta"):
            led.set_budget(FP, 3.0, bad, n=1797)
    assert led.fingerprints() == []
    led.set_budget(FP, 3.0, 0.5)  # an old ledger's budget, n unknown when it was set
    with pytest.raises(BudgetExceeded, match="1/n") as e:
        led.reserve(FP, "s1", search_event(), n=1000)
    assert e.value.field == "budget.delta" and led.charges() == []
    led.set_budget(FP, 3.0, 1e-5, n=1797)
    one = A.epsilon([search_event(5.0)], 1e-5)
    assert 2 * one > 3.0  # adding ε would refuse the second search; RDP composition fits two, not three
    led.reserve(FP, "s1", search_event(5.0), n=1000)
    led.reserve(FP, "s2", search_event(5.0), n=1000)
    with pytest.raises(BudgetExceeded, match="over its budget"):
        led.reserve(FP, "s3", search_event(5.0), n=1000)
    assert [c.name for c in led.charges()] == ["s1", "s2"]
    assert led.spent(FP) == pytest.approx(A.epsilon([search_event(5.0)] * 2, 1e-5), rel=1e-9)
    assert led.spent(FP) < 3.0 < A.epsilon([search_event(5.0)] * 3, 1e-5)


def test_ledger_show_and_errors_never_print_the_fingerprint(ledger_at: str) -> None:
    """Issue 22 item 6: the data's fingerprint stays inside the ledger: `show` (text and --json) and the
    over-budget error name the random dataset id and a label, never the fingerprint or any piece of it."""
    fp = hashlib.sha256(b"the data").hexdigest()
    path = ledger_at
    led = Ledger(path)
    led.set_budget(fp, 5.0, DELTA, label="digits")
    led.reserve(fp, "s1", search_event(2.0))
    pieces = {fp[i:i + 8] for i in range(0, 64, 4)}
    outputs = []
    for extra in ([], ["--json"]):
        r = subprocess.run([sys.executable, "-m", "dptune.cli.ledger", "show", "--ledger", str(path), *extra],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert led.dataset_id(fp) in r.stdout and "digits" in r.stdout
        outputs.append(r.stdout)
    with pytest.raises(BudgetExceeded) as e:
        led.reserve(fp, "s2", search_event(0.6))
    assert led.dataset_id(fp) in str(e.value)
    outputs.append(str(e.value))
    for text in outputs:
        assert not any(p in text for p in pieces), text


def test_ledger_files_are_owner_only_and_ids_are_random(tmp_path: Path) -> None:
    """Issue items 4 and 23: the ledger and its key are 0600; the public dataset id is random (not a hash of
    the data), and two budgets on the same data in two ledgers get different ids."""
    import stat

    ids = []
    for name in ("a", "b"):
        led = Ledger(tmp_path / name / "l.sqlite")
        led.set_budget(FP, 50.0, DELTA)
        led.reserve(FP, "x", search_event())
        for f in (led.path, led.key_path, *led.path.parent.glob("l.sqlite-*")):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        ids.append(led.dataset_id(FP))
    assert ids[0] != ids[1] and FP not in ids and all(len(i) == 32 for i in ids)


@dataclass
class _Records:
    """A dataset as the ledger sees it (what ``dptune.data.Splits`` provides), written out by the test."""

    record_ids: tuple[str, ...] | None
    signatures: list[tuple[bytes, ...]]
    digests: list[bytes]

    def content_signatures(self) -> list[tuple[bytes, ...]]:
        return self.signatures

    def example_digests(self) -> list[bytes]:
        return self.digests


def _sig(tag: str, i: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{tag}/{i}/{k}".encode()).digest()[:16] for k in range(8))


def test_legacy_budgets_match_as_before_and_new_ones_namespace_ids_by_content(tmp_path: Path) -> None:
    """A budget opened before record ids (exact digests only) still takes data sharing >= 90 % of its examples, and
    one opened before content signatures still takes data by ids; a budget with content signatures takes data by
    content (share >= SAME_DATASET_SHARE of the smaller, whatever the ids) and compares ids only within it: the same
    ids on other content are other records (issue 40 item 6)."""
    from dptune.ledger._budgets import SAME_DATASET_SHARE, match, open_budget, record_id_digests

    digests = sorted(hashlib.sha256(str(i).encode()).digest() for i in range(1000))
    near = digests[:950] + [hashlib.sha256(b"new").digest()]  # 95 % shared
    far = digests[:500] + [hashlib.sha256(str(-i).encode()).digest() for i in range(1, 600)]
    sigs = [_sig("a", i) for i in range(1000)]
    led = Ledger(tmp_path / "l.sqlite")
    led.set_budget(FP, 5.0, DELTA, digests=digests)  # legacy: no ids, no content
    assert match(led, _Records(None, sigs, digests), FP).overlapped == [FP]
    assert match(led, _Records(None, sigs[:951], near), "e" * 64).legacy == [FP]
    assert match(led, _Records(None, sigs, far), "d" * 64).overlapped == []  # 500/1000 shared: another dataset
    led2 = Ledger(tmp_path / "l2.sqlite")
    ids = tuple(f"r/{i}" for i in range(1000))
    led2.set_budget(FP, 5.0, DELTA, digests=digests, ids=record_id_digests(led2, ids))  # legacy: ids, no content
    m = match(led2, _Records(ids[:10], [_sig("z", i) for i in range(10)], far[:10]), "e" * 64)
    assert (m.overlapped, m.covered, m.legacy) == ([FP], True, [FP])  # ten shared records: charged, covered
    led3 = Ledger(tmp_path / "l3.sqlite")
    key = open_budget(led3, _Records(ids, sigs, digests), 5.0, DELTA, "a")
    rekeyed = _Records(tuple(f"s/{i}" for i in range(1000)), sigs, digests)
    m = match(led3, rekeyed, "e" * 64)
    assert (m.overlapped, m.covered, m.by_content) == ([key], True, [key])
    other = _Records(ids, [_sig("b", i) for i in range(1000)], far)  # the same ids, other content
    assert match(led3, other, "f" * 64).overlapped == []
    k = int(SAME_DATASET_SHARE * 400)  # a 400-record subset: a share of the smaller set
    part = _Records(tuple(f"t/{i}" for i in range(400)), sigs[:k] + [_sig("c", i) for i in range(400 - k)], far)
    assert match(led3, part, "0" * 64).overlapped == [key] and not match(led3, part, "0" * 64).covered
    part.signatures[0] = _sig("c", -1)  # one record short of the share
    assert match(led3, part, "0" * 64).overlapped == []


def _open_new_ledgers(paths: list[str], barrier: object, out: mp.Queue) -> None:
    results = []
    for path in paths:
        barrier.wait()  # type: ignore[attr-defined]  # every process opens the same new file at once
        try:
            Ledger(path)
            results.append("ok")
        except Exception as e:  # noqa: BLE001 — the test reports what each process saw
            results.append(f"{type(e).__name__}: {e}")
    out.put(results)


def test_new_ledger_opened_by_concurrent_processes_sets_up_once(tmp_path: Path) -> None:
    """Issue 22 item 21: four real processes creating the same new ledger at the same instant all succeed (no
    `duplicate column name`, no `database is locked`, no half-written key), round after round."""
    ctx = mp.get_context("spawn")
    paths = [str(tmp_path / f"l{r}.sqlite") for r in range(6)]
    barrier = ctx.Barrier(4)
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_open_new_ledgers, args=(paths, barrier, q)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    failures = [r for rs in results for r in rs if r != "ok"]
    assert failures == []
    for path in paths:
        led = Ledger(path)
        assert len(bytes.fromhex(led.key_path.read_text())) == 32
        assert list(led.path.parent.glob(led.key_path.name + ".*")) == []  # no temporary key left behind


def test_missing_key_of_a_ledger_with_charges_is_refused(tmp_path: Path) -> None:
    """Issue 22 item 23: a ledger whose charges were authenticated by a key that is now missing is refused
    (a fresh key would silently orphan every certificate); a ledger without charges gets a key."""
    from dptune.errors import ConfigError

    led = Ledger(tmp_path / "l.sqlite")
    led.set_budget(FP, 50.0, DELTA)
    led.key_path.unlink()
    Ledger(led.path)  # budgets but no charge yet: nothing was authenticated, a new key is fine
    led.reserve(FP, "x", search_event())
    led.key_path.unlink()
    with pytest.raises(ConfigError, match="key") as e:
        Ledger(led.path)
    assert e.value.field == "--ledger" and "restore" in str(e.value)
    assert not led.key_path.exists()
    r = subprocess.run([sys.executable, "-m", "dptune.cli.ledger", "show", "--ledger", str(led.path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "key" in r.stderr and not led.key_path.exists()


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
def test_default_ledger_is_one_absolute_per_user_file_printed_on_every_charge(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 item 3: without --ledger, searches started from two working directories charge one per-user
    ledger (under ~/.local/share/dptune, or an absolute $XDG_DATA_HOME), which the second finds with its
    budget; the path is printed on every charge; a relative --ledger is resolved; the API has that default."""
    import inspect

    from dptune import api
    from dptune.ledger import default_ledger_path
    from tests.conftest import ROOT, digits_seed_with_k, isolated_env_for

    env = isolated_env_for(tmp_path)
    env.pop("XDG_DATA_HOME", None)
    env["DPTUNE_TEST_DRAW_SEED"] = str(digits_seed_with_k(0, 0))  # K = 0: the whole CLI path, no Ray
    env["PYTHONPATH"] = str(ROOT)
    home_ledger = tmp_path / "home" / ".local" / "share" / "dptune" / "ledger.sqlite"
    space = str(ROOT / "search_spaces" / "digits.yaml")
    outs = []
    for i, cwd in enumerate((tmp_path / "a", tmp_path / "b" / "c")):
        cwd.mkdir(parents=True)
        budget = ["--budget-epsilon", "20"] if i == 0 else []  # the second search must find the first's budget
        r = subprocess.run([sys.executable, "-m", "dptune.search", "--space", space, "--name", f"s{i}", *budget],
                           capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(r.stdout)
    assert all(f"ledger: {home_ledger}" in o for o in outs)
    led = Ledger(home_ledger)
    assert len(led.charges()) == 2 and len({c.fingerprint for c in led.charges()}) == 1
    assert not list(tmp_path.glob("*/ledger.sqlite")) and not list(tmp_path.glob("*/runs/ledger.sqlite"))
    xdg = tmp_path / "xdg"
    r = subprocess.run([sys.executable, "-m", "dptune.search", "--space", space, "--name", "s2", "--ledger",
                        "rel/l.sqlite", "--budget-epsilon", "20"], capture_output=True, text=True,
                       env={**env, "XDG_DATA_HOME": str(xdg)}, cwd=tmp_path / "a", timeout=300)
    assert r.returncode == 0 and f"ledger: {tmp_path / 'a' / 'rel' / 'l.sqlite'}" in r.stdout, r.stdout + r.stderr
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_ledger_path() == home_ledger
    monkeypatch.setenv("XDG_DATA_HOME", str(xdg))
    assert default_ledger_path() == xdg / "dptune" / "ledger.sqlite"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # not absolute: ignored, as the XDG spec says
    assert default_ledger_path() == home_ledger
    assert inspect.signature(api.search).parameters["ledger"].default is None  # None = default_ledger_path()


def test_reservation_on_several_budgets_is_all_or_none_and_closes_together(ledger_at: str) -> None:
    """Issue 22 item 2: data overlapping two budgets is charged to both in one transaction: refused on one,
    stored on neither; the first charge is the one returned, and closing it closes the other."""
    a, b = "a" * 64, "b" * 64
    led = Ledger(ledger_at)
    led.set_budget(a, 50.0, DELTA)
    led.set_budget(b, 1.0, DELTA)
    with pytest.raises(BudgetExceeded, match="over its budget"):
        led.reserve([a, b], "both", search_event(2.0))
    assert led.charges() == []
    led.set_budget(b, 50.0, DELTA)
    first = led.reserve([a, b], "both", search_event(2.0))
    assert led.charge(first).fingerprint == a
    assert [(c.fingerprint, c.status) for c in led.charges()] == [(a, "reserved"), (b, "reserved")]
    assert led.spent(a) == led.spent(b) == pytest.approx(A.epsilon([search_event(2.0)], DELTA), rel=1e-9)
    led.commit(first)
    assert [c.status for c in led.charges()] == ["committed", "committed"]
