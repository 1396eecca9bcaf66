"""The training study report's descriptive sections: the task and settings, the results tables, and what the
study cost."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from seco_lab import get_scheme

from .report_format import ci, fmt, md_table

__all__ = ["compute_section", "results_section", "settings_section", "task_line"]


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
