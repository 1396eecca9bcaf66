"""The resumable study driver and its command line.

    seco-lab study bias [--quick] [--jobs 2] [--out DIR] [--draws N] [--fresh]   (alias: seco-lab bias-study)

Two kinds of group (``definition``): the chain-basis grid (``group``) and the paper-settings
groups (``paper``, k = 128 and up).  Each group's tables are written atomically under
``OUT/cells`` (its ``.json`` timing file last: its presence marks the group done); a rerun
skips finished groups as long as the study definition is unchanged.  At the end the groups
are gathered, sorted, into ``results.csv``, ``paper.csv`` (paper-settings cells), ``checks.csv``,
``groups.csv`` and ``convergence.csv``; run times (per group and per part) live only in
``study.json``, so the tables are byte-identical run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from ...store import (
    RECORD_MAX_BYTES,
    DefinitionMismatch,
    StudyFolder,
    atomic_write,
    read_checked_bytes,
    read_csv,
    read_json,
    software_versions,
)
from ..rerun_tables import write_tables
from ..runner import run_cells, worker_count
from .definition import (
    CHECK_COLUMNS,
    CONVERGENCE_COLUMNS,
    DEFAULT,
    GROUP_COLUMNS,
    PAPER_COLUMNS,
    QUICK,
    RESULT_COLUMNS,
    STUDY_FORMAT,
    StudyConfig,
    run_totals_problem,
)
from .group import run_group
from .options import COST_GUARD_HOURS, add_arguments, check_draws
from .paper import run_paper_group

__all__ = [
    "StudyDefinitionError", "TABLES", "add_arguments", "build_parser", "gather", "main", "run_from_args",
    "run_study", "study_folder",
]

#: what to do about a damaged group file (a FIFO, a device, too large, not CSV or JSON): the group is computed again
REDO = "remove it and rerun the study (the group is computed again)"
TABLES = {"results": RESULT_COLUMNS, "paper": PAPER_COLUMNS, "checks": CHECK_COLUMNS, "groups": GROUP_COLUMNS,
          "convergence": CONVERGENCE_COLUMNS}
# rows sorted by these columns (then by every other key column): a fixed order whatever finished first
SORT_KEYS = {"results": ["L", "k", "seed", "t", "scheme", "metric"],
             "paper": ["L", "k", "seed", "t", "scheme", "metric"], "checks": ["L", "k", "seed", "t", "check"],
             "groups": ["L", "k", "seed", "metric"], "convergence": ["L", "k", "seed", "t", "scheme", "n"]}


StudyDefinitionError = DefinitionMismatch  # the output folder holds results of a different study definition


CHAIN, PAPER_KIND = "chain", "paper"  # the two kinds of group


#: rows whose values are rounding itself (rerun_tables): residuals sqrt(max(q, 0)) of quadratic forms that vanish
#: in exact arithmetic come back as sqrt(rounding) ~ 1e-8 on another CPU's kernels (measured: 2.6e-8), and every
#: check's value is a float64 rounding error (measured: moves of 5.2e-15 across kernels).  A real change moves a
#: residual or a check by orders of magnitude more.
SQRT_RESIDUALS = ("rel_bias", "best_scale_residual", "per_tensor_residual")
ROUNDING_FLOORS = {
    "results": lambda df: np.where(df["metric"].isin(SQRT_RESIDUALS), 1e-7, 0.0),
    "paper": lambda df: np.where(df["metric"].isin(SQRT_RESIDUALS), 1e-7, 0.0),
    "checks": lambda df: np.full(len(df), 1e-12),
}


def all_groups(cfg: StudyConfig) -> list[tuple[str, tuple[int, int, int]]]:
    """(kind, (L, k, seed)) of every group, the expensive paper-settings groups first."""
    return [(PAPER_KIND, g) for g in cfg.paper_groups()] + [(CHAIN, g) for g in cfg.groups()]


def group_name(n_layers: int, num_chunks: int, seed: int, kind: str = CHAIN) -> str:
    prefix = "" if kind == CHAIN else f"{kind}_"
    return f"{prefix}L{n_layers}_k{num_chunks}_s{seed}"


def group_stem(out: Path, n_layers: int, num_chunks: int, seed: int, kind: str = CHAIN) -> Path:
    return Path(out) / "cells" / group_name(n_layers, num_chunks, seed, kind)


def study_folder(out: Path) -> StudyFolder:
    """The bias study's results folder (its manifest keeps the fingerprint under 'digest')."""
    return StudyFolder(out, cells="cells", key="digest", study="bias", tables=tuple(f"{t}.csv" for t in TABLES))


