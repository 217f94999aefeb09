"""One registry per clipping mode (issue 26): what a mode is and costs (``dptune.config.clipping``, config layer) and its
engine (``dpsgd`` ``@engine``); every list of names and every capability question reads them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from dptune.accounting import plan_search
from dptune.config import CLIPPING_MODES, ConfigError, TrialConfig, clipping, parse_space
from dptune.dpsgd import ENGINES, Engine, engine_mode, make_engine
from dptune.dpsgd._engines import VmapEngine, engine

ROOT = Path(__file__).resolve().parent.parent


def test_the_two_registries_agree_and_every_list_comes_from_them() -> None:
    assert set(ENGINES) == set(clipping.MODES)
    assert ("auto", *clipping.MODES) == CLIPPING_MODES
    with pytest.raises(ConfigError, match="use one of: auto, " + ", ".join(clipping.MODES)):
        TrialConfig(clipping="nope")
    for name in clipping.MODES:
        cfg = TrialConfig(clipping=name, layer_clip={"1": 1.0} if clipping.mode(name).layerwise else None)
        model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
        assert engine_mode(make_engine(name, model, cfg, torch.Generator())) == name


@pytest.fixture
def triple() -> Iterator[str]:
    """A new mode, registered the way the module docstring says (one ClippingMode line, one engine class), and
    removed afterwards: per-example clipping charged as if one example moved the sum by 3C."""
    clipping.register(clipping.ClippingMode("triple", "a test mode charged at 3C", sensitivity=3.0))

    @engine("triple")
    class TripleEngine(VmapEngine):
        pass

    try:
        yield "triple"
    finally:
        del clipping.MODES["triple"], ENGINES["triple"]


def test_a_new_mode_is_one_registration_and_one_engine(triple: str) -> None:
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["fixed"]["clipping"] = triple
    space = parse_space(raw)  # accepted by the schema: the registry's names
    plan = plan_search(space, 1257, compare=False)
    assert {p.noise_multiplier for p in plan.points} == {5.0 / 3}  # charged at its sensitivity, nothing else edited
    e = make_engine(triple, nn.Linear(2, 2), space.fixed, torch.Generator())
    assert isinstance(e, Engine) and engine_mode(e) == triple
    with pytest.raises(ValueError, match="registered twice"):
        clipping.register(clipping.ClippingMode(triple, "again"))
