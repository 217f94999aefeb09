"""Elementary functions for the charged numbers, the same floats on every CPU: exp and log from IEEE-754's basic
operations, and the numpy stand-in that dp_accounting's PLD modules compute with.

Why: numpy picks its ``exp``/``log``/``expm1``/``log1p`` loops at run time by the CPU's features (AVX-512 kernels on
one x86-64 machine, the C library's on another), and they differ in the last bits. A pessimistic PLD rounds millions
of losses up to its grid, so a last-bit difference moves mass by a grid step and the planner's ε in its sixth digit
(an AMD EPYC without AVX-512 against one with it: 5.2635040 against 5.2635117, issue 58).

How: :func:`exp` and :func:`log` are fdlibm's algorithms (Sun 1993; the ones Java's ``StrictMath`` requires so that
results are reproducible on every platform) written as numpy array operations that are each correctly rounded by
IEEE-754 on every CPU (``+ − × ÷``, comparisons, ``rint``, ``frexp``/``ldexp``, which are exact), in a fixed order:
no run-time dispatch, no C library, no fused multiply-add. :func:`expm1` and :func:`log1p` follow from them by
Kahan's and Goldberg's corrections (Goldberg 1991, "What every computer scientist should know about floating-point
arithmetic", Theorem 4), which keep their accuracy near 0 from the same two functions. Complex products (the FFT
convolutions) are written out in real operations: NumPy fuses them where the CPU has FMA3 (:func:`complex_multiply`,
:func:`complex_power`).

Guarantee: each function returns bitwise the same array for the same input on every IEEE-754 machine and numpy
build (``tests/test_strictmath.py`` runs them under numpy's other CPU dispatch); within 1 ulp of the exact value
for exp/log (fdlibm's bound), a few ulp for expm1/log1p; ±inf, NaN and the domain edges as numpy gives them.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["complex_multiply", "complex_power", "exp", "expm1", "log", "log1p", "logaddexp", "make_strict", "strict_numpy"]

# fdlibm e_exp.c: ln2 split so that k·_LN2_HI is exact for |k| < 2^11; P1..P5 its Remez coefficients on [0, 0.347]
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_P = (1.66666666666666019037e-01, -2.77777777770155933842e-03, 6.61375632143793436117e-05,
      -1.65339022054652515390e-06, 4.13813679705723846039e-08)
_EXP_OVERFLOW = 7.09782712893383973096e02  # above: +inf
_EXP_UNDERFLOW = -7.45133219101941108420e02  # below: 0
# fdlibm e_log.c: Lg1..Lg7 approximate (log(1+f) − 2s + s·... )/s on |s| < 0.1716
_LG = (6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01, 2.222219843214978396e-01,
       1.818357216161805012e-01, 1.531383769920937332e-01, 1.479819860511658591e-01)
_SQRT_HALF = 0.70710678118654757274  # fdlibm normalises the mantissa into [√2/2, √2)


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _out(result: np.ndarray, x: Any) -> Any:
    """A numpy scalar for a scalar input (as numpy's ufuncs return), else the array."""
    return result[()] if result.ndim == 0 and np.ndim(x) == 0 else result


def _scalar(x: Any) -> float | None:
    """``x`` as a Python float when it is one number (a library's scalar call: dp_accounting's loops make tens of
    thousands), else None. Python's float operations are IEEE-754 double operations, as NumPy's on float64 arrays, so
    a scalar path that runs the array path's arithmetic (:func:`_exp_reduced`, :func:`_log_reduced`) gives its very
    floats without its per-call overhead (``tests/test_strictmath.py`` compares them bit for bit)."""
    if isinstance(x, float | int | np.floating | np.integer) and not isinstance(x, bool):
        return float(x)
    return None


def _elementwise(scalar: Callable[[float], float]) -> Callable[[Callable[[np.ndarray], np.ndarray]], Callable[[Any], Any]]:
    """One function over a number (``scalar``, in Python floats) or an array (the decorated body, on float64 with
    floating-point warnings off), returning a NumPy scalar or an array as a ufunc does."""
    def wrap(array: Callable[[np.ndarray], np.ndarray]) -> Callable[[Any], Any]:
        @functools.wraps(array)
        def f(x: Any) -> Any:
            if (v := _scalar(x)) is not None:
                return np.float64(scalar(v))
            x = _f64(x)
            with np.errstate(all="ignore"):
                return _out(array(x), x)
        return f
    return wrap


def _exp_reduced(x: Any, k: Any) -> Any:
    """e^(x − k·ln2) for |x − k·ln2| ≤ ln2/2, fdlibm's rational approximation: the same operations on a float and on
    an array (``k`` an int or a float array, exact either way for |k| < 2^11)."""
    hi = x - k * _LN2_HI
    lo = k * _LN2_LO
    r = hi - lo
    t = r * r
    c = r - t * (_P[0] + t * (_P[1] + t * (_P[2] + t * (_P[3] + t * _P[4]))))
    return 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)


