"""One group of the study: every cell of one (L, k, seed), in three parts.

* ``group_checks``    -- exactness of the chain basis itself (its chains sum to the dense
  gradient; hop strata beyond depth L vanish) and the group's facts (gradient norm,
  chain count, stratum norms);
* ``scheme_metrics``  -- per budget t and scheme: exact statistics, Monte Carlo statistics
  and the convergence curve;
* ``engine_check``    -- the chain-basis fast path against the real sparse engine on drawn sets.

Metrics written to ``results.csv`` (all relative to the exact gradient g; ĝ is the estimate):

* exact, from the chain basis and pairwise inclusion probabilities:
  ``rel_bias`` = ||E ĝ − g|| / ||g||, ``rel_var`` = tr Cov ĝ / ||g||², ``rel_mse`` = E||ĝ − g||² / ||g||²,
  ``direction_bias`` = 1 − cos(E ĝ, g), ``best_scale_residual`` = min_s ||s E ĝ − g|| / ||g|| = sin(E ĝ, g),
  ``w_p{p}`` = the expected weight w(p) = W(p) π(p) of hop stratum p (1 = unbiased);
  at matched scale (SPEC §4c): ``noise_to_signal`` = tr Cov ĝ / ||E ĝ||² and ``best_scale_mse`` =
  min_a E||a ĝ − g||² / ||g||² = 1 − ⟨E ĝ, g⟩² / (||g||² (||E ĝ||² + tr Cov ĝ));
* exact, from the hop strata's per-tensor Gram matrices (``seco_lab.stats.strata.bias_metrics``):
  ``per_tensor_residual`` = min over one scale per parameter tensor of ||(a_i E ĝ_i − g_i)_i|| / ||g||
  (what Adam's per-coordinate rescaling cannot absorb);
* Monte Carlo over N draws: ``mc_rel_sq_bias`` (debiased ||mean − g||² − tr Σ̂/N), its jackknife standard error
  ``mc_rel_sq_bias_se`` and interval ``mc_rel_sq_bias_ci_low``/``_high``, ``mc_rel_var`` (sample tr Σ̂),
  ``mc_cost`` (mean number of chunks drawn) and ``mc_covered`` (1 if the interval holds the exact squared bias;
  empty where the estimate is not random, t = k).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ...core.engine import dense_grad
from ...estimators.spaco import ChainBasis, chain_basis, flatten, hop_strata, spaco_grad
from ...stats.chain_space import (
    ChainSpace,
    Inclusion,
    MonteCarlo,
    enumerated_stats,
    exact_stats,
    monte_carlo_stats,
    scheme_chain_weights,
)
from ...stats.strata import StrataGram, bias_metrics
from .definition import (
    CHECK_COLUMNS,
    CONVERGENCE_COLUMNS,
    GROUP_COLUMNS,
    RESULT_COLUMNS,
    SAMPLER_CODES,
    Purpose,
    StudyConfig,
    build_model,
    build_tokens,
    seed_sequence,
)

__all__ = ["DETERMINISTIC_VAR", "GroupResult", "engine_check", "group_checks", "run_group", "scheme_metrics"]

# below this tr Cov / ||g||² the estimate is deterministic (t = k) and an interval's coverage means nothing
DETERMINISTIC_VAR = 1e-20


@dataclass
class GroupResult:
    """The four tables of one group (columns as in ``definition``) and the Monte Carlo draws it made."""

    results: pd.DataFrame
    checks: pd.DataFrame
    facts: pd.DataFrame
    convergence: pd.DataFrame
    draws: int


@dataclass
class GroupData:
    """What every part of a group shares: model, data, exact gradient and its chain basis."""

    model: torch.nn.Module
    tokens: torch.Tensor
    targets: torch.Tensor
    dense: torch.Tensor  # flat exact gradient
    basis: ChainBasis
    space: ChainSpace
    gram: StrataGram  # per-tensor Gram matrices of the hop strata g(p), p = 0..k-1


def group_data(cfg: StudyConfig, n_layers: int, num_chunks: int, seed: int) -> GroupData:
    model = build_model(cfg, n_layers, num_chunks, seed)
    tokens, targets = build_tokens(cfg, n_layers, num_chunks, seed)
    _, dense = dense_grad(model, tokens, targets)
    basis = chain_basis(model, tokens, targets, cfg.chunk_size, max_hops=min(n_layers, num_chunks - 1))
    gram = StrataGram.of(hop_strata(model, tokens, targets, cfg.chunk_size))
    return GroupData(model, tokens, targets, flatten(dense), basis, ChainSpace.from_basis(basis), gram)


def group_checks(cfg: StudyConfig, data: GroupData, n_layers: int) -> tuple[list[tuple], list[tuple]]:
    """(checks, facts) rows: the chain basis sums to the dense gradient, strata stop at depth L."""
    g_norm = float(data.dense.norm())
    strata = data.gram.norms() / g_norm
    chain_sum = data.basis.vectors.sum(0)
    checks = [(0, "chain_sum_vs_dense", float((chain_sum - data.dense).norm()) / g_norm),
              (0, "strata_beyond_depth", float(max([0.0, *strata[n_layers + 1:]])))]
    facts = [("g_norm", g_norm), ("n_chains", float(len(data.basis.chains)))]
    facts += [(f"stratum_norm_p{p}", float(v)) for p, v in enumerate(strata[: n_layers + 1])]
    return checks, facts


def scheme_metrics(cfg: StudyConfig, data: GroupData, variant, scheme, inc: Inclusion, mc: MonteCarlo,
                   num_chunks: int, budget: int, n_layers: int, enumerable: bool) -> tuple[dict, float, list]:
    """(metrics, enumeration check, convergence rows) of one scheme at one cell."""
    space, k, t = data.space, num_chunks, budget
    g2 = space.g_norm2
    W = scheme_chain_weights(scheme, k, t, data.basis.hops)
    ex = exact_stats(space, W, inc)
    m = dict(ex.relative(g2))
    m.update({f"w_p{p}": float(w) for p, w in enumerate(scheme.expected_weights(k, t, n_layers))})
    m["per_tensor_residual"] = bias_metrics(data.gram, scheme.expected_weights(k, t, data.gram.max_hops))[
        "per_tensor_residual"]
    ms = monte_carlo_stats(space, mc, W, cfg.ci_level)
    m.update(mc_rel_sq_bias=ms.sq_bias / g2, mc_rel_sq_bias_se=ms.sq_bias_se / g2, mc_rel_sq_bias_ci_low=ms.ci_low / g2,
             mc_rel_sq_bias_ci_high=ms.ci_high / g2, mc_rel_var=ms.cov_trace / g2, mc_cost=float(mc.mean_size))
    random_estimate = ex.cov_trace > DETERMINISTIC_VAR * g2
    m["mc_covered"] = float(ms.ci_low <= ex.sq_bias <= ms.ci_high) if random_estimate else np.nan
    enum_err = np.nan
    if enumerable:
        sq_b, tr = enumerated_stats(space, W, scheme.sampler, k, t)
        enum_err = max(abs(sq_b - ex.sq_bias), abs(tr - ex.cov_trace)) / g2
    exact_rel_bias = float(np.sqrt(max(ex.sq_bias, 0.0) / g2))
    conv = [(t, variant.label, int(n), float(err) / np.sqrt(g2), exact_rel_bias)
            for n, err in zip(mc.checkpoints, ms.convergence)]
    return m, enum_err, conv


def engine_check(cfg: StudyConfig, data: GroupData, schemes, sampler, num_chunks: int, budget: int,
                 rng: np.random.Generator) -> float:
    """Largest relative difference between the chain-basis estimate and ``spaco_grad`` on drawn sets."""
    worst = 0.0
    k, t = num_chunks, budget
    for _ in range(cfg.engine_check_draws):
        subset = sampler.draw(k, t, rng)
        if not subset:
            continue
        for _, scheme in schemes:
            _, g_hat = spaco_grad(data.model, data.tokens, data.targets, cfg.chunk_size, scheme, t, subset=subset)
            g_hat = flatten(g_hat)
            fast = data.basis.estimate(subset, scheme.chain_weights(k, t, data.basis.max_hops))
            worst = max(worst, float((fast - g_hat).norm() / max(float(g_hat.norm()), 1e-300)))
    return worst


def run_group(cfg: StudyConfig, n_layers: int, num_chunks: int, seed: int) -> GroupResult:
    """Every cell of one (L, k, seed)."""
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    L, k = n_layers, num_chunks
    data = group_data(cfg, L, k, seed)
    checks, facts = group_checks(cfg, data, L)
    rows, conv = [], []
    check_rng = np.random.default_rng(seed_sequence(cfg, L, k, seed, Purpose.ENGINE_CHECK))
    schemes = [(v, v.build()) for v in cfg.schemes]
    samplers = {s.sampler.kind: s.sampler for _, s in schemes}
    for t in cfg.budgets[k]:
        enum_errs = []
        for kind, sampler in samplers.items():
            mine = [(v, s) for v, s in schemes if s.sampler.kind == kind]
            inc = Inclusion.of(data.space, sampler, k, t)
            rng = np.random.default_rng(seed_sequence(cfg, L, k, seed, Purpose.MONTE_CARLO, t, SAMPLER_CODES[kind]))
            mc = MonteCarlo.run(data.space, sampler, k, t, cfg.draws, rng, batches=cfg.batches)
            enumerable = sampler.num_subsets(k, t) <= cfg.max_enumerated_subsets
            for variant, scheme in mine:
                metrics, enum_err, c = scheme_metrics(cfg, data, variant, scheme, inc, mc, k, t, L, enumerable)
                rows += [(t, variant.label, name, value) for name, value in metrics.items()]
                enum_errs.append(enum_err)
                conv += c
            checks.append((t, f"engine_vs_chain_basis_{kind}", engine_check(cfg, data, mine, sampler, k, t, check_rng)))
        if not np.all(np.isnan(enum_errs)):
            checks.append((t, "enumerated_vs_analytic", float(np.nanmax(enum_errs))))
    key = (L, k, seed)
    return GroupResult(
        results=pd.DataFrame([(*key, *r) for r in rows], columns=list(RESULT_COLUMNS)),
        checks=pd.DataFrame([(*key, *r) for r in checks], columns=list(CHECK_COLUMNS)),
        facts=pd.DataFrame([(*key, *r) for r in facts], columns=list(GROUP_COLUMNS)),
        convergence=pd.DataFrame([(*key, *r) for r in conv], columns=list(CONVERGENCE_COLUMNS)),
        draws=cfg.draws * len(cfg.budgets[k]) * len(samplers),
    )
