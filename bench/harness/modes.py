"""The mode interface and its registry: a mode is one way of choosing the config a final run trains (or of
releasing a model), evaluated on every row beside the baseline (a).

A mode plans once per total ε in the main process (:meth:`Mode.plan`: the charge, σ, the stopping rule; a
picklable value), then runs once per row in a worker (:meth:`Mode.run`: a record with its test accuracy under
``test``, or one sub-record per reported mode). A new mode is a :class:`Mode` subclass and one :func:`register`
call in its module; ``harness.runner.load_modes`` imports the modules that register them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from harness.context import Bench

MODES: dict[str, Mode] = {}


class Mode:
    """One mode. ``name`` is its task's name in the records; ``reports`` the modes its record measures (mode n's
    task also measures f); ``titles`` each reported mode's line in the report."""

    name: ClassVar[str]
    reports: ClassVar[tuple[str, ...]] = ()
    titles: ClassVar[dict[str, str]] = {}
    doc: ClassVar[str] = ""  # what it runs, one paragraph for the report

    def plan(self, bench: Bench, eps: float) -> Any:
        """What this mode runs at total ``eps`` (computed once, before any row)."""
        return None

    def run(self, bench: Bench, plan: Any, eps: float, seed: int, data: Any, merged: Any) -> dict[str, Any]:
        """One row: a record with ``test`` (or one sub-record per reported mode) and what the report shows."""
        raise NotImplementedError

    def privacy(self, bench: Bench, eps: float, plan: Any, records: list[dict[str, Any]]) -> tuple[str, str, str]:
        """(plan, trial σ, search ε) of the report's privacy table (``records``: this ε's rows, maybe old .json)."""
        search = [r["eps_search"] for r in records if "eps_search" in r]
        return "", "–", f"{max(search):.4f}" if search else "–"

    def cell(self, record: dict[str, Any]) -> str:
        """The per-row cell: K drawn, the released config and its test accuracy."""
        return released_cell(record)


def register(mode: Mode) -> Mode:
    if mode.name in MODES:
        raise ValueError(f"mode {mode.name!r} is registered twice")
    MODES[mode.name] = mode
    return mode


def measured(record: dict[str, Any], mode: str) -> dict[str, Any]:
    """The (sub-)record that measured ``mode`` (mode n's task record holds n and f)."""
    return record[mode] if isinstance(record.get(mode), dict) and "test" in record[mode] else record


def released_cell(r: dict[str, Any]) -> str:
    """"K k: released config → test %" from a record of this harness or of the benches it replaced."""
    released = r.get("released") or {"batch_size": r.get("batch_size"), "learning_rate": r.get("lr")}
    short = {"batch_size": "B", "learning_rate": "lr"}
    rel = ", ".join(f"{short.get(k, k)} {v:.3g}" if isinstance(v, float) else f"{short.get(k, k)} {v}"
                    for k, v in sorted(released.items()) if k not in ("layer_clip", "noise_multiplier") and v is not None)
    k = f"K {r['k']}: " if "k" in r else ""
    return f"{k}{rel} → {100 * r['test']:.1f}"
