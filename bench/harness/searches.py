"""Searches exactly as ``dptune search`` runs them: the space's searcher and draw (K, configs), an adaptive
searcher's Optuna sampler, every trial refused unless charged (``plan_search``'s points), the space's selection
(best noised score, or one report-noisy-max), the release (``released_params``), then the final run ``dptune
train --target-epsilon --train-on-validation`` trains (``calibrate_final``). A space that plans its final run
(``privacy.search_share``) runs each trial at its (B, E)'s cheap σ_c with lr = L·σ_f/σ_c (``plan_transfer``);
its final run is at σ_f with the released lr, asserted equal to the released rule lr·σ_f / σ within 0.5 %.

(search) the ``--space`` itself (any searcher: random, TPE, scaled);
and the named searches of issues 13 and 21, each a space file beside ``--space`` (on the same data):
(R)  ``mnist.yaml`` as first declared (B 64-1024, lr 0.1-6.4), random search with random stopping;
(R2) ``mnist.yaml``'s second version (B ∈ {256, 1024}, lr 0.4-3.2, epochs 5 or 10), rebuilt from the fourth;
(R3) ``mnist.yaml``'s third version (B ∈ {256, 1024}, lr 0.8-3.2, groups 4 or 8, epochs 10), rebuilt from the fourth;
(R4) ``mnist.yaml``'s fourth version (R3's ranges and epochs 10 or 20: all four searched), rebuilt from the fifth;
(R5) ``mnist.yaml`` as shipped since 2026-11-27 (R4 with the lr scaled by √(B/256): L 0.8-1.6 at B 256);
(T)  ``mnist_tpe.yaml`` as first declared (R's space): TPE under composition, the same transfer;
(T2) ``mnist_tpe.yaml``'s second version (R2's space), rebuilt from the fourth;
(T3) ``mnist_tpe.yaml``'s third version (R3's space), rebuilt from the fourth;
(T4) ``mnist_tpe.yaml``'s fourth version (R4's space), rebuilt from the fifth;
(T5) ``mnist_tpe.yaml`` as shipped since 2026-11-27 (R5's space);
(S)  ``mnist_scaled.yaml``: the scaled searcher over B × lr, one report-noisy-max;
(A)  ``mnist_alc.yaml``: (S) with adaptive layerwise clipping (per-layer C_l from public data);
(m)  the lr-only scaled searcher of issue 13 (``mnist_scaled.yaml`` with B 256, lr candidates 0.2-3.2), noisy max;
(g)  (m) with a Gaussian score of std 40 per trial instead of the noisy max (its charge), the same draw.

A search's draw and selection randomness come from the row seed and the mode's key (its name; g shares
m's, A shares S's).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

from dptune.config import SearchSpace
from harness.context import DRAW_SEED, Bench
from harness.modes import MODES, Mode, register

SELECT_SEED = 91_367  # a row's selection seed: SELECT_SEED·(s + 1) + the mode's key
NOISE_LRS = (0.2, 0.4, 0.8, 1.6, 3.2)  # (m)'s final-run lr candidates at B 256
GAUSSIAN_SCORE = 40.0  # (g)'s score noise per trial (std on the 1,000 validation correct-counts)
R1 = {"learning_rate": {"type": "float", "low": 0.1, "high": 6.4, "log": True},  # mnist.yaml as first declared
      "batch_size": {"type": "categorical", "choices": [64, 256, 1024]}}
R2 = {"learning_rate": {"type": "float", "low": 0.4, "high": 3.2, "log": True},
      "batch_size": {"type": "categorical", "choices": [256, 1024]}}  # mnist.yaml's second version
R3 = {"learning_rate": {"type": "float", "low": 0.8, "high": 3.2, "log": True},  # mnist.yaml's third version
      "batch_size": {"type": "categorical", "choices": [256, 1024]},
      "groups": {"type": "categorical", "choices": [4, 8]}}
R4 = {**R3, "epochs": {"type": "categorical", "choices": [10, 20]}}  # mnist.yaml's fourth version
R5 = {**R4, "learning_rate": {"type": "float", "low": 0.8, "high": 1.6, "log": True}}  # = mnist.yaml since it shipped,
R5_SCALING = {"lr_reference_batch": 256, "lr_batch_power": 0.5}  # with L the final run's lr at B 256, x (B/256)^0.5
V2_VERDICT = {"mnist": ({1: -0.0349, 2: -0.0094, 4: -0.0027}, "f161099e723dddff"),  # the second versions' planner
              "mnist_tpe": ({1: -0.0494, 2: 0.0024, 4: 0.0167}, "fb38e30b55b85852")}  # rehearsal, rehearsal_of
V3_VERDICT = {"mnist": ({1: -0.0195, 2: 0.0083, 4: 0.0173}, "262badb7e1406c12"),  # the third versions'
              "mnist_tpe": ({1: -0.0036, 2: 0.0183, 4: 0.0289}, "ab51c31b1a48a57d")}
V4_VERDICT = {"mnist": ({1: -0.0150, 2: 0.0125, 4: 0.0229}, {1: 0.0072, 2: 0.0065, 4: 0.0054}, "3c080bfd57f4c2f2"),
              "mnist_tpe": ({1: 0.0023, 2: 0.0219, 4: 0.0322}, {1: 0.0084, 2: 0.0132, 4: 0.0109}, "956b36536ac84060")}


def lr_only_scaled(raw: dict[str, Any]) -> dict[str, Any]:
    """A scaled searcher's space mapping made the lr-only searcher of issue 13: B 256, ``NOISE_LRS``, one trial
    each."""
    raw["space"] = {"learning_rate": {"type": "categorical", "choices": list(NOISE_LRS)}}
    raw["fixed"]["batch_size"] = 256
    raw["default"] = {"learning_rate": 0.4}
    raw["privacy"]["mean"] = len(NOISE_LRS)
    return raw


def search_once(space: SearchSpace, plan: Any, tp: Any, key: int, trial: Any, n_train: int, n_val: int, *,
                select_key: int, score_scale: float = 1.0) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """One search as ``dptune search`` runs it (its draw, sampler and selection), every trial run by
    ``trial(params, seed) -> dict`` (score, val_raw, diverged); its draw, trials and released params.
    ``score_scale``: the noisy max's scale relative to the space's (a proxy with another validation size)."""
    from dptune.config.searchers import searcher
    from dptune.release import released_params, select_best, select_noisy_max
    from dptune.trials import TrialRow
    from dptune.tuning.draw import make_draw

    draw = make_draw(space, plan.stopping, seed=key)
    sampler = searcher(space.searcher).sampler(space, draw.stream_seed("sampler"))
    trials: list[dict[str, Any]] = []
    if sampler is not None:  # an adaptive searcher chooses each trial from the earlier (noised) scores
        import optuna

        study = optuna.create_study(direction="maximize", sampler=sampler)
        for t in draw.trials:
            ot = study.ask(fixed_distributions=dict(space.space))
            trials.append(trial(dict(ot.params), int(t["seed"]) % 2**63))
            s = trials[-1]["score"]
            study.tell(ot, s if math.isfinite(s) else -1.0)
    else:
        for t in draw.trials:
            trials.append(trial(dict(t["params"]), int(t["seed"]) % 2**63))
    rows = [TrialRow(index=i, params=t["params"], seed="", score=t["score"], val_accuracy_raw=t["val_raw"],
                     diverged=t["diverged"]) for i, t in enumerate(trials)]
    if space.privacy.selection == "noisy_max":
        best, _ = select_noisy_max(rows, gumbel_scale=float(space.privacy.score_noise or 0) * score_scale,
                                   n_val=n_val, seed=select_key)
    else:
        best = select_best(rows)
    params, _ = released_params(space, best, n_train, transfer=tp)
    return draw, trials, params


class SpaceSearch(Mode):
    """A search of one space file (``file`` beside ``--space``; None: ``--space`` itself)."""

    file: ClassVar[str | None] = None
    key: ClassVar[str] = ""  # whose draw and selection randomness it uses (default: its own name)

    def space(self, bench: Bench, eps: float) -> SearchSpace:
        path = Path(bench.spec.space) if self.file is None else Path(bench.spec.space).parent / self.file
        raw = bench.raw(path)
        raw["privacy"]["target_epsilon"] = eps
        return bench.same_data(bench.parse(self.edit(raw)), f"mode {self.name} ({path})")

    def edit(self, raw: dict[str, Any]) -> dict[str, Any]:
        return raw

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        from dptune.accounting import plan_search, plan_transfer
        from dptune.dpsgd import run_trial

        space = self.space(bench, eps)
        if space.alc is not None:  # per-layer clip norms from the public data, as dptune search computes them
            from dptune.tuning.precharge import with_layer_clip

            space = with_layer_clip(space, data)
        charge = plan_search(space, bench.n_train, compare=False)
        tp = plan_transfer(space, charge, final_n=bench.n_final) if space.transfers else None

        def trial(params: dict[str, Any], trial_seed: int) -> dict[str, Any]:
            cfg = space.fixed.replace(**params, seed=trial_seed)
            cfg = tp.trial_config(cfg) if tp is not None else cfg
            r = run_trial(cfg, data, charged_points=charge.points)
            return {"params": params, "lr": cfg.learning_rate, "sigma": cfg.noise_multiplier, "score": r.score,
                    "val_raw": r.val_accuracy_raw, "diverged": r.diverged}

        k = sum(map(ord, self.key or self.name))
        draw, trials, params = search_once(space, charge, tp, DRAW_SEED * (seed + 1) + k, trial, bench.n_train,
                                           bench.n_val, select_key=SELECT_SEED * (seed + 1) + k)
        cfg = space.fixed.replace(**params)
        out = bench.final_run(cfg, [charge.search_event], eps, merged, seed)
        if tp is not None:  # σ as released (σ_f), and the lr trained is the release's rule lr·σ_f / σ (dptune train's)
            from dptune.release import release_document

            assert abs(out["sigma_final"] / cfg.noise_multiplier - 1) < 5e-3, (out["sigma_final"], cfg.noise_multiplier)
            rule = release_document(space, params, None, transfer=tp)["scaling_rule"]["lr_times_sigma"]
            assert abs(rule / out["sigma_final"] / out["lr"] - 1) < 5e-3, (rule, out["sigma_final"], out["lr"])
        return {"k": draw.k, "trials": trials, "eps_search": charge.search_epsilon, "released": params,
                "sigma_c": [list(r) for r in tp.sigmas] if tp is not None else None, **out}

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        space = self.space(bench, eps)
        sel = (f"noisy max, Gumbel scale {space.privacy.score_noise:g}" if space.privacy.selection == "noisy_max"
               else f"σ_s {space.privacy.score_noise:g}")
        desc = f"{space.name}: {space.searcher}, {space.accounting}, {sel}"
        if space.transfers:
            desc += f", search share {space.privacy.search_share:.0%}, trials at σ_c(B, E), lr L·σ_f/σ_c"
        sigmas = sorted({round(s[2], 3) for r in records for s in (r.get("sigma_c") or [])})
        search = [r["eps_search"] for r in records if "eps_search" in r]
        return (desc, " / ".join(f"{s:g}" for s in sigmas) or "–", f"{max(search):.4f}" if search else "–")


class AutoSearch(SpaceSearch):
    """(auto) the space ``space: auto`` derives from the public facts of ``--space``'s data and the budget (issue
    43): only the dataset section and δ of ``--space`` are read, never its model, ranges or priors."""

    name = "auto"
    reports = ("auto",)
    titles = {"auto": "(auto) the space derived from public facts (space: auto), its own search + final"}
    doc = ("(auto) `space: auto`: every choice derived from the data's public facts and the budget "
           "(dptune.config.auto), random search with random stopping, + the final run dptune train trains.")

    def space(self, bench: Bench, eps: float) -> SearchSpace:
        from dptune.config import parse_space

        raw = bench.raw()
        derived = parse_space({"dataset": raw["dataset"], "space": "auto",
                               "privacy": {"target_epsilon": eps, "delta": bench.delta}}, n_train=bench.n_train)
        assert derived.auto is not None
        return bench.same_data(bench.parse(derived.auto["space"]), "mode auto")


def _named(name: str, file: str | None, title: str, doc: str, *, key: str = "",
           edit: Any = None) -> SpaceSearch:
    attrs: dict[str, Any] = {"name": name, "file": file, "key": key, "reports": (name,), "titles": {name: title},
                             "doc": doc}
    if edit is not None:
        attrs["edit"] = lambda self, raw: edit(raw)
    return type(f"Search_{name}", (SpaceSearch,), attrs)()


def _r1(raw: dict[str, Any]) -> dict[str, Any]:
    raw = _r2(raw)
    raw["space"].update(R1)
    raw["default"].update(batch_size=64, learning_rate=0.1)
    return raw


def _r2(raw: dict[str, Any]) -> dict[str, Any]:
    """The second version (shipped until 2026-11-26) rebuilt from the fourth: R2's ranges, epochs 5 or 10,
    the default's lr 0.4, and the second version's verdict (mnist.yaml, mnist_tpe.yaml)."""
    raw = _r4(raw)
    raw["space"] = {**R2, "groups": R3["groups"], "epochs": {"type": "categorical", "choices": [5, 10]}}
    raw["default"].update(learning_rate=0.4, epochs=10)
    rehearsal, key = V2_VERDICT[raw["name"]]
    raw["planner"].update(rehearsal=rehearsal, rehearsal_of=key)
    raw["planner"].pop("rehearsal_se", None)  # judged by its sign then, as shipped
    return raw


def _r3(raw: dict[str, Any]) -> dict[str, Any]:
    """The third version (shipped 2026-11-26 to 27) rebuilt from the fourth: epochs fixed at 10, and the
    third version's verdict (mnist.yaml, mnist_tpe.yaml)."""
    raw = _r4(raw)
    raw["space"] = dict(R3)
    raw["fixed"]["epochs"] = raw["default"].pop("epochs")
    rehearsal, key = V3_VERDICT[raw["name"]]
    raw["planner"].update(rehearsal=rehearsal, rehearsal_of=key)
    raw["planner"].pop("rehearsal_se", None)  # judged by its sign then, as shipped
    return raw


