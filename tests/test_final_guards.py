"""Final training guards on real releases (issue 22): the certificate binds the released config, a
diverging final training records its charge and says so, no local path in a shared file. The searches
here draw K = 0 (a NOT PRIVATE test seed): they release the space's default config without starting Ray."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from dptune.certificate import load_certificate, verify_binding
from dptune.cli.train import main as train_main
from dptune.config import parse_space
from dptune.ledger import Ledger
from tests.conftest import ROOT, digits_seed_with_k

DIGITS = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())


def _space(name: str, sigma: float, learning_rate: float = 0.6, epochs: float = 1.0) -> dict[str, Any]:
    raw = json.loads(json.dumps(DIGITS))
    raw["name"] = name
    raw["fixed"]["epochs"] = epochs
    raw["space"]["noise_multiplier"] = {"type": "float", "low": sigma, "high": sigma + 1}
    raw["space"]["learning_rate"] = {"type": "float", "low": learning_rate, "high": 2 * learning_rate, "log": True}
    raw["default"].update(noise_multiplier=sigma, learning_rate=learning_rate)
    return raw


def _search(root: Path, name: str, raw: dict[str, Any]) -> Path:
    from dptune.tuning.driver import SearchRequest, run_search

    req = SearchRequest(space=parse_space(raw), run_dir=root / name, ledger=root / "ledger.sqlite",
                        budget_epsilon=1000, seed=digits_seed_with_k(0, 0))
    run_search(req, say=lambda line: None)
    return root / name / "release"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("guards")
    return {"cheap": _search(root, "cheap", _space("cheap", 6.0)),
            "expensive": _search(root, "expensive", _space("expensive", 1.5)),
            "diverging": _search(root, "diverging", _space("diverging", 6.0, learning_rate=1e36)),
            "ledger": root / "ledger.sqlite"}


def _train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = train_main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_another_searchs_best_config_in_a_cheap_release_is_refused(runs: dict[str, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 1: the expensive search's best_config.yaml copied into the cheap search's release (the
    cheap certificate's ε would be claimed for the expensive config) — refused, exit 2, nothing charged."""
    cheap, expensive = runs["cheap"], runs["expensive"]
    assert load_certificate(expensive / "certificate.json").epsilon > load_certificate(cheap / "certificate.json").epsilon
    forged = tmp_path / "cheap"
    shutil.copytree(cheap.parent, forged)
    shutil.copyfile(expensive / "best_config.yaml", forged / "release" / "best_config.yaml")
    before = Ledger(runs["ledger"]).charges()
    rc, _, err = _train(capsys, "--release", str(forged / "release"), "--out", str(tmp_path / "o"), "--seed", "1")
    assert rc == 2 and "best_config.yaml: is not the file this certificate was released with" in err, err
    assert Ledger(runs["ledger"]).charges() == before and not (tmp_path / "o" / "model.pt").exists()


