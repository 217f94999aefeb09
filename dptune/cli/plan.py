"""``dptune plan`` (``python -m dptune.plan``): what a trial and a whole search cost, before anything touches data,
from explicit numbers (``--noise-multiplier 1.5 --sampling-rate 0.04 --steps 2250 --delta 1e-5 --stopping poisson
--mean 3 --public-validation``), a search space (``--space search_spaces/digits.yaml``, the worst case over it) or one
derived from the data (``--data digits --target-epsilon 4``). With a space and ``--target-epsilon`` it also prints
budget-split advice: every stopping rule, mean number of trials, score noise, search share and tune fraction priced
side by side, and whether a search can pay at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from dptune.accounting import (
    STOPPING_RULES,
    Advice,
    Plan,
    StoppingRule,
    TrialPoint,
    advise,
    advise_transfer,
    alternative_rules,
    clipping_sensitivity,
    epsilon,
    filter_schedule,
    plan_search,
    plan_transfer,
    sigma_floor,
    stopping_rule,
    worst_case_event,
)
from dptune.cli._common import add_space_arguments, auto_text, run_cli, space_from_args
from dptune.config import (
    ConfigError,
    DatasetSpec,
    PrivacySpec,
    SearchSpace,
    TrialConfig,
    check_privacy,
    check_space,
    load_space,
    nominal_train_size,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptune.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_space_arguments(p, required=False)
    p.add_argument("--n-train", type=int, help="training-set size (needed for imagefolder; overrides the nominal size)")
    p.add_argument("--noise-multiplier", type=float)
    p.add_argument("--sampling-rate", type=float)
    p.add_argument("--steps", type=int)
    p.add_argument("--delta", type=float)
    p.add_argument("--stopping", help=" | ".join(STOPPING_RULES))
    p.add_argument("--mean", type=float, help="mean number of trials (poisson, tnb)")
    p.add_argument("--eta", type=float, help="TNB shape: 0 logarithmic, 1 geometric (default 1); = --setting eta=…")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE", help="a stopping-rule setting")
    p.add_argument("--trials", type=int, help="number of trials (composed)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--score-noise", type=float, help="std of the Gaussian noise on the validation correct-count")
    g.add_argument("--public-validation", action="store_true", help="the validation split is public: scores are free")
    p.add_argument("--target-epsilon", type=float, help="also find the smallest noise-multiplier lower bound that fits")
    p.add_argument("--tune-fraction", type=float,
                   help="run the search on a Poisson subsample of this fraction of the training data (0 < f <= 1)")
    p.add_argument("--accuracy-spread", type=float,
                   help="advice prior: std of validation accuracy across the space's configs (default: the space's "
                   "planner.accuracy_spread, measured on its public proxy; 0.10 without one)")
    p.add_argument("--loss-per-doubling", type=float,
                   help="advice prior: accuracy lost when the final model's noise-to-signal doubles (default: the "
                   "space's planner.loss_per_noise_doubling; 0.15 without one)")
    p.add_argument("--min-gain", type=float,
                   help="advice: the smallest expected gain (accuracy) worth a search (default: planner.min_gain, 0.005)")
    p.add_argument("--baseline", help="a search that plans its final run: a space file whose default config is the "
                   "no-search alternative (default: this space's own default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", help="also draw epsilon vs mean trials per stopping rule to this PNG file")
    return p


def _rule(args: argparse.Namespace, privacy: PrivacySpec) -> StoppingRule:
    """The catalogue's rule from the flags, else the space's privacy settings; errors name what set them."""
    name = args.stopping or privacy.stopping
    cls = STOPPING_RULES.get(name)
    trials = args.trials if cls is not None and not cls.random_stopping else None  # --trials: a fixed K
    if trials is not None and trials < 1:
        raise ConfigError("--trials", f"{trials} is < 1", "run at least one trial")
    mean = trials if trials is not None else args.mean if args.mean is not None else privacy.mean
    settings = dict(privacy.stopping_settings) if name == privacy.stopping else {}
    flags = {"privacy.stopping": "--stopping" if args.stopping else None,
             "privacy.mean": "--trials" if trials is not None else "--mean" if args.mean is not None else None}
    for item in [*args.setting, *([f"eta={args.eta}"] if args.eta is not None else [])]:
        key, value = (part.strip() for part in item.partition("=")[::2])
        try:
            settings[key] = float(value)
        except ValueError:
            raise ConfigError("--setting", f"{item!r} is not NAME=NUMBER", "e.g. --setting eta=0") from None
        flags[f"privacy.{key}"] = flags[f"privacy.stopping.{key}"] = "--eta" if key == "eta" and args.eta is not None else "--setting"
    try:
        return stopping_rule(name, mean=mean, **settings)
    except ConfigError as e:
        flag = flags.get(e.field)
        raise (e.renamed(flag) if flag else e) from e


def _explicit_plan(args: argparse.Namespace) -> Plan:
    missing = [f"--{n.replace('_', '-')}" for n in ("noise_multiplier", "sampling_rate", "steps", "delta")
               if getattr(args, n) is None]
    if missing:
        raise ConfigError(missing[0], "is required without --space", "give --noise-multiplier, --sampling-rate, "
                          "--steps and --delta, or a search space with --space")
    if args.score_noise is None and not args.public_validation:
        raise ConfigError("--score-noise", "releasing a private validation score needs noise",
                          "give --score-noise S (std on the correct-count) or --public-validation")
    if not 0 < args.delta < 1:
        raise ConfigError("--delta", f"{args.delta!r} is not in (0, 1)", "choose e.g. 1e-5")
    rule = _rule(args, PrivacySpec(delta=args.delta, mean=args.mean or 1.0, score_noise=args.score_noise))
    point = TrialPoint(noise_multiplier=args.noise_multiplier, sampling_rate=args.sampling_rate, steps=args.steps,
                       score_noise=args.score_noise)
    try:
        t_event = worst_case_event([point])
    except ConfigError as e:
        raise e.renamed(f"--{e.field.replace('_', '-')}") from e
    s_event = rule.search_event(t_event)
    alts = {other.label(): epsilon([other.search_event(t_event)], args.delta) for other in alternative_rules(rule)}
    return Plan(stopping=rule, delta=args.delta, points=[point], trial_event=t_event, search_event=s_event,
                trial_epsilon=epsilon([t_event], args.delta), search_epsilon=epsilon([s_event], args.delta),
                n_train=0, alternatives=alts)


def _space_plan(args: argparse.Namespace) -> tuple[Plan, SearchSpace]:
    space = space_from_args(args, n_train=args.n_train)
    n = args.n_train or nominal_train_size(space.dataset)
    if n is None:
        raise ConfigError("--n-train", f"the size of dataset {space.dataset.name!r} is not known without reading it",
                          "pass --n-train N (number of training examples)")
    if n < 1:
        raise ConfigError("--n-train", f"{n} is < 1", "give the number of training examples")
    if args.delta is not None:
        if not 0 < args.delta < 1:
            raise ConfigError("--delta", f"{args.delta!r} is not in (0, 1)", "choose e.g. 1e-5")
        space = space.with_privacy(delta=args.delta)
    check_privacy(space.privacy, space.dataset.public_validation)
    if space.transfers and args.target_epsilon is not None:  # the trials and final run are sized from it
        space = space.with_privacy(target_epsilon=args.target_epsilon)
    if args.tune_fraction is not None:
        space = dataclasses.replace(space, tune_fraction=args.tune_fraction)
    try:
        check_space(space)  # the overrides too (--tune-fraction on a space that plans its final run: refused)
        plan = plan_search(space, n, _rule(args, space.privacy))
    except ConfigError as e:
        if e.field != "search.tune_fraction" or args.tune_fraction is None:
            raise
        raise ConfigError("--tune-fraction", e.problem, e.fix.replace("remove search.tune_fraction", "drop --tune-fraction")) from e
    return plan, space


def _per_example(space: SearchSpace) -> SearchSpace:
    """``space`` with per-example clipping wherever it clips the batch (the same σ, q, T, score noise)."""
    rest = {k: v for k, v in space.space.items() if k != "clipping"}
    return dataclasses.replace(space, fixed=space.fixed.replace(clipping="auto"),
                               default=space.default.replace(clipping="auto"), space=rest)


def _summary(plan: Plan) -> dict[str, Any]:
    worst = max(plan.points, key=lambda p: (p.sampling_rate, p.steps))
    return {
        "trial_epsilon": plan.trial_epsilon, "search_epsilon": plan.search_epsilon, "delta": plan.delta,
        "stopping": plan.stopping.describe(), "stopping_label": plan.stopping.label(), "alternatives": plan.alternatives,
        "worst_case": {"noise_multiplier": worst.noise_multiplier, "points": len(plan.points),
                       "max_sampling_rate": max(p.sampling_rate for p in plan.points),
                       "max_steps": max(p.steps for p in plan.points), "score_noise": worst.score_noise},
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def body() -> int:
        if args.tune_fraction is not None:
            if not (math.isfinite(args.tune_fraction) and 0 < args.tune_fraction <= 1):
                raise ConfigError("--tune-fraction", f"{args.tune_fraction!r} is not in (0, 1]",
                                  "choose e.g. 0.25, or 1 for no subsampling")
            if not (args.space or args.data):
                raise ConfigError("--tune-fraction", "needs a search space", "pass --space FILE")
        if args.target_epsilon is not None and not (math.isfinite(args.target_epsilon) and args.target_epsilon > 0):
            raise ConfigError("--target-epsilon", f"{args.target_epsilon!r} must be > 0", "choose e.g. 4")
        plan, space = _space_plan(args) if args.space or args.data else (_explicit_plan(args), None)
        out = _summary(plan)
        if space is not None:
            out["tune_fraction"] = space.tune_fraction
            if space.scheduler == "asha":  # what the RDP filter admits, rung by rung
                out["asha"] = filter_schedule(space, plan)
            if space.auto is not None:  # space: auto: the derived space, as the search shows and releases it
                from dptune.release import public_auto
                out["auto"] = public_auto(space)
            if clipping_sensitivity(space) > 1:  # what BatchNorm costs: the same σ, q, T clipped per example
                per_example = plan_search(_per_example(space), plan.n_train, plan.stopping, compare=False)
                out["batch_clipping"] = {"sensitivity": clipping_sensitivity(space),
                                         "per_example_trial_epsilon": per_example.trial_epsilon,
                                         "per_example_search_epsilon": per_example.search_epsilon}
        if space is not None and space.transfers:
            out["transfer"] = _transfer_json(args, space, plan)
        elif args.target_epsilon is not None:
            if space is None:
                space = _explicit_space(args, plan)
            # the exact charge the search will pay (plan_search, subsampled when tune_fraction < 1)
            floor = sigma_floor(space, plan.n_train or 10**6, target_epsilon=args.target_epsilon,
                                stopping=plan.stopping)
            out["target_epsilon"] = args.target_epsilon
            out["noise_multiplier_floor"] = floor
            if args.space or args.data:
                pr = _priors(args, space)
                out["advice"] = _advice_json(advise(
                    space, plan.n_train, target_epsilon=args.target_epsilon, accuracy_spread=pr["accuracy_spread"],
                    loss_per_noise_doubling=pr["loss_per_noise_doubling"], min_gain=pr["min_gain"]))
        if args.plot:
            if not args.plot.lower().endswith(".png") or not Path(args.plot).resolve().parent.is_dir():
                raise ConfigError("--plot", f"{args.plot!r} is not a .png path in an existing folder",
                                  "give e.g. --plot stopping.png")
            from dptune.plots import stopping_rule_figure

            stopping_rule_figure(plan.trial_event, plan.delta, out=args.plot, mark=plan.stopping,
                                 tune_fraction=space.tune_fraction if space is not None else 1.0)
            out["plot"] = args.plot
        if args.json:
            print(json.dumps(out))
        else:
            _print(out)
        return 0

    return run_cli(body)


def _explicit_space(args: argparse.Namespace, plan: Plan) -> SearchSpace:
    # one point as a space: q = B/n with n = 10^6 and B = q·n, so sigma_floor can vary σ alone
    n = 10**6
    b = max(1, round(args.sampling_rate * n))
    epochs = args.steps * b / n
    fixed = TrialConfig(batch_size=b, epochs=epochs, noise_multiplier=args.noise_multiplier,
                        score_noise=args.score_noise)
    privacy = PrivacySpec(delta=args.delta, score_noise=args.score_noise)
    return SearchSpace("explicit", DatasetSpec(public_validation=args.score_noise is None), fixed, {}, fixed, privacy)


def _priors(args: argparse.Namespace, space: SearchSpace) -> dict[str, float]:
    """The advice priors: the flags, else the space's ``planner`` section (measured on its public proxy)."""
    pr = space.planner
    values = {"accuracy_spread": pr.accuracy_spread if args.accuracy_spread is None else args.accuracy_spread,
              "loss_per_noise_doubling": pr.loss_per_noise_doubling if args.loss_per_doubling is None
              else args.loss_per_doubling,
              "min_gain": pr.min_gain if args.min_gain is None else args.min_gain}
    for flag, key in (("--accuracy-spread", "accuracy_spread"), ("--loss-per-doubling", "loss_per_noise_doubling")):
        if not (math.isfinite(values[key]) and values[key] > 0):
            raise ConfigError(flag, f"{values[key]!r} must be > 0", "give a prior from a public proxy task, e.g. 0.02")
    if not (math.isfinite(values["min_gain"]) and values["min_gain"] >= 0):
        raise ConfigError("--min-gain", f"{values['min_gain']!r} must be >= 0", "choose e.g. 0.005 (half a point)")
    return values


