"""The bias report's researcher-facing sections: "At the paper's settings", "Which scheme should
I use?", the scheme definitions, and the hook for "On a pretrained LM".  Every number comes from
``summarize_paper`` (stored ``paper.csv``) except the relay structure, which is a property of the
schemes themselves (``Scheme.constant_relay``)."""

from __future__ import annotations

from pathlib import Path

from ..studies.bias.definition import (
    BERNOULLI,
    FALLING_FACTORIAL,
    PAPER,
    PAPER_CAPPED_2,
    PAPER_CHAIN_CAPPED_2,
    RELEASED,
    RELEASED_UNBIASED,
)
from ..studies.registry import STUDIES
from .bias_paper import PAPER_METRICS, UNBIASED_TOL, scheme_definitions
from .markdown import MissingResultsError, fmt, left_out, table, verified_beside

__all__ = ["guidance_section", "paper_settings_section", "real_lm_section", "scheme_definitions_section"]


def paper_settings_section(p: dict, cfg: dict, timing: dict, figure: str | None) -> list[str]:
    """The headline: every scheme's bias, direction, residuals, variance and MSE at k = 128, t ∈ {8, 16, 32}."""
    k, ts = p["k"], ", ".join(map(str, p["budgets"]))
    md = ["## At the paper's settings\n",
          "The paper trains on 16K tokens in 128-token chunks (k = 128 chunks) with t ∈ {8, 16, 32}. Here: "
          f"**k = {k} chunks, t ∈ {{{ts}}}** (k/t = " + ", ".join(f"{k / t:g}" for t in p["budgets"])
          + "), on the study's tiny random-init model "
          f"(d_model {cfg['model']['d_model']}, chunks of {cfg['chunk_size']} tokens) with L ∈ "
          f"{{{', '.join(map(str, p['depths']))}}} layers, mean over seeds {p['seeds']}. Bias, direction and "
          "residuals are **exact**: E ĝ = Σ_p w(p) g(p) from one stratified pass with P = L "
          "(`seco_lab.stats.strata.bias_metrics`). Variance is **Monte Carlo**: "
          f"N = {cfg['paper_draws']} draws per (t, sampler), each one stratified sparse sweep shared by every scheme "
          "of that sampler (`strata_monte_carlo`); MSE = exact bias² + Monte Carlo variance.\n",
          "Columns: relative bias ‖E ĝ − g‖/‖g‖; direction bias 1 − cos(E ĝ, g); best-scale residual "
          "min_a ‖a E ĝ − g‖/‖g‖ (what no learning rate can absorb); per-tensor residual, the same with one scale "
          "per parameter tensor (closer to what Adam's per-coordinate normalisation absorbs); variance tr Σ/‖g‖²; "
          "MSE E‖ĝ − g‖²/‖g‖²; and at matched scale (a tuned learning rate or Adam removes any global scale, "
          "docs/estimators.md §4c): noise-to-signal tr Σ/‖E ĝ‖² and best-scale MSE min_a E‖a ĝ − g‖²/‖g‖² "
          "= 1 − ⟨E ĝ, g⟩²/(‖g‖² (‖E ĝ‖² + tr Σ))."
          + (" The stored paper.csv predates these two columns (study format 3): they are derived exactly from its "
             "stored scale ⟨E ĝ, g⟩/‖E ĝ‖², direction bias and variance (‖E ĝ‖/‖g‖ = cos/scale; "
             "`seco_lab.report.bias_paper.derive_matched_scale`); `make bias-study` stores them."
             if p.get("matched_scale_derived") else "") + "\n"]
    for L, tab in p["tables"].items():
        md += [f"**L = {L} layers, k = {k}** (mean over seeds):\n", table(tab, integer_columns=("t",)) + "\n"]
    same = [f"t = {t}: " + "; ".join(" = ".join(f"`{x}`" for x in grp) for grp in groups)
            for t, groups in p["coinciding"][max(p["coinciding"])].items() if groups]
    if same:
        md.append(f"Identical rows (L = {max(p['coinciding'])}; equal metrics and variance: the same expected "
                  "weights on every stratum that can survive, e.g. where a cap does not bind, C ≥ k/t): "
                  + ", ".join(same) + ". In the figure their points sit side by side.\n")
    deep = max(p["all_schemes"])
    md += [f"<details><summary>All {p['all_schemes'][deep].scheme.nunique()} scheme variants at L = {deep}, "
           f"k = {k}</summary>\n", table(p["all_schemes"][deep], integer_columns=("t",)) + "\n", "</details>\n"]
    for (L, k2), tab in p["other_k"].items():
        md += [f"**L = {L}, k = {k2}** (a longer sequence at the same budgets):\n",
               table(tab, integer_columns=("t",)) + "\n"]
    hit, n = p["covered"]
    if n:
        md.append(f"The {p['level']:.0%} jackknife intervals for the squared bias (B = {cfg['paper_batches']} "
                  f"batches of the N draws) covered the exact value in {hit} of {n} paper-settings cells "
                  f"({hit / n:.0%}).\n")
    if figure:
        md.append(f"![paper settings]({figure})\n")
    md.append(paper_cost_line(timing, cfg))
    return md


