"""One private search, as a library call: plan → reserve (or resume the same charge) → draw → trials →
release. The CLI (``python -m dptune.search``) parses flags into a :class:`SearchRequest` and prints.

Order (rule 4): nothing touches data before the ledger holds the charge, except reading the dataset to
fingerprint it and to know n (published: the guarantee is conditional on the split sizes, see the certificate).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna.distributions as od

from dptune.accounting import Plan, TransferPlan, filter_bound, plan_search, plan_transfer
from dptune.config import (
    DatasetSpec,
    PrivacySpec,
    SearchSpace,
    TrialConfig,
    check_space,
    later_defaults,
    stopping,
)
from dptune.errors import ConfigError, check_delta, python_m
from dptune.ledger import Charge, Ledger, LedgerLocation, LedgerUnavailable, ledger_location
from dptune.ledger import check as check_ledger
from dptune.release import (
    day_of,
    public_auto,
    release_document,
    released_params,
    search_certificate,
    select,
    write_release,
)
from dptune.rundir import RunDir
from dptune.trials import TrialRow, write_trials
from dptune.tuning.budgets import budget_keys
from dptune.tuning.draw import Draw, make_draw
from dptune.tuning.failures import SearchStopped, is_interrupt, safely, stopped, watch_for_sudden_death
from dptune.tuning.options import RayOptions, check_auth_mode, check_gpus, check_token_file
from dptune.tuning.precharge import check_public, ledger_warnings, validate_models, verdict, with_layer_clip

__all__ = ["SearchOutcome", "SearchRequest", "SearchStopped", "run_search", "run_spec", "sealed_run_spec"]


@dataclass(frozen=True)
class SearchRequest:
    space: SearchSpace  # with every CLI override applied: this is what runs and what is charged
    run_dir: Path
    ledger: Path | str | LedgerLocation  # a SQLite file or a postgresql:// URL (absolute_paths: a LedgerLocation)
    budget_epsilon: float | None = None
    budget_delta: float | None = None
    resume: bool = False
    seed: int | None = None  # NOT PRIVATE
    show_trials: bool = False
    ray: RayOptions = dataclasses.field(default_factory=RayOptions)
    # the CLI's exact resume command: a watcher prints it if this process dies silently (a killed head raylet)
    resume_command: str | None = None
    tune_anyway: bool = False  # run a search that plans its final run the planner does not expect to pay


@dataclass(frozen=True)
class SearchOutcome:
    run: RunDir
    released: dict[str, Any]  # best_config.yaml's content
    epsilon: float
    delta: float
    stopping: str
    dashboard: str | None


def run_spec(space: SearchSpace) -> dict[str, Any]:
    """Everything about a search that changes what runs (a resumed search must match it exactly)."""
    return {"name": space.name, "dataset": dataclasses.asdict(space.dataset), "fixed": space.fixed.to_dict(),
            "space": {k: od.distribution_to_json(d) for k, d in sorted(space.space.items())},
            "default": space.default.to_dict(), "privacy": _privacy_spec(space.privacy),
            "accounting": space.accounting, "searcher": space.searcher, "scheduler": space.scheduler,
            "tune_fraction": space.tune_fraction, **({"sealed_params": "final-run"} if space.transfers else {}),
            # sealed_params: a search planning its final run seals final-run params (an older scaled search sealed
            # its trials'; the key tells them apart); the lr's batch scaling only when set, as before it existed
            **{k: getattr(space, k) for k in ("lr_reference_batch", "lr_batch_power") if space.lr_reference_batch is not None},
            **({"auto": {"rules": space.auto["rules"], "facts": space.auto["facts"]}} if space.auto is not None else {})}


def _privacy_spec(p: PrivacySpec) -> dict[str, Any]:  # JSON-stable: the rule's settings as a mapping
    return {**dataclasses.asdict(p), "stopping_settings": dict(p.stopping_settings)}


def sealed_run_spec(stored: dict[str, Any]) -> dict[str, Any]:
    """A run spec sealed at reserve time, with the config fields added since then at their defaults (what
    ran before they existed): a search sealed by an older dptune resumes if nothing else changed. An older
    spec's ``privacy.eta`` was TNB's shape for every rule: it is the rule's setting only where the rule has it."""
    out = dict(stored)
    classes = (("dataset", DatasetSpec), ("fixed", TrialConfig), ("default", TrialConfig), ("privacy", PrivacySpec))
    for key, cls in classes:
        if isinstance(out.get(key), dict):
            out[key] = {**later_defaults(cls), **out[key]}
    privacy = dict(out.get("privacy") or {})
    if "eta" in privacy and "stopping_settings" not in stored.get("privacy", {}):
        eta, rule = privacy.pop("eta"), privacy.get("stopping")
        own = stopping.rule_info(rule).settings if rule in stopping.choices() else ()
        out["privacy"] = {**privacy, "stopping_settings": {"eta": eta} if "eta" in own else {}}
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class _Prepared:
    data: Any
    n_train: int
    plan: Plan
    fingerprint: str
    spec: dict[str, Any]
    transfer: TransferPlan | None  # a search that plans its final run: σ_c, σ_f per (B, E), the scaled grid
    notes: tuple[str, ...] = ()  # what the clipping guard chose instead of auto's default mode
    space: SearchSpace | None = None  # the space as it runs (alc: with its per-layer clip norms)


