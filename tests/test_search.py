"""End-to-end: real local Ray (2 CPUs, loopback), real Opacus trials on digits, sealed vs released."""

from __future__ import annotations

import json
import math
import re
import stat
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dptune import accounting as A
from dptune.config import load_space
from dptune.ledger import Ledger
from tests.conftest import digits_seed_with_k, free_port, run_cli

SPACE = "search_spaces/digits.yaml"


def _seed_with_k(lo: int, hi: int) -> int:
    return digits_seed_with_k(lo, hi)


def _search_args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["-m", "dptune.search", "--space", SPACE, "--name", name, "--runs-dir", str(tmp_path / "runs"),
            "--ledger", str(tmp_path / "ledger.sqlite"), "--budget-epsilon", "30", "--num-cpus", "2",
            "--dashboard-port", str(free_port()), "--smoke-test", *extra]


def _no_k(text: str, k: int) -> None:
    assert not re.search(r"\b(K|k|trials?|num_trials|n_trials)\b\s*[=:]\s*\d", text), text
    assert f"{k} trial" not in text


@pytest.mark.ray
def test_tiny_search_end_to_end(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    seed = _seed_with_k(2, 4)
    r = run_cli(_search_args(tmp_path, "e2e", "--seed", str(seed)), isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "runs" / "e2e"
    draw = json.loads((run / "sealed" / "draw.json").read_text())
    k = draw["k"]
    assert 2 <= k <= 4

    # sealed: owner-only — the directories 0700 and every file in them 0600, Tune's own files included
    # (issue item 23); the Ray auth token 0600 in a 0700 ~/.ray (item 17)
    assert stat.S_IMODE((run / "sealed").stat().st_mode) == 0o700
    for p in (run / "sealed").rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    home = Path(isolated_env["HOME"])
    assert stat.S_IMODE((home / ".ray").stat().st_mode) == 0o700
    assert stat.S_IMODE((home / ".ray" / "auth_token").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ledger.sqlite").stat().st_mode) == 0o600
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    assert sorted(t["index"] for t in trials) == list(range(k))
    # 128-bit trial seeds (item 1), distinct
    assert all(int(t["seed"]) >= 0 for t in trials) and len({t["seed"] for t in trials}) == k

    # ledger: reserved (durably) before the first trial started, committed after
    [charge] = Ledger(tmp_path / "ledger.sqlite").charges()
    assert charge.status == "committed"
    assert charge.created < min(t["started"] for t in trials)

    # what ran = what was charged, measured by the trainer (item 8): the noise actually added (count and
    # std / C), the realised Poisson batch rate and the steps lie within a charged worst-case point
    cert = json.loads((run / "release" / "certificate.json").read_text())
    points = [A.TrialPoint(**p) for p in cert["details"]["worst_case"]]
    for t in trials:
        m = json.loads(t["measured"])
        b = json.loads(t["params"])["batch_size"]
        assert m["noise_additions"] == t["steps"] > 0
        sigma = m["noise_std"] / 1.0  # max_grad_norm C = 1 in the digits space
        q = m["mean_batch_size"] / 1257
        assert abs(q - b / 1257) < 6 * math.sqrt(b / 1257 / (1257 * t["steps"]))  # binomial, 6 s.d.
        assert m["applied_score_noise"] == 9.0
        assert any(p.noise_multiplier <= sigma * 1.05 and p.sampling_rate >= b / 1257 * (1 - 1e-12)
                   and p.steps >= t["steps"] and p.score_noise == m["applied_score_noise"] for p in points), t

    # release: exactly the best trial's config, and a certificate matching the planner
    best = max(trials, key=lambda t: (t["score"] if math.isfinite(t["score"]) else -math.inf, -t["index"]))
    released = yaml.safe_load((run / "release" / "best_config.yaml").read_text())
    for key, value in json.loads(best["params"]).items():
        assert released["config"][key] == pytest.approx(value)
    assert released["score"] == pytest.approx(best["score"])
    assert "seed" not in released["config"]
    assert sorted(p.name for p in (run / "release").iterdir()) == ["best_config.yaml", "certificate.json"]
    # the release cannot date the search's end (item 16): file times = the reservation, a day-only date
    for p in [run / "release", *(run / "release").iterdir()]:
        assert p.stat().st_mtime == pytest.approx(charge.created, abs=1e-3), p
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cert["created"])
    assert cert["guarantee"]["reproducible"] is True and "NOT PRIVATE" in cert["guarantee"]["warning"]
    space = load_space(SPACE)
    space = type(space)(**{**space.__dict__, "fixed": space.fixed.replace(epochs=2)})
    plan = A.plan_search(space, 1257)
    assert cert["epsilon"] == pytest.approx(plan.search_epsilon, rel=1e-9)
    assert cert["delta"] == 1e-5 and cert["stopping"]["rule"] == "poisson"

    # K appears nowhere outside sealed/
    for f in (run / "release").iterdir():
        _no_k(f.read_text(), k)
        assert '"k"' not in f.read_text().lower()
    _no_k(r.stdout, k)
    assert "127.0.0.1" in r.stdout  # dashboard on loopback, URL printed
    assert f"next:   {sys.executable} -m dptune.train --release" in r.stdout  # runs as printed, in any shell
    # the Ray session lived in an owner-only temp dir, removed afterwards, not in world-readable /tmp/ray
    assert not any(Path("/tmp/ray").glob("session_*")) or all(
        p.stat().st_mtime < charge.created for p in Path("/tmp/ray").glob("session_2*"))


@pytest.mark.ray
def test_k_zero_releases_the_default(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    hook = digits_seed_with_k(0, 0)
    env = {**isolated_env, "DPTUNE_TEST_DRAW_SEED": str(hook)}
    args = _search_args(tmp_path, "k0")
    del args[args.index("--name"):args.index("--name") + 2]  # the default name: random, not a start time
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    [run] = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"digits-[0-9a-f]{8}", run.name), run.name
    assert "NOT PRIVATE" in r.stdout + r.stderr  # the test hook is labelled like --seed (item 9)
    released = yaml.safe_load((run / "release" / "best_config.yaml").read_text())
    default = load_space(SPACE).default
    for key in ("learning_rate", "batch_size", "groups", "noise_multiplier"):
        assert released["config"][key] == getattr(default, key)
    cert = json.loads((run / "release" / "certificate.json").read_text())
    assert cert["epsilon"] > 0  # the theorem's charge is paid whatever K is
    assert Ledger(tmp_path / "ledger.sqlite").charges()[0].status == "committed"


def test_over_budget_exits_2_before_ray(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    args = _search_args(tmp_path, "poor")
    args[args.index("--budget-epsilon") + 1] = "0.5"
    r = run_cli(args, isolated_env)
    assert r.returncode == 2
    assert "budget" in r.stderr and "Ray dashboard" not in r.stdout
    assert not (tmp_path / "runs" / "poor").exists()
    assert Ledger(tmp_path / "ledger.sqlite").charges() == []


@pytest.mark.parametrize("extra, field", [
    (["--searcher", "tpe"], "privacy.stopping"),
    (["--accounting", "composed"], "--trials"),
    (["--trials", "0", "--accounting", "composed"], "--trials"),
    (["--cpus-per-trial", "0"], "--cpus-per-trial"),
    (["--budget-delta", "2"], "--budget-delta"),
    (["--resume"], "--resume"),
])
def test_bad_search_input_exits_2(tmp_path: Path, isolated_env: dict[str, str], extra: list[str], field: str) -> None:
    r = run_cli(_search_args(tmp_path, "bad", *extra), isolated_env)
    assert r.returncode == 2, r.stderr
    assert field in r.stderr
    assert not (tmp_path / "ledger.sqlite").exists() or Ledger(tmp_path / "ledger.sqlite").charges() == []


def test_world_readable_ray_token_is_refused_before_any_charge(tmp_path: Path,
                                                               isolated_env: dict[str, str]) -> None:
    """Issue item 17: whoever reads the token drives the dashboard's job API as the curator."""
    token = Path(isolated_env["HOME"]) / ".ray" / "auth_token"
    token.parent.mkdir(mode=0o700)
    token.write_text("0" * 64)
    token.chmod(0o644)
    r = run_cli(_search_args(tmp_path, "tok"), isolated_env)
    assert r.returncode == 2 and "chmod 600" in r.stderr and str(token) in r.stderr, r.stderr
    assert not (tmp_path / "ledger.sqlite").exists() or Ledger(tmp_path / "ledger.sqlite").charges() == []


def test_bad_yaml_exits_2(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text(Path(SPACE).read_text() + "\nunknown_key: 1\n")
    args = _search_args(tmp_path, "bad")
    args[args.index("--space") + 1] = str(bad)
    r = run_cli(args, isolated_env)
    assert r.returncode == 2 and "unknown_key" in r.stderr


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
@pytest.mark.ray
def test_tpe_runs_under_composed_accounting(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    # --checkpoint-every: mid-trial reports carry no score; TPE must still run (issue item 21)
    r = run_cli(_search_args(tmp_path, "tpe", "--searcher", "tpe", "--accounting", "composed", "--trials", "2",
                             "--seed", "1", "--checkpoint-every", "1"), isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "runs" / "tpe"
    cert = json.loads((run / "release" / "certificate.json").read_text())
    assert cert["stopping"] == {"rule": "composed", "mean": 2.0}
    assert cert["details"]["searcher"] == "tpe" and cert["details"]["accounting"] == "composed"
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    assert len(trials) == 2 and all(t["steps"] > 0 and not t["crashed"] for t in trials)
    assert len({t["seed"] for t in trials}) == 2 and all(int(t["seed"]) > 2**64 for t in trials)  # 128-bit
    worst = A.worst_case_event([A.TrialPoint(**p) for p in cert["details"]["worst_case"]])
    assert cert["epsilon"] == pytest.approx(A.epsilon([A.stopping_rule("composed", mean=2).search_event(worst)], 1e-5))


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
@pytest.mark.ray
def test_subsample_tuning(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """search.tune_fraction f: trials at q = B/(f·n) on a Poisson subsample, the charge amplified, the
    released batch size transferred to the full data (B/f)."""
    raw = yaml.safe_load(Path(SPACE).read_text())
    raw["search"]["tune_fraction"] = 0.5
    f = tmp_path / "sub.yaml"
    f.write_text(yaml.safe_dump(raw))
    args = _search_args(tmp_path, "sub", "--seed", str(_seed_with_k(1, 2)))
    args[args.index("--space") + 1] = str(f)
    r = run_cli(args, isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "runs" / "sub"
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    for t in trials:
        b = json.loads(t["params"])["batch_size"]
        assert t["sampling_rate"] == pytest.approx(b / (0.5 * 1257))
        assert t["steps"] == math.ceil(2 * 0.5 * 1257 / b - 1e-9)
    best = max(trials, key=lambda t: (t["score"] if math.isfinite(t["score"]) else -math.inf, -t["index"]))
    released = yaml.safe_load((run / "release" / "best_config.yaml").read_text())
    assert released["config"]["batch_size"] == 2 * json.loads(best["params"])["batch_size"]
    assert "sampling_basis" not in released["config"] and released["tuned_on_fraction"] == 0.5
    cert = json.loads((run / "release" / "certificate.json").read_text())
    space = load_space(f)
    # the search on the subsample, unamplified: trials at q = B/(f·n), then amplified by hand
    space = type(space)(**{**space.__dict__, "fixed": space.fixed.replace(epochs=2), "tune_fraction": 1.0})
    inner = A.plan_search(space, 0.5 * 1257).search_event  # type: ignore[arg-type]
    assert cert["epsilon"] == pytest.approx(A.epsilon([A.subsampled_search_event(inner, fraction=0.5)], 1e-5), rel=1e-9)
    assert cert["details"]["tune_fraction"] == 0.5
    # the curator report reads a subsample run's certificate (issue 11 item 2: it used to fail on every one)
    rep = run_cli(["-m", "dptune.report", str(run)], isolated_env)
    assert rep.returncode == 0, rep.stderr
    assert "poisson" in (run / "sealed" / "report.html").read_text()


@pytest.mark.integration  # a whole search end to end (make test-slow; CI runs it)
@pytest.mark.ray
def test_storage_path_uri_end_to_end(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Tune's checkpoints on --storage-path (a file:// URI, as s3:// would be): the release still gets the
    best trial's model, the sealed record stays with the driver, the storage is owner-only."""
    store = tmp_path / "shared"
    r = run_cli(_search_args(tmp_path, "st", "--seed", str(_seed_with_k(1, 2)), "--save-checkpoint",
                             "--checkpoint-every", "1", "--storage-path", f"file://{store}"), isolated_env)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "runs" / "st"
    assert (run / "release" / "best_checkpoint.pt").is_file()
    assert (run / "sealed" / "trials.parquet").is_file() and (store / "tune").is_dir()
    assert not any((run / "sealed" / "ray").iterdir())  # Tune wrote to the storage path, not sealed/ray
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
