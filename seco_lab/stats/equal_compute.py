"""Comparing gradient methods at matched scale and equal compute (docs/estimators.md §4c, SPEC §4c).

A training step averages B sequences.  Sequence i has exact gradient g_i; the population
gradient is g = E_i g_i.  A scheme's conditional mean for sequence i is m_i = E[g_hat_i | i]
= sum_p w(p) g_i(p) and its draws scatter around it by delta_i(I) = g_hat_i(I) - m_i.  Write

    V_d = tr Cov_i(m_i)                       (data noise of the scheme's mean)
    A   = E_i E_I ||delta_i(I)||^2            (sampling noise of one sequence: E_i tr Sigma_s,i)
    C   = E_{i != j} E_I <delta_i(I), delta_j(I)>   (two sequences that share one draw)

SeCO is m_i = g_i, A = C = 0.  A step of B sequences in micro-batches of n_1 + ... + n_M = B
sequences, one draw per micro-batch, has mean m = E_i m_i and covariance trace

    tr Var G = V_d / B + sum_r (n_r A + n_r (n_r - 1) C) / B^2           (step_variance)

-- with one draw per sequence (n_r = 1) this is (V_d + A) / B, SPEC §4c's formula; with one
shared draw per step (n_1 = B) the sampling part is A / B + (1 - 1/B) C, which does *not*
shrink with B when C > 0.  The best-scale MSE of G (a tuned step size or Adam removes any
global scale) is

    min_a E||a G - g||^2 / ||g||^2 = 1 - <m, g>^2 / (||g||^2 (||m||^2 + tr Var G))   (best_scale_mse)

and noise-to-signal is tr Var G / ||m||^2 (noise_to_signal).  At **equal compute** a method
costing c per sequence against a reference's c_0 averages B_s = B c_0 / c sequences
(equal_compute_batch).  With one draw per sequence both errors are explicit in x = 1/B and the
crossover -- the batch above which SeCO's error is the smaller -- is

    B* = (||g||^4 r - <m, g>^2 V_0) / (||g||^2 (<m, g>^2 - ||g||^2 ||m||^2)),
    r = (V_d + A) c / c_0,  V_0 = SeCO's tr Cov_i(g_i)                                (crossover_batch)

(Cauchy-Schwarz makes the denominator <= 0).  Assumptions, to be stated with any number: one
step, a step size tuned per method, no curvature; bias persists over steps while noise averages.

Cost model (chunk_passes): in units of one chunk forward per sequence, a backward costing two,

    SeCO        (k - 1) + 3k      pass 1 skips the last chunk; pass 2 rebuilds and backprops all k
    SpaCO(t)    k + 3 E|I|        pass 1 over every chunk (it also gives the loss), |I| rebuilt
    truncated   3k                one forward with a graph and one backward per chunk, no pass 1
    dense       3k
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["best_scale_mse", "chunk_passes", "crossover_batch", "equal_batches", "equal_compute_batch",
           "noise_to_signal", "step_variance"]


def _finite(x: float, name: str) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def best_scale_mse(inner: float, mean_sq: float, g_sq: float, var: float) -> float:
    """min_a E||a G - g||^2 / ||g||^2 = 1 - <E G, g>^2 / (||g||^2 (||E G||^2 + tr Var G)).

    ``inner`` = <E G, g>, ``mean_sq`` = ||E G||^2, ``g_sq`` = ||g||^2, ``var`` = tr Var G.  Estimated
    inputs (debiased, so possibly slightly off) are clipped into their valid range: the result lies
    in [0, 1]; a method whose mean and variance are both zero has MSE 1 (a = 0 is its best scale).
    """
    inner, mean_sq, g_sq, var = (_finite(v, n) for v, n in
                                 ((inner, "inner"), (mean_sq, "mean_sq"), (g_sq, "g_sq"), (var, "var")))
    if g_sq <= 0:
        raise ValueError(f"g_sq = ||g||^2 must be > 0 (the reference gradient is zero), got {g_sq}")
    second = max(mean_sq, 0.0) + max(var, 0.0)  # E||G||^2
    if second <= 0:
        return 1.0
    return min(max(1.0 - inner * inner / (g_sq * second), 0.0), 1.0)


def noise_to_signal(var: float, mean_sq: float) -> float:
    """tr Var(g_hat) / ||E g_hat||^2: the noise a tuned scale cannot remove (inf for a zero mean)."""
    var, mean_sq = _finite(var, "var"), _finite(mean_sq, "mean_sq")
    if var < 0:
        raise ValueError(f"var must be >= 0, got {var}")
    return var / mean_sq if mean_sq > 0 else math.inf


def step_variance(data_var: float, sampling_var: float, batch: int, micro_batches: Sequence[int] | None = None,
                  shared_cov: float = 0.0) -> float:
    """tr Var of a step's mean over ``batch`` sequences (module docstring).

    ``data_var`` = tr Cov_i(m_i), ``sampling_var`` = A = E_i tr Sigma_s,i, ``shared_cov`` = C (the
    sampling covariance of two sequences under one draw).  ``micro_batches``: the sizes of the step's
    micro-batches, one draw each (they must sum to ``batch``); None = one draw per sequence.
    """
    if int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch}")
    sizes = [1] * int(batch) if micro_batches is None else [int(n) for n in micro_batches]
    if any(n < 1 for n in sizes) or sum(sizes) != batch:
        raise ValueError(f"micro_batches {list(micro_batches or [])} must be positive and sum to batch={batch}")
    data_var, sampling_var, shared_cov = (_finite(v, n) for v, n in
                                          ((data_var, "data_var"), (sampling_var, "sampling_var"),
                                           (shared_cov, "shared_cov")))
    sampling = sum(n * sampling_var + n * (n - 1) * shared_cov for n in sizes) / batch**2
    return data_var / batch + sampling


def equal_compute_batch(batch: float, cost_ref: float, cost: float) -> float:
    """B_s = B c_0 / c_s: the sequences a method costing ``cost`` fits into the reference's compute."""
    if not (cost > 0 and cost_ref > 0 and batch > 0):
        raise ValueError(f"batch, cost_ref and cost must be > 0, got {batch}, {cost_ref}, {cost}")
    return batch * cost_ref / cost


