"""What a search leaves where other local users or other hosts could reach it (issue 22, items 11-15): trial
work dirs, Ray's temp dir, token authentication, usage statistics, listening sockets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import digits_seed_with_k, free_port, run_cli

SPACE = "search_spaces/digits.yaml"


def _search_args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["-m", "dptune.search", "--space", SPACE, "--name", name, "--runs-dir", str(tmp_path / "runs"),
            "--ledger", str(tmp_path / "ledger.sqlite"), "--budget-epsilon", "30", "--num-cpus", "2",
            "--dashboard-port", str(free_port()), "--smoke-test", *extra]


@pytest.mark.ray
def test_trial_work_dirs_with_their_secrets_are_not_left_in_tmp(tmp_path: Path,
                                                               isolated_env: dict[str, str]) -> None:
    """Item 13: a trial's work dir (seed, RNG states) lives under Ray's trial dir, inside the search's
    owner-only Ray temp dir, and is removed in a finally, --save-checkpoint included; never in $TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**isolated_env, "TMPDIR": str(tmp)}
    r = run_cli(_search_args(tmp_path, "work", "--seed", str(digits_seed_with_k(1, 2)), "--save-checkpoint",
                             "--checkpoint-every", "1"), env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "runs" / "work" / "release" / "best_checkpoint.pt").is_file()
    left = [p for p in tmp.rglob("*") if p.name.startswith("dptune-trial-") or p.name == "trial.pt"]
    assert left == [], left