def _prepare(req: SearchRequest) -> _Prepared:
    from dptune.data import check_planned_size, load_dataset

    check_planned_size(req.space.dataset, data := load_dataset(req.space.dataset))  # the sizes `dptune plan` priced
    if req.space.alc is not None:  # per-layer clip norms from the public data, before anything is checked or charged
        req = dataclasses.replace(req, space=with_layer_clip(req.space, data))
    notes = validate_models(req.space, data)
    n_train = int(len(data.train[1]))
    # δ ≥ 1/n admits publishing one random example in the clear (n: the smaller, training split)
    check_delta("privacy.delta", req.space.privacy.delta, n_train)
    plan = plan_search(req.space, n_train, compare=False)
    # a search that plans its final run plans the one its printed dptune.train command makes: on train + validation
    transfer = None if not req.space.transfers else plan_transfer(
        req.space, plan, final_n=n_train + int(len(data.val[1])))
    return _Prepared(data, n_train, plan, data.pool_fingerprint(), run_spec(req.space), transfer, notes, req.space)


def _preflight(location: str | Path | LedgerLocation) -> Ledger:
    """The ledger opened before any data is read: a team ledger's server answers (exit 2 for each failure class if
    not, ``LedgerUnavailable``) and this machine holds its curator key. Nothing is charged before this returns."""
    try:
        ledger = Ledger(location)
        if ledger.location.is_postgres:
            ledger.key()  # the key file this machine must hold, checked against the database's check value
            failed = [f for f in check_ledger(ledger.location) if not f.ok]  # its role, writable (not a standby)
            if failed:
                raise LedgerUnavailable("--ledger", f"{failed[0].name}: {failed[0].said}",
                                        f"`{python_m('dptune.cli.ledger')} check --ledger {ledger.location}` lists "
                                        "every check")
    except LedgerUnavailable as e:
        raise LedgerUnavailable(e.field, f"{e.problem}; nothing was charged and nothing ran", e.fix,
                                retry=e.retry) from None
    return ledger


def _reserve(req: SearchRequest, run: RunDir, ledger: Ledger, p: _Prepared,
             say: Callable[[str], None]) -> tuple[Charge, Draw]:
    if run.root.exists():
        raise ConfigError("--name", f"{run.root} already exists", "choose a new --name, or --resume that search")
    budget_fps = budget_keys(req, ledger, p.data, p.fingerprint, say)
    charge_id = ledger.reserve(budget_fps, run.root.name, p.plan.search_event, n=p.n_train)  # rule 4: durable first
    run.create()
    charge = ledger.charge(charge_id)
    run.write_state(charge_id=charge_id, fingerprint=p.fingerprint, budget_fingerprint=budget_fps[0],
                    budget_fingerprints=budget_fps,
                    run_spec=p.spec, event_sha256=_event_sha(charge), status="reserved",
                    ledger=str(ledger.location), ledger_id=ledger.ledger_id,
                    reserved_at=charge.created)  # password-free; a team ledger's id: the same ledger however reached
    draw = make_draw(req.space, p.plan.stopping, seed=req.seed)
    draw.save(run.draw_file)
    return charge, draw


