"""The charged numbers' arithmetic (issue 58): ``_strictmath``'s functions are accurate and the same bytes on every
CPU path, and ``_grid`` rounds up, to its digits, idempotently."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

from dptune.accounting import _strictmath as strict
from dptune.accounting._grid import EPSILON_DIGITS, SIGMA_DIGITS, round_up, round_up_epsilon, round_up_sigma

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(58)
INPUTS = {
    "exp": np.concatenate([RNG.uniform(-745, 709, 20000), RNG.uniform(-1e-6, 1e-6, 5000), RNG.uniform(-30, 30, 5000)]),
    # no NumPy exp/log here: they are what differs by CPU, and the inputs must be the same bytes in every child
    "log": np.concatenate([np.ldexp(RNG.uniform(0.5, 1, 20000), RNG.integers(-1020, 1020, 20000)),
                           RNG.uniform(0.5, 2, 5000), [5e-324, 1e-310, 3.3e-315]]),
    "log1p": np.concatenate([RNG.uniform(-1, 10, 20000), RNG.uniform(-1e-9, 1e-9, 5000),
                             np.ldexp(RNG.uniform(0.5, 1, 5000), RNG.integers(-70, 70, 5000))]),
    "expm1": np.concatenate([RNG.uniform(-745, 709, 20000), RNG.uniform(-1e-9, 1e-9, 5000), RNG.uniform(-1, 1, 5000)]),
}
ULPS = {"exp": 1, "log": 1, "log1p": 2, "expm1": 2}  # fdlibm's bound; Goldberg's and Kahan's corrections on top


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_each_function_is_within_its_ulps_of_the_c_library(name: str) -> None:
    x = INPUTS[name]
    ours = getattr(strict, name)(x)
    exact = np.array([getattr(math, name)(v) for v in x])  # glibc: < 1 ulp
    finite = np.isfinite(exact) & (exact != 0)
    ulps = np.abs(ours[finite] - exact[finite]) / np.spacing(np.abs(exact[finite]))
    assert ulps.max() <= ULPS[name] + 1, name


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_edges_are_numpys(name: str) -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 1e-320, -1e-320, 1e308, -1e308, 710.0, -746.0])
    with np.errstate(all="ignore"):
        ours, theirs = getattr(strict, name)(x), getattr(np, name)(x)
    same = (ours == theirs) | (np.isnan(ours) & np.isnan(theirs)) | (np.abs(ours - theirs) <= 2 * np.spacing(np.abs(theirs)))
    assert same.all(), (name, x[~same], ours[~same], theirs[~same])
    assert isinstance(getattr(strict, name)(0.5), np.floating)  # a scalar in, a scalar out (as a ufunc)


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_a_scalar_gives_the_arrays_bits(name: str) -> None:
    """The scalar paths (dp_accounting calls these on one float at a time) are the array paths' operations in Python
    floats: the same bits, specials included."""
    f = getattr(strict, name)
    x = np.concatenate([INPUTS[name][::7], [0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 5e-324, 709.78, -745.13]])
    with np.errstate(all="ignore"):
        arrays = f(x)
    scalars = np.array([f(float(v)) for v in x])
    same = (arrays.view(np.int64) == scalars.view(np.int64)) | (np.isnan(arrays) & np.isnan(scalars))
    assert same.all(), x[~same]
    assert isinstance(f(np.float64(0.25)), np.float64) and f(1) == f(1.0)


def test_complex_products_are_numpys_to_rounding() -> None:
    z = RNG.normal(size=1000) + 1j * RNG.normal(size=1000)
    np.testing.assert_allclose(strict.complex_multiply(z, z[::-1]), z * z[::-1], rtol=1e-15)
    unit = np.exp(1j * RNG.uniform(0, 2 * np.pi, 1000)) * 0.999  # in this process only
    for n in (1, 2, 7, 625, 20000):
        np.testing.assert_allclose(strict.complex_power(unit, n), unit**n, rtol=n * 2e-15, atol=1e-300)  # n products
    with pytest.raises(ValueError):
        strict.complex_power(unit, 0)


_CHILD = r"""
import hashlib, sys
import numpy as np
sys.path.insert(0, "tests")
from test_strictmath import INPUTS
from dptune.accounting import _strictmath as strict
z = INPUTS["exp"][:4096] / 700 + 1j * INPUTS["expm1"][:4096] / 700
parts = [getattr(strict, name)(x).tobytes() for name, x in sorted(INPUTS.items())]
parts += [np.array([getattr(strict, name)(float(v)) for v in x[:500]]).tobytes() for name, x in sorted(INPUTS.items())]
parts += [strict.logaddexp(INPUTS["log1p"], INPUTS["expm1"]).tobytes(), strict.complex_power(z, 625).tobytes(),
          strict.complex_multiply(z, z[::-1]).tobytes()]
print(hashlib.sha256(b"".join(parts)).hexdigest())
"""


def test_the_same_bytes_without_the_cpus_simd_kernels() -> None:
    """Run with every NumPy dispatch feature this CPU has switched off (the kernels of a CPU without AVX2 or
    AVX-512), the functions give the very bytes they give here: nothing in them is picked by the CPU."""
    try:  # NumPy 2; NumPy 1 called the package numpy.core
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # pragma: no cover
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__  # type: ignore[no-redef]

    def run(env: dict[str, str]) -> str:
        full = {k: v for k, v in os.environ.items() if not k.startswith("NPY_")} | env
        r = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=full, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    features = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
    assert run({}) == run({"NPY_DISABLE_CPU_FEATURES": features})


@pytest.mark.parametrize("x", [5.2635040283203125, 5.2635117, 0.599495, 1e-7, 3.0, 123456.789, 9.9999999, 2.0**-30])
def test_round_up_is_the_next_grid_point_at_or_above(x: float) -> None:
    for digits in (EPSILON_DIGITS, SIGMA_DIGITS):
        g = round_up(x, digits)
        assert g >= x
        assert round_up(g, digits) == g  # idempotent: a value on the grid stays
        d = Decimal(repr(g))
        assert len(d.normalize().as_tuple().digits) <= digits
        step = Decimal(1).scaleb(Decimal(x).adjusted() - digits + 1)
        assert Decimal(x) > d - step  # no grid point skipped


def test_round_up_edges_and_names() -> None:
    assert round_up_epsilon(math.inf) == math.inf and math.isnan(round_up_sigma(math.nan))
    assert round_up_epsilon(0.0) == 0.0
    assert round_up_epsilon(2.0) == 2.0 and round_up_epsilon(2.0000000001) == 2.00001
    assert round_up_sigma(13.91863) == 13.919 and round_up_sigma(0.879361) == 0.87937
    assert round_up(9.99999951, 6) == 10.0