def _transfer_json(args: argparse.Namespace, space: SearchSpace, plan: Plan) -> dict[str, Any]:
    """The trials, final runs and verdict of a search that plans its final run (``privacy.target_epsilon`` or
    --target-epsilon), from the plan printed above it (its stopping rule, the flags' too; computed once)."""
    try:
        baseline = load_space(args.baseline).default if args.baseline else None
    except ConfigError as e:
        raise ConfigError("--baseline", f"{args.baseline}: {e.field}: {e.problem}", e.fix) from e
    pr = _priors(args, space)
    tp = plan_transfer(space, plan, final_n=plan.n_train + space.dataset.validation_size)
    a = advise_transfer(space, plan.n_train, baseline=baseline, planned=(plan, tp), min_gain=pr["min_gain"],
                        accuracy_spread=pr["accuracy_spread"], loss_per_noise_doubling=pr["loss_per_noise_doubling"])
    p = a.plan
    sel = space.privacy
    return {"searcher": space.searcher, "selection": {"rule": sel.selection, "noise": sel.score_noise},
            "target_epsilon": a.target_epsilon, "search_epsilon": a.search_epsilon,
            "trial_noise_multiplier": p.trial_sigma, "expected_trials": a.expected_trials,
            "final_noise_multipliers": [{"batch_size": b, "epochs": e, "noise_multiplier": sf}
                                        for b, e, sf in p.final_sigmas],
            "candidates": [dict(c) for c in p.candidates],
            "final_n": p.final_n, "lr_reference_batch": p.lr_reference_batch, "lr_batch_power": p.lr_batch_power,
            "baseline": args.baseline or ("planner.baseline" if space.planner.baseline else "default"),
            "baseline_noise_multiplier": a.baseline_sigma, "noise_ratio": a.noise_ratio, "transfer": a.transfer,
            "expected_gain": a.expected_gain, "proxy": a.proxy, "rehearsed": a.rehearsed,
            "rehearsed_se": a.rehearsed_se, "rehearsal_basis": a.rehearsal_basis, "pays": a.pays,
            "verdict": a.verdict, "priors": {**a.priors, "min_gain": a.min_gain}}


