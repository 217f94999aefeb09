"""Adaptive layerwise clipping (issue 24; van Dijk et al. 2023): per-layer clip norms from public data only, each
example clipped layer by layer, the charge of flat clipping at C."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from dptune.accounting import plan_search
from dptune.config import ConfigError, TrialConfig, load_space, parse_space
from dptune.dpsgd import make_engine, run_trial, validate_model
from dptune.dpsgd._alc import layer_of
from dptune.models import build_model

ROOT = Path(__file__).resolve().parent.parent


def _public_folder(root: Path, seed: int) -> dict[str, Any]:
    """A small public image folder (10 classes named 0-9, as digits' labels), written by the test."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", 6), ("test", 1)):
        for c in range(10):
            (root / split / str(c)).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / split / str(c) / f"{i}.png")
    return {"name": "imagefolder", "path": str(root), "validation_size": 2, "classes": [str(c) for c in range(10)]}


def _alc_space(public: dict[str, Any]) -> Any:
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["fixed"]["clipping"] = "alc"
    raw["alc"] = {"public": public, "quantile": 0.5, "examples": 64}
    return parse_space(raw)


def test_layer_norms_come_from_the_public_data_only(tmp_path: Path, digits: Any) -> None:
    from dptune.data import load_dataset
    from dptune.tuning.precharge import with_layer_clip

    space = _alc_space(_public_folder(tmp_path / "pub", seed=0))
    clip = with_layer_clip(space, digits).fixed.layer_clip
    model = build_model(space.fixed.replace(layer_clip=None, clipping="auto"), 10, (1, 8, 8))
    assert clip is not None and set(clip) == {layer_of(n) for n, _ in model.named_parameters()}  # every layer
    assert math.sqrt(sum(v * v for v in clip.values())) == pytest.approx(space.fixed.max_grad_norm, rel=1e-9)
    # other private data (another split, every pixel changed): the same norms
    other = load_dataset(dataclasses.replace(space.dataset, split_seed=7))
    other = dataclasses.replace(other, train=(other.train[0] * 0.5 + 0.1, other.train[1]))
    assert with_layer_clip(space, other).fixed.layer_clip == clip
    # other public data: other norms (the computation reads it)
    moved = with_layer_clip(_alc_space(_public_folder(tmp_path / "pub2", seed=1)), digits).fixed.layer_clip
    assert moved != clip


def test_each_layer_is_clipped_to_its_own_norm_by_hand() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    clip = {"1": 0.03, "3": 0.04}  # sqrt(0.0009 + 0.0016) = 0.05 = C
    cfg = TrialConfig(clipping="alc", layer_clip=clip, max_grad_norm=0.05, batch_size=4, physical_batch_size=8)
    x, y = torch.randn(5, 1, 1, 4) * 10, torch.tensor([0, 1, 0, 1, 1])
    engine = make_engine("alc", model, cfg, torch.Generator().manual_seed(0), noise_multiplier=0.0)
    engine.backward(x, y, 0, 5)
    engine.optimizer.pre_step()
    got = [p.summed_grad.clone() for p in engine.params]  # type: ignore[attr-defined]
    expected = [torch.zeros_like(p) for p in model.parameters()]
    clipped = 0
    for i in range(5):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        contribution = []
        for layer, idx in (("1", (0, 1)), ("3", (2, 3))):
            n = math.sqrt(sum(float((grads[j] ** 2).sum()) for j in idx))
            clipped += n > clip[layer]
            contribution += [grads[j] * min(1.0, clip[layer] / (n + 1e-6)) for j in idx]
        assert math.sqrt(sum(float((c ** 2).sum()) for c in contribution)) <= 0.05 * (1 + 1e-9)  # <= C
        expected = [e + c for e, c in zip(expected, contribution, strict=True)]
    assert clipped >= 5  # the clip is active in at least half the (example, layer) pairs
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True)) < 1e-6


def test_an_alc_trial_trains_and_measures_its_noise(tmp_path: Path, digits: Any) -> None:
    from dptune.tuning.precharge import with_layer_clip

    space = with_layer_clip(_alc_space(_public_folder(tmp_path / "pub", seed=0)), digits)
    cfg = space.default.replace(seed=4, score_noise=None, epochs=5.0, noise_multiplier=1.0)
    assert validate_model(cfg, digits.num_classes, digits.input_shape)[0] == "alc"
    r = run_trial(cfg, digits, evaluate_test=True)
    assert r.steps == r.noise_additions
    assert r.noise_std == pytest.approx(cfg.noise_multiplier * cfg.max_grad_norm, rel=0.02)
    assert r.test_accuracy is not None and r.test_accuracy > 0.5


def test_alc_is_charged_as_flat_clipping() -> None:
    alc, flat = load_space(ROOT / "search_spaces" / "mnist_alc.yaml"), load_space(ROOT / "search_spaces" / "mnist_scaled.yaml")
    assert alc.fixed.clipping == "alc" and flat.fixed.clipping == "auto"
    a, f = plan_search(alc, 8000, compare=False), plan_search(flat, 8000, compare=False)
    assert a.points == f.points and a.search_epsilon == f.search_epsilon