def _event_sha(charge: Charge) -> str:
    from dptune.ledger import event_sha256

    return event_sha256(charge.event)


def _resume(req: SearchRequest, run: RunDir, ledger: Ledger, p: _Prepared,
            say: Callable[[str], None]) -> tuple[Charge, Draw]:
    """The same sealed draw under the charge made at reserve time — only if what would run now is exactly
    what was charged then (a flag that changes what runs must change what is charged)."""
    from dptune.ledger import event_sha256

    state = run.read_state()
    if not run.draw_file.exists() or "charge_id" not in state:
        raise ConfigError("--resume", f"{run.root} holds no sealed draw", "give the --name of an interrupted search")
    if state.get("status") == "released":
        raise ConfigError("--resume", f"{run.root.name} already finished", f"its release is in {run.release}")
    if not ledger.same_ledger(state["ledger"], state.get("ledger_id")):
        raise ConfigError("--ledger", f"the search was charged to {state['ledger']}"
                          + (f" (ledger id {state['ledger_id']}), not to ledger id {ledger.ledger_id}"
                             if state.get("ledger_id") and ledger.ledger_id else ""), "resume with that --ledger")
    if state.get("fingerprint") != p.fingerprint:
        raise ConfigError("--space", "the dataset differs from the one the search was charged for",
                          "resume with the same data")
    sealed = sealed_run_spec(state.get("run_spec", {}))
    changed = sorted(k for k in set(p.spec) | set(sealed) if p.spec.get(k) != sealed.get(k))
    charge = ledger.charge(int(state["charge_id"]))
    if changed or event_sha256(p.plan.search_event) != event_sha256(charge.event):
        raise ConfigError("--resume", "what would run now differs from what was charged at reserve time "
                          f"(changed: {', '.join(changed) or 'the charged event'})",
                          "resume with exactly the original --space and flags (--epochs, --smoke-test, "
                          "--accounting, --trials, --searcher, --tune-fraction), or start a new search")
    if charge.status == "aborted":
        raise ConfigError("--resume", "its ledger charge was aborted", "start a new search")
    say(f"  resuming; charged at reserve time: epsilon = {charge.epsilon:.4f} (no new charge)")
    return charge, Draw.load(run.draw_file)


def _run_trials(req: SearchRequest, run: RunDir, p: _Prepared, draw: Draw,
                say: Callable[[str], None]) -> tuple[list[TrialRow], str | None]:
    if draw.k == 0:
        return [], None
    from dptune.tuning import runner
    from dptune.tuning.raysession import RaySession, expected_dashboard_url

    data = p.data
    f = req.space.tune_fraction
    if f < 1:  # X₁ drawn once from the sealed (secret, 128-bit) stream: a resumed search sees the same
        from dptune.data import poisson_subsample

        data = poisson_subsample(data, f, draw.stream_seed("subsample"))
    eps = f"{p.plan.search_epsilon:.4f}"
    # the dashboard's job list shows metadata["job_name"] as the job's Name: which search, what it costs
    opts = dataclasses.replace(req.ray, job_metadata={
        **req.ray.job_metadata, "job_name": f"dptune search {run.root.name}: epsilon {p.plan.search_epsilon:.2f}",
        "dptune_run": run.root.name, "dptune_space": req.space.name, "dptune_epsilon": eps,
        "dptune_delta": f"{p.plan.delta:g}", "dptune_stopping": p.plan.stopping.label()})
    opts = dataclasses.replace(opts, py_modules=user_modules(req.space.fixed.model))
    session = RaySession(opts)
    # before Ray starts (its start takes seconds): where the dashboard will be and how to open it
    where = (f"{expected_dashboard_url(opts)} once Ray has started" if not opts.address else
             "on your cluster's head (`ray dashboard cluster.yaml` forwards it to http://127.0.0.1:8265)")
    say(f"  Ray dashboard: {where}. It asks for the token: paste what `ray get-auth-token` prints (the file "
        "~/.ray/auth_token, kept 0600); scripts send the header 'Authorization: Bearer <token>'")
    with session as dashboard, runner.sealed_ray_logs(run.sealed / "logs" / "ray.log"):
        listens = ""
        if session.exposed:  # measured after start from the socket table (a joined cluster: not measured)
            listens = (f"; Ray listens beyond loopback (token-checked; docs/operations.md: what others can see): "
                       f"{', '.join(session.exposed)}")
        elif not opts.address:
            listens = "; Ray listens on loopback only (its processes' listening sockets, checked after start)"
        say(f"  Ray started, dashboard at {dashboard or 'your cluster head'}: {session.auth}{listens}")
        run.write_state(status="running", dashboard=dashboard)
        rows = runner.run_trials(req.space, draw, data, run, opts, show_trials=req.show_trials,
                                 resume=req.resume, sampling_basis=f * p.n_train if f < 1 else None,
                                 charged_points=p.plan.points, transfer=p.transfer,
                                 filter_budget=filter_bound(p.plan.search_event))
    return rows, dashboard


