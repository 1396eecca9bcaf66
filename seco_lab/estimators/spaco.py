"""SpaCO: the sparse engine, the hop strata and the chain basis (docs/estimators.md §2-3).

* :func:`spaco_grad` visits only the drawn chunks I (decreasing order) and backprops
  ``c_0 J_j + sum_q c_q <m_j, G_j(q)>``.  Schemes whose c_q does not depend on q
  use a single relay buffer; the others keep one buffer per hop count.
* :func:`hop_strata` returns g(p), p = 0..P: the gradient grouped by the number of
  KV-cache hops of its chain (optionally restricted to a drawn set, g_I(p)).
  Every scheme sharing a sampler is a reweighting of the same strata:
  ``g_hat_s(I) = sum_p W_s(p) g_I(p)``.
* :func:`chain_basis` splits the gradient further, into one vector per chain
  j = i_0 > i_1 > ... > i_p.  The estimate of any scheme on any draw is then
  ``sum_{chains c subset of I} W(p_c) v_c`` -- the Monte Carlo study's fast path.

``max_hops`` is P, the deepest hop stratum kept.  Where it may be omitted its default is the
largest P that can hold a nonzero stratum, so nothing is dropped: :func:`spaco_grad` min(|I| - 1, L)
(a chain crosses at most L = the model's cache layers, and at most |I| - 1 drawn chunks);
:func:`hop_strata` k - 1 (any model); :func:`seco_lab.stats.strata.strata_monte_carlo` min(L, k - 1).
:func:`chain_basis` has no default: its size grows like k^P.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..core.checks import as_bool, as_float, as_int, check_budget, check_max_hops, check_subset, guard_memory
from ..core.engine import (
    accumulate_into,
    backward_sweep,
    cache_leaves,
    checked_batch,
    hop_sweep,
    require_autograd,
    trainable,
)
from ..core.grads import GradDict, accumulation_dtype, flatten, named_grads
from .schemes import Scheme, get_scheme

__all__ = ["ChainBasis", "HopStrata", "chain_basis", "hop_strata", "spaco_grad"]


def spaco_grad(
    model,
    tokens,
    targets,
    chunk_size: int,
    scheme: str | Scheme = "falling-factorial",
    budget: int = 1,
    subset=None,
    generator: np.random.Generator | int | None = None,
    ignore_index: int = -100,
    max_hops: int | None = None,
    keep_graphs: int | None = None,
) -> tuple[torch.Tensor, GradDict]:
    """Sparse chunk-wise gradient estimate for one drawn set I (docs/estimators.md §3).

    ``subset`` fixes I (0-based chunk indices); otherwise it is drawn from the
    scheme's sampler with ``generator`` (a numpy Generator or a seed).  Returns
    (full-sequence loss from the forward pass, gradient estimate).

    Hop-dependent schemes keep one relay buffer per hop count q = 1..P.  P defaults
    to min(|I| - 1, L), L = number of cache layers: a chain crosses at most L caches
    (docs/estimators.md §2, checked by the tier-1 tests), so deeper strata are exactly zero.
    Pass ``max_hops=len(subset) - 1`` for a model without that property.

    ``keep_graphs`` = n: pass 1 forwards the last n drawn chunks with a graph and pass 2 backpropagates
    them as they are instead of rebuilding them -- n chunk forwards fewer, for n chunks' activations held
    from pass 1 to pass 2 (a memory cost independent of the sequence length).  The same estimate up to
    rounding (tested).  Default: the model's ``keep_graphs`` attribute, 0 where it has none.  On a CPU it was
    measured 1.19x slower than rebuilding (docs/cost.md, "SpaCO: graphs kept from pass 1").
    """
    require_autograd("spaco_grad")
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    scheme = get_scheme(scheme)
    k, t = check_budget(batch.num_chunks, budget)
    if max_hops is not None:
        max_hops = check_max_hops(max_hops)
    if subset is None:
        subset = scheme.sampler.draw(k, t, generator)
    subset = check_subset(subset, k, t if scheme.sampler.kind == "uniform" else None)
    keep_graphs = as_int(getattr(model, "keep_graphs", 0) if keep_graphs is None else keep_graphs, "keep_graphs", 0)
    params = trainable(model)
    acc = [torch.zeros_like(p, dtype=accumulation_dtype(p.dtype)) for _, p in params]  # 16-bit: summed in float32
    kept: dict = {}
    leaves, loss = cache_leaves(model, batch, keep=subset[len(subset) - min(keep_graphs, len(subset)):], kept=kept)
    depth = len(leaves[0])  # cache layers
    P = min(max(len(subset) - 1, 0), depth if max_hops is None else max_hops)
    c = scheme.factors(k, t, P)
    tensors, collect = [p for _, p in params], accumulate_into(acc)
    if scheme.constant_relay(k, t):  # one label: every hop multiplies by c_1 (one relay buffer)
        relay_factor = float(c[1]) if P >= 1 else 0.0
        backward_sweep(model, batch, leaves, tensors, subset, direct_label=lambda j: 0, direct_scale=float(c[0]),
                       relay=lambda lab, j, i: (0, relay_factor), collect=collect, collect_total=True, kept=kept)
    else:
        hop_sweep(model, batch, leaves, tensors, subset, P, collect, factors=c, collect_total=True, kept=kept)
    return loss, named_grads(params, [a.to(p.dtype) for a, (_, p) in zip(acc, params)])


@dataclass
class HopStrata:
    """g(p) for p = 0..P (restricted to ``subset`` when one was given).

    ``remainder`` (when measured, ``hop_strata(..., remainder=True)``) is g(>P) = g - sum_{p<=P} g(p)
    with g from a SeCO sweep over the same chunks: the mass a P below the deepest chain leaves out.
    """

    loss: torch.Tensor
    strata: list[GradDict]
    num_chunks: int
    subset: tuple[int, ...] | None
    remainder: GradDict | None = None

    @property
    def max_hops(self) -> int:
        return len(self.strata) - 1

    def total(self) -> GradDict:
        return self.combine(np.ones(len(self.strata)))

    def combine(self, weights) -> GradDict:
        """sum_p weights[p] g(p); weights beyond P are ignored, missing ones count as 0.  An exactly zero
        stratum adds nothing whatever its weight (chains deeper than the model are zero, while W(p) = (k/t)^p
        may exceed float range there); a weight beyond the gradient dtype's range on a non-zero stratum is
        refused rather than turned into inf or NaN."""
        if isinstance(weights, (str, bytes, dict, set, frozenset)) or not hasattr(weights, "__iter__"):
            raise TypeError(f"weights must be a sequence of numbers W(0), W(1), ... in hop order (a list, tuple, "
                            f"array or tensor), got {type(weights).__name__}")
        out = {n: torch.zeros_like(g) for n, g in self.strata[0].items()}
        for p, (w, g) in enumerate(zip(weights, self.strata)):
            w = weight_as_float(w, p)  # an infinite weight on a zero stratum adds nothing (above)
            if math.isnan(w):
                raise ValueError(f"weight W({p}) is NaN: the scheme's weights are not defined at {p} hops")
            if w == 0 or not any(bool(t.any()) for t in g.values()):
                continue
            if not all(abs(w) <= torch.finfo(t.dtype).max for t in g.values()):
                raise ValueError(f"weight {w:.3g} on the non-zero stratum g({p}) exceeds the range of its dtype: "
                                 "the estimate would be inf or NaN; lower max_hops or the weights")
            for n in out:
                out[n].add_(g[n], alpha=w)
        return out

    def estimate(self, scheme: str | Scheme, budget: int) -> GradDict:
        """The scheme's sparse estimate for this draw: sum_p W(p) g_I(p).  On the strata of a drawn subset
        I, a uniform scheme's budget must be |I| (it draws exactly t chunks)."""
        scheme = get_scheme(scheme)
        _, budget = check_budget(self.num_chunks, budget)
        if self.subset is not None and scheme.sampler.kind == "uniform" and budget != len(self.subset):
            raise ValueError(f"budget t={budget} does not match the drawn subset {self.subset} of {len(self.subset)} "
                             f"chunk(s): scheme {scheme.name!r} draws exactly t chunks; pass budget={len(self.subset)}")
        return self.combine(scheme.chain_weights(self.num_chunks, budget, self.max_hops))

    def norms(self) -> np.ndarray:
        return np.array([float(flatten(g).norm()) for g in self.strata])

    def with_remainder(self) -> list[GradDict]:
        """[g(0), ..., g(P), g(>P)]: the strata and the measured remainder (they sum to g exactly)."""
        if self.remainder is None:
            raise ValueError("the remainder was not measured: call hop_strata(..., remainder=True)")
        return [*self.strata, self.remainder]

    def remainder_ratio(self) -> float:
        """||g(>P)|| / ||g||: the bound every number computed from g(0..P) alone carries."""
        rest = flatten(self.with_remainder()[-1])
        return float(rest.norm() / (flatten(self.total()) + rest).norm())