def _log_reduced(k: Any, f: Any) -> Any:
    """log(2^k·(1 + f)) for √2/2 ≤ 1 + f < √2, fdlibm's: the same operations on a float and on an array."""
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (_LG[1] + w * (_LG[3] + w * _LG[5]))
    t2 = z * (_LG[0] + w * (_LG[2] + w * (_LG[4] + w * _LG[6])))
    r = t2 + t1
    hfsq = 0.5 * f * f
    return k * _LN2_HI - ((hfsq - (s * (hfsq + r) + k * _LN2_LO)) - f)


def _exp_scalar(x: float) -> float:
    if math.isnan(x) or x > _EXP_OVERFLOW:
        return x if math.isnan(x) else math.inf
    if x < _EXP_UNDERFLOW:
        return 0.0
    k = round(x * _INV_LN2)  # half to even, as np.rint
    return math.ldexp(math.ldexp(_exp_reduced(x, k), k // 2), k - k // 2)


def _log_scalar(x: float) -> float:
    if math.isnan(x) or x < 0.0:
        return math.nan
    if x == 0.0:
        return -math.inf
    if x == math.inf:
        return math.inf
    m, e = math.frexp(x)
    low = m < _SQRT_HALF
    if low:
        m *= 2.0
    return _log_reduced(float(e - low), m - 1.0)


def _log1p_scalar(x: float) -> float:
    if x == math.inf:
        return math.inf
    u = 1.0 + x
    d = u - 1.0
    return x if d == 0.0 else _log_scalar(u) * (x / d)


def _expm1_scalar(x: float) -> float:
    u = _exp_scalar(x)
    d = u - 1.0
    if u != 1.0 and d != -1.0 and math.isfinite(u):
        return d * (x / _log_scalar(u))
    return x if u == 1.0 else d


@_elementwise(_exp_scalar)
def exp(x: np.ndarray) -> np.ndarray:
    """e^x, fdlibm's ``__ieee754_exp``: x = k·ln2 + r, |r| ≤ ln2/2, e^r from a rational approximation, × 2^k."""
    k = np.rint(x * _INV_LN2)
    y = _exp_reduced(x, k)
    k_int = np.where(np.isfinite(k), k, 0).astype(np.int64)
    # 2^k in two exact steps, so that a k past the exponent range still gives the subnormal or 0 once
    result = np.ldexp(np.ldexp(y, k_int // 2), k_int - k_int // 2)
    result = np.where(x > _EXP_OVERFLOW, np.inf, result)
    result = np.where(x < _EXP_UNDERFLOW, 0.0, result)
    return np.where(np.isnan(x), np.nan, result)


@_elementwise(_log_scalar)
def log(x: np.ndarray) -> np.ndarray:
    """The natural log, fdlibm's ``__ieee754_log``: x = 2^k·(1 + f), √2/2 ≤ 1 + f < √2, s = f/(2 + f),
    log(1 + f) = f − s·(f − R(s²)), plus k·ln2 in two parts; 0 → −inf, < 0 → NaN, +inf → +inf."""
    m, e = np.frexp(x)  # exact: x = m·2^e, m ∈ [0.5, 1) (subnormals too)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    result = _log_reduced((e - low).astype(np.float64), m - 1.0)  # m − 1 exact (Sterbenz)
    result = np.where(x == 0.0, -np.inf, result)
    result = np.where(x < 0.0, np.nan, result)
    result = np.where(np.isposinf(x), np.inf, result)
    return np.where(np.isnan(x), np.nan, result)


@_elementwise(_log1p_scalar)
def log1p(x: np.ndarray) -> np.ndarray:
    """log(1 + x), accurate near 0: u = 1 + x rounded, log(u)·x/(u − 1) (Goldberg 1991, Thm 4); x where u == 1."""
    u = 1.0 + x
    d = u - 1.0
    result = np.where(d == 0.0, x, log(u) * (x / np.where(d == 0.0, 1.0, d)))
    return np.where(np.isposinf(x), np.inf, result)


@_elementwise(_expm1_scalar)
def expm1(x: np.ndarray) -> np.ndarray:
    """e^x − 1, accurate near 0: u = e^x, (u − 1)·x/log(u) (Kahan); x where u == 1, −1 where u − 1 == −1."""
    u = exp(x)
    d = u - 1.0
    safe = (u != 1.0) & (d != -1.0) & np.isfinite(u)
    return np.where(safe, d * (x / np.where(safe, log(u), 1.0)), np.where(u == 1.0, x, d))


def logaddexp(a: Any, b: Any) -> Any:
    """log(e^a + e^b) without overflow: max + log1p(e^(−|a − b|)); a == b (±inf included) gives a + log 2."""
    a, b = _f64(a), _f64(b)
    with np.errstate(all="ignore"):
        top = np.maximum(a, b)
        gap = -np.abs(a - b)
        result = np.where(a == b, a + _LN2_HI + _LN2_LO, top + log1p(exp(np.where(np.isnan(gap), 0.0, gap))))
        result = np.where(np.isnan(a) | np.isnan(b), np.nan, result)
    return _out(result, np.broadcast_to(a, np.broadcast(a, b).shape))


def complex_multiply(x: Any, y: Any) -> np.ndarray:
    """x·y for complex128 arrays, as (ac − bd) + (ad + bc)i in separate real operations: NumPy's own complex multiply
    runs fused multiply-adds where the CPU has FMA3 and separate ones where not (the FFT convolutions' floats)."""
    x, y = np.asarray(x, dtype=np.complex128), np.asarray(y, dtype=np.complex128)
    a, b, c, d = x.real, x.imag, y.real, y.imag
    out = np.empty(np.broadcast(x, y).shape, dtype=np.complex128)
    out.real = a * c - b * d
    out.imag = a * d + b * c
    return out


def complex_power(z: Any, n: int) -> np.ndarray:
    """z**n for a complex128 array and an integer n >= 1, by binary exponentiation (:func:`complex_multiply`):
    NumPy's ``**`` takes the C library's ``cpow`` or FMA-dependent products, by exponent and CPU."""
    if n < 1:
        raise ValueError(f"complex_power needs n >= 1, got {n}")
    base = np.array(z, dtype=np.complex128)
    result: np.ndarray | None = None
    while True:
        if n & 1:
            result = base.copy() if result is None else complex_multiply(result, base)
        n >>= 1
        if not n:
            assert result is not None  # n >= 1 has a set bit
            return result
        base = complex_multiply(base, base)


class _StrictNumpy(types.ModuleType):
    """numpy with this module's elementary functions: a library computing with ``np.exp`` etc. (dp_accounting's PLD
    modules) is given this as its ``np`` and computes the same floats on every CPU; every other name is numpy's."""

    exp = staticmethod(exp)
    log = staticmethod(log)
    expm1 = staticmethod(expm1)
    log1p = staticmethod(log1p)
    logaddexp = staticmethod(logaddexp)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


strict_numpy = _StrictNumpy("numpy")


def make_strict(*names: str) -> None:
    """Give each loaded module of ``names`` that computes with numpy as ``np`` :data:`strict_numpy` instead (its
    ``np.exp`` etc. become this module's; idempotent; a module not loaded is skipped). Used on dp_accounting's
    modules whose floats dptune charges: their code is unchanged, only the elementary functions they call."""
    import sys

    for name in names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "np", None) is np:
            setattr(module, "np", strict_numpy)  # noqa: B010 (a module's global, not a typed attribute)
