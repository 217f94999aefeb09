"""Random stopping from the privacy profile of one trial: a bound on the whole search's δ(ε) that is valid
for every ranking of the outputs, computed on the trial's dominating pair (dp_accounting's pessimistic PLD).

In the spirit of Koskela, Redberg & Wang, "Privacy Profiles for Private Selection" (ICML 2024,
arXiv:2402.06701): bound the hockey-stick divergence of PrivateTuning through the probability generating
function (pgf) of K and the base mechanism's privacy profile, instead of through Rényi DP (Papernot & Steinke
2022). The statement and proof below are dptune's own: the stored copy of that paper could not be read beyond
its abstract. ``tests/test_profile.py`` checks the bound against brute force over every ranking of small
mechanisms, and against an explicit ranking on dptune's trials that attains it to within 3 % of ε (0.1 % on
``search_spaces/digits.yaml``), so no bound from the trial's profile alone can be much smaller.

**Setting.** One trial M (add/remove neighbours D, D'; P = M(D), P' = M(D')); K ~ a law with pgf
φ(z) = E[z^K] (Poisson(μ): φ'(z) = μ e^{μ(z−1)}, K = 0 allowed, releasing ⊥ = the default config; TNB(η, γ),
K ≥ 1: Papernot & Steinke, Def. 1); the search runs M K times independently and releases the best output under a
total order on outputs that does not depend on the data (ties broken by an independent coin; dptune ranks by a
Gaussian-noised score, so ties have probability 0).

**Theorem.** Let (A, B) be a dominating pair of (P, P') (P = T(A), P' = T(B) for one kernel T), L = log dA/dB its
privacy loss, and R(t) = sup{A(S) : B(S) ≤ t} its ROC (Neyman–Pearson: the highest-loss outcomes first;
concave). For α = e^ε ≥ 1 let f_α(s) = sup_{t∈[0,1]} (φ'(R(t))·s − α·φ'(t))_+. Then

    H_α(Q(D) || Q(D')) ≤ E_B[f_α(e^L); L < ∞] + φ'(1)·A(L = ∞),

and the same with the add-direction pair for H_α(Q(D') || Q(D)); δ_search(ε) is the larger of the two.

*Proof.* (1) Tag every output with an independent U ~ Unif[0, 1] and rank (output, U) lexicographically: the
search on tagged outputs determines the original one (drop U), so its divergences are no smaller, and tagging
changes no likelihood ratio; the ranking now has no atoms. (2) Then P[best ∈ dy] = Σ_k Pr[K = k]·k·F(y)^{k−1}
P(dy) = φ'(F(y)) P(dy), F(y) = P(outputs ranked below y) (as in Papernot & Steinke's proofs; K = 0 releases ⊥ with
the same probability on both sides, which adds nothing to H_α for α ≥ 1). So H_α(Q || Q') =
∫ (φ'(F) dP − α φ'(F') dP')_+. (3) F(y) = P(S_y), F'(y) = P'(S_y) for the set S_y below y, and
P(S) ≤ R_{P,P'}(P'(S)) ≤ R(P'(S)) (a post-processed pair's ROC lies below: Blackwell). φ' is non-decreasing
(non-negative coefficients), so where dP = e^ℓ dP' the integrand is at most (φ'(R(F'))·e^ℓ − α φ'(F'))_+ dP' ≤
f_α(e^ℓ) dP', and on the part of P singular to P' at most φ'(1) dP. (4) f_α is a supremum of convex functions of
s, so convex, and ∫ f_α(dP/dP') dP' + f_α'(∞)·P(singular) is the f-divergence D_{f_α}(P || P'), with
f_α'(∞) = lim f_α(s)/s ≤ φ'(1); f-divergences of any convex f only shrink under post-processing (the
data-processing inequality, Csiszár 1967), so D_{f_α}(P || P') ≤ D_{f_α}(A || B), the right-hand side. ∎

*A worst case over the space* (``WorstCaseDpEvent``: a data-independent choice among trials i, weights w_i
unknown here): the trial's pair is the labelled mixture ⊕ w_i (P_i, P'_i). Its ROC is at most R̄, the concave
envelope of max_i R_i (for t = Σ w_i t_i, Σ w_i R_i(t_i) ≤ R̄(t)); with f_α built from R̄, the divergence of the
mixture is Σ w_i D_{f_α}(P_i || P'_i) ≤ max_i D_{f_α}(A_i || B_i). So δ is the maximum over the components, each
with the common R̄, whatever the weights.

**Assumptions, and what is not covered.** The trial's dominating pair in both directions is dp_accounting's
pessimistic PLD (``_pld``; losses rounded up, the truncated tail at +∞: a pair that dominates the mechanism, as in
``_mixed``); K is drawn independently of the data from exactly the law named in the event (Poisson mean μ, or
TNB(η, γ) with γ = ``tnb_gamma(mean, η)``, what ``draw_k`` uses); the released output is the best of the K under a
data-independent order, nothing else about the other trials leaves. The accountant ``profile`` bounds a search
event *alone*; composed with final training, the accountant ``profile+pld`` (``_mixed``) uses this δ(ε) (it
bounds both directions, ε >= 0) in place of the RDP conversion where it is smaller
(:func:`search_profile_delta_grid`). A noisy-max selection composed
with the trials, two searches composed, and the subsampled search (Zhu & Wang amplification, stated for RDP) stay
on the RDP-based bounds.

**Numerics.** Everything is an upper bound: f_α on [t_j, t_{j+1}] is bounded by φ'(R̄(t_{j+1}))·s − α φ'(t_j) on a
grid holding every vertex of R̄ plus uniform steps in t and in R̄; the supremum of these lines is their upper
envelope g (computed once), and f_α(s) = α·g(s/α)_+ for every α, so δ(ε) costs one pass over the loss grid; ε at
δ is what bisection finds (δ(ε) does not increase in ε), rounded up to its grid (``_roots.bisected_epsilon``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event as de

from dptune.accounting import _strictmath as strict
from dptune.accounting._events import WorstCaseDpEvent, event_from_json, event_to_json
from dptune.accounting._pld import has_pld, pld_of
from dptune.accounting._pldlib import fftconvolve
from dptune.accounting._roots import bisected_epsilon
from dptune.accounting._stopping import tnb_gamma

__all__ = ["has_profile", "pgf_derivative", "profile_delta", "profile_epsilon", "search_profile_delta",
           "search_profile_delta_grid", "search_profile_epsilon"]

GRID_STEPS = 2048  # uniform steps in t and in R̄ (besides R̄'s vertices): < 0.1 % of ε on dptune's trials
EPSILON_TOLERANCE = 1e-5  # bisection stops when the bracket is this narrow; the upper end is returned


def has_profile(event: de.DpEvent) -> bool:
    """Whether ``event`` is a random-stopping search whose trial has a PLD (or is a worst case over trials that
    each have one): the events this bound covers (a cheap walk, nothing is built)."""
    return (isinstance(event, de.RepeatAndSelectDpEvent) and _rule_ok(event)
            and all(has_pld(c) for c in _components(event.event)))


def _rule_ok(event: de.RepeatAndSelectDpEvent) -> bool:
    mean, shape = event.mean, event.shape
    return (isinstance(mean, int | float) and math.isfinite(mean) and mean >= 1
            and isinstance(shape, int | float) and shape >= 0)


def _components(event: de.DpEvent) -> list[de.DpEvent]:
    """The distinct trials of a (nested) worst case; the event itself otherwise."""
    if not isinstance(event, WorstCaseDpEvent):
        return [event]
    out: dict[str, de.DpEvent] = {}
    for e in event.events:
        for c in _components(e):
            out.setdefault(json.dumps(event_to_json(c), sort_keys=True), c)
    return list(out.values())


def _component_keys(event: de.DpEvent) -> tuple[str, ...]:
    """:func:`_components` as their JSON keys (the caches' keys: an event is a frozen value, so its key names it)."""
    if not isinstance(event, WorstCaseDpEvent):
        return (json.dumps(event_to_json(event), sort_keys=True),)
    out: dict[str, None] = {}
    for e in event.events:
        for k in _component_keys(e):
            out.setdefault(k)
    return tuple(out)


def pgf_derivative(*, mean: float, shape: float) -> Callable[[np.ndarray], np.ndarray]:
    """φ'(z) of the number of trials K: Poisson(``mean``) for ``shape`` = inf, else TNB(η = ``shape``, γ) with
    E[K] = ``mean`` (γ from ``tnb_gamma``, as the draw uses). Vectorised; φ'(1) = E[K]."""
    if math.isinf(shape):
        mu = float(mean)
        return lambda z: mu * strict.exp(mu * (np.asarray(z, dtype=np.float64) - 1))
    eta = float(shape)
    gamma = tnb_gamma(mean=mean, eta=eta)
    if gamma >= 1:
        return lambda z: np.ones_like(np.asarray(z, dtype=np.float64))  # K = 1: φ(z) = z
    r = 1 - gamma
    if eta == 0:  # logarithmic: φ(z) = log(1 − r z) / log γ
        return lambda z: r / (math.log(1 / gamma) * (1 - r * np.asarray(z, dtype=np.float64)))
    # φ(z) = ((1 − r z)^{−η} − 1) / (γ^{−η} − 1)   (Papernot & Steinke, Def. 1)
    norm = math.expm1(-eta * math.log(gamma))
    return lambda z: eta * r * (1 - r * np.asarray(z, dtype=np.float64)) ** (-eta - 1) / norm


@dataclass(frozen=True)
class _Pair:
    """A dominating pair on a loss grid: finite losses ``loss`` with A-masses ``a`` and B-masses ``b``, and A's
    mass at loss +∞ (B's missing mass sits at −∞, where A has none)."""

    loss: np.ndarray
    a: np.ndarray
    b: np.ndarray
    a_inf: float

    def roc(self) -> tuple[np.ndarray, np.ndarray]:
        """Vertices (t, R(t)) of the Neyman–Pearson ROC: highest losses first."""
        order = np.argsort(-self.loss, kind="stable")
        t = np.concatenate([[0.0], np.cumsum(self.b[order])])
        r = np.minimum(self.a_inf + np.concatenate([[0.0], np.cumsum(self.a[order])]), 1.0)
        last = np.append(np.diff(t) > 0, True)  # B-masses that underflowed to 0: keep the higher R per t
        return t[last], r[last]


@functools.lru_cache(maxsize=64)
def _pairs(key: str) -> tuple[_Pair, ...]:
    """The two directions' pairs of the pessimistic PLD of the trial ``key`` (its JSON; one pair when they are the
    same). Cached, read-only: the stopping rules a plan compares share one trial (``tests/test_profile.py``)."""
    pld = pld_of(event_from_json(json.loads(key)))
    assert pld is not None  # has_profile
    pmfs = [pld._pmf_remove]  # noqa: SLF001 - dp_accounting keeps the two directions' loss distributions here
    if pld._pmf_add is not pld._pmf_remove:  # noqa: SLF001
        pmfs.append(pld._pmf_add)  # noqa: SLF001
    out = []
    for pmf in pmfs:
        dense = pmf.to_dense_pmf()
        probs = np.asarray(dense._probs, dtype=np.float64)  # noqa: SLF001
        loss = (dense._lower_loss + np.arange(len(probs))) * dense._discretization  # noqa: SLF001
        keep = probs > 0
        a, loss = probs[keep], loss[keep]
        out.append(_Pair(loss=_frozen(loss), a=_frozen(a), b=_frozen(a * strict.exp(-loss)),
                         a_inf=float(dense._infinity_mass)))  # noqa: SLF001
    return tuple(out)


def _frozen(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


def _upper_hull(t: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vertices of the upper concave envelope of the points (t, r) (monotone chain), t increasing."""
    order = np.lexsort((-r, t))
    t, r = t[order], r[order]
    first = np.concatenate([[True], np.diff(t) > 0])  # per t, the largest r (sorted first)
    t, r = t[first], r[first]
    ht: list[float] = []
    hr: list[float] = []
    for x, y in zip(t.tolist(), r.tolist(), strict=True):
        while len(ht) >= 2 and (ht[-1] - ht[-2]) * (y - hr[-2]) >= (hr[-1] - hr[-2]) * (x - ht[-2]):
            ht.pop()
            hr.pop()
        ht.append(x)
        hr.append(y)
    return np.asarray(ht), np.asarray(hr)


@functools.lru_cache(maxsize=64)
def _envelope_roc_cached(keys: tuple[str, ...], direction: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_envelope_roc` of the trials ``keys`` in one direction (0: remove, 1: add; a trial with one pair uses it
    for both), cached read-only: it does not depend on the stopping rule, only the lines drawn from it do."""
    t, r = _envelope_roc([_direction(_pairs(k), direction) for k in keys])
    return _frozen(t), _frozen(r)


def _direction(pairs: Sequence[_Pair], i: int) -> _Pair:
    return pairs[min(i, len(pairs) - 1)]


def _envelope_roc(pairs: Sequence[_Pair]) -> tuple[np.ndarray, np.ndarray]:
    """R̄ on [0, 1]: the concave envelope of the largest of the pairs' ROCs (vertices; R̄ = 1 after the last)."""
    rocs = [p.roc() for p in pairs]
    ts = np.unique(np.concatenate([t for t, _ in rocs] + [np.array([0.0, 1.0])]))
    ts = ts[(ts >= 0) & (ts <= 1)]
    # each ROC is 1 beyond its last vertex; the max of concave piecewise-linear functions only has vertices
    # at theirs or at (convex) crossings, which are never vertices of the concave envelope
    top = np.max([np.interp(ts, t, r, right=1.0) for t, r in rocs], axis=0)
    return _upper_hull(ts, top)


def _lines(roc: tuple[np.ndarray, np.ndarray], dphi: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(c, d) with f_α(s) <= max_j (c_j s − α d_j)_+ for every α (module docstring, numerics), from R̄'s vertices."""
    vt, vr = roc
    levels = np.linspace(0.0, 1.0, GRID_STEPS + 1)
    rising = int(np.argmax(vr >= vr[-1])) + 1  # R̄ is increasing up to its first vertex at the top
    inside = (levels > vr[0]) & (levels < vr[-1])
    t_of_level = np.interp(levels[inside], vr[:rising], vt[:rising])  # R̄'s inverse at uniform levels
    grid = np.unique(np.concatenate([vt, levels, t_of_level, np.geomspace(1e-15, 1.0, 256), [0.0, 1.0]]))
    grid = grid[(grid >= 0) & (grid <= 1)]
    r = np.interp(grid, vt, vr, right=1.0)
    return np.asarray(dphi(r[1:])), np.asarray(dphi(grid[:-1]))


def _upper_envelope(c: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The upper envelope of the lines u ↦ c_j u − d_j on u >= 0: (breakpoints, slopes, intercepts), line k on
    [breaks[k], breaks[k+1]) (breaks[0] = 0)."""
    order = np.lexsort((d, c))  # slope increasing, and for one slope the highest line first
    c, d = c[order], d[order]
    first = np.concatenate([[True], np.diff(c) > 0])
    c, d = c[first], d[first]
    # the kept lines are a stack, its first m slots (preallocated: half the time of list appends and pops, the same
    # floats — max(start, 0.0) written out as Python's max evaluates it)
    hc = [0.0] * len(c)
    hd = [0.0] * len(c)
    hb = [0.0] * len(c)  # where each kept line starts to be the highest
    m = 0
    for cj, dj in zip(c.tolist(), d.tolist(), strict=True):
        start = 0.0
        while m:
            start = (dj - hd[m - 1]) / (cj - hc[m - 1])  # crossing with the last kept line (steeper now)
            if start <= hb[m - 1]:
                m -= 1
                start = 0.0
                continue
            break
        hc[m], hd[m] = cj, dj
        hb[m] = 0.0 if start < 0.0 else start
        m += 1
    return np.asarray(hb[:m]), np.asarray(hc[:m]), np.asarray(hd[:m])


@dataclass(frozen=True)
class _Search:
    """Everything δ(ε) needs for one search: per direction, the line envelope g and the components' pairs."""

    parts: tuple[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[_Pair, ...]], ...]
    tail: float  # φ'(1) = E[K]: the weight of A's mass at +∞

    def delta(self, epsilon: float) -> float:
        alpha = math.exp(epsilon)
        worst = 0.0
        for (breaks, c, d), pairs in self.parts:
            for p in pairs:
                u = strict.exp(p.loss - epsilon)
                k = np.searchsorted(breaks, u, side="right") - 1
                g = np.maximum(c[k] * u - d[k], 0.0)
                worst = max(worst, alpha * float(np.sum(p.b * g)) + self.tail * p.a_inf)  # not BLAS: its sum order varies
        return min(worst, 1.0)


def _build(per_component: Sequence[Sequence[_Pair]], dphi: Callable[[np.ndarray], np.ndarray],
           rocs: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> _Search:
    """The search over trials whose pairs (one per direction, or one when symmetric) are ``per_component``;
    ``rocs``: their R̄ per direction where already known (:func:`_envelope_roc_cached`)."""
    parts = []
    for i in range(max(len(p) for p in per_component)):  # remove, then add
        pairs = tuple(_direction(p, i) for p in per_component)
        roc = _envelope_roc(pairs) if rocs is None else rocs[i]
        parts.append((_upper_envelope(*_lines(roc, dphi)), pairs))
    return _Search(parts=tuple(parts), tail=float(dphi(np.array(1.0))))


@functools.lru_cache(maxsize=64)
def _search_cached(key: str) -> _Search:
    event = event_from_json(json.loads(key))
    assert isinstance(event, de.RepeatAndSelectDpEvent)
    dphi = pgf_derivative(mean=float(event.mean), shape=float(event.shape))
    keys = _component_keys(event.event)
    per_component = [_pairs(k) for k in keys]
    rocs = [_envelope_roc_cached(keys, i) for i in range(max(len(p) for p in per_component))]
    return _build(per_component, dphi, rocs)


def _search(event: de.RepeatAndSelectDpEvent) -> _Search:
    return _search_cached(json.dumps(event_to_json(event), sort_keys=True))


def search_profile_delta(event: de.DpEvent, epsilon: float) -> float:
    """δ at ``epsilon`` (>= 0) of the random-stopping search ``event`` by the theorem of the module docstring;
    ``ValueError`` unless :func:`has_profile`."""
    if not has_profile(event):
        raise ValueError(f"no privacy-profile bound for {type(event).__name__}: a random-stopping search of "
                         "trials with a PLD is needed")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    assert isinstance(event, de.RepeatAndSelectDpEvent)
    return _search(event).delta(float(epsilon))


def search_profile_epsilon(event: de.DpEvent, delta: float) -> float:
    """The smallest ε (rounded up, to ``EPSILON_TOLERANCE``) at which :func:`search_profile_delta` <= ``delta``;
    ``math.inf`` if none below ε = 1000."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not has_profile(event):
        raise ValueError(f"no privacy-profile bound for {type(event).__name__}")
    assert isinstance(event, de.RepeatAndSelectDpEvent)
    return bisected_epsilon(_search(event).delta, delta, tolerance=EPSILON_TOLERANCE)


@functools.lru_cache(maxsize=16)
def _delta_grid_cached(key: str, step: float, size: int) -> np.ndarray:
    event = event_from_json(json.loads(key))
    assert isinstance(event, de.RepeatAndSelectDpEvent)
    search = _search(event)
    k = np.arange(size)
    worst = np.zeros(size)
    for (breaks, c, d), pairs in search.parts:
        for p in pairs:
            index = np.round(p.loss / step).astype(np.int64)
            if not np.allclose(index * step, p.loss, rtol=0, atol=1e-9 * step):
                raise ValueError("the PLD's losses are not on the grid of ε")
            lo, hi = int(index.min()), int(index.max())
            b = np.zeros(hi - lo + 1)
            np.add.at(b, index - lo, p.b)
            u = strict.exp(np.arange(lo - size + 1, hi + 1) * step)  # u = e^{loss − ε} for every loss and ε = k·step
            j = np.searchsorted(breaks, u, side="right") - 1
            g = np.maximum(c[j] * u - d[j], 0.0)
            # S[k] = Σ_loss b·g(e^{loss − k·step}): one correlation (FFT), plus a bound on its rounding error
            s = fftconvolve(g, b[::-1], mode="valid")[::-1]
            margin = 1e-13 * math.sqrt(float(np.sum(g * g)) * float(np.sum(b * b))) * max(1.0, math.log2(len(g)))
            worst = np.maximum(worst, strict.exp(k * step) * (np.maximum(s, 0.0) + margin) + search.tail * p.a_inf)
    out = np.minimum(worst, 1.0)
    out.flags.writeable = False
    return out


def search_profile_delta_grid(event: de.DpEvent, *, step: float, size: int) -> np.ndarray:
    """:func:`search_profile_delta` at ε = k·``step`` for k = 0 … ``size`` − 1, all at once (an upper bound: one
    FFT correlation per pair, with a margin for its rounding), for ``_mixed``; ``step`` must be the PLD's loss
    interval. Cached (read-only)."""
    if not has_profile(event):
        raise ValueError(f"no privacy-profile bound for {type(event).__name__}")
    return _delta_grid_cached(json.dumps(event_to_json(event), sort_keys=True), float(step), int(size))


def profile_delta(events: Sequence[de.DpEvent], epsilon: float) -> float | None:
    """δ at ``epsilon`` of ``events`` composed, or None unless they are one random-stopping search (:func:`has_profile`)."""
    event = _one_search(events)
    return None if event is None else search_profile_delta(event, epsilon)


def profile_epsilon(events: Sequence[de.DpEvent], delta: float) -> float | None:
    """ε at ``delta`` of ``events`` composed, or None unless they are one random-stopping search whose trial has a
    PLD (:func:`has_profile`; no-ops aside): the accountant ``profile`` of ``_accountant``."""
    event = _one_search(events)
    return None if event is None else search_profile_epsilon(event, delta)


def _one_search(events: Sequence[de.DpEvent]) -> de.DpEvent | None:
    if isinstance(events, de.DpEvent):
        raise TypeError("pass a sequence of events: [event] for one")
    rest = [e for e in events if not isinstance(e, de.NoOpDpEvent)]
    return rest[0] if len(rest) == 1 and has_profile(rest[0]) else None
