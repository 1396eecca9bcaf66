"""The training study's report: ``summarize`` (tables, pure) and ``render`` (Markdown + figures).

    seco-lab report train [--results reports/training_study] [--out reports/training_study.md]

Everything in the report is computed from ``results.csv.gz``, ``runs.csv`` and ``study.json``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from seco_lab import get_scheme

from ..report.markdown import MissingResultsError, read_json_table, read_results_csv, require, write_markdown
from . import figures
from .equal_report import equal_compute_sections
from .stats import paired_difference
from .summary import at_best, summarize

__all__ = ["load", "render", "summarize", "training_study_report"]

BIASED = ("paper", "paper-capped", "released", "released-unbiased")


PRODUCE_TRAIN = "`make train-study` (`seco-lab study train`)"
RESULT_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "step", "metric", "distance", "value")
FINAL_METRICS = ("train_loss", "val_loss", "val_far_loss", "test_loss", "test_far_loss")  # every run, last step
RUN_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "steps_done")  # runs.csv has these and more


def load(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The stored study, refused unless readable and consistent: ``study.json`` is a JSON object, both
    tables parse with their columns, hold finite numbers (NaN only for a diverged run, or a far-token loss
    at a distance with no target), no repeated rows, one ``runs.csv`` row per run ``study.json`` counts,
    the same runs in both tables, and every run has every measurement of its arm's other runs."""
    folder = Path(folder)
    require(folder, ("results.csv.gz", "runs.csv", "study.json"), PRODUCE_TRAIN)
    study = read_json_table(folder / "study.json", PRODUCE_TRAIN)
    runs = read_results_csv(folder / "runs.csv", RUN_COLUMNS, PRODUCE_TRAIN,
                            text_columns=("run_id", "arm", "optimizer"), key=("run_id",), more_columns=True)
    done = study.get("runs_done", study.get("runs_total"))
    if isinstance(done, int) and len(runs) != done:
        raise MissingResultsError(f"{folder}/runs.csv has {len(runs)} runs, but study.json records {done}: the table "
                                  f"is incomplete or mixed; rerun {PRODUCE_TRAIN} (or with --collect)")
    diverged = set(runs.run_id[runs["diverged"].astype(str) == "True"]) if "diverged" in runs else set()

    def unusable(d):  # rows whose NaN or inf is a measurement, not damage
        return d.run_id.isin(diverged) | d.metric.str.endswith("far_loss")

    results = read_results_csv(folder / "results.csv.gz", RESULT_COLUMNS, PRODUCE_TRAIN,
                               text_columns=("run_id", "arm", "optimizer", "metric"), nan_allowed=unusable,
                               inf_allowed=lambda d: d.run_id.isin(diverged),
                               key=("run_id", "step", "metric", "distance"))
    for missing, where in ((set(runs.run_id) - set(results.run_id), "results.csv.gz"),
                           (set(results.run_id) - set(runs.run_id), "runs.csv")):
        if missing:
            raise MissingResultsError(f"{folder}/{where} lacks {len(missing)} run(s) the other table holds (e.g. "
                                      f"{sorted(missing)[0]}): the results are incomplete or mixed; rerun "
                                      f"{PRODUCE_TRAIN}")
    keys = results[~results.run_id.isin(diverged)].groupby("run_id")[["step", "metric", "distance"]]
    have = {run: set(map(tuple, rows.itertuples(index=False))) for run, rows in keys}
    last = dict(zip(runs.run_id, runs.steps_done.astype(int)))
    for run, got in sorted(have.items()):  # what the tables of the report are made of: the last step's losses
        lacking = [m for m in FINAL_METRICS if (last[run], m, 0) not in got]
        if lacking:
            raise MissingResultsError(f"{folder}/results.csv.gz lacks {', '.join(lacking)} of run {run} at its last "
                                      f"step {last[run]}: the table is incomplete; rerun {PRODUCE_TRAIN}")
    arm_of = dict(zip(runs.run_id, runs.arm))
    for arm in sorted(set(arm_of.values())):
        sets = {run: have[run] for run in have if arm_of.get(run) == arm}
        union = set().union(*sets.values())
        for run, got in sorted(sets.items()):
            if got != union:
                step, metric, distance = sorted(union - got)[0]
                raise MissingResultsError(f"{folder}/results.csv.gz lacks {len(union - got)} measurement(s) of run "
                                          f"{run} (e.g. {metric} at step {step}, distance {distance}) that the arm's "
                                          f"other runs have: the table is incomplete; rerun {PRODUCE_TRAIN}")
    return results, runs, study


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}"


def ci(mean, lo, hi, digits: int = 3) -> str:
    return f"{fmt(mean, digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]"


def md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]


