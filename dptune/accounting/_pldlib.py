"""dp_accounting's PLD library, loaded lean and computed in arrays: the same floats, a fraction of the time.

A plan calibrates σ on PLDs dozens of times; three of dp_accounting's steps dominated it, and each is replaced here by
the same computation in fewer Python steps, compared byte for byte with dp_accounting's in ``tests/test_pld.py``:

* the import (:func:`pld_module`): dp_accounting's PLD modules import ``scipy.signal`` for ``fftconvolve`` and
  ``scipy.stats`` for the normal distribution, ≈ 1 s; they get stand-ins (:class:`_Lazy`), :func:`fftconvolve` is
  SciPy's steps on ``scipy.fft``, and the Gaussian here uses :class:`_Normal` (the special functions ``norm`` calls);
* the connect-the-dots points of the (subsampled) Gaussian (:func:`subsampled_gaussian_pld`): one array pass instead
  of tens of thousands of scalar ``inverse_privacy_loss`` calls;
* the Chernoff bounds of a self-composition (:func:`self_compose`): SciPy's ``logsumexp`` without its array-API layer.

Only dp_accounting 0.6 (pinned) and SciPy 1.17's code paths are reproduced; the byte comparisons fail first if either
changes.
"""

from __future__ import annotations

import functools
import math
import sys
import types
from typing import TYPE_CHECKING, Any

from dptune.accounting import _strictmath as strict

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

__all__ = ["VALUE_DISCRETIZATION_INTERVAL", "fftconvolve", "pld_module", "self_compose", "subsampled_gaussian_pld"]

VALUE_DISCRETIZATION_INTERVAL = 1e-3


def pld_module() -> types.ModuleType:
    """dp_accounting's PLD module, imported on first use (a planner start without PLD skips it).

    Its modules import ``scipy.signal`` (for ``fftconvolve`` alone) and ``scipy.stats`` (for ``norm``, which the
    Gaussian here does without): ≈ 1 s of a `dptune plan`. While they import, both names are :class:`_Lazy` stand-ins
    (the real modules, if already loaded, are put back right after): dp_accounting's ``signal.fftconvolve`` is
    :func:`fftconvolve` (SciPy's computation, the same floats), and any other attribute loads the real module then."""
    if "dp_accounting.pld.privacy_loss_distribution" not in sys.modules:
        saved = {name: sys.modules.get(name) for name in _LAZY}
        stand_ins = {name: _Lazy(name, own) for name, own in _LAZY.items()}
        sys.modules.update(stand_ins)
        try:
            from dp_accounting.pld import privacy_loss_distribution  # noqa: F401
        finally:
            for name, module in saved.items():
                if sys.modules.get(name) is not stand_ins[name]:
                    continue  # the real module, loaded meanwhile by a stand-in's other attribute: it stays
                if module is None:
                    del sys.modules[name]
                else:
                    sys.modules[name] = module
    strict.make_strict(*_STRICT_MODULES)
    for name in ("dp_accounting.pld.pld_pmf", "dp_accounting.pld.common"):
        # its convolutions are dptune's (FMA-free products) even when another import loaded it with scipy.signal:
        # which module imported dp_accounting first must not move a charge (a certificate re-derived elsewhere)
        module = sys.modules.get(name)
        if module is not None and not isinstance(getattr(module, "signal", None), _Lazy):
            setattr(module, "signal", _Lazy("scipy.signal", {"fftconvolve": fftconvolve}))  # noqa: B010
    return sys.modules["dp_accounting.pld.privacy_loss_distribution"]


# dp_accounting's PLD modules that compute with numpy's elementary functions: they get ``_strictmath``'s
_STRICT_MODULES = ("dp_accounting.pld.common", "dp_accounting.pld.pld_pmf", "dp_accounting.pld.privacy_loss_mechanism",
                   "dp_accounting.pld.privacy_loss_distribution")


