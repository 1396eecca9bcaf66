"""One paper-settings group of the study: k = 128 (and up) chunks, where the chain basis
(about C(k, L+1) chains) does not scale and hop strata do.

* exact, first order -- one stratified pass with P = L gives g(p), p = 0..L, and their
  per-tensor Gram matrices; every scheme's E ĝ = Σ_p w(p) g(p), so ``bias_metrics`` gives
  ``rel_bias``, ``direction_bias``, ``best_scale_residual`` and ``scale`` exactly
  (``seco_lab.stats.strata``), and ``per_tensor_residual``;
* Monte Carlo, second order -- per budget t and sampler, ``strata_monte_carlo`` draws N sets,
  one stratified sparse sweep each, shared by every scheme of that sampler: ``mc_rel_var``
  (sample tr Σ̂ / ||g||²), ``mc_rel_sq_bias`` (debiased ||mean − g||² − tr Σ̂/N) with its
  jackknife interval ``mc_rel_sq_bias_ci_low``/``_high``, ``mc_covered`` (1 if the interval
  holds the exact squared bias ``rel_bias``²; empty where the estimate is not random),
  ``rel_mse`` = ``rel_bias``² + ``mc_rel_var`` (exact bias, Monte Carlo variance) and
  ``mc_cost`` (mean number of chunks drawn);
* matched scale (SPEC §4c; exact mean, Monte Carlo variance): ``noise_to_signal`` = ``mc_rel_var`` ·
  ||g||² / ||E ĝ||² and ``best_scale_mse`` = min_a E||a ĝ − g||² / ||g||² = 1 − ⟨E ĝ, g⟩² / (||g||²
  (||E ĝ||² + tr Σ̂)).

Checks: Σ_{p ≤ L} g(p) equals the dense gradient (so nothing travels more than L hops, and the
strata are exact).
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch

from ...core.engine import dense_grad
from ...estimators.spaco import flatten, hop_strata
from ...stats.chain_space import matched_scale
from ...stats.strata import StrataGram, bias_metrics, strata_monte_carlo
from .definition import (
    CHECK_COLUMNS,
    GROUP_COLUMNS,
    PAPER_COLUMNS,
    SAMPLER_CODES,
    Purpose,
    StudyConfig,
    build_model,
    build_tokens,
    seed_sequence,
)
from .group import DETERMINISTIC_VAR, GroupResult

__all__ = ["run_paper_group"]


def exact_metrics(gram: StrataGram, scheme, num_chunks: int, budget: int) -> dict[str, float]:
    """First-order metrics of one scheme at (k, t) from the strata's Gram matrices, and its weights w(p)."""
    w = np.asarray(scheme.expected_weights(num_chunks, budget, gram.max_hops), dtype=np.float64)
    m = bias_metrics(gram, w)
    G = gram.total
    gg = float(G.sum())
    # <E g_hat, g> and ||E g_hat||^2 relative to ||g||^2 (not stored: monte_carlo_metrics turns them into the
    # matched-scale metrics)
    m["_rel_inner"], m["_rel_mean_sq"] = float(w @ G.sum(1)) / gg, float(w @ G @ w) / gg
    m.update({f"w_p{p}": float(x) for p, x in enumerate(w)})
    return m


def monte_carlo_metrics(mc, exact: dict[str, float]) -> dict[str, float]:
    """A scheme's ``StrataMonteCarlo`` as stored metrics, with the interval's coverage of the exact value,
    and the matched-scale metrics (exact mean from ``exact_metrics``, Monte Carlo variance)."""
    sq_bias = exact["rel_bias"] ** 2
    random_estimate = mc.rel_var > DETERMINISTIC_VAR
    return {"mc_rel_sq_bias": mc.rel_sq_bias, "mc_rel_sq_bias_ci_low": mc.ci_low, "mc_rel_sq_bias_ci_high": mc.ci_high,
            "mc_rel_var": mc.rel_var, "mc_rel_sq_err": mc.rel_sq_err, "rel_mse": sq_bias + mc.rel_var,
            "mc_cost": mc.mean_chunks,
            "mc_covered": float(mc.ci_low <= sq_bias <= mc.ci_high) if random_estimate else np.nan,
            **matched_scale(exact["_rel_inner"], exact["_rel_mean_sq"], mc.rel_var)}


def run_paper_group(cfg: StudyConfig, n_layers: int, num_chunks: int, seed: int) -> tuple[GroupResult, dict]:
    """Every cell of one paper-settings (L, k, seed) and the seconds each part took."""
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    L, k = n_layers, num_chunks
    for t in cfg.paper_budgets:
        if not 1 <= t < k:
            raise ValueError(f"paper budget t={t} must lie in [1, k) for k={k}: change paper_budgets or paper_cells")
    start = time.perf_counter()
    model = build_model(cfg, L, k, seed)
    tokens, targets = build_tokens(cfg, L, k, seed)
    _, dense = dense_grad(model, tokens, targets)
    g = flatten(dense)
    g_norm = float(g.norm())
    P = min(L, k - 1)
    strata = hop_strata(model, tokens, targets, cfg.chunk_size, max_hops=P)
    gram = StrataGram.of(strata)
    checks = [(0, "paper_strata_sum_vs_dense", float((flatten(strata.total()) - g).norm()) / g_norm)]
    facts = [("g_norm", g_norm)] + [(f"stratum_norm_p{p}", float(v) / g_norm) for p, v in enumerate(gram.norms())]
    schemes = [(v, v.build()) for v in cfg.schemes]
    exact = {(t, v.label): exact_metrics(gram, s, k, t) for t in cfg.paper_budgets for v, s in schemes}
    seconds = {"exact": time.perf_counter() - start}
    rows = []
    for kind, code in SAMPLER_CODES.items():
        mine = {v.label: s for v, s in schemes if s.sampler.kind == kind}
        if not mine:
            continue
        start = time.perf_counter()
        for t in cfg.paper_budgets:
            rng = np.random.default_rng(seed_sequence(cfg, L, k, seed, Purpose.STRATA_MONTE_CARLO, t, code))
            sampler = next(iter(mine.values())).sampler
            mc = strata_monte_carlo(model, tokens, targets, cfg.chunk_size, sampler, t, mine, cfg.paper_draws, rng,
                                    max_hops=P, batches=cfg.paper_batches, reference=g, level=cfg.ci_level)
            for label, stats in mc.items():
                ex = exact[(t, label)]
                metrics = {**{n: v for n, v in ex.items() if not n.startswith("_")}, **monte_carlo_metrics(stats, ex)}
                rows += [(t, label, name, value) for name, value in metrics.items()]
        seconds[f"monte_carlo_{kind}"] = time.perf_counter() - start
    key = (L, k, seed)
    n_samplers = len({s.sampler.kind for _, s in schemes})
    result = GroupResult(
        results=pd.DataFrame([(*key, *r) for r in rows], columns=list(PAPER_COLUMNS)),
        checks=pd.DataFrame([(*key, *r) for r in checks], columns=list(CHECK_COLUMNS)),
        facts=pd.DataFrame([(*key, *r) for r in facts], columns=list(GROUP_COLUMNS)),
        convergence=None,
        draws=cfg.paper_draws * len(cfg.paper_budgets) * n_samplers,
    )
    return result, seconds
