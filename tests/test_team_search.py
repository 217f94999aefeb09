"""The digits main job on a team ledger (PostgreSQL, a real server: tests/pg.py), as two curators run it (issue 42
items 3 and 5): a real search on Ray whose ledger server goes away between the reservation and the commit keeps its
charge reserved and `--resume` closes it; curator B, holding a copy of the team key, trains the release on the same
team ledger (the certificate curator A's search made is accepted); curator C, with another key, is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dptune.ledger import Ledger
from tests.conftest import ROOT, digits_seed_with_k, free_port, isolated_env_for, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.train]  # a real search on Ray, then DP-SGD final training

SPACE = str(ROOT / "search_spaces" / "digits.yaml")


def _curator(tmp_path: Path, name: str) -> dict[str, str]:
    (tmp_path / name).mkdir()
    env = isolated_env_for(tmp_path / name)  # its own HOME: its key at ~/.config/dptune/keys/<host>-<port>-<db>.key
    env.pop("DPTUNE_LEDGER_KEY", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


def _key_file(home: Path) -> Path:
    [key] = (home / ".config" / "dptune" / "keys").glob("*.key")
    return key


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
def test_team_search_survives_a_lost_server_and_another_curator_trains_its_release(pg: Any, pg_url: str,
                                                                                   tmp_path: Path) -> None:
    """Items 3 and 5: (a) the server stops (immediate) while the search's trial runs: the search stops with its
    charge reserved (never "ran uncharged"), and once the server is back `--resume` releases and commits it; (b)
    curator B (another HOME, a copy of the team key) runs dptune.train on the release against the team ledger:
    accepted, charged there; (c) curator C with another key is refused (exit 2) and charges nothing."""
    runs = tmp_path / "runs"
    args = ["-m", "dptune.search", "--space", SPACE, "--name", "team", "--runs-dir", str(runs), "--ledger", pg_url,
            "--budget-epsilon", "100", "--num-cpus", "2", "--dashboard-port", str(free_port()), "--epochs", "4",
            "--seed", str(digits_seed_with_k(1, 1))]
    a = _curator(tmp_path, "a")
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=a, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    state = runs / "team" / "sealed" / "state.json"
    try:
        wait_until(lambda: state.is_file() and json.loads(state.read_text()).get("status") == "running", 240, 0.05)
        pg.stop("immediate")  # the ledger's server goes away between the reservation and the commit
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        pg.start()
    assert proc.returncode == 1, out
    assert "stays reserved" in out and "--resume" in out and f"127.0.0.1:{pg.port}" in out, out
    assert [c.status for c in Ledger(pg_url).charges()] == ["reserved"]  # durable, counted, not released
    assert not (runs / "team" / "release" / "certificate.json").exists()
    r = subprocess.run([sys.executable, *args, "--resume"], cwd=tmp_path, env=a, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    [search] = Ledger(pg_url).charges()
    assert search.status == "committed"

    b = _curator(tmp_path, "b")
    key_b = Path(b["HOME"]) / ".config" / "dptune" / "keys" / _key_file(Path(a["HOME"])).name
    key_b.parent.mkdir(parents=True)
    shutil.copy2(_key_file(Path(a["HOME"])), key_b)  # handed over like a credential
    train = ["-m", "dptune.train", "--release", str(runs / "team" / "release"), "--epochs", "1", "--seed", "0"]
    r = subprocess.run([sys.executable, *train, "--out", str(tmp_path / "final-b")], cwd=tmp_path, env=b,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"charged to the ledger postgresql://postgres@127.0.0.1:{pg.port}/" in r.stdout
    charges = Ledger(pg_url).charges()
    assert [(c.name.split(":")[0], c.status) for c in charges] == [("team", "committed"),
                                                                  ("final_training", "committed")]

    c = _curator(tmp_path, "c")
    key_c = Path(c["HOME"]) / ".config" / "dptune" / "keys" / key_b.name
    key_c.parent.mkdir(parents=True)
    key_c.write_text("ab" * 32)  # another key
    key_c.chmod(0o600)
    r = subprocess.run([sys.executable, *train, "--out", str(tmp_path / "final-c")], cwd=tmp_path, env=c,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 2 and "is not the key of the team ledger" in r.stderr, r.stdout + r.stderr
    assert len(Ledger(pg_url).charges()) == 2  # nothing charged
