"""The bad-input catalogue: every user-facing CLI, every kind of bad input. Each gets one clear line
naming the field (`error: <field>: <problem>; <fix>`), exit status 2, and leaves the ledger unchanged."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dptune.ledger import Ledger

ROOT = Path(__file__).resolve().parent.parent
SPACE = ROOT / "search_spaces" / "digits.yaml"
GOOD_PLAN = ["--noise-multiplier", "1.5", "--sampling-rate", "0.04", "--steps", "100", "--delta", "1e-5",
             "--public-validation"]


def _k0_seed() -> int:
    from tests.conftest import digits_seed_with_k

    return digits_seed_with_k(0, 0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A ledger with a digits budget and one real search's charge and release: a K = 0 search (the draw
    seed fixed by the test hook), which runs the whole CLI path but needs no Ray."""
    from dptune.cli.search import main as search_main

    base = tmp_path_factory.mktemp("world")
    old = os.environ.get("DPTUNE_TEST_DRAW_SEED")
    os.environ["DPTUNE_TEST_DRAW_SEED"] = str(_k0_seed())
    try:
        rc = search_main(["--space", str(SPACE), "--name", "demo", "--runs-dir", str(base / "runs"), "--ledger",
                          str(base / "ledger.sqlite"), "--budget-epsilon", "4"])
    finally:
        os.environ.pop("DPTUNE_TEST_DRAW_SEED")
        if old is not None:
            os.environ["DPTUNE_TEST_DRAW_SEED"] = old
    assert rc == 0
    corrupt = base / "corrupt.yaml"
    corrupt.write_text("space: [unclosed\n  privacy: {")
    raw = yaml.safe_load(SPACE.read_text())
    spaces = {"wrong_type": ("fixed", "epochs", "many"), "big_delta": ("privacy", "delta", 1e-3),
              "bad_default": ("default", "batch_size", 100), "basis": ("fixed", "sampling_basis", 256.0),
              "seeded": ("fixed", "seed", 1)}
    out = {"base": base, "ledger": base / "ledger.sqlite", "run": base / "runs" / "demo",
           "release": base / "runs" / "demo" / "release", "corrupt": corrupt}
    for name, (section, key, value) in spaces.items():
        variant = yaml.safe_load(yaml.safe_dump(raw))
        variant[section][key] = value
        out[name] = base / f"{name}.yaml"
        out[name].write_text(yaml.safe_dump(variant))
    unknown = base / "unknown.yaml"
    unknown.write_text(SPACE.read_text() + "\ncolour: blue\n")
    other = base / "other-ledger.sqlite"
    Ledger(other)
    yield {**out, **_model_and_table_variants(base, raw), "unknown": unknown, "other_ledger": other}


def _model_and_table_variants(base: Path, raw: dict[str, Any]) -> dict[str, Path]:
    """Spaces whose model or table is refused only once the data is read (search, before the ledger reserves):
    a BatchNorm model, a factory that does not import, and one bad table per kind, from one CSV file."""
    table = base / "table.csv"
    table.write_text("x,w,s,y\n" + "".join(f"{'' if i == 3 else i / 10},{i / 20},{'ab'[i % 2]},{i % 2}\n"
                                           for i in range(20)))
    variants: dict[str, dict[str, Any]] = {
        "bn_model": {"model": {"torchvision": "resnet18"}},
        "no_factory": {"model": {"factory": "dptune_no_such_module:make"}},
        "tbl_missing": {"features": {"x": [0, 2]}}, "tbl_no_label": {"label": "nope"},
        "tbl_text": {"features": {"s": [0, 1]}}, "tbl_no_column": {"features": {"zz": [0, 1]}},
    }
    out = {}
    for name, change in variants.items():
        variant = yaml.safe_load(yaml.safe_dump(raw))
        if name.startswith("tbl_"):
            variant["dataset"] = {"name": "table", "path": str(table), "label": "y", "features": {"w": [0, 1]},
                                  "validation_size": 2, "test_size": 2, "classes": [0, 1], **change}
            variant["model"] = {"name": "mlp"}
        else:
            variant.update(change)
        out[name] = base / f"{name}.yaml"
        out[name].write_text(yaml.safe_dump(variant))
    return out


