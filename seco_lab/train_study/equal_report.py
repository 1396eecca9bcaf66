"""The training study at equal compute (issue 22): tables, verdict lines and figures from the stored
extension folders (``OUT/equal_compute``, ``OUT/second_L4``) next to the main study (``OUT``).

Compute of a run = steps x sequences per step x chunk passes per sequence (the cost model of
:mod:`seco_lab.equal_compute`), relative to the main study's SeCO run (S x B x (4k - 1)).  Every
comparison pairs seeds (same initial weights); an arm's numbers are at its tuned rate (lowest mean
validation far-token loss among the rates it ran, as in the main study).

The prediction: each arm's equal-compute best-scale MSE (``probe_ec_mse``: the step's error at its own
sequences and micro-batches, from the probes' exact strata, data noise and sampling noise) averaged
over its trajectory, ranked against its final test far-token loss (Spearman rho; 95% interval by
Fisher's z with the Bonett-Wright standard error sqrt((1 + rho^2 / 2) / (n - 3))), next to the
bias-only ranking (the trajectory-mean per-tensor residual for AdamW, best-scale residual for SGD).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from scipy import stats

from seco_lab.equal_compute import chunk_passes, equal_batches

from ..report.figures import SCHEME_COLOURS
from .figures import save
from .stats import detectable_difference, paired_difference, t_interval
from .summary import select_lr

__all__ = ["EXTENSION_FOLDERS", "equal_compute_sections", "extension_finals", "prediction_table",
           "spearman_interval"]

EXTENSION_FOLDERS = {"equal_compute": "equal_compute", "second": "second_L4"}
BIAS_METRIC = {"adamw": "probe_per_tensor_residual", "sgd": "probe_best_scale_residual"}


def fmt(x, digits: int = 3) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def ci(m, lo, hi, digits: int = 3) -> str:
    return f"{fmt(m, digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]"


def md_table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]


def _load(folder: Path):
    folder = Path(folder)
    if not (folder / "runs.csv").exists():
        return None
    return (pd.read_csv(folder / "results.csv.gz"), pd.read_csv(folder / "runs.csv"),
            json.loads((folder / "study.json").read_text()))


def _arm_fields(name: str) -> dict:
    """mode, scheme, budget, batch and steps override of an arm name ('seco B=10', 'paper t=4 B=25', ...)."""
    parts = name.split(" ")
    out = {"base": " ".join(p for p in parts if not p.startswith(("B=", "steps="))), "batch_size": 0, "steps_o": 0}
    for p in parts:
        if p.startswith("B="):
            out["batch_size"] = int(p[2:])
        if p.startswith("steps="):
            out["steps_o"] = int(p[6:])
    return out


def run_finals(results: pd.DataFrame, runs: pd.DataFrame, settings: dict) -> pd.DataFrame:
    """One row per run: last-step validation and test far-token loss (NaN when diverged), compute."""
    k, B, S = settings["task"]["num_chunks"], settings["batch_size"], settings["steps"]
    runs = runs.copy()
    f = pd.DataFrame([_arm_fields(a) for a in runs.arm])
    runs["base"] = f.base.to_numpy()
    if "steps" not in runs:
        runs["steps"] = S
    if "batch_size" not in runs:
        runs["batch_size"] = B
    runs["steps"] = runs["steps"].fillna(S).astype(int)
    runs["batch_size"] = runs["batch_size"].fillna(B).astype(int)
    passes = [chunk_passes(m, k, b if m == "spaco" else None) for m, b in zip(runs["mode"], runs.budget)]
    runs["rel_compute"] = runs.steps * runs.batch_size * np.asarray(passes) / (S * B * chunk_passes("seco", k))
    if "cpu_s" not in runs:
        runs["cpu_s"] = np.nan
    runs["cpu_ms_per_step"] = runs.cpu_s / runs.steps_done * 1000
    r = results[(results.distance == 0) & results.metric.isin(["val_far_loss", "test_far_loss"])]
    r = r.merge(runs[["run_id", "steps"]], on="run_id")
    last = r[r.step == r.steps].pivot_table(index="run_id", columns="metric", values="value").reset_index()
    out = runs.merge(last, on="run_id", how="left")
    for m in ("val_far_loss", "test_far_loss"):
        if m not in out:
            out[m] = np.nan
        out.loc[out.diverged.astype(bool), m] = np.nan
    return out


def extension_finals(folder: Path, sub: str, main_final: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """Finals of an extension folder; for 'equal_compute' the main study's runs are added (the arms at
    equal steps) and the replays left out (they only carry the probes, see ``prediction_table``)."""
    loaded = _load(Path(folder) / sub)
    if loaded is None:
        return None
    results, runs, study = loaded
    fin = run_finals(results, runs, study["design"]["settings"]).assign(source=sub)
    if main_final is not None:
        fin = pd.concat([main_final.assign(source="main"), fin[~fin.arm.isin(set(main_final.arm))]],
                        ignore_index=True)
    return fin


def tuned(final: pd.DataFrame) -> pd.DataFrame:
    """Runs at each (arm, optimizer)'s tuned rate."""
    sel = select_lr(final.assign(val_far_loss=final.val_far_loss))
    best = sel.loc[sel.best, ["arm", "optimizer", "lr"]]
    return final.merge(best, on=["arm", "optimizer", "lr"])


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
            base = _arm_fields(arm)["base"]
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


