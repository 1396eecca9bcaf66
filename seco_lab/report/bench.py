"""The benchmark report (``reports/benchmarks.md``) from ``experiments/bench.py``'s stored results."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from ..studies.registry import STUDIES
from . import bench_fsdp, bench_hf
from .figures import figure_folder, new_figure, save_figure
from .markdown import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    MissingResultsError,
    check_derived,
    fmt,
    generated_note,
    left_out,
    read_json_table,
    read_results_csv,
    require,
    table,
    write_markdown,
)

__all__ = ["INTEGER_COLUMNS", "bench_report", "load_bench", "summarize_bench"]

PRODUCE_BENCH = STUDIES["bench"].produce
BENCH_FILES = STUDIES["bench"].stored_files
# The paper's claims, reported against (not tuned for)
SECO_TIME_OVER_DENSE_MAX = 1.4  # SeCO step time <= 1.4x dense at chunk >= 256
SECO_MEMORY_OVER_KV_GROWTH_MAX = 1.1  # SeCO memory grows at most 1.1x the KV cache's growth
SPACO_RATIO = 16  # the paper's SpaCO budget t/k = 1/16 ...
SPACO_TIME_OVER_FORWARD_MAX = 1.5  # ... costs <= 1.5x forward-only time ...
SPACO_OVER_SECO_TIME_MAX = 1 / 2.5  # ... and is >= 2.5x faster than SeCO (SpaCO/SeCO time <= 0.4)
INTEGER_COLUMNS = ("length", "longest length within cap")
#: the columns of results.csv the report reads (an "error" row has no value)
RESULTS_COLUMNS = ("length", "label", "metric", "value")
#: one measurement per (length, method, metric): a repeated one would be averaged into the report
RESULTS_KEY = ("length", "label", "metric")
#: one row per process of experiments/bench_strata.py: the report's groups, and the round within them
STRATA_KEY = ("length", "chunk_size", "max_hops", "tag", "rev", "round")


def load_bench(folder: Path) -> tuple[pd.DataFrame, dict]:
    folder = Path(folder)
    require(folder, BENCH_FILES, PRODUCE_BENCH)
    df = read_results_csv(folder / "results.csv", RESULTS_COLUMNS, PRODUCE_BENCH, text_columns=("label", "metric"),
                          nan_allowed=lambda d: d["metric"].astype(str).eq("error"), more_columns=True,
                          ranges={"length": COUNT, "value": NON_NEGATIVE}, key=RESULTS_KEY,
                          keyed=lambda d: ~d["metric"].astype(str).eq("error"))
    meta = read_json_table(folder / "bench.json", PRODUCE_BENCH)
    check_spaco_rows(folder, df, meta)
    return df, meta


def check_spaco_rows(folder: Path, df: pd.DataFrame, meta: dict) -> None:
    """bench.json's chunk size against the SpaCO rows of results.csv: a row of budget t at t/k = 1/ratio ran
    k = t x ratio chunks, and k = ceil(length / chunk size); its label names its scheme and ratio.  A chunk size
    that the rows contradict, or a label its columns contradict (edited), is refused, never printed."""
    cfg = meta.get("config")
    chunk = cfg.get("chunk_size") if isinstance(cfg, dict) else None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise MissingResultsError(f"{folder / 'bench.json'} holds no chunk size (config.chunk_size = {chunk!r}, not a "
                                  f"positive integer): rerun {PRODUCE_BENCH}")
    if not {"method", "scheme", "budget", "ratio"} <= set(df.columns):
        return
    sp = df[df["method"].astype(str).eq("spaco")]
    budget, ratio = pd.to_numeric(sp["budget"], errors="coerce"), pd.to_numeric(sp["ratio"], errors="coerce")
    named = "spaco " + sp["scheme"].astype(str) + " t/k=1/" + ratio.map("{:g}".format)
    if (other := sp.label.ne(named)).any():  # the report pairs SpaCO rows by scheme and ratio, draws them by label
        row = other.idxmax()
        raise MissingResultsError(f"{folder / 'results.csv'}: row {int(row) + 2} is labelled {sp.label[row]!r}, but "
                                  f"its scheme and ratio make it {named[row]!r}: the file was edited or is damaged; "
                                  f"rerun {PRODUCE_BENCH}")
    k = -(-sp["length"] // chunk)
    bad = ~(budget * ratio == k)
    if bad.any():
        row = bad.idxmax()
        raise MissingResultsError(
            f"{folder / 'results.csv'}: row {int(row) + 2} ({sp.label[row]} at length {int(sp.length[row])}) ran "
            f"budget x ratio = {budget[row]:g} x {ratio[row]:g} = {budget[row] * ratio[row]:g} chunks, but "
            f"{folder / 'bench.json'} gives chunk_size {chunk}, i.e. k = ceil({int(sp.length[row])} / {chunk}) = "
            f"{int(k[row])}: one of them was edited or they come from two runs; rerun {PRODUCE_BENCH}")


def kv_cache_mib(cfg: dict, n: int) -> float:
    """KV cache of n tokens in MiB: layers x (K and V) x kv heads x head dim x n x batch x dtype size."""
    m = cfg["model"]
    head_dim = m["d_model"] // m["n_heads"]
    size = {"float32": 4, "float64": 8, "bfloat16": 2}[cfg["dtype"]]
    return m["n_layers"] * 2 * m["n_kv_heads"] * head_dim * n * cfg["batch"] * size / (1 << 20)


def _at(table_: pd.DataFrame, n, c) -> float:
    return float(table_.loc[n, c]) if n in table_.index and c in table_.columns else np.nan


def _ratio(a: float, b: float) -> float:
    """a / b; NaN where b is 0 (a memory growth or time too small to measure is no denominator)."""
    return a / b if b else np.nan


def spaco_labels(df: pd.DataFrame) -> pd.DataFrame:
    """SpaCO rows' (label, scheme, ratio), ordered by scheme then growing sparsity."""
    sp = df[df.method == "spaco"][["label", "scheme", "ratio"]].drop_duplicates("label")
    return sp.sort_values(["scheme", "ratio"]).reset_index(drop=True)


