"""The pretrained-LM report: SmolLM2-135M's hop strata and each scheme's exact bias, from the cells
stored by :mod:`seco_lab.studies.real` (``seco-lab study real``).  ``summarize`` reads the scheme table back;
``render`` writes the Markdown section; ``real_report`` the whole report file."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ..studies.registry import STUDIES
from .markdown import (
    MissingResultsError,
    check_bounds,
    generated_note,
    read_json_table,
    read_results_csv,
    require,
    write_markdown,
)

__all__ = ["real_report", "render", "summarize"]

DEFAULT_DIR = STUDIES["real"].results
PRODUCE_REAL = STUDIES["real"].produce


RESULT_COLUMNS = ("params", "num_chunks", "budget", "t_over_k", "scheme", "rel_bias", "direction_bias",
                  "best_scale_residual")
STRATA_COLUMNS = ("params", "p", "norm_ratio")


def load_real(out_dir: str | Path = DEFAULT_DIR) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(study.json, strata.csv, results.csv), refused unless complete and consistent: each parses with its
    columns, holds finite numbers and no repeated row, and every gradient ``study.json`` lists has its
    strata p = 0 .. k-1 and a row per (budget, scheme) of the study's definition -- the message names
    what is missing."""
    from ..estimators.schemes import SCHEME_NAMES

    out_dir = Path(out_dir)
    require(out_dir, STUDIES["real"].stored_files, PRODUCE_REAL)
    study = read_json_table(out_dir / "study.json", PRODUCE_REAL)
    try:
        cfg, gradients = study["config"], list(study["gradients"])
        k, fractions = int(cfg["num_chunks"]), [float(f) for f in cfg["budget_fractions"]]
    except (KeyError, TypeError, ValueError) as e:
        raise MissingResultsError(f"{out_dir}/study.json has no readable study definition ({type(e).__name__}: {e}): "
                                  f"rerun {PRODUCE_REAL}") from None
    if not gradients:
        raise MissingResultsError(f"{out_dir}/study.json lists no finished gradient: rerun {PRODUCE_REAL}")
    strata = read_results_csv(out_dir / "strata.csv", STRATA_COLUMNS, PRODUCE_REAL, text_columns=("params",),
                              key=("params", "p"))
    table = read_results_csv(out_dir / "results.csv", RESULT_COLUMNS, PRODUCE_REAL, text_columns=("params", "scheme"),
                             key=("params", "budget", "scheme"))
    check_bounds(out_dir / "strata.csv", strata, {"norm_ratio": (0, math.inf)}, PRODUCE_REAL)
    check_bounds(out_dir / "results.csv", table, {"rel_bias": (0, math.inf), "direction_bias": (0, 2),
                                                  "best_scale_residual": (0, 1), "t_over_k": (0, 1)}, PRODUCE_REAL)
    budgets = sorted({max(1, round(f * k)) for f in fractions})
    for path, have, want, what in (
            (out_dir / "strata.csv", set(zip(strata.params, strata.p.astype(int))),
             {(g, p) for g in gradients for p in range(k)}, "(params, p)"),
            (out_dir / "results.csv", set(zip(table.params, table.budget.astype(int), table.scheme)),
             {(g, t, s) for g in gradients for t in budgets for s in SCHEME_NAMES}, "(params, budget, scheme)")):
        for gap, verb in ((sorted(want - have), "lacks"), (sorted(have - want), "has rows outside the study's "
                                                                                 "definition,")):
            if gap:
                raise MissingResultsError(f"{path} {verb} {len(gap)} of {len(want)} expected {what} rows (e.g. "
                                          f"{gap[0]}): the results are incomplete or mixed; rerun {PRODUCE_REAL}")
    return study, strata, table


def summarize(out_dir: str | Path = DEFAULT_DIR) -> pd.DataFrame:
    """The scheme table: one row per (parameter set, budget, scheme)."""
    return load_real(out_dir)[2]


def _fmt(x: float) -> str:
    return f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3f}"