def _work(args) -> dict:
    cfg, out, kind, (L, k, seed) = args
    start, wall_start = time.perf_counter(), time.time()
    if kind == CHAIN:
        res, parts = run_group(cfg, L, k, seed), None
        tables = {"results": res.results, "checks": res.checks, "groups": res.facts, "convergence": res.convergence}
    else:
        res, parts = run_paper_group(cfg, L, k, seed)
        tables = {"paper": res.results, "checks": res.checks, "groups": res.facts}
    timing = {"kind": kind, "seconds": time.perf_counter() - start, "draws": res.draws, "started": wall_start,
              "finished": time.time()}
    if parts is not None:
        timing["parts"] = parts
    study_folder(out).write_cell(group_name(L, k, seed, kind), timing, tables)  # the timing file marks it done
    return timing


def gather(cfg: StudyConfig, out: Path) -> dict[str, pd.DataFrame]:
    """Every group's tables, concatenated and sorted into a fixed row order."""
    tables = {}
    for name, cols in TABLES.items():
        files = [Path(f"{group_stem(out, *g, kind)}.{name}.csv") for kind, g in all_groups(cfg)]
        parts = [df for f in files if f.exists() and len(df := read_csv(f, "group table", fix=REDO))]
        df = pd.concat(parts, ignore_index=True)[list(cols)] if parts else pd.DataFrame(columns=list(cols))
        tables[name] = df.sort_values(SORT_KEYS[name], kind="stable").reset_index(drop=True)
    return tables


def timing_summary(cfg: StudyConfig, out: Path) -> dict:
    """Worker seconds per part of the study (summed over groups) and per paper-settings (L, k), from the
    groups' timing files, and the Monte Carlo draws of each kind of group."""
    by_part, per_cell, draws = {}, {}, {CHAIN: 0, PAPER_KIND: 0}
    for kind, (L, k, seed) in all_groups(cfg):
        t = read_json(group_stem(out, L, k, seed, kind).with_suffix(".json"), "group record", fix=REDO)
        draws[kind] += t["draws"]
        if kind == CHAIN:
            by_part["chain_basis_grid"] = by_part.get("chain_basis_grid", 0.0) + t["seconds"]
            continue
        for part, sec in t["parts"].items():
            by_part[f"paper_{part}"] = by_part.get(f"paper_{part}", 0.0) + sec
            cell = per_cell.setdefault(f"L{L}_k{k}", {})
            cell[part] = cell.get(part, 0.0) + sec
    draws_per_sampler = cfg.paper_draws * len(cfg.paper_budgets) * len(cfg.paper_seeds)  # per (L, k)
    for cell in per_cell.values():
        for part in [p for p in cell if p.startswith("monte_carlo_")]:
            cell[f"{part}_seconds_per_draw"] = cell[part] / draws_per_sampler
    return {"worker_seconds_by_part": by_part, "paper_worker_seconds_by_cell": per_cell, "draws_by_kind": draws}


def run_study(cfg: StudyConfig, out: Path, jobs: int = 1, fresh: bool = False, progress: bool = True) -> dict:
    """Compute every missing group of ``cfg`` into ``out`` and gather the tables; returns the manifest."""
    out = Path(out)
    folder = study_folder(out)
    stored_record = (read_checked_bytes(folder.manifest_path, "study record", RECORD_MAX_BYTES)
                     if folder.manifest_path.is_file() else b"")
    old = folder.open(cfg.digest(), fresh)
    manifest = {"digest": cfg.digest(), "study_format": STUDY_FORMAT, "config": cfg.to_json(),
                "software": software_versions(), "status": "running"}
    groups = all_groups(cfg)
    todo = [(kind, g) for kind, g in groups if not folder.done(group_name(*g, kind))]
    print(f"bias study -> {out}: {len(groups)} groups ({len(cfg.paper_groups())} at the paper's settings), "
          f"{len(groups) - len(todo)} already done, {len(todo)} to compute with {worker_count(jobs, len(todo))} "
          f"worker(s); {cfg.draws} Monte Carlo draws per chain-basis cell and sampler, "
          + (f"{cfg.paper_draws} per paper-settings cell and sampler" if cfg.paper_groups() else
             "no paper-settings cells")
          + f" (the whole study: roughly {_duration(estimated_worker_seconds(cfg))} of worker time)", flush=True)
    folder.write_manifest(manifest)  # after the first line: a standard output that fails leaves the record as it was
    t0 = time.perf_counter()
    done_now = run_cells(_work, [(cfg, out, kind, g) for kind, g in todo], jobs=jobs, progress=progress,
                         desc="groups", done=len(groups) - len(todo))
    spans: dict[str, list[float]] = {}  # kind -> [first start, last end] in this run (epoch seconds)
    wall = time.perf_counter() - t0
    for t in done_now:
        span = spans.setdefault(t["kind"], [t["started"], t["finished"]])
        span[:] = [min(span[0], t["started"]), max(span[1], t["finished"])]

    # a rerun of a complete study (a fresh clone recomputes the committed one) keeps the stored tables, and the
    # record of the run that produced them, when it reproduces them up to float rounding (rerun_tables)
    with folder.gathering_cells([f"{name}.csv" for name in TABLES]):  # the groups as their workers wrote them
        check = write_tables(out, gather(cfg, out), compare=bool(old), floors=ROUNDING_FLOORS)
    summary = timing_summary(cfg, out)
    draws = sum(summary["draws_by_kind"].values())
    compute = sum(summary["worker_seconds_by_part"].values())
    chain_seconds = summary["worker_seconds_by_part"].get("chain_basis_grid", 0.0)
    manifest.update(status="complete", total_draws=draws, jobs=jobs, timing={
        "wall_seconds_this_run": wall, "groups_computed_this_run": len(todo), "compute_seconds": compute,
        "wall_seconds_by_kind_this_run": {k: v[1] - v[0] for k, v in sorted(spans.items())},
        **summary,
        "chain_draws_per_second_per_worker": summary["draws_by_kind"][CHAIN] / chain_seconds if chain_seconds else None,
    })
    # kept only when it records this very definition: a study.json edited by hand (its digest left as it was)
    # is written anew, not vouched for again (campaign 28, ST15)
    same = old.get("config") == json.loads(json.dumps(cfg.to_json()))
    if check.kept and old.get("status") == "complete" and same and run_totals_problem(old, cfg) is None:  # and the
        # run totals it can be checked on (campaign 31 U10: edited ones were written back as found)
        atomic_write(folder.manifest_path, stored_record)
    else:
        folder.write_manifest(manifest)
    rate = f"{len(todo)} groups" if todo else "nothing to compute"
    print(f"done in {wall:.1f} s wall ({rate}; {compute:.0f} s of worker time, of which "
          f"{compute - chain_seconds:.0f} s at the paper's settings); {check.summary()}", flush=True)
    return manifest


