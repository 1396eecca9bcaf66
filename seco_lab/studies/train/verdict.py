"""The training study's verdict: does the bias change what a model learns?  Per optimizer, the best and the worst
scheme paired by seed, the caps' effect, how far tuning the rate moved each biased arm, and the bias's rank
correlation with the outcome."""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from .report_format import ci, fmt
from .stats import paired_difference
from .summary import at_best

__all__ = ["BIASED", "bias_link_lines", "cap_lines", "paired_arms", "tuning_lines", "verdict_lines"]

BIASED = ("paper", "paper-capped", "released", "released-unbiased")


def paired_arms(final: pd.DataFrame, sel: pd.DataFrame, a: str, b: str, opt: str, metric: str) -> dict:
    """Paired difference a - b of ``metric`` at each arm's tuned rate, same seeds."""
    best = at_best(final, sel)
    x = best[(best.arm == a) & (best.optimizer == opt)].set_index("seed")[metric]
    y = best[(best.arm == b) & (best.optimizer == opt)].set_index("seed")[metric]
    seeds = x.index.intersection(y.index)
    return paired_difference(x.loc[seeds].to_numpy(), y.loc[seeds].to_numpy())


def verdict_lines(tabs: dict, study: dict) -> list[str]:
    """The verdict, generated from the numbers (see module docstring of summary.py for the protocol)."""
    tab, final, sel, unt = tabs["table"], tabs["final"], tabs["selection"], tabs["untuned"]
    budgets = study["design"]["budgets"]
    lo_n, hi_n = int(tab.seeds.min()), int(tab.seeds.max())
    n_seeds = f"{lo_n}" if lo_n == hi_n else f"{lo_n}–{hi_n}"
    out = ["## Verdict", "",
           f"Power: {n_seeds} seed(s) per arm and optimizer at the tuned rate; a paired difference is called a "
           "difference only when its 95% t-interval excludes 0. 'MDE' is the paired difference a two-sided "
           "paired t-test at 5% would detect with 80% probability given the observed spread of the differences "
           "(noncentral t).", ""]
    for opt in dict.fromkeys(tab.optimizer):
        g = tab[tab.optimizer == opt]
        out.append(f"### {opt}")
        out.append("")
        sp = g[g["mode"] == "spaco"]
        worse = sp[sp.test_far_loss_vs_seco_lo > 0].arm.tolist()
        same = sp[~(sp.test_far_loss_vs_seco_lo > 0) & ~(sp.test_far_loss_vs_seco_hi < 0)]
        out.append(f"- **SpaCO vs SeCO (far-token loss)**: worse than SeCO: {', '.join(worse) or 'none'}; "
                   f"not distinguishable: {', '.join(same.arm) or 'none'} (median MDE "
                   f"{fmt(float(sp.test_far_loss_mde.dropna().median()))} nats).")
        dense = g[g.arm == "dense"]
        if not dense.empty:
            r = dense.iloc[0]
            out.append(f"- **Dense vs SeCO** (the same gradient up to float32 rounding, so this measures how far "
                       f"rounding alone moves a run): Δ far = "
                       f"{ci(r.test_far_loss_vs_seco, r.test_far_loss_vs_seco_lo, r.test_far_loss_vs_seco_hi, 4)}.")
        exact = g[g["mode"] != "spaco"]
        out.append("- **Seeds that learned the task** (test far-token loss < ln K / 2, tuned rate): "
                   + "; ".join(f"{r.arm} {r.learned}/{r.seeds}" for r in pd.concat([exact, sp]).itertuples()) + ".")
        for t in budgets:
            at = sp[sp.budget == t].sort_values("test_far_loss")
            if len(at) < 2:
                continue
            best, worst = at.iloc[0], at.iloc[-1]
            d = paired_arms(final, sel, worst.arm, best.arm, opt, "test_far_loss")
            verdict = ("too few paired seeds for an interval" if not np.isfinite(d["diff_lo"]) else
                       "scheme choice **changed the outcome**" if d["diff_lo"] > 0 else
                       "**no detectable difference** between the best and worst scheme at this power")
            out.append(f"- **Scheme choice at t = {t}**: best {best.arm} ({fmt(best.test_far_loss)}), worst "
                       f"{worst.arm} ({fmt(worst.test_far_loss)}); paired worst − best = "
                       f"{ci(d['diff'], d['diff_lo'], d['diff_hi'])}: {verdict}.")
        out += cap_lines(final, sel, tab, opt, budgets)
        out += tuning_lines(unt[unt.optimizer == opt])
        out += bias_link_lines(tabs["probes"], opt)
        out.append("")
    return out


