"""The equal-compute comparisons: the compute levels compared, each arm's row against its level's reference,
the verdict line per level and optimizer, the one-sentence advice, and the compute plot.

Every comparison pairs seeds (same initial weights).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from seco_lab.stats.equal_compute import chunk_passes, equal_batches

from ...report.figures import SCHEME_COLOURS
from .equal_finals import arm_fields
from .equal_format import ci, fmt
from .stats import detectable_difference, paired_difference, t_interval

__all__ = ["action_sentence", "arm_row", "compute_plot", "levels", "verdict"]


def arm_row(best: pd.DataFrame, arm: str, opt: str, ref: str | None, chance: float) -> dict | None:
    g = best[(best.arm == arm) & (best.optimizer == opt)].set_index("seed")
    if g.empty:
        return None
    m, lo, hi, n = t_interval(g.test_far_loss)
    row = {"arm": arm, "optimizer": opt, "lr": float(g.lr.iloc[0]), "rel_compute": float(g.rel_compute.iloc[0]),
           "batch": int(g.batch_size.iloc[0]), "steps": int(g.steps.iloc[0]), "far": m, "far_lo": lo, "far_hi": hi,
           "seeds": n, "learned": int((g.test_far_loss < chance / 2).sum()),
           "cpu_ms": float(g.cpu_ms_per_step.median()) if g.cpu_ms_per_step.notna().any() else math.nan}
    if ref is not None and ref != arm:
        r = best[(best.arm == ref) & (best.optimizer == opt)].set_index("seed")
        seeds = g.index.intersection(r.index)
        d = paired_difference(g.loc[seeds, "test_far_loss"].to_numpy(), r.loc[seeds, "test_far_loss"].to_numpy())
        diffs = (g.loc[seeds, "test_far_loss"] - r.loc[seeds, "test_far_loss"]).to_numpy()
        sd = float(np.nanstd(diffs, ddof=1)) if len(seeds) > 1 else math.nan
        row.update(ref=ref, diff=d["diff"], diff_lo=d["diff_lo"], diff_hi=d["diff_hi"], pairs=d["n_pairs"],
                   mde=detectable_difference(sd, len(seeds)))
    return row


def levels(final: pd.DataFrame, budgets, num_chunks: int, batch: int) -> list[dict]:
    """The compute levels compared: SpaCO(t)'s compute (SeCO with fewer sequences / steps as reference) and
    SeCO's compute (SeCO as reference), per budget, each with the arms present at that level."""
    arms = list(dict.fromkeys(final.arm))
    out = []
    for t in budgets:
        ref = f"seco B={equal_batches(num_chunks, batch, t)[0]}"
        if ref not in arms:
            continue
        steps_arm = [a for a in arms if a.startswith("seco steps=") and
                     abs(final[final.arm == a].rel_compute.iloc[0] - chunk_passes("spaco", num_chunks, t)
                         / chunk_passes("seco", num_chunks)) < 0.01]
        spaco = [a for a in arms if a.endswith(f" t={t}")]
        out.append({"name": f"SpaCO t={t}'s compute", "budget": t, "ref": ref, "arms": [ref] + steps_arm + spaco,
                    "spaco": spaco})
    for t in budgets:
        big = [a for a in arms if f" t={t} B=" in a]
        if big and "seco" in arms:
            out.append({"name": f"SeCO's compute (t={t} schemes on more sequences)", "budget": t, "ref": "seco",
                        "arms": ["seco"] + big, "spaco": big})
    if "truncated" in arms and "seco" in arms:
        cheaper = [a for a in arms if a.startswith("seco B=")]
        out.append({"name": "truncated (cache detached)", "budget": None, "ref": "seco",
                    "arms": ["seco", "truncated"] + cheaper, "spaco": []})
    return out