def test_alc_refusals(tmp_path: Path, digits: Any) -> None:
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["fixed"]["clipping"] = "alc"
    with pytest.raises(ConfigError, match="^alc: clipping alc sets each layer"):
        parse_space(raw)
    raw["alc"] = {"public": {"name": "digits"}}
    with pytest.raises(ConfigError, match="alc.public: is the private dataset itself"):
        parse_space(raw)
    raw["alc"] = {"public": {"name": "digits", "split": "nope"}}
    with pytest.raises(ConfigError, match="^alc.public.split"):
        parse_space(raw)
    raw["fixed"]["clipping"] = "auto"
    raw["alc"] = {"public": _public_folder(tmp_path / "pub", 0)}
    with pytest.raises(ConfigError, match="^alc: is set but no trial clips layerwise"):
        parse_space(raw)
    with pytest.raises(ConfigError, match="layer_clip: per-layer clip norms apply to clipping: alc only"):
        TrialConfig(layer_clip={"a": 1.0})
    with pytest.raises(ConfigError, match="clipping alc has no per-layer clip norms"):
        make_engine("alc", nn.Linear(2, 2), TrialConfig(clipping="alc"), torch.Generator())


def test_a_public_dataset_that_a_budget_covers_is_refused(tmp_path: Path, digits: Any) -> None:
    """The ledger knows digits' records (a budget is open on it): digits cannot be alc's public data elsewhere."""
    from dptune.ledger import Ledger, open_budget
    from dptune.tuning.precharge import check_public

    ledger = Ledger(tmp_path / "ledger.sqlite")
    open_budget(ledger, digits, 8.0, 1e-5, "digits")
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["dataset"] = _public_folder(tmp_path / "private", 3)  # the private data: another folder
    raw["fixed"]["clipping"] = "alc"
    raw["alc"] = {"public": {"name": "digits"}}
    space = parse_space(raw)
    with pytest.raises(ConfigError, match="alc.public: holds records of a budgeted dataset"):
        check_public(space, ledger)
    raw["alc"] = {"public": _public_folder(tmp_path / "pub", 0)}
    check_public(parse_space(raw), ledger)  # a folder no budget covers passes


@pytest.mark.integration  # make test-slow (CI runs it): a whole alc search, ~45 s
def test_an_alc_search_computes_its_norms_before_the_charge_and_releases_them(tmp_path: Path, digits: Any) -> None:
    """A real Ray search (CLI, 1 epoch): the per-layer norms it releases are those of its public data, the charge is
    flat clipping's plan, and the printed final-training command trains with them."""
    import json

    from dptune.ledger import Ledger
    from dptune.tuning.precharge import with_layer_clip
    from tests.conftest import free_port, isolated_env_for, run_cli

    public = _public_folder(tmp_path / "pub", seed=0)
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["fixed"]["clipping"] = "alc"
    raw["fixed"]["epochs"] = 1
    raw["alc"] = {"public": public, "quantile": 0.5, "examples": 64}
    raw["privacy"]["mean"] = 1
    space_file = tmp_path / "alc.yaml"
    space_file.write_text(yaml.safe_dump(raw))
    env = {**isolated_env_for(tmp_path), "RAY_ADDRESS": "local"}
    r = run_cli(["-m", "dptune.search", "--space", str(space_file), "--name", "alc", "--runs-dir",
                 str(tmp_path / "runs"), "--ledger", str(tmp_path / "ledger.sqlite"), "--budget-epsilon", "30",
                 "--num-cpus", "2", "--dashboard-port", str(free_port())], env)
    assert r.returncode == 0, r.stdout + r.stderr
    release = yaml.safe_load((tmp_path / "runs" / "alc" / "release" / "best_config.yaml").read_text())
    expected = with_layer_clip(parse_space(raw), digits).fixed.layer_clip
    assert release["config"]["clipping"] == "alc" and release["config"]["layer_clip"] == pytest.approx(expected)
    (charge,) = Ledger(tmp_path / "ledger.sqlite").charges()
    flat = parse_space({**raw, "fixed": {**raw["fixed"], "clipping": "auto"}, "alc": None})
    assert charge.epsilon == pytest.approx(plan_search(flat, len(digits.train[1])).search_epsilon, rel=1e-9)
    out = tmp_path / "final"
    t = run_cli(["-m", "dptune.train", "--release", str(tmp_path / "runs" / "alc" / "release"), "--out", str(out),
                 "--ledger", str(tmp_path / "ledger.sqlite"), "--epochs", "1"], env)
    assert t.returncode == 0, t.stdout + t.stderr
    import torch

    trained = torch.load(out / "model.pt", weights_only=True)["config"]
    assert trained["clipping"] == "alc" and trained["layer_clip"] == pytest.approx(expected)
    assert json.loads((out / "metrics.json").read_text())["steps"] >= 1
