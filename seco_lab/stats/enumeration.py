"""Exact expectations and covariances of SpaCO estimates by enumerating every draw
(docs/estimators.md §5, tier 2).

    E[g_hat]   = sum_I P(I) g_hat(I)
    Cov[g_hat] = sum_I P(I) (g_hat(I) - E)(g_hat(I) - E)^T

over all C(k, t) subsets (uniform sampler) or all 2^k subsets weighted by
rho^|I| (1 - rho)^(k - |I|) (Bernoulli).  Each g_hat(I) is a real run of the
sparse engine (:func:`seco_lab.estimators.spaco.spaco_grad`), so the result is an
independent check of the closed form sum_p w(p) g(p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..core.checks import as_bool, as_int, check_budget, checked_batch, guard_memory
from ..core.engine import trainable
from ..core.grads import GradDict, flatten, unflatten
from ..estimators.schemes import Scheme, get_scheme
from ..estimators.spaco import spaco_grad

__all__ = ["Expectation", "enumerate_expectation"]

DEFAULT_MAX_SUBSETS = 20_000
DEFAULT_FULL_COV_MAX_PARAMS = 4_000


@dataclass
class Expectation:
    mean: GradDict
    cov_trace: float
    cov: torch.Tensor | None  # full (d, d) matrix, when d is small enough
    num_subsets: int
    scheme: str
    budget: int


def enumerate_expectation(
    model,
    tokens,
    targets,
    chunk_size: int,
    scheme: str | Scheme,
    budget: int,
    max_subsets: int = DEFAULT_MAX_SUBSETS,
    full_cov_max_params: int = DEFAULT_FULL_COV_MAX_PARAMS,
    ignore_index: int = -100,
    progress: bool = False,
    force: bool = False,
) -> Expectation:
    """Exact mean and covariance of ``scheme``'s estimate at budget t over every possible draw.

    Refuses (ValueError) when there are more than ``max_subsets`` draws.  The full (d, d) covariance is
    computed when the model has d <= ``full_cov_max_params`` trainable parameters (only its trace otherwise).
    What this holds -- every draw's gradient (three copies: the draws, stacked, centred) and the full
    covariance -- is checked against :data:`~seco_lab.core.checks.MEMORY_GUARD_BYTES` before the first draw
    and refused (MemoryError, stating the bytes) unless ``force=True``.
    """
    progress, force = as_bool(progress, "progress"), as_bool(force, "force")
    max_subsets = as_int(max_subsets, "max_subsets", 1)
    full_cov_max_params = as_int(full_cov_max_params, "full_cov_max_params", 0)
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    scheme = get_scheme(scheme)
    k = batch.num_chunks
    check_budget(k, budget)
    n_sub = scheme.sampler.num_subsets(k, budget)
    if n_sub > max_subsets:
        raise ValueError(
            f"enumerating {scheme.name!r} at k={k}, t={budget} needs {n_sub} subsets, more than "
            f"max_subsets={max_subsets}; use fewer chunks or raise the limit"
        )
    params = [p for _, p in trainable(model)]
    d, dtype = sum(p.numel() for p in params), params[0].dtype
    item = params[0].element_size()
    draws_bytes, cov_bytes = 3 * n_sub * d * item, d * d * item if d <= full_cov_max_params else 0
    cov = (f", and the full {d:,} x {d:,} covariance of {str(dtype).removeprefix('torch.')} = {cov_bytes:,} bytes "
           f"(d = {d:,} <= full_cov_max_params = {full_cov_max_params:,})" if cov_bytes else "")
    guard_memory("enumerate_expectation", draws_bytes + cov_bytes,
                 f"{n_sub:,} draw(s) x {d:,} parameters x {item} bytes x 3 copies = {draws_bytes:,} bytes{cov}",
                 (f"lower full_cov_max_params below d = {d:,} (the covariance's trace is computed without it), "
                  if cov_bytes else "") + "use fewer chunks or a smaller model", force)
    probs, flats, like = [], [], None
    for subset, p in tqdm(scheme.sampler.subsets(k, budget), total=n_sub, disable=not progress, desc="subsets"):
        if subset:
            _, g = spaco_grad(model, batch.tokens, batch.targets, chunk_size, scheme, budget, subset=subset,
                              ignore_index=ignore_index)
            like = g
            flats.append(flatten(g))
        else:  # the empty Bernoulli draw backprops nothing
            flats.append(None)
        probs.append(float(p))
    d = flats[next(i for i, f in enumerate(flats) if f is not None)].numel()
    ref = next(f for f in flats if f is not None)
    G = torch.stack([torch.zeros(d, dtype=ref.dtype, device=ref.device) if f is None else f for f in flats])
    w = torch.tensor(probs, dtype=G.dtype, device=G.device)
    mean = w @ G
    centred = G - mean
    cov_trace = float((w * centred.pow(2).sum(1)).sum())
    cov = (centred.T * w) @ centred if d <= full_cov_max_params else None
    return Expectation(unflatten(mean, like), cov_trace, cov, n_sub, scheme.name, budget)