class _Lazy(types.ModuleType):
    """A module's stand-in: ``own`` attributes from dptune, every other one from the real module, loaded on first use."""

    def __init__(self, name: str, own: dict[str, Any]) -> None:
        super().__init__(name)
        self.__dict__.update(own)

    def __getattr__(self, attr: str) -> Any:
        import importlib

        if attr.startswith("__"):
            raise AttributeError(attr)
        if sys.modules.get(self.__name__) is self:  # still standing in (dp_accounting importing): make way
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def fftconvolve(in1: Any, in2: Any, mode: str = "full") -> Any:
    """``scipy.signal.fftconvolve(in1, in2, mode)`` for real 1-D arrays (SciPy 1.17's steps: ``rfftn``/``irfftn`` at
    ``next_fast_len``, then the mode's slice), without importing ``scipy.signal``; ``tests/test_pld.py`` compares the
    bytes with SciPy's."""
    import numpy as np
    from scipy import fft

    a, b = np.asarray(in1), np.asarray(in2)
    if a.ndim == b.ndim == 0:
        return a * b
    if a.ndim != 1 or b.ndim != 1 or np.iscomplexobj(a) or np.iscomplexobj(b):
        from scipy import signal

        return signal.fftconvolve(in1, in2, mode=mode)
    if a.size == 0 or b.size == 0:
        return np.asarray([])
    s1, s2 = a.shape[0], b.shape[0]
    if mode == "valid" and s1 < s2:
        a, b = b, a
    if s1 == 1 or s2 == 1:  # SciPy drops the axis: an elementwise product
        ret = a * b
    else:
        shape = s1 + s2 - 1
        fshape = [fft.next_fast_len(shape, True)]
        if np.issubdtype(a.dtype, np.integer):
            a = a.astype(np.float64)
        if np.issubdtype(b.dtype, np.integer):
            b = b.astype(np.float64)
        product = strict.complex_multiply(fft.rfftn(a, fshape, axes=[0]), fft.rfftn(b, fshape, axes=[0]))
        ret = fft.irfftn(product, fshape, axes=[0])[:shape]
    if mode == "full":
        return ret.copy()
    n = ret.shape[0]
    if mode not in ("same", "valid"):
        raise ValueError("acceptable mode flags are 'valid', 'same', or 'full'")
    keep = s1 if mode == "same" else abs(s1 - s2) + 1  # SciPy's _centered to in1's shape, or to the valid part
    start = (n - keep) // 2
    return ret[start:start + keep].copy()