def _advice_json(a: Advice, top: int = 10) -> dict[str, Any]:
    rows = [{"stopping": c.stopping.label(), "mean": c.stopping.mean, "score_noise": c.score_noise,
             "score_error": c.score_error, "tune_fraction": c.tune_fraction, "search_share": c.search_share,
             "search_noise_multiplier": c.search_sigma, "search_epsilon": c.search_epsilon,
             "final_noise_multiplier": c.final_sigma, "final_batch_size": c.final_batch_size,
             "final_steps": c.final_steps, "total_epsilon": c.total_epsilon, "noise_penalty": c.noise_penalty,
             "expected_gain": c.expected_gain, "proxy": c.proxy} for c in a.candidates[:top]]
    return {"can_pay": a.can_pay, "verdict": a.verdict, "baseline_noise_multiplier": a.baseline_sigma,
            "fixed_cost_epsilon": a.fixed_cost_epsilon, "candidates": rows, "n_candidates": len(a.candidates),
            "suggestions": list(a.suggestions)}


def _print_advice(a: dict[str, Any]) -> None:
    print("\nbudget-split advice (best first; proxy = expected selection gain - loss from the final model's "
          "extra noise, accuracy units):")
    if a["baseline_noise_multiplier"] is not None:
        print(f"  no search (default config, whole budget): noise_multiplier {a['baseline_noise_multiplier']:.3g}")
    print(f"  {'stopping':<28} {'score':>6} {'f':>5} {'share':>5} {'sigma_s':>7} {'eps_s':>6} {'sigma_f':>7} "
          f"{'eps':>6} {'noise x':>7} {'proxy':>7}")
    for r in a["candidates"]:
        sn = "public" if r["score_noise"] is None else f"{r['score_noise']:.3g}"
        print(f"  {r['stopping']:<28} {sn:>6} {r['tune_fraction']:>5g} {r['search_share']:>5.0%} "
              f"{r['search_noise_multiplier']:>7.3g} {r['search_epsilon']:>6.3f} {r['final_noise_multiplier']:>7.3g} "
              f"{r['total_epsilon']:>6.3f} {r['noise_penalty']:>7.2f} {r['proxy']:>+7.3f}")
    print(("  " if a["can_pay"] else "  NOTE: ") + a["verdict"])
    if not a["can_pay"]:
        print("  what would help:")
        for tip in a["suggestions"]:
            print(f"    - {tip}")


