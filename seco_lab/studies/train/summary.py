"""``summarize``: the study's stored results -> pandas tables (pure: no files written).

Selection protocol: for each (arm, optimizer) the learning rate with the lowest mean *validation*
far-token loss over seeds at the last step (learning rates where a seed diverged come last) is the
arm's tuned rate; every test-set number is reported at that rate.  Paired comparisons pair a run
with SeCO's run of the same seed at SeCO's tuned rate (same initial weights, same token stream).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .stats import detectable_difference, paired_difference, t_interval

__all__ = ["KEYS", "at_best", "curves", "select_lr", "summarize"]

KEYS = ["arm", "optimizer", "lr", "seed"]


def final_metrics(results: pd.DataFrame, runs: pd.DataFrame, steps: int) -> pd.DataFrame:
    """One row per run: last-step validation / test losses (NaN for a diverged run) + compute."""
    last = results[(results.step == steps) & results.metric.isin(["val_far_loss", "val_loss", "test_far_loss",
                                                                   "test_loss"])]
    col = last.metric + np.where(last.distance > 0, "_d" + last.distance.astype(str), "")
    wide = last.assign(col=col).pivot_table(index=KEYS, columns="col", values="value").reset_index()
    keep = ["arm", "optimizer", "lr", "seed", "mode", "scheme", "budget", "diverged", "wall_s",
            "backprop_chunks_per_step", "steps_done", "param_distance"]
    out = runs[keep].merge(wide, on=KEYS, how="left")
    roughness = (results[results.metric == "train_loss"].sort_values("step").groupby(KEYS)["value"]
                 .agg(lambda v: float(np.nanstd(np.diff(v.to_numpy()[len(v) // 2:]))) if len(v) > 3 else math.nan))
    return out.merge(roughness.rename("train_roughness").reset_index(), on=KEYS, how="left")


def select_lr(final: pd.DataFrame) -> pd.DataFrame:
    """Per (arm, optimizer, lr): mean validation far loss over seeds and divergences; ``best`` marks the
    tuned rate (fewest divergences, then lowest mean validation far loss)."""
    g = final.groupby(["arm", "optimizer", "lr"], sort=False)
    sel = g.agg(val_far_loss=("val_far_loss", "mean"), diverged=("diverged", "sum"), seeds=("seed", "count"))
    sel = sel.reset_index()
    sel["rank_key"] = sel.diverged * 1e9 + sel.val_far_loss.fillna(1e9)
    best = sel.loc[sel.groupby(["arm", "optimizer"]).rank_key.idxmin(), ["arm", "optimizer", "lr"]]
    sel["best"] = sel.set_index(["arm", "optimizer", "lr"]).index.isin(best.set_index(["arm", "optimizer", "lr"]).index)
    return sel.drop(columns="rank_key")


def at_best(final: pd.DataFrame, sel: pd.DataFrame) -> pd.DataFrame:
    return final.merge(sel.loc[sel.best, ["arm", "optimizer", "lr"]], on=["arm", "optimizer", "lr"])


def _ref(final: pd.DataFrame, sel: pd.DataFrame, optimizer: str, lr: float | None = None) -> pd.DataFrame:
    """SeCO's runs for ``optimizer`` at its tuned rate (or at ``lr``), indexed by seed."""
    seco = final[(final.arm == "seco") & (final.optimizer == optimizer)]
    if lr is None:
        lr = float(sel[(sel.arm == "seco") & (sel.optimizer == optimizer) & sel.best].lr.iloc[0])
    return seco[seco.lr == lr].set_index("seed")


def final_table(final: pd.DataFrame, sel: pd.DataFrame, metrics=("test_far_loss", "test_loss"),
                level: float = 0.95, learned_below: float = math.inf) -> pd.DataFrame:
    """Per (arm, optimizer) at the tuned rate: mean and t-interval over seeds of each metric, the paired
    difference to SeCO (same seed, SeCO at its tuned rate), compute, the detectable difference, and how
    many seeds *learned* the task (test far-token loss below ``learned_below``)."""
    rows = []
    best = at_best(final, sel)
    for (arm, opt), grp in best.groupby(["arm", "optimizer"], sort=False):
        ref = _ref(final, sel, opt)
        grp = grp.set_index("seed")
        row = {"arm": arm, "optimizer": opt, "lr": float(grp.lr.iloc[0]), "mode": grp["mode"].iloc[0],
               "scheme": grp.scheme.iloc[0], "budget": int(grp.budget.iloc[0]), "seeds": len(grp),
               "diverged": int(grp.diverged.sum()), "learned": int((grp.test_far_loss < learned_below).sum()),
               "backprop_chunks_per_step": float(grp.backprop_chunks_per_step.mean()),
               "wall_s": float(grp.wall_s.median())}
        for m in metrics:
            mean, lo, hi, _ = t_interval(grp[m], level)
            seeds = grp.index.intersection(ref.index)
            pd_ = paired_difference(grp.loc[seeds, m].to_numpy(), ref.loc[seeds, m].to_numpy(), level)
            sd = float(np.nanstd(grp.loc[seeds, m].to_numpy() - ref.loc[seeds, m].to_numpy(), ddof=1)) \
                if len(seeds) > 1 else math.nan
            row.update({m: mean, f"{m}_lo": lo, f"{m}_hi": hi, f"{m}_vs_seco": pd_["diff"],
                        f"{m}_vs_seco_lo": pd_["diff_lo"], f"{m}_vs_seco_hi": pd_["diff_hi"],
                        f"{m}_vs_seco_p": pd_["p_value"], f"{m}_mde": detectable_difference(sd, len(seeds))})
        rows.append(row)
    return pd.DataFrame(rows)