def crossover_batch(inner: float, mean_sq: float, g_sq: float, var_per_seq: float, ref_var_per_seq: float,
                    cost: float, cost_ref: float) -> float:
    """The reference batch B* above which the exact reference (SeCO: mean g, variance ``ref_var_per_seq``/B)
    has the smaller best-scale MSE than the scheme at equal compute (mean with ``inner``, ``mean_sq``;
    variance ``var_per_seq`` / B_s, one draw per sequence).  ``math.inf``: the scheme is at least as good at
    every batch; 0.0: the reference is better at every batch."""
    inner, mean_sq, g_sq = _finite(inner, "inner"), _finite(mean_sq, "mean_sq"), _finite(g_sq, "g_sq")
    if g_sq <= 0 or mean_sq < 0 or var_per_seq < 0 or ref_var_per_seq < 0:
        raise ValueError("g_sq must be > 0 and mean_sq, var_per_seq, ref_var_per_seq >= 0")
    r = var_per_seq * cost / cost_ref
    ip2 = inner * inner
    num = g_sq * (ip2 - g_sq * mean_sq)  # <= 0: the scheme's bias, priced at B -> infinity
    den = g_sq * g_sq * r - ip2 * ref_var_per_seq  # < 0: the scheme is less noisy at equal compute
    gap_small_b = den  # sign of (MSE_ref - MSE_s) as B -> 0 times a positive factor: den < 0 -> scheme wins
    tol = 1e-12 * g_sq * g_sq * max(mean_sq, 1e-300)
    if num >= -tol:  # unbiased up to a scale: only the noise decides, at every batch alike
        return math.inf if den <= 0 else 0.0
    if gap_small_b >= 0:  # the scheme is noisier per compute and biased: the reference wins everywhere
        return 0.0
    return den / num  # = 1 / x*, x* = num / den > 0


def chunk_passes(mode: str, num_chunks: int, budget: float | None = None) -> float:
    """Cost model: chunk passes per sequence of one gradient, a forward = 1 and a backward = 2 (module
    docstring).  ``budget`` (SpaCO) is the expected number of drawn chunks E|I| = t."""
    k = int(num_chunks)
    if k < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if mode == "seco":
        return (k - 1) + 3 * k
    if mode in ("dense", "truncated"):
        return 3 * k
    if mode == "spaco":
        if budget is None or not 0 < budget <= k:
            raise ValueError(f"spaco needs a budget in (0, num_chunks={k}], got {budget}")
        return k + 3 * float(budget)
    raise ValueError(f"unknown mode {mode!r}; use 'seco', 'spaco', 'truncated' or 'dense'")


def equal_batches(num_chunks: int, batch: int, budget: int) -> tuple[int, int]:
    """(B_0, B_t): SeCO's sequences per step at SpaCO(t)'s compute and SpaCO(t)'s at SeCO's, for a study of
    ``batch`` sequences per step (the cost model, rounded to whole sequences, at least 1)."""
    c0, ct = chunk_passes("seco", num_chunks), chunk_passes("spaco", num_chunks, budget)
    return max(1, round(batch * ct / c0)), max(1, round(batch * c0 / ct))