def spearman_interval(x, y, level: float = 0.95) -> dict:
    """Spearman rho of (x, y) with Fisher-z interval, Bonett-Wright standard error."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    n = int(ok.sum())
    if n < 4:
        return {"rho": math.nan, "lo": math.nan, "hi": math.nan, "n": n, "p": math.nan}
    rho, p = stats.spearmanr(x[ok], y[ok])
    rho = float(rho)
    z = math.atanh(max(min(rho, 0.999999), -0.999999))
    se = math.sqrt((1 + rho * rho / 2) / (n - 3))
    q = stats.norm.ppf(0.5 + level / 2)
    return {"rho": rho, "lo": math.tanh(z - q * se), "hi": math.tanh(z + q * se), "n": n, "p": float(p)}


def prediction_table(folder: Path, main_best: pd.DataFrame, ec_best: pd.DataFrame) -> pd.DataFrame | None:
    """Per (arm, optimizer) with noise probes: trajectory means of the equal-compute MSE and of the bias, next to
    the outcome (mean test far-token loss at the tuned rate).  Main-study arms use their seed-0 replay."""
    loaded = _load(Path(folder) / "equal_compute")
    if loaded is None:
        return None
    results, runs, _ = loaded
    probes = results[results.metric.isin(["probe_ec_mse", "probe_per_tensor_residual", "probe_best_scale_residual",
                                          "probe_noise_to_signal"])]
    if "probe_ec_mse" not in set(probes.metric):
        return None
    traj = probes.groupby(["run_id", "metric"]).value.mean().unstack("metric").reset_index()
    traj = traj.merge(runs[["run_id", "arm", "optimizer", "lr", "seed"]], on="run_id")
    rows = []
    main_arms = set(main_best.arm)
    for (arm, opt), g in traj.groupby(["arm", "optimizer"], sort=False):
        outcome_src = main_best if arm in main_arms else ec_best
        o = outcome_src[(outcome_src.arm == arm) & (outcome_src.optimizer == opt)]
        if o.empty:
            continue
        g = g[g.lr == float(o.lr.iloc[0])]
        if g.empty:
            continue
        rows.append({"arm": arm, "optimizer": opt, "replay": arm in main_arms, "ec_mse": g.probe_ec_mse.mean(),
                     "bias": g[BIAS_METRIC[opt]].mean(), "noise_to_signal": g.probe_noise_to_signal.mean(),
                     "outcome": float(o.test_far_loss.mean()), "trajectories": len(g)})
    return pd.DataFrame(rows) if rows else None


def replay_check(folder: Path, main_final: pd.DataFrame) -> float:
    """Largest |test far-token loss| difference between a replay and its main-study run (same seed, rate)."""
    loaded = _load(Path(folder) / "equal_compute")
    if loaded is None:
        return math.nan
    results, runs, study = loaded
    fin = run_finals(results, runs, study["design"]["settings"])
    rep = fin[fin.arm.isin(set(main_final.arm))]
    m = rep.merge(main_final, on=["arm", "optimizer", "lr", "seed"], suffixes=("", "_main"))
    return float((m.test_far_loss - m.test_far_loss_main).abs().max()) if len(m) else math.nan


def prediction_plot(pred: pd.DataFrame) -> Figure:
    opts = list(dict.fromkeys(pred.optimizer))
    fig = Figure(figsize=(5.6 * len(opts), 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(opts)))
    for ax, opt in zip(axes, opts):
        d = pred[pred.optimizer == opt]
        ax.scatter(d.ec_mse, d.outcome, c=["0.4" if r else "tab:blue" for r in d.replay], s=25)
        for r in d.itertuples():
            ax.annotate(r.arm, (r.ec_mse, r.outcome), textcoords="offset points", xytext=(4, 2), fontsize=6.5)
        ax.set_xlabel("trajectory-mean equal-compute best-scale MSE (probe)")
        ax.set_title(f"prediction vs outcome: {opt} (grey: seed-0 replays of main arms)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test far-token loss (tuned rate, mean over seeds)")
    return fig


def _status_line(folder: Path, sub: str) -> str:
    p = Path(folder) / sub / "study.json"
    if not p.exists():
        return f"`{sub}`: not run."
    s = json.loads(p.read_text())
    return (f"`{sub}`: {s.get('runs_done')} of {s.get('runs_total')} runs ({s.get('status')}), wall time "
            f"{fmt(s.get('study_wall_s', math.nan) / 60, 1)} min over {len(s.get('sessions', []))} sessions, "
            f"{s.get('jobs')} worker processes; sum of per-run CPU time "
            f"{fmt(_cpu_total(Path(folder) / sub) / 60, 1)} min.")


def _cpu_total(folder: Path) -> float:
    runs = pd.read_csv(folder / "runs.csv") if (folder / "runs.csv").exists() else None
    return float(runs.cpu_s.sum()) if runs is not None and "cpu_s" in runs else math.nan


def costs_lines(folder: Path, k: int) -> list[str]:
    """The cost model against measured CPU time (costs.csv)."""
    path = Path(folder) / "equal_compute" / "costs.csv"
    if not path.exists():
        return []
    c = pd.read_csv(path)
    ref = c[c.arm == "seco"].set_index("batch")
    rows = []
    for arm, g in c.groupby("arm", sort=False):
        g = g.set_index("batch")
        b = 16 if 16 in g.index else g.index[len(g) // 2]
        model = g.passes.loc[b] / ref.passes.loc[b]
        rows.append([arm, fmt(model, 3), fmt(g.cpu_s.loc[b] / ref.cpu_s.loc[b], 3),
                     fmt(g.cpu_s_per_seq.iloc[0] / ref.cpu_s_per_seq.iloc[0], 3),
                     fmt(1000 * g.cpu_s.loc[b], 1), fmt(1000 * g.cpu_s_fixed.iloc[0], 1)])
    return (["**The cost model against measured CPU time** (`costs.csv`: one process, one thread, CPU time of one "
             f"gradient step at initialisation, median of {int(c.reps.iloc[0])} interleaved repetitions, B ∈ "
             + "{" + ", ".join(str(int(b)) for b in sorted(c.batch.unique())) + "}"
             + "; a line cpu = fixed + per-sequence × B fitted per arm). Ratios to SeCO:", ""]
            + md_table(["arm", "cost model (passes)", "measured CPU at B = 16", "measured CPU per extra sequence",
                        "ms per step at B = 16", "fixed ms per step"], rows)
            + ["On this toy model a step's CPU time is mostly fixed overhead (Python, kernel launches on 8-token "
               "chunks), which a real model does not have, so compute here is the cost model (chunk passes, a "
               "backward = 2 forwards), which the FLOPs of a real model follow; the table shows how far the toy's "
               "CPU time agrees. Schemes with a hop-dependent relay (`falling-factorial`, `bernoulli`, "
               "`released-unbiased` at some t) keep one relay buffer per hop count and cost more than the model "
               "says; that extra is not charged to them here.", ""])


def equal_compute_sections(folder: Path, main_final: pd.DataFrame, main_tabs: dict, study: dict, out_md: Path,
                           fig_dir: Path) -> list[str]:
    """The report's sections of issue 22 (empty when no extension folder exists)."""
    folder = Path(folder)
    settings = study["design"]["settings"]
    k, B = settings["task"]["num_chunks"], settings["batch_size"]
    budgets = study["design"]["budgets"]
    chance = math.log((settings["task"]["vocab_size"] - 1) // 4)
    main_fin = run_finals_from_main(main_final, settings)
    ec = extension_finals(folder, "equal_compute", main_fin)
    if ec is None:
        return []

    def rel(path: Path) -> str:
        return Path(path).resolve().relative_to(Path(out_md).resolve().parent).as_posix()

    ec_best = tuned(ec)
    lines = ["## At equal compute", "",
             "SpaCO exists to save compute, so the user's question is what to do with a fixed budget: SpaCO (which "
             "scheme, which t), SeCO on fewer sequences or steps, or cutting the gradient at every cache. "
             "Compute of a run = steps × sequences per step × chunk passes per sequence (SeCO "
             f"{chunk_passes('seco', k):g}, SpaCO k + 3t = "
             + ", ".join(f"{chunk_passes('spaco', k, t):g} at t = {t}" for t in budgets)
             + f", truncated {chunk_passes('truncated', k):g}; `seco_lab.equal_compute`), relative to SeCO's run "
             f"({settings['steps']} steps × {B} sequences). Arms:", "",
             "- **SeCO at SpaCO's compute** on fewer sequences per step, B₀ = round(B c_t / c₀) (the primary choice: "
             "the same steps and schedule, so only the gradient's quality changes, and the case the equal-compute "
             "MSE describes); with fewer steps (same schedule shape) where `seco steps=…` rows appear;",
             "- **SpaCO at SeCO's compute** on B_t = round(B c₀ / c_t) sequences per step, in micro-batches of "
             f"{settings['micro_batch']} with one draw each (gradient accumulation, as the trainer does), for the "
             "best and the worst scheme of the main study at each budget and optimizer;",
             "- **truncated**: every chunk backpropagated with the cache detached (g(0) only, "
             "`seco_lab.truncated_grad`), B sequences.", "",
             "Learning rates: each new arm ran at the main study's tuned rate of the same method (SeCO's for SeCO "
             "variants and truncated) and, where the `lr-neighbours` tier ran, also at the neighbouring grid rate in "
             "the direction its batch moved; the tuned rate is chosen on validation as before. Δ: paired by seed "
             "against the level's SeCO arm, 95% t-interval; MDE as in the main study; learned: test far-token loss "
             "< ln K / 2.", ""]
    figs = {}
    for opt in dict.fromkeys(ec_best.optimizer):
        lines += [f"### {opt}", ""]
        summaries = []
        for lv in levels(ec_best[ec_best.optimizer == opt], budgets, k, B):
            rows, line, summ = verdict(ec_best, lv, opt, chance)
            if not rows:
                continue
            summaries.append((lv, summ))
            lines += [f"**{lv['name']}** — {line}", ""] + md_table(
                ["arm", "compute", "B", "steps", "lr", "far-token loss", "Δ vs reference", "MDE", "learned",
                 "CPU ms/step"], rows)
        sentence = action_sentence(opt, summaries)
        if sentence:
            lines += [sentence, ""]
    figs["equal_compute.png"] = save(compute_plot(ec_best, f"k = {k}, L = {settings['model']['n_layers']}"),
                                     fig_dir / "equal_compute.png")
    lines += ["Final test far-token loss against compute per arm (tuned rate; mean and 95% t-interval over seeds; "
              "filled: the study's batch, hollow: a changed batch; squares: SeCO with fewer steps):", "",
              f"![equal compute]({rel(figs['equal_compute.png'])})", ""]
    lines += costs_lines(folder, k)
    lines += second_section(folder, chance, fig_dir, rel)
    lines += prediction_section(folder, main_fin, main_tabs, ec_best, fig_dir, rel)
    lines += what_ran(folder, study)
    return lines


def what_ran(folder: Path, study: dict) -> list[str]:
    """Every tier of the extension plan with its finished runs, the folders' wall and CPU time, how to resume."""
    from .extensions import extension_plan
    from .study import StudyConfig

    lines = ["### What ran", "",
             "Issue 22's runs go in tiers, in priority order (`seco_lab.train_study.extensions.extension_plan`); "
             "every tier is resumable and the report uses whatever finished.", ""]
    try:
        main = StudyConfig()
        if main.fingerprint() != study.get("fingerprint"):
            raise ValueError("not the default study")
        plan = extension_plan(main, folder)
    except (ValueError, KeyError, FileNotFoundError):
        plan = []
    rows, finished = [], {}
    for tier, sub, cfg in plan:
        if sub not in finished:  # the assembled table (the per-run files are not committed)
            table = Path(folder) / sub / "runs.csv"
            finished[sub] = set(pd.read_csv(table).run_id) if table.exists() else set()
        specs = cfg.runs()
        done = sum(s.run_id in finished[sub] for s in specs)
        arms = ", ".join(dict.fromkeys(f"{a.name} ({o})" for a, o, _, _ in cfg.cells))
        rows.append([tier, sub, f"{done}/{len(specs)}", arms])
    if rows:
        lines += md_table(["tier", "folder", "runs done", "cells"], rows)
    lines += [" ".join(_status_line(folder, s) for s in EXTENSION_FOLDERS.values()), "",
              "Resume (skips every finished run): `seco-lab study train --part extensions --jobs 2` "
              "(or `make train-study`, which also checks the main study), then `seco-lab report train`.", ""]
    return lines


def run_finals_from_main(main_final: pd.DataFrame, settings: dict) -> pd.DataFrame:
    """The main study's ``final`` table with the compute columns of ``run_finals``."""
    k = settings["task"]["num_chunks"]
    f = main_final.copy()
    f["steps"], f["batch_size"] = settings["steps"], settings["batch_size"]
    f["base"] = f.arm
    passes = [chunk_passes(m, k, b if m == "spaco" else None) for m, b in zip(f["mode"], f.budget)]
    f["rel_compute"] = np.asarray(passes) / chunk_passes("seco", k)
    f["cpu_ms_per_step"] = np.nan
    return f


def second_section(folder: Path, chance: float, fig_dir: Path, rel) -> list[str]:
    sub = Path(folder) / "second_L4"
    loaded = _load(sub)
    if loaded is None:
        return []
    results, runs, study = loaded
    s = study["design"]["settings"]
    k, B = s["task"]["num_chunks"], s["batch_size"]
    fin = run_finals(results, runs, s)
    best = tuned(fin)
    budgets = study["design"]["budgets"]
    lines = [f"## A second configuration: L = {s['model']['n_layers']} layers", "",
             f"The same task (k = {k} chunks) with a {s['model']['n_layers']}-layer model, so chains cross up to "
             f"{min(s['model']['n_layers'], k - 1)} caches and the 2-hop and deeper strata carry gradient. At t = "
             f"{max(budgets)} (t/k = {max(budgets) / k:g}): SeCO, the main study's best and worst scheme at equal "
             "steps, SeCO at the best scheme's compute (fewer sequences) and the best scheme at SeCO's (more "
             "sequences). Learning rates: the main study's tuned rate of the same method (not re-tuned: compute); "
             f"{len(set(fin.seed))} seeds.", ""]
    for opt in dict.fromkeys(best.optimizer):
        lines += [f"### {opt}, L = {s['model']['n_layers']}", ""]
        steps_lv = {"name": "equal steps", "budget": max(budgets), "ref": "seco",
                    "arms": ["seco"] + [a for a in dict.fromkeys(best.arm) if a.endswith(f" t={max(budgets)}")],
                    "spaco": [a for a in dict.fromkeys(best.arm) if a.endswith(f" t={max(budgets)}")]}
        for lv in [steps_lv] + levels(best[best.optimizer == opt], budgets, k, B):
            rows, line, _ = verdict(best, lv, opt, chance)
            if rows:
                lines += [f"**{lv['name']}** — {line}", ""] + md_table(
                    ["arm", "compute", "B", "steps", "lr", "far-token loss", "Δ vs reference", "MDE", "learned",
                     "CPU ms/step"], rows)
    path = save(compute_plot(best, f"k = {k}, L = {s['model']['n_layers']}"), fig_dir / "equal_compute_L4.png")
    lines += [f"![equal compute, L = 4]({rel(path)})", ""]
    return lines


def prediction_section(folder: Path, main_fin: pd.DataFrame, main_tabs: dict, ec_best: pd.DataFrame, fig_dir: Path,
                       rel) -> list[str]:
    main_best = tuned(main_fin)
    pred = prediction_table(folder, main_best, ec_best)
    if pred is None:
        return []
    lines = ["## The prediction, tested", "",
             "docs/estimators.md §4c's equal-compute best-scale MSE, 1 − ⟨m, g⟩² / (‖g‖² (‖m‖² + tr Var G)), with "
             "tr Var G = tr Cov_i(m_i)/B + Σ_r (n_r A + n_r (n_r − 1) C)/B² for micro-batches of n_r sequences "
             "sharing a draw (`seco_lab.equal_compute.step_variance`), evaluated at every probe of each arm's "
             "trajectory at its own sequences per step: the probe batch (16 held-out sequences) in 4 groups of 4 "
             "gives unbiased cross-group estimates of ‖g‖², ⟨m, g⟩, ‖m‖² and the data noise; 4 draws of the arm's "
             "sampler over every group give the sampling noise A of one sequence and the covariance C of two that "
             "share a draw. Main-study arms: their seed-0 run replayed with these probes (same seed, same draws); "
             "new arms: every seed at the tuned rate. Outcome: test far-token loss at the tuned rate, mean over "
             "seeds. Spearman ρ with a 95% Fisher-z interval (Bonett–Wright standard error), next to the bias-only "
             "ranking (trajectory-mean per-tensor residual for AdamW, best-scale residual for SGD) on the same arms.",
             ""]
    rows = []
    for opt, d in pred.groupby("optimizer", sort=False):
        e = spearman_interval(d.ec_mse, d.outcome)
        b = spearman_interval(d.bias, d.outcome)
        rows.append([opt, e["n"], ci(e["rho"], e["lo"], e["hi"], 2), ci(b["rho"], b["lo"], b["hi"], 2)])
    lines += md_table(["optimizer", "arms", "ρ (equal-compute MSE, outcome)", "ρ (bias only, outcome)"], rows)
    if max(r[1] for r in rows) < 4:
        lines += ["**Too few arms carry the probes for a rank correlation** (at least 4 per optimizer are needed; the "
                  "replays of the main-study arms are in the tiers below that did not run): the per-arm numbers "
                  "below are all there is, and no conclusion is drawn.", ""]
    gap = replay_check(folder, main_fin)
    lines += [f"The study's bias-only correlation over its SpaCO arms at equal steps is in the Verdict above. "
              f"Replays against their main-study runs: largest |Δ test far-token loss| = {fmt(gap, 6)}.", ""]
    tab = [[r.arm, r.optimizer, fmt(r.ec_mse, 4), fmt(r.noise_to_signal, 3), fmt(r.bias, 3), fmt(r.outcome),
            "replay" if r.replay else f"{r.trajectories} runs"] for r in pred.itertuples()]
    lines += ["<details><summary>Per arm</summary>", ""] + md_table(
        ["arm", "optimizer", "equal-compute MSE", "noise-to-signal", "bias metric", "far-token loss", "trajectories"],
        tab) + ["</details>", ""]
    path = save(prediction_plot(pred), fig_dir / "prediction.png")
    lines += [f"![prediction]({rel(path)})", ""]
    return lines
