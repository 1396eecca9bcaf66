"""The bias report's figures, drawn from the study's cell table (one row per L, k, t, seed, scheme)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..study.definition import PAPER, SCHEMES
from .bias_summary import UNBIASED_TOL
from .figures import new_figure, save_figure, scheme_order, scheme_style

PAPER_FAMILY = tuple(v.label for v in SCHEMES if v.name.startswith(PAPER.name))


def _legend(fig, ax) -> None:
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)


def fig_bias_vs_ratio(cells: pd.DataFrame, out: Path) -> str:
    ks, Ls = sorted(cells.k.unique()), sorted(cells.L.unique())
    fig, axes = new_figure(len(ks), len(Ls), figsize=(4.2 * len(Ls), 3.2 * len(ks)), sharey=True)
    mean = cells.groupby(["L", "k", "t", "ratio", "scheme"], as_index=False).rel_bias.mean()
    for r, k in enumerate(ks):
        for c, L in enumerate(Ls):
            ax = axes[r][c]
            for s in scheme_order(cells.scheme):
                d = mean[(mean.k == k) & (mean.L == L) & (mean.scheme == s)].sort_values("ratio")
                col, ls = scheme_style(s)
                ax.plot(d.ratio, d.rel_bias, ls, color=col, marker="o", ms=3, label=s)
            ax.axvline((L + 1) / k, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_title(f"L={L} layers, k={k} chunks", fontsize=9)
            ax.set_xlabel("budget ratio t/k (dotted: t = L+1)")
            if c == 0:
                ax.set_ylabel("exact relative bias ||E ĝ - g|| / ||g||")
    _legend(fig, axes[0][0])
    fig.suptitle("Exact relative bias of each compensation scheme (mean over seeds)")
    return save_figure(fig, out / "bias_vs_ratio.png")


def fig_variance_mse(cells: pd.DataFrame, out: Path) -> str:
    k = cells.k.max()
    Ls = sorted(cells.L.unique())
    fig, axes = new_figure(2, len(Ls), figsize=(4.2 * len(Ls), 6.4), sharey="row")
    d = cells[(cells.k == k) & (cells.t < k)].groupby(["L", "ratio", "scheme"], as_index=False)[
        ["rel_var", "rel_mse"]].mean()
    for c, L in enumerate(Ls):
        for s in scheme_order(cells.scheme):
            e = d[(d.L == L) & (d.scheme == s)].sort_values("ratio")
            col, ls = scheme_style(s)
            axes[0][c].plot(e.ratio, e.rel_var, ls, color=col, marker="o", ms=3, label=s)
            axes[1][c].plot(e.ratio, e.rel_mse, ls, color=col, marker="o", ms=3, label=s)
        for r, name in enumerate(["relative variance tr Σ / ||g||²", "relative MSE E||ĝ - g||² / ||g||²"]):
            ax = axes[r][c]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("budget ratio t/k")
            ax.set_title(f"L={L}, k={k}", fontsize=9)
            if c == 0:
                ax.set_ylabel(name)
    _legend(fig, axes[0][0])
    fig.suptitle("Exact variance and mean squared error (mean over seeds)")
    return save_figure(fig, out / "variance_mse_vs_ratio.png")


def convergence_cell(cells: pd.DataFrame) -> tuple[int, int, int, int]:
    """A cell where unbiased and biased schemes both appear: deepest L, largest k, t = L+1."""
    L, k = int(cells.L.max()), int(cells.k.max())
    ts = sorted(cells[(cells.L == L) & (cells.k == k)].t.unique())
    t = min([x for x in ts if L + 1 <= x < k] or ts)
    return L, k, int(t), int(cells.seed.min())


def fig_convergence(conv: pd.DataFrame, cells: pd.DataFrame, out: Path) -> tuple[str, tuple]:
    L, k, t, seed = convergence_cell(cells)
    d = conv[(conv.L == L) & (conv.k == k) & (conv.t == t) & (conv.seed == seed)]
    fig, axes = new_figure(figsize=(7, 4.8))
    ax = axes[0][0]
    for s in scheme_order(cells.scheme):
        e = d[d.scheme == s].sort_values("n")
        if e.empty:
            continue
        col, ls = scheme_style(s)
        ax.loglog(e.n, e.rel_err, ls, color=col, label=s)
        b = float(e.exact_rel_bias.iloc[0])
        if b > UNBIASED_TOL:
            ax.axhline(b, color=col, lw=0.7, ls=":")
    unb = d[d.exact_rel_bias < UNBIASED_TOL]
    if not unb.empty:
        first = unb.groupby("n").rel_err.mean()
        ref = first.iloc[0] * np.sqrt(first.index[0] / first.index.values)
        ax.loglog(first.index, ref, "k--", lw=1, label="1/√N reference")
    ax.set_xlabel("Monte Carlo draws N")
    ax.set_ylabel("||mean of N estimates - g|| / ||g||")
    ax.set_title(f"Convergence to the exact gradient (L={L}, k={k}, t={t}, seed {seed}); dotted: exact bias",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, out / "convergence.png"), (L, k, t, seed)


def fig_weights(cells: pd.DataFrame, out: Path) -> tuple[str, tuple]:
    L, k = int(cells.L.max()), int(cells.k.max())
    ts = [x for x in sorted(cells[(cells.L == L) & (cells.k == k)].t.unique()) if x < k]
    fig, axes = new_figure(1, len(ts), figsize=(3.4 * len(ts), 3.6), sharey=True)
    for ax, t in zip(axes[0], ts):
        d = cells[(cells.L == L) & (cells.k == k) & (cells.t == t) & (cells.seed == cells.seed.min())]
        for s in scheme_order(cells.scheme):
            row = d[d.scheme == s]
            if row.empty:
                continue
            w = [float(row[f"w_p{p}"].iloc[0]) for p in range(L + 1)]
            col, ls = scheme_style(s)
            ax.plot(range(L + 1), w, ls, color=col, marker="o", ms=4, label=s)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_xticks(range(L + 1))
        ax.set_xlabel("hops p")
        ax.set_title(f"k={k}, t={t}", fontsize=9)
    axes[0][0].set_ylabel("effective weight w(p) = W(p) π(p)")
    _legend(fig, axes[0][0])
    fig.suptitle("Expected weight of each hop stratum (1 = unbiased)")
    return save_figure(fig, out / "weights.png"), (L, k)


def fig_cap_tradeoff(cells: pd.DataFrame, out: Path) -> str:
    k = cells.k.max()
    d = cells[(cells.k == k) & (cells.t < k) & cells.scheme.isin(PAPER_FAMILY)]
    d = d.groupby(["L", "t", "scheme"], as_index=False)[["rel_bias", "rel_var", "rel_mse"]].mean()
    Ls = sorted(d.L.unique())
    fig, axes = new_figure(1, len(Ls), figsize=(4.4 * len(Ls), 3.8))
    for ax, L in zip(axes[0], Ls):
        for s in scheme_order(d.scheme):
            e = d[(d.L == L) & (d.scheme == s)].sort_values("t")
            col, ls = scheme_style(s)
            ax.plot(e.rel_var, e.rel_bias, ls, color=col, marker="o", ms=4, label=s)
            if s == PAPER.label:
                for _, r in e.iterrows():
                    ax.annotate(f"t={int(r.t)}", (r.rel_var, r.rel_bias), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("relative variance tr Σ / ||g||²")
        ax.set_title(f"L={L}, k={k}", fontsize=9)
    axes[0][0].set_ylabel("relative bias")
    _legend(fig, axes[0][0])
    fig.suptitle("What the cap trades: bias against variance (paper formula, capped and uncapped)")
    return save_figure(fig, out / "cap_tradeoff.png")