def paired_arms(final: pd.DataFrame, sel: pd.DataFrame, a: str, b: str, opt: str, metric: str) -> dict:
    """Paired difference a - b of ``metric`` at each arm's tuned rate, same seeds."""
    best = at_best(final, sel)
    x = best[(best.arm == a) & (best.optimizer == opt)].set_index("seed")[metric]
    y = best[(best.arm == b) & (best.optimizer == opt)].set_index("seed")[metric]
    seeds = x.index.intersection(y.index)
    return paired_difference(x.loc[seeds].to_numpy(), y.loc[seeds].to_numpy())


def task_line(task: dict) -> str:
    k, c = task["num_chunks"], task["chunk_size"]
    K = (task["vocab_size"] - 1) // 4
    head = (f"- **Task**: associative recall, {k} chunks of {c} tokens (n = {k * c}), vocabulary "
            f"{task['vocab_size']} (K = {K} keys and values, chance far-token loss ln K = {math.log(K):.3f}), "
            f"{task['filler']} filler. ")
    if task["layout"] == "anchored":
        body = (f"Chunk 0 opens with {task['pairs']} key→value pairs; the query (0, key, value) of pair r opens "
                f"chunk d_r, d ∈ {tuple(task['distances'])}: one far target per distance and sequence. ")
    else:
        body = (f"{task['pairs']} pairs, pair r at a random offset in the chunk d_r before the last chunk, d_r "
                f"drawn from {tuple(task['distances'])}; the last chunk queries every key. ")
    return head + body + ("Far targets = the queried values; their loss can fall below ln K only through a "
                          "chain with at least one hop (a pair's chunk and its query's chunk both backpropagated).")


def settings_section(study: dict) -> list[str]:
    d = study["design"]
    s, task = d["settings"], d["settings"]["task"]
    k = task["num_chunks"]
    out = ["## Settings", "",
           task_line(task),
           f"- **Model**: TinyTransformer {s['model']}, float32, fresh weights from the run's seed.",
           f"- **Training**: {s['steps']} optimizer steps, batch {s['batch_size']} sequences (batch `step` of the "
           f"train split of the run's seed: every arm sees the same token stream), SpaCO draws one chunk set per "
           f"micro-batch of {s['micro_batch']} (draws seeded by (seed, step, micro-batch): arms with the same "
           f"sampler and budget share their draws); linear warm-up {s['warmup']} steps then cosine decay to "
           f"{s['min_lr_ratio']}×peak; " + (f"gradient-norm clipping at {s['clip']} (as common fine-tuning recipes "
           "do; it bounds every step, so instability shows as noise and slow learning rather than overflow)."
           if s.get("clip") else "no gradient clipping."),
           f"- **Optimizers**: AdamW (β = (0.9, 0.999), weight decay {s['weight_decay']}) and SGD with momentum "
           f"{s['momentum']}. Peak learning-rate grid: " + "; ".join(f"{o}: {', '.join(f'{x:g}' for x in g)}"
                                                                     for o, g in d["lrs"].items()) + ".",
           f"- **Seeds**: {d['seeds']} (model initialisation, data order and draws).",
           f"- **Selection**: per arm and optimizer the rate with the lowest mean validation far-token loss "
           f"({s['val_sequences']} held-out sequences, last step; rates where a seed diverged rank last); test "
           f"numbers ({s['test_sequences']} other held-out sequences) at that rate. Paired comparisons: same seed, "
           "SeCO at its own tuned rate.",
           f"- **Probes**: every {s['probe_every']} steps, on a fixed batch of {s['probe_sequences']} held-out "
           "sequences at the run's current parameters, the hop strata g(p) (p ≤ L) give the arm's exact expected "
           "gradient E ĝ = Σ_p w(p) g(p); reported: cos(E ĝ, g), relative bias ‖E ĝ − g‖/‖g‖, best-scale residual "
           "(SGD-relevant) and per-tensor residual (Adam-relevant), docs/estimators.md §4.", "",
           "Arms (w(p): expected weight of the p-hop stratum; 1-hop survival: probability that a pair's chain "
           "is drawn):", ""]
    L = s["model"]["n_layers"]
    rows = []
    for a in d["arms"]:
        if a["mode"] != "spaco":
            rows.append([a["name"], "exact", "–", *["1"] * (L + 1), "1"])
            continue
        sch, t = get_scheme(a["scheme"]), a["budget"]
        P = min(t - 1, L) if sch.sampler.kind == "uniform" else L
        f = sch.factors(k, t, P)
        w = sch.expected_weights(k, t, L)
        rows.append([a["name"], sch.sampler.kind, ", ".join(fmt(x, 2) for x in f), *[fmt(x) for x in w],
                     fmt(float(sch.sampler.inclusion(k, t, 2)))])
    out += md_table(["arm", "sampler", "c_0, c_1, …", *[f"w({p})" for p in range(L + 1)], "1-hop survival"], rows)
    if min(d["budgets"]) > 1:
        out += [f"Why not t/k = 1/{k}: at t = 1 no chain with a hop survives a draw without replacement, so every "
                "uniform scheme degenerates to a rescaled direct-term-only gradient (`paper` ≡ `paper-capped`, "
                "`released` ≡ `released-unbiased` ≡ `falling-factorial`) and cannot learn the task at all; the "
                "smallest budget here is the smallest one at which the schemes differ.", ""]
    if task["layout"] == "anchored":
        out += ["Why this layout: the study needs a task the exact gradient learns well inside the step budget, "
                "so that a scheme that learns late or not at all shows up as a gap. A content-based variant "
                "(`layout='random'`: pairs at random offsets, shuffled queries) was not learned by the exact "
                "gradient within a few hundred steps in pilot runs, which would leave every arm at ln K and the "
                "study without power (the failure of the earlier `train-compare` experiment).", ""]
    skipped = [t for t in d["budgets"] if k / t <= 2]
    if skipped:
        out += [f"`paper-capped` (C = 2) is not run at t = {', '.join(map(str, skipped))}: k/t ≤ C there, the cap "
                "never binds and the arm is `paper`, draw for draw.", ""]
    return out


