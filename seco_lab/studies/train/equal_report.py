"""The training study at equal compute (issue 22): tables, verdict lines and figures from the stored
extension folders (``OUT/equal_compute``, ``OUT/second_L4``) next to the main study (``OUT``).

Compute of a run = steps x sequences per step x chunk passes per sequence (the cost model of
:mod:`seco_lab.stats.equal_compute`), relative to the main study's SeCO run (S x B x (4k - 1)).  Every
comparison pairs seeds (same initial weights); an arm's numbers are at its tuned rate (lowest mean
validation far-token loss among the rates it ran, as in the main study).

The prediction: each arm's equal-compute best-scale MSE (``probe_ec_mse``: the step's error at its own
sequences and micro-batches, from the probes' exact strata, data noise and sampling noise) averaged
over its trajectory, ranked against its final test far-token loss (Spearman rho; 95% interval by
Fisher's z with the Bonett-Wright standard error sqrt((1 + rho^2 / 2) / (n - 3))), next to the
bias-only ranking (the trajectory-mean per-tensor residual for AdamW, best-scale residual for SGD).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from seco_lab.stats.equal_compute import chunk_passes

# the pieces of this report live in equal_finals, equal_format, equal_levels, equal_prediction and equal_runs;
# their names are re-exported here, where they were defined before
from ...report.markdown import left_out
from .equal_finals import (
    EXTENSION_FOLDERS,
    PRODUCE_EXTENSIONS,
    extension_finals,
    load_folder,
    run_finals,
    run_finals_from_main,
    tier_state,
    tuned,
)
from .equal_finals import arm_fields as _arm_fields  # noqa: F401 (re-export)
from .equal_finals import load_folder as _load  # noqa: F401 (re-export)
from .equal_format import ci, fmt, md_table  # noqa: F401 (re-export)
from .equal_levels import action_sentence, arm_row, compute_plot, levels, verdict  # noqa: F401 (re-export)
from .equal_prediction import (  # noqa: F401 (re-export)
    BIAS_METRIC,
    prediction_plot,
    prediction_section,
    prediction_table,
    replay_check,
    spearman_interval,
)
from .equal_runs import _cpu_total, _status_line, costs_lines, what_ran  # noqa: F401 (re-export)
from .figures import save

__all__ = ["EXTENSION_FOLDERS", "equal_compute_sections", "extension_finals", "prediction_table",
           "spearman_interval"]


def intro_lines(settings: dict, budgets) -> list[str]:
    """The section's heading and how its arms and compute are defined."""
    k, B = settings["task"]["num_chunks"], settings["batch_size"]
    return ["## At equal compute", "",
            "SpaCO exists to save compute, so the user's question is what to do with a fixed budget: SpaCO (which "
            "scheme, which t), SeCO on fewer sequences or steps, or cutting the gradient at every cache. "
            "Compute of a run = steps × sequences per step × chunk passes per sequence (SeCO "
            f"{chunk_passes('seco', k):g}, SpaCO k + 3t = "
            + ", ".join(f"{chunk_passes('spaco', k, t):g} at t = {t}" for t in budgets)
            + f", truncated {chunk_passes('truncated', k):g}; `seco_lab.stats.equal_compute`), relative to SeCO's run "
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


def optimizer_lines(ec_best: pd.DataFrame, opt: str, budgets, k: int, B: int, chance: float) -> list[str]:
    """One optimizer's compute levels: a verdict line and a table each, then the one-sentence advice."""
    lines = [f"### {opt}", ""]
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
    return lines


def equal_compute_sections(folder: Path, main_final: pd.DataFrame, main_tabs: dict, study: dict, out_md: Path,
                           fig_dir: Path) -> list[str]:
    """The report's sections of issue 22 (empty when no extension folder exists)."""
    folder = Path(folder)
    settings = study["design"]["settings"]
    k, B = settings["task"]["num_chunks"], settings["batch_size"]
    budgets = study["design"]["budgets"]
    chance = math.log((settings["task"]["vocab_size"] - 1) // 4)
    main_fin = run_finals_from_main(main_final, settings)

    def rel(path: Path) -> str:
        return Path(path).resolve().relative_to(Path(out_md).resolve().parent).as_posix()

    why = tier_state(folder / EXTENSION_FOLDERS["equal_compute"])
    if why is not None:  # said in the report; the second configuration and the status line stand on their own
        return ([left_out("the sections At equal compute and The prediction, tested",
                          EXTENSION_FOLDERS["equal_compute"], why, PRODUCE_EXTENSIONS)]
                + second_section(folder, chance, fig_dir, rel) + what_ran(folder, study))
    ec = extension_finals(folder, "equal_compute", main_fin)

    ec_best = tuned(ec)
    lines = intro_lines(settings, budgets)
    figs = {}
    for opt in dict.fromkeys(ec_best.optimizer):
        lines += optimizer_lines(ec_best, opt, budgets, k, B, chance)
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


def second_section(folder: Path, chance: float, fig_dir: Path, rel) -> list[str]:
    sub = Path(folder) / EXTENSION_FOLDERS["second"]
    why = tier_state(sub)
    if why is not None:
        return [left_out("the section A second configuration", EXTENSION_FOLDERS["second"], why, PRODUCE_EXTENSIONS)]
    loaded = load_folder(sub)
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
