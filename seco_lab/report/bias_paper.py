"""The bias report's numbers at the paper's settings (``paper.csv``: k = 128 and up) and the
evidence behind "Which scheme should I use?", from the stored study alone (no plotting)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..estimators.schemes import get_scheme
from ..studies.bias.definition import (
    BERNOULLI,
    FALLING_FACTORIAL,
    PAPER,
    PAPER_CAPPED_2,
    RELEASED,
    RELEASED_UNBIASED,
    SCHEMES,
)
from .exactness import EXACT_TOL
from .figures import scheme_order

__all__ = [
    "PAPER_METRICS", "UNBIASED_TOL", "coinciding", "guidance", "paper_cells", "scheme_definitions",
    "summarize_paper",
]

PAPER_K = 128  # the paper's chunk count: 16K tokens in chunks of 128
UNBIASED_TOL = EXACT_TOL  # relative bias below this is "exactly unbiased" (the float64 rule of every report)
# the schemes of the headline table: the paper's formula, what it ran, the public code, and the unbiased ones
HEADLINE_SCHEMES = (PAPER, PAPER_CAPPED_2, RELEASED, RELEASED_UNBIASED, FALLING_FACTORIAL, BERNOULLI)
# column -> (stored metric, heading) of the paper-settings tables
PAPER_METRICS = {
    "rel_bias": "relative bias",
    "direction_bias": "direction bias 1 − cos",
    "best_scale_residual": "best-scale residual",
    "per_tensor_residual": "per-tensor residual",
    "mc_rel_var": "variance (MC)",
    "rel_mse": "MSE",
    "noise_to_signal": "noise-to-signal",
    "best_scale_mse": "best-scale MSE",
}


def paper_cells(paper: pd.DataFrame) -> pd.DataFrame:
    """``paper.csv`` (long) as one row per (L, k, t, seed, scheme) with a column per metric."""
    if paper.empty:
        return pd.DataFrame(columns=["L", "k", "t", "seed", "scheme", *PAPER_METRICS])
    cells = paper.pivot_table(index=["L", "k", "t", "seed", "scheme"], columns="metric", values="value",
                              dropna=False).reset_index()
    cells.columns.name = None
    for m in PAPER_METRICS:  # a study written before the matched-scale metrics: they show as missing
        if m not in cells:
            cells[m] = np.nan
    return derive_matched_scale(cells.dropna(subset=["rel_bias"]))


def derive_matched_scale(cells: pd.DataFrame) -> pd.DataFrame:
    """Fill missing matched-scale metrics of paper-settings cells from what every study stored: with
    cos = 1 - direction_bias and the best scale a = <E ĝ, g> / ||E ĝ||², ||E ĝ|| / ||g|| = x = cos / a, so

        noise_to_signal = var / x²,    best_scale_mse = 1 - cos² x² / (x² + var)     (var = mc_rel_var)

    -- the same numbers the study computes from the strata (tested equal on the quick study).  A study stored
    before the metrics existed (study format < 4) gets them this way; stored values are kept."""
    cells = cells.copy()
    cos = 1.0 - cells.direction_bias
    x2 = (cos / cells.scale.where(cells.scale != 0)) ** 2
    var = cells.mc_rel_var
    derived = {"noise_to_signal": var / x2, "best_scale_mse": (1.0 - cos**2 * x2 / (x2 + var)).clip(0.0, 1.0)}
    cells.attrs["matched_scale_derived"] = bool(cells[list(derived)].isna().any().any())
    for m, v in derived.items():
        cells[m] = cells[m].fillna(v)
    return cells


def settings_table(mean: pd.DataFrame, n_layers: int, num_chunks: int, labels) -> pd.DataFrame:
    """Scheme x budget rows of every paper metric at (L, k), mean over seeds."""
    d = mean[(mean.L == n_layers) & (mean.k == num_chunks) & mean.scheme.isin(labels)]
    order = {s: i for i, s in enumerate(scheme_order(labels))}
    d = d.assign(_o=d.scheme.map(order)).sort_values(["_o", "t"])
    out = d[["scheme", "t", *PAPER_METRICS]].rename(columns=PAPER_METRICS)
    return out.reset_index(drop=True)


def _at(mean: pd.DataFrame, scheme: str, n_layers: int, num_chunks: int, budget: int, metric: str) -> float:
    d = mean[(mean.scheme == scheme) & (mean.L == n_layers) & (mean.k == num_chunks) & (mean.t == budget)]
    return float(d[metric].iloc[0]) if len(d) else float("nan")


def relay_costs(num_chunks: int, budgets) -> pd.DataFrame:
    """Per scheme: whether one relay buffer suffices (``Scheme.constant_relay``) at each budget."""
    rows = []
    for v in SCHEMES:
        s = v.build()
        const = [s.constant_relay(num_chunks, t) for t in budgets]
        rows.append({"scheme": v.label, "relay": "constant (one buffer)" if all(const) else
                     ("stratified (one buffer per hop count)" if not any(const) else
                      "constant at t = " + ", ".join(str(t) for t, c in zip(budgets, const) if c))})
    return pd.DataFrame(rows)


def guidance(mean: pd.DataFrame, n_layers: int, num_chunks: int, budgets) -> dict:
    """The numbers behind "Which scheme should I use?" at (L, k) for every budget."""
    at = {m: {s.label: {t: _at(mean, s.label, n_layers, num_chunks, t, m) for t in budgets} for s in SCHEMES}
          for m in ("rel_bias", "direction_bias", "best_scale_residual", "per_tensor_residual", "mc_rel_var",
                    "rel_mse", "scale", "mc_cost", "noise_to_signal", "best_scale_mse")}
    var, nts = at["mc_rel_var"], at["noise_to_signal"]
    price = {s.label: {t: var[s.label][t] / var[PAPER.label][t] for t in budgets}
             for s in (FALLING_FACTORIAL, BERNOULLI, RELEASED_UNBIASED)}
    # the same price at matched scale: noise-to-signal relative to paper's (a tuned rate removes any scale)
    nts_price = {s: {t: nts[s][t] / nts[PAPER.label][t] for t in budgets} for s in price}
    d = mean[(mean.scheme == PAPER.label) & (mean.L == n_layers) & (mean.k == num_chunks)].set_index("t")
    paper_w = {int(t): [float(d.loc[t, f"w_p{p}"]) for p in range(n_layers + 1)] for t in budgets}
    return {"L": n_layers, "k": num_chunks, "budgets": list(budgets), "at": at, "var_price": price,
            "nts_price": nts_price, "paper_weights": paper_w}


def unbiased_where(cells: pd.DataFrame) -> dict:
    """Per scheme: the largest relative bias where t ≥ L+1 and where t < L+1 (over every paper cell), and in how
    many of its cells (``"unbiased"`` of ``"cells"``) the relative bias is below :data:`UNBIASED_TOL`."""
    out = {}
    for s in scheme_order(cells.scheme):
        d = cells[cells.scheme == s]
        deep = d.t >= d.L + 1
        out[s] = {"t ≥ L+1": float(d[deep].rel_bias.max()) if deep.any() else float("nan"),
                  "t < L+1": float(d[~deep].rel_bias.max()) if (~deep).any() else float("nan"),
                  "unbiased": int((d.rel_bias < UNBIASED_TOL).sum()), "cells": len(d)}
    return out


def stratum_shares(groups: pd.DataFrame, num_chunks: int) -> dict[int, list[float]]:
    """Per depth L: ||g(p)|| / ||g|| for p = 0..L at k = ``num_chunks``, mean over seeds (from groups.csv)."""
    d = groups[(groups.k == num_chunks) & groups.metric.str.startswith("stratum_norm_p")]
    d = d.assign(p=d.metric.str.removeprefix("stratum_norm_p").astype(int))
    m = d.groupby(["L", "p"]).value.mean()
    return {int(L): [float(m[(L, p)]) for p in range(int(L) + 1) if (L, p) in m.index] for L in
            sorted(d.L.unique())}


def coinciding(mean: pd.DataFrame, n_layers: int, num_chunks: int) -> dict[int, list[list[str]]]:
    """Per budget t: the sets of schemes whose exact first-order metrics agree to 1e-12 and Monte Carlo variance
    to 1e-9 (same weights, same draws: their curves coincide, e.g. a capped variant whose cap does not bind)."""
    d = mean[(mean.L == n_layers) & (mean.k == num_chunks)]
    keys = ["rel_bias", "best_scale_residual", "per_tensor_residual", "mc_rel_var"]
    out = {}
    for t, e in d.groupby("t"):
        groups: list[list[str]] = []
        rows = {r.scheme: np.array([getattr(r, m) for m in keys]) for r in e.itertuples()}
        for s in scheme_order(list(rows)):
            for g in groups:
                if np.allclose(rows[g[0]], rows[s], rtol=1e-9, atol=1e-15):
                    g.append(s)
                    break
            else:
                groups.append([s])
        out[int(t)] = [g for g in groups if len(g) > 1]
    return out


def summarize_paper(paper: pd.DataFrame, groups: pd.DataFrame, level: float) -> dict | None:
    """Every number of the report's paper-settings sections; None when the study has no paper cells."""
    cells = paper_cells(paper)
    if cells.empty:
        return None
    derived = cells.attrs.get("matched_scale_derived", False)
    mean = cells.groupby(["L", "k", "t", "scheme"], as_index=False).mean(numeric_only=True)
    ks = sorted(int(k) for k in cells.k.unique())
    k0 = PAPER_K if PAPER_K in ks else ks[0]
    depths = sorted(int(L) for L in cells[cells.k == k0].L.unique())
    budgets = sorted(int(t) for t in cells[cells.k == k0].t.unique())
    covered = cells.mc_covered.dropna()
    headline = [s.label for s in HEADLINE_SCHEMES]
    return {
        "matched_scale_derived": derived,
        "k": k0, "depths": depths, "budgets": budgets, "seeds": sorted(int(s) for s in cells.seed.unique()),
        "tables": {L: settings_table(mean, L, k0, headline) for L in depths},
        "all_schemes": {L: settings_table(mean, L, k0, scheme_order(cells.scheme)) for L in depths},
        "other_k": {(int(L), int(k)): settings_table(mean, L, k, headline)
                    for L, k in sorted({(int(a), int(b)) for a, b in zip(cells.L, cells.k) if b != k0})},
        "guidance": {L: guidance(mean, L, k0, budgets) for L in depths},
        "unbiased": unbiased_where(cells),
        "relay": relay_costs(k0, budgets),
        "covered": (int(covered.sum()), len(covered)), "level": level,
        "strata": stratum_shares(groups, k0),
        "coinciding": {L: coinciding(mean, L, k0) for L in depths},
        "mean": mean,
    }


