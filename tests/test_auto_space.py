"""``space: auto`` / ``dptune search --data … --target-epsilon ε`` (issue 43): the whole space derived from public
facts only (same facts → the same space, whatever the data's values), every derived space passes the clipping guard
and plans, one that is not expected to pay exits 2 with nothing charged, and a search's release binds the space it
derived."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dptune.accounting import plan_search, plan_transfer
from dptune.cli._common import space_from_args
from dptune.config import ConfigError, parse_space
from dptune.config.auto import batch_sizes, facts_of
from dptune.dpsgd import validate_model
from dptune.release import public_auto
from tests.conftest import run_cli

FEATURES = {f"f{i}": [-3.0, 3.0] for i in range(6)}


def _table(path: Path, seed: int, rows: int = 400) -> Path:
    rng = np.random.default_rng(seed)
    cols: dict[str, Any] = {k: rng.normal(size=rows) * (1 + seed) for k in FEATURES}
    cols["label"] = rng.choice(["no", "yes"], size=rows)
    pq.write_table(pa.table(cols), path)
    return path


def _table_data(path: Path) -> dict[str, Any]:
    return {"name": "table", "path": str(path), "label": "label", "classes": ["no", "yes"], "features": FEATURES,
            "validation_size": 60, "test_size": 40}


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"space": None, "data": None, "target_epsilon": None, "hardware": "cpu", **kw})


def _yaml(path: Path, data: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump({"dataset": data}))
    return str(path)


def test_same_public_facts_give_the_same_space_whatever_the_values(tmp_path: Path) -> None:
    """Two tables of the same columns, bounds, classes and size, with different values (another scale, other
    labels): the searches derive the same space, and the releases would bind the same derived file."""
    a = space_from_args(_args(data=_yaml(tmp_path / "a.yaml", _table_data(_table(tmp_path / "a.parquet", 0))),
                              target_epsilon=2.0), count=True)
    b = space_from_args(_args(data=_yaml(tmp_path / "b.yaml", _table_data(_table(tmp_path / "b.parquet", 7))),
                              target_epsilon=2.0), count=True)
    assert a.auto is not None and b.auto is not None
    assert public_auto(a) == public_auto(b)
    assert (a.fixed, a.space, a.default, a.privacy, a.planner) == (b.fixed, b.space, b.default, b.privacy, b.planner)
    assert a.auto["facts"]["n_train"] == 300 and a.auto["facts"]["shape"] == [1, 1, 6]
    # another size is another public fact: it may change the space (here the batch sizes), nothing else does
    c = space_from_args(_args(data=_yaml(tmp_path / "c.yaml", _table_data(_table(tmp_path / "c.parquet", 0, 4100))),
                              target_epsilon=2.0), count=True)
    assert c.auto is not None and c.auto["facts"]["n_train"] == 4000
    assert c.space["batch_size"] != a.space["batch_size"]


def test_image_spaces_never_read_the_files(tmp_path: Path) -> None:
    """A built-in reader's facts are its published shape, classes and split sizes: two folders (one holding
    nothing at all) derive the same space, and so does the same data under another path."""
    spaces = [parse_space({"dataset": {"name": "mnist", "path": str(tmp_path / d), "split": "test",
                                       "validation_size": 1000, "test_size": 1000},
                           "privacy": {"target_epsilon": 2}, "space": "auto"}) for d in ("x", "y")]
    assert spaces[0].auto is not None and public_auto(spaces[0]) == public_auto(spaces[1])
    assert spaces[0].fixed.model == "tanh_cnn"


CASES = [
    ({"name": "digits"}, "gn_cnn", None),
    ({"name": "mnist", "path": "unused", "split": "test", "validation_size": 1000, "test_size": 1000}, "tanh_cnn", None),
    ({"name": "table", "path": "unused.parquet", "label": "label", "classes": ["no", "yes"], "features": FEATURES,
      "validation_size": 60, "test_size": 40}, "mlp", 300),
]


@pytest.mark.parametrize(("data", "model", "n_train"), CASES, ids=["digits", "mnist", "table"])
@pytest.mark.parametrize("eps", [1.0, 2.0, 4.0])
def test_every_derived_space_plans_and_passes_the_clipping_guard(data: dict[str, Any], model: str,
                                                                 n_train: int | None, eps: float) -> None:
    space = parse_space({"dataset": data, "privacy": {"target_epsilon": eps}, "space": "auto"}, n_train=n_train)
    assert space.fixed.model == model and space.transfers and space.searcher == "random"
    assert space.auto is not None
    n = space.auto["facts"]["n_train"]
    plan = plan_search(space, n, compare=False)
    tp = plan_transfer(space, plan, final_n=n + space.dataset.validation_size)
    assert 0 < plan.search_epsilon <= 0.3 * eps * (1 + 1e-6)
    assert all(math.isfinite(s) and s > 0 for _, _, s in tp.final_sigmas)
    shape = tuple(space.auto["facts"]["shape"])
    if eps == 2.0:  # the guard does not depend on ε: every model and engine the space can run, probed once
        for groups in (4, 8):
            for batch in space.space["batch_size"].choices:  # type: ignore[attr-defined]
                validate_model(space.fixed.replace(groups=groups, batch_size=int(batch)),
                               space.auto["facts"]["classes"], shape)


@pytest.mark.slow
def test_a_colour_image_space_passes_the_clipping_guard() -> None:
    space = parse_space({"dataset": {"name": "cifar10", "path": "unused", "validation_size": 5000},
                         "privacy": {"target_epsilon": 4}, "space": "auto"})
    assert space.fixed.model == "resnet9" and space.auto is not None
    plan_search(space, space.auto["facts"]["n_train"], compare=False)
    validate_model(space.fixed.replace(groups=8, batch_size=1024), 10, (3, 32, 32))


def test_batch_sizes_follow_the_training_split_size() -> None:
    assert batch_sizes(8000) == (256, 1024)
    assert batch_sizes(1257) == (64, 256)
    assert batch_sizes(300) == (64, 64)
    assert batch_sizes(45000) == (1024, 4096)


@pytest.mark.parametrize(("raw", "field"), [
    ({"dataset": {"name": "digits"}, "space": "auto"}, "privacy.target_epsilon"),
    ({"dataset": {"name": "digits"}, "space": "auto", "privacy": {"target_epsilon": 2}, "model": {"name": "mlp"}},
     "model"),
    ({"dataset": {"name": "digits"}, "space": "auto", "privacy": {"target_epsilon": 2, "mean": 3}}, "privacy.mean"),
    ({"dataset": {"name": "digits"}, "space": "auto", "privacy": {"target_epsilon": -1}}, "privacy.target_epsilon"),
    ({"dataset": {"name": "table", "path": "t.parquet", "label": "y", "classes": [0, 1], "features": FEATURES},
      "space": "auto", "privacy": {"target_epsilon": 2}}, "dataset"),
])
def test_bad_auto_input_names_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_space(raw)
    assert e.value.field == field


def test_facts_refuse_a_dataset_without_classes() -> None:
    with pytest.raises(ConfigError, match="classes"):
        facts_of({"name": "table", "features": FEATURES, "classes": []}, n_train=100, target_epsilon=2, delta=1e-5)


def test_cli_without_a_budget_exits_2_naming_it(tmp_path: Path) -> None:
    r = run_cli(["-m", "dptune.plan", "--data", "digits"], env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "--target-epsilon" in r.stderr, r.stderr


def test_a_derived_search_not_expected_to_pay_exits_2_with_nothing_charged(tmp_path: Path,
                                                                           isolated_env: dict[str, str]) -> None:
    """digits at total ε 1: the verdict says the derived search does not pay; exit 2 before any charge or run
    folder, naming --tune-anyway."""
    ledger = tmp_path / "l.sqlite"
    r = run_cli(["-m", "dptune.search", "--data", "digits", "--target-epsilon", "1", "--ledger", str(ledger),
                 "--budget-epsilon", "10", "--runs-dir", str(tmp_path / "runs"), "--num-cpus", "1"], isolated_env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "does not expect this search to beat" in r.stderr and "--tune-anyway" in r.stderr, r.stderr
    assert "raise --target-epsilon" in r.stderr and "search_share" not in r.stderr, r.stderr
    assert "space: auto (rules v" in r.stdout  # the derived space was shown before anything
    from dptune.ledger import Ledger

    if ledger.exists():
        assert Ledger(str(ledger)).charges() == []
    assert not any((tmp_path / "runs").glob("*/sealed/state.json"))


@pytest.mark.slow  # a whole digits search at 10-20 epochs per trial (make test-slow; CI runs it)
def test_a_derived_search_releases_and_binds_its_space(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """A real search on digits from --data alone: the release holds auto_space.yaml, bound by the certificate,
    equal to the space the plan derives, and dptune train accepts the release."""
    ledger = tmp_path / "l.sqlite"
    r = run_cli(["-m", "dptune.search", "--data", "digits", "--target-epsilon", "8", "--tune-anyway", "--ledger",
                 str(ledger), "--budget-epsilon", "10", "--runs-dir", str(tmp_path / "runs"), "--name", "a",
                 "--num-cpus", "2", "--seed", "3"], isolated_env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    release = tmp_path / "runs" / "a" / "release"
    derived = yaml.safe_load((release / "auto_space.yaml").read_text())
    cert = json.loads((release / "certificate.json").read_text())
    assert "auto_space.yaml" in cert["binding"]["files"]
    expected = public_auto(parse_space({"dataset": {"name": "digits"}, "space": "auto",
                                        "privacy": {"target_epsilon": 8}}))
    assert derived == expected == cert["details"]["auto"]
    assert "path" not in derived["space"]["dataset"]
    (release / "auto_space.yaml").write_text((release / "auto_space.yaml").read_text() + "# edited\n")
    t = run_cli(["-m", "dptune.train", "--release", str(release), "--out", str(tmp_path / "final"), "--ledger",
                 str(ledger), "--epochs", "1"], isolated_env)
    assert t.returncode == 2 and "auto_space.yaml" in t.stderr, t.stderr


def test_the_api_plans_a_derived_space_on_a_counted_table(tmp_path: Path) -> None:
    import dptune

    raw = {"dataset": _table_data(_table(tmp_path / "t.parquet", 1)), "privacy": {"target_epsilon": 4},
           "space": "auto"}
    plan = dptune.plan(raw)
    assert plan.n_train == 300 and 0 < plan.search_epsilon <= 1.2 * (1 + 1e-6)
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert dptune.plan(str(path)).search_epsilon == plan.search_epsilon


def test_search_refuses_a_budget_flag_a_hand_written_space_would_ignore(tmp_path: Path) -> None:
    ledger = tmp_path / "l.sqlite"
    r = run_cli(["-m", "dptune.search", "--space", "search_spaces/digits.yaml", "--target-epsilon", "2", "--ledger",
                 str(ledger), "--budget-epsilon", "10", "--runs-dir", str(tmp_path / "runs")], env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "--target-epsilon" in r.stderr and "written by hand" in r.stderr, r.stderr
    assert not ledger.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("data", "model", "n_train"), CASES, ids=["digits", "mnist", "table"])
def test_the_verdict_is_the_measured_gain_of_its_kind(data: dict[str, Any], model: str, n_train: int | None) -> None:
    """Rules v2 (issue 58): a derived grey-image search is judged by what searches by the same rules gained on the
    public proxy of its kind (digits for 8x8, the public MNIST training images for 28x28), expected to pay iff that
    gain at the target ε is above its std error: at ε 2 and above, not at 1 and below; between them, interpolated in
    log ε (digits pays at 1.5, the 28x28 proxy does not: +0.64 against 0.68 points). A table
    has no measured proxy of its kind: the analytic model judges it, as in v1."""
    from dptune.accounting import advise_transfer
    from dptune.config.auto import KIND_GAIN

    for eps in (1.0, 1.5, 4.0, 8.0) if model != "mlp" else (2.0,):  # measured, between, above
        space = parse_space({"dataset": data, "privacy": {"target_epsilon": eps}, "space": "auto"}, n_train=n_train)
        assert space.auto is not None
        a = advise_transfer(space, space.auto["facts"]["n_train"])
        if model not in KIND_GAIN:
            assert space.planner.kind_gain is None and a.rehearsed is None and a.pays == (a.proxy >= a.min_gain)
            continue
        gain, se, _ = KIND_GAIN[model]
        near = min(gain, key=lambda e: abs(math.log(e / eps)))
        if eps in gain or eps < min(gain) or eps > max(gain):
            assert a.rehearsed == gain[near] and a.rehearsed_se == se[near]
        else:
            assert min(gain[1.0], gain[2.0]) < a.rehearsed < max(gain[1.0], gain[2.0])  # between ε 1 and 2
        assert a.rehearsed_se is not None and a.pays == (a.rehearsed > a.rehearsed_se), (eps, a.verdict)
        assert "public proxy of this kind" in a.verdict
        if eps != 1.5:
            assert a.pays == (eps >= 2.0), (eps, a.verdict)


def test_a_refused_derived_search_names_what_refusing_gives_up() -> None:
    """The refusal says what the proxy measured for the search (the cost of refusing) and the flag; nothing runs."""
    from dptune.accounting import plan_search, plan_transfer
    from dptune.tuning.precharge import verdict

    space = parse_space({"dataset": {"name": "digits"}, "privacy": {"target_epsilon": 1.0}, "space": "auto"})
    assert space.auto is not None
    n, n_val = space.auto["facts"]["n_train"], space.dataset.validation_size
    plan = plan_search(space, n, compare=False)
    said: list[str] = []
    with pytest.raises(ConfigError) as e:
        verdict(space, n, n_val, (plan, plan_transfer(space, plan, final_n=n + n_val)), tune_anyway=False,
                say=said.append)
    assert e.value.field == "--tune-anyway" and "+0.14 points (std error 3.43)" in str(e.value), str(e.value)
    assert "--tune-anyway" in str(e.value) and "nothing was charged" in str(e.value)
    verdict(space, n, n_val, (plan, plan_transfer(space, plan, final_n=n + n_val)), tune_anyway=True, say=said.append)
    assert said[-1].startswith("  --tune-anyway")


@pytest.mark.parametrize(("planner", "field"), [
    ({"kind_gain": {1: 0.01}}, "planner.kind_gain_se"),
    ({"kind_gain_se": {1: 0.01}}, "planner.kind_gain"),
    ({"kind_gain": {1: 0.01, 2: 0.02}, "kind_gain_se": {1: 0.01}}, "planner.kind_gain_se"),
    ({"kind_gain": {1: 0.01}, "kind_gain_se": {1: -0.01}}, "planner.kind_gain_se"),
    ({"kind_gain": {1: 3.0}, "kind_gain_se": {1: 0.01}}, "planner.kind_gain.1"),
])
def test_a_bad_kind_gain_names_its_field(planner: dict[str, Any], field: str) -> None:
    from dptune.config.planner import PlannerSpec

    with pytest.raises(ConfigError) as e:
        PlannerSpec(**planner)
    assert e.value.field == field, e.value
