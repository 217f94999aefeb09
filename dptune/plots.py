"""Matplotlib figures for dptune, as functions of plain data that return PNG bytes.

Each figure is built on its own :class:`matplotlib.figure.Figure` with the Agg canvas, never through
``pyplot``: no global figure state, no GUI backend, safe in a headless CLI or a Ray driver.
No torch, no ray: these take numbers (or dp_accounting events) and draw them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib.dates as mdates
from dp_accounting import dp_event as de
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dptune.accounting import StoppingRule, comparison_rules, epsilon, subsampled_search_event

__all__ = ["DEFAULT_MEANS", "ledger_figure", "score_figure", "stopping_rule_figure", "stopping_rule_table"]

DEFAULT_MEANS: tuple[int, ...] = tuple(range(1, 31))

def _png(fig: Figure, out: str | Path | None) -> bytes:
    FigureCanvasAgg(fig)  # attaches the Agg canvas to the figure
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    data = buf.getvalue()
    if out is not None:
        Path(out).write_bytes(data)
    return data


# --------------------------------------------------------------------------------------------------
# (b) ε against the mean number of trials, per stopping rule


def stopping_rule_table(trial_event: de.DpEvent, delta: float, means: Sequence[float] = DEFAULT_MEANS, *,
                        tune_fraction: float = 1.0) -> dict[str, list[tuple[float, float]]]:
    """ε of the whole search at ``delta`` for each stopping rule and mean: ``{family: [(mean, ε), ...]}``.

    The rules are the catalogue's (``comparison_rules``; composition, the baseline random stopping must beat,
    at whole numbers of trials only). Each point goes through :meth:`StoppingRule.search_event`, the
    subsampling of ``tune_fraction`` and :func:`dptune.accounting.epsilon`, i.e. exactly what the planner,
    the ledger and the certificate charge.
    """
    table: dict[str, dict[float, float]] = {}
    for m in means:
        for rule in comparison_rules(m):
            charge = subsampled_search_event(rule.search_event(trial_event), fraction=tune_fraction)
            table.setdefault(rule.family(), {})[float(rule.mean)] = epsilon([charge], delta)
    return {family: sorted(points.items()) for family, points in table.items()}


def stopping_rule_figure(trial_event: de.DpEvent, delta: float, means: Sequence[float] = DEFAULT_MEANS,
                         out: str | Path | None = None, *, mark: StoppingRule | None = None,
                         tune_fraction: float = 1.0) -> bytes:
    """PNG of ε (at ``delta``) against the mean number of trials for Poisson, TNB η=0, TNB η=1 and composition.

    ``trial_event``: one (worst-case) trial, e.g. ``Plan.trial_event`` or the ``.event`` of a
    certificate's search event. ``means``: the x values (each ≥ 1). ``out``: also write the PNG there.
    ``mark``: a rule to highlight (the one a run used). ``tune_fraction``: the run's subsample (1: none).
    Returns the PNG bytes.
    """
    if not means or any(not (math.isfinite(m) and m >= 1) for m in means):
        raise ValueError(f"means must be finite and >= 1, got {list(means)!r}")
    table = stopping_rule_table(trial_event, delta, means, tune_fraction=tune_fraction)
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    styles = ("o-", "s-", "^-", "k--")
    for i, (label, points) in enumerate(table.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, styles[i % len(styles)], label=label, markersize=3, linewidth=1.4)
    if mark is not None:
        eps = epsilon([subsampled_search_event(mark.search_event(trial_event), fraction=tune_fraction)], delta)
        ax.plot([mark.mean], [eps], "*", color="crimson", markersize=16, zorder=5,
                label=f"this run: {mark.label()}, ε = {eps:.3g}")
    ax.set_xlabel("mean number of trials E[K]")
    ax.set_ylabel(f"ε of the whole search (δ = {delta:g})")
    ax.set_title("Cost of a search: random stopping (Papernot & Steinke 2022) vs composition")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig, out)


# --------------------------------------------------------------------------------------------------
# (a) score against each searched hyperparameter


def _failed(row: Mapping[str, Any]) -> str | None:
    """Why a trial has no usable score ('crashed' / 'diverged' / 'no score'), or None."""
    if row.get("crashed"):
        return "crashed"
    if row.get("diverged"):
        return "diverged"
    s = row.get("score")
    return "no score" if s is None or not math.isfinite(float(s)) else None


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def score_figure(trials: Sequence[Mapping[str, Any]], params: Sequence[str]) -> bytes:
    """PNG: one panel per hyperparameter in ``params``, the trials' scores against its value.

    ``trials``: rows with ``params`` (a dict), ``score`` and optional ``crashed``/``diverged``. Trials
    whose score is -inf/None (crashed or diverged) are drawn below every real score, marked by reason.
    """
    names = list(params) or ["(no hyperparameters)"]
    ncols = min(2, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig = Figure(figsize=(6.0 * ncols, 3.6 * nrows), layout="constrained")
    ok = [float(r["score"]) for r in trials if _failed(r) is None]
    lo, hi = (min(ok), max(ok)) if ok else (0.0, 1.0)
    span = (hi - lo) or 1.0
    floor = lo - 0.25 * span  # where failed trials sit: below every real score
    markers = {"crashed": ("x", "tab:red"), "diverged": ("v", "tab:orange"), "no score": ("D", "tab:gray")}
    for i, name in enumerate(names):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        values = [r["params"].get(name) for r in trials]
        present = [v for v in values if v is not None]
        # whole-number choices (batch size, groups) read best as evenly spaced categories
        categorical = not _numeric(present) or all(isinstance(v, int) for v in present)
        cats = sorted({v for v in present}, key=lambda v: (not _numeric([v]), v if _numeric([v]) else str(v)))
        cats = [str(v) for v in cats] if categorical else []
        if categorical and len(present) < len(values):
            cats.append("None")

        def x_of(v: Any, cats: list[str] = cats, categorical: bool = categorical) -> float:
            return float(cats.index(str(v))) if categorical else float(v)

        good = [(x_of(r["params"].get(name)), float(r["score"])) for r in trials if _failed(r) is None]
        if good:
            ax.scatter([x for x, _ in good], [y for _, y in good], s=28, color="tab:blue", label="trial", zorder=3)
        for reason, (marker, colour) in markers.items():
            bad = [x_of(r["params"].get(name)) for r in trials if _failed(r) == reason]
            if bad:
                ax.scatter(bad, [floor] * len(bad), marker=marker, s=40, color=colour, label=reason, zorder=3)
        if not trials:
            ax.text(0.5, 0.5, "the search drew no trials", ha="center", va="center", transform=ax.transAxes)
        elif len(good) < len(trials):
            ax.axhline(lo - 0.12 * span, color="gray", linewidth=0.8, linestyle=":")
        if categorical:
            ax.set_xticks(range(len(cats)), cats)
        else:
            xs = [x_of(v) for v in values if v is not None]
            if xs and min(xs) > 0 and max(xs) / min(xs) > 20:  # e.g. learning rates searched on a log scale
                ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("score")
        ax.grid(True, alpha=0.3)
        if i == 0 and trials:
            ax.legend(fontsize=8)
    fig.suptitle(f"Score of every trial (sealed; {len(trials)} trials) — failed trials at the bottom")
    return _png(fig, None)


# --------------------------------------------------------------------------------------------------
# (c) the ledger: cumulative ε per dataset over time


def ledger_figure(series: Mapping[str, Sequence[tuple[float, float]]],
                  budgets: Mapping[str, float | None] | None = None) -> bytes:
    """PNG of cumulative ε (composed, never added) after each charge, per dataset.

    ``series``: ``{dataset label: [(created unix time, cumulative ε), ...]}`` in order of creation.
    ``budgets``: ``{dataset label: budget ε}`` drawn as dashed lines in the dataset's colour.
    """
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    all_times: list[float] = []
    for i, (label, points) in enumerate(series.items()):
        colour = f"C{i % 10}"
        if not points:
            continue
        times = [float(mdates.date2num(datetime.fromtimestamp(t))) for t, _ in points]
        eps = [e for _, e in points]
        all_times += times
        # ε jumps at each charge and stays there: a post-step line from 0, a marker per charge
        ax.step([times[0], *times], [0.0, *eps], where="post", color=colour, label=f"{label} spent")
        ax.plot(times, eps, "o", color=colour, markersize=4)
        budget = (budgets or {}).get(label)
        if budget is not None:
            ax.axhline(budget, color=colour, linestyle="--", linewidth=1, label=f"{label} budget ε = {budget:g}")
    if all_times:
        # at least ±30 min around the charges: one charge alone would otherwise get a years-wide axis
        pad = max(0.05 * (max(all_times) - min(all_times)), 1 / 48)
        ax.set_xlim(min(all_times) - pad, max(all_times) + pad)
    else:
        ax.text(0.5, 0.5, "the ledger holds no charges", ha="center", va="center", transform=ax.transAxes)
    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set_xlabel("time of charge")
    ax.set_ylabel("cumulative ε (composed)")
    ax.set_ylim(bottom=0)
    ax.set_title("Privacy ledger: spend per dataset")
    ax.grid(True, alpha=0.3)
    if all_times:
        ax.legend(fontsize=8)
    return _png(fig, None)