def hop_strata(
    model, tokens, targets, chunk_size: int, max_hops: int | None = None, subset=None, ignore_index: int = -100,
    force: bool = False,
    remainder: bool = False,
) -> HopStrata:
    """One stratified pass: relay buffers per hop count, chunk j's loss seeds stratum 0
    and the gradient it receives in stratum q is relayed to stratum q+1 of earlier chunks.

    ``max_hops`` defaults to k-1, so nothing is dropped and sum_p g(p) is the exact gradient;
    a smaller P drops the strata above it, and a larger one is clipped to k-1 (no chain of a k-chunk
    sequence has more hops: those strata would be zero).  Each stratum is one gradient-sized
    buffer: more than :data:`~seco_lab.core.checks.MEMORY_GUARD_BYTES` in all is refused unless ``force``.
    ``remainder=True`` measures what was dropped, ``HopStrata.remainder`` = g(>P) = g - sum_{p<=P} g(p), as one
    more stratum of the same sweep (the chains of more than P hops; see :func:`strata_sweep`).
    Both flags must be True or False (``force="no"`` is refused, not read as True).
    """
    require_autograd("hop_strata")
    force, remainder = as_bool(force, "force"), as_bool(remainder, "remainder")
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    k = batch.num_chunks
    max_hops = k - 1 if max_hops is None else min(check_max_hops(max_hops), k - 1)
    visit = range(k) if subset is None else check_subset(subset, k)
    params = trainable(model)
    grad_bytes = sum(p.numel() * p.element_size() for _, p in params)
    guard_memory("hop_strata", (max_hops + 1 + remainder) * grad_bytes,
                 f"{max_hops + 1} strata x {grad_bytes / 2**20:,.1f} MiB of gradients",
                 "lower max_hops (strata above it are dropped) or use fewer, longer chunks", force)
    leaves, loss = cache_leaves(model, batch)
    strata, rest = strata_sweep(model, batch, leaves, [p for _, p in params], visit, max_hops, remainder)
    return HopStrata(loss, [named_grads(params, s) for s in strata], k, None if subset is None else tuple(visit),
                     None if rest is None else named_grads(params, rest))


