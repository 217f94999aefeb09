"""The sealed draw: K once from the configured distribution, i.i.d. configs over the whole declared range,
and 128-bit secrets (issue items 1 and 7)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import optuna.distributions as od
import pytest

from dptune import accounting as A
from dptune.config import load_space
from dptune.config.distributions import sample_params
from dptune.tuning.draw import TEST_HOOK, make_draw

SPACE = "search_spaces/digits.yaml"


def test_integer_log_uniform_reaches_every_value() -> None:
    """`int 1..16 log` used to draw only 1..10 while being charged at 16."""
    rng = np.random.default_rng(0)
    dist = od.IntDistribution(1, 16, log=True)
    counts = Counter(sample_params({"x": dist}, rng)["x"] for _ in range(20_000))
    assert set(counts) == set(range(1, 17))
    # log-uniform: P[v] = log((v+1)/v) / log(17)
    for v in (1, 8, 16):
        expected = math.log((v + 1) / v) / math.log(17)
        assert counts[v] / 20_000 == pytest.approx(expected, abs=0.015)


def test_trial_secrets_are_128_bit_and_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private draw takes every trial's entropy from the OS, 128 bits each (a 31-bit seed was enumerable)."""
    monkeypatch.delenv(TEST_HOOK, raising=False)
    space = load_space(SPACE)
    rule = A.stopping_rule("poisson", mean=40.0)
    draws = [make_draw(space, rule) for _ in range(5)]
    seeds = [t["seed"] for d in draws for t in d.trials]
    assert len(seeds) > 100 and len(set(seeds)) == len(seeds)
    assert max(s.bit_length() for s in seeds) == 128 and min(s.bit_length() for s in seeds) > 100
    assert all(d.draw_seed.bit_length() > 100 and not d.reproducible for d in draws)
    # the draw's derived secret streams are 128-bit too, and differ from each other
    d = draws[0]
    assert d.stream_seed("subsample") != d.stream_seed("searcher")
    assert min(d.stream_seed("subsample").bit_length(), d.stream_seed("searcher").bit_length()) > 100


def test_reproducible_draw_is_labelled_and_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    space = load_space(SPACE)
    rule = A.stopping_rule("poisson", mean=5.0)
    monkeypatch.setenv(TEST_HOOK, "3")
    a, b = make_draw(space, rule), make_draw(space, rule)
    assert a == b and a.reproducible
    assert all(t["seed"].bit_length() > 64 for t in a.trials)


def test_trial_config_keeps_a_128_bit_seed_exactly() -> None:
    """A float round trip would truncate the entropy (and once refused it as 'not an integer')."""
    from dptune.config import TrialConfig

    seed = 2**127 + 12345
    assert TrialConfig.from_dict({"seed": seed}).seed == seed


def _tpe_space() -> object:
    import yaml

    from dptune.config import parse_space

    raw = yaml.safe_load(Path(SPACE).read_text())
    raw["search"].update(searcher="tpe", accounting="composed")
    raw["privacy"].update(stopping="composed", mean=2)
    return parse_space(raw)


def _sampler_state(seed: int) -> tuple:
    from dptune.tuning.search_alg import search_alg

    space = _tpe_space()
    draw = make_draw(space, A.stopping_rule("composed", mean=2), seed=seed)  # type: ignore[arg-type]
    alg = search_alg(space, draw)  # type: ignore[arg-type]
    return draw, alg._sampler._rng.rng.get_state()


def test_tpe_sampler_is_seeded_by_its_own_full_128_bit_stream() -> None:
    """Issue 22 item 25: the TPE sampler's RandomState comes from the draw's own "sampler" stream, all 128 bits
    of it — not from the low 32 bits of the "searcher" stream that keys the adaptive trials' seeds."""
    from dptune.config.searchers import seed_words

    draw, state = _sampler_state(7)
    expected = np.random.RandomState(seed_words(draw.stream_seed("sampler"))).get_state()
    assert np.array_equal(state[1], expected[1])
    trial_key = np.random.RandomState(draw.stream_seed("searcher") % 2**32).get_state()
    assert not np.array_equal(state[1], trial_key[1])
    assert draw.stream_seed("sampler") != draw.stream_seed("searcher")
    # two 128-bit seeds that agree in their low 32 bits seed different samplers
    words = seed_words(2**100 + 5)
    assert not np.array_equal(np.random.RandomState(words).get_state()[1],
                              np.random.RandomState(seed_words(5)).get_state()[1])


def test_optuna_prints_nothing_once_a_tpe_searcher_is_built(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 9: Optuna's own log lines (trial numbers, values, wall-clock times) are silenced."""
    import optuna

    _sampler_state(7)
    capfd.readouterr()
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    study.tell(trial, 0.5)
    assert capfd.readouterr().err == ""
