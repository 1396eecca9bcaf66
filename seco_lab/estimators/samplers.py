"""Chunk samplers (docs/estimators.md §3): how the set I of backpropagated chunks is drawn, and the exact
probability that given chunks are all in it.

    uniform t of k (no replacement):  a chain of p hops survives with pi(p) = (t)_{p+1} / (k)_{p+1}
    Bernoulli with rate rho:          pi(p) = rho^{p+1}

Probabilities are exact fractions (``fractions.Fraction``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, Union

import numpy as np

from ..core.checks import as_float, check_budget, check_rng

__all__ = ["BERNOULLI", "Num", "Sampler", "UNIFORM", "check_rho", "falling"]

Num = Union[Fraction, int]


def falling(a: Num, m: int) -> Num:
    """Falling factorial (a)_m = a (a-1) ... (a-m+1); (a)_0 = 1."""
    out: Num = 1
    for i in range(m):
        out *= a - i
    return out


@dataclass(frozen=True)
class Sampler:
    """How the set I of backpropagated chunks is drawn.

    ``uniform``: exactly t distinct chunks, uniformly.  ``bernoulli``: each chunk
    independently with probability rho (default t/k, so t is the mean budget).
    """

    kind: Literal["uniform", "bernoulli"] = "uniform"
    rho: float | None = None

    def __post_init__(self):
        if self.kind not in ("uniform", "bernoulli"):
            raise ValueError(f"unknown sampler kind {self.kind!r}; use 'uniform' or 'bernoulli'")
        if self.rho is not None:
            if self.kind != "bernoulli":
                raise ValueError("rho applies to the bernoulli sampler only")
            object.__setattr__(self, "rho", check_rho(self.rho))

    def rate(self, num_chunks: int, budget: int) -> Fraction:
        """rho as an exact fraction (t/k unless set)."""
        k, t = num_chunks, budget
        check_budget(k, t)
        return Fraction(t, k) if self.rho is None else Fraction(self.rho)

    def inclusion(self, num_chunks: int, budget: int, m: int) -> Fraction:
        """Probability that m given distinct chunks are all drawn."""
        k, t = num_chunks, budget
        check_budget(k, t)
        if self.kind == "uniform":
            return Fraction(falling(t, m), falling(k, m)) if m <= t else Fraction(0)
        return self.rate(k, t) ** m

    def draw_indicator(self, num_chunks: int, budget: int, n: int, generator: np.random.Generator) -> np.ndarray:
        """n independent draws as a (n, k) boolean matrix (row r: is chunk j in I_r)."""
        k, t = num_chunks, budget
        check_budget(k, t)
        u = generator.random((n, k))
        if self.kind == "bernoulli":
            return u < float(self.rate(k, t))
        out = np.zeros((n, k), dtype=bool)
        # the t smallest of k iid uniforms are a uniform t-subset
        idx = np.argpartition(u, t - 1, axis=1)[:, :t] if t < k else np.broadcast_to(np.arange(k), (n, k))
        np.put_along_axis(out, idx, True, axis=1)
        return out

    def draw(self, num_chunks: int, budget: int, generator: np.random.Generator | int | None) -> tuple[int, ...]:
        """One draw: the sorted chunk indices of I."""
        k, t = num_chunks, budget
        return tuple(int(j) for j in np.flatnonzero(self.draw_indicator(k, t, 1, check_rng(generator))[0]))

    def max_hops(self, num_chunks: int, budget: int) -> int:
        """The longest chain that can survive a draw: t-1 hops (uniform) or k-1 (Bernoulli)."""
        k, t = num_chunks, budget
        check_budget(k, t)
        return t - 1 if self.kind == "uniform" else k - 1

    def num_subsets(self, num_chunks: int, budget: int) -> int:
        k, t = num_chunks, budget
        check_budget(k, t)
        return math.comb(k, t) if self.kind == "uniform" else 2**k

    def subsets(self, num_chunks: int, budget: int) -> Iterator[tuple[tuple[int, ...], Fraction]]:
        """Every possible I with its exact probability."""
        k, t = num_chunks, budget
        check_budget(k, t)
        if self.kind == "uniform":
            p = Fraction(1, math.comb(k, t))
            for s in itertools.combinations(range(k), t):
                yield s, p
        else:
            rho = self.rate(k, t)
            for size in range(k + 1):
                p = rho**size * (1 - rho) ** (k - size)
                for s in itertools.combinations(range(k), size):
                    yield s, p


def check_rho(rho) -> float:
    """A Bernoulli inclusion probability: a real number (int, float, Fraction or numpy's) in (0, 1], as a Python
    float; ``True``, ``"0.5"``, NaN and ints beyond float range are refused naming rho, never coerced."""
    what = "Bernoulli inclusion probability rho"
    value = as_float(rho, what, allowed="a number in (0, 1] (or None for t/k)")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must lie in (0, 1], got {rho}")
    return value


UNIFORM = Sampler("uniform")
BERNOULLI = Sampler("bernoulli")
