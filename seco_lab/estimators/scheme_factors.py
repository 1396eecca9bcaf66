"""The built-in schemes' compensation factors, c_0(k, t, rho) and c_q(q, k, t, rho), and the closed forms of
their expected weights w(p) (docs/estimators.md §3), as exact fractions.  Module-level functions, so schemes
pickle across processes.
"""

from __future__ import annotations

from fractions import Fraction

from .samplers import falling

__all__ = ["falling_hop", "inv_rho", "inv_rho_hop", "k_over_t", "k_over_t_hop", "one", "one_hop", "survive",
           "w_bernoulli", "w_falling", "w_paper", "w_paper_capped", "w_paper_chain_capped", "w_released",
           "w_released_unbiased"]


def one(k, t, rho):
    return Fraction(1)


def one_hop(q, k, t, rho):
    return Fraction(1)


def k_over_t(k, t, rho):
    return Fraction(k, t)


def k_over_t_hop(q, k, t, rho):
    return Fraction(k, t)


def inv_rho(k, t, rho):
    return 1 / rho


def inv_rho_hop(q, k, t, rho):
    return 1 / rho


def falling_hop(q, k, t, rho):
    # (k-q)/(t-q); a chain with q >= t hops cannot survive, so its factor is moot: use 0.
    return Fraction(k - q, t - q) if q < t else Fraction(0)


def survive(k, t, p) -> Fraction:
    return Fraction(falling(t, p + 1), falling(k, p + 1)) if p + 1 <= t else Fraction(0)


# Closed forms of the table in docs/estimators.md §3: w(p) of scheme s.
def w_paper(s, k, t, p):
    return Fraction(k, t) ** p * survive(k, t, p)


def w_paper_capped(s, k, t, p):
    return min(Fraction(k, t), s.cap) ** p * survive(k, t, p)


def w_paper_chain_capped(s, k, t, p):
    return min(Fraction(k, t) ** p, s.cap) * survive(k, t, p)


def w_released(s, k, t, p):
    return Fraction(k, t) * survive(k, t, p)


def w_released_unbiased(s, k, t, p):
    return Fraction(k, t) ** (p + 1) * survive(k, t, p)


def w_falling(s, k, t, p):
    return Fraction(1) if p < t else Fraction(0)


def w_bernoulli(s, k, t, p):
    return Fraction(1)
