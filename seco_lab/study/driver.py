"""The resumable study driver and its command line.

    seco-lab bias-study [--quick] [--jobs 2] [--out DIR] [--draws N] [--fresh]

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
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

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
)
from .group import run_group
from .paper import run_paper_group
from .storage import atomic_write_csv, atomic_write_json, software_versions

TABLES = {"results": RESULT_COLUMNS, "paper": PAPER_COLUMNS, "checks": CHECK_COLUMNS, "groups": GROUP_COLUMNS,
          "convergence": CONVERGENCE_COLUMNS}
# rows sorted by these columns (then by every other key column): a fixed order whatever finished first
SORT_KEYS = {"results": ["L", "k", "seed", "t", "scheme", "metric"],
             "paper": ["L", "k", "seed", "t", "scheme", "metric"], "checks": ["L", "k", "seed", "t", "check"],
             "groups": ["L", "k", "seed", "metric"], "convergence": ["L", "k", "seed", "t", "scheme", "n"]}
# BLAS/OpenMP pools of worker processes: one thread each, so every sum is taken in the same order on every run
SINGLE_THREAD_ENV = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (flags, defaults worked out later)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class StudyDefinitionError(ValueError):
    """The output folder holds results of a different study definition."""


CHAIN, PAPER_KIND = "chain", "paper"  # the two kinds of group


def all_groups(cfg: StudyConfig) -> list[tuple[str, tuple[int, int, int]]]:
    """(kind, (L, k, seed)) of every group, the expensive paper-settings groups first."""
    return [(PAPER_KIND, g) for g in cfg.paper_groups()] + [(CHAIN, g) for g in cfg.groups()]


def group_stem(out: Path, n_layers: int, num_chunks: int, seed: int, kind: str = CHAIN) -> Path:
    prefix = "" if kind == CHAIN else f"{kind}_"
    return Path(out) / "cells" / f"{prefix}L{n_layers}_k{num_chunks}_s{seed}"


def group_done(out: Path, n_layers: int, num_chunks: int, seed: int, kind: str = CHAIN) -> bool:
    return group_stem(out, n_layers, num_chunks, seed, kind).with_suffix(".json").exists()


def _work(args) -> dict:
    cfg, out, kind, (L, k, seed) = args
    start, wall_start = time.perf_counter(), time.time()
    if kind == CHAIN:
        res, parts = run_group(cfg, L, k, seed), None
        tables = {"results": res.results, "checks": res.checks, "groups": res.facts, "convergence": res.convergence}
    else:
        res, parts = run_paper_group(cfg, L, k, seed)
        tables = {"paper": res.results, "checks": res.checks, "groups": res.facts}
    stem = group_stem(out, L, k, seed, kind)
    for name, df in tables.items():
        atomic_write_csv(df, Path(f"{stem}.{name}.csv"))
    timing = {"kind": kind, "seconds": time.perf_counter() - start, "draws": res.draws, "started": wall_start,
              "finished": time.time()}
    if parts is not None:
        timing["parts"] = parts
    atomic_write_json(timing, stem.with_suffix(".json"))  # written last: marks the group done
    return timing


@contextmanager
def _single_threaded_children():
    saved = {k: os.environ.get(k) for k in SINGLE_THREAD_ENV}
    os.environ.update(SINGLE_THREAD_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _prepare(cfg: StudyConfig, out: Path, fresh: bool) -> dict:
    """Check the folder against the definition, clear stale or discarded files, write the manifest."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for stale in (out / "cells").glob("*.tmp*"):  # left by an interrupted run
        stale.unlink()
    manifest_path = out / "study.json"
    digest = cfg.digest()
    if manifest_path.exists() and not fresh:
        old = json.loads(manifest_path.read_text())
        if old.get("digest") != digest:
            raise StudyDefinitionError(
                f"{out} holds results of a different study definition (digest {old.get('digest')} != {digest}); "
                "pass --fresh to discard them or --out to write elsewhere")
    if fresh:
        for f in (out / "cells").iterdir():
            f.unlink()
    manifest = {"digest": digest, "study_format": STUDY_FORMAT, "config": cfg.to_json(),
                "software": software_versions(), "status": "running"}
    atomic_write_json(manifest, manifest_path)
    return manifest


def gather(cfg: StudyConfig, out: Path) -> dict[str, pd.DataFrame]:
    """Every group's tables, concatenated and sorted into a fixed row order."""
    tables = {}
    for name, cols in TABLES.items():
        files = [Path(f"{group_stem(out, *g, kind)}.{name}.csv") for kind, g in all_groups(cfg)]
        parts = [df for f in files if f.exists() and len(df := pd.read_csv(f))]
        df = pd.concat(parts, ignore_index=True)[list(cols)] if parts else pd.DataFrame(columns=list(cols))
        tables[name] = df.sort_values(SORT_KEYS[name], kind="stable").reset_index(drop=True)
    return tables