def test_a_certificate_whose_reproducible_flag_differs_from_the_sealed_draw_is_refused(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 1: final training reads ``reproducible`` from the sealed draw itself."""
    copy = tmp_path / "cheap"
    shutil.copytree(runs["cheap"].parent, copy)
    draw = json.loads((copy / "sealed" / "draw.json").read_text())
    assert draw["reproducible"] is True  # a --seed search
    (copy / "sealed" / "draw.json").write_text(json.dumps({**draw, "reproducible": False}))
    before = Ledger(runs["ledger"]).charges()
    rc, _, err = _train(capsys, "--release", str(copy / "release"), "--out", str(tmp_path / "o"), "--seed", "1")
    assert rc == 2 and "certificate.guarantee.reproducible" in err, err
    assert Ledger(runs["ledger"]).charges() == before


def test_a_diverging_final_training_records_its_charge_and_says_so(runs: dict[str, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 26: a final training that diverges (lr 1e36) commits its charge, writes a certificate and
    a metrics.json saying it diverged (no model), and exits 1 with a clear message — no AssertionError."""
    ledger = Ledger(runs["ledger"])
    before = len(ledger.charges())
    out = tmp_path / "o"
    rc, _, err = _train(capsys, "--release", str(runs["diverging"]), "--out", str(out), "--seed", "1")
    assert rc == 1 and "final training diverged" in err and "charge is spent and recorded" in err, err
    charges = ledger.charges()
    assert len(charges) == before + 1 and charges[-1].name.startswith("final_training")
    assert charges[-1].status == "committed"
    assert sorted(p.name for p in out.iterdir()) == ["certificate.json", "metrics.json"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["diverged"] is True and metrics["test_accuracy"] is None
    cert = load_certificate(out / "certificate.json")
    bound = verify_binding(cert, ledger, folder=out)  # metrics.json is bound; no model beside it
    assert [c.token for c in bound] == cert.tokens() and bound[-1].token == charges[-1].token


@pytest.mark.slow  # CI runs it (make test-slow): the default suite stays well under 15 min
def test_use_best_checkpoint_exports_a_scaled_searcher_release(tmp_path: Path) -> None:
    """Issue 22 item 26: the scaled searcher releases the final run's settings (σ_f, lr·σ rule) while its best
    checkpoint ran at the cheap σ_c with lr = L·σ_f/σ_c; the export checks the checkpoint against that and
    labels the exported model with the config it was trained with. (Real Ray search, 2 candidates.)"""
    import os

    import torch

    from tests.conftest import free_port, run_cli

    raw = yaml.safe_load((ROOT / "search_spaces" / "digits_scaled.yaml").read_text())
    raw["space"]["learning_rate"]["choices"] = [0.3, 0.6]
    raw["privacy"]["mean"] = 2
    (tmp_path / "scaled.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "DPTUNE_TEST_DRAW_SEED"}
    env.update(HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
               RAY_ADDRESS="local")
    r = run_cli(["-m", "dptune.search", "--space", str(tmp_path / "scaled.yaml"), "--name", "s", "--runs-dir",
                 str(tmp_path / "runs"), "--ledger", str(tmp_path / "l.sqlite"), "--budget-epsilon", "30",
                 "--num-cpus", "2", "--dashboard-port", str(free_port()), "--smoke-test", "--save-checkpoint",
                 "--seed", "3"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    release = tmp_path / "runs" / "s" / "release"
    r = run_cli(["-m", "dptune.train", "--release", str(release), "--out", str(tmp_path / "o"),
                 "--use-best-checkpoint"], env)
    assert r.returncode == 0 and "no new charge" in r.stdout, r.stdout + r.stderr
    cert = load_certificate(release / "certificate.json")
    released = yaml.safe_load((release / "best_config.yaml").read_text())
    (point,) = cert.details["transfer"]["points"]  # the one (B, E) of this space: its trials' σ_c
    trial_sigma = point["trial_noise_multiplier"]
    model = torch.load(tmp_path / "o" / "model.pt", weights_only=True)
    assert model["config"]["noise_multiplier"] == trial_sigma != released["config"]["noise_multiplier"]
    assert model["config"]["learning_rate"] == pytest.approx(released["scaling_rule"]["lr_times_sigma"] / trial_sigma)


def test_shared_files_carry_no_local_absolute_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 24: best_config.yaml (its first comment, dataset.path) and the final model.pt name no
    folder of the curator's machine; final training still finds the data (the sealed record's path)."""
    import torch

    from dptune.data.examples import main as examples_main

    folder = tmp_path / "curator-private-folder"
    folder.mkdir()
    assert examples_main(["breast-cancer", str(folder / "bc.parquet")]) == 0
    raw = yaml.safe_load((ROOT / "search_spaces" / "breast_cancer.yaml").read_text())
    raw["dataset"]["path"] = str(folder / "bc.parquet")
    raw["fixed"]["epochs"] = 1
    release = _search(tmp_path, "bc", raw)
    text = (release / "best_config.yaml").read_text()
    assert str(tmp_path) not in text and "curator-private-folder" not in text, text
    assert yaml.safe_load(text)["dataset"]["path"] == "bc.parquet"
    rc, _, err = _train(capsys, "--release", str(release), "--out", str(tmp_path / "o"), "--seed", "1")
    assert rc == 0, err
    model = torch.load(tmp_path / "o" / "model.pt", weights_only=True)
    assert model["dataset"]["path"] == "bc.parquet"
    for name in ("model.pt", "metrics.json", "certificate.json"):
        data = (tmp_path / "o" / name).read_bytes()
        assert str(tmp_path).encode() not in data and b"curator-private-folder" not in data, name


def test_a_release_publishes_the_sizes_its_guarantee_is_conditional_on(runs: dict[str, Path]) -> None:
    """Issue 22 item 10: the sizes the guarantee is conditional on are in the release (n_train in the
    certificate, the held-out sizes in best_config.yaml)."""
    cert = load_certificate(runs["cheap"] / "certificate.json")
    doc = yaml.safe_load((runs["cheap"] / "best_config.yaml").read_text())
    assert cert.details["n_train"] == 1797 - 360 - 180
    assert (doc["dataset"]["validation_size"], doc["dataset"]["test_size"]) == (180, 360)
    assert "conditional_on" in cert.guarantee


def test_a_release_names_what_trained_and_which_engines(runs: dict[str, Path]) -> None:
    """Issue 59: the certificate says the trials ran captured programs and when per-layer engines may run."""
    training = load_certificate(runs["cheap"] / "certificate.json").details["training"]
    assert "torch.fx" in training["program"] and "functorch" in training["engines"]
    assert isinstance(training["notes"], list)


def test_release_tar_carries_the_reservation_time_and_no_other(runs: dict[str, Path]) -> None:
    """Issue 22 item 9: a file's ctime is the moment it was written (the search's end) and cannot be set;
    release.tar (what to ship) holds one time per entry, the reservation's, no atime/ctime (ustar: no pax
    headers), no owner names."""
    import tarfile

    release = runs["cheap"]
    [charge] = [c for c in Ledger(runs["ledger"]).charges() if c.name == "cheap"]
    with tarfile.open(release.parent / "release.tar") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["release", "release/best_config.yaml", "release/certificate.json"]
        for m in members:
            assert m.mtime == int(charge.created) and not m.pax_headers, m.name
            assert (m.uid, m.gid, m.uname, m.gname) == (0, 0, "", "")
            if m.isfile():
                f = tar.extractfile(m)
                assert f is not None and f.read() == (release.parent / m.name).read_bytes()
    raw = (release.parent / "release.tar").read_bytes()
    assert b"ctime" not in raw and b"atime" not in raw and b"PaxHeader" not in raw
    assert (release.parent / "release.tar").stat().st_mtime == pytest.approx(charge.created, abs=1e-3)


def test_search_progress_prints_no_elapsed_time_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 9: the heartbeat's "15 s elapsed" reached shared notebooks (through the API too): by
    default one line and no time; the elapsed-time heartbeat only with --show-trials (curator only)."""
    import time

    from dptune.tuning.runner import progress

    with progress(False, every=0.02):
        time.sleep(0.2)
    quiet = capsys.readouterr().out
    assert quiet.count("\n") == 1 and "elapsed time is shown" in quiet and not any(c.isdigit() for c in quiet)
    with progress(True, every=0.02):
        time.sleep(0.2)
    assert "s elapsed" in capsys.readouterr().out
