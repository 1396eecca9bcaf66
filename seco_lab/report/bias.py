"""The bias report (Markdown and figures) from a stored study: ``seco-lab report bias``."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from ..studies.bias.definition import BERNOULLI, FALLING_FACTORIAL, PAPER_CAPPED_2
from . import bias_figures as figs
from .bias_guide import guidance_section, paper_settings_section, real_lm_section, scheme_definitions_section
from .bias_summary import CHECK_KINDS, COVERAGE_BAND, PRODUCE_BIAS, UNBIASED_TOL, load_bias, summarize_bias
from .exactness import not_exact
from .figures import figure_folder
from .markdown import fmt, generated_note, table, write_markdown

__all__ = ["bias_report", "settings_section"]

ESTIMATORS_DOC = Path("docs") / "estimators.md"  # the estimators' math, relative to the repository root


def _spread(d: dict) -> str:
    return f"{fmt(d['min'])}–{fmt(d['max'])} (median {fmt(d['50%'])})"


def headline_section(s: dict) -> list[str]:
    h, unb = s["headline"], s["unbiased"].set_index("scheme")
    ff, be = unb.loc[FALLING_FACTORIAL.label], unb.loc[BERNOULLI.label]
    md = [f"## The small grid (k ≤ {h['kmax']}): exact bias *and* variance\n",
          "At k ≤ 16 every KV-cache chain is enumerable (the chain basis), so variance and MSE are exact too and "
          "the Monte Carlo statistics can be checked against them. These cells are small: at k = 16, t = 1 only "
          "the direct term survives, so the paper's k/t = 16 is read at k = 128 above, not here.\n"]
    rg = h["range"]
    md.append(
        f"- Paper formula over every budget t < k at k = {h['kmax']}: relative bias {fmt(rg['rel_bias'][0])}–"
        f"{fmt(rg['rel_bias'][1])}; after the best scalar rescaling the residual is "
        f"{fmt(rg['best_scale_residual'][0])}–{fmt(rg['best_scale_residual'][1])} (direction bias "
        f"{fmt(rg['direction_bias'][0])}–{fmt(rg['direction_bias'][1])}). Much of the error is the shrinkage of the "
        "direct term (w(0) = t/k), which a larger learning rate would absorb; the rest changes the direction of the "
        "gradient.")
    cap = s["cap"]
    if cap["binding"]:
        md.append(f"- **The cap C = 2** (`{PAPER_CAPPED_2.label}`) changes the estimate in {cap['binding']} of "
                  f"{cap['cells']} cells with t < k (where k/t > 2 and chains of ≥ 1 hop survive). There it multiplies "
                  f"the variance by {_spread(cap['var_ratio'])} and the relative bias by {_spread(cap['bias_ratio'])}.")

    def when(row, col):
        return "in every such cell" if row[col] == "yes" else f"not in every such cell: {row[col]}"

    shallow = ff["unbiased when t < L+1"].replace("no (", "").rstrip(")").replace("yes", "every one of its")
    deep = ff["unbiased when t ≥ L+1"]
    # each claim read from the cells with UNBIASED_TOL: never "exactly unbiased" over a bias above it
    ff_deep = (f"is exactly unbiased when t ≥ L+1 ({when(ff, 'unbiased when t ≥ L+1')})" if deep == "yes" else
               "has no cell with t ≥ L+1" if not deep.startswith("no") else
               f"is **not exactly unbiased in every cell with t ≥ L+1**, although it is by construction: unbiased "
               f"in {deep.removeprefix('no (').rstrip(')')} (below {UNBIASED_TOL:g}; the stored cells are wrong or "
               "damaged)")
    n_be, all_be = be["unbiased cells (t < k)"].split("/")
    be_all = "" if n_be == all_be else (" (**not every one**, although it is unbiased by construction: the stored "
                                        "cells are wrong or damaged)")
    md.append(f"- **Unbiased schemes.** `{FALLING_FACTORIAL.label}` {ff_deep} and unbiased when t < L+1 in "
              f"{shallow} cells; `{BERNOULLI.label}` is unbiased in {be['unbiased cells (t < k)']} cells with t < k"
              f"{be_all}. "
              + ("Every other scheme is biased in every cell with t < k." if s["others_biased"] else
                 "See the table below for the other schemes."))
    fv, fn = s["ff_var_ratio"], s["ff_nts_ratio"]
    md.append(f"- Unbiasedness costs noise, at matched scale: {FALLING_FACTORIAL.label}'s noise-to-signal "
              f"Var/‖E ĝ‖² is {fmt(fn['50%'])}× the paper formula's (median over cells with t < k; range "
              f"{fmt(fn['min'])}–{fmt(fn['max'])}). The raw variance relative to ‖g‖², which a tuned learning rate "
              f"or Adam rescales away (the paper formula's mean is shrunk towards 0), is {fmt(fv['50%'])}× "
              f"(range {fmt(fv['min'])}–{fmt(fv['max'])}). At equal compute against SeCO, with data noise and "
              "the batch size: `reports/audit.md` (the real model) and `reports/training_study.md`.")
    if s["bernoulli_cost_spread"] is not None:
        md.append(f"- Cost: the uniform schemes backpropagate exactly t chunks; `{BERNOULLI.label}` backpropagates t "
                  f"on average (Monte Carlo mean |I| within {s['bernoulli_cost_spread']:.1%} of t in every cell) but "
                  "a random number per step, and SpaCO's stratified schemes pay one vector-Jacobian product per hop "
                  "count (`reports/benchmarks.md`).")
    hit, n = s["covered"]
    md.append(f"- Confidence intervals ({s['level']:.0%}) for the squared bias covered the exact value in {hit} of "
              f"{n} cells ({hit / n:.1%}).\n")
    return md


def statistics_section(s: dict, cfg: dict) -> list[str]:
    cov = s["coverage"]
    band = f"within {COVERAGE_BAND:.0%} band of nominal"
    bad = cov[cov[band] != "yes"]
    md = ["## Statistical honesty\n",
          f"Each cell draws N = {cfg['draws']:,} sets per sampler, shared by all schemes of that sampler. The squared "
          "bias is estimated as ||mean − g||² − tr Σ̂ / N (the raw squared error overstates it by tr Σ / N); its "
          f"{s['level']:.0%} interval is the estimate ± t_(B−1) × the delete-one-batch jackknife standard error over "
          f"B = {cfg['batches']} batch means. Coverage against the exact squared bias, per scheme (a scheme is "
          f"flagged when its count of covering intervals falls outside the {COVERAGE_BAND:.0%} binomial band around "
          "nominal):\n",
          table(cov, integer_columns=("intervals", "covering")) + "\n"]
    if len(bad):
        md.append("**Coverage off nominal** for: " + ", ".join(f"`{x}`" for x in bad.scheme) + ". The jackknife "
                  "interval is built for a squared norm whose estimator is close to normal; where the true bias is "
                  "zero or tiny next to the Monte Carlo noise, the estimator is a centred quadratic form with a "
                  "skewed distribution and the symmetric interval misses more often than nominal.\n")
    else:
        md.append("Every scheme's coverage sits within the band.\n")
    med, mx = s["mc_vs_exact_var"]
    md.append(f"The Monte Carlo variance agrees with the exact one to a median relative difference of {fmt(med)} "
              f"(max {fmt(mx)}).\n")
    ck = s["checks"]
    md.append("## Exactness checks run inside the study\n")
    md.append("From `checks.csv` (the largest value over every group and budget):\n")
    md.append(table(pd.DataFrame([{"check": label, "value": ck.get(kind, float("nan"))}
                                  for kind, label in CHECK_KINDS.items()])) + "\n")
    if s["checks_failed"]:
        md.append(checks_verdict(s["checks_failed"]) + "\n")
    return md


def checks_verdict(failed: list[str], where: str = "") -> str:
    """The flag for exactness checks above :data:`~seco_lab.report.exactness.EXACT_TOL` (as the audit report's)."""
    return (f"{not_exact(failed)} The chain-basis decomposition or the estimates built on it differ from their "
            "float64 references in this study; every exact bias, weight and variance in this report rests on them "
            f"and is not to be trusted{where}: rerun the study.")


def settings_section(meta: dict) -> list[str]:
    cfg, sw, timing = meta["config"], meta["software"], meta.get("timing", {})
    budgets = "; ".join(f"k={k}: t ∈ {{{', '.join(map(str, v))}}}" for k, v in cfg["budgets"].items())
    return ["## Settings\n",
            f"- Grid: depths L ∈ {{{', '.join(map(str, cfg['depths']))}}}, chunks k ∈ "
            f"{{{', '.join(map(str, cfg['chunk_counts']))}}}, budgets {budgets}; seeds {cfg['seeds']} (each seed is "
            f"its own model initialisation and token sequence); {len(cfg['schemes'])} scheme variants.\n"
            f"- Model: {cfg['arch']} Llama-style transformer in float64, {cfg['model']}, chunk size "
            f"{cfg['chunk_size']} tokens (sequence length {cfg['chunk_size']}k); random weights and random tokens.\n"
            f"- Monte Carlo: {cfg['draws']:,} draws per cell and sampler. Seeds: every random stream is "
            f"`numpy.random.SeedSequence([{cfg['base_seed']}, L, k, seed, purpose, ...])` with one purpose each for "
            "the model's weights, the tokens, the Monte Carlo draws (extended by t and the sampler) and the engine "
            "check (`seco_lab.studies.bias.definition`); `seco_lab.studies.bias.load_cell(folder, L, k, seed)` "
            "rebuilds any group's model and data. Exact covariance by enumeration where the number of subsets is ≤ "
            f"{cfg['max_enumerated_subsets']:,}, and by the pair-inclusion formula everywhere.\n"
            f"- Paper-settings groups: (L, k) ∈ {{{', '.join(f'({a}, {b})' for a, b in cfg['paper_cells'])}}}, budgets "
            f"t ∈ {{{', '.join(map(str, cfg['paper_budgets']))}}}, seeds {cfg['paper_seeds']}; {cfg['paper_draws']} "
            f"Monte Carlo draws per (t, sampler) in {cfg['paper_batches']} jackknife batches (its own seed purpose, "
            "`STRATA_MONTE_CARLO`).\n"
            f"- Run: {meta.get('total_draws', 0):,.0f} draws; {timing.get('compute_seconds', 0):.0f} s of worker time; "
            f"last run {timing.get('wall_seconds_this_run', 0):.1f} s wall with {meta.get('jobs')} worker(s). "
            + cost_by_part(timing) + "\n"
            f"- Software: Python {sw['python']}, torch {sw['torch']}, numpy {sw['numpy']}, scipy {sw['scipy']}, "
            f"pandas {sw['pandas']}, matplotlib {sw['matplotlib']}; {sw['platform']}, {sw['cpus']} CPUs.\n"
            f"- Study definition digest `{meta['digest']}` (`seco_lab.studies.bias`).\n"]


PART_NAMES = {"chain_basis_grid": "chain-basis grid (k ≤ 16)", "paper_exact": "paper settings, exact strata",
              "paper_monte_carlo_uniform": "paper settings, Monte Carlo (uniform)",
              "paper_monte_carlo_bernoulli": "paper settings, Monte Carlo (Bernoulli)"}


def cost_by_part(timing: dict) -> str:
    """Worker seconds of each part of the study and the wall span of each kind of group (from study.json)."""
    parts = timing.get("worker_seconds_by_part", {})
    if not parts:
        return ""
    text = "Worker seconds by part: " + ", ".join(f"{PART_NAMES.get(k, k)} {v:.0f} s" for k, v in parts.items())
    spans = timing.get("wall_seconds_by_kind_this_run", {})
    if spans:
        text += "; wall span of each kind in the last run (they overlap: both workers take whichever group is " \
                "next): " + ", ".join(f"{k} groups {v:.0f} s" for k, v in spans.items())
    return text + "."


def estimators_link(out_md: Path) -> str:
    """A relative link to docs/estimators.md when the report lies in the current directory (the repository)."""
    cwd, where = Path.cwd().resolve(), out_md.parent.resolve()
    if where.is_relative_to(cwd):
        return f"[`{ESTIMATORS_DOC.as_posix()}`]({os.path.relpath(cwd / ESTIMATORS_DOC, where)})"
    return f"`{ESTIMATORS_DOC.as_posix()}` in the seco_lab repository"


def bias_report(folder: Path, out_md: Path) -> Path:
    """``out_md`` and its figures (under ``figures/bias_study`` beside ``bias_study.md``, ``figures/<stem>`` beside
    another name: :func:`figure_folder`) from the study in ``folder``."""
    folder, out_md = Path(folder), Path(out_md)
    study = load_bias(folder)
    s = summarize_bias(study)
    cells = study.cells
    figdir = figure_folder(out_md, "bias_study", "bias_study")
    f_bias, f_var = figs.fig_bias_vs_ratio(cells, figdir), figs.fig_variance_mse(cells, figdir)
    f_conv, conv_cell = figs.fig_convergence(study.convergence, cells, figdir)
    f_w, w_cell = figs.fig_weights(cells, figdir)
    f_cap = figs.fig_cap_tradeoff(cells, figdir)
    rel = os.path.relpath(figdir, out_md.parent)
    md = ["# SpaCO bias study\n", generated_note("bias", folder, out_md, PRODUCE_BIAS),
          *([checks_verdict(s["checks_failed"], " (see \"Exactness checks run inside the study\")") + "\n"]
            if s["checks_failed"] else []),
          "## The question\n",
          "SpaCO backpropagates only t of the k chunks of a sequence and rescales what it keeps. Its paper claims the "
          "k/t compensation makes the gradient unbiased. A gradient path that crosses p KV caches needs all p+1 of "
          "its chunks to be drawn; drawing t *distinct* chunks keeps it with probability (t)_{p+1}/(k)_{p+1}, not "
          "(t/k)^{p+1}, and the paper leaves the direct term unscaled, so its expected weight per hop count is "
          "w(p) = (k/t)^p (t)_{p+1}/(k)_{p+1} ≠ 1. This study measures, exactly and by Monte Carlo, how far each "
          "compensation scheme's expectation is from the true gradient and what each costs in variance "
          f"({estimators_link(out_md)} defines every scheme and the verification tiers).\n"]
    p = s["paper"]
    if p is not None:
        f_paper = figs.fig_paper_settings(p["mean"], p["k"], figdir)
        md += paper_settings_section(p, study.meta["config"], study.meta.get("timing", {}), f"{rel}/{f_paper}")
    md += real_lm_section(out_md)  # "On a pretrained LM", when its cells are stored beside the report
    if p is not None:
        md += guidance_section(p)
    md += scheme_definitions_section()
    md += headline_section(s)
    md += ["## Which schemes are unbiased, and when\n",
           f"A scheme is counted unbiased in a cell when its exact relative bias is below {UNBIASED_TOL:g} (rounding "
           "is ~1e-15). Cells with t = k are deterministic and excluded.\n", table(s["unbiased"]) + "\n",
           f"## Bias, direction bias and MSE at L = {s['Lmax']}, k = {s['kmax']} (mean over seeds)\n",
           "Exact relative bias ||E ĝ − g|| / ||g||:\n", table(s["tables"]["rel_bias"]) + "\n",
           "Direction bias 1 − cos(E ĝ, g) (a global scale only rescales the learning rate; this does not):\n",
           table(s["tables"]["direction_bias"]) + "\n",
           "Relative MSE E||ĝ − g||² / ||g||² (bias² + variance):\n", table(s["tables"]["rel_mse"]) + "\n",
           "In the figures the paper-family variants coincide wherever their cap does not bind (C ≥ k/t): each "
           "scheme has its own marker and its points are offset sideways so every curve stays visible.\n",
           f"![bias vs t/k]({rel}/{f_bias})\n", f"![variance and MSE]({rel}/{f_var})\n",
           "## Effective weights per hop stratum\n",
           "E ĝ = Σ_p w(p) g(p) with w(p) = W(p) π(p); a scheme is unbiased iff w(p) = 1 for every stratum present. "
           f"Strata stop at p = L (checked below). Shown for L = {w_cell[0]}, k = {w_cell[1]}.\n",
           f"![weights]({rel}/{f_w})\n", "## Monte Carlo convergence\n",
           f"Cell L = {conv_cell[0]}, k = {conv_cell[1]}, t = {conv_cell[2]}, seed {conv_cell[3]}: the error of the "
           "mean of N draws falls like 1/√N for unbiased schemes and flattens at the exact bias (dotted) for the "
           "others.\n", f"![convergence]({rel}/{f_conv})\n", "## The cap's bias–variance trade\n",
           f"![cap trade-off]({rel}/{f_cap})\n",
           "`paper-capped` caps every hop factor, c_q = min(k/t, C) (the paper, Sec. 6.4); `paper-chain-capped` caps "
           "the whole chain factor, W(p) = min((k/t)^p, C) (the review's reading). With C ≥ k/t neither cap binds.\n"]
    md += statistics_section(s, study.meta["config"])
    md += settings_section(study.meta)
    md += ["## Method\n",
           "For each (L, k, seed) the gradient is split exactly into one vector per KV-cache chain "
           "j = i_0 > … > i_p, p ≤ L (`seco_lab.chain_basis`, one batched vector–Jacobian product per chunk). A drawn "
           "set I gives every scheme's estimate as Σ_{chains ⊆ I} W(p) v_c — identical to running the sparse engine "
           "(checked above on real draws) — so exact expectations, covariances (via pairwise inclusion "
           "probabilities) and Monte Carlo sums are quadratic forms in the chains' Gram matrix.\n"]
    return write_markdown(md, out_md)