def _score_label(out: dict[str, Any], score_noise: float | None) -> str:
    if score_noise is not None:
        return f"{score_noise:g}"
    noisy_max = out.get("transfer", {}).get("selection", {}).get("rule") == "noisy_max"
    return "none per trial (one noisy max selects)" if noisy_max else "public"


def _print(out: dict[str, Any]) -> None:
    if "auto" in out:
        print(auto_text(out["auto"]))
    w = out["worst_case"]
    sens = out.get("batch_clipping", {}).get("sensitivity", 1.0)
    label = "sigma" if sens == 1 else f"sigma/{sens:g}"
    print(f"one trial (worst case over {w['points']} reachable point(s): {label} >= {w['noise_multiplier']:g}, "
          f"q <= {w['max_sampling_rate']:.4g}, T <= {w['max_steps']}, score noise "
          f"{_score_label(out, w['score_noise'])}):  "
          f"epsilon = {out['trial_epsilon']:.4f} at delta = {out['delta']:g}")
    if "batch_clipping" in out:
        bc = out["batch_clipping"]
        print(f"batch clipping: one example moves the clipped batch mean by up to {bc['sensitivity']:g}C, so each "
              f"step is charged at sigma / {bc['sensitivity']:g}; per-example clipping at the same "
              f"sigma, q, T would cost epsilon = {bc['per_example_trial_epsilon']:.4f} per trial, "
              f"{bc['per_example_search_epsilon']:.4f} for the whole search: the difference is what BatchNorm costs")
    if out.get("tune_fraction", 1.0) < 1:
        print(f"search on a Poisson subsample of {out['tune_fraction']:g} of the training data "
              "(Zhu & Wang 2019, Thm. 6; score releases on the full validation split are not amplified)")
    print(f"whole search, {out['stopping_label']}:  epsilon = {out['search_epsilon']:.4f} at delta = {out['delta']:g}")
    if "asha" in out:
        print(out["asha"]["text"])
    print("other stopping rules at the same mean, side by side:")
    for label, eps in out["alternatives"].items():
        print(f"  {label:<34} epsilon = {eps:.4f}")
    if "target_epsilon" in out:
        floor = out["noise_multiplier_floor"]
        if floor is None:
            print(f"target epsilon {out['target_epsilon']:g}: no noise multiplier fits — the score release and the "
                  "stopping rule alone cost more; use more score noise, a public validation split or fewer trials")
        else:
            print(f"target epsilon {out['target_epsilon']:g}: noise_multiplier lower bound >= {floor:.4f}")
    if "advice" in out:
        _print_advice(out["advice"])
    if "transfer" in out:
        _print_transfer(out["transfer"])