def _r4(raw: dict[str, Any]) -> dict[str, Any]:
    """The fourth version (shipped 2026-11-27) rebuilt from the shipped fifth: lr 0.8-3.2 at every batch size (no
    scaling), and the fourth version's verdict with its standard errors (mnist.yaml, mnist_tpe.yaml)."""
    raw = _r5(raw)
    raw["space"] = dict(R4)
    for key in R5_SCALING:
        raw["search"].pop(key)
    rehearsal, se, key = V4_VERDICT[raw["name"]]
    raw["planner"].update(rehearsal=rehearsal, rehearsal_se=se, rehearsal_of=key)
    return raw


def _r5(raw: dict[str, Any]) -> dict[str, Any]:
    """The shipped file as it is, once it is checked to still search R5's ranges (mnist.yaml, mnist_tpe.yaml)."""
    assert raw["space"] == R5 and "epochs" not in raw["fixed"], f"{raw['name']}.yaml no longer searches R5's ranges"
    assert {k: raw["search"].get(k) for k in R5_SCALING} == R5_SCALING, f"{raw['name']}.yaml: not R5's lr scaling"
    return raw


def _t1(raw: dict[str, Any]) -> dict[str, Any]:
    raw = _r1(raw)
    raw["planner"].update(accuracy_spread=0.2230, loss_per_noise_doubling=0.3507)  # proxy_priors_mnist_v1.md
    return raw


