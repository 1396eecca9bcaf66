"""The bias report's figures, drawn from the study's cell table (one row per L, k, t, seed, scheme)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..studies.bias.definition import PAPER, SCHEMES
from .bias_summary import UNBIASED_TOL
from .figures import new_figure, save_figure, scheme_marker, scheme_offset, scheme_order, scheme_style

__all__ = [
    "fig_bias_vs_ratio", "fig_cap_tradeoff", "fig_convergence", "fig_paper_settings", "fig_variance_mse",
    "fig_weights",
]

PAPER_FAMILY = tuple(v.label for v in SCHEMES if v.name.startswith(PAPER.name))


def _legend(fig, ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=8)


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
                ax.plot(d.ratio * scheme_offset(s), d.rel_bias, ls, color=col, marker=scheme_marker(s), ms=4,
                        mfc="none", label=s)
            ax.axvline((L + 1) / k, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_title(f"L={L} layers, k={k} chunks", fontsize=9)
            ax.set_xlabel("budget ratio t/k (dotted: t = L+1)")
            if c == 0:
                ax.set_ylabel("exact relative bias ||E ĝ - g|| / ||g||")
    _legend(fig, axes[0][0])
    fig.suptitle("Exact relative bias of each compensation scheme (mean over seeds; points offset sideways so "
                 "coinciding curves stay visible)", fontsize=10)
    return save_figure(fig, out / "bias_vs_ratio.png")


def fig_variance_mse(cells: pd.DataFrame, out: Path) -> str:
    k = cells.k.max()
    Ls = sorted(cells.L.unique())
    rows = {"rel_var": "relative variance tr Σ / ||g||²", "rel_mse": "relative MSE E||ĝ - g||² / ||g||²",
            "noise_to_signal": "noise-to-signal tr Σ / ||E ĝ||²",
            "best_scale_mse": "best-scale MSE min_a E||aĝ - g||² / ||g||²"}
    # a study stored before the matched-scale metrics (format < 4) has none: those rows are left out
    rows = {m: name for m, name in rows.items() if m in cells and cells[m].notna().any()}
    fig, axes = new_figure(len(rows), len(Ls), figsize=(4.2 * len(Ls), 3.2 * len(rows)), sharey="row")
    d = cells[(cells.k == k) & (cells.t < k)].groupby(["L", "ratio", "scheme"], as_index=False)[list(rows)].mean()
    for c, L in enumerate(Ls):
        for s in scheme_order(cells.scheme):
            e = d[(d.L == L) & (d.scheme == s)].sort_values("ratio")
            col, ls = scheme_style(s)
            x, mk = e.ratio * scheme_offset(s), scheme_marker(s)
            for r, metric in enumerate(rows):
                y = e[metric].where(e[metric] > 0)  # exact zeros (t = k) leave the log axis
                axes[r][c].plot(x, y, ls, color=col, marker=mk, ms=4, mfc="none", label=s)
        for r, (metric, name) in enumerate(rows.items()):
            ax = axes[r][c]
            ax.set_xscale("log", base=2)
            if (d[metric] > 0).any():  # (a study stored before a metric existed has none of it)
                ax.set_yscale("log")
            ax.set_xlabel("budget ratio t/k")
            ax.set_title(f"L={L}, k={k}", fontsize=9)
            if c == 0:
                ax.set_ylabel(name)
    _legend(fig, axes[0][0])
    fig.suptitle("Exact variance and mean squared error, raw and at matched scale (mean over seeds)")
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
        ax.loglog(e.n, e.rel_err, ls, color=col, marker=scheme_marker(s), ms=3, mfc="none", markevery=4, label=s)
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
    """w(p) per hop count on a log axis; a weight of exactly 0 (the chain cannot survive or is cut) is drawn
    as a hollow triangle on the separate "0" row below the axis break, never joined to the curve by a slope."""
    L, k = int(cells.L.max()), int(cells.k.max())
    ts = [x for x in sorted(cells[(cells.L == L) & (cells.k == k)].t.unique()) if x < k]
    d0 = cells[(cells.L == L) & (cells.k == k) & (cells.seed == cells.seed.min())]
    w_all = np.concatenate([d0[f"w_p{p}"].to_numpy(float) for p in range(L + 1)])
    positive = w_all[w_all > 0]
    floor = 10 ** np.floor(np.log10(positive.min())) / 10 if len(positive) else 1e-3  # the "0" row
    fig, axes = new_figure(1, len(ts), figsize=(3.4 * len(ts), 3.8), sharey=True)
    labels = scheme_order(cells.scheme)
    for ax, t in zip(axes[0], ts):
        d = d0[d0.t == t]
        for i, s in enumerate(labels):
            row = d[d.scheme == s]
            if row.empty:
                continue
            w = np.array([float(row[f"w_p{p}"].iloc[0]) for p in range(L + 1)])
            x = np.arange(L + 1) + 0.05 * (i - (len(labels) - 1) / 2)  # side by side where curves coincide
            col, ls = scheme_style(s)
            ax.plot(x, np.where(w > 0, w, np.nan), ls, color=col, marker=scheme_marker(s), ms=5, mfc="none", label=s)
            zero = w == 0
            ax.plot(x[zero], np.full(zero.sum(), floor), "v", color=col, ms=5, mfc="none")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(floor * 1.8, color="gray", lw=0.6, ls=(0, (2, 2)))
        ax.set_yscale("log")
        ax.set_ylim(floor / 1.6, None)
        ax.set_xticks(range(L + 1))
        ax.set_xlabel("hops p")
        ax.set_title(f"k={k}, t={t}", fontsize=9)
    ticks = [x for x in axes[0][0].get_yticks() if x > floor * 2]
    axes[0][0].set_yticks([floor, *ticks], ["0", *[f"{x:g}" for x in ticks]])
    axes[0][0].set_ylim(floor / 1.6, None)
    axes[0][0].set_ylabel("effective weight w(p) = W(p) π(p)")
    _legend(fig, axes[0][0])
    fig.suptitle("Expected weight of each hop stratum (1 = unbiased)\nhollow triangles on the bottom row: w(p) = 0 "
                 "exactly (below the dotted break)", fontsize=9)
    return save_figure(fig, out / "weights.png"), (L, k)


def fig_cap_tradeoff(cells: pd.DataFrame, out: Path) -> str:
    """Bias against variance of the paper family; every point labelled by its t in its curve's colour."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    k = cells.k.max()
    d = cells[(cells.k == k) & (cells.t < k) & cells.scheme.isin(PAPER_FAMILY)]
    d = d.groupby(["L", "t", "scheme"], as_index=False)[["rel_bias", "rel_var", "rel_mse"]].mean()
    Ls = sorted(d.L.unique())
    fig, axes = new_figure(1, len(Ls), figsize=(4.8 * len(Ls), 4.2))
    labels = scheme_order(d.scheme)
    for ax, L in zip(axes[0], Ls):
        for i, s in enumerate(labels):
            e = d[(d.L == L) & (d.scheme == s)].sort_values("t")
            col, ls = scheme_style(s)
            ax.plot(e.rel_var * scheme_offset(s, 0.1), e.rel_bias, ls, color=col, marker=scheme_marker(s), ms=5,
                    mfc="none", label=s)
            for _, r in e.iterrows():
                ax.annotate(f"t={int(r.t)}", (r.rel_var * scheme_offset(s, 0.1), r.rel_bias), fontsize=6, color=col,
                            xytext=(4, -3 + 7 * (i - (len(labels) - 1) / 2)), textcoords="offset points")
        ax.set_xscale("log")
        # ticks at 1, 2, 5 x 10^n, printed short and tilted so they never collide; no minor labels
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=8))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.2g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.set_xlabel("relative variance tr Σ / ||g||²")
        ax.set_title(f"L={L}, k={k}", fontsize=9)
    axes[0][0].set_ylabel("relative bias")
    _legend(fig, axes[0][0])
    fig.suptitle("What the cap trades: bias against variance (paper formula, capped and uncapped; where the cap does "
                 "not bind the curves coincide and are offset sideways)", fontsize=9)
    return save_figure(fig, out / "cap_tradeoff.png")


