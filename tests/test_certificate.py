from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dp_accounting import dp_event as de

from dptune import accounting as A
from dptune.certificate import Certificate, CertificateError, load_certificate, verify_binding
from dptune.ledger import Ledger

FP = "a" * 64
DATASET_ID = "0123456789abcdef0123456789abcdef"


def _cert() -> Certificate:
    search = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=1.2, sampling_rate=0.1, steps=150,
                                                     score_noise=6.0), 3.0, math.inf)
    return Certificate.build(DATASET_ID, 1e-5, [("search", search)], A.stopping_rule("poisson", mean=3.0).describe())


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
        Certificate.build(DATASET_ID, 1e-5, [], {"rule": "poisson", "K": 3})


def test_missing_and_corrupt(tmp_path: Path) -> None:
    with pytest.raises(CertificateError):
        load_certificate(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CertificateError):
        load_certificate(tmp_path / "bad.json")


def _bound(tmp_path: Path, sigma: float = 1.2) -> tuple[Certificate, Ledger]:
    """A search certificate bound to a real ledger charge of its event."""
    ledger = Ledger(tmp_path / "l.sqlite")
    if ledger.budget(FP) is None:
        ledger.set_budget(FP, 100.0, 1e-5)
    search = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=sigma, sampling_rate=0.1, steps=150, score_noise=6.0), 3.0, math.inf)
    charge = ledger.charge(ledger.reserve(FP, f"s{sigma}", search))
    cert = Certificate.build(ledger.dataset_id(FP), 1e-5, [("search", search)], {"rule": "poisson", "mean": 3.0})
    return cert.bind(ledger, [charge.token]), ledger


def test_binding_accepts_the_ledgers_own_certificate(tmp_path: Path) -> None:
    cert, ledger = _bound(tmp_path)
    cert.save(tmp_path / "c.json")
    [charge] = verify_binding(load_certificate(tmp_path / "c.json"), ledger)
    assert charge.name == "s1.2"
    data = json.loads((tmp_path / "c.json").read_text())
    # nothing computed from the data, no row id: a random dataset id and a random charge token
    assert data["dataset_id"] == ledger.dataset_id(FP) != FP and len(data["dataset_id"]) == 32
    assert FP not in (tmp_path / "c.json").read_text()
    assert data["binding"]["charges"][0]["token"] == charge.token and "id" not in data["binding"]["charges"][0]


def test_forged_event_with_recomputed_epsilon_is_refused(tmp_path: Path) -> None:
    """Issue item 5: edit the event to a cheaper one and recompute ε — verify() passes, the binding fails."""
    cert, ledger = _bound(tmp_path)
    cheaper = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=5.0, sampling_rate=0.1, steps=150, score_noise=6.0), 3.0, math.inf)
    forged = Certificate.build(cert.dataset_id, cert.delta, [("search", cheaper)], cert.stopping)
    forged = Certificate(forged.dataset_id, forged.delta, forged.events, forged.epsilon, forged.stopping,
                         binding=cert.binding, bound=forged.bound)
    forged.verify()  # internally consistent
    assert forged.epsilon < cert.epsilon
    with pytest.raises(CertificateError, match="certificate.binding"):  # the MAC covers ε (and every field)
        verify_binding(forged, ledger)


def test_borrowed_or_unkeyed_certificates_are_refused(tmp_path: Path) -> None:
    cert, ledger = _bound(tmp_path)
    other, _ = _bound(tmp_path, sigma=3.0)  # a cheaper search on the same ledger
    # another search's binding pasted onto this certificate
    pasted = Certificate(cert.dataset_id, cert.delta, cert.events, cert.epsilon, cert.stopping,
                         binding=other.binding)
    with pytest.raises(CertificateError):
        verify_binding(pasted, ledger)
    # a binding made with another curator key
    stranger = Ledger(tmp_path / "stranger" / "l.sqlite")
    with pytest.raises(CertificateError, match="not authenticated"):
        verify_binding(cert, stranger)
    with pytest.raises(CertificateError, match="certificate.binding"):
        verify_binding(Certificate(cert.dataset_id, cert.delta, cert.events, cert.epsilon, cert.stopping), ledger)


def test_guarantee_says_what_is_covered(tmp_path: Path) -> None:
    """Issue item 9: neighbouring relation, test accuracy not covered, reproducibility recorded."""
    _cert().save(tmp_path / "c.json")
    g = json.loads((tmp_path / "c.json").read_text())["guarantee"]
    assert "add or remove one example of the training split or of the validation split" in g["neighbouring_relation"]
    assert "test" in g["not_covered"] and g["reproducible"] is False and "warning" not in g
    search = de.RepeatAndSelectDpEvent(A.trial_event(noise_multiplier=1.2, sampling_rate=0.1, steps=150, score_noise=6.0), 3.0, math.inf)
    seeded = Certificate.build(DATASET_ID, 1e-5, [("search", search)], {}, reproducible=True)
    assert seeded.guarantee["reproducible"] is True and "NOT PRIVATE" in seeded.guarantee["warning"]