def user_modules(model: str) -> tuple[str, ...]:
    """The directory (package) or file (module) of a ``factory:<package.module>:<function>`` model, for
    Ray's runtime_env: workers on other nodes import the user's code from there, not from this machine."""
    if not model.startswith("factory:"):
        return ()
    import importlib.util

    top = model.removeprefix("factory:").split(":")[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise ConfigError("model.factory", f"module {top!r} cannot be imported here",
                          "put it on PYTHONPATH (or install it) on the machine that starts the search")
    origin = Path(spec.origin).resolve()
    if _installed(origin):  # e.g. factory: torchvision.models:resnet18 — on every node already, never uploaded
        return ()
    return (str(origin.parent if origin.name == "__init__.py" else origin),)


def _installed(path: Path) -> bool:
    """Inside an installed environment's library folders (site-packages, the standard library)."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    roots.update(site.getsitepackages())
    return any(path.is_relative_to(Path(r).resolve()) for r in roots if r)


def absolute_paths(req: SearchRequest) -> SearchRequest:
    """Every local path of a request made absolute against today's working directory, before Ray sees any."""
    storage = req.ray.storage_path
    if storage is not None and "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    return dataclasses.replace(req, run_dir=req.run_dir.expanduser().resolve(), ledger=ledger_location(req.ledger),
                               ray=dataclasses.replace(req.ray, storage_path=storage))


def _say(line: str) -> None:
    print(line, flush=True)  # as it happens, also when stdout is a pipe (tee, CI, a notebook's stream)


