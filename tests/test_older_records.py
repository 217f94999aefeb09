"""Records written before later config fields existed (``model_kwargs``; the dataset's ``split``,
``download`` and table keys): a release loads, and a sealed search resumes, with those fields at their
defaults — what ran before they existed. Unknown keys and every other missing field are still refused by
name. One real K = 0 search (no Ray), interrupted and resumed from a run spec stripped of the later fields."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dptune.config import DatasetSpec, TrialConfig, later_defaults, load_space
from dptune.errors import ConfigError
from dptune.ledger import Ledger
from dptune.release import load_release
from dptune.rundir import RunDir
from tests.conftest import ROOT, digits_seed_with_k

SPACE = ROOT / "search_spaces" / "digits.yaml"
LATER = {"dataset": later_defaults(DatasetSpec), "config": later_defaults(TrialConfig)}


def _strip_later_fields(spec: dict[str, Any]) -> None:
    for key, cls in (("dataset", DatasetSpec), ("fixed", TrialConfig), ("default", TrialConfig)):
        for name in later_defaults(cls):
            del spec[key][name]


@pytest.fixture(scope="module")
def old_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A K = 0 search interrupted after its charge, its sealed run spec rewritten as an older dptune wrote
    it, then resumed (no new charge) to its release."""
    from dptune.tuning import driver
    from dptune.tuning.runner import SearchInterrupted

    base = tmp_path_factory.mktemp("old")
    req = driver.SearchRequest(space=load_space(SPACE), run_dir=base / "old", ledger=base / "l.sqlite",
                               budget_epsilon=30, seed=digits_seed_with_k(0, 0))

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise SearchInterrupted([])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "_run_trials", interrupted)
        with pytest.raises(driver.SearchStopped):
            driver.run_search(req, say=lambda line: None)
    run = RunDir(req.run_dir)
    spec = run.read_state()["run_spec"]
    _strip_later_fields(spec)
    run.write_state(run_spec=spec)
    out = driver.run_search(dataclasses.replace(req, resume=True), say=lambda line: None)
    assert out.released["config"]["model_kwargs"] == {}
    assert [c.status for c in Ledger(req.ledger).charges()] == ["committed"]  # the one charge, no second
    return req.run_dir


def test_an_older_sealed_run_spec_reads_at_the_later_defaults() -> None:
    import json

    from dptune.tuning.driver import run_spec, sealed_run_spec

    spec = json.loads(json.dumps(run_spec(load_space(SPACE))))  # as state.json holds it
    old = json.loads(json.dumps(spec))
    _strip_later_fields(old)
    assert old != spec and sealed_run_spec(old) == spec
    old["fixed"]["noise_multiplier"] = 9.0  # a field that existed then still counts as a change
    assert sealed_run_spec(old)["fixed"] != spec["fixed"]


def _edited(old_run: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    release = tmp_path / "release"
    shutil.copytree(old_run / "release", release)
    doc = yaml.safe_load((release / "best_config.yaml").read_text())
    edit(doc)
    (release / "best_config.yaml").write_text(yaml.safe_dump(doc))
    return release


def _drop_later(doc: dict[str, Any]) -> None:
    for section, fields in LATER.items():
        for name in fields:
            del doc[section][name]


def test_a_release_without_the_later_fields_loads_at_their_defaults(old_run: Path, tmp_path: Path) -> None:
    release = load_release(_edited(old_run, tmp_path, _drop_later))
    current = load_release(old_run / "release")
    assert release.config == current.config and release.config.model_kwargs == {}
    assert release.dataset == current.dataset and release.dataset.split == "official"


def _set(section: str, key: str, value: Any = None, delete: bool = False) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        _drop_later(doc)
        if delete:
            del doc[section][key]
        else:
            doc[section][key] = value
    return edit


@pytest.mark.parametrize("edit, field, problem", [
    (_set("config", "dropout", 0.1), "best_config.config.dropout", "unknown key"),
    (_set("dataset", "colour", "blue"), "best_config.dataset.colour", "unknown key"),
    (_set("config", "noise_multiplier", delete=True), "best_config.config.noise_multiplier", "is missing"),
    (_set("config", "fix_batchnorm", delete=True), "best_config.config.fix_batchnorm", "is missing"),
    (_set("dataset", "split_seed", delete=True), "best_config.dataset.split_seed", "is missing"),
])
def test_unknown_and_other_missing_fields_are_still_refused(old_run: Path, tmp_path: Path,
                                                           edit: Callable[[dict[str, Any]], None], field: str,
                                                           problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_release(_edited(old_run, tmp_path, edit))
    assert e.value.field == field and problem in str(e.value), e.value