def _edited(tmp_path: Path, cert: Certificate, edit: object) -> Certificate:
    cert.save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    assert callable(edit)
    edit(data)
    (tmp_path / "c.json").write_text(json.dumps(data))
    return load_certificate(tmp_path / "c.json", verify=False)


@pytest.mark.parametrize("edit", [
    lambda c: c["guarantee"].update(reproducible=True),
    lambda c: c["guarantee"].update(warning="none"),
    lambda c: c["guarantee"].update(neighbouring_relation="replace one example"),
    lambda c: c["stopping"].update(mean=1.0),
    lambda c: c["details"].update(searcher="random"),
    lambda c: c.update(created="2020-01-01"),
    lambda c: c["versions"].update(dptune="0"),
    lambda c: c["binding"]["files"].update({"best_config.yaml": "0" * 64}),
    lambda c: c["binding"]["files"].pop("best_config.yaml"),
])
def test_binding_mac_covers_every_certificate_field_and_file_digest(tmp_path: Path, edit: object) -> None:
    """Issue 22 item 1: the fields the MAC left out (guarantee, reproducible, warning, stopping, details,
    created) and the released files' digests are authenticated: any edit is refused."""
    cert, ledger = _bound(tmp_path)
    (tmp_path / "best_config.yaml").write_text("config: {}\n")
    cert = Certificate.build(cert.dataset_id, cert.delta, cert.events, cert.stopping, {"searcher": "tpe"}
                             ).bind(ledger, cert.tokens(), {"best_config.yaml": tmp_path / "best_config.yaml"})
    verify_binding(_edited(tmp_path, cert, lambda c: None), ledger, folder=tmp_path)  # unedited: accepted
    with pytest.raises(CertificateError, match="certificate.binding: is not authenticated"):
        verify_binding(_edited(tmp_path, cert, edit), ledger)


def test_binding_refuses_a_config_or_checkpoint_it_was_not_released_with(tmp_path: Path) -> None:
    cert, ledger = _bound(tmp_path)
    cfg = tmp_path / "best_config.yaml"
    cfg.write_text("config: {learning_rate: 0.5}\n")
    cert = cert.bind(ledger, cert.tokens(), {"best_config.yaml": cfg})
    verify_binding(cert, ledger, folder=tmp_path)
    cfg.write_text("config: {learning_rate: 0.6}\n")
    with pytest.raises(CertificateError, match="best_config.yaml: is not the file"):
        verify_binding(cert, ledger, folder=tmp_path)
    cfg.write_text("config: {learning_rate: 0.5}\n")
    (tmp_path / "best_checkpoint.pt").write_bytes(b"a model")  # a checkpoint the search did not release
    with pytest.raises(CertificateError, match="best_checkpoint.pt: was not released"):
        verify_binding(cert, ledger, folder=tmp_path)
    cfg.unlink()
    (tmp_path / "best_checkpoint.pt").unlink()
    with pytest.raises(CertificateError, match="best_config.yaml: is missing"):
        verify_binding(cert, ledger, folder=tmp_path)


def test_a_certificate_bound_before_its_files_were_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    """Decision for older certificates (binding version 1: the MAC covered the charges only): their ε still
    verifies, but they cannot authorize final training — nothing authenticates the config beside them."""
    import hmac as hmac_

    cert, ledger = _bound(tmp_path)
    charges = cert.binding["charges"]
    message = json.dumps({"format": "dptune-certificate/2", "dataset_id": cert.dataset_id, "delta": cert.delta,
                          "charges": charges}, sort_keys=True, separators=(",", ":")).encode()
    old = Certificate(cert.dataset_id, cert.delta, cert.events, cert.epsilon, cert.stopping,
                      binding={"charges": charges, "mac": ledger.mac(message)}, bound=cert.bound)
    assert hmac_.compare_digest(old.binding["mac"], ledger.mac(message))
    old.save(tmp_path / "old.json")
    loaded = load_certificate(tmp_path / "old.json")  # readable, ε verifies
    with pytest.raises(CertificateError, match="older dptune") as e:
        verify_binding(loaded, ledger)
    assert "run a new search" in str(e.value)


def test_guarantee_states_it_is_conditional_on_the_published_split_sizes(tmp_path: Path) -> None:
    """Issue 22 item 10: "add or remove one example" and "split sizes are public" contradicted each other;
    the certificate now says plainly that (ε, δ) is conditional on the sizes it publishes."""
    _cert().save(tmp_path / "c.json")
    g = json.loads((tmp_path / "c.json").read_text())["guarantee"]
    assert "treated as public" not in json.dumps(g)
    assert "published split sizes" in g["neighbouring_relation"]
    assert "details.n_train" in g["conditional_on"] and "does not hide the sizes" in g["conditional_on"]