def _release_variant(world: dict[str, Path], name: str, edit: Callable[[Path], None]) -> str:
    import shutil

    dst = world["base"] / f"release-{name}"
    if not dst.exists():
        shutil.copytree(world["release"], dst)
        edit(dst)
    return str(dst)


def _train(world: dict[str, Path], release: str, out: str, *extra: str) -> list[str]:
    return ["--release", release, "--run", str(world["run"]), "--out", str(world["base"] / out), *extra]


def _tamper(d: Path) -> None:
    c = json.loads((d / "certificate.json").read_text())
    c["epsilon"] /= 2
    (d / "certificate.json").write_text(json.dumps(c))


def _no_cert(d: Path) -> None:
    (d / "certificate.json").unlink()


def _bad_batch(d: Path) -> None:
    c = yaml.safe_load((d / "best_config.yaml").read_text())
    c["config"]["batch_size"] = "large"
    (d / "best_config.yaml").write_text(yaml.safe_dump(c))


def _bn_model(d: Path) -> None:
    """A release whose model Opacus cannot train (BatchNorm, no fix_batchnorm): refused before the reserve."""
    c = yaml.safe_load((d / "best_config.yaml").read_text())
    c["config"]["model"] = "torchvision:resnet18"
    (d / "best_config.yaml").write_text(yaml.safe_dump(c))


def _corrupt_cfg(d: Path) -> None:
    (d / "best_config.yaml").write_text("config: {unclosed")


def _basis_cfg(d: Path) -> None:
    c = yaml.safe_load((d / "best_config.yaml").read_text())
    c["config"]["sampling_basis"] = 256.0
    (d / "best_config.yaml").write_text(yaml.safe_dump(c))


def _forged(d: Path) -> None:
    """Issue item 5: a cheaper event with a correctly recomputed ε (passes verify(), not the binding)."""
    from dptune.certificate import load_certificate

    c = json.loads((d / "certificate.json").read_text())
    c["events"][0]["event"]["mean"] = 1.0
    (d / "certificate.json").write_text(json.dumps(c))
    c["epsilon"] = load_certificate(d / "certificate.json", verify=False).compose_with("x", _noop()).epsilon
    (d / "certificate.json").write_text(json.dumps(c))


def _noop() -> Any:
    from dp_accounting import dp_event as de

    return de.NoOpDpEvent()