def summarize_bench(df: pd.DataFrame, meta: dict) -> dict:
    """Ratio tables and the paper's targets from the tidy results (one row per length x method x metric)."""
    cfg = meta["config"]
    t = df[df.metric == bench_hf.clock(df)].pivot_table(index="length", columns="label", values="value")
    mem = df[df.metric == "peak_mib"].pivot_table(index="length", columns="label", values="value")
    lengths = sorted(df.length.unique())
    n_lo, n_hi = lengths[0], lengths[-1]
    core = pd.DataFrame([{"length": n, "SeCO/dense time": _ratio(_at(t, n, "seco"), _at(t, n, "dense")),
                          "SeCO/checkpoint time": _ratio(_at(t, n, "seco"), _at(t, n, "checkpoint")),
                          "SeCO/dense memory": _ratio(_at(mem, n, "seco"), _at(mem, n, "dense")),
                          "SeCO/checkpoint memory": _ratio(_at(mem, n, "seco"), _at(mem, n, "checkpoint"))}
                         for n in lengths])
    sp = spaco_labels(df)
    vs = [{"length": n, "method": r.label, "SpaCO/forward time": _ratio(_at(t, n, r.label), _at(t, n, "forward")),
           "SpaCO/SeCO time": _ratio(_at(t, n, r.label), _at(t, n, "seco"))}
          for r in sp.itertuples() for n in lengths if not np.isnan(_at(t, n, r.label))]
    strat_rows = []
    for r in sp[sp.scheme == cfg["stratified_scheme"]].itertuples():
        twin = sp[(sp.scheme == cfg["constant_scheme"]) & (sp.ratio == r.ratio)].label
        for n in lengths if len(twin) else []:
            strat_rows.append({"length": n, "budget": f"t/k=1/{int(r.ratio)}",
                               "time ratio": _ratio(_at(t, n, r.label), _at(t, n, twin.iloc[0])),
                               "memory ratio": _ratio(_at(mem, n, r.label), _at(mem, n, twin.iloc[0]))})
    reach = pd.DataFrame([{"method": c, "longest length within cap": int(ok.max()) if len(ok) else 0}
                          for c in sorted(set(df.label))
                          for ok in [df[(df.label == c) & (df.metric == "peak_mib")].length]])
    seco_t = [_ratio(_at(t, n, "seco"), _at(t, n, "dense")) for n in lengths]
    dense_ok = [n for n in lengths if not np.isnan(_at(mem, n, "dense"))]
    sparse = [(r.label, _ratio(_at(t, n_hi, r.label), _at(t, n_hi, "forward")),
               _ratio(_at(t, n_hi, r.label), _at(t, n_hi, "seco")))
              for r in sp[sp.ratio == SPACO_RATIO].itertuples()]
    return {"time": t, "memory": mem, "lengths": lengths, "core": core, "spaco": pd.DataFrame(vs),
            "stratified": pd.DataFrame(strat_rows).dropna(), "reach": reach, "errors": df[df.metric == "error"],
            "seco_time_range": (min(seco_t), max(seco_t)),
            "seco_growth": _at(mem, n_hi, "seco") - _at(mem, n_lo, "seco"),
            "kv_growth": kv_cache_mib(cfg, n_hi) - kv_cache_mib(cfg, n_lo),
            "dense_range": (dense_ok[0], dense_ok[-1]) if len(dense_ok) > 1 else None, "spaco_targets": sparse}


