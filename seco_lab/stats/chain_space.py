"""Exact and Monte Carlo statistics of SpaCO schemes, computed in chain space.

With the chain basis (:func:`seco_lab.estimators.spaco.chain_basis`) a draw I gives
``g_hat(I) = sum_c a_c(I) W(p_c) v_c`` with a_c(I) = [chain c inside I].  With
the Gram matrix G = V V^T every second-order quantity is a quadratic form in
chain coefficients, so nothing of size (draws x parameters) is ever formed:

    exact mean       E g_hat = sum_c W_c pi(|c|) v_c
    exact covariance tr Cov = sum_{c,c'} W_c W_c' [pi(|c u c'|) - pi(|c|) pi(|c'|)] G_cc'
    squared bias     ||E g_hat - g||^2 = b G b^T,  b_c = W_c pi(|c|) - 1

Monte Carlo: N draws shared by every scheme with the same sampler (common random
numbers); the sample mean's squared error overstates the squared bias by tr Sigma / N,
so the debiased estimate ``||mean - g||^2 - tr Sigma_hat / N`` is reported, with a
confidence interval from a delete-one-batch jackknife over B batch means.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from ..estimators.schemes import Sampler, Scheme
from ..estimators.spaco import ChainBasis
from .equal_compute import best_scale_mse, noise_to_signal

__all__ = [
    "ChainSpace", "Inclusion", "MonteCarlo", "enumerated_stats", "exact_stats", "monte_carlo_stats",
    "scheme_chain_weights",
]


def popcount(x: np.ndarray) -> np.ndarray:
    return np.bitwise_count(x.astype(np.uint64)).astype(np.int64)


def masks_from_indicator(ind: np.ndarray) -> np.ndarray:
    """(n, k) boolean draws -> (n,) int64 bitmasks."""
    return (ind.astype(np.int64) << np.arange(ind.shape[1], dtype=np.int64)).sum(1)


def containment(draw_masks: np.ndarray, chain_masks: np.ndarray) -> np.ndarray:
    """(n, chains) matrix a_c(I_n) = 1 if chain c lies inside draw n."""
    return ((chain_masks[None, :] & ~draw_masks[:, None]) == 0).astype(np.float32)


@dataclass
class ChainSpace:
    """The quantities shared by every scheme of one (model, sequence): chain hops, masks, Gram matrix."""

    hops: np.ndarray
    masks: np.ndarray
    gram: np.ndarray  # G = V V^T, float64
    union_sizes: np.ndarray  # |c u c'|
    sizes: np.ndarray  # |c| = hops + 1
    g_norm2: float  # ||g||^2 = 1^T G 1

    @classmethod
    def from_basis(cls, basis: ChainBasis) -> ChainSpace:
        V = basis.vectors.double()
        gram = (V @ V.T).cpu().numpy()
        union = popcount(basis.masks[:, None] | basis.masks[None, :])
        return cls(basis.hops, basis.masks, gram, union, basis.hops + 1, float(gram.sum()))

    def quad(self, a: np.ndarray, b: np.ndarray | None = None) -> float | np.ndarray:
        """a G b^T for chain-coefficient vectors (or row stacks)."""
        b = a if b is None else b
        return a @ self.gram @ b.T


def inclusion_table(sampler: Sampler, num_chunks: int, budget: int) -> np.ndarray:
    """pi[m] = P(m given chunks all drawn), m = 0..k (k = ``num_chunks``, t = ``budget``)."""
    k, t = num_chunks, budget
    return np.array([float(sampler.inclusion(k, t, m)) for m in range(k + 1)])


@dataclass
class ExactStats:
    mean_coef: np.ndarray  # chain coefficients of E g_hat
    sq_bias: float
    cov_trace: float
    cos: float
    mean_sq: float = float("nan")  # ||E g_hat||^2
    inner: float = float("nan")  # <E g_hat, g>

    def relative(self, g_norm2: float) -> dict[str, float]:
        """Metrics relative to ||g||^2, and at matched scale (SPEC §4c): noise-to-signal tr Cov / ||E g_hat||^2
        and best-scale MSE min_a E||a g_hat - g||^2 / ||g||^2 (``seco_lab.stats.equal_compute``)."""
        return {
            "rel_bias": float(np.sqrt(max(self.sq_bias, 0.0) / g_norm2)),
            "rel_var": self.cov_trace / g_norm2,
            "rel_mse": (self.sq_bias + self.cov_trace) / g_norm2,
            "direction_bias": max(1.0 - self.cos, 0.0),  # rounding can push cos a hair above 1
            "best_scale_residual": float(np.sqrt(max(1.0 - self.cos**2, 0.0))),
            **matched_scale(self.inner / g_norm2, self.mean_sq / g_norm2, self.cov_trace / g_norm2),
        }


def matched_scale(rel_inner: float, rel_mean_sq: float, rel_var: float) -> dict[str, float]:
    """noise_to_signal = tr Cov / ||E g_hat||^2 and best_scale_mse = 1 - <E g_hat, g>^2 / (||g||^2 (||E g_hat||^2
    + tr Cov)), from <E g_hat, g>, ||E g_hat||^2 and tr Cov, each relative to ||g||^2."""
    return {"noise_to_signal": noise_to_signal(max(rel_var, 0.0), rel_mean_sq),
            "best_scale_mse": best_scale_mse(rel_inner, rel_mean_sq, 1.0, rel_var)}


@dataclass
class Inclusion:
    """What one sampler at (k, t) implies for the chains: P(c in I) and Cov(a_c, a_c') (times G)."""

    pi_c: np.ndarray
    cov_gram: np.ndarray  # (pi(|c u c'|) - pi(|c|) pi(|c'|)) * G_cc'

    @classmethod
    def of(cls, space: ChainSpace, sampler: Sampler, num_chunks: int, budget: int) -> Inclusion:
        pi = inclusion_table(sampler, num_chunks, budget)
        pi_c = pi[space.sizes]
        return cls(pi_c, (pi[space.union_sizes] - np.outer(pi_c, pi_c)) * space.gram)


def exact_stats(space: ChainSpace, chain_w: np.ndarray, inc: Inclusion) -> ExactStats:
    """Exact mean, squared bias, covariance trace and cosine for chain weights W_c."""
    mean = chain_w * inc.pi_c
    ones = np.ones_like(mean)
    sq_bias = float(space.quad(mean - ones))
    cov_trace = float(chain_w @ inc.cov_gram @ chain_w)
    mg = float(space.quad(mean, ones))
    mm = float(space.quad(mean))
    cos = mg / np.sqrt(mm * space.g_norm2) if mm > 0 else 0.0
    return ExactStats(mean, sq_bias, cov_trace, cos, mm, mg)


def enumerated_stats(space: ChainSpace, chain_w: np.ndarray, sampler: Sampler, num_chunks: int,
                     budget: int) -> tuple[float, float]:
    """(squared bias, covariance trace) by summing over every possible draw (tier 2 in chain space)."""
    subsets, probs = zip(*sampler.subsets(num_chunks, budget))
    masks = np.array([sum(1 << j for j in s) for s in subsets], dtype=np.int64)
    A = containment(masks, space.masks).astype(np.float64) * chain_w
    p = np.array([float(x) for x in probs])
    mean = p @ A
    second = (A.T * p) @ A
    sq_bias = float(space.quad(mean - 1.0))
    cov_trace = float(np.sum((second - np.outer(mean, mean)) * space.gram))
    return sq_bias, cov_trace


@dataclass
class MonteCarlo:
    """Sufficient statistics of N draws for one sampler, shared by all its schemes."""

    n: int
    containment_mean: np.ndarray  # mean of a_c over draws
    second_gram: np.ndarray  # (mean of a_c a_c' over draws) * G_cc'
    batch_means: np.ndarray  # (B, chains) containment means per batch
    checkpoints: np.ndarray  # draw counts N_i for the convergence curve
    running_means: np.ndarray  # (len(checkpoints), chains) containment means after N_i draws
    mean_size: float  # mean |I|

    @classmethod
    def run(cls, space: ChainSpace, sampler: Sampler, num_chunks: int, budget: int, draws: int,
            generator: np.random.Generator, batches: int = 50, n_checkpoints: int = 25,
            block: int = 2000) -> MonteCarlo:
        """``draws`` draws of I (in blocks of ``block``), summarised for every chain at once."""
        k, t, n, rng = num_chunks, budget, draws, generator
        if n % batches:
            raise ValueError(f"number of draws {n} must be a multiple of the number of batches {batches}")
        nc = len(space.masks)
        total = np.zeros(nc)
        second = np.zeros((nc, nc))
        batch_sums = np.zeros((batches, nc))
        per_batch = n // batches
        checkpoints = np.unique(np.geomspace(10, n, n_checkpoints).astype(int))
        running = np.zeros((len(checkpoints), nc))
        size_sum = 0
        done = 0
        while done < n:
            m = min(block, n - done)
            ind = sampler.draw_indicator(k, t, m, rng)
            size_sum += int(ind.sum())
            A = containment(masks_from_indicator(ind), space.masks)  # float32 0/1: exact counts below 2^24
            second += (A.T @ A).astype(np.float64)
            for i, cp in enumerate(checkpoints):
                if done < cp <= done + m:
                    running[i] = total + A[: cp - done].sum(0, dtype=np.float64)
            # batches are contiguous runs of draws: sum each run that falls in this block
            idx = (done + np.arange(m)) // per_batch
            starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
            batch_sums[idx[starts]] += np.add.reduceat(A, starts, axis=0, dtype=np.float64)
            total += A.sum(0, dtype=np.float64)
            done += m
        running /= checkpoints[:, None]
        return cls(n, total / n, second / n * space.gram, batch_sums / per_batch, checkpoints, running,
                   size_sum / n)


@dataclass
class MonteCarloStats:
    sq_err: float  # ||mean - g||^2
    cov_trace: float  # unbiased sample estimate of tr Sigma
    sq_bias: float  # debiased: sq_err - cov_trace / N
    sq_bias_se: float  # jackknife standard error over batches
    ci_low: float
    ci_high: float
    convergence: np.ndarray  # ||running mean - g|| at each checkpoint


def monte_carlo_stats(space: ChainSpace, mc: MonteCarlo, chain_w: np.ndarray, level: float = 0.95) -> MonteCarloStats:
    n = mc.n
    mean = mc.containment_mean * chain_w
    err = mean - 1.0
    sq_err = float(space.quad(err))
    second = float(chain_w @ mc.second_gram @ chain_w)
    cov_trace = (second - float(space.quad(mean))) * n / (n - 1)
    sq_bias = sq_err - cov_trace / n
    # U-statistic over batch means x_b: (sum_{b != b'} <x_b, x_b'>) / (B (B - 1)), jackknifed.
    X = mc.batch_means * chain_w - 1.0
    gram_b = space.quad(X)
    B = len(X)
    total, diag = gram_b.sum(), np.diag(gram_b)
    row = gram_b.sum(1)
    loo = (total - 2 * row + diag - (diag.sum() - diag)) / ((B - 1) * (B - 2))
    se = float(np.sqrt((B - 1) / B * np.sum((loo - loo.mean()) ** 2)))
    q = stats.t.ppf(0.5 + level / 2, B - 1)
    R = mc.running_means * chain_w - 1.0
    conv = np.sqrt(np.maximum(((R @ space.gram) * R).sum(1), 0.0))
    return MonteCarloStats(sq_err, cov_trace, sq_bias, se, sq_bias - q * se, sq_bias + q * se, conv)


def scheme_chain_weights(scheme: Scheme, num_chunks: int, budget: int, hops: np.ndarray) -> np.ndarray:
    """W(p_c) for every chain (0 where the chain is longer than any draw can hold)."""
    P = int(hops.max()) if len(hops) else 0
    return scheme.chain_weights(num_chunks, budget, P)[hops]