def cap_lines(final, sel, tab, opt, budgets) -> list[str]:
    out = []
    for t in budgets:
        capped, plain = f"paper-capped t={t}", f"paper t={t}"
        if capped not in set(tab.arm) or plain not in set(tab.arm):
            continue
        d = paired_arms(final, sel, capped, plain, opt, "test_far_loss")
        runs = final[final.optimizer == opt]
        div_c, div_p = int(runs[runs.arm == capped].diverged.sum()), int(runs[runs.arm == plain].diverged.sum())
        n_c = int((runs.arm == capped).sum())
        rough_c = float(runs[runs.arm == capped].train_roughness.median())
        rough_p = float(runs[runs.arm == plain].train_roughness.median())
        effect = ("has too few paired seeds to judge" if not np.isfinite(d["diff_lo"]) else "helped" if d["diff_hi"] < 0
                  else "hurt" if d["diff_lo"] > 0 else "had no detectable effect on")
        stab = ("fewer" if div_c < div_p else "more" if div_c > div_p else "as many")
        out.append(f"- **Cap (C = 2) at t = {t}**: capped − uncapped far-token loss = "
                   f"{ci(d['diff'], d['diff_lo'], d['diff_hi'])}, so the cap {effect} the outcome; divergences over "
                   f"the whole lr grid: {div_c}/{n_c} capped vs {div_p}/{n_c} uncapped ({stab}); median "
                   f"step-to-step training-loss roughness {fmt(rough_c, 4)} vs {fmt(rough_p, 4)}.")
    return out


def tuning_lines(unt: pd.DataFrame) -> list[str]:
    out = []
    for r in unt.itertuples():
        if r.arm.split(" t=")[0] not in BIASED:
            continue
        before = r.gap_at_seco_lr_lo > 0
        after = r.gap_tuned_lo > 0
        if not (np.isfinite(r.gap_at_seco_lr_lo) and np.isfinite(r.gap_tuned_lo)):
            what = "too few paired seeds to judge"
        elif r.own_lr == r.seco_lr:
            what = "tuned rate = SeCO's rate"
        elif before and not after:
            what = "**tuning closes the gap** (to within the interval)"
        elif before and after:
            what = "tuning does **not** close the gap" + (
                f" (narrows it by {fmt(r.gap_at_seco_lr - r.gap_tuned)})" if r.gap_tuned < r.gap_at_seco_lr else "")
        else:
            what = "no gap to close at SeCO's rate"
        out.append(f"- **LR tuning, {r.arm}**: gap at SeCO's rate {r.seco_lr:g}: "
                   f"{ci(r.gap_at_seco_lr, r.gap_at_seco_lr_lo, r.gap_at_seco_lr_hi)}; at its own rate {r.own_lr:g}: "
                   f"{ci(r.gap_tuned, r.gap_tuned_lo, r.gap_tuned_hi)} — {what}.")
    return out


def bias_link_lines(probes: pd.DataFrame, opt: str) -> list[str]:
    p = probes[(probes.optimizer == opt) & probes.arm.str.contains(" t=")]
    metric = "probe_per_tensor_residual" if opt == "adamw" else "probe_best_scale_residual"
    if len(p) < 3 or metric not in p:
        return []
    x, y = p[metric].to_numpy(), p.test_far_loss_vs_seco.to_numpy()
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return []
    rho, pv = stats.spearmanr(x[ok], y[ok])
    name = metric.removeprefix("probe_").replace("_", "-")
    return [f"- **Bias vs outcome**: across the {int(ok.sum())} SpaCO arms, Spearman ρ between the trajectory-mean "
            f"{name} (the {opt}-relevant bias) and the far-token gap to SeCO = {fmt(float(rho), 2)} "
            f"(p = {fmt(float(pv), 3)})."]
