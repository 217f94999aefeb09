"""Bad user input, and the one set of checks that say so (the bottom layer: stdlib only).

Every problem is a :class:`ConfigError` that names the field, says what is wrong and how to fix it; the
CLIs turn it into one line on stderr and exit status 2, before anything is charged or run. Library code
names *fields* (``privacy.delta``, ``target_epsilon``); a CLI maps fields to its flags.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ConfigError", "check_delta", "check_positive", "check_unit_interval"]


class ConfigError(ValueError):
    """Bad user input: names the field, what is wrong, and how to fix it (CLIs exit with status 2)."""

    def __init__(self, field_name: str, problem: str, fix: str) -> None:
        self.field = field_name
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field_name}: {problem}; {fix}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str]]:  # picklable (worker processes)
        return (type(self), (self.field, self.problem, self.fix))

    def renamed(self, field_name: str) -> ConfigError:
        """The same error under another field name (e.g. the CLI flag that set it)."""
        return ConfigError(field_name, self.problem, self.fix)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def check_positive(field: str, value: Any, fix: str) -> float:
    """``value`` is a finite number > 0."""
    if not (_is_number(value) and value > 0):
        raise ConfigError(field, f"{value!r} must be > 0", fix)
    return float(value)


def check_unit_interval(field: str, value: Any, fix: str, *, include_one: bool = False) -> float:
    """``value`` lies in (0, 1), or (0, 1] with ``include_one``."""
    ok = _is_number(value) and value > 0 and (value <= 1 if include_one else value < 1)
    if not ok:
        raise ConfigError(field, f"{value!r} is not in (0, {'1]' if include_one else '1)'}", fix)
    return float(value)


def check_delta(field: str, delta: Any, n: float | None = None) -> float:
    """δ in (0, 1), and below 1/n when the number of protected examples n is known: δ ≥ 1/n admits the
    mechanism that publishes one random example in the clear."""
    d = check_unit_interval(field, delta, "choose e.g. 1e-5 (well below 1/n, n = number of examples)")
    if n is not None and n >= 1 and d >= 1.0 / n:
        raise ConfigError(field, f"{d:g} is not below 1/n = {1.0 / n:.3g} (n = {int(n)} examples): a mechanism that "
                          "publishes a random example in the clear meets such a δ",
                          f"choose δ < {1.0 / n:.3g}, e.g. {10 ** math.floor(math.log10(0.1 / n)):g}")
    return d


def python_m(module: str) -> str:
    """``<this interpreter> -m <module>``: a printed command that runs as printed from any shell, even one where
    ``python`` is another interpreter without dptune's packages (e.g. outside the venv)."""
    import shlex
    import sys

    return f"{shlex.quote(sys.executable or 'python')} -m {module}"