def _print_transfer(s: dict[str, Any]) -> None:
    print(f"\n{s['searcher']} searcher planning its final run, total epsilon {s['target_epsilon']:g} (search "
          f"{s['search_epsilon']:.4f} + final run, composed: the smallest valid bound, RDP or PLD):")
    scale, sc = (f" x (B/{ref})^{s['lr_batch_power']:g}" if (ref := s.get("lr_reference_batch")) else ""), s["trial_noise_multiplier"]
    print(f"  trials at noise multiplier {sc:.4g}, each with lr = L{scale} x sigma_f(B, E) / {sc:.4g} (L: the final "
          f"run's lr{f' at batch size {ref}' if ref else ''}; the same update noise lr x sigma)")
    print(f"  final run on {s['final_n']} examples (train + validation), noise multiplier per batch size and epochs: "
          + ", ".join(f"B {f['batch_size']} E {f['epochs']:g}: {f['noise_multiplier']:.4g}"
                      for f in s["final_noise_multipliers"]))
    if s["candidates"]:
        print(f"  {len(s['candidates'])} candidates, each tried once: " + "; ".join(
            ", ".join(f"{k} {v:g}" for k, v in c.items()) for c in s["candidates"]))
    sel = s["selection"]
    if sel["rule"] == "noisy_max":
        print(f"  selection: one report-noisy-max (Gumbel scale {sel['noise']:g} on each trial's validation "
              "correct-count), charged once; the trials release no score")
    else:
        print(f"  selection: each trial's validation score released with Gaussian noise (std {sel['noise']:g} on "
              "the correct-count), the best wins")
    print(f"  baseline ({s['baseline']}): trained once with the whole budget at noise multiplier "
          f"{s['baseline_noise_multiplier']:.4g}; priors from {s['priors']['proxy']}")
    print(("  " if s["pays"] else "  NOTE: ") + s["verdict"])


if __name__ == "__main__":
    sys.exit(main())
