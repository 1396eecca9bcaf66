"""The FSDP section of ``reports/benchmarks.md``, from ``experiments/bench_fsdp.py``'s CSV.

``summarize(results)`` -> one row per mode: per-rank peak resident set (the larger rank, median
over rounds), the same above the pre-model baseline, the median step time (slower rank), the
collectives of one optimizer step, and the ratios to the replicated path -- computed within
each round (the modes of a round ran back to back) and then the median over rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .markdown import COUNT, NON_NEGATIVE, MissingResultsError, check_one_setting, read_results_csv, table

__all__ = ["INTEGER_COLUMNS", "render", "summarize"]

BASELINE = "replicated"
PRODUCE = "`make bench-fsdp` (python -m experiments.bench_fsdp)"
INTEGER_COLUMNS = ("rounds", "all-gathers / step", "reduce-scatters / step", "all-reduces / step")


def read_fsdp_results(path: str | Path) -> pd.DataFrame:
    """``fsdp_results.csv``, checked: rows, numbers in the columns the report reads, and one row per (round, mode,
    rank) -- a repeated one would be taken into the round's maximum as if it were another rank; one model, size,
    length and chunk size in every row (the report states them once); every (round, mode) measured on the same
    ranks, and every round with its replicated baseline (the ratios are taken within a round)."""
    path = Path(path)
    df = read_results_csv(path, ("round", "mode", "parameters", "base_mib", "peak_mib", "step_s", "all_gather",
                                   "reduce_scatter", "all_reduce", "seq_len", "chunk_size", "model"), PRODUCE,
                            text_columns=("mode", "model"), more_columns=True,
                            ranges={"round": NON_NEGATIVE, "parameters": COUNT, "base_mib": NON_NEGATIVE,
                                    "peak_mib": NON_NEGATIVE, "step_s": NON_NEGATIVE, "all_gather": NON_NEGATIVE,
                                    "reduce_scatter": NON_NEGATIVE, "all_reduce": NON_NEGATIVE, "seq_len": COUNT,
                                    "chunk_size": COUNT}, key=("round", "mode", "rank"))
    check_one_setting(path, df, ("model", "parameters", "seq_len", "chunk_size"), PRODUCE)
    ranks = df.groupby(["round", "mode"])["rank"].apply(lambda r: tuple(sorted(r)))
    if ranks.nunique() != 1:
        (rnd, mode), got = next((i, v) for i, v in ranks.items() if v != ranks.iloc[0])
        raise MissingResultsError(f"{path}: round {rnd} of {mode} holds ranks {list(got)}, round "
                                  f"{ranks.index[0][0]} of {ranks.index[0][1]} {list(ranks.iloc[0])}: a rank's "
                                  f"row is missing or extra; rerun {PRODUCE}")
    if lacking := sorted(set(df["round"]) - set(df.loc[df["mode"] == BASELINE, "round"])):
        raise MissingResultsError(f"{path}: round {lacking[0]:g} has no {BASELINE!r} rows, which its ratios are "
                                  f"taken against; rerun {PRODUCE}")
    return df


def summarize(results: pd.DataFrame | str | Path) -> pd.DataFrame:
    df = read_fsdp_results(results) if not isinstance(results, pd.DataFrame) else results
    df = df.assign(above_mib=df.peak_mib - df.base_mib)
    per = df.groupby(["round", "mode"]).agg(peak_mib=("peak_mib", "max"), above_mib=("above_mib", "max"),
                                            step_s=("step_s", "max"), all_gather=("all_gather", "max"),
                                            reduce_scatter=("reduce_scatter", "max"),
                                            all_reduce=("all_reduce", "max")).reset_index()
    base = per[per["mode"] == BASELINE].set_index("round")
    if base.empty:
        raise ValueError(f"{BASELINE!r} rows are missing from the FSDP benchmark results: rerun {PRODUCE}")
    per["memory_ratio"] = per.peak_mib / per["round"].map(base.peak_mib)
    per["above_ratio"] = per.above_mib / per["round"].map(base.above_mib)
    per["time_ratio"] = per.step_s / per["round"].map(base.step_s)
    order = {m: i for i, m in enumerate(dict.fromkeys([BASELINE, *df["mode"]]))}  # as measured
    out = per.groupby("mode").median(numeric_only=True).drop(columns="round")
    out = out.loc[sorted(out.index, key=order.get)]
    out.insert(0, "rounds", per.groupby("mode").size())
    return out.reset_index()


def render(folder: Path) -> list[str]:
    df = read_fsdp_results(Path(folder) / "fsdp_results.csv")
    s = summarize(df)
    try:
        model = json.loads(df.model.iloc[0])
    except (ValueError, TypeError, RecursionError):
        model = None
    if not isinstance(model, dict):
        raise MissingResultsError(f"{Path(folder) / 'fsdp_results.csv'}: its model column holds no model settings "
                                  f"(damaged): rerun {PRODUCE}")
    params = int(df.parameters.iloc[0])
    show = s.rename(columns={"peak_mib": "peak MiB / rank", "above_mib": "above baseline MiB",
                             "step_s": "step s", "memory_ratio": "peak / replicated",
                             "above_ratio": "above baseline / replicated", "time_ratio": "step time / replicated",
                             "all_gather": "all-gathers / step", "reduce_scatter": "reduce-scatters / step",
                             "all_reduce": "all-reduces / step"})
    return ["\n## Sharded training: FSDP against replicated data parallelism\n",
            f"Generated from `{Path(folder).name}/fsdp_results.csv` by {PRODUCE}. Two ranks (`torchrun "
            f"--nproc_per_node 2`, gloo, one thread each) on CPU; tiny transformer ({model['n_layers']} blocks, "
            f"d_model {model['d_model']}, d_ff {model['d_ff']}, vocab {model['vocab_size']}), {params:,} "
            f"parameters, float32; SeCO, sequence {int(df.seq_len.iloc[0])}, chunk {int(df.chunk_size.iloc[0])}, "
            "one sequence per rank, AdamW. Every (round, mode) is a fresh launch; modes alternate within a round. "
            "Peak: the resident set's high-water mark of the larger rank; *above baseline*: minus its resident "
            "set before the model was built (imports only); children run with glibc's `MALLOC_MMAP_THRESHOLD_=65536` "
            "so that freed tensors leave the resident set (with the default adaptive threshold the high-water mark "
            "follows the heap's history: both modes then peak near 1.3 GiB). Step time: median over the timed "
            "steps, slower rank. Ratios are taken within each round, then the median over rounds. Replicated: "
            "one all-reduce of the gradients and one of the statistics (float32). FSDP: see `docs/training.md` "
            "for the collectives policy.\n",
            table(show, INTEGER_COLUMNS) + "\n",
            f"Load average during the runs (median): {df.loadavg.median():.1f} on this shared machine; step-time "
            "ratios come from modes run back to back.\n"]