def paper_cost_line(timing: dict, cfg: dict) -> str:
    """What the paper-settings cells cost, from study.json's timing record."""
    cells = timing.get("paper_worker_seconds_by_cell", {})
    if not cells:
        return ""
    parts = []
    for name, c in cells.items():
        per = [f"{c[key]:.2f} s/draw ({key.split('_')[2]})" for key in c if key.endswith("_seconds_per_draw")]
        parts.append(f"{name.replace('_', ', ')}: exact strata {c.get('exact', 0):.1f} s over its seeds, "
                     + ", ".join(per))
    return ("Cost (worker seconds, last run; one stratified sparse sweep per draw): " + "; ".join(parts) + ".\n")


def guidance_section(p: dict) -> list[str]:
    """ "Which scheme should I use?" at the deepest paper-settings depth, every number from the study."""
    L = max(p["guidance"])
    g = p["guidance"][L]
    at, ts, k = g["at"], g["budgets"], g["k"]
    t0 = ts[0]

    def row(metric, label):
        return ", ".join(f"t = {t}: {fmt(at[metric][label][t])}" for t in ts)

    pa, cap, rel, ff, be, ru = (PAPER.label, PAPER_CAPPED_2.label, RELEASED.label, FALLING_FACTORIAL.label,
                                BERNOULLI.label, RELEASED_UNBIASED.label)
    rb, bs, pt = at["rel_bias"][pa][t0], at["best_scale_residual"][pa][t0], at["per_tensor_residual"][pa][t0]
    mostly_scale = bs < 0.25 * rb
    shares = ", ".join(f"p = {q}: {fmt(x)}" for q, x in enumerate(p["strata"].get(L, [])))
    w = ", ".join(f"w({q}) = {fmt(x)}" for q, x in enumerate(g["paper_weights"][t0]))
    if mostly_scale:
        scale_text = (f"its bias is mostly a **scale** error. The direct term is not compensated and the hop strata "
                      f"get nearly its weight ({w}, t/k = {fmt(t0 / k)}), so E ĝ ≈ g / "
                      f"{fmt(at['scale'][pa][t0])}: a larger learning rate (or Adam's normalisation) absorbs that. "
                      "What is left, the residual columns, comes from the hop strata weighted a little less than "
                      f"the direct term (they carry ‖g(p)‖/‖g‖ = {shares})")
    else:
        scale_text = (f"its bias is largely a **direction** error, which no learning rate absorbs ({w}; "
                      f"‖g(p)‖/‖g‖: {shares})")
    unb = p["unbiased"]
    md = ["## Which scheme should I use?\n",
          f"Evidence from the paper-settings cells (L = {L}, k = {k}; the table above).\n",
          f"- **Scale error vs direction error.** At t = {t0} the paper formula's relative bias is {fmt(rb)} but "
          f"its best-scale residual is {fmt(bs)} (per-tensor {fmt(pt)}): {scale_text}.",
          f"- **The cap and the public code's defaults bend the direction.** Best-scale residual of `{pa}`: "
          f"{row('best_scale_residual', pa)}; of `{cap}` (what the paper ran, Sec. 6.4): "
          f"{row('best_scale_residual', cap)}; of `{rel}` (public code, default flags): "
          f"{row('best_scale_residual', rel)}. Capping c_q at C < k/t shrinks the hop strata while the direct "
          "term stays, and `released` scales the direct term by k/t but never the hops: both change the relative "
          "weight of the strata, which no scalar can undo.",
          "- **When each scheme is unbiased.** " + unbiased_claims(unb, row) + " "
          f"(below {UNBIASED_TOL:g} counts as unbiased).",
          _noise_price_bullet(at, g, ts, t0, row, pa, ff, be, ru),
          _best_rate_bullet(at, ts, row, pa, cap, rel, ff, be),
          "- **Backprop cost.** Every uniform scheme backpropagates exactly t chunks; `" + be + "` a random number "
          f"with mean t (mean drawn at t = {t0}: {fmt(at['mc_cost'][be][t0])}). What differs is the relay "
          "(`Scheme.constant_relay`): when c_q is the same for every hop count one relay buffer carries all chains; "
          "otherwise the sparse backward keeps one buffer per hop count, which costs time and memory "
          f"(`reports/benchmarks.md` measures the stratified relay against the constant one). At k = {k}:\n",
          table(p["relay"]) + "\n",
          f"- **In short.** Need an unbiased gradient: `{ff}` when t ≥ L+1 (at the price above and a stratified "
          f"relay), else `{be}`" + ("" if not contradicted(unb) else
                                    " by construction, but the stored cells above break it: rerun the study before "
                                    "relying on either") + f". Accept a bias to save variance: `{pa}` uncapped errs "
          + ("mostly in scale" if mostly_scale else "in direction too") + f"; the cap (`{cap}`, "
          f"`{PAPER_CHAIN_CAPPED_2.label}`) and `{rel}` trade variance for a direction error.\n"]
    return md


