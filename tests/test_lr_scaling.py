"""The searched learning rate scaled with batch size (``search.lr_reference_batch``, ``search.lr_batch_power``):
a search that plans its final run searches L, the final run's lr at the reference batch size, and a config of
batch size B trains its final run at L·(B/ref)^p and its trials at that lr times σ_f/σ_c. Computed here by hand;
the charge does not move (lr is not a privacy parameter), what the release and a resume key on does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from dptune import accounting as A
from dptune.config import ConfigError, parse_space
from dptune.release import release_document, released_params
from dptune.trials import TrialRow
from dptune.tuning.driver import run_spec

ROOT = Path(__file__).resolve().parent.parent
N_TRAIN, N_VAL = 1257, 180


def _digits(**search: object) -> dict[str, object]:
    """digits' random-search space planning its final run (B 256 or 512), with ``search`` settings added."""
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["space"].pop("noise_multiplier")
    raw["default"].pop("noise_multiplier")
    raw["privacy"]["search_share"] = 0.3
    raw["search"].update(search)
    return raw


@pytest.mark.parametrize("power", [1.0, 0.5])
def test_the_final_and_trial_lr_scale_with_batch_size_by_hand(power: float) -> None:
    space = parse_space(_digits(lr_reference_batch=256, lr_batch_power=power))
    plain = parse_space(_digits())
    plan = A.plan_search(space, N_TRAIN, compare=False)
    tp = A.plan_transfer(space, plan, final_n=N_TRAIN + N_VAL)
    # the lr does not enter the charge: the same trial points, σ_c and σ_f as without the scaling
    assert plan.search_epsilon == A.plan_search(plain, N_TRAIN, compare=False).search_epsilon
    assert tp.sigmas == A.plan_transfer(plain, plan, final_n=N_TRAIN + N_VAL).sigmas
    for b, e, sc, sf in tp.sigmas:
        lr = 0.9 * (b / 256) ** power  # the final run's lr of searched L = 0.9 at batch size b
        cfg = space.fixed.replace(batch_size=b, epochs=e, learning_rate=0.9)
        assert tp.final_config(cfg).learning_rate == pytest.approx(lr, rel=1e-12)
        assert tp.final_config(cfg).noise_multiplier == sf
        t = tp.trial_config(cfg)
        assert t.noise_multiplier == sc and t.learning_rate == pytest.approx(lr * sf / sc, rel=1e-12)
        # the release: the final run's config (its lr and σ_f), and the rule lr·σ_f that dptune train applies
        row = TrialRow(index=0, params={"learning_rate": 0.9, "batch_size": b, "groups": 4}, seed="", score=0.5,
                       val_accuracy_raw=0.5)
        params, _ = released_params(space, row, N_TRAIN, transfer=tp)
        assert params["learning_rate"] == pytest.approx(lr, rel=1e-12) and params["noise_multiplier"] == sf
        doc = release_document(space, params, 0.5, transfer=tp)
        assert doc["scaling_rule"]["lr_times_sigma"] == pytest.approx(lr * sf, rel=1e-12)
        assert doc["config"]["learning_rate"] == pytest.approx(lr, rel=1e-12)
    assert 512 in {b for b, *_ in tp.sigmas}  # a batch size off the reference: the scaling was exercised
    # K = 0 releases the default (B 256, the reference: its lr as written)
    params, _ = released_params(space, None, N_TRAIN, transfer=tp)
    assert params["learning_rate"] == space.default.learning_rate


@pytest.mark.parametrize(("search", "field"), [
    ({"lr_batch_power": 1.0}, "search.lr_batch_power"),  # a power without a reference batch
    ({"lr_reference_batch": 256, "lr_batch_power": 3}, "search.lr_batch_power"),
    ({"lr_reference_batch": 256, "lr_batch_power": 0}, "search.lr_batch_power"),
    ({"lr_reference_batch": 256, "lr_batch_power": "half"}, "search.lr_batch_power"),
    ({"lr_reference_batch": 256, "lr_batch_power": True}, "search.lr_batch_power"),  # YAML true is not a power
    ({"lr_reference_batch": 0}, "search.lr_reference_batch"),
    ({"lr_reference_batch": "big"}, "search.lr_reference_batch"),
])
def test_a_bad_lr_scaling_names_the_field(search: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_space(_digits(**search))
    assert e.value.field == field and e.value.fix


def test_only_a_search_that_plans_its_final_run_scales_its_lr() -> None:
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["search"]["lr_reference_batch"] = 256
    with pytest.raises(ConfigError) as e:
        parse_space(raw)
    assert e.value.field == "search.lr_reference_batch" and "search_share" in e.value.fix


def test_the_scaling_is_part_of_what_a_rehearsal_and_a_resume_match() -> None:
    """Another scaling is another search: its rehearsal key and its sealed run spec differ (a rehearsal of the
    plain search does not judge it, and a sealed plain search does not resume as it); a space without the
    setting keeps the key and spec it had before the setting existed (the shipped MNIST keys: test_transfer)."""
    plain, linear, root = (parse_space(_digits()), parse_space(_digits(lr_reference_batch=256)),
                           parse_space(_digits(lr_reference_batch=256, lr_batch_power=0.5)))
    keys = {A.rehearsal_key(s) for s in (plain, linear, root)}
    assert len(keys) == 3
    specs = [run_spec(s) for s in (plain, linear, root)]
    assert "lr_reference_batch" not in specs[0] and specs[1] != specs[2]
    assert specs[1]["lr_reference_batch"] == 256 and math.isclose(specs[2]["lr_batch_power"], 0.5)