def results_section(tabs: dict, study: dict) -> list[str]:
    tab = tabs["table"]
    s = study["design"]["settings"]
    out = ["## Final metrics (test set, tuned learning rate)", "",
           f"Mean over seeds with 95% t-interval; Δ vs SeCO: paired difference (same seed), 95% t-interval; "
           "learned: seeds whose far-token loss ended below ln K / 2. "
           f"Backpropagated chunks per sequence and step; wall: median seconds per run of {s['steps']} steps "
           "(training steps only, 2 runs in parallel on the shared CPUs).", ""]
    for opt, g in tab.groupby("optimizer", sort=False):
        rows = [[r.arm, f"{r.lr:g}", ci(r.test_far_loss, r.test_far_loss_lo, r.test_far_loss_hi),
                 ci(r.test_far_loss_vs_seco, r.test_far_loss_vs_seco_lo, r.test_far_loss_vs_seco_hi),
                 ci(r.test_loss, r.test_loss_lo, r.test_loss_hi),
                 ci(r.test_loss_vs_seco, r.test_loss_vs_seco_lo, r.test_loss_vs_seco_hi, 4),
                 f"{r.learned}/{r.seeds}", f"{r.diverged}/{r.seeds}", fmt(r.backprop_chunks_per_step, 2),
                 fmt(r.wall_s, 1)] for r in g.itertuples()]
        out += [f"### {opt}", ""] + md_table(
            ["arm", "lr", "far-token loss", "Δ far vs SeCO", "held-out loss", "Δ loss vs SeCO", "learned",
             "diverged", "chunks/step", "wall s"], rows)
    bd = tabs["by_distance"]
    out += ["### Far-token loss by distance (test, tuned rate)", ""]
    dists = sorted(bd.distance.unique())
    rows = []
    for (arm, opt), g in bd.groupby(["arm", "optimizer"], sort=False):
        g = g.set_index("distance")
        rows.append([opt, arm] + [ci(g.loc[d, "mean"], g.loc[d, "lo"], g.loc[d, "hi"], 2) for d in dists])
    out += md_table(["optimizer", "arm"] + [f"d = {d}" for d in dists], rows)
    return out


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


def compute_section(final: pd.DataFrame, study: dict) -> list[str]:
    steps = study["design"]["settings"]["steps"]
    wall = study.get("study_wall_s")
    status = study.get("status", "?")
    out = ["## Compute (matched steps and tokens)", "",
           f"Every arm: {steps} optimizer steps × {study['design']['settings']['batch_size']} sequences. "
           f"Study: {study.get('runs_done', '?')} of {study.get('runs_total', '?')} runs ({status}), wall time "
           f"{fmt(wall / 60 if wall else math.nan, 1)} min with {study.get('jobs', '?')} worker processes "
           f"(sum of per-run training time {fmt(study.get('run_wall_s_total', math.nan) / 60, 1)} min). The "
           "machine was shared with other jobs for part of the study, so absolute times are inflated and noisy; "
           "ratios between arms measured in the same period are the informative part.", ""]
    rows = []
    for arm, g in final.groupby("arm", sort=False):
        ms = g.wall_s / g.steps_done * 1000
        q1, med, q3 = np.percentile(ms, [25, 50, 75])
        rows.append([arm, fmt(float(g.backprop_chunks_per_step.mean()), 2), fmt(med, 1),
                     f"{fmt(q1, 1)}–{fmt(q3, 1)}", len(g)])
    return out + md_table(["arm", "backpropagated chunks per sequence and step", "median ms per step",
                           "interquartile range", "runs"], rows)