#: rough worker rates, measured on the committed study (one core): chain-basis draws per second, and seconds
#: per paper-settings draw at k = 128 (growing about as k squared)
CHAIN_DRAWS_PER_SECOND, PAPER_SECONDS_PER_DRAW_K128 = 10_000, 0.4


def estimated_worker_seconds(cfg: StudyConfig) -> float:
    """A rough estimate of the study's Monte Carlo worker time (the rest of a group is small beside it)."""
    samplers = len({variant.build().sampler.kind for variant in cfg.schemes})
    chain = cfg.draws_by_kind()[CHAIN] / CHAIN_DRAWS_PER_SECOND
    paper = sum(cfg.paper_draws * len(cfg.paper_budgets) * samplers * PAPER_SECONDS_PER_DRAW_K128 * (k / 128) ** 2
                for _, k, _ in cfg.paper_groups())
    return chain + paper


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:,.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:,.0f} h"


def check_cost(cfg: StudyConfig, force: bool = False) -> float:
    """Refuse (ValueError) a study estimated above :data:`COST_GUARD_HOURS` of worker time unless ``force``;
    returns the estimate in seconds."""
    seconds = estimated_worker_seconds(cfg)
    if seconds > COST_GUARD_HOURS * 3600 and not force:
        raise ValueError(f"this study would take about {seconds / 3600:,.0f} hours of worker time ({cfg.draws:,} draws "
                         f"per chain-basis cell and sampler, {cfg.paper_draws:,} per paper-settings cell), above the "
                         f"{COST_GUARD_HOURS} h guard; lower --draws / --paper-draws (defaults {DEFAULT.draws:,} and "
                         f"{DEFAULT.paper_draws:,}), or pass --force if you mean it")
    return seconds


def config_from_args(args) -> StudyConfig:
    """The study definition the command line asks for (ValueError on impossible draw counts, and on a study
    whose estimated cost is above the guard without --force)."""
    check_draws(args)
    cfg = replace(QUICK if args.quick else DEFAULT, arch=args.arch)
    if args.draws is not None:
        cfg = replace(cfg, draws=args.draws - args.draws % cfg.batches)
    if args.paper_draws is not None:
        cfg = (replace(cfg, paper_cells=()) if args.paper_draws == 0 else
               replace(cfg, paper_draws=args.paper_draws - args.paper_draws % cfg.paper_batches))
    check_cost(cfg, getattr(args, "force", False))
    return cfg


def run_from_args(args) -> int:
    """``seco-lab study bias``: run (or resume) the study into ``args.out``."""
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"seco-lab study bias: error: {e}", file=sys.stderr)
        return 2
    out = args.out
    if args.default_out and args.arch != "tiny":
        out = out.with_name(f"{out.name}_{args.arch}")
    jobs = args.jobs if args.jobs is not None else max(1, min(2, os.cpu_count() or 1))
    run_study(cfg, out, jobs=jobs, fresh=args.fresh, progress=args.progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``seco-lab bias-study`` (= ``seco-lab study bias``)."""
    from ..registry import STUDIES, build_study_parser

    return build_study_parser(STUDIES["bias"], prog="seco-lab bias-study")


def main(argv=None) -> int:
    """``seco-lab bias-study ...``, the same as ``seco-lab study bias ...``."""
    from ..registry import study_main

    return study_main(argv, prog="seco-lab bias-study")
