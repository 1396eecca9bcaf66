"""Chunk samplers and SpaCO compensation schemes (docs/estimators.md §3).

A sparse step draws a set I of chunks and backprops, for every j in I (in
decreasing order), ``c_0 J_j + sum_q c_q <m_j, G_j(q)>``.  A chain of p hops
carries the weight W(p) = c_0 c_1 ... c_p and survives with probability

    uniform t of k (no replacement):  pi(p) = (t)_{p+1} / (k)_{p+1}
    Bernoulli with rate rho:          pi(p) = rho^{p+1}

so E[g_hat] = sum_p w(p) g(p) with w(p) = W(p) pi(p).  A :class:`Scheme` is a
small value: a sampler, a direct factor c_0, per-hop factors c_q and an
optional cap.  All factors are computed in exact rational arithmetic
(``fractions.Fraction``) and converted to float only where they are used.

Here: :class:`Scheme`, :func:`make_scheme` and the registry of built-in schemes (:func:`get_scheme`); the
samplers are in :mod:`seco_lab.estimators.samplers`, the built-in factors and closed forms in
:mod:`seco_lab.estimators.scheme_factors`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Literal

import numpy as np

from ..core.checks import MAX_WEIGHT_ENTRIES, as_float, check_budget, check_max_hops
from .samplers import BERNOULLI, UNIFORM, Num, Sampler, falling  # noqa: F401 (re-export: defined here before)
from .scheme_factors import (
    falling_hop,
    inv_rho,
    inv_rho_hop,
    k_over_t,
    k_over_t_hop,
    one,
    one_hop,
    survive,
    w_bernoulli,
    w_falling,
    w_paper,
    w_paper_capped,
    w_paper_chain_capped,
    w_released,
    w_released_unbiased,
)

__all__ = ["BERNOULLI", "Hop", "SCHEME_NAMES", "Sampler", "Scheme", "falling", "get_scheme", "make_scheme"]

# the built-in factors' names before seco_lab.estimators.scheme_factors (a Scheme pickled then refers to them)
(_falling_hop, _inv_rho, _inv_rho_hop, _k_over_t, _k_over_t_hop, _one, _one_hop, _survive, _w_bernoulli, _w_falling,
 _w_paper, _w_paper_capped, _w_paper_chain_capped, _w_released, _w_released_unbiased) = (
    falling_hop, inv_rho, inv_rho_hop, k_over_t, k_over_t_hop, one, one_hop, survive, w_bernoulli, w_falling, w_paper,
    w_paper_capped, w_paper_chain_capped, w_released, w_released_unbiased)


Direct = Callable[[int, int, Fraction], Num]  # c_0(k, t, rho)
Hop = Callable[[int, int, int, Fraction], Num]  # c_q(q, k, t, rho), q >= 1
ClosedForm = Callable[["Scheme", int, int, int], Fraction]  # w(p)(scheme, k, t, p)


@dataclass(frozen=True)
class Scheme:
    """A SpaCO compensation scheme: sampler + c_0 + c_q (+ cap), and its expected weights.

    ``cap_on='hop'`` caps each factor: c_q <- min(c_q, C).
    ``cap_on='chain'`` caps the chain product: W(p) = c_0 min(c_1...c_p, C).
    """

    name: str
    sampler: Sampler
    direct: Direct
    hop: Hop
    cap: Fraction | None = None
    cap_on: Literal["hop", "chain"] = "hop"
    closed_form: ClosedForm | None = field(default=None, compare=False)
    description: str = field(default="", compare=False)

    def __post_init__(self):
        if self.cap is not None:
            object.__setattr__(self, "cap", check_cap(self.cap))
        if self.cap_on not in ("hop", "chain"):
            raise ValueError(f"cap_on must be 'hop' or 'chain', got {self.cap_on!r}")

    # -- factors ---------------------------------------------------------------
    def factors_exact(self, num_chunks: int, budget: int, max_hops: int) -> list[Fraction]:
        """[c_0, c_1, ..., c_P] as exact fractions, caps applied."""
        k, t = num_chunks, budget
        check_max_hops(max_hops)
        rho = self.sampler.rate(k, t)
        # a user's factor function may return anything: each value is checked like a constant factor
        c0 = check_factor(self.direct(k, t, rho), f"scheme {self.name!r}: direct(k={k}, t={t}, rho) returned, but c_0")
        raw = [check_factor(self.hop(q, k, t, rho), f"scheme {self.name!r}: hop(q={q}, k={k}, t={t}, rho) returned, "
                            "but c_q") for q in range(1, max_hops + 1)]
        if self.cap is None:
            return [c0] + raw
        if self.cap_on == "hop":
            return [c0] + [min(c, self.cap) for c in raw]
        out, prod, prev = [c0], Fraction(1), Fraction(1)
        # once the capped product is at the cap and no factor left is below 1, every later ratio is 1: the exact
        # product (which grows with q, e.g. (k/t)^q) is not needed any more
        at_least_one = list(itertools.accumulate(reversed([c >= 1 for c in raw]), lambda a, b: a and b))[::-1]
        for q, c in enumerate(raw):
            if prev == self.cap and at_least_one[q]:
                out.extend([Fraction(1)] * (len(raw) - q))
                break
            prod *= c
            capped = min(prod, self.cap)
            out.append(capped / prev if prev else Fraction(0))
            prev = capped
        return out

    def factors(self, num_chunks: int, budget: int, max_hops: int) -> np.ndarray:
        k, t = num_chunks, budget
        return np.array([float(c) for c in self.factors_exact(k, t, max_hops)])

    def chain_weights_exact(self, num_chunks: int, budget: int, max_hops: int) -> list[Fraction]:
        """W(p) = c_0 c_1 ... c_p for p = 0..P.  A chain of k chunks has at most k-1 hops: more than
        :data:`EXACT_TERMS` weights past k-1 (exact fractions whose size grows with p) are refused, and so are
        weights whose total size passes :data:`EXACT_BITS` (:class:`ExactTooLarge`; :meth:`chain_weights` then
        computes the floats in log space)."""
        k, t = check_budget(num_chunks, budget)
        max_hops = check_max_hops(max_hops)
        if max_hops > k - 1 + EXACT_TERMS:
            raise ValueError(f"max_hops P={max_hops:,}: no chain of k={k} chunks has more than {k - 1} hops, and "
                             f"{max_hops + 1:,} exact weights would take long to compute; pass max_hops <= "
                             f"{k - 1 + EXACT_TERMS:,} (k - 1 suffices)")
        size = ExactSize(self, "chain weights W", k, t, max_hops)
        return [size.add(p, w) for p, w in
                enumerate(itertools.accumulate(self.factors_exact(k, t, max_hops), lambda a, b: a * b))]

    def chain_weights(self, num_chunks: int, budget: int, max_hops: int) -> np.ndarray:
        """W(p) as floats; a weight beyond float range (e.g. (k/t)^p at k = 256) is ``inf``, which
        :meth:`HopStrata.combine` accepts only on an exactly zero stratum.  Exact while the exact weights fit
        :data:`EXACT_BITS`; beyond (a huge k) the products are taken in log space."""
        k, t = num_chunks, budget
        try:
            exact = self.chain_weights_exact(k, t, max_hops)
        except ExactTooLarge:
            return np.array([log2_to_float(v) for v in log2_products(self.factors_exact(k, t, max_hops))])
        return np.array([fraction_to_float(w) for w in exact])

    def constant_relay(self, num_chunks: int, budget: int) -> bool:
        """True when c_q does not depend on q (for the hops that can occur), so one relay buffer suffices."""
        k, t = num_chunks, budget
        c = self.factors_exact(k, t, self.sampler.max_hops(k, t))[1:]
        return all(x == c[0] for x in c)

    # -- expectations ----------------------------------------------------------
    def expected_weights_exact(self, num_chunks: int, budget: int, max_hops: int) -> list[Fraction]:
        """w(p) = W(p) pi(p), p = 0..P: the closed form (docs/estimators.md §3) when the scheme has one.

        No chain survives a draw of t chunks without replacement past t-1 hops: there pi(p) = 0, so w(p) is
        computed only up to t-1 and the rest are zeros (a huge P costs nothing but them; more than
        :data:`~seco_lab.core.checks.MAX_WEIGHT_ENTRIES` entries are refused).  Bernoulli weights do not vanish, but
        past k-1 they weigh chains a k-chunk sequence cannot have: more than :data:`EXACT_TERMS` exact terms
        past k-1 are refused."""
        k, t = check_budget(num_chunks, budget)
        max_hops = check_max_hops(max_hops)
        last_nonzero = self.sampler.max_hops(k, t) if self.sampler.kind == "uniform" else max_hops
        if max_hops + 1 > MAX_WEIGHT_ENTRIES or last_nonzero > k - 1 + EXACT_TERMS:
            raise ValueError(f"max_hops P={max_hops:,}: {max_hops + 1:,} weights, but no chain of k={k} chunks has "
                             f"more than {k - 1} hops; pass P <= k - 1 = {k - 1}")
        top = min(max_hops, last_nonzero)
        if self.closed_form is not None and top < CLOSED_FORM_TERMS:
            size = ExactSize(self, "expected weights w", k, t, max_hops)
            head = [size.add(p, Fraction(self.closed_form(self, k, t, p))) for p in range(top + 1)]
        else:  # a closed form computes each term afresh (falling factorials): the direct products are linear
            head = self.direct_expected_weights(k, t, top)
        return head + [Fraction(0)] * (max_hops - top)

    def direct_expected_weights(self, num_chunks: int, budget: int, max_hops: int) -> list[Fraction]:
        """w(p) computed generically as chain weight times survival probability (both as running products)."""
        k, t = num_chunks, budget
        W = self.chain_weights_exact(k, t, max_hops)
        size = ExactSize(self, "expected weights w", k, t, max_hops)
        return [size.add(p, w * pi) for p, (w, pi) in enumerate(zip(W, self.inclusions(k, t, max_hops)))]

    def inclusions(self, num_chunks: int, budget: int, max_hops: int):
        """pi(p) = inclusion(k, t, p + 1) for p = 0..P, as running products (each term from the last)."""
        k, t = num_chunks, budget
        pi = Fraction(1)
        rho = self.sampler.rate(k, t) if self.sampler.kind != "uniform" else None
        for p in range(max_hops + 1):
            if rho is not None:
                pi *= rho
            else:
                pi = pi * Fraction(t - p, k - p) if p < t else Fraction(0)
            yield pi

    def inclusion_ratios(self, num_chunks: int, budget: int, max_hops: int) -> list[Fraction]:
        """pi(p) / pi(p-1) for p = 0..P (pi(-1) = 1): small exact fractions, for the log-space weights of a huge k."""
        k, t = num_chunks, budget
        if self.sampler.kind != "uniform":
            return [self.sampler.rate(k, t)] * (max_hops + 1)
        return [Fraction(t - p, k - p) if p < t else Fraction(0) for p in range(max_hops + 1)]

    def expected_weights(self, num_chunks: int, budget: int, max_hops: int) -> np.ndarray:
        """w(p) as floats.  Each factor is a float but their product need not be: a weight beyond float range
        (a user's scheme with huge factors; no built-in one) is refused, naming it, rather than an
        OverflowError or an inf that every bias metric would turn into NaN.  Exact while the exact weights fit
        :data:`EXACT_BITS`; beyond (a huge k) the products are taken in log space."""
        k, t = num_chunks, budget
        try:
            weights, to_float, to_log2 = self.expected_weights_exact(k, t, max_hops), fraction_to_float, fraction_log2
        except ExactTooLarge:
            # each step's factor times its survival ratio (1 for Bernoulli's 1/rho): no cancellation of huge logs
            weights = log2_products(c * r for c, r in zip(self.factors_exact(k, t, max_hops),
                                                          self.inclusion_ratios(k, t, max_hops)))
            to_float, to_log2 = log2_to_float, float
        out = []
        for p, w in enumerate(weights):
            value = to_float(w)
            if math.isinf(value):  # p >= 1: w(0) = c_0 pi(0) <= c_0 is a float
                log = to_log2(w)
                raise ValueError(f"scheme {self.name!r}: the expected weight w({p}) at k={k}, t={t} is beyond float "
                                 f"range (about 1e{log * math.log10(2):.0f}); pass max_hops <= {p - 1} or use smaller "
                                 "factors")
            out.append(value)
        return np.array(out)

    def with_params(self, **params) -> Scheme:
        return _with_params(self, params)


#: exact (Fraction) terms computed past k - 1 at most: each is a product of P factors, so their cost grows with P
EXACT_TERMS = 4096


#: the most bits (numerators and denominators together) the exact weights of one call may take: W(p) = (k/t)^p grows
#: with p, so k exact weights take O(k^2 log k) bits (k = 4096, t = 1: 1e8 bits, 0.1 s); beyond, the float weights
#: are computed in log space and the exact ones refused (:class:`ExactTooLarge`)
EXACT_BITS = 2**28

#: a closed form computes each w(p) afresh (falling factorials of p + 1 terms): beyond this many terms the running
#: products of :meth:`Scheme.direct_expected_weights` (equal by definition) are used
CLOSED_FORM_TERMS = 1024


class ExactTooLarge(ValueError):
    """The exact weights asked for would pass :data:`EXACT_BITS` (time and memory grow with k squared)."""


class ExactSize:
    """Counts the bits of the exact weights computed so far; refuses past :data:`EXACT_BITS`, naming the cost."""

    def __init__(self, scheme: Scheme, what: str, k: int, t: int, max_hops: int):
        self.scheme, self.what, self.k, self.t, self.max_hops, self.bits = scheme, what, k, t, max_hops, 0

    def add(self, p: int, value: Fraction) -> Fraction:
        self.bits += value.numerator.bit_length() + value.denominator.bit_length()
        if self.bits > EXACT_BITS:
            digits = max(value.numerator.bit_length(), value.denominator.bit_length()) * math.log10(2)
            raise ExactTooLarge(
                f"scheme {self.scheme.name!r}: the exact {self.what}(0..{self.max_hops:,}) at k={self.k:,}, "
                f"t={self.t:,} would take more than {EXACT_BITS // 2**23} MB ({self.what}({p:,}) alone has "
                f"{digits:,.0f} digits); use the float chain_weights / expected_weights (log space there), or pass "
                f"max_hops <= {max(p - 1, 0):,}")
        return value


def fraction_log2(value: Fraction) -> float:
    """log2(value) of an exact value >= 0 (-inf at 0), without converting it to float (no overflow)."""
    if value == 0:
        return -math.inf
    return math.log2(value.numerator) - math.log2(value.denominator)


def log2_products(factors) -> list[float]:
    """log2 of the running products of factors >= 0 (-inf once a factor is 0)."""
    out, total = [], 0.0
    for c in factors:
        total = -math.inf if c == 0 or total == -math.inf else total + fraction_log2(Fraction(c))
        out.append(total)
    return out


def log2_to_float(log: float) -> float:
    """2 ** log, inf beyond float range and 0.0 below it."""
    return math.inf if log >= 1024 else 2.0 ** log


def fraction_to_float(value: Fraction) -> float:
    """float(value), or +-inf where it lies beyond float range (instead of an OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def short_repr(value, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"


def check_cap(cap) -> Fraction:
    """A cap C on a hop factor or chain product: a finite number > 0, as an exact fraction (``True``,
    strings and ints beyond float range are refused)."""
    if isinstance(cap, Fraction):
        value = fraction_to_float(cap) if cap < 2**1000 else math.inf  # a 2**1000 cap is no cap
    else:
        try:
            value = as_float(cap, "cap", finite=False)
        except (TypeError, ValueError):
            raise ValueError(f"cap must be a finite number > 0, got {short_repr(cap)}") from None
    if math.isnan(value):
        raise ValueError(f"cap must be a finite number > 0, got {short_repr(cap)}")
    if value == math.inf or value <= 0:
        why = ("an uncapped scheme has no cap: for C = infinity use the scheme's name without '-capped', e.g. 'paper' "
               "or 'paper-chain'" if value == math.inf else "a cap scales every factor above it down to C, so C must "
               "be > 0; the paper deploys C = 2")
        raise ValueError(f"cap must be a finite number > 0, got {short_repr(cap)} ({why})")
    return Fraction(cap) if isinstance(cap, (int, Fraction)) else Fraction(value)


def _with_params(scheme: Scheme, params: dict) -> Scheme:
    out = scheme
    for key, value in params.items():
        if key == "cap":
            if scheme.cap is None:
                raise ValueError(f"scheme {scheme.name!r} has no cap; capped schemes: {capped_names()}")
            out = replace(out, cap=check_cap(value))
        elif key == "rho":
            if scheme.sampler.kind != "bernoulli":
                raise ValueError(f"scheme {scheme.name!r} samples without replacement; rho needs a bernoulli scheme")
            out = replace(out, sampler=Sampler("bernoulli", value))  # the sampler checks rho (check_rho)
        else:
            raise ValueError(f"unknown scheme parameter {key!r}; schemes take cap= or rho=")
    return out


def make_scheme(
    name: str,
    direct: Num | float | Direct,
    hop: Num | float | Hop,
    sampler: Sampler | str = "uniform",
    cap: float | None = None,
    cap_on: Literal["hop", "chain"] = "hop",
) -> Scheme:
    """A user-defined scheme.  ``direct`` is c_0 or ``f(k, t, rho)``; ``hop`` is c_q or ``f(q, k, t, rho)``.

    Its expected weights come for free from W(p) pi(p).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if cap_on not in ("hop", "chain"):
        raise ValueError(f"cap_on must be 'hop' or 'chain', got {cap_on!r}")
    c0 = None if callable(direct) else check_factor(direct, "direct factor c_0")
    cq = None if callable(hop) else check_factor(hop, "hop factor c_q")
    d = direct if callable(direct) else (lambda k, t, rho, _c=c0: _c)
    h = hop if callable(hop) else (lambda q, k, t, rho, _c=cq: _c)
    s = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
    return Scheme(name, s, d, h, None if cap is None else check_cap(cap), cap_on)


def check_factor(value, what: str) -> Fraction:
    """A compensation factor: a finite number >= 0 (int, float or Fraction) within float range, exactly.

    The factors are used as floats (:meth:`Scheme.factors`, the engines' relay scales), so one beyond float
    range is refused here, naming it, rather than failing later with an OverflowError from deep in a sweep."""
    if isinstance(value, Fraction) or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)):
        exact = Fraction(int(value)) if not isinstance(value, Fraction) else value
        try:
            float(exact)
        except OverflowError:
            raise ValueError(f"{what} must be a finite number >= 0 within float range (about 1.8e308), got "
                             f"{short_repr(value)}") from None
    else:  # a finite float is within float range
        exact = Fraction(as_float(value, what))
    if exact < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return exact




_BUILTIN: dict[str, Scheme] = {
    s.name: s
    for s in [
        Scheme("paper", UNIFORM, one, k_over_t_hop, closed_form=w_paper,
               description="Paper, Alg. 2 / Eq. 9: c_0 = 1, c_q = k/t"),
        Scheme("paper-capped", UNIFORM, one, k_over_t_hop, cap=Fraction(2), cap_on="hop",
               closed_form=w_paper_capped, description="Paper Sec. 6.4: c_0 = 1, c_q = min(k/t, C)"),
        Scheme("paper-chain-capped", UNIFORM, one, k_over_t_hop, cap=Fraction(2), cap_on="chain",
               closed_form=w_paper_chain_capped, description="Review's reading: W(p) = min((k/t)^p, C)"),
        Scheme("released", UNIFORM, k_over_t, one_hop, closed_form=w_released,
               description="Public code, default flags: c_0 = k/t, c_q = 1"),
        Scheme("released-unbiased", UNIFORM, k_over_t, k_over_t_hop, closed_form=w_released_unbiased,
               description="Public code, --unbiased_estimate: c_0 = c_q = k/t"),
        Scheme("falling-factorial", UNIFORM, k_over_t, falling_hop, closed_form=w_falling,
               description="Horvitz-Thompson: c_0 = k/t, c_q = (k-q)/(t-q)"),
        Scheme("bernoulli", BERNOULLI, inv_rho, inv_rho_hop, closed_form=w_bernoulli,
               description="Bernoulli(rho = t/k) inclusion: c_0 = c_q = 1/rho"),
    ]
}

SCHEME_NAMES: tuple[str, ...] = tuple(_BUILTIN)


def capped_names() -> list[str]:
    return [n for n, s in _BUILTIN.items() if s.cap is not None]


def get_scheme(name: str | Scheme, **params) -> Scheme:
    """A registered scheme by name, with optional parameters (``cap=`` for capped schemes,
    ``rho=`` for ``bernoulli``).  Passing a :class:`Scheme` returns it (with params applied)."""
    if isinstance(name, Scheme):
        return _with_params(name, params)
    if name not in _BUILTIN:
        raise ValueError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEME_NAMES)}")
    return _with_params(_BUILTIN[name], params)