def timing_summary(cfg: StudyConfig, out: Path) -> dict:
    """Worker seconds per part of the study (summed over groups) and per paper-settings (L, k), from the
    groups' timing files, and the Monte Carlo draws of each kind of group."""
    by_part, per_cell, draws = {}, {}, {CHAIN: 0, PAPER_KIND: 0}
    for kind, (L, k, seed) in all_groups(cfg):
        t = json.loads(group_stem(out, L, k, seed, kind).with_suffix(".json").read_text())
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
    manifest = _prepare(cfg, out, fresh)
    groups = all_groups(cfg)
    todo = [(kind, g) for kind, g in groups if not group_done(out, *g, kind)]
    print(f"bias study -> {out}: {len(groups)} groups ({len(cfg.paper_groups())} at the paper's settings), "
          f"{len(groups) - len(todo)} already done, {len(todo)} to compute with {jobs} worker(s); {cfg.draws} Monte "
          f"Carlo draws per chain-basis cell and sampler, {cfg.paper_draws} per paper-settings cell and sampler",
          flush=True)
    t0 = time.perf_counter()
    tasks = [(cfg, out, kind, g) for kind, g in todo]
    bar = tqdm(total=len(tasks), desc="groups", unit="group", disable=not progress)
    spans: dict[str, list[float]] = {}  # kind -> [first start, last end] in this run (epoch seconds)
    done_now = []
    if jobs > 1 and len(tasks) > 1:
        with _single_threaded_children(), get_context("spawn").Pool(jobs) as pool:
            for timing in pool.imap_unordered(_work, tasks):
                done_now.append(timing)
                bar.update()
    else:
        for task in tasks:
            done_now.append(_work(task))
            bar.update()
    bar.close()
    wall = time.perf_counter() - t0
    for t in done_now:
        span = spans.setdefault(t["kind"], [t["started"], t["finished"]])
        span[:] = [min(span[0], t["started"]), max(span[1], t["finished"])]

    for name, df in gather(cfg, out).items():
        atomic_write_csv(df, out / f"{name}.csv")
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
    atomic_write_json(manifest, out / "study.json")
    rate = f"{len(todo)} groups" if todo else "nothing to compute"
    print(f"done in {wall:.1f} s wall ({rate}; {compute:.0f} s of worker time, of which "
          f"{compute - chain_seconds:.0f} s at the paper's settings)", flush=True)
    return manifest


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="seco-lab bias-study", formatter_class=DefaultsHelpFormatter,
        description="The bias study: every SpaCO compensation scheme against the exact gradient, over a grid of "
                    "depths L, chunk counts k, budgets t and seeds. Resumable: a rerun skips finished groups.")
    ap.add_argument("--quick", action="store_true", help="small grid (2 depths, k in {4, 8}, 2 seeds), sub-minute")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="worker processes")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder, relative to the current directory (default: reports/bias_study, "
                         "reports/_work/bias_study_quick with --quick, suffixed _hf-... for an HF --arch)")
    ap.add_argument("--draws", type=int, default=None,
                    help=f"Monte Carlo draws per cell and sampler (default: {DEFAULT.draws}, {QUICK.draws} "
                         "with --quick; rounded down to a multiple of the batch count)")
    ap.add_argument("--paper-draws", type=int, default=None,
                    help=f"Monte Carlo draws per paper-settings cell and sampler (default: {DEFAULT.paper_draws}, "
                         f"{QUICK.paper_draws} with --quick; rounded down to a multiple of the batch count; 0 skips "
                         "the paper-settings groups)")
    ap.add_argument("--fresh", action="store_true", help="discard results already stored in --out")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--arch", default="tiny", choices=("tiny", "hf-llama", "hf-qwen2"),
                    help="model of every cell (HF architectures need the [hf] extra)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    cfg = replace(QUICK if a.quick else DEFAULT, arch=a.arch)
    if a.draws is not None:
        if a.draws < 2 * cfg.batches:
            ap.error(f"--draws must be at least {2 * cfg.batches} (two draws per batch of the jackknife)")
        cfg = replace(cfg, draws=a.draws - a.draws % cfg.batches)
    if a.paper_draws is not None:
        if a.paper_draws == 0:
            cfg = replace(cfg, paper_cells=())
        elif a.paper_draws < 2 * cfg.paper_batches:
            ap.error(f"--paper-draws must be 0 or at least {2 * cfg.paper_batches} (two draws per jackknife batch)")
        else:
            cfg = replace(cfg, paper_draws=a.paper_draws - a.paper_draws % cfg.paper_batches)
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    name = ("_work/bias_study_quick" if a.quick else "bias_study") + ("" if a.arch == "tiny" else "_" + a.arch)
    out = a.out if a.out is not None else Path("reports") / name
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file, not a folder: pass a folder path")
    try:
        run_study(cfg, out, jobs=a.jobs, fresh=a.fresh, progress=not a.no_progress)
    except StudyDefinitionError as e:
        ap.error(str(e))
    except OSError as e:
        print(f"{ap.prog}: error: cannot write the results to {out}: {e.strerror or e} "
              "(pass a writable folder with --out)", file=sys.stderr)
        return 2
    return 0
