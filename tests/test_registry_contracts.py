"""Contract tests: every registered stopping rule and clipping mode passes them, built-in or added (they iterate the
registries, never a copied list), and each registry refuses at registration what it can check — before a space is
read, so never after a charge (issue 41, item 2)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from dp_accounting import dp_event as de
from torch import nn

import dptune.accounting as A
from dptune.accounting._catalogue import rule_of_search_event
from dptune.certificate import Certificate
from dptune.config import ConfigError, TrialConfig, clipping, stopping
from dptune.dpsgd import ENGINES, Engine, engine_mode, make_engine, validate_model
from dptune.dpsgd._alc import layer_of
from dptune.dpsgd._engines import VmapEngine, engine
from dptune.models import build_model
from tests.toy_rules import Rounds, registered

ROOT = Path(__file__).resolve().parent.parent
RULES = [rule for cls in A.STOPPING_RULES.values() for mean in (1.0, 2.6, 7.0) for rule in cls.variants(mean)]
TRIAL = A.trial_event(noise_multiplier=1.1, sampling_rate=0.05, steps=200, score_noise=6.0)

# --- stopping rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.label())
def test_every_rule_keeps_its_contract(rule: A.StoppingRule) -> None:
    """Its charge on curves is its event's; its event reads back as itself and no other rule; its settings rebuild
    it; its description is one a certificate accepts (no drawn K); the accounting it implies is its kind's."""
    cls = type(rule)
    assert A.STOPPING_RULES[rule.name] is cls and stopping.rule_info(rule.name).settings == cls.setting_names()
    assert rule.search_rdp(A.rdp_of(TRIAL)) == pytest.approx(A.rdp_of(rule.search_event(TRIAL)), rel=1e-12)
    assert rule_of_search_event(rule.search_event(TRIAL)) == (TRIAL, rule)
    assert cls.from_settings({n: getattr(rule, n) for n in cls.setting_names()}) == rule
    assert cls.setting_names()[0] == "mean" and not any(stopping.reveals_k(s) for s in cls.setting_names())
    described = rule.describe()
    assert described["rule"] == rule.name and not any(stopping.reveals_k(k) for k in described)
    cert = Certificate.build("ds-test", 1e-5, [("search", rule.search_event(TRIAL))], described)
    assert cert.epsilon == pytest.approx(A.epsilon([rule.search_event(TRIAL)], 1e-5), rel=1e-9)
    assert stopping.accounting_of(rule.name) == (cls.accounting or ("random_stopping" if cls.random_stopping
                                                                    else "composed"))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.label())
def test_every_rule_draws_k_with_its_mean(rule: A.StoppingRule) -> None:
    """E[K] = mean for a random rule (the theorem's E[K]); exactly mean trials for a composed one."""
    rng = np.random.default_rng(2)
    ks = np.array([rule.draw_k(rng) for _ in range(8000)])
    assert ks.min() >= 0 and np.issubdtype(ks.dtype, np.integer)
    if rule.random_stopping:
        assert ks.mean() == pytest.approx(rule.mean, rel=0.05)
    elif type(rule).accounting == "filter":  # not trials: the configurations drawn, a fixed cap the filter spends
        assert len(set(ks)) == 1 and ks[0] >= rule.mean
    else:
        assert set(ks) == {int(rule.mean)}


def test_every_rule_is_in_the_key_reference() -> None:
    page = (ROOT / "docs" / "spaces.md").read_text()
    for name in A.STOPPING_RULES:
        assert f"| `{name}` |" in page, name


def _revealing(setting: str) -> type[A.StoppingRule]:
    """A rule whose own setting is called ``setting``, otherwise sound (its own search event)."""
    cls = dataclasses.make_dataclass(f"Revealing_{setting}", [(setting, float, dataclasses.field(default=1.0))],
                                     bases=(Rounds,), frozen=True, kw_only=True,
                                     namespace={"name": f"revealing_{setting.lower()}"})
    cls.__annotations__["name"] = ClassVar[str]
    return cls


@pytest.mark.parametrize("setting", ["k", "K", "trials_run"])
def test_a_rule_whose_setting_reads_as_the_drawn_k_is_refused_at_registration(setting: str) -> None:
    """A rule with a setting named k once charged ε 1.5691, ran its trials and was only then refused by the
    certificate (its description carries its settings): nothing released, the charge left reserved."""
    cls = _revealing(setting)
    with registered(cls.name):
        with pytest.raises(ValueError, match=f"setting '{setting}' would read as the drawn number of trials"):
            A.register_rule(cls)
        assert cls.name not in A.STOPPING_RULES and cls.name not in stopping.choices()


def test_a_rule_with_its_own_setting_named_k_is_refused_at_registration() -> None:
    cls = _revealing("k")
    with registered(cls.name):
        with pytest.raises(ValueError, match="would read as the drawn number of trials"):
            A.register_rule(cls)
        assert cls.name not in A.STOPPING_RULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Borrowed(A.Poisson):
    """K ~ Poisson(mean), a setting of its own, but Poisson's search event (so a stored charge names two rules)."""

    name: ClassVar[str] = "borrowed"
    weight: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Lossy(Rounds):
    """Its event forgets the rule (reads back as one round whatever ``rounds``)."""

    name: ClassVar[str] = "lossy"

    @classmethod
    def variants(cls, mean: float) -> tuple[A.StoppingRule, ...]:
        return (cls(mean=mean, rounds=2.0),)

    def search_event(self, trial_event: de.DpEvent) -> de.DpEvent:
        return de.ComposedDpEvent([de.RepeatAndSelectDpEvent(trial_event, float(self.mean), math.inf)])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Shadowing(Rounds):
    """Its settings include a privacy key of its own (privacy.delta would be ambiguous)."""

    name: ClassVar[str] = "shadowing"
    delta: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Telling(Rounds):
    """A sound rule whose description tells the number of trials drawn."""

    name: ClassVar[str] = "telling"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "num_trials_drawn": 3}