def strata_sweep(model, batch, leaves, params, visit, max_hops: int,
                 remainder: bool = False) -> tuple[list[list[torch.Tensor]], list[torch.Tensor] | None]:
    """The stratified sweep of :func:`hop_strata` over given cache leaves (pass 1 done by the caller, so
    several sweeps -- e.g. Monte Carlo draws -- share it): ([g(0), ..., g(P)], g(>P) or None), each a
    list of tensors in the order of ``params``.  g(>P) is its own stratum of the same sweep (every chain of
    more than P hops, :func:`~seco_lab.core.engine.hop_relay` with ``lump``), not g - sum_p g(p): exactly 0
    when no chain of ``visit`` has more than P hops (|visit| <= P + 1), and free of the cancellation error
    of a difference."""
    strata = [[torch.zeros_like(p) for p in params] for _ in range(max_hops + 1 + remainder)]

    def collect(q, j, grads):
        for a, g in zip(strata[q], grads):
            a.add_(g)

    hop_sweep(model, batch, leaves, params, visit, max_hops, collect, lump=remainder)
    return (strata[:-1], strata[-1]) if remainder else (strata, None)


def total_sweep(model, batch, leaves, params, visit) -> list[torch.Tensor]:
    """The unweighted sweep over ``visit`` (every chain inside it, any depth): a SeCO step over the given
    cache leaves when ``visit`` is every chunk, sum_p g_I(p) otherwise."""
    total = [torch.zeros_like(p) for p in params]
    backward_sweep(model, batch, leaves, params, visit, direct_label=lambda j: 0, direct_scale=1.0,
                   relay=lambda q, j, i: (0, 1.0), collect=accumulate_into(total))
    return total


