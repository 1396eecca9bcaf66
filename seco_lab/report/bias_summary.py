"""The bias report's numbers, from the stored study alone (no plotting: testable without matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from ..studies.bias.definition import (
    BERNOULLI,
    CHECK_COLUMNS,
    CONVERGENCE_COLUMNS,
    FALLING_FACTORIAL,
    GROUP_COLUMNS,
    GROUP_KEY,
    PAPER,
    PAPER_CAPPED_2,
    RESULT_COLUMNS,
    STUDY_FORMAT,
    StudyConfig,
    run_totals_problem,
)
from ..studies.bias.driver import SORT_KEYS  # the columns that identify a row of each table
from ..studies.registry import STUDIES
from .bias_paper import PAPER_METRICS, summarize_paper
from .exactness import EXACT_TOL, above_tol
from .figures import scheme_order
from .markdown import MissingResultsError, read_json_table, read_results_csv, require

__all__ = ["BiasStudy", "CHECK_KINDS", "COVERAGE_BAND", "PRODUCE_BIAS", "UNBIASED_TOL", "headline", "load_bias",
           "summarize_bias"]

UNBIASED_TOL = EXACT_TOL  # relative bias below this is "exactly unbiased" (float64 rounding is ~1e-15)
PAPER_RATIO = 16  # the paper's chunks-to-budget ratio k/t (k = 128 chunks of 128 tokens, t = 8)
OTHER_PAPER_RATIOS = (8, 4)  # the paper's other budgets at k = 128: t = 16, 32
COVERAGE_BAND = 0.99  # a scheme's count of covering intervals is flagged outside this binomial band
PRODUCE_BIAS = STUDIES["bias"].produce
STUDY_FILES = STUDIES["bias"].stored_files


MATCHED_SCALE = ("noise_to_signal", "best_scale_mse")  # added in study format 4
#: the metrics every cell of results.csv carries (besides its weights w_p0..w_pL and MATCHED_SCALE from format 4)
RESULT_METRICS = ("rel_bias", "rel_var", "rel_mse", "mc_rel_sq_bias", "mc_rel_sq_bias_ci_low", "mc_rel_sq_bias_ci_high",
                  "mc_rel_sq_bias_se", "mc_rel_var", "mc_covered", "mc_cost", "best_scale_residual",
                  "per_tensor_residual", "direction_bias")

#: the exactness checks of checks.csv, by kind (the sampler suffix dropped), as the report's table names them;
#: each is a float64 relative error or a norm that must vanish, so above EXACT_TOL it fails (:mod:`.exactness`)
CHECK_KINDS = {
    "chain_sum_vs_dense": "Σ over chains of the chain basis vs dense gradient (max rel. error)",
    "strata_beyond_depth": "largest ‖g(p)‖ / ‖g‖ for p > L (bounded-chain claim)",
    "engine_vs_chain_basis": "chain-basis estimate vs the real sparse engine on drawn sets (max rel. error)",
    "enumerated_vs_analytic": "enumerated vs analytic squared bias and covariance trace (max, relative to ‖g‖²)",
    "paper_strata_sum_vs_dense": "paper settings: Σ_{p ≤ L} g(p) of the stratified pass vs dense gradient (max rel. "
                                 "error)",
}


@dataclass
class BiasStudy:
    """The stored study: one row per (L, k, t, seed, scheme) with a column per metric, and the other tables."""

    cells: pd.DataFrame
    checks: pd.DataFrame
    groups: pd.DataFrame
    convergence: pd.DataFrame
    meta: dict
    paper: pd.DataFrame  # paper.csv, long: one metric of one scheme x paper-settings cell


def check_run_totals(folder: Path, meta: dict, cfg: StudyConfig) -> None:
    """Refuse run totals in ``study.json`` that its definition does not make (:func:`run_totals_problem`)."""
    problem = run_totals_problem(meta, cfg)
    if problem:
        raise MissingResultsError(f"{folder}/study.json records {problem}: the record was edited or is damaged, so "
                                  f"the run it reports is not the one that made the results; restore it, or rerun "
                                  f"{PRODUCE_BIAS} (a complete study's rerun writes it again)")


def load_bias(folder: Path) -> BiasStudy:
    """The stored study, refused unless complete and consistent: every table parses with its columns and
    rows, holds finite numbers (NaN only where a metric is undefined: ``mc_covered``), and every cell and
    group of the study's own definition (``study.json``) is present -- the message names what is missing."""
    folder = Path(folder)
    require(folder, STUDY_FILES, PRODUCE_BIAS)
    meta = read_json_table(folder / "study.json", PRODUCE_BIAS)
    if meta.get("status") != "complete":
        raise MissingResultsError(f"{folder}/study.json says the study is {meta.get('status')!r}: rerun it to "
                                  "completion (it resumes where it stopped)")
    try:
        cfg = StudyConfig.from_json(meta["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MissingResultsError(f"{folder}/study.json has no readable study definition ({type(e).__name__}: {e}): "
                                  f"rerun {PRODUCE_BIAS}") from None
    fmt = meta.get("study_format")
    if type(fmt) is not int or not 1 <= fmt <= STUDY_FORMAT:  # campaign 29 S5: "4" raised a raw TypeError below
        raise MissingResultsError(f"{folder}/study.json records study_format {fmt!r}, not a format of a bias study "
                                  f"(an integer in [1, {STUDY_FORMAT}]): the record was edited or is damaged; rerun "
                                  f"{PRODUCE_BIAS}")
    digest = cfg.digest(fmt)
    if meta.get("digest") != digest:  # with the format recorded (campaign 29 S4: any format)
        older = f" or written by a seco-lab older than study format {STUDY_FORMAT}," if fmt < STUDY_FORMAT else ""
        raise MissingResultsError(f"{folder}/study.json: its definition has digest {digest}, but the study "
                                  f"recorded {meta.get('digest')!r} when it ran: the record was edited,{older} so "
                                  "its numbers (draws, seeds, grid, interval level) are not known to be the ones the "
                                  f"results were computed with; restore it, or rerun {PRODUCE_BIAS}")
    check_run_totals(folder, meta, cfg)

    def read(name, columns, nan_allowed=None):
        return read_results_csv(folder / name, columns, PRODUCE_BIAS, nan_allowed=nan_allowed,
                                key=tuple(SORT_KEYS[name.removesuffix(".csv")]))

    res = read("results.csv", RESULT_COLUMNS, lambda d: d.metric == "mc_covered")
    check_ranges(folder / "results.csv", res)
    expect_metrics(folder / "results.csv", res,
                   {*RESULT_METRICS, *(MATCHED_SCALE if meta.get("study_format", 0) >= 4 else ())})
    cells = res.pivot_table(index=["L", "k", "t", "seed", "scheme"], columns="metric", values="value",
                            dropna=False).reset_index()
    if "rel_bias" not in cells.columns:
        raise MissingResultsError(f"{folder}/results.csv has no rel_bias rows: rerun {PRODUCE_BIAS}")
    cells = cells.dropna(subset=["rel_bias"])
    cells.columns.name = None
    cells["ratio"] = cells.t / cells.k
    for m in MATCHED_SCALE:  # a study written before the matched-scale metrics: they show as missing
        if m not in cells:
            cells[m] = float("nan")
    labels = [s.label for s in cfg.schemes]
    expect_cells(folder / "results.csv", cells, [(L, k, t, seed, s) for L, k, seed in cfg.groups()
                                                  for t in cfg.budgets[k] for s in labels])
    paper = read("paper.csv", RESULT_COLUMNS) if cfg.paper_groups() else pd.DataFrame(columns=list(RESULT_COLUMNS))
    check_ranges(folder / "paper.csv", paper)
    expect_metrics(folder / "paper.csv", paper, set(PAPER_METRICS))
    if cfg.paper_groups():
        expect_cells(folder / "paper.csv", paper[paper.metric == "rel_bias"],
                     [(L, k, t, seed, s) for L, k, seed in cfg.paper_groups() for t in cfg.paper_budgets
                      for s in labels])
    checks, groups = read("checks.csv", CHECK_COLUMNS), read("groups.csv", GROUP_COLUMNS)
    if len(negative := checks[checks.value < 0]):  # every check is a relative error or a norm ratio
        r = negative.iloc[0]
        raise MissingResultsError(f"{folder}/checks.csv holds {len(negative)} impossible value(s) (e.g. {r.check} = "
                                  f"{r.value:g} at L={r.L}, k={r.k}, seed={r.seed}, t={r.t}; a relative error or "
                                  "norm ratio is never below 0): the table was edited or damaged; rerun "
                                  f"{PRODUCE_BIAS}")
    for name, df in (("checks.csv", checks), ("groups.csv", groups)):
        expect_groups(folder / name, df, cfg.groups() + cfg.paper_groups())
    have = set(zip(*(checks[c].astype(int) for c in ("L", "k", "seed", "t")), checks.check))
    want = expected_checks(cfg)
    for gap, what in ((sorted(want - have), "lacks"), (sorted(have - want), "has checks outside the study's "
                                                                                   "definition,")):
        if gap:
            L, k, seed, t, check = gap[0]
            raise MissingResultsError(f"{folder}/checks.csv {what} {len(gap)} of {len(want)} expected exactness checks "
                                      f"(e.g. L={L}, k={k}, seed={seed}, t={t}, {check}): the study is incomplete or "
                                      f"mixed; rerun {PRODUCE_BIAS}")
    return BiasStudy(cells, checks, groups, read("convergence.csv", CONVERGENCE_COLUMNS), meta, paper)


#: metrics that are norms, variances, errors, costs or weights: never below 0; and those that are fractions
NONNEGATIVE = ("rel_bias", "rel_var", "rel_mse", "mc_rel_var", "mc_rel_sq_err", "mc_rel_sq_bias_se", "mc_cost",
               "noise_to_signal", "best_scale_mse", "best_scale_residual", "per_tensor_residual", "direction_bias",
               "scale")
AT_MOST_ONE = ("mc_covered", "best_scale_mse")


def check_ranges(path: Path, results: pd.DataFrame) -> None:
    """Refuse values no computation gives (a negative variance, a coverage above 1, a weight below 0): a table
    edited by hand or damaged is not reported as if it were a result."""
    nonneg = results.metric.isin(NONNEGATIVE) | results.metric.str.fullmatch(r"w_p\d+")
    bad = results[(nonneg & (results.value < 0)) | (results.metric.isin(AT_MOST_ONE) & (results.value > 1))
                  | ((results.metric == "mc_covered") & ~results.value.isin([0.0, 1.0]) & results.value.notna())]
    if len(bad):
        r = bad.iloc[0]
        raise MissingResultsError(f"{path} holds {len(bad)} impossible value(s) (e.g. {r.metric} = {r.value:g} at "
                                  f"L={r.L}, k={r.k}, t={r.t}, seed={r.seed}, {r.scheme}): the table was edited or "
                                  f"damaged; rerun {PRODUCE_BIAS}")


def expected_checks(cfg: StudyConfig) -> set[tuple]:
    """Every (L, k, seed, t, check) row a complete study of ``cfg`` has in checks.csv (as the groups write
    them: ``seco_lab.studies.bias.group.run_group`` and ``seco_lab.studies.bias.paper``)."""
    samplers = {}
    for variant in cfg.schemes:
        sampler = variant.build().sampler
        samplers[sampler.kind] = sampler
    out = set()
    for L, k, seed in cfg.groups():
        out |= {(L, k, seed, 0, "chain_sum_vs_dense"), (L, k, seed, 0, "strata_beyond_depth")}
        for t in cfg.budgets[k]:
            out |= {(L, k, seed, t, f"engine_vs_chain_basis_{kind}") for kind in samplers}
            if any(s.num_subsets(k, t) <= cfg.max_enumerated_subsets for s in samplers.values()):
                out.add((L, k, seed, t, "enumerated_vs_analytic"))
    out |= {(L, k, seed, 0, "paper_strata_sum_vs_dense") for L, k, seed in cfg.paper_groups()}
    return out


def expect_groups(path: Path, df: pd.DataFrame, every_group: list[tuple]) -> None:
    """Every (L, k, seed) group of the study has rows in ``df``; else refuse, naming the first missing."""
    have = set(map(tuple, df[list(GROUP_KEY)].astype(int).itertuples(index=False)))
    lacking = [g for g in every_group if g not in have]
    if lacking:
        raise MissingResultsError(f"{path} lacks {len(lacking)} of {len(every_group)} groups (e.g. L={lacking[0][0]}, "
                                  f"k={lacking[0][1]}, seed={lacking[0][2]}): the study is incomplete; rerun "
                                  f"{PRODUCE_BIAS}")


def expect_metrics(path: Path, table: pd.DataFrame, required: set[str]) -> None:
    """Every (L, k, t, seed, scheme) cell of a long results table carries every metric: the ``required`` ones,
    every other metric some cell has, and its weights w_p0..w_pL; else refuse, naming the first gap."""
    weight = table.metric.str.fullmatch(r"w_p\d+")
    base = set(required) | set(table.metric[~weight])
    lacking = []
    for (L, k, t, seed, scheme), metrics in table.groupby(["L", "k", "t", "seed", "scheme"]).metric:
        want = base | {f"w_p{p}" for p in range(int(L) + 1)}
        lacking += [(int(L), int(k), int(t), int(seed), scheme, m) for m in sorted(want - set(metrics))]
    if lacking:
        L, k, t, seed, scheme, m = lacking[0]
        raise MissingResultsError(f"{path} lacks {len(lacking)} (cell, metric) rows (e.g. {m} at L={L}, k={k}, t={t}, "
                                  f"seed={seed}, {scheme}): the results are incomplete or mixed; rerun {PRODUCE_BIAS}")


def expect_cells(path: Path, cells: pd.DataFrame, expected: list[tuple]) -> None:
    """Every (L, k, t, seed, scheme) of ``expected`` present in ``cells``, and no other: else refuse, naming
    how many are missing (or unexpected) and the first of them."""
    have = set(zip(cells.L.astype(int), cells.k.astype(int), cells.t.astype(int), cells.seed.astype(int),
                   cells.scheme))
    want = set(expected)
    outside = "has cells outside the study's definition,"
    for gap, what in ((sorted(want - have), "lacks"), (sorted(have - want), outside)):
        if gap:
            L, k, t, seed, scheme = gap[0]
            raise MissingResultsError(
                f"{path} {what} {len(gap)} of {len(want)} expected (L, k, t, seed, scheme) cells (e.g. L={L}, k={k}, "
                f"t={t}, seed={seed}, {scheme}): the results are incomplete or mixed; rerun {PRODUCE_BIAS}")


def _verdict(unbiased: pd.Series, mask: pd.Series) -> str:
    """'yes' when every cell under ``mask`` is unbiased; '– (no cells)' when none is (never a vacuous 'yes')."""
    if not mask.any():
        return "– (no cells)"
    return "yes" if unbiased[mask].all() else f"no ({int(unbiased[mask].sum())}/{int(mask.sum())})"


def unbiasedness_summary(cells: pd.DataFrame) -> pd.DataFrame:
    """Per scheme: in how many random cells (t < k) the exact bias vanishes, split at t = L+1."""
    random = cells[cells.t < cells.k]
    rows = []
    for s in scheme_order(cells.scheme):
        d = random[random.scheme == s]
        unb = d.rel_bias < UNBIASED_TOL
        deep = d.t >= d.L + 1

        rows.append({"scheme": s, "unbiased cells (t < k)": f"{int(unb.sum())}/{len(d)}",
                     "unbiased when t ≥ L+1": _verdict(unb, deep), "unbiased when t < L+1": _verdict(unb, ~deep),
                     "max rel. bias": float(d.rel_bias.max())})
    return pd.DataFrame(rows)


def coverage_summary(cells: pd.DataFrame, level: float) -> pd.DataFrame:
    """Per scheme: intervals, how many covered the exact squared bias, and whether that count is plausible."""
    rows = []
    tail = (1 - COVERAGE_BAND) / 2
    for s in scheme_order(cells.scheme):
        c = cells[cells.scheme == s].mc_covered.dropna()
        n, hit = len(c), int(c.sum())
        lo, hi = stats.binom.ppf([tail, 1 - tail], n, level) if n else (np.nan, np.nan)
        rows.append({"scheme": s, "intervals": n, "covering": hit, "coverage": hit / n if n else np.nan,
                     f"within {COVERAGE_BAND:.0%} band of nominal": "yes" if lo <= hit <= hi else "**no**"})
    return pd.DataFrame(rows)


def scheme_ratio(mean: pd.DataFrame, a: str, b: str, metric: str) -> pd.Series:
    """metric(a) / metric(b) per (L, k, t) with t < k, finite values only."""
    def of(s):
        return mean[(mean.scheme == s) & (mean.t < mean.k)].set_index(["L", "k", "t"])[metric]

    r = (of(a) / of(b)).dropna()
    return r[np.isfinite(r)]


def by_budget(main: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Schemes x budgets table of one metric."""
    tab = main.pivot_table(index="scheme", columns="t", values=metric).reindex(scheme_order(main.scheme))
    tab.columns = [f"t={int(c)}" for c in tab.columns]
    return tab.reset_index()


def headline(mean: pd.DataFrame) -> dict:
    """The paper formula at the paper's ratio k/t (the largest k reaching it, else the nearest ratio) and
    at the other paper ratios, at the study's largest k."""
    kmax = int(mean.k.max())
    paper = mean[mean.scheme == PAPER.label].assign(r=lambda d: d.k / d.t)
    r16 = float(paper.loc[(paper.r - PAPER_RATIO).abs().idxmin(), "r"])
    at16 = paper[paper.r == r16]
    k16 = int(at16.k.max())
    at16 = at16[at16.k == k16]
    others = {}
    for r in OTHER_PAPER_RATIOS:
        d = paper[(paper.r == r) & (paper.k == kmax)]
        if len(d):
            others[r] = {"k": kmax, "t": kmax // r, "rel_bias": float(d.rel_bias.mean()),
                         "direction_bias": float(d.direction_bias.mean())}
    every = paper[(paper.k == kmax) & (paper.t < kmax)]
    return {"ratio": r16, "k": k16, "t": int(round(k16 / r16)), "rel_bias": float(at16.rel_bias.mean()),
            "direction_bias": float(at16.direction_bias.mean()),
            "best_scale_residual": float(at16.best_scale_residual.mean()), "others": others, "kmax": kmax,
            "range": {m: (float(every[m].min()), float(every[m].max()))
                      for m in ("rel_bias", "best_scale_residual", "direction_bias")}}


def summarize_bias(study: BiasStudy) -> dict:
    """Every number the bias report prints (besides its figures), from the stored study."""
    cells, cfg = study.cells, study.meta["config"]
    mean = cells.groupby(["L", "k", "t", "scheme"], as_index=False).mean(numeric_only=True)
    kmax, Lmax = int(cells.k.max()), int(cells.L.max())
    cap_var = scheme_ratio(mean, PAPER_CAPPED_2.label, PAPER.label, "rel_var")
    cap_bias = scheme_ratio(mean, PAPER_CAPPED_2.label, PAPER.label, "rel_bias")
    capped = cap_var[cap_var < 1 - 1e-12]
    unb = unbiasedness_summary(cells)
    main = mean[(mean.k == kmax) & (mean.L == Lmax)]
    bern = cells[(cells.scheme == BERNOULLI.label) & (cells.t < cells.k)]
    checks = study.checks.assign(kind=study.checks.check.str.replace(r"_(uniform|bernoulli)$", "", regex=True))
    mc_vs_exact = (cells.mc_rel_var - cells.rel_var).abs() / cells.rel_var.where(cells.rel_var > 0)
    covered = cells.mc_covered.dropna()
    unbiased_schemes = (FALLING_FACTORIAL.label, BERNOULLI.label)
    return {
        "kmax": kmax, "Lmax": Lmax, "level": cfg["ci_level"], "headline": headline(mean),
        "cap": {"cells": len(cap_var), "binding": len(capped),
                "var_ratio": capped.describe()[["min", "50%", "max"]].to_dict() if len(capped) else None,
                "bias_ratio": cap_bias[capped.index].describe()[["min", "50%", "max"]].to_dict() if len(capped)
                else None},
        "unbiased": unb,
        "others_biased": bool(unb[~unb.scheme.isin(unbiased_schemes)]["unbiased cells (t < k)"]
                              .str.startswith("0/").all()),
        "ff_var_ratio": scheme_ratio(mean, FALLING_FACTORIAL.label, PAPER.label, "rel_var").describe()[
            ["min", "50%", "max"]].to_dict(),
        "ff_nts_ratio": scheme_ratio(mean, FALLING_FACTORIAL.label, PAPER.label, "noise_to_signal").describe()[
            ["min", "50%", "max"]].to_dict(),
        "bernoulli_cost_spread": float((bern.mc_cost / bern.t - 1).abs().max()) if len(bern) else None,
        "coverage": coverage_summary(cells, cfg["ci_level"]),
        "covered": (int(covered.sum()), len(covered)),
        "tables": {m: by_budget(main, m) for m in ("rel_bias", "direction_bias", "rel_mse")},
        "checks": (ck := checks.groupby("kind").value.max().to_dict()),
        # the checks above the float64 tolerance (a study without paper cells has no paper check: not a failure)
        "checks_failed": above_tol(ck, CHECK_KINDS, skip_missing=True),
        "mc_vs_exact_var": (float(mc_vs_exact.median()), float(mc_vs_exact.max())),
        "paper": summarize_paper(study.paper, study.groups, cfg["ci_level"]),
    }
