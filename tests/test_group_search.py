"""A grouped search (``--group-trials``) against the same search one trial at a time: real local Ray (2 CPUs,
loopback), real trials on digits, the same NOT PRIVATE draw seed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dptune.config import TrialConfig
from dptune.tuning.grouping import plan_groups
from tests.conftest import ROOT, digits_seed_with_k, free_port, run_cli


def _space(tmp_path: Path) -> Path:
    """The digits space with the MLP under whole-model vmap: its grouped trials equal its lone trials bitwise."""
    space = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    space["model"] = {"name": "mlp"}
    space["fixed"]["clipping"] = "functorch"
    path = tmp_path / "digits_mlp.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


def _search(tmp_path: Path, env: dict[str, str], name: str, seed: int, *extra: str) -> tuple[str, Path]:
    r = run_cli(["-m", "dptune.search", "--space", str(_space(tmp_path)), "--name", name, "--runs-dir",
                 str(tmp_path / "runs"), "--ledger", str(tmp_path / f"{name}.sqlite"), "--budget-epsilon", "30",
                 "--num-cpus", "2", "--dashboard-port", str(free_port()), "--smoke-test", "--seed", str(seed),
                 *extra], env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, tmp_path / "runs" / name


def _rows(run: Path) -> list[dict[str, Any]]:
    keep = ("index", "params", "seed", "score", "val_accuracy_raw", "diverged", "crashed", "steps", "sampling_rate",
            "noise_multiplier")
    rows = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    out = []
    for r in sorted(rows, key=lambda r: r["index"]):
        measured = {k: v for k, v in json.loads(r["measured"]).items() if k != "device"}
        out.append({**{k: r[k] for k in keep}, "measured": measured})
    return out


def _transcript(text: str, name: str, tmp_path: Path) -> str:
    """What differs between two runs whatever they do: the folder, the run's name, a budget's random id, the port."""
    text = text.replace(str(tmp_path), "<tmp>").replace(name, "<name>")
    text = re.sub(r"\(id [0-9a-f]{16,}\)", "(id <random>)", text)
    return re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", text)


@pytest.mark.integration  # two whole searches through Ray (make test-slow; CI runs it)
def test_grouped_search_equals_one_at_a_time(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """Same draw: every sealed row (score, raw accuracy, steps, measured noise and batches), the released config,
    the certificate's charge, and the terminal transcript are those of the one-at-a-time search."""
    seed = digits_seed_with_k(3, 5)
    out_a, run_a = _search(tmp_path, isolated_env, "alone", seed)
    out_b, run_b = _search(tmp_path, isolated_env, "grouped", seed, "--group-trials")
    assert _rows(run_a) == _rows(run_b)
    assert (run_a / "release" / "best_config.yaml").read_text() == (run_b / "release" / "best_config.yaml").read_text()
    cert_a, cert_b = (json.loads((r / "release" / "certificate.json").read_text()) for r in (run_a, run_b))
    assert (cert_a["epsilon"], cert_a["delta"], cert_a["events"]) == (cert_b["epsilon"], cert_b["delta"],
                                                                        cert_b["events"])
    assert _transcript(out_a, "alone", tmp_path) == _transcript(out_b, "grouped", tmp_path)


def test_groups_are_one_architecture_balanced_over_the_slots() -> None:
    """A function of the configs and the slots: one architecture per group, each over at most ``slots`` groups,
    every trial exactly once, the longest trials spread first."""
    base = TrialConfig(model="mlp", batch_size=64, epochs=1.0)
    configs = [base, base.replace(epochs=4.0), base.replace(groups=2), base.replace(epochs=2.0),
               base.replace(epochs=3.0), base.replace(groups=2, epochs=2.0)]
    groups = plan_groups(configs, slots=2, basis=1000.0)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert sorted(groups) == [[0, 1], [2], [3, 4], [5]]  # loads 4+1, 3+2 (T ∝ epochs); groups=2 apart
    assert plan_groups(configs, slots=1, basis=1000.0) == [[0, 1, 3, 4], [2, 5]]
    assert plan_groups(configs[:1], slots=4, basis=1000.0) == [[0]]