def render(out_dir: str | Path = DEFAULT_DIR) -> str:
    """The Markdown section of the real-LM cells."""
    study, strata, table = load_real(out_dir)
    cfg = study["config"]
    md = ["## A pretrained LM: SmolLM2-135M on real Python\n",
          f"SmolLM2-135M-Instruct (Q4_1-dequantized GGUF weights, not the original float weights) on "
          f"`{cfg['text_file']}` of the standard library: {cfg['num_chunks']} chunks of {cfg['chunk_size']} tokens "
          f"({cfg['num_chunks'] * cfg['chunk_size']:,} tokens). Hop strata from one stratified pass in "
          f"{cfg['strata_dtype']} with P = k − 1 (nothing truncated); LoRA r = {cfg['lora_r']}, α = "
          f"{cfg['lora_alpha']} on {'/'.join(cfg['lora_targets'])} with A and B random (seed {cfg['lora_seed']}); "
          "the full-parameter gradient by parameter group (G = Σ_groups G_group).\n"]
    md.append("**Exactness (float64, real text):**\n")
    md.append("| gradient | window | SeCO vs HF backward | Σ_p g(p) vs HF backward | dense vs HF backward |\n"
              "|---|---|---|---|---|")
    for name, e in study["exactness"].items():
        md.append(f"| {name.removeprefix('exact-')} | {e['tokens']} tokens, {e['num_chunks']} × {e['chunk_size']} | "
                  f"{e['seco_vs_hf_backward']:.1e} | {e['strata_sum_vs_hf_backward']:.1e} | "
                  f"{e['dense_vs_hf_backward']:.1e} |")
    for name, e in study["exactness"].items():
        md.append(f"\n{name.removeprefix('exact-')} ‖g(p)‖/‖g‖ in that float64 window, p = 0…: "
                  + ", ".join(_fmt(v) for v in e["strata_norms"]))
    md.append("\n**How much of the gradient crosses p KV-cache hops, ‖g(p)‖/‖g‖:**\n")
    wide = strata.pivot(index="p", columns="params", values="norm_ratio")
    md.append("| p | " + " | ".join(wide.columns) + " |\n|---|" + "---|" * len(wide.columns))
    for p, row in wide.iterrows():
        md.append(f"| {p} | " + " | ".join(_fmt(v) for v in row) + " |")
    md.append("\n**Each scheme's exact bias** (relative bias ‖E ĝ − g‖/‖g‖ / direction bias 1 − cos / best-scale "
              "residual sin∠(E ĝ, g)):\n")
    for params, part in table.groupby("params", sort=False):
        budgets = sorted(part.budget.unique())
        md.append(f"*{params}*\n\n| scheme | " + " | ".join(f"t = {t} of {part.num_chunks.iloc[0]}" for t in budgets)
                  + " |\n|---|" + "---|" * len(budgets))
        for scheme, rows in part.groupby("scheme", sort=False):
            cells = [rows[rows.budget == t].iloc[0] for t in budgets]
            md.append(f"| {scheme} | " + " | ".join(
                f"{_fmt(r.rel_bias)} / {_fmt(r.direction_bias)} / {_fmt(r.best_scale_residual)}" for r in cells) + " |")
        md.append("")
    ff = table[table.scheme == "falling-factorial"]
    md.append("falling-factorial keeps only p ≤ t − 1 (its weights are 1 there, 0 beyond): its relative bias is "
              "exactly what that truncation loses, ‖Σ_{p ≥ t} g(p)‖/‖g‖ — " + ", ".join(
                  f"{r.params} t = {r.budget}: {_fmt(r.rel_bias)}" for r in ff.itertuples()) + ".\n")
    if "full" not in study["gradients"]:
        md.append(f"Full-parameter gradient: not complete ({len(study['full_groups_stored'])} parameter group(s) "
                  "stored); rerun the study to resume.\n")
    md.append("Cost: " + ", ".join(f"{n} {c['wall_s']:.0f} s (peak {c['peak_rss_gib']:.1f} GiB)"
                                   for n, c in study["cells"].items()) + ". Variance by Monte Carlo: not run.\n")
    return "\n".join(md)




def real_report(folder: Path, out_md: Path) -> Path:
    md = ["# Hop strata and scheme bias on a pretrained LM\n", generated_note("real", folder, out_md, PRODUCE_REAL),
          render(folder)]
    return write_markdown(md, out_md)