def distance_table(final: pd.DataFrame, sel: pd.DataFrame, distances, level: float = 0.95) -> pd.DataFrame:
    """Test far-token loss by chunk distance, per (arm, optimizer) at the tuned rate: mean and interval."""
    rows = []
    for (arm, opt), grp in at_best(final, sel).groupby(["arm", "optimizer"], sort=False):
        for d in distances:
            x = grp[f"test_far_loss_d{d}"]
            mean, lo, hi, n = t_interval(x, level)
            rows.append({"arm": arm, "optimizer": opt, "distance": int(d), "mean": mean, "lo": lo, "hi": hi,
                         "min": float(x.min()), "max": float(x.max()), "seeds": n})
    return pd.DataFrame(rows)


def untuned_gap(final: pd.DataFrame, sel: pd.DataFrame, metric: str = "test_far_loss",
                level: float = 0.95) -> pd.DataFrame:
    """Does tuning close the gap?  Paired gap to SeCO with the arm at SeCO's tuned rate vs at its own."""
    rows = []
    for (arm, opt), grp in final[final["mode"] == "spaco"].groupby(["arm", "optimizer"], sort=False):
        ref = _ref(final, sel, opt)
        seco_lr = float(ref.lr.iloc[0])
        own_lr = float(sel[(sel.arm == arm) & (sel.optimizer == opt) & sel.best].lr.iloc[0])
        out = {"arm": arm, "optimizer": opt, "seco_lr": seco_lr, "own_lr": own_lr}
        for tag, lr in (("at_seco_lr", seco_lr), ("tuned", own_lr)):
            g = grp[grp.lr == lr].set_index("seed")
            seeds = g.index.intersection(ref.index)
            d = paired_difference(g.loc[seeds, metric].to_numpy(), ref.loc[seeds, metric].to_numpy(), level)
            out.update({f"gap_{tag}": d["diff"], f"gap_{tag}_lo": d["diff_lo"], f"gap_{tag}_hi": d["diff_hi"]})
        rows.append(out)
    return pd.DataFrame(rows)


def curves(results: pd.DataFrame, sel: pd.DataFrame, metrics, level: float = 0.95) -> pd.DataFrame:
    """Mean, t-interval and range (min, max) over seeds, per (arm, optimizer, metric, step), at the tuned rate."""
    best = sel.loc[sel.best, ["arm", "optimizer", "lr"]]
    r = results[results.metric.isin(metrics) & (results.distance == 0)].merge(best, on=["arm", "optimizer", "lr"])
    rows = []
    for (arm, opt, metric, step), g in r.groupby(["arm", "optimizer", "metric", "step"], sort=False):
        mean, lo, hi, n = t_interval(g.value, level)
        rows.append({"arm": arm, "optimizer": opt, "metric": metric, "step": int(step), "mean": mean,
                     "lo": lo, "hi": hi, "min": float(g.value.min()), "max": float(g.value.max()), "seeds": n})
    # keep the study's arm order (first appearance); steps ascend within each run already
    return pd.DataFrame(rows).sort_values("step", kind="stable").sort_values(
        ["optimizer", "metric"], kind="stable").reset_index(drop=True)


def probe_summary(results: pd.DataFrame, sel: pd.DataFrame, final_tab: pd.DataFrame) -> pd.DataFrame:
    """Per SpaCO arm and optimizer: the probes averaged over the trajectory (at the tuned rate), next to the
    final gap to SeCO -- the study's link between measured bias and training outcome."""
    metrics = ["probe_cos", "probe_rel_bias", "probe_best_scale_residual", "probe_per_tensor_residual",
               "probe_hop_share"]
    c = curves(results, sel, metrics)
    avg = c.groupby(["arm", "optimizer", "metric"])["mean"].mean().unstack("metric").reset_index()
    avg.columns.name = None
    keep = final_tab[["arm", "optimizer", "test_far_loss_vs_seco"]]
    return avg.merge(keep, on=["arm", "optimizer"])


def in_arm_order(df: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """Rows sorted by the study's arm order (stable within an arm)."""
    rank = {a: i for i, a in enumerate(order)}
    return df.iloc[np.argsort(df.arm.map(rank).to_numpy(), kind="stable")].reset_index(drop=True)


def summarize(results: pd.DataFrame, runs: pd.DataFrame, study: dict, level: float = 0.95) -> dict[str, pd.DataFrame]:
    """All tables of the report from ``results.csv.gz``, ``runs.csv`` and ``study.json`` (pure)."""
    settings = study["design"]["settings"]
    order = [a["name"] for a in study["design"]["arms"]]
    final = in_arm_order(final_metrics(results, runs, settings["steps"]), order)
    sel = in_arm_order(select_lr(final), order)
    chance = math.log((settings["task"]["vocab_size"] - 1) // 4)
    tab = in_arm_order(final_table(final, sel, level=level, learned_below=chance / 2), order)
    tables = {
        "final": final,
        "selection": sel,
        "table": tab,
        "by_distance": distance_table(final, sel, settings["task"]["distances"], level),
        "untuned": untuned_gap(final, sel, level=level),
        "curves": curves(results, sel, ["val_far_loss", "val_loss", "train_loss"], level),
        "probe_curves": curves(results, sel, ["probe_cos", "probe_rel_bias", "probe_best_scale_residual",
                                              "probe_per_tensor_residual", "probe_hop_share"], level),
        "probes": probe_summary(results, sel, tab),
    }
    return {name: in_arm_order(t, order) for name, t in tables.items()}