def bench_figures(s: dict, meta: dict, figdir: Path) -> list[str]:
    cfg = meta["config"]

    ratios = sorted({int(c.split("1/")[-1]) for c in s["time"].columns if c.startswith("spaco")})
    dashes, markers = ["-", "--", "-.", ":"], ["o", "s", "^", "v", "D", "P"]

    def style(c):
        """(colour, line style, marker): colour per scheme, line style and marker per budget, so every
        line differs from every other in at least two of the three."""
        if c.startswith("spaco"):
            i = ratios.index(int(c.split("1/")[-1]))
            colour = "tab:blue" if cfg["stratified_scheme"] in c else "tab:green"
            return colour, dashes[i % len(dashes)], markers[i % len(markers)]
        return {"forward": ("k", "--", "x"), "dense": ("tab:red", "-", "o"), "checkpoint": ("tab:orange", "-", "s"),
                "seco": ("tab:purple", "-", "D")}.get(c, ("gray", "-", "o"))

    names = []
    for name, tab, ylabel in [("time_vs_length", s["time"], "seconds per step (median)"),
                              ("memory_vs_length", s["memory"], "peak memory above baseline (MiB)")]:
        fig, axes = new_figure(figsize=(8, 5))
        ax = axes[0][0]
        order = sorted(tab.columns, key=lambda c: (c.startswith("spaco"), c.split(" t/k")[0],
                                                     int(c.split("1/")[-1]) if c.startswith("spaco") else 0))
        for c in order:
            col, ls, marker = style(c)
            ax.loglog(tab.index, tab[c], ls, color=col, marker=marker, ms=4, lw=1.2, label=c)
        if name == "memory_vs_length":
            ax.loglog(s["lengths"], [kv_cache_mib(cfg, n) for n in s["lengths"]], "k:", lw=1, label="KV cache size")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{meta['device_name']}; chunk {cfg['chunk_size']}; {meta['n_params']:,} parameters", fontsize=9)
        fig.legend(loc="outside right upper", fontsize=7)
        names.append(save_figure(fig, figdir / f"{name}.png"))
    return names