# where each scheme comes from, beyond the short origin in ``Scheme.description`` (the review's corrections)
ORIGIN_NOTES = {
    "paper-chain-capped": "the review's reading of the paper's cap (c_0 = 1)",
    "falling-factorial": "the review's correction: Horvitz–Thompson weights, unbiased when t ≥ L+1",
    "bernoulli": "the review's correction: Bernoulli(ρ = t/k) inclusion, unbiased at every t",
}


def scheme_definitions() -> pd.DataFrame:
    """One line per scheme variant of the study: c_0, c_q (from ``Scheme.description``) and where it comes from."""
    rows = []
    for v in SCHEMES:
        s = v.build()
        origin, _, formula = get_scheme(v.name).description.partition(": ")
        if s.cap is not None:
            formula += f" (C = {float(s.cap):g})"
        rows.append({"scheme": v.label, "sampler": s.sampler.kind, "c_0, c_q": formula,
                     "origin": ORIGIN_NOTES.get(v.name, origin)})
    return pd.DataFrame(rows)


def mean_chunks_spread(cells: pd.DataFrame) -> float:
    """Largest |mean drawn chunks / t − 1| of the Bernoulli cells (uniform ones draw exactly t)."""
    d = cells[cells.scheme == BERNOULLI.label]
    return float(np.max(np.abs(d.mc_cost / d.t - 1))) if len(d) else float("nan")