def render(tabs: dict, study: dict, out_md: Path, fig_dir: Path, source: str = "reports/training_study",
           extensions: Path | None = None) -> Path:
    """Write the Markdown report and its figures (paths in the Markdown are relative to ``out_md``);
    ``extensions``: the study folder whose equal-compute / second-configuration subfolders to report (issue 22)."""
    out_md, fig_dir = Path(out_md), Path(fig_dir)
    task = study["design"]["settings"]["task"]
    k, budgets = task["num_chunks"], study["design"]["budgets"]
    chance = math.log((task["vocab_size"] - 1) // 4)
    figs = {
        "far_loss_curves.png": figures.learning_curves(tabs["curves"], "val_far_loss", budgets, k, chance,
                                                       "validation far-token loss"),
        "loss_curves.png": figures.learning_curves(tabs["curves"], "val_loss", budgets, k, None,
                                                   "validation loss (all tokens)"),
        "far_loss_by_distance.png": figures.distance_plot(tabs["by_distance"], budgets, k, chance),
        "gradient_quality.png": figures.probe_plot(tabs["probe_curves"], {
            "probe_cos": "cos(E ĝ, g)", "probe_rel_bias": "relative bias ‖E ĝ − g‖/‖g‖",
            "probe_best_scale_residual": "best-scale residual (SGD)",
            "probe_per_tensor_residual": "per-tensor residual (Adam)"}),
        "lr_sensitivity.png": figures.lr_plot(tabs["selection"], budgets, k),
    }
    rel = {}
    for name, fig in figs.items():
        path = figures.save(fig, fig_dir / name)
        rel[name] = path.resolve().relative_to(out_md.resolve().parent).as_posix() \
            if path.resolve().is_relative_to(out_md.resolve().parent) else path.as_posix()
    sw = study.get("software", {})
    lines = ["# Does the bias matter? A training study of the SpaCO schemes", "",
             f"_Generated by `seco-lab report train` (in the repository: `make report`) from "
             f"`{source}/`; rerun with `make train-study`. Do not edit by hand._", ""]
    lines += verdict_lines(tabs, study)
    if extensions is not None:
        lines += equal_compute_sections(extensions, tabs["final"], tabs, study, out_md, fig_dir)
    lines += settings_section(study)
    lines += ["## Learning curves", "",
              "Validation far-token loss at each arm's tuned rate, mean over seeds, band = range over seeds; dense "
              "(dashed black) and SeCO (thick grey) compute the same gradient and should coincide.", "",
              f"![far-token loss]({rel['far_loss_curves.png']})", "",
              f"![validation loss]({rel['loss_curves.png']})", ""]
    lines += results_section(tabs, study)
    lines += ["Test far-token loss by distance at the tuned rate: mean over seeds, bars = range over seeds.", "",
              f"![far-token loss by distance]({rel['far_loss_by_distance.png']})", "",
              "## Learning-rate sensitivity", "", f"![lr sensitivity]({rel['lr_sensitivity.png']})", ""]
    lines += ["## Gradient quality along the trajectory", "",
              "Each SpaCO arm's exact expected gradient at its own current parameters (probe batch), averaged "
              "over seeds; solid: the larger budget, dashed: the smaller.", "",
              f"![gradient quality]({rel['gradient_quality.png']})", ""]
    p = tabs["probes"]
    rows = [[r.arm, r.optimizer, fmt(r.probe_cos, 4), fmt(r.probe_rel_bias), fmt(r.probe_best_scale_residual),
             fmt(r.probe_per_tensor_residual), fmt(r.probe_hop_share), fmt(r.test_far_loss_vs_seco)]
            for r in p[p.arm.str.contains(" t=")].itertuples()]
    lines += ["Trajectory means next to the outcome:", ""] + md_table(
        ["arm", "optimizer", "cos", "rel. bias", "best-scale resid.", "per-tensor resid.",
         "hop share ‖Σ_{p≥1} g(p)‖/‖g‖", "Δ far vs SeCO"], rows)
    lines += compute_section(tabs["final"], study)
    lines += [f"Software: Python {sw.get('python')}, torch {sw.get('torch')}, scipy {sw.get('scipy')}; "
              f"{sw.get('platform')}, {sw.get('cpus')} CPUs. Study fingerprint `{study.get('fingerprint')}`.", ""]
    return write_markdown(lines, out_md)


def training_study_report(folder: Path, out_md: Path) -> Path:
    """``seco-lab report train``: the report and its figures (in figures/<stem>/ beside it)."""
    folder, out_md = Path(folder), Path(out_md)
    results, runs, study = load(folder)
    return render(summarize(results, runs, study), study, out_md, out_md.parent / "figures" / out_md.stem,
                  os.path.relpath(folder.resolve(), Path.cwd()), extensions=folder)

