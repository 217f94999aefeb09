from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dp_accounting import dp_event as de

from dptune import accounting as A
from dptune.certificate import Certificate, CertificateError, load_certificate

FP = "a" * 64


def _cert() -> Certificate:
    search = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=1.2, sampling_rate=0.1, steps=150, score_noise=6.0), 3.0, math.inf)
    return Certificate.build(FP, 1e-5, [("search", search)], A.stopping_rule("poisson", mean=3.0).describe())


def test_round_trip_and_verify(tmp_path: Path) -> None:
    cert = _cert()
    cert.save(tmp_path / "c.json")
    back = load_certificate(tmp_path / "c.json")
    assert back.epsilon == pytest.approx(cert.epsilon)
    data = json.loads((tmp_path / "c.json").read_text())
    assert {"opacus", "dp-accounting", "dptune"} <= set(data["versions"])
    assert data["stopping"]["rule"] == "poisson" and "k" not in json.dumps(data["stopping"]).lower().split('"')


def test_tampered_epsilon_fails(tmp_path: Path) -> None:
    _cert().save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    data["epsilon"] = data["epsilon"] / 2
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(CertificateError, match="certificate.epsilon"):
        load_certificate(tmp_path / "c.json")


def test_tampered_event_fails(tmp_path: Path) -> None:
    _cert().save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    data["events"][0]["event"]["mean"] = 1.0  # claims fewer trials than were charged
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(CertificateError):
        load_certificate(tmp_path / "c.json")


def test_composition_with_final_training_is_below_the_sum() -> None:
    cert = _cert()
    final = A.trial_event(noise_multiplier=1.0, sampling_rate=0.1, steps=150, score_noise=None)
    total = cert.compose_with("final_training", final)
    assert total.epsilon < cert.epsilon + A.epsilon([final], 1e-5)
    assert total.epsilon > max(cert.epsilon, A.epsilon([final], 1e-5))


def test_certificate_refuses_k() -> None:
    with pytest.raises(ValueError, match="number of trials"):
        Certificate.build(FP, 1e-5, [], {"rule": "poisson", "K": 3})


def test_missing_and_corrupt(tmp_path: Path) -> None:
    with pytest.raises(CertificateError):
        load_certificate(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CertificateError):
        load_certificate(tmp_path / "bad.json")
