"""A new searcher is one module plus one registration (issue 21): registered at run time, it is a valid
``search.searcher`` for the schema, the space checks (rule 7 from its own class attributes), the sealed draw and the
CLI's ``--searcher`` choices, with no other list of names to edit."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import optuna.distributions as od
import pytest
import yaml

from dptune import accounting as A
from dptune.config import ConfigError, SearchSpace, parse_space
from dptune.config.searchers import SEARCHERS, Searcher, register
from dptune.tuning.draw import make_draw

SPACE = Path(__file__).resolve().parents[1] / "search_spaces" / "digits.yaml"


class MidpointSearcher(Searcher):
    """Every trial at the middle of each range (geometric on a log range), the first of each categorical."""

    name: ClassVar[str] = "midpoint_plugin_test"
    summary: ClassVar[str] = "a test searcher: the middle of every range"

    def sample(self, space: SearchSpace, rng: np.random.Generator) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, d in space.space.items():
            if isinstance(d, od.CategoricalDistribution):
                out[k] = d.choices[0]
            elif isinstance(d, od.FloatDistribution):
                out[k] = math.sqrt(d.low * d.high) if d.log else (d.low + d.high) / 2
            else:
                raise AssertionError(f"{k}: {d}")
        return out


class AdaptivePluginSearcher(MidpointSearcher):
    name: ClassVar[str] = "adaptive_plugin_test"
    adaptive: ClassVar[bool] = True
    accounting: ClassVar[tuple[str, ...]] = ("composed",)


@pytest.fixture
def plugins() -> Iterator[None]:
    added = [register(MidpointSearcher()), register(AdaptivePluginSearcher())]
    try:
        yield
    finally:
        for s in added:
            SEARCHERS.pop(s.name)


def _space(searcher: str, **privacy: Any) -> SearchSpace:
    raw = yaml.safe_load(SPACE.read_text())
    raw["search"]["searcher"] = searcher
    if privacy:
        raw["privacy"].update(privacy)
        raw["search"]["accounting"] = "composed"
    return parse_space(raw)


def test_a_registered_searcher_is_a_valid_name_and_fills_the_sealed_draw(plugins: None) -> None:
    space = _space("midpoint_plugin_test")
    draw = make_draw(space, A.stopping_rule("poisson", mean=6.0), seed=3)
    assert draw.k > 0
    for t in draw.trials:
        assert t["params"]["learning_rate"] == pytest.approx(math.sqrt(0.5 * 1.2))
        assert t["params"]["noise_multiplier"] == pytest.approx(6.25)
        assert t["params"]["batch_size"] == 256 and t["params"]["groups"] == 4


def test_the_cli_offers_a_registered_searcher(plugins: None) -> None:
    from dptune.cli.search import _parser

    args = _parser().parse_args(["--space", str(SPACE), "--searcher", "midpoint_plugin_test"])
    assert args.searcher == "midpoint_plugin_test"


def test_rule_7_comes_from_the_plugins_own_attributes(plugins: None) -> None:
    with pytest.raises(ConfigError) as e:
        _space("adaptive_plugin_test")  # digits.yaml: random stopping
    assert e.value.field == "privacy.stopping" and "adaptive" in str(e.value)
    assert _space("adaptive_plugin_test", stopping="composed", mean=3).searcher == "adaptive_plugin_test"


def test_an_unregistered_name_is_refused_naming_the_registered_ones(plugins: None) -> None:
    with pytest.raises(ConfigError) as e:
        _space("nonexistent")
    assert e.value.field == "search.searcher"
    assert "midpoint_plugin_test" in str(e.value) and "random" in str(e.value)
    SEARCHERS.pop("midpoint_plugin_test")
    with pytest.raises(ConfigError):
        _space("midpoint_plugin_test")
    register(MidpointSearcher())  # the fixture removes it again


def test_registration_checks_the_attributes_rule_7_reads_against_the_hooks() -> None:
    class Sneaky(MidpointSearcher):  # chooses from earlier scores but says it is not adaptive
        name: ClassVar[str] = "sneaky_plugin_test"

        def sampler(self, space: SearchSpace, seed: int) -> Any:
            import optuna

            return optuna.samplers.TPESampler(seed=seed)

    class FixedUnderStopping(MidpointSearcher):
        name: ClassVar[str] = "fixed_plugin_test"
        fixed_candidates: ClassVar[bool] = True

    class AdaptiveUnderStopping(MidpointSearcher):
        name: ClassVar[str] = "adaptive_stopping_plugin_test"
        adaptive: ClassVar[bool] = True

    for cls, words in ((Sneaky, "adaptive = True"), (FixedUnderStopping, "accounting = ('composed',)"),
                       (AdaptiveUnderStopping, "random stopping does not cover it")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            register(cls())
        assert cls.name not in SEARCHERS
    with pytest.raises(ValueError, match="registered twice"):
        register(SEARCHERS["random"].__class__())
