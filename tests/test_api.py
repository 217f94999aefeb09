"""The Python API runs the same library calls as the CLIs: same validation, same ledger entries, same
certificates. K = 0 (a fixed, NOT PRIVATE draw seed) keeps it fast: no Ray, a real final training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import dptune
from dptune.cli.search import main as search_main
from dptune.cli.train import main as train_main
from dptune.ledger import Ledger, event_sha256
from tests.conftest import digits_seed_with_k

ROOT = Path(__file__).resolve().parent.parent
SPACE = ROOT / "search_spaces" / "digits.yaml"


def _k0_seed() -> int:
    return digits_seed_with_k(0, 0)


def _entries(path: Path) -> list[tuple[str, str, str]]:
    return [(c.name.split(":")[0], c.status, event_sha256(c.event)) for c in Ledger(path).charges()]


def test_api_plan_search_train_match_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    torch.set_num_threads(1)
    seed = _k0_seed()
    raw = yaml.safe_load(SPACE.read_text())
    plan = dptune.plan(raw)  # a dict works like the YAML path
    assert plan.search_epsilon == pytest.approx(dptune.plan(SPACE).search_epsilon, rel=1e-12)

    found = dptune.search(raw, budget_epsilon=30, ledger=tmp_path / "api.sqlite", runs_dir=tmp_path / "api",
                          name="s", seed=seed, epochs=2)
    model = dptune.train(found, target_epsilon=found.epsilon + 2, epochs=1, seed=1)
    assert found.score is None and found.config["batch_size"] == raw["default"]["batch_size"]  # K = 0
    assert dptune.plan(raw, epochs=2).search_epsilon == pytest.approx(found.epsilon, rel=1e-9)  # the plan of that search
    assert isinstance(model, dptune.FinalModel)
    assert model.epsilon <= found.epsilon + 2 and 0 <= model.metrics["test_accuracy"] <= 1

    assert search_main(["--space", str(SPACE), "--name", "s", "--runs-dir", str(tmp_path / "cli"), "--ledger",
                        str(tmp_path / "cli.sqlite"), "--budget-epsilon", "30", "--seed", str(seed),
                        "--epochs", "2"]) == 0
    assert train_main(["--release", str(tmp_path / "cli" / "s" / "release"), "--out", str(tmp_path / "cli-final"),
                       "--target-epsilon", str(found.epsilon + 2), "--epochs", "1", "--seed", "1"]) == 0
    capsys.readouterr()
    assert _entries(tmp_path / "api.sqlite") == _entries(tmp_path / "cli.sqlite")
    api_cert = json.loads((model.out / "certificate.json").read_text())
    cli_cert = json.loads((tmp_path / "cli-final" / "certificate.json").read_text())
    assert api_cert["epsilon"] == pytest.approx(cli_cert["epsilon"], rel=1e-12)
    assert [e["event"] for e in api_cert["events"]] == [e["event"] for e in cli_cert["events"]]


def test_api_bad_input_raises_config_error_and_charges_nothing(tmp_path: Path) -> None:
    raw = yaml.safe_load(SPACE.read_text())
    raw["privacy"]["delta"] = 0.01  # ≥ 1/n
    with pytest.raises(dptune.ConfigError, match="privacy.delta"):
        dptune.search(raw, budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path / "runs")
    assert Ledger(tmp_path / "l.sqlite").charges() == []
    with pytest.raises(dptune.ConfigError, match="tune_fraction"):
        dptune.plan(SPACE, tune_fraction=0)


def _asha(raw: dict) -> dict:
    raw["search"].update(scheduler="asha", accounting="composed")
    raw["privacy"].update(stopping="composed", mean=2)
    return raw


def _space_object_with(**changes: object) -> object:
    import dataclasses

    import optuna.distributions as od

    space = dptune.config.load_space(SPACE)
    if "seed" in changes:
        return dataclasses.replace(space, fixed=space.fixed.replace(seed=12345))
    return dataclasses.replace(space, space={**space.space, "score_noise": od.FloatDistribution(1.0, 9.0)})


@pytest.mark.parametrize("space, field", [
    (lambda: _asha(yaml.safe_load(SPACE.read_text())), "search.scheduler"),
    (lambda: _space_object_with(seed=12345), "fixed.seed"),
    (lambda: _space_object_with(score_noise=True), "space.score_noise"),
])
def test_api_refuses_what_the_cli_refuses_through_one_validation_path(tmp_path: Path, space: object,
                                                                     field: str) -> None:
    """Issue 22 item 22: ``scheduler: asha`` (ran FIFO through the API), an internal field set on a SearchSpace
    object, a searched score noise — refused by dptune.search and dptune.plan as by the CLI, nothing charged."""
    assert callable(space)
    with pytest.raises(dptune.ConfigError) as e:
        dptune.search(space(), budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path / "runs",
                      seed=_k0_seed())
    assert e.value.field == field, e.value
    assert not (tmp_path / "l.sqlite").exists() or Ledger(tmp_path / "l.sqlite").charges() == []
    assert not (tmp_path / "runs").exists()
    with pytest.raises(dptune.ConfigError) as e:
        dptune.plan(space(), n_train=1257)
    assert e.value.field == field


def test_cli_refuses_asha_from_the_space_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "asha.yaml").write_text(yaml.safe_dump(_asha(yaml.safe_load(SPACE.read_text()))))
    rc = search_main(["--space", str(tmp_path / "asha.yaml"), "--ledger", str(tmp_path / "l.sqlite"),
                      "--runs-dir", str(tmp_path / "runs"), "--budget-epsilon", "30"])
    assert rc == 2 and "search.scheduler" in capsys.readouterr().err


def test_api_result_config_holds_what_a_user_sets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 part 5: ``found.config`` carried every TrialConfig field the release file keeps for final
    training (score noise, alc's clip norms, …). It holds what a space sets — the searched keys first — and the
    release file is unchanged: final training still reads what it needs from it."""
    import dataclasses

    from dptune.config import TrialConfig
    from dptune.release import NOT_USER_SET

    raw = yaml.safe_load(SPACE.read_text())
    found = dptune.search(raw, budget_epsilon=30, ledger=tmp_path / "l.sqlite", runs_dir=tmp_path / "runs",
                          name="c", seed=_k0_seed(), epochs=2)
    searched = sorted(raw["space"])
    assert list(found.config)[:len(searched)] == searched
    settable = {f.name for f in dataclasses.fields(TrialConfig)} - {"seed", "sampling_basis", "score_noise",
                                                                      "layer_clip"}
    assert set(found.config) == settable and not set(found.config) & set(NOT_USER_SET)
    assert found.config["epochs"] == 2 and found.config["model"] == "gn_cnn"
    stored = yaml.safe_load((found.release / "best_config.yaml").read_text())["config"]
    assert stored["score_noise"] is not None and "layer_clip" in stored and "seed" not in stored  # format kept
    assert {k: stored[k] for k in found.config} == found.config
    capsys.readouterr()


def test_resume_call_repeats_what_was_given() -> None:
    """The call an interrupted ``dptune.search`` names (tests/test_search_faults.py runs it): the same space and
    arguments, ``name`` and ``resume=True``; a budget is not reopened; a dict or SearchSpace is named, not dumped."""
    from dptune.api import resume_call

    given = {"space": Path("spaces/x.yaml"), "budget_epsilon": 30, "ledger": Path("l.sqlite"), "name": None,
             "epochs": None, "num_cpus": 2, "seed": None, "resume": False, "cpus_per_trial": 1.0}
    assert resume_call(given, "x-1") == "dptune.search('spaces/x.yaml', name='x-1', resume=True, ledger='l.sqlite', num_cpus=2)"
    assert resume_call({**given, "space": {"space": {}}}, "x-1").endswith(", with space the same dict as this call's")