@dataclass
class ChainBasis:
    """One gradient vector per chain j = i_0 > ... > i_p (p <= P), flattened over parameters.

    ``chains[c]`` is the chunk tuple, ``hops[c] = p``, ``masks[c]`` the chunk set as a bitmask,
    ``vectors[c]`` its contribution v_c, so that g(p) = sum_{hops[c] = p} v_c and a scheme's
    estimate on draw I is sum_{c subset of I} W(hops[c]) v_c.
    """

    chains: list[tuple[int, ...]]
    hops: np.ndarray
    masks: np.ndarray
    vectors: torch.Tensor
    num_chunks: int
    max_hops: int
    loss: float
    like: GradDict

    def contained(self, subset) -> np.ndarray:
        """Which chains lie inside ``subset`` (distinct chunk indices in [0, k), checked)."""
        m = sum(1 << j for j in check_subset(subset, self.num_chunks))
        return (self.masks & ~np.int64(m)) == 0

    def estimate(self, subset, chain_weights) -> torch.Tensor:
        """sum over chains inside ``subset`` of W(p) v_c (flat); ``chain_weights`` holds W(0), ..., W(P)."""
        try:
            raw = chain_weights.detach().cpu().numpy() if isinstance(chain_weights, torch.Tensor) else \
                np.asarray(chain_weights)
            if np.iscomplexobj(raw) or raw.dtype == bool:  # a cast would drop the imaginary part
                raise TypeError(f"got {raw.dtype} values")
            if raw.dtype == object and raw.ndim == 1:  # ints beyond int64, Fractions: each checked as combine does
                raw = np.array([weight_as_float(x, p) for p, x in enumerate(raw)])
            w = raw.astype(float)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:  # complex, strings, ragged lists
            raise ValueError(f"chain_weights must be real numbers W(0), ..., W(P): {e}") from None
        if w.ndim != 1 or len(w) < self.max_hops + 1 or not np.isfinite(w[: self.max_hops + 1]).all():
            raise ValueError(f"chain_weights must hold W(0), ..., W(P) for P = {self.max_hops} hops: "
                             f"{self.max_hops + 1} finite numbers, got {np.asarray(chain_weights).tolist()!r:.120}")
        coef = np.where(self.contained(subset), w[self.hops], 0.0)
        return torch.as_tensor(coef, dtype=self.vectors.dtype) @ self.vectors


def weight_as_float(w, p: int) -> float:
    """The weight W(p) as a float (inf allowed: the callers check it against their strata): a one-element
    tensor's value, an int too large for a float or a non-number refused naming W(p)."""
    return as_float(w.item() if isinstance(w, torch.Tensor) and w.numel() == 1 else w, f"weight W({p})",
                    finite=False)


def chain_basis(model, tokens, targets, chunk_size: int, max_hops: int, ignore_index: int = -100,
                force: bool = False) -> ChainBasis:
    """Decompose the gradient into per-chain vectors, chains of at most ``max_hops`` hops.

    Each chain's seed is relayed separately (labels are chain tuples); all seeds
    that reach a chunk share one rebuild and one batched vector-Jacobian product.
    A chain is a decreasing run of chunks, so there are N = sum_{m=1}^{P+1} C(k, m) of them
    (2^k - 1 at P = k-1), each a gradient-sized vector: N times the gradient's bytes above
    :data:`~seco_lab.core.checks.MEMORY_GUARD_BYTES` is refused unless ``force`` (True or False).
    """
    require_autograd("chain_basis")
    force = as_bool(force, "force")
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    k = batch.num_chunks
    if k > 62:
        raise ValueError(f"chain_basis stores chunk sets as 64-bit masks: k={k} chunks is too many (max 62)")
    max_hops = check_max_hops(max_hops)
    params = trainable(model)
    n_chains = sum(math.comb(k, m) for m in range(1, min(max_hops, k - 1) + 2))
    grad_bytes = sum(p.numel() * p.element_size() for _, p in params)
    guard_memory("chain_basis", n_chains * grad_bytes,
                 f"{n_chains:,} chains of at most {max_hops} hops over k={k} chunks x {grad_bytes / 2**20:,.2f} MiB "
                 "each; the count grows as 2^k", "lower max_hops or use fewer, longer chunks", force)
    leaves, loss = cache_leaves(model, batch)
    found: dict[tuple[int, ...], torch.Tensor] = {}

    def collect(chain, j, grads):
        found[chain] = torch.cat([g.reshape(-1) for g in grads])

    backward_sweep(
        model, batch, leaves, [p for _, p in params], range(k),
        direct_label=lambda j: (j,), direct_scale=1.0,
        relay=lambda chain, j, i: (chain + (i,), 1.0) if len(chain) <= max_hops else None, collect=collect,
    )
    chains = sorted(found, key=lambda c: (len(c), c))
    return ChainBasis(
        chains=chains,
        hops=np.array([len(c) - 1 for c in chains], dtype=np.int64),
        masks=np.array([sum(1 << j for j in c) for c in chains], dtype=np.int64),
        vectors=torch.stack([found[c] for c in chains]),
        num_chunks=k,
        max_hops=max_hops,
        loss=float(loss),
        like={n: p.detach() for n, p in params},
    )