def targets_section(s: dict, chunk: int) -> list[str]:
    n_lo, n_hi = s["lengths"][0], s["lengths"][-1]
    lo, hi = s["seco_time_range"]
    grow, kv = s["seco_growth"], s["kv_growth"]
    md = ["## Where this stands against the paper's claims (targets, not tuned for)\n",
          f"- SeCO step time ≤ {SECO_TIME_OVER_DENSE_MAX}× dense at chunk ≥ 256: measured {fmt(lo)}–{fmt(hi)}× over "
          f"{n_lo}–{n_hi} tokens (chunk {chunk}) — "
          f"{'met' if hi <= SECO_TIME_OVER_DENSE_MAX else 'not met at every length'}.",
          f"- SeCO peak memory growth from {n_lo} to {n_hi} tokens: {fmt(grow)} MiB against a KV-cache growth of "
          f"{fmt(kv)} MiB (target: ≤ {SECO_MEMORY_OVER_KV_GROWTH_MAX}× = {fmt(SECO_MEMORY_OVER_KV_GROWTH_MAX * kv)} "
          f"MiB) — {'met' if grow <= SECO_MEMORY_OVER_KV_GROWTH_MAX * kv else 'not met'}. SeCO keeps the cache "
          "leaves *and* their relayed gradients (same size), plus one chunk's attention scores over the whole prefix."]
    if s["dense_range"]:
        d_lo, d_hi = s["dense_range"]
        mem = s["memory"]
        growth = _ratio(_at(mem, d_hi, "dense"), _at(mem, d_lo, "dense"))
        md.append(f"- Dense memory grows {fmt(growth)}× from {d_lo} to "
                  f"{d_hi} tokens ({d_hi // d_lo}× longer; attention scores grow quadratically)"
                  + (f" and does not fit the cap at {n_hi}." if d_hi < n_hi else "."))
    for label, a, b in s["spaco_targets"]:
        md.append(f"- {label} at {n_hi}: {fmt(a)}× forward-only time (target ≤ {SPACO_TIME_OVER_FORWARD_MAX}: "
                  f"{'met' if a <= SPACO_TIME_OVER_FORWARD_MAX else 'not met'}), {fmt(b)}× SeCO's time (target "
                  f"≤ {fmt(SPACO_OVER_SECO_TIME_MAX)}, i.e. ≥ 2.5× faster: "
                  f"{'met' if b <= SPACO_OVER_SECO_TIME_MAX else 'not met'}).")
    return md


def strata_cost_section(path: Path) -> list[str]:
    """LoRA hop strata next to a SeCO step, before and after (experiments/bench_strata.py)."""
    df = read_results_csv(path, ("length", "chunk_size", "max_hops", "tag", "rev", "seco_cpu_s", "strata_cpu_s",
                                 "ratio", "peak_rss_gib", "loadavg_1m"), "`python -m experiments.bench_strata`",
                          text_columns=("tag", "rev"), more_columns=True,
                          ranges={"length": COUNT, "chunk_size": COUNT, "max_hops": NON_NEGATIVE,
                                  "seco_cpu_s": NON_NEGATIVE, "strata_cpu_s": NON_NEGATIVE, "ratio": POSITIVE,
                                  "peak_rss_gib": NON_NEGATIVE, "loadavg_1m": NON_NEGATIVE}, key=STRATA_KEY)
    check_derived(path, df, "ratio", df.strata_cpu_s / df.seco_cpu_s, "strata_cpu_s / seco_cpu_s",
                  "`python -m experiments.bench_strata`")
    keys = list(STRATA_KEY[:-1])
    g = df.groupby(keys, sort=False).agg(rounds=("ratio", "size"), seco_cpu_s=("seco_cpu_s", "median"),
                                         strata_cpu_s=("strata_cpu_s", "median"), ratio=("ratio", "median"),
                                         peak_rss_gib=("peak_rss_gib", "max"),
                                         load_1m=("loadavg_1m", "median")).reset_index()
    g = g.rename(columns={"ratio": "strata / SeCO", "max_hops": "P"})
    return ["\n## Hop strata (LoRA) next to a SeCO step, before and after\n",
            "`python -m experiments.bench_strata --before REV` (SmolLM2-135M, Q4_1-dequantized, LoRA r = 8, α = 16 on "
            "q/v, float32, `pydoc_data/topics.py`): one fresh single-threaded process per (revision, round), "
            "revisions alternating; in each, SeCO then `hop_strata(max_hops=P)`; CPU time of the process; the "
            "ratio is taken within the process, medians over rounds; load_1m = the machine's load average when the "
            "process ended (2 cores, shared). Target (issue 21): P = 6 at ≤ 4× SeCO.\n",
            table(g, ("length", "chunk_size", "P", "rounds")) + "\n"]