# (cli, argv builder, the field the message must name)
CASES: list[tuple[str, Callable[[dict[str, Path]], list[str]], str]] = [
    # plan
    ("plan", lambda w: ["--space", "no/such.yaml"], "--space"),
    ("plan", lambda w: ["--space", str(w["corrupt"])], "malformed YAML"),
    ("plan", lambda w: ["--space", str(w["wrong_type"])], "fixed.epochs"),
    ("plan", lambda w: ["--space", str(w["unknown"])], "colour"),
    ("plan", lambda w: [*GOOD_PLAN[:1], "0", *GOOD_PLAN[2:]], "--noise-multiplier"),
    ("plan", lambda w: [*GOOD_PLAN[:1], "-2", *GOOD_PLAN[2:]], "--noise-multiplier"),
    ("plan", lambda w: [*GOOD_PLAN[:3], "1.5", *GOOD_PLAN[4:]], "--sampling-rate"),
    ("plan", lambda w: [*GOOD_PLAN[:5], "0", *GOOD_PLAN[6:]], "--steps"),
    ("plan", lambda w: [*GOOD_PLAN[:7], "0", *GOOD_PLAN[8:]], "--delta"),
    ("plan", lambda w: [*GOOD_PLAN, "--mean", "0"], "--mean"),
    ("plan", lambda w: [*GOOD_PLAN, "--stopping", "tnb", "--eta", "-1"], "--eta"),
    ("plan", lambda w: [*GOOD_PLAN, "--stopping", "often"], "--stopping"),
    ("plan", lambda w: [*GOOD_PLAN, "--target-epsilon", "0"], "--target-epsilon"),
    ("plan", lambda w: [*GOOD_PLAN[:1], "abc", *GOOD_PLAN[2:]], "--noise-multiplier"),  # wrong type
    ("plan", lambda w: ["--space", str(w["bad_default"])], "default.batch_size"),
    ("plan", lambda w: ["--space", str(w["basis"])], "fixed.sampling_basis"),
    # search (all refused before Ray starts)
    ("search", lambda w: ["--space", "no/such.yaml"], "--space"),
    ("search", lambda w: ["--space", str(w["corrupt"])], "malformed YAML"),
    ("search", lambda w: ["--space", str(w["wrong_type"])], "fixed.epochs"),
    ("search", lambda w: ["--space", str(w["unknown"])], "colour"),
    ("search", lambda w: ["--space", str(SPACE), "--searcher", "tpe"], "privacy.stopping"),
    ("search", lambda w: ["--space", str(SPACE), "--accounting", "composed", "--trials", "0"], "--trials"),
    ("search", lambda w: ["--space", str(SPACE), "--epochs", "0"], "--epochs"),
    ("search", lambda w: ["--space", str(SPACE), "--budget-epsilon", "-1"], "--budget-epsilon"),
    ("search", lambda w: ["--space", str(SPACE), "--name", "../escape"], "--name"),
    ("search", lambda w: ["--space", str(SPACE), "--resume", "--name", "never-ran"], "--resume"),
    ("search", lambda w: ["--space", str(SPACE), "--name", "over"], "budget"),  # over budget: 2.9 + 2.9 > 4
    ("search", lambda w: ["--space", str(SPACE), "--cpus-per-trial", "0"], "--cpus-per-trial"),
    ("search", lambda w: ["--space", str(SPACE), "--gpus-per-trial", "a quarter"], "--gpus-per-trial"),
    ("search", lambda w: ["--space", str(SPACE), "--num-gpus", "0", "--gpus-per-trial", "0.25"],
     "--gpus-per-trial"),  # no GPU for the local Ray: refused before the charge (issue 44), not after Ray starts
    ("search", lambda w: ["--space", str(SPACE), "--num-gpus", "-1"], "--num-gpus"),
    ("search", lambda w: ["--space", str(SPACE), "--ledger", str(w["base"] / "fresh.sqlite"), "--budget-epsilon", "3",
                          "--budget-delta", "0.5"], "--budget-delta"),  # δ ≥ 1/n for a budget (issue 22 item 4)
    ("search", lambda w: ["--space", str(w["big_delta"])], "privacy.delta"),  # δ ≥ 1/n (issue item 12)
    ("search", lambda w: ["--space", str(w["bad_default"])], "default.batch_size"),  # not a choice (item 12)
    ("search", lambda w: ["--space", str(w["basis"])], "fixed.sampling_basis"),  # internal (issue item 3)
    ("search", lambda w: ["--space", str(w["seeded"])], "fixed.seed"),  # internal
    ("search", lambda w: ["--space", str(SPACE), "--address", "127.0.0.1:1", "--checkpoint-every", "1"],
     "--checkpoint-every"),  # node-local checkpoints on a cluster
    ("search", lambda w: ["--space", str(SPACE), "--address", "127.0.0.1:1", "--save-checkpoint"],
     "--save-checkpoint"),
    # models and tables refused once the data is read, before the ledger reserves
    ("search", lambda w: ["--space", str(w["bn_model"])], "model: bn1 is BatchNorm"),
    ("search", lambda w: ["--space", str(w["no_factory"])], "model.factory"),
    ("search", lambda w: ["--space", str(w["tbl_missing"])], "dataset.features.x"),  # a missing value
    ("search", lambda w: ["--space", str(w["tbl_no_label"])], "dataset.label"),  # no such label column
    ("search", lambda w: ["--space", str(w["tbl_text"])], "dataset.features.s"),  # not numeric
    ("search", lambda w: ["--space", str(w["tbl_no_column"])], "dataset.features.zz"),  # no such column
    # ledger
    ("ledger", lambda w: ["set-budget", "--fingerprint", "x", "--epsilon", "0", "--delta", "1e-5"], "--epsilon"),
    ("ledger", lambda w: ["set-budget", "--fingerprint", "x", "--epsilon", "1", "--delta", "2"], "--delta"),
    ("ledger", lambda w: ["set-budget", "--fingerprint", "x", "--epsilon", "nan?", "--delta", "1e-5"], "--epsilon"),
    ("ledger", lambda w: ["set-budget", "--dataset-id", "0" * 32, "--epsilon", "9", "--delta", "1e-6"],
     "--dataset-id"),  # names no budget: refused, no phantom budget (issue 22 item 23)
    # train
    ("train", lambda w: ["--release", str(w["base"] / "missing"), "--out", str(w["base"] / "o1")], "--release"),
    ("train", lambda w: _train(w, _release_variant(w, "nocert", _no_cert), "o2"), "certificate"),
    ("train", lambda w: _train(w, _release_variant(w, "tamper", _tamper), "o3"), "certificate.epsilon"),
    ("train", lambda w: _train(w, _release_variant(w, "batch", _bad_batch), "o4"), "best_config.config.batch_size"),
    ("train", lambda w: _train(w, _release_variant(w, "corrupt", _corrupt_cfg), "o5"), "best_config"),
    ("train", lambda w: _train(w, str(w["release"]), "o6", "--target-epsilon", "-1"), "--target-epsilon"),
    ("train", lambda w: _train(w, str(w["release"]), "o7", "--target-epsilon", "1"),
     "epsilon"),  # below what the search already cost
    ("train", lambda w: _train(w, str(w["release"]), "o8", "--epochs", "100"), "budget"),  # over the budget
    ("train", lambda w: _train(w, _release_variant(w, "basis", _basis_cfg), "o9"),
     "best_config.config.sampling_basis"),  # an internal field (issue item 3)
    ("train", lambda w: _train(w, _release_variant(w, "forged", _forged), "o10"),
     "certificate.binding"),  # a forged event with recomputed ε (issue item 5): the MAC covers ε too
    ("train", lambda w: _train(w, str(w["release"]), "o11", "--ledger", str(w["other_ledger"])),
     "--ledger"),  # a ledger that never saw the search (issue item 19)
    ("train", lambda w: ["--release", str(w["release"]), "--out", str(w["base"] / "o12"), "--run",
                         str(w["base"])], "--release"),  # no sealed record of the search
    ("train", lambda w: _train(w, _release_variant(w, "bn", _bn_model), "o13"),
     "best_config.yaml: is not the file"),  # an edited config: refused by the binding (issue 22 item 1)
    # report
    ("report", lambda w: [str(w["base"] / "no-run")], "run"),
    ("report", lambda w: [str(w["run"]), "--out", str(w["release"] / "report.html")], "--out"),  # item 20
    ("report", lambda w: [str(w["run"]), "--out", str(w["base"] / "report.html")], "--out"),  # outside sealed/
]


def _ledger_digest(path: Path) -> str:
    led = Ledger(path)
    rows = [(c.id, c.name, c.status, c.epsilon) for c in led.charges()]
    budgets = [(fp, led.budget(fp)) for fp in led.fingerprints()]
    return hashlib.sha256(repr((rows, budgets)).encode()).hexdigest()


@pytest.mark.parametrize("cli, argv, field", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_exits_2_and_charges_nothing(cli: str, argv: Callable[[dict[str, Path]], list[str]], field: str,
                                               world: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.chdir(ROOT)
    args = argv(world)
    if cli in ("search", "train", "ledger"):
        if cli == "ledger":
            args = [args[0], "--ledger", str(world["ledger"]), *args[1:]]
        elif "--ledger" not in args:
            args = [*args, "--ledger", str(world["ledger"])]
        if cli == "search":
            args += ["--runs-dir", str(world["base"] / "runs")]
    before = _ledger_digest(world["ledger"])
    main = importlib.import_module(f"dptune.cli.{cli}").main
    try:
        rc = main(args)
    except SystemExit as e:  # argparse rejects wrong types itself, with exit status 2
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "error: " in err and field in err, err
    assert _ledger_digest(world["ledger"]) == before
    assert not (world["base"] / "runs" / "over").exists()