def verdict(best: pd.DataFrame, level: dict, opt: str, chance: float) -> tuple[list[list], str, dict]:
    """Table rows of one compute level and optimizer, and its one-line verdict."""
    rows, data = [], []
    for arm in level["arms"]:
        r = arm_row(best, arm, opt, level["ref"], chance)
        if r is None:
            continue
        data.append(r)
        rows.append([arm, fmt(r["rel_compute"], 2), r["batch"], r["steps"], f"{r['lr']:g}",
                     ci(r["far"], r["far_lo"], r["far_hi"]),
                     ci(r.get("diff"), r.get("diff_lo"), r.get("diff_hi")) if "diff" in r else "reference",
                     fmt(r.get("mde", math.nan)), f"{r['learned']}/{r['seeds']}", fmt(r["cpu_ms"], 1)])
    if not data:
        return rows, "", {}
    winner = min(data, key=lambda r: r["far"] if np.isfinite(r["far"]) else math.inf)
    sp = [r for r in data if r["arm"] in level["spaco"] and "diff" in r]
    summary = {"winner": winner["arm"]}
    if not sp:
        if level["budget"] is None:
            tr = next((r for r in data if r["arm"] == "truncated"), None)
            if tr is None:
                return rows, "", summary
            line = (f"truncated − SeCO = {ci(tr['diff'], tr['diff_lo'], tr['diff_hi'])} at "
                    f"{fmt(tr['rel_compute'], 2)}× SeCO's compute; best arm here: `{winner['arm']}`.")
            return rows, line, summary
        return rows, "", summary
    bsp = min(sp, key=lambda r: r["far"] if np.isfinite(r["far"]) else math.inf)
    if not np.isfinite(bsp["diff_lo"]):
        line = (f"best arm `{winner['arm']}`; best SpaCO arm `{bsp['arm']}` − `{level['ref']}` = {fmt(bsp['diff'])} "
                f"over {bsp['pairs']} paired seed(s): **too few seeds for an interval**, no verdict.")
        return rows, line, summary
    if bsp["diff_hi"] < 0:
        word = "**SpaCO beats SeCO**"
    elif bsp["diff_lo"] > 0:
        word = "**SeCO beats every SpaCO arm**" if all(r["diff_lo"] > 0 for r in sp) else "**SeCO beats SpaCO**"
    else:
        word = f"**no detectable difference** (MDE {fmt(bsp['mde'])} nats)"
    summary.update(best_spaco=bsp["arm"], diff=bsp["diff"], lo=bsp["diff_lo"], hi=bsp["diff_hi"], word=word)
    line = (f"best arm `{winner['arm']}`; best SpaCO arm `{bsp['arm']}` − `{level['ref']}` = "
            f"{ci(bsp['diff'], bsp['diff_lo'], bsp['diff_hi'])}: {word}.")
    return rows, line, summary


def action_sentence(opt: str, summaries: list[tuple[dict, dict]]) -> str:
    """One sentence a user can act on, from the verdicts at SpaCO's compute levels."""
    at_spaco = [(lv, s) for lv, s in summaries if lv["name"].startswith("SpaCO") and "word" in s]
    if not at_spaco:
        return ""
    parts = []
    for lv, s in at_spaco:
        t = lv["budget"]
        if "SpaCO beats" in s["word"]:
            parts.append(f"at t = {t} run `{s['best_spaco']}` (it beats SeCO on {lv['ref'].split('B=')[1]} "
                         f"sequences per step)")
        elif "SeCO beats" in s["word"]:
            parts.append(f"instead of SpaCO at t = {t}, run SeCO on {lv['ref'].split('B=')[1]} sequences per step")
        else:
            parts.append(f"at t = {t} SpaCO (`{s['best_spaco']}`) and SeCO on {lv['ref'].split('B=')[1]} sequences "
                         "per step are indistinguishable, so prefer SeCO (exact, no scheme to choose)")
    return f"**{opt}, in one sentence:** with this compute, " + "; ".join(parts) + "."


def compute_plot(best: pd.DataFrame, title: str) -> Figure:
    """Final test far-token loss against relative compute per arm (mean, 95% t-interval over seeds)."""
    opts = list(dict.fromkeys(best.optimizer))
    fig = Figure(figsize=(6.4 * len(opts), 4.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(opts), sharey=True))
    for ax, opt in zip(axes, opts):
        d = best[best.optimizer == opt]
        for arm, g in d.groupby("arm", sort=False):
            m, lo, hi, _ = t_interval(g.test_far_loss)
            x = float(g.rel_compute.iloc[0])
            base = arm_fields(arm)["base"]
            scheme = base.split(" t=")[0]
            if base.startswith("seco"):
                color, marker = "black", "s" if "steps=" in arm else "o"
            elif base == "truncated":
                color, marker = "0.5", "X"
            elif base == "dense":
                continue
            else:
                color, marker = SCHEME_COLOURS.get(scheme, "tab:gray"), "^" if "t=4" in base else "v"
            yerr = [[m - lo], [hi - m]] if np.isfinite(lo) else None
            ax.errorbar([x], [m], yerr=yerr, fmt=marker, color=color, mfc="none" if "B=" in arm else color,
                        capsize=3, ms=7)
            ax.annotate(arm, (x, m), textcoords="offset points", xytext=(5, 3), fontsize=6.5, color=color)
        ax.set_xlabel("compute per run relative to SeCO (steps × sequences × chunk passes)")
        ax.set_title(f"{title}: {opt}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test far-token loss (tuned rate), 95% CI")
    return fig