def _g(raw: dict[str, Any]) -> dict[str, Any]:
    raw = lr_only_scaled(raw)
    raw["privacy"].update(selection="best_score", score_noise=GAUSSIAN_SCORE)
    return raw


for _mode in (
    AutoSearch(),
    _named("search", None, "(search) the space's own search + final", "(search) --space's own search, as dptune "
           "search runs it, + the final run dptune train trains."),
    _named("R", "mnist.yaml", "(R) random search, random stopping, whole space (mnist.yaml as first declared)",
           "(R) mnist.yaml as first declared (B 64-1024, lr 0.1-6.4).", edit=_r1),
    _named("R2", "mnist.yaml", "(R2) random search, random stopping, B ∈ {256, 1024}, lr 0.4-3.2 (mnist.yaml v2)",
           "(R2) mnist.yaml's second version (epochs 5 or 10, lr 0.4-3.2).", edit=_r2),
    _named("R3", "mnist.yaml", "(R3) random search, random stopping, B ∈ {256, 1024}, lr 0.8-3.2, E 10 (mnist.yaml v3)",
           "(R3) mnist.yaml's third version (epochs 10).", edit=_r3),
    _named("R4", "mnist.yaml", "(R4) random search, random stopping, R3 with E ∈ {10, 20} (mnist.yaml v4)",
           "(R4) mnist.yaml's fourth version (lr 0.8-3.2 at every batch size).", edit=_r4),
    _named("R5", "mnist.yaml", "(R5) random search, random stopping, R4 with lr L·√(B/256), L 0.8-1.6 (mnist.yaml v5)",
           "(R5) mnist.yaml as shipped.", edit=_r5),
    _named("T", "mnist_tpe.yaml", "(T) TPE, composed, whole space (mnist_tpe.yaml as first declared)",
           "(T) mnist_tpe.yaml as first declared (B 64-1024, lr 0.1-6.4).", edit=_t1),
    _named("T2", "mnist_tpe.yaml", "(T2) TPE, composed, B ∈ {256, 1024}, lr 0.4-3.2 (mnist_tpe.yaml v2)",
           "(T2) mnist_tpe.yaml's second version (R2's space).", edit=_r2),
    _named("T3", "mnist_tpe.yaml", "(T3) TPE, composed, B ∈ {256, 1024}, lr 0.8-3.2, E 10 (mnist_tpe.yaml v3)",
           "(T3) mnist_tpe.yaml's third version (R3's space).", edit=_r3),
    _named("T4", "mnist_tpe.yaml", "(T4) TPE, composed, R4's space (mnist_tpe.yaml v4)",
           "(T4) mnist_tpe.yaml's fourth version (R4's space).", edit=_r4),
    _named("T5", "mnist_tpe.yaml", "(T5) TPE, composed, R5's space (mnist_tpe.yaml v5)",
           "(T5) mnist_tpe.yaml as shipped.", edit=_r5),
    _named("S", "mnist_scaled.yaml", "(S) scaled searcher, B × lr, noisy max (mnist_scaled.yaml)",
           "(S) mnist_scaled.yaml."),
    _named("A", "mnist_alc.yaml", "(A) (S) with adaptive layerwise clipping (mnist_alc.yaml)",
           "(A) mnist_alc.yaml: (S) with adaptive layerwise clipping, (S)'s draw and selection.", key="S"),
    _named("m", "mnist_scaled.yaml", "(m) lr-only scaled searcher, B 256, noisy max (issue 13)",
           "(m) mnist_scaled.yaml made lr-only (B 256, lr 0.2-3.2, one trial each), one noisy max.",
           edit=lr_only_scaled),
    _named("g", "mnist_scaled.yaml", "(g) (m) with a Gaussian score per trial (std 40)",
           "(g) (m)'s candidates and draw, a Gaussian score of std 40 per trial, the best noised score.", key="m",
           edit=_g),
):
    register(_mode)


def verdicts(bench: Bench, modes: list[str], epsilons: list[float]) -> dict[tuple[str, float], Any]:
    """The planner's verdict per search and ε, as ``dptune search`` prints it (priors from each space's public
    proxy, ``planner:``), against the baseline (mode a); only for searches that plan their final run."""
    from dptune.accounting import advise_transfer

    out: dict[tuple[str, float], Any] = {}
    for m in modes:
        mode = _search_mode(m)
        for eps in epsilons:
            space = mode.space(bench, eps) if mode is not None else None
            if space is not None and space.transfers:
                out[m, eps] = advise_transfer(space, bench.n_train, baseline=bench.baseline)
    return out


def _search_mode(name: str) -> SpaceSearch | None:
    mode = MODES.get(name)
    return mode if isinstance(mode, SpaceSearch) else None
