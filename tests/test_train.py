"""Final training from a real search release: charge, composed certificate, calibration, bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from dp_accounting import dp_event as de
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from dptune import accounting as A
from dptune.certificate import load_certificate, verify_binding
from dptune.cli.train import main as train_main
from dptune.config import ConfigError
from dptune.config.params import trial_steps
from dptune.ledger import Ledger
from tests.conftest import digits_seed_with_k, free_port, run_cli

SPACE = "search_spaces/digits.yaml"
N_TRAIN, N_VAL = 1257, 180  # digits: 1797 - 360 test - 180 validation


def _seed_with_k(k: int) -> int:
    return digits_seed_with_k(k, k)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(release dir, ledger) of one real tiny search (K = 1, best checkpoint saved)."""
    import torch

    root = tmp_path_factory.mktemp("train")
    (root / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "DPTUNE_TEST_DRAW_SEED"}
    # RAY_ADDRESS=local: start our own Ray even if another one on this machine advertises itself
    env.update(HOME=str(root / "home"), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
               RAY_ADDRESS="local")
    ledger = root / "ledger.sqlite"
    r = run_cli(["-m", "dptune.search", "--space", SPACE, "--name", "s", "--runs-dir", str(root / "runs"),
                 "--ledger", str(ledger), "--budget-epsilon", "30", "--num-cpus", "2", "--dashboard-port",
                 str(free_port()), "--smoke-test", "--save-checkpoint", "--seed", str(_seed_with_k(1))], env)
    assert r.returncode == 0, r.stdout + r.stderr
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in-process training below: 2 shared cores
    yield root / "runs" / "s" / "release", ledger
    torch.set_num_threads(threads)


def _train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = train_main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _copy(release: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "release"
    shutil.copytree(release, dst)
    return dst


def _sgd_part(cert_events: list[tuple[str, de.DpEvent]]) -> de.PoissonSampledDpEvent:
    role, event = cert_events[-1]
    assert role == "final_training" and isinstance(event, de.ComposedDpEvent)
    sgd, score = event.events
    assert isinstance(score, de.NoOpDpEvent)  # final training releases no score
    assert isinstance(sgd, de.SelfComposedDpEvent) and isinstance(sgd.event, de.PoissonSampledDpEvent)
    return sgd.event


# --------------------------------------------------------------------------------------------------


def test_calibration_is_tight() -> None:
    prior = [A.stopping_rule("poisson", mean=3.0).search_event(A.trial_event(noise_multiplier=2.0, sampling_rate=0.1, steps=40, score_noise=6.0))]
    q, steps, delta = 128 / N_TRAIN, 20, 1e-5
    prior_eps = A.epsilon(prior, delta)
    target = prior_eps + 1.0
    sigma = A.calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=delta, target_epsilon=target)
    assert A.epsilon([*prior, A.trial_event(noise_multiplier=sigma, sampling_rate=q, steps=steps, score_noise=None)], delta) <= target
    assert A.epsilon([*prior, A.trial_event(noise_multiplier=0.99 * sigma, sampling_rate=q, steps=steps, score_noise=None)], delta) > target
    # no prior: the public dp_accounting API agrees that the σ found fits — under the PLD, the bound it was
    # calibrated on; RDP alone would need more noise
    alone = A.calibrate_noise_multiplier([], sampling_rate=q, steps=steps, delta=delta, target_epsilon=2.0)
    pld = PLDAccountant()
    pld.compose(A.trial_event(noise_multiplier=alone, sampling_rate=q, steps=steps, score_noise=None))
    assert pld.get_epsilon(delta) <= 2.0
    acc = RdpAccountant()
    acc.compose(A.trial_event(noise_multiplier=alone, sampling_rate=q, steps=steps, score_noise=None))
    assert acc.get_epsilon(delta) > 2.0
    with pytest.raises(ConfigError, match="target_epsilon"):  # the field; the train CLI maps it to its flag
        A.calibrate_noise_multiplier(prior, sampling_rate=q, steps=steps, delta=delta, target_epsilon=prior_eps * 0.99)