def _largest(u: dict) -> float:
    """The largest relative bias over every cell of one scheme's :func:`unbiased_where` entry."""
    values = [u.get(key, float("nan")) for key in ("t ≥ L+1", "t < L+1")]
    values = [v for v in values if v == v]
    return max(values) if values else float("nan")


def contradicted(unb: dict) -> list[str]:
    """The unbiased-by-construction schemes whose stored cells break that (relative bias not below
    :data:`UNBIASED_TOL`): `falling-factorial` where t ≥ L+1, `bernoulli` anywhere."""
    ff, be = unb.get(FALLING_FACTORIAL.label, {}), unb.get(BERNOULLI.label, {})
    bad, deep = [], ff.get("t ≥ L+1", float("nan"))
    if deep == deep and not deep < UNBIASED_TOL:  # NaN: no cell with t ≥ L+1, no claim
        bad.append(FALLING_FACTORIAL.label)
    if be and not _largest(be) < UNBIASED_TOL:
        bad.append(BERNOULLI.label)
    return bad


def unbiased_claims(unb: dict, row) -> str:
    """Which scheme is unbiased where, each claim read from the stored cells with :data:`UNBIASED_TOL` (never
    "exactly unbiased" over a relative bias above it); ``row(metric, label)``: a metric at every budget."""
    ff, be, ru = FALLING_FACTORIAL.label, BERNOULLI.label, RELEASED_UNBIASED.label
    bad = contradicted(unb)
    deep = unb.get(ff, {}).get("t ≥ L+1")
    if ff in bad:
        text = (f"`{ff}`: **not exactly unbiased where t ≥ L+1**, although its weights make it so by construction: "
                f"largest relative bias there {fmt(deep)}, above {UNBIASED_TOL:g} (the stored cells are wrong or "
                "damaged; rerun the study).")
    else:
        text = (f"`{ff}`: exactly when t ≥ L+1 (largest relative bias there {fmt(deep)}; at the paper's t ≥ 8 this "
                "needs L ≤ 7 layers, not the paper's 32: deeper chains get w(p) = 0 for p ≥ t).")
    if be in bad:
        text += (f" `{be}` (Bernoulli inclusion, c = 1/ρ): **not exactly unbiased in every cell**, although it is by "
                 f"construction: unbiased in {unb[be]['unbiased']} of {unb[be]['cells']}, largest relative bias "
                 f"{fmt(_largest(unb[be]))}, above {UNBIASED_TOL:g} (the stored cells are wrong or damaged).")
    else:
        text += f" `{be}` (Bernoulli inclusion, c = 1/ρ): in every cell (largest {fmt(_largest(unb.get(be, {})))})."
    r = unb.get(ru, {})
    if r.get("unbiased", 0):
        text += (f" `{ru}` (public code's --unbiased_estimate): relative bias {row('rel_bias', ru)}; below "
                 f"{UNBIASED_TOL:g} in {r['unbiased']} of its {r['cells']} cells, which its weights do not explain.")
    else:
        text += (f" `{ru}` (public code's --unbiased_estimate) is not: relative bias {row('rel_bias', ru)}, because "
                 "drawing t *distinct* chunks keeps a p-hop chain with probability (t)_{p+1}/(k)_{p+1}, not "
                 "(t/k)^{p+1}.")
    others = [s for s, u in unb.items() if s not in (ff, be, ru) and u.get("unbiased", 0)]
    text += (" Every other scheme is biased" if not others else
             " The other schemes are biased except in some cells of " + ", ".join(f"`{s}`" for s in others))
    return text