def run_search(req: SearchRequest, say: Callable[[str], None] = _say) -> SearchOutcome:
    """Run (or resume) one search; raises ConfigError before anything is charged for bad input, and
    :class:`SearchStopped` (trials sealed, charge kept, nothing released) when a search with a reserved
    charge is interrupted or fails, whatever failed."""
    check_space(req.space)  # however the space was built (file, dict, object, overrides): before anything runs
    os.umask(0o077)  # every file this search (and the Ray it starts) writes is owner-only
    req = absolute_paths(req)  # Ray reads a relative path as a URI without a scheme (Tuner.restore fails)
    check_auth_mode()  # RAY_AUTH_MODE=disabled in the environment is refused before anything is charged
    check_token_file(create=False)  # a world-readable Ray token is refused before anything is charged
    check_gpus(req.ray)  # GPUs per trial against a local Ray's GPUs: refused before anything is charged
    run = RunDir(req.run_dir)
    # the first line within a second of the call, before the slow part (torch, the data, the models' probes)
    say(f"dptune search {run.root.name!r}{' (resuming)' if req.resume else ''}: space {req.space.name}, "
        f"{req.space.searcher} search; loading the data and checking the models "
        f"({'no new charge' if req.resume else 'nothing is charged yet'})")
    ledger = _preflight(req.ledger)  # before the data: a refused search fails in a second or two, not 20
    p = _prepare(req)
    req = dataclasses.replace(req, space=p.space or req.space)
    for line in ledger_warnings(ledger.location):
        say(line)
    if req.space.alc is not None:
        check_public(req.space, ledger)
    if req.seed is not None or os.environ.get("DPTUNE_TEST_DRAW_SEED") is not None:
        say("WARNING: fixed randomness (--seed or the test hook): K, the configs and all DP noise are "
            "reproducible: NOT PRIVATE (tests/reproducibility only).")
    if not req.resume and p.transfer is not None:
        verdict(req.space, p.n_train, int(len(p.data.val[1])), (p.plan, p.transfer), tune_anyway=req.tune_anyway,
                say=say)
    charge, draw = (_resume if req.resume else _reserve)(req, run, ledger, p, say)
    for note in p.notes:
        say(f"  {note}")
    say(f"  ledger: {ledger.path}")
    say(f"  {'its charge, unchanged' if req.resume else 'charged to the ledger before any trial'}: epsilon = "
        f"{p.plan.search_epsilon:.4f}, delta = {p.plan.delta:g} ({p.plan.stopping.label()}; one worst-case trial: "
        f"epsilon = {p.plan.trial_epsilon:.4f})")
    watcher = None if req.resume_command is None else watch_for_sudden_death(run, ledger.location, charge.epsilon,
                                                                             req.resume_command)
    try:
        return _after_reservation(req, run, ledger, p, charge, draw, say)
    except _RefusedBeforeTrials as refused:  # Ray's start-up checks (token auth really on, GPUs)
        e = refused.error
        if req.resume:  # trials of an earlier session ran under this charge: it stays
            raise stopped(ledger.location, run, charge, e, interrupted=False) from None
        safely(lambda: ledger.abort(charge.id))  # nothing ran under this charge: released, as any refusal
        safely(lambda: run.write_state(status="aborted"))
        raise e from None
    except (Exception, KeyboardInterrupt) as e:
        raise stopped(ledger.location, run, charge, e, interrupted=is_interrupt(e)) from None
    finally:  # the search ended in a known state: the watcher exits without a word
        if watcher is not None:
            watcher.ended()


class _RefusedBeforeTrials(Exception):
    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error))
        self.error = error


def _after_reservation(req: SearchRequest, run: RunDir, ledger: Ledger, p: _Prepared, charge: Charge, draw: Draw,
                       say: Callable[[str], None]) -> SearchOutcome:
    try:
        rows, dashboard = _run_trials(req, run, p, draw, say)
    except ConfigError as e:  # raised before Tune starts (Ray's start-up checks, GPUs): no trial ran
        raise _RefusedBeforeTrials(e) from None
    write_trials(run.trials_file, rows)
    return _release(req, run, ledger, p, charge, draw, rows, dashboard)


def _release(req: SearchRequest, run: RunDir, ledger: Ledger, p: _Prepared, charge: Charge, draw: Draw,
             rows: list[TrialRow], dashboard: str | None) -> SearchOutcome:
    best = select(req.space, rows, n_val=int(len(p.data.val[1])), seed=draw.stream_seed("selection"))
    params, score = released_params(req.space, best, p.n_train, transfer=p.transfer)
    document = release_document(req.space, params, score, transfer=p.transfer)
    budget_fp = run.read_state()["budget_fingerprint"]
    cert = search_certificate(req.space, p.plan, charge.event, dataset_id=ledger.dataset_id(budget_fp),
                              reproducible=draw.reproducible, created=day_of(charge.created), transfer=p.transfer,
                              engines=p.notes)
    checkpoint = None
    if req.ray.save_model and best is not None and best.checkpoint:
        checkpoint = Path(best.checkpoint) / "model.pt"
    cert = write_release(run.release, document, cert, ledger=ledger, tokens=[charge.token], mtime=charge.created,
                         checkpoint=checkpoint,
                         auto_space=public_auto(req.space) if req.space.auto is not None else None)
    ledger.commit(charge.id)
    run.write_state(status="released")
    return SearchOutcome(run, document, cert.epsilon, cert.delta, p.plan.stopping.label(), dashboard)


def default_run_name(space: SearchSpace) -> str:
    """``<space>-<random>``: a start time in the name would date the release (and, with its files'
    times, give the search's duration)."""
    import secrets

    return f"{space.name}-{secrets.token_hex(4)}"