class _Normal:
    """``scipy.stats.norm(scale=σ)``'s ``cdf``, ``logcdf`` and ``ppf`` as ``rv_continuous`` computes them (the special
    function of (x − 0)/σ, or ndtri(q)·σ + 0), without importing ``scipy.stats``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def _standard(self, x: Any) -> Any:
        import numpy as np

        x = np.asarray(x)
        return np.asarray((x - np.asarray(0)) / np.asarray(self.scale), dtype=np.promote_types(x.dtype, np.float64))

    def cdf(self, x: Any) -> Any:
        from scipy import special

        out = special.ndtr(self._standard(x))
        return out[()] if getattr(out, "ndim", 0) == 0 else out

    def logcdf(self, x: Any) -> Any:
        from scipy import special

        out = special.log_ndtr(self._standard(x))
        return out[()] if getattr(out, "ndim", 0) == 0 else out

    def ppf(self, q: Any) -> Any:
        import numpy as np
        from scipy import special

        q = np.asarray(q, dtype=np.float64)
        if q.ndim or not 0 < q < 1:
            raise ValueError("dptune's normal stand-in takes one probability in (0, 1)")
        return (special.ndtri(q) * np.asarray(self.scale) + np.asarray(0))[()]


_LAZY: dict[str, dict[str, Any]] = {"scipy.signal": {"fftconvolve": fftconvolve}, "scipy.stats": {}}


def subsampled_gaussian_pld(*, standard_deviation: float, sampling_prob: float,
                            value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL
                            ) -> PrivacyLossDistribution:
    """dp_accounting's ``from_gaussian_mechanism(standard_deviation, sampling_prob=…, value_discretization_interval=…)``
    (sensitivity 1, pessimistic connect-the-dots, add/remove-one; q = 1 is the plain Gaussian), the same distribution
    bit for bit, ~5x faster, and without scipy.stats.

    dp_accounting finds the connect-the-dots points one privacy loss at a time (``inverse_privacy_loss`` in a Python
    loop, tens of thousands of calls per distribution: most of a plan's accounting time); :class:`_VectorGaussianLoss`
    computes them in one pass of the same floating-point operations in the same order (NumPy's array and scalar
    ufuncs share their loops), and everything else is dp_accounting's own code. ``tests/test_pld.py`` compares the
    two byte for byte over a grid of σ and q, so a change on either side fails there, not in a certificate."""
    pld = pld_module()
    if not 0 < sampling_prob <= 1:
        return pld.from_gaussian_mechanism(standard_deviation=standard_deviation, sampling_prob=sampling_prob,
                                           value_discretization_interval=value_discretization_interval)
    loss_class = _vector_loss_class()

    def single(adjacency_type: object) -> object:
        return pld._create_pld_pmf_from_monotone_privacy_loss(
            loss_class(standard_deviation, sampling_prob=sampling_prob, adjacency_type=adjacency_type),
            pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
            use_connect_dots=True)

    return pld._pld_for_subsampled_mechanism(single, sampling_prob)


def _isclose(a: Any, b: float) -> Any:
    """``math.isclose(a, b)`` elementwise over the array ``a`` (its default rel_tol 1e-9, abs_tol 0)."""
    import numpy as np

    diff = np.abs(b - a)
    return (diff <= abs(1e-9 * b)) | (diff <= np.abs(1e-9 * a))


@functools.cache
def _vector_loss_class() -> type:
    """dp_accounting's ``GaussianPrivacyLoss`` with its hockey-stick curve computed in arrays (built on first use:
    the module is imported lazily, ``pld_module``)."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_mechanism as plm

    class _VectorGaussianLoss(plm.GaussianPrivacyLoss):
        def __init__(self, standard_deviation: float, sensitivity: float = 1, pessimistic_estimate: bool = True,
                     log_mass_truncation_bound: float = -50, sampling_prob: float = 1.0,
                     adjacency_type: Any = plm.AdjacencyType.REMOVE) -> None:
            # GaussianPrivacyLoss.__init__, its normal distribution without scipy.stats (_Normal)
            if standard_deviation <= 0:
                raise ValueError(f"Standard deviation is not a positive real number: {standard_deviation}")
            if log_mass_truncation_bound > 0:
                raise ValueError(f"Log mass truncation bound is not a non-positive real number: "
                                 f"{log_mass_truncation_bound}")
            self._standard_deviation = standard_deviation
            self._gaussian_random_variable = _Normal(standard_deviation)
            self._pessimistic_estimate = pessimistic_estimate
            self._log_mass_truncation_bound = log_mass_truncation_bound
            plm.AdditiveNoisePrivacyLoss.__init__(self, sensitivity, False, sampling_prob, adjacency_type)

        def _x_cutoffs(self, eps: np.ndarray) -> np.ndarray:
            # inverse_privacy_loss(ε) for each ε: _inverse_privacy_loss_{remove,add} with common.log_a_times_exp_b_plus_c
            # and _inverse_privacy_loss_without_subsampling_{remove,add}, the same operations in the same order
            q, s, var = self.sampling_prob, self.sensitivity, self._standard_deviation**2
            a, c = 1 / q, 1 - 1 / q
            remove = self.adjacency_type == plm.AdjacencyType.REMOVE
            edge = math.log(1 - q) if remove else -math.log(1 - q)
            at_edge = _isclose(eps, edge)
            beyond = (eps <= edge) if remove else (eps > edge)
            if np.any(beyond & ~at_edge):
                raise ValueError(f"privacy loss beyond {edge} for sampling probability {q}")
            b = eps[~at_edge] if remove else -eps[~at_edge]
            d = b + strict.log(a)
            log_minus_c = strict.log(-c)
            if np.any(log_minus_c >= d):
                raise ValueError(f"a exp(b) + c must be positive: {a}, {c}")
            without = np.where(b == 0, strict.log(a + c), d + strict.log1p(-strict.exp(log_minus_c - d)))
            out = np.full(eps.shape, math.inf if remove else -math.inf)
            out[~at_edge] = (-0.5 * s - without * var / s) if remove else (s + (-0.5 * s - (-without) * var / s))
            return out

        def get_delta_for_epsilon(self, epsilon: object) -> object:
            if (self.sampling_prob == 1.0 or self.adjacency_type not in (plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE)
                    or np.isscalar(epsilon)):
                return super().get_delta_for_epsilon(epsilon)
            epsilons = np.asarray(epsilon)
            deltas = np.zeros_like(epsilons, dtype=float)
            if self.adjacency_type == plm.AdjacencyType.ADD:
                inverse = epsilons < -math.log1p(-self.sampling_prob)
            else:
                inverse = epsilons > math.log1p(-self.sampling_prob)
                deltas[~inverse] = -strict.expm1(epsilons[~inverse])
            x = self._x_cutoffs(epsilons[inverse])
            deltas[inverse] = self.mu_upper_cdf(x) - strict.exp(epsilons[inverse] + self.mu_lower_log_cdf(x))
            return np.clip(deltas, 0, 1)

    return _VectorGaussianLoss


