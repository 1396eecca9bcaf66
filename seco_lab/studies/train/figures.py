"""Figures of the training study, drawn on ``matplotlib.figure.Figure`` (no pyplot global state).

Every line is labelled; dense (dashed, black) and SeCO (solid, thick, grey) stay distinguishable
where they coincide; each panel shows one optimizer and one budget, so no panel bundles more than
the schemes of one budget.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ...report.figures import SCHEME_COLOURS, write_png

__all__ = ["distance_plot", "learning_curves", "lr_plot", "probe_plot", "save"]

EXACT_STYLE = {"seco": dict(color="0.55", lw=4.0, ls="-", alpha=0.8, zorder=2),
               "dense": dict(color="black", lw=1.3, ls="--", zorder=3)}


def arm_style(arm: str) -> dict:
    if arm in EXACT_STYLE:
        return dict(EXACT_STYLE[arm])
    scheme = arm.split(" t=")[0]
    return dict(color=SCHEME_COLOURS.get(scheme, "gray"), lw=1.6, ls="-", zorder=4)


def panel_arms(arms, budget: int) -> list[str]:
    """dense, SeCO and the SpaCO arms at ``budget``, in a fixed order."""
    exact = [a for a in ("dense", "seco") if a in arms]
    return exact + [a for a in arms if a.endswith(f" t={budget}")]


def _grid(optimizers, budgets, width=5.2, height=3.6):
    fig = Figure(figsize=(width * len(budgets), height * len(optimizers)), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(optimizers), len(budgets), squeeze=False, sharey="row"))
    return fig, axes


def save(fig: Figure, path: Path) -> Path:
    return write_png(fig, path, dpi=110)


def learning_curves(curves: pd.DataFrame, metric: str, budgets, k: int, chance: float | None, ylabel: str) -> Figure:
    """``metric`` vs step at each arm's tuned rate: mean over seeds, band = range over seeds."""
    opts = list(dict.fromkeys(curves.optimizer))
    fig, axes = _grid(opts, budgets)
    arms = list(dict.fromkeys(curves.arm))
    for r, opt in enumerate(opts):
        for c, t in enumerate(budgets):
            ax = axes[r, c]
            for arm in panel_arms(arms, t):
                g = curves[(curves.arm == arm) & (curves.optimizer == opt) & (curves.metric == metric)]
                if g.empty:
                    continue
                st = arm_style(arm)
                ax.plot(g.step, g["mean"], label=arm, **st)
                # band: the range over seeds (with 3 seeds a t-band is ~5 standard errors wide and hides the lines)
                ax.fill_between(g.step, g["min"], g["max"], color=st["color"], alpha=0.12, lw=0)
            if chance is not None:
                ax.axhline(chance, color="0.3", lw=0.8, ls=":", label=f"ln K = {chance:.3f}")
            ax.set_title(f"{opt}, SpaCO t/k = {t}/{k}")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    return fig


def distance_plot(by_distance: pd.DataFrame, budgets, k: int, chance: float) -> Figure:
    """Final test far-token loss vs chunk distance of the pair, per arm (tuned rate): mean over seeds,
    bars = range over seeds (the t-intervals are in the report's table)."""
    opts = list(dict.fromkeys(by_distance.optimizer))
    fig, axes = _grid(opts, budgets)
    arms = list(dict.fromkeys(by_distance.arm))
    for r, opt in enumerate(opts):
        for c, t in enumerate(budgets):
            ax = axes[r, c]
            shown = panel_arms(arms, t)
            for i, arm in enumerate(shown):
                g = by_distance[(by_distance.arm == arm) & (by_distance.optimizer == opt)]
                st = arm_style(arm)
                x = g.distance + (i - len(shown) / 2) * 0.06  # dodge so intervals stay visible
                err = np.vstack([g["mean"] - g["min"], g["max"] - g["mean"]])  # range over seeds
                ax.errorbar(x, g["mean"], yerr=np.nan_to_num(err), marker="o", ms=3, capsize=2, label=arm,
                            color=st["color"], ls=st["ls"], lw=min(st["lw"], 1.6))
            ax.axhline(chance, color="0.3", lw=0.8, ls=":", label=f"ln K = {chance:.3f}")
            ax.set_title(f"{opt}, SpaCO t/k = {t}/{k}")
            ax.set_xlabel("distance of the pair (chunks before the query)")
            ax.set_ylabel("test far-token loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    return fig


def probe_plot(probe_curves: pd.DataFrame, metrics: dict[str, str]) -> Figure:
    """Gradient quality of each SpaCO arm's expected gradient along its own trajectory."""
    opts = list(dict.fromkeys(probe_curves.optimizer))
    fig = Figure(figsize=(4.6 * len(metrics), 3.6 * len(opts)), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(opts), len(metrics), squeeze=False))
    arms = [a for a in dict.fromkeys(probe_curves.arm) if " t=" in a]
    budgets = sorted({int(a.split(" t=")[1]) for a in arms}, reverse=True)
    dashes = {t: ls for t, ls in zip(budgets, ["-", "--", ":", "-."])}
    for r, opt in enumerate(opts):
        for c, (metric, label) in enumerate(metrics.items()):
            ax = axes[r, c]
            for arm in arms:
                g = probe_curves[(probe_curves.arm == arm) & (probe_curves.optimizer == opt)
                                 & (probe_curves.metric == metric)]
                if g.empty:
                    continue
                st = arm_style(arm)
                ax.plot(g.step, g["mean"], color=st["color"], ls=dashes[int(arm.split(" t=")[1])], lw=1.4, label=arm)
            ax.set_title(f"{opt}: {label}")
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6), fontsize=8)
    return fig


def lr_plot(selection: pd.DataFrame, budgets, k: int) -> Figure:
    """Mean validation far-token loss vs learning rate: how much tuning each arm needs."""
    opts = list(dict.fromkeys(selection.optimizer))
    fig, axes = _grid(opts, budgets, height=3.3)
    arms = list(dict.fromkeys(selection.arm))
    for r, opt in enumerate(opts):
        for c, t in enumerate(budgets):
            ax = axes[r, c]
            for arm in panel_arms(arms, t):
                g = selection[(selection.arm == arm) & (selection.optimizer == opt)].sort_values("lr")
                st = arm_style(arm)
                ax.plot(g.lr, g.val_far_loss, marker="o", ms=3, label=arm, color=st["color"], ls=st["ls"],
                        lw=min(st["lw"], 2.5))
                b = g[g.best]
                ax.plot(b.lr, b.val_far_loss, marker="*", ms=10, color=st["color"], ls="none")
            ax.set_xscale("log")
            ax.set_title(f"{opt}, SpaCO t/k = {t}/{k} (star: tuned rate)")
            ax.set_xlabel("peak learning rate")
            ax.set_ylabel("validation far-token loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    return fig