def test_final_training_end_to_end(release: tuple[Path, Path], tmp_path: Path) -> None:
    rel, ledger_path = release
    out = tmp_path / "final"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = run_cli(["-m", "dptune.train", "--release", str(rel), "--out", str(out), "--ledger", str(ledger_path),
                 "--seed", "7"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NOT PRIVATE" in r.stderr and "non-private held-out" in r.stdout
    # no --target-epsilon: the target is the one the release carries (digits: privacy.target_epsilon 8), printed
    assert yaml.safe_load((rel / "best_config.yaml").read_text())["privacy"]["target_epsilon"] == 8
    assert "total epsilon target 8, from the release's privacy.target_epsilon" in r.stdout

    import torch

    model = torch.load(out / "model.pt", weights_only=True)
    assert "seed" not in model["config"] and model["config"]["score_noise"] is None
    assert all(isinstance(v, torch.Tensor) for v in model["model_state"].values())
    released = yaml.safe_load((rel / "best_config.yaml").read_text())["config"]
    batch, steps = released["batch_size"], trial_steps(epochs=released["epochs"], batch_size=released["batch_size"], basis=N_TRAIN)
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["test_accuracy"] <= 1 and metrics["steps"] == steps and metrics["target_epsilon"] == 8
    # the shareable folder holds no secret and nothing that times or counts (issue items 14, 22): the seed,
    # the ledger row, the timing, the local path and the divergence flag are sealed with the search
    assert sorted(p.name for p in out.iterdir()) == ["certificate.json", "metrics.json", "model.pt"]
    assert not {"seconds", "started", "ledger_charge", "release", "diverged", "seed"} & set(metrics)
    [record] = (rel.parent / "sealed" / "final").glob("final-*.json")
    sealed = json.loads(record.read_text())
    assert sealed["seed"] == "7" and sealed["seconds"] > 0 and "ledger_charge" in sealed
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert '"seed"' not in (out / "certificate.json").read_text() + (out / "metrics.json").read_text()

    # the certificate verifies; its ε is the composition — RDP, or the search's profile (its RDP conversion, or
    # also its privacy-profile bound: profile+pld) convolved with the final run's PLD (rdp+pld), whichever is
    # smallest: below the sum of the parts, above each
    cert = load_certificate(out / "certificate.json")
    search_cert = load_certificate(rel / "certificate.json")
    assert [role for role, _ in cert.events] == ["search", "final_training"]
    search_eps = A.epsilon([cert.events[0][1]], cert.delta)
    final_eps = A.epsilon([cert.events[1][1]], cert.delta)
    total_rdp = sum(A.rdp_of(e) for _, e in cert.events)
    rdp_total = compute_epsilon(A.ORDERS, total_rdp, cert.delta)[0]
    assert cert.bound in ("rdp", "rdp+pld", "profile+pld") and cert.epsilon <= rdp_total * (1 + 1e-9)
    assert cert.epsilon == A.certify([e for _, e in cert.events], cert.delta).epsilon
    assert search_eps == pytest.approx(search_cert.epsilon)
    assert max(search_eps, final_eps) <= cert.epsilon < search_eps + final_eps
    assert 8 - 0.05 < cert.epsilon <= 8  # calibrated to the release's target, not the released σ
    poisson = _sgd_part(cert.events)
    assert poisson.sampling_probability == pytest.approx(batch / N_TRAIN)
    assert cert.events[1][1].events[0].count == steps

    # ledger: the search and the final charge, both committed; the final one durable before training
    charges = Ledger(ledger_path).charges()
    final = [c for c in charges if c.name.startswith("final_training")]
    assert charges[0].name == "s" and len(final) == 1
    assert all(c.status == "committed" for c in charges)
    assert final[0].created < sealed["started"]
    assert final[0].epsilon == pytest.approx(final_eps)
    # the composed certificate is re-bound: both events are the ledger's authenticated charges
    bound = verify_binding(cert, Ledger(ledger_path))
    assert [c.name for c in bound] == ["s", final[0].name]


def test_target_epsilon_on_train_and_validation(release: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rel, ledger_path = release
    target = load_certificate(rel / "certificate.json").epsilon + 1.0
    rc, out, err = _train(capsys, "--release", str(rel), "--out", str(tmp_path / "o"), "--ledger",
                          str(ledger_path), "--target-epsilon", str(target), "--train-on-validation",
                          "--epochs", "1", "--seed", "1")
    assert rc == 0, err
    assert f"total epsilon target {target:g}, from --target-epsilon {target:g}, instead of the release's 8" in out
    cert = load_certificate(tmp_path / "o" / "certificate.json")
    assert target - 0.05 < cert.epsilon <= target
    batch = yaml.safe_load((rel / "best_config.yaml").read_text())["config"]["batch_size"]
    assert _sgd_part(cert.events).sampling_probability == pytest.approx(batch / (N_TRAIN + N_VAL))
    assert cert.details["final_training"]["n_train"] == N_TRAIN + N_VAL


def test_over_budget_exits_2_and_stores_nothing(release: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The budget is checked against everything the certificate composes (the search's charge is in the
    search's ledger, which final training must use: issue item 19)."""
    rel, ledger_path = release
    ledger = Ledger(ledger_path)
    search = load_certificate(rel / "certificate.json")
    fingerprint = ledger.fingerprint_of(search.dataset_id)
    assert fingerprint is not None
    ledger.set_budget(fingerprint, ledger.spent(fingerprint) + 0.05, search.delta)  # everything spent so far + 0.05
    try:
        before = ledger.charges()
        rc, _, err = _train(capsys, "--release", str(rel), "--out", str(tmp_path / "o"), "--seed", "1")
        assert rc == 2 and "budget" in err
        assert ledger.charges() == before and not (tmp_path / "o" / "model.pt").exists()
    finally:
        ledger.set_budget(fingerprint, 30.0, search.delta)


def _tamper_epsilon(d: Path) -> None:
    c = json.loads((d / "certificate.json").read_text())
    c["epsilon"] = c["epsilon"] / 2
    (d / "certificate.json").write_text(json.dumps(c))


def _edit_config(key: str, value: object, delete: bool = False) -> object:
    def edit(d: Path) -> None:
        raw = yaml.safe_load((d / "best_config.yaml").read_text())
        if delete:
            del raw["config"][key]
        else:
            raw["config"][key] = value
        (d / "best_config.yaml").write_text(yaml.safe_dump(raw))
    return edit


def _other_dataset(d: Path) -> None:
    c = json.loads((d / "certificate.json").read_text())
    c["dataset_id"] = "0" * 32
    (d / "certificate.json").write_text(json.dumps(c))


@pytest.mark.parametrize("edit, message", [
    (_tamper_epsilon, "certificate.epsilon"),
    (lambda d: (d / "certificate.json").unlink(), "certificate"),
    (lambda d: shutil.rmtree(d), "--release"),
    (_edit_config("dropout", 0.1), "best_config.config.dropout: unknown key"),
    (_edit_config("noise_multiplier", None, delete=True), "best_config.config.noise_multiplier: is missing"),
    (_edit_config("batch_size", "big"), "best_config.config.batch_size"),
    (lambda d: (d / "best_config.yaml").write_text("config: [unclosed\n"), "best_config.yaml"),
    (_other_dataset, "certificate.binding"),
    (lambda d: (d / "best_checkpoint.pt").unlink(), "--save-checkpoint"),
])
def test_bad_release_exits_2(release: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             edit: object, message: str) -> None:
    rel, ledger_path = release
    copy = _copy(rel, tmp_path)
    assert callable(edit)
    edit(copy)
    before = Ledger(ledger_path).charges()
    extra = ["--use-best-checkpoint"] if message == "--save-checkpoint" else ["--seed", "1"]
    rc, _, err = _train(capsys, "--release", str(copy), "--run", str(rel.parent), "--out", str(tmp_path / "o"),
                        "--ledger", str(ledger_path), *extra)
    assert rc == 2 and err.startswith("error: ") and message in err, err  # exit 2 before any warning
    assert Ledger(ledger_path).charges() == before and not (tmp_path / "o" / "model.pt").exists()


def test_no_budget_and_impossible_target_exit_2(release: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rel, ledger_path = release
    Ledger(tmp_path / "empty.sqlite")
    rc, _, err = _train(capsys, "--release", str(rel), "--out", str(tmp_path / "o"), "--ledger",
                        str(tmp_path / "empty.sqlite"), "--seed", "1")
    assert rc == 2 and "--ledger" in err and "the search was charged to" in err
    before = Ledger(ledger_path).charges()
    search_eps = load_certificate(rel / "certificate.json").epsilon
    rc, _, err = _train(capsys, "--release", str(rel), "--out", str(tmp_path / "o"), "--ledger", str(ledger_path),
                        "--target-epsilon", str(search_eps * 0.9), "--seed", "1")
    assert rc == 2 and "--target-epsilon" in err
    assert Ledger(ledger_path).charges() == before


def test_use_best_checkpoint_exports_without_charge(release: tuple[Path, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rel, ledger_path = release
    before = Ledger(ledger_path).charges()
    rc, out, err = _train(capsys, "--release", str(rel), "--out", str(tmp_path / "o"), "--ledger", str(ledger_path),
                          "--use-best-checkpoint")
    assert rc == 0, err
    assert "no new charge" in out
    assert Ledger(ledger_path).charges() == before
    assert (tmp_path / "o" / "certificate.json").read_bytes() == (rel / "certificate.json").read_bytes()
    import torch

    model = torch.load(tmp_path / "o" / "model.pt", weights_only=True)
    assert "seed" not in model["config"]
    assert 0 <= json.loads((tmp_path / "o" / "metrics.json").read_text())["test_accuracy"] <= 1


def test_an_edited_release_or_checkpoint_is_refused_even_when_equivalent(release: tuple[Path, Path], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The binding covers the files' bytes (issue 22 item 1): best_config.yaml rewritten without the later
    fields (read at their defaults, the same config) or a checkpoint re-saved without model_kwargs is not the
    file that was released — refused, nothing charged. (Reading older files at the later defaults:
    tests/test_older_records.py.)"""
    import torch

    from dptune.config import DatasetSpec, TrialConfig, later_defaults

    rel, ledger_path = release
    before = Ledger(ledger_path).charges()
    old = _copy(rel, tmp_path)
    doc = yaml.safe_load((old / "best_config.yaml").read_text())
    for section, cls in (("config", TrialConfig), ("dataset", DatasetSpec)):
        for name in later_defaults(cls):
            del doc[section][name]
    (old / "best_config.yaml").write_text(yaml.safe_dump(doc))
    rc, _, err = _train(capsys, "--release", str(old), "--run", str(rel.parent), "--out", str(tmp_path / "o"),
                        "--ledger", str(ledger_path), "--use-best-checkpoint")
    assert rc == 2 and "best_config.yaml: is not the file" in err, err
    shutil.copyfile(rel / "best_config.yaml", old / "best_config.yaml")
    ckpt = torch.load(old / "best_checkpoint.pt", weights_only=True)
    del ckpt["config"]["model_kwargs"]
    torch.save(ckpt, old / "best_checkpoint.pt")
    rc, _, err = _train(capsys, "--release", str(old), "--run", str(rel.parent), "--out", str(tmp_path / "o"),
                        "--ledger", str(ledger_path), "--use-best-checkpoint")
    assert rc == 2 and "best_checkpoint.pt: is not the file" in err, err
    assert Ledger(ledger_path).charges() == before and not (tmp_path / "o" / "model.pt").exists()