PAPER_PANELS = {"rel_bias": "relative bias", "best_scale_residual": "best-scale residual",
                "per_tensor_residual": "per-tensor residual", "mc_rel_var": "variance tr Σ/||g||² (MC)",
                "noise_to_signal": "noise-to-signal tr Σ/||E ĝ||²", "best_scale_mse": "best-scale MSE"}


def fig_paper_settings(mean: pd.DataFrame, num_chunks: int, out: Path) -> str:
    """Every scheme's exact bias and residuals and Monte Carlo variance against t at k = ``num_chunks``,
    one row per depth L (points offset sideways so coinciding schemes stay visible)."""
    d = mean[mean.k == num_chunks]
    Ls = sorted(d.L.unique())
    fig, axes = new_figure(len(Ls), len(PAPER_PANELS), figsize=(3.6 * len(PAPER_PANELS), 3.1 * len(Ls)))
    for r, L in enumerate(Ls):
        for c, (metric, name) in enumerate(PAPER_PANELS.items()):
            ax = axes[r][c]
            for s in scheme_order(d.scheme):
                e = d[(d.L == L) & (d.scheme == s)].sort_values("t")
                col, ls = scheme_style(s)
                y = e[metric].where(e[metric] > 0)  # exact zeros (unbiased) leave the log axis
                ax.plot(e.t * scheme_offset(s), y, ls, color=col, marker=scheme_marker(s), ms=5, mfc="none", label=s)
            ax.set_xscale("log", base=2)
            if (d[d.L == L][metric] > 0).any():
                ax.set_yscale("log")
            ax.set_xticks(sorted(d.t.unique()), [str(int(t)) for t in sorted(d.t.unique())])
            ax.set_xlabel("budget t (chunks backpropagated)")
            ax.set_title(f"{name}, L={L}, k={num_chunks}", fontsize=9)
    _legend(fig, axes[0][0])
    fig.suptitle(f"At the paper's settings (k = {num_chunks}); unbiased schemes have no bias point (exactly 0)",
                 fontsize=10)
    return save_figure(fig, out / "paper_settings.png")
