"""Bias, variance and MSE of every scheme from hop strata alone (docs/estimators.md §4-5).

The chain basis needs one vector per KV-cache chain, about C(k, L+1) of them: fine at
k = 16, hopeless at the paper's k = 128.  The hop strata need only P+1 vectors, and

    E[g_hat] = sum_p w(p) g(p),        g = sum_p g(p),

so every *first-order* metric is a quadratic form in the strata's Gram matrix
G[p, q] = <g(p), g(q)> (per parameter tensor: G_i[p, q] = <g_i(p), g_i(q)>):

    relative bias         ||E g_hat - g|| / ||g||  = sqrt((w-1)^T G (w-1) / 1^T G 1)
    direction bias        1 - cos,   cos = w^T G 1 / sqrt(w^T G w  1^T G 1)
    best-scale residual   min_a ||a E g_hat - g|| / ||g|| = sqrt(1 - cos^2)
    per-tensor residual   min_{a_i} ||(a_i E g_hat_i - g_i)_i|| / ||g||
                          = sqrt(sum_i (||g_i||^2 - <E g_hat_i, g_i>^2 / ||E g_hat_i||^2)) / ||g||

The per-tensor residual is what Adam cannot absorb (it rescales each coordinate by its
own running magnitude); the best-scale residual is what SGD's learning rate cannot.

Second-order metrics (variance, MSE) need draws: :func:`strata_monte_carlo` runs the
first pass once, then per draw I one stratified sparse sweep over the drawn chunks,
giving g_I(p) and with it *every* scheme of that sampler at once,
g_hat_s(I) = sum_p W_s(p) g_I(p) (common random numbers across schemes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats
from tqdm.auto import tqdm

from ..core.checks import as_int, check_budget, check_max_hops, check_rng
from ..core.engine import cache_leaves, checked_batch, hop_sweep, trainable
from ..estimators.schemes import Sampler, Scheme
from ..estimators.spaco import HopStrata

__all__ = ["StrataGram", "StrataMonteCarlo", "bias_metrics", "jackknife_sq_norm", "strata_monte_carlo"]

# --------------------------------------------------------------------------- exact, first order


@dataclass
class StrataGram:
    """Per-tensor Gram matrices of the hop strata: ``per_tensor[i, p, q] = <g_i(p), g_i(q)>``."""

    per_tensor: np.ndarray  # (tensors, P+1, P+1), float64
    names: list[str]

    @classmethod
    def of(cls, strata: HopStrata) -> StrataGram:
        names = list(strata.strata[0])
        per = np.zeros((len(names), len(strata.strata), len(strata.strata)))
        for i, name in enumerate(names):
            S = torch.stack([s[name].reshape(-1).double() for s in strata.strata])
            per[i] = (S @ S.T).cpu().numpy()
        return cls(per, names)

    @property
    def total(self) -> np.ndarray:
        """G = sum_i G_i: the Gram matrix of the flattened strata."""
        return self.per_tensor.sum(0)

    @property
    def max_hops(self) -> int:
        return self.per_tensor.shape[1] - 1

    def norms(self) -> np.ndarray:
        """||g(p)|| for p = 0..P."""
        return np.sqrt(np.maximum(np.diag(self.total), 0.0))


def bias_metrics(gram: StrataGram, expected_weights) -> dict[str, float]:
    """Exact first-order metrics of E g_hat = sum_p w(p) g(p) against g = sum_p g(p) (module docstring)."""
    w = np.asarray(expected_weights, dtype=np.float64)
    if w.shape != (gram.max_hops + 1,):
        raise ValueError(f"expected_weights must have {gram.max_hops + 1} entries (p = 0..{gram.max_hops}), "
                         f"got shape {w.shape}")
    one = np.ones_like(w)
    G = gram.total
    gg = float(one @ G @ one)
    if gg <= 0:
        raise ValueError("the gradient is zero: relative metrics are undefined")
    mm, mg = float(w @ G @ w), float(w @ G @ one)
    cos = mg / np.sqrt(mm * gg) if mm > 0 else 0.0
    a = mg / mm if mm > 0 else 0.0  # the best global scale
    # residuals as quadratic forms in (a w - 1): exactly 0 for an unbiased scheme, no 1 - cos^2 cancellation
    global_resid = float((a * w - one) @ G @ (a * w - one))
    Gi = gram.per_tensor
    mm_i = np.einsum("p,ipq,q->i", w, Gi, w)
    mg_i = np.einsum("p,ipq,q->i", w, Gi, one)
    a_i = np.where(mm_i > 0, mg_i / np.where(mm_i > 0, mm_i, 1.0), 0.0)  # per tensor; m_i = 0 leaves g_i
    R = a_i[:, None] * w[None, :] - one[None, :]
    tensor_resid = float(np.einsum("ip,ipq,iq->", R, Gi, R))
    s2 = min(max(global_resid, 0.0) / gg, 1.0)  # sin^2 of the angle between E g_hat and g
    return {
        "rel_bias": float(np.sqrt(max(float((w - one) @ G @ (w - one)), 0.0) / gg)),
        # 1 - cos = sin^2 / (1 + cos) for cos >= 0: no cancellation when the directions nearly agree
        "direction_bias": s2 / (1.0 + np.sqrt(1.0 - s2)) if cos >= 0 else 1.0 - cos,
        "best_scale_residual": float(np.sqrt(max(global_resid, 0.0) / gg)),
        "per_tensor_residual": float(np.sqrt(max(tensor_resid, 0.0) / gg)),
        "scale": a,  # the best global a: a E g_hat ~ g
    }


# --------------------------------------------------------------------------- Monte Carlo


@dataclass
class StrataMonteCarlo:
    """Monte Carlo statistics of one scheme, from N stratified sparse sweeps (all relative to ||g||^2).

    ``sq_bias`` is the debiased ||mean - g||^2 - tr(Sigma_hat)/N; its interval is a delete-one-batch
    jackknife of the U-statistic over B batch means (as :mod:`seco_lab.stats.chain_space` does in chain space).
    """

    scheme: str
    draws: int
    rel_sq_err: float  # ||mean - g||^2 / ||g||^2
    rel_var: float  # tr(Sigma_hat) / ||g||^2, unbiased sample estimate
    rel_sq_bias: float
    ci_low: float
    ci_high: float
    mean_chunks: float  # mean |I|


def jackknife_sq_norm(batch_gram: np.ndarray) -> tuple[float, float]:
    """U = sum_{b != b'} <x_b, x_b'> / (B (B-1)) from the Gram matrix of B batch vectors x_b (unbiased for
    ||E x||^2 when the x_b are independent) and its delete-one jackknife standard error: (U, se)."""
    B = len(batch_gram)
    if B < 3:
        raise ValueError(f"the jackknife needs at least 3 batches, got {B}")
    total, diag, row = batch_gram.sum(), np.diag(batch_gram), batch_gram.sum(1)
    u = (total - diag.sum()) / (B * (B - 1))
    loo = (total - 2 * row + diag - (diag.sum() - diag)) / ((B - 1) * (B - 2))
    return float(u), float(np.sqrt((B - 1) / B * np.sum((loo - loo.mean()) ** 2)))


def strata_monte_carlo(
    model,
    tokens,
    targets,
    chunk_size: int,
    sampler: Sampler,
    budget: int,
    schemes: Mapping[str, Scheme],
    draws: int,
    generator: np.random.Generator | int | None = None,
    max_hops: int | None = None,
    batches: int = 20,
    reference=None,
    ignore_index: int = -100,
    level: float = 0.95,
    progress: bool = False,
) -> dict[str, StrataMonteCarlo]:
    """Draw I ~ ``sampler`` ``draws`` times; per draw one stratified sparse sweep over I gives
    g_I(p), p = 0..P, and every scheme's estimate g_hat_s(I) = sum_p W_s(p) g_I(p).

    Pass 1 (the no-grad forward that builds the cache leaves) is shared by all draws.  P defaults to
    the number of cache layers L (chains cross at most L caches).  ``reference`` is the exact flat
    gradient g (computed here by one full stratified sweep when omitted).  Every scheme must use
    ``sampler``: the draws are shared.
    """
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    k, t = check_budget(batch.num_chunks, budget)
    draws = as_int(draws, "draws", 1)
    batches = as_int(batches, "batches", 3)
    if draws % batches:
        raise ValueError(f"draws={draws} must be a multiple of batches={batches}")
    for name, s in schemes.items():
        if s.sampler != sampler:
            raise ValueError(f"scheme {name!r} uses sampler {s.sampler}, not the shared {sampler}")
    rng = check_rng(generator)
    params = trainable(model)
    leaves, _ = cache_leaves(model, batch)
    P = len(leaves[0]) if max_hops is None else check_max_hops(max_hops)
    P = min(P, k - 1)
    tensors = [p for _, p in params]

    def stratified(visit) -> torch.Tensor:
        return _stratified(model, batch, leaves, tensors, P, visit)

    g = stratified(range(k)).sum(0) if reference is None else torch.as_tensor(reference, dtype=torch.float64)
    weights = {name: torch.as_tensor(s.chain_weights(k, t, P), dtype=torch.float64) for name, s in schemes.items()}
    per_batch = draws // batches
    batch_sums, sq_sums, chunks = _draw_estimates(stratified, sampler, k, t, rng, weights, draws, batches, g.numel(),
                                                  progress)
    g = g.cpu()
    gg = float(g @ g)
    q = stats.t.ppf(0.5 + level / 2, batches - 1)
    return {name: _monte_carlo_result(name, batch_sums[name], sq_sums[name], g, gg, draws, per_batch, q, chunks)
            for name in schemes}


def _stratified(model, batch, leaves, tensors: list[torch.Tensor], P: int, visit) -> torch.Tensor:
    """(P+1, d) flat strata g_I(p) of the sweep over ``visit``."""
    d = sum(p.numel() for p in tensors)
    out = torch.zeros(P + 1, d, dtype=torch.float64, device=tensors[0].device)

    def collect(q, j, grads):
        out[q] += torch.cat([g.reshape(-1) for g in grads]).double()

    hop_sweep(model, batch, leaves, tensors, visit, P, collect)
    return out


def _draw_estimates(stratified, sampler: Sampler, k: int, t: int, rng: np.random.Generator,
                    weights: Mapping[str, torch.Tensor], draws: int, batches: int, dim: int, progress: bool):
    """``draws`` draws of I: per scheme, the sum of its estimates g_hat_s(I) in each of ``batches`` consecutive
    batches of draws ((batches, dim)) and the sum of their squared norms; and the chunks backpropagated."""
    per_batch = draws // batches
    batch_sums = {name: torch.zeros(batches, dim, dtype=torch.float64) for name in weights}
    sq_sums = dict.fromkeys(weights, 0.0)
    chunks = 0
    for n in tqdm(range(draws), desc=f"{sampler.kind} t={t} draws", disable=not progress, leave=False):
        subset = sampler.draw(k, t, rng)
        chunks += len(subset)
        if not subset:  # an empty Bernoulli draw: every estimate is 0
            continue
        S = stratified(subset).cpu()
        for name, W in weights.items():
            est = W @ S
            batch_sums[name][n // per_batch] += est
            sq_sums[name] += float(est @ est)
    return batch_sums, sq_sums, chunks


def _monte_carlo_result(name: str, batch_sum: torch.Tensor, sq_sum: float, g: torch.Tensor, gg: float, draws: int,
                        per_batch: int, q: float, chunks: int) -> StrataMonteCarlo:
    """One scheme's errors from its batch sums: MSE, variance, squared bias with a jackknife interval over the
    batches (``q``: the t quantile), all relative to ||g||^2."""
    mean = batch_sum.sum(0) / draws
    sq_err = float((mean - g) @ (mean - g))
    var = (sq_sum / draws - float(mean @ mean)) * draws / (draws - 1)
    sq_bias = sq_err - var / draws
    X = batch_sum / per_batch - g
    _, se = jackknife_sq_norm((X @ X.T).numpy())
    return StrataMonteCarlo(name, draws, sq_err / gg, var / gg, sq_bias / gg, (sq_bias - q * se) / gg,
                            (sq_bias + q * se) / gg, chunks / draws)
