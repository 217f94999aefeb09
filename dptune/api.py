"""The Python API: plan, search and train from a notebook with the same validation, ledger and
certificates as the CLIs (which are thin wrappers over the same library calls).

    import dptune
    plan = dptune.plan("search_spaces/digits.yaml")            # what the search will cost
    found = dptune.search("search_spaces/digits.yaml", budget_epsilon=30, num_cpus=2)
    model = dptune.train(found.release)     # composed total ε ≤ the space's privacy.target_epsilon
    print(found.config, found.epsilon, model.metrics["test_accuracy"], model.epsilon)

A space is a YAML path or a dict with the same keys. Bad input raises :class:`dptune.ConfigError` (naming
the field) before anything is charged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptune.accounting import Plan, plan_search
from dptune.certificate import Certificate, load_certificate
from dptune.config import SearchSpace, check_space, load_space, nominal_train_size, parse_space
from dptune.errors import ConfigError, check_positive, check_unit_interval
from dptune.final import FinalModel

__all__ = ["FinalModel", "SearchResult", "plan", "search", "train"]


def _space(space: str | Path | Mapping[str, Any] | SearchSpace, *, tune_fraction: float | None = None,
           epochs: float | None = None) -> SearchSpace:
    if isinstance(space, SearchSpace):
        out = space
    elif isinstance(space, Mapping):  # a space: auto on a table or folder is sized on its counted split
        out = parse_space(dict(space), source=None, count_train=_train_size)
    else:
        out = load_space(space, count_train=_train_size)
    changes: dict[str, Any] = {}
    if tune_fraction is not None:
        changes["tune_fraction"] = check_unit_interval("tune_fraction", tune_fraction, "choose e.g. 0.25, or 1",
                                                       include_one=True)
    if epochs is not None:
        if "epochs" in out.space:
            raise ConfigError("epochs", "epochs is searched in this space", "drop epochs or fix it in the space")
        e = check_positive("epochs", epochs, "give e.g. 5")
        changes.update(fixed=out.fixed.replace(epochs=e), default=out.default.replace(epochs=e))
    out = dataclasses.replace(out, **changes)
    check_space(out)  # the one validation path: a dict, a file and a SearchSpace object alike, as the CLI
    return out


def _train_size(spec: Any) -> int:
    """A table's or folder's training split, counted (torch is imported only for such a space: auto)."""
    from dptune.data import train_size

    return train_size(spec)


def plan(space: str | Path | Mapping[str, Any] | SearchSpace, *, n_train: int | None = None,
         tune_fraction: float | None = None, epochs: float | None = None) -> Plan:
    """The charge of a search over ``space`` (the worst case over it), before anything touches data; ``epochs``
    and ``tune_fraction`` as :func:`search` takes them, so the plan is the charge of that search."""
    s = _space(space, tune_fraction=tune_fraction, epochs=epochs)
    n = n_train if n_train is not None else nominal_train_size(s.dataset)
    if n is None and s.auto is not None:  # a derived space on a table or folder: sized on its counted split
        n = s.auto["facts"]["n_train"]
    if n is None:
        raise ConfigError("n_train", f"dataset {s.dataset.name!r} has no nominal size", "pass n_train=…")
    return plan_search(s, int(n))


@dataclass(frozen=True)
class SearchResult:
    """The release of one search: only the best trial's config and noised score, and the certificate.

    Attributes:
        run: The run folder (its ``sealed/`` is the curator's).
        release: The release folder: ``best_config.yaml`` (everything ``dptune.train`` needs), the certificate.
        config: The released hyperparameters a user sets — the searched ones first, then the space's fixed
            ones; nothing internal (the trials' seeds) or derived (score noise, alc's per-layer clip norms).
        score: The best trial's noised validation score (None: none released).
        certificate: The search's certificate (``epsilon`` is its charge).
    """

    run: Path
    release: Path
    config: dict[str, Any]
    score: float | None
    certificate: Certificate

    @property
    def epsilon(self) -> float:
        return self.certificate.epsilon

    def __repr__(self) -> str:
        """What ``print(found)`` shows in a notebook: the release, not the certificate's events and binding."""
        score = "None" if self.score is None else f"{self.score:.4f}"
        return (f"SearchResult(config={self.config!r}, score={score}, epsilon={self.epsilon:.4g}, "
                f"delta={self.certificate.delta:g}, release={str(self.release)!r})")


def search(space: str | Path | Mapping[str, Any] | SearchSpace, *, budget_epsilon: float | None = None,
           budget_delta: float | None = None, ledger: str | Path | None = None,
           runs_dir: str | Path = "runs", name: str | None = None, tune_fraction: float | None = None,
           epochs: float | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
           address: str | None = None, cpus_per_trial: float = 1.0, gpus_per_trial: str = "auto",
           save_checkpoint: bool = False,
           resume: bool = False, seed: int | None = None, tune_anyway: bool = False,
           group_trials: bool = False) -> SearchResult:
    """Run a private search (charged to ``ledger`` before any trial) and return its release.
    ``ledger``: a SQLite file or a ``postgresql://`` URL; default the CLI's (``$DPTUNE_LEDGER``, else
    :func:`dptune.ledger.default_ledger_path`).
    ``tune_anyway``: run a search that plans its final run even when the planner does not expect it to pay.
    ``gpus_per_trial``: ``auto`` (1 where Ray has a GPU), 0, or a fraction: 0.25 packs four trials on each GPU
    (``cpus_per_trial`` each); ``num_gpus``: the GPUs a local Ray offers (default: those it detects).
    ``group_trials``: trials of one architecture trained together (``dptune search --group-trials``).

    Raises :class:`dptune.ConfigError` before anything is charged for bad input; once charged, a search that is
    interrupted or fails raises ``SearchStopped``: nothing released, the charge reserved, and its message ends
    with the exact call that continues it (``resume=True``)."""
    given = dict(locals())
    from dptune.ledger import ledger_location
    from dptune.release import user_config
    from dptune.tuning.driver import SearchRequest, SearchStopped, default_run_name, run_search
    from dptune.tuning.options import RayOptions

    s = _space(space, tune_fraction=tune_fraction, epochs=epochs)
    run_name = name or default_run_name(s)
    ray = RayOptions(address=address, num_cpus=num_cpus, num_gpus=num_gpus, cpus_per_trial=cpus_per_trial,
                     gpus_per_trial=gpus_per_trial, save_model=save_checkpoint, group_trials=group_trials)
    try:
        out = run_search(SearchRequest(space=s, run_dir=Path(runs_dir) / run_name,
                                       ledger=ledger_location(ledger),
                                       budget_epsilon=budget_epsilon, budget_delta=budget_delta,
                                       resume=resume, seed=seed, ray=ray, tune_anyway=tune_anyway))
    except SearchStopped as e:  # its message ends with this very call, resumed
        raise e.resumed_by(resume_call(given, run_name)) from None
    release = out.run.release
    return SearchResult(out.run.root, release, user_config(out.released["config"], s.space), out.released["score"],
                        load_certificate(release / "certificate.json"))


# a resume charges nothing and opens no budget: the budget arguments are not repeated
_NOT_REPEATED = ("space", "name", "resume", "budget_epsilon", "budget_delta")


def resume_call(given: Mapping[str, Any], name: str) -> str:
    """The call that continues the search ``dptune.search(**given)`` named ``name``: the same space and every
    argument given other than its default, with ``name`` and ``resume=True``."""
    import inspect

    params = inspect.signature(search).parameters
    space = given["space"]
    first = repr(str(space)) if isinstance(space, str | Path) else "space"
    from dptune.ledger import is_url, ledger_location

    if is_url(given.get("ledger")):  # a team ledger's URL, repeated without its password
        given = {**given, "ledger": str(ledger_location(given["ledger"]))}
    args = [f"{k}={str(v)!r}" if isinstance(v, Path) else f"{k}={v!r}" for k, v in given.items()
            if k not in _NOT_REPEATED and k in params and v != params[k].default]
    call = f"dptune.search({', '.join([first, f'name={name!r}', 'resume=True', *args])})"
    return call if first != "space" else f"{call}, with space the same {type(space).__name__} as this call's"


def train(release: str | Path | SearchResult, *, out: str | Path | None = None, target_epsilon: float | None = None,
          train_on_validation: bool = False, epochs: float | None = None, device: str | None = None,
          use_best_checkpoint: bool = False, seed: int | None = None) -> FinalModel:
    """Final DP training of a release (charged to the search's own ledger): what it wrote and what it cost.
    ``target_epsilon`` (search + training) defaults to the one the release carries (the space's
    ``privacy.target_epsilon``); a value given here wins, and the run prints which one it used."""
    from dptune.final import TrainRequest, run_final

    rel = release.release if isinstance(release, SearchResult) else Path(release)
    return run_final(TrainRequest(release=rel, out=Path(out) if out else rel.parent / "final",
                                  target_epsilon=target_epsilon, train_on_validation=train_on_validation,
                                  epochs=epochs, device=device, use_best_checkpoint=use_best_checkpoint, seed=seed))