def _noise_price_bullet(at: dict, g: dict, ts, t0, row, pa: str, ff: str, be: str, ru: str) -> str:
    """The noise price of unbiasedness: each unbiased scheme's noise-to-signal against the paper formula's, at
    matched scale (``row(metric, label)``: a metric at every budget)."""
    return (f"- **The noise price of unbiasedness, at matched scale.** `{pa}`'s mean is about g/"
            f"{fmt(at['scale'][pa][t0])} at t = {t0}, and a tuned learning rate (or Adam) multiplies its noise by "
            "the same factor it undoes, so compare noise-to-signal tr Σ/‖E ĝ‖², not variance/‖g‖². "
            f"Noise-to-signal of `{pa}`: {row('noise_to_signal', pa)}; `{ff}`: {row('noise_to_signal', ff)}; "
            f"`{be}`: {row('noise_to_signal', be)}; `{ru}`: {row('noise_to_signal', ru)}. "
            f"Relative to `{pa}`'s: `{ff}` " + price_text(g["nts_price"][ff], ts) + f", `{be}` "
            + price_text(g["nts_price"][be], ts) + f", `{ru}` " + price_text(g["nts_price"][ru], ts)
            + f" (the raw variances relative to ‖g‖², which charge `{pa}` nothing for its shrunken mean: `{ff}` "
            + price_text(g["var_price"][ff], ts) + f", `{be}` " + price_text(g["var_price"][be], ts) + f", `{ru}` "
            + price_text(g["var_price"][ru], ts) + "). " + same_direction_text(at, ts, pa, ru))