@pytest.mark.parametrize("cls, match", [
    (_Borrowed, "reads as a 'poisson' search too"), (_Lossy, "does not read back"),
    (_Shadowing, "'delta' is a privacy key"), (_Telling, r"describe\(\)"), (A.Poisson, "registered twice"),
    (A.StoppingRule, "not a concrete StoppingRule"),
])
def test_what_a_rule_registry_can_check_is_checked_at_registration(cls: type[A.StoppingRule], match: str) -> None:
    before = (dict(A.STOPPING_RULES), stopping.choices())
    with registered(*({getattr(cls, "name", "")} - set(before[0]))):
        with pytest.raises(ValueError, match=match):
            A.register_rule(cls)
        assert (dict(A.STOPPING_RULES), stopping.choices()) == before  # nothing half-registered


def test_a_sound_rule_with_its_own_setting_registers_and_keeps_the_contract() -> None:
    with registered(Rounds.name):
        assert A.register_rule(Rounds) is Rounds
        for rule in (Rounds(mean=3.0), Rounds(mean=2.0, rounds=3.0)):
            test_every_rule_keeps_its_contract(rule)
        assert A.comparison_rules(3.0)[-1] == Rounds(mean=3.0)  # priced beside the others, nothing else edited
    assert Rounds.name not in A.STOPPING_RULES


# --- clipping modes ----------------------------------------------------------------------------------

SHAPE, CLASSES = (1, 8, 8), 10


def _config(name: str) -> TrialConfig:
    cfg = TrialConfig(model="gn_cnn", clipping=name, batch_size=16, physical_batch_size=32)
    if clipping.mode(name).layerwise:  # per-layer norms for the model at hand, sqrt(sum C_l^2) = C
        layers = {layer_of(n) for n, _ in build_model(cfg.replace(clipping="auto"), CLASSES, SHAPE).named_parameters()}
        cfg = cfg.replace(layer_clip={k: cfg.max_grad_norm / math.sqrt(len(layers)) for k in layers})
    return cfg


@pytest.mark.parametrize("name", list(clipping.MODES))
def test_every_mode_has_an_engine_that_the_guard_proves_on_the_default_model(name: str) -> None:
    """Its engine implements Engine and is built for it; the clipping guard measures it on the embedded default
    model (one example moves the clipped sum by at most the mode's sensitivity·C) and keeps it."""
    cls = ENGINES[name]
    assert issubclass(cls, Engine) and cls.backward is not Engine.backward and cls.mode == name
    cfg = _config(name)
    model = build_model(cfg.replace(clipping="auto", layer_clip=None), CLASSES, SHAPE)
    assert engine_mode(make_engine(name, model, cfg, torch.Generator())) == name
    assert validate_model(cfg, CLASSES, SHAPE) == (name, None)


def test_every_mode_is_documented() -> None:
    page = (ROOT / "docs" / "clipping.md").read_text()
    for name in clipping.choices():
        assert f"| `{name}` |" in page, f"docs/clipping.md has no row for clipping mode {name!r}"


class _NoBackward(Engine):
    pass


class _NotAnEngine:
    def backward(self) -> None: ...


@pytest.mark.parametrize("cls, error, match", [
    (_NoBackward, TypeError, "does not implement Engine.backward"),
    (_NotAnEngine, TypeError, "must subclass dptune.dpsgd.Engine"),
])
def test_an_engine_that_does_not_implement_engine_is_refused_at_registration(cls: Any, error: type[Exception],
                                                                            match: str) -> None:
    clipping.register(clipping.ClippingMode("probe_mode", "a test mode"))
    try:
        with pytest.raises(error, match=match):
            engine("probe_mode")(cls)
        assert "probe_mode" not in ENGINES
    finally:
        del clipping.MODES["probe_mode"]
        ENGINES.pop("probe_mode", None)


def test_an_engine_for_no_mode_or_a_taken_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown clipping mode 'nope'"):
        engine("nope")(VmapEngine)
    with pytest.raises(ValueError, match="has two engines"):
        engine("functorch")(type("Again", (VmapEngine,), {}))
    with pytest.raises(ValueError, match="has two engines"):
        engine("auto")(type("Auto", (VmapEngine,), {}))
    assert set(ENGINES) == set(clipping.MODES)


def test_a_new_mode_is_one_registration_and_one_engine_class() -> None:
    """The docs' recipe (docs/adding-a-clipping-mode.md), end to end: the new mode passes the contract."""
    clipping.register(clipping.ClippingMode("exact_again", "whole-model vmap under another name"))

    @engine("exact_again")
    class ExactAgain(VmapEngine):
        pass

    try:
        test_every_mode_has_an_engine_that_the_guard_proves_on_the_default_model("exact_again")
        assert isinstance(make_engine("exact_again", nn.Linear(2, 2), _config("exact_again"), torch.Generator()),
                          ExactAgain)
    finally:
        del clipping.MODES["exact_again"], ENGINES["exact_again"]


@pytest.mark.parametrize("space_file", sorted((ROOT / "search_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_spaces_leave_the_accounting_to_the_stopping_rule(space_file: Path) -> None:
    """``search.accounting`` follows from the rule (``stopping.accounting_of``): a shipped space does not repeat it."""
    import yaml

    raw = yaml.safe_load(space_file.read_text())
    assert "accounting" not in (raw.get("search") or {}), f"{space_file.name}: drop search.accounting"