def bench_report(folder: Path, out_md: Path) -> Path:
    folder, out_md = Path(folder), Path(out_md)
    df, meta = load_bench(folder)
    s = summarize_bench(df, meta)
    cfg = meta["config"]
    figdir = figure_folder(out_md, "benchmarks", "bench" + folder.name.replace("bench", ""))
    figs = bench_figures(s, meta, figdir)
    rel = os.path.relpath(figdir, out_md.parent)
    md = ["# Benchmarks: dense, layer checkpointing, SeCO and SpaCO\n",
          generated_note(STUDIES["bench"].name, folder, out_md, PRODUCE_BENCH),
          f"Device: **{meta['device_name']}** ({meta['device']}). Model: tiny Llama-style, {cfg['model']}, "
          f"{meta['n_params']:,} parameters, {cfg['dtype']}, batch {cfg['batch']}; chunk size "
          f"{cfg['chunk_size']}. One training step = forward + backward, no optimizer. Time: median of "
          f"{cfg['rounds']} interleaved rounds after a warm-up round, every method in one process per length"
          + (f", as the CPU time of a process with {cfg['threads']} thread(s) (it counts the step's work whatever "
             "else ran on the machine). " if bench_hf.clock(df) == "cpu_s" else " (wall time). ") +
          "Memory: each (method, length) in a fresh process; peak above the baseline after building the model "
          f"(CPU: resident set; GPU: allocator). Memory cap: {cfg['memory_cap_gib']} GiB of address space per "
          "process on CPU. SpaCO backpropagates a fixed set (the last t chunks) so rounds do equal work; "
          f"constant-relay scheme `{cfg['constant_scheme']}`, stratified `{cfg['stratified_scheme']}`.\n",
          f"![time]({rel}/{figs[0]})\n\n![memory]({rel}/{figs[1]})\n", "## Ratios\n",
          table(s["core"], INTEGER_COLUMNS) + "\n"]
    if len(s["spaco"]):
        md += ["SpaCO against forward-only inference and against SeCO:\n", table(s["spaco"], INTEGER_COLUMNS) + "\n"]
    if len(s["stratified"]):
        md += [f"Stratified relay (`{cfg['stratified_scheme']}`, one buffer per hop count) over constant relay "
               f"(`{cfg['constant_scheme']}`) at the same budget:\n", table(s["stratified"], INTEGER_COLUMNS) + "\n"]
    md += ["Longest length each method ran within the memory cap:\n", table(s["reach"], INTEGER_COLUMNS) + "\n"]
    if len(s["errors"]):
        md.append("Configurations that did not finish: " + "; ".join(
            f"{r.label} at {r.length} ({r.note})" for r in s["errors"].itertuples()) + ".\n")
    md += targets_section(s, cfg["chunk_size"])
    for name, render, what, produce in (
            ("hf_results.csv", bench_hf.render, "the HF model benchmarks (SmolLM2 shape)", "`make bench-hf`"),
            ("fsdp_results.csv", bench_fsdp.render, "the FSDP benchmark", "`make bench-fsdp`"),
            ("strata_cost.csv", lambda f: strata_cost_section(f / "strata_cost.csv"), "the hop-strata cost",
             "`python -m experiments.bench_strata`")):
        if (folder / name).exists():
            md += render(folder)
        else:  # each comes from its own benchmark: said when absent, never dropped without a word
            md.append("\n" + left_out(what, name, "does not exist in the results folder", produce))
    sw = meta["software"]
    md.append(f"\nSoftware: Python {sw['python']}, torch {sw['torch']}; {sw['platform']}.\n")
    return write_markdown(md, out_md)