def _best_rate_bullet(at: dict, ts, row, pa: str, cap: str, rel: str, ff: str, be: str) -> str:
    """The error left after the best learning rate: each scheme's best-scale MSE, and the lowest per budget."""
    return (f"- **Error after the best learning rate.** Best-scale MSE min_a E‖a ĝ − g‖²/‖g‖² of `{pa}`: "
            f"{row('best_scale_mse', pa)}; `{cap}`: {row('best_scale_mse', cap)}; `{rel}`: "
            f"{row('best_scale_mse', rel)}; `{ff}`: {row('best_scale_mse', ff)}; `{be}`: {row('best_scale_mse', be)}. "
            "Lowest best-scale MSE: " + "; ".join(f"t = {t}: `{best_of(at, 'best_scale_mse', t)}`" for t in ts)
            + " (raw MSE E‖ĝ − g‖²/‖g‖², which also counts the scale error a learning rate absorbs: lowest "
            + "; ".join(f"t = {t}: `{best_of(at, 'rel_mse', t)}`" for t in ts) + "). One sequence, one draw: "
            "data noise and the batch size are not in these numbers; the audit's equal-compute table "
            "(`reports/audit.md`, the real model at k = 128) and the training study's \"At equal compute\" "
            "(`reports/training_study.md`) weigh them against SeCO.")


def same_direction_text(at: dict, budgets, paper: str, other: str) -> str:
    """A sentence when ``other``'s expectation is a multiple of ``paper``'s (equal direction bias at every t)."""
    d = at["direction_bias"]
    if not all(abs(d[other][t] - d[paper][t]) <= 1e-9 * max(d[paper][t], 1e-300) for t in budgets):
        return ""
    return (f"`{other}`'s expectation is a multiple (k/t) of `{paper}`'s (equal direction bias at every t): it removes "
            "the scale error but none of the direction error, for the variance factor above. ")


def best_of(at: dict, metric: str, budget: int) -> str:
    """The scheme with the lowest ``metric`` at ``budget`` (NaN cells skipped)."""
    vals = {s: v[budget] for s, v in at[metric].items() if v[budget] == v[budget]}
    return min(vals, key=vals.get) if vals else "–"


def price_text(price: dict, budgets) -> str:
    return ", ".join(f"t = {t}: {price[t]:.3g}×" for t in budgets)


def scheme_definitions_section() -> list[str]:
    return ["## The schemes\n",
            "A sparse step draws a set I of chunks and backpropagates, for every j ∈ I, c_0 times its own loss's "
            "gradient plus c_q times what reaches it through q KV-cache hops; a p-hop chain gets W(p) = c_0 c_1 … "
            "c_p and survives with probability π(p), so E ĝ = Σ_p W(p) π(p) g(p). Uniform sampling draws t distinct "
            "chunks of k; Bernoulli includes each chunk with probability ρ = t/k.\n",
            table(scheme_definitions()) + "\n"]


def real_lm_section(out_md: Path) -> list[str]:
    """"On a pretrained LM": the real-LM cells stored beside the report (``real_study/k16x16`` next to
    ``out_md``, written by ``make real-study``), rendered by :mod:`seco_lab.report.real`; when absent, a line
    saying the section is left out and why."""
    from .real import render

    real = STUDIES["real"]
    rel = real.results.relative_to(real.report_file.parent)
    folder = Path(out_md).parent / rel
    what = "the section on a pretrained LM (SmolLM2-135M, real-LM cells)"
    with verified_beside(folder, real.produce) as present:  # read as the report's own results are: verified
        if not present:
            return [left_out(what, rel, "does not exist beside this report", real.produce)]
        if not (folder / "study.json").exists():  # verified: not recorded either, so no finished real-LM study
            return [left_out(what, rel, "holds no finished study (no study.json)", real.produce)]
        lacking = [f for f in real.stored_files if not (folder / f).exists()]
        if lacking:  # a study stopped before its tables: not a --results matter of this report
            raise MissingResultsError(f"this report also draws from {folder}, which lacks {', '.join(lacking)} (a real"
                                      f"-LM study stopped before its tables?): finish it with {real.produce} "
                                      f"(--out {folder}), or move the folder away to leave the section out")
        text = render(folder)
    text = text.replace("## A pretrained LM: SmolLM2-135M on real Python",
                        "## On a pretrained LM: SmolLM2-135M on real Python", 1)
    return [text, "Full report: [real_study.md](real_study.md) (`seco-lab report real`).\n"]


PAPER_TABLE_HEADINGS = tuple(PAPER_METRICS.values())  # the paper-settings table's metric columns (for tests)