def self_compose(one: PrivacyLossDistribution, count: int) -> PrivacyLossDistribution:
    """``one.self_compose(count)`` (dp_accounting, its default tail mass truncation 1e-15), bit for bit, ~3x faster.

    dp_accounting bounds the composed support by a Chernoff bound at 40 orders, each a ``scipy.special.logsumexp``
    whose array-API dispatch costs more than its arithmetic (~0.25 ms a call; ~6,000 calls in one plan).
    :func:`_logsumexp` runs SciPy's algorithm on NumPy arrays directly, the same operations in the same order; the
    FFT and the pmf are dp_accounting's. Any pmf but a dense one goes to dp_accounting. ``tests/test_pld.py``
    compares the two byte for byte."""
    pld = pld_module()
    from dp_accounting.pld import pld_pmf

    pmfs = [one._pmf_remove] if one._symmetric else [one._pmf_remove, one._pmf_add]

    def dense(p: Any) -> Any:  # the dense pmf dp_accounting would self-compose, or None
        if type(p) is pld_pmf.DensePLDPmf:
            return p
        if type(p) is pld_pmf.SparsePLDPmf and p.size**count > pld_pmf._MAX_PMF_SPARSE_SIZE:
            return p.to_dense_pmf()  # as SparsePLDPmf.self_compose does
        return None

    todo = [dense(p) for p in pmfs]
    if count < 2 or any(p is None for p in todo):
        return one.self_compose(count)
    return pld.PrivacyLossDistribution(*[_dense_self_compose(p, count) for p in todo])


_TAIL_MASS_TRUNCATION = 1e-15  # dp_accounting's default in PrivacyLossDistribution.self_compose


def _dense_self_compose(pmf: Any, num_times: int) -> Any:
    # pld_pmf.DensePLDPmf.self_compose with common.self_convolve inlined
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from scipy import fft

    probs_in = pmf._probs
    tail = _TAIL_MASS_TRUNCATION
    lower_loss = pmf._lower_loss * num_times
    # common.compute_self_convolve_bounds
    upper_bound = (len(probs_in) - 1) * num_times
    lower_bound = 0
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(probs_in)
    log_mgfs = _logsumexp(np.arange(len(probs_in))[None, :] * orders[:, None], probs_in)  # one row per order
    for order, log_mgf_value in zip(orders, log_mgfs, strict=True):
        bound = (num_times * log_mgf_value + math.log(2 / tail)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper_bound = min(upper_bound, math.ceil(bound))
        if order < 0:
            lower_bound = max(lower_bound, math.floor(bound))
    # common.self_convolve
    output_len = upper_bound - lower_bound + 1
    fast_len = fft.next_fast_len(max(output_len, len(probs_in)))
    convolved = np.real(fft.ifft(strict.complex_power(fft.fft(probs_in, fast_len), num_times)))
    probs = np.array(np.roll(convolved, -lower_bound)[:output_len])
    lower_loss += lower_bound
    inf_prob = tail - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
    return pld_pmf.DensePLDPmf(pmf._discretization, lower_loss, probs, inf_prob,
                               pmf._pessimistic_estimate)


def _logsumexp(a: Any, b: Any) -> Any:
    """``scipy.special.logsumexp(row, b=b)`` for each row of the 2-D float64 array ``a`` (``b`` 1-D, the rows' length,
    not empty): SciPy 1.17's ``logsumexp`` and ``_logsumexp`` for real input without a sign, without the array-API
    layer, every step along the rows (NumPy reduces each contiguous row as it reduces a 1-D array: the same floats,
    ``tests/test_pld.py``)."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out_inf = strict.log(np.sum(b * strict.exp(a), axis=1, keepdims=True))
        a = np.array(a, copy=True)
        a[np.broadcast_to(b == 0, a.shape)] = -np.inf
        a_max = np.max(a, axis=1, keepdims=True)
        mask = a == a_max
        a[mask] = -np.inf
        m = np.sum(b * mask.astype(a.dtype), axis=1, keepdims=True, dtype=a.dtype)
        exp = b * strict.exp(a - a_max)
        s = np.sum(exp, axis=1, keepdims=True, dtype=exp.dtype)
        s = np.where(s == 0, s, s / m)
        sgn = np.sign(s + 1) * np.sign(m)
        s = np.where(s < -1, -s - 2, s)
        m = np.abs(m)
        out = strict.log1p(s) + strict.log(m) + a_max
        out[sgn < 0] = np.nan
    out = np.where(np.isfinite(out), out, out_inf)
    return out[:, 0]
