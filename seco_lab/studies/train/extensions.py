"""Issue 22: the training study at equal compute, and a second configuration.

Compute is the cost model of :func:`seco_lab.stats.equal_compute.chunk_passes` (chunk passes per
sequence, a backward = 2 forwards) times the sequences per step, checked against the CPU time
of single-threaded steps by :func:`measure_costs` (``costs.csv``: the marginal CPU time per
sequence is the part that scales like FLOPs; the fixed per-step part is Python and tiny-kernel
overhead that a real model does not have).  With SeCO's c_0 and a SpaCO budget's c_t passes per
sequence and the study's B sequences per step:

* **SeCO at SpaCO's compute** -- fewer sequences per step, B_0 = round(B c_t / c_0) (the primary
  choice: same steps and schedule, and the case the equal-compute MSE describes), and fewer
  steps, S_0 = round(S c_t / c_0) with the schedule's shape (the alternative; cheap, so both run);
* **SpaCO at SeCO's compute** -- B_t = round(B c_0 / c_t) sequences per step in micro-batches of
  the study's size, one draw each (gradient accumulation, as the trainer does), for the best and
  the worst scheme at each budget and optimizer of the main study (test far-token loss);
* **truncated** -- every chunk backpropagated with the cache detached (g(0) only), B sequences;
* **replays** -- every main-study arm at its tuned rate, seed 0, rerun with the noise probes
  (``variance_groups``): the trajectories on which the equal-compute MSE is evaluated (a replay
  reproduces its main-study run: same seed, same draws; the report checks it).

The main study's stored results pick the best/worst schemes and the tuned rates, so these
configurations are a function of ``reports/training_study`` (run the main study first).

``second_config``: the same task with L = 4 layers (chains up to 4 hops, so 2-hop and deeper strata
exist), SeCO, truncated and the t = k/2 schemes best and worst in the main study, at equal steps and
at equal compute, at the main study's tuned rate of the same method (not re-tuned: compute).
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from seco_lab import TinyConfig, TinyTransformer
from seco_lab.stats.equal_compute import chunk_passes, equal_batches

from ...report.markdown import read_json_table, read_stored_csv
from .runner import Arm, gradient
from .study import StudyConfig, atomic_write_csv, quick_config
from .summary import summarize

__all__ = ["best_and_worst", "equal_compute_config", "extension_plan", "folder_configs", "folder_settings",
           "measure_costs", "near_rates", "second_config", "second_layers", "tier_folders", "tuned_rates"]

NOISE_PROBE = {"variance_groups": 4, "variance_draws": 4}
SECOND_LAYERS = 4  # the second configuration's model depth (its folder: second_L4)


def second_layers(main: StudyConfig) -> int:
    """The second configuration's layers: 4, or 2 for ``--quick``'s one-layer main study (fast)."""
    return 2 if main.fingerprint() == quick_config().fingerprint() else SECOND_LAYERS


def folder_settings(main: StudyConfig, folder: str, n_layers: int | None = None):
    """The settings of an extension folder's runs: the main study's with the noise probes (``equal_compute``),
    or with ``n_layers`` layers (``second_L4``; default :func:`second_layers`)."""
    s = main.settings
    if folder == "equal_compute":
        return replace(s, **NOISE_PROBE)
    if folder == "second_L4":
        return replace(s, model={**s.model, "n_layers": second_layers(main) if n_layers is None else n_layers})
    raise ValueError(f"no extension folder {folder!r}; use equal_compute or second_L4")


def near_rates(grid, rate: float, batch_ratio: float) -> tuple[float, ...]:
    """Two learning rates around ``rate`` (a tuned rate of the main study): it and its grid neighbour in the
    direction the batch moved (up for a larger batch, else down; at the grid's edge the other neighbour)."""
    grid = sorted(float(x) for x in grid)
    i = grid.index(float(rate))
    j = i + 1 if batch_ratio > 1 else i - 1
    if not 0 <= j < len(grid):
        j = 2 * i - j
    return tuple(sorted({grid[i], grid[j]})) if 0 <= j < len(grid) else (grid[i],)


def _main_tables(folder: Path) -> dict:
    """The main study's summary tables (computed once per folder and process)."""
    return _main_tables_cached(str(Path(folder).resolve()))


@functools.lru_cache(maxsize=4)
def _main_tables_cached(folder: str) -> dict:
    f = Path(folder)
    missing = [n for n in ("results.csv.gz", "runs.csv", "study.json") if not (f / n).exists()]
    if missing:
        raise FileNotFoundError(f"{f} lacks {missing}: run the main study first (`seco-lab study train --part main`)")
    produce = "the main study (`seco-lab study train --part main`)"
    return summarize(read_stored_csv(f / "results.csv.gz", produce), read_stored_csv(f / "runs.csv", produce),
                     read_json_table(f / "study.json", produce))


def tuned_rates(tabs: dict) -> dict[tuple[str, str], float]:
    """(arm name, optimizer) -> the tuned learning rate of a summarized study."""
    sel = tabs["selection"]
    return {(a, o): float(lr) for a, o, lr in sel.loc[sel.best, ["arm", "optimizer", "lr"]].itertuples(index=False)}


def best_and_worst(tabs: dict, optimizer: str, budget: int) -> tuple[str, str]:
    """The SpaCO schemes at ``budget`` with the lowest and highest mean test far-token loss (tuned rate)."""
    tab = tabs["table"]
    at = tab[(tab.optimizer == optimizer) & (tab["mode"] == "spaco") & (tab.budget == budget)]
    if at.empty:
        raise ValueError(f"the main study has no SpaCO arm at t={budget} for {optimizer}")
    at = at.sort_values("test_far_loss", kind="stable")
    return str(at.scheme.iloc[0]), str(at.scheme.iloc[-1])


def _tiers(main: StudyConfig, main_folder: Path) -> dict[str, list]:
    """The cells of every tier (name -> [(arm, optimizer, lrs, seeds)]), at the main study's tuned rates."""
    tabs = _main_tables(main_folder)
    rates = tuned_rates(tabs)
    s = main.settings
    k, B, S = s.task.num_chunks, s.batch_size, s.steps
    c0 = chunk_passes("seco", k)
    hi, lo = max(main.budgets), min(main.budgets)
    tiers: dict[str, list] = {name: [] for name in (
        "equal-compute", "equal-compute-spaco", f"replay-t{hi}", "equal-compute-worst", f"equal-compute-t{lo}",
        f"replay-t{lo}", "fewer-steps", "lr-neighbours")}
    for opt, grid in reversed(list(main.lrs.items())):  # sgd first (an interrupted earlier session ran adamw)
        seco_lr = rates[("seco", opt)]

        def add(tier, arm, rate, ratio, opt=opt, grid=grid):
            tiers[tier].append((arm, opt, (rate,), None))
            nb = [x for x in near_rates(grid, rate, ratio) if x != rate]
            tiers["lr-neighbours"] += [(arm, opt, (x,), None) for x in nb]

        for t in main.budgets:
            b0 = equal_batches(k, B, t)[0]
            add("equal-compute", Arm("seco", batch_size=b0), seco_lr, b0 / B)
        for t in (hi, lo):
            bt = equal_batches(k, B, t)[1]
            best, worst = best_and_worst(tabs, opt, t)
            for scheme, tier in {best: "equal-compute-spaco", worst: "equal-compute-worst"}.items():
                add(tier if t == hi else f"equal-compute-t{lo}", Arm("spaco", scheme, t, batch_size=bt),
                    rates[(Arm("spaco", scheme, t).name, opt)], bt / B)
        add("equal-compute-spaco", Arm("truncated"), seco_lr, 1.0)
        for t in main.budgets:
            add("fewer-steps", Arm("seco", steps=max(1, round(S * chunk_passes("spaco", k, t) / c0))), seco_lr, 1.0)
        for arm in main.arms:
            if arm.mode == "dense" or (arm.mode == "spaco" and arm.budget not in (hi, lo)):
                continue
            tier = f"replay-t{lo}" if arm.budget == lo else f"replay-t{hi}"
            tiers[tier].append((arm, opt, (rates[(arm.name, opt)],), (main.seeds[0],)))
    return tiers


def _cells_config(main: StudyConfig, settings, cells) -> StudyConfig:
    return StudyConfig(settings=settings, budgets=main.budgets, lrs=main.lrs, seeds=main.seeds, cells=tuple(cells))


def equal_compute_config(main: StudyConfig, main_folder: Path, tiers=None) -> StudyConfig:
    """The equal-compute folder's cells (every tier, or the named ones), with the noise probes."""
    all_tiers = _tiers(main, main_folder)
    cells = [c for name, cs in all_tiers.items() if tiers is None or name in tiers for c in cs]
    return _cells_config(main, folder_settings(main, "equal_compute"), cells)


def second_config(main: StudyConfig, main_folder: Path, n_layers: int = SECOND_LAYERS, tiers=None) -> StudyConfig:
    """The second configuration: ``n_layers`` layers, t = k/2 (module docstring).  Tier 'second': SeCO, the best
    scheme at equal steps, SeCO at its compute and it at SeCO's; tier 'second-more': truncated, the worst scheme."""
    tabs = _main_tables(main_folder)
    rates = tuned_rates(tabs)
    s = main.settings
    k, B = s.task.num_chunks, s.batch_size
    t = max(main.budgets)
    b0, bt = equal_batches(k, B, t)
    named: dict[str, list] = {"second": [], "second-more": []}
    for opt in main.lrs:
        best, worst = best_and_worst(tabs, opt, t)
        seco_lr, best_lr = rates[("seco", opt)], rates[(Arm("spaco", best, t).name, opt)]
        named["second"] += [(Arm("seco"), opt, (seco_lr,), None), (Arm("spaco", best, t), opt, (best_lr,), None),
                            (Arm("seco", batch_size=b0), opt, (seco_lr,), None),
                            (Arm("spaco", best, t, batch_size=bt), opt, (best_lr,), None)]
        named["second-more"] += [(Arm("truncated"), opt, (seco_lr,), None)]
        if worst != best:
            named["second-more"] += [(Arm("spaco", worst, t), opt, (rates[(Arm("spaco", worst, t).name, opt)],), None)]
    cells = [c for name, cs in named.items() if tiers is None or name in tiers for c in cs]
    return _cells_config(main, folder_settings(main, "second_L4", n_layers), cells)


def tier_folders(main: StudyConfig) -> list[tuple[str, str]]:
    """(tier, folder name) in run order; the names depend on the main study's budgets only (no files read)."""
    hi, lo = max(main.budgets), min(main.budgets)
    return [("equal-compute", "equal_compute"), ("equal-compute-spaco", "equal_compute"),
            (f"replay-t{hi}", "equal_compute"), ("second", "second_L4"), ("equal-compute-worst", "equal_compute"),
            (f"equal-compute-t{lo}", "equal_compute"), (f"replay-t{lo}", "equal_compute"),
            ("second-more", "second_L4"), ("fewer-steps", "equal_compute"), ("lr-neighbours", "equal_compute")]


def extension_plan(main: StudyConfig, main_folder: Path,
                   n_layers: int = SECOND_LAYERS) -> list[tuple[str, str, StudyConfig]]:
    """(tier, folder name, config) in the order the driver runs them (priority: the equal-compute verdict at
    the larger budget, its replays, the second configuration, then the rest)."""
    plan = []
    for tier, folder in tier_folders(main):
        cfg = second_config(main, main_folder, n_layers, (tier,)) if folder == "second_L4" else \
            equal_compute_config(main, main_folder, (tier,))
        plan.append((tier, folder, cfg))
    return plan


def folder_configs(main: StudyConfig, main_folder: Path, n_layers: int = SECOND_LAYERS) -> dict[str, StudyConfig]:
    """Folder name -> the union of its tiers (what the report reads)."""
    return {"equal_compute": equal_compute_config(main, main_folder),
            "second_L4": second_config(main, main_folder, n_layers)}


def measure_costs(cfg: StudyConfig, arms, batches=(8, 16, 32), reps: int = 7, seed: int = 0) -> pd.DataFrame:
    """CPU time of one gradient step (``time.process_time``, one thread), per arm and sequences per step,
    interleaved (arm after arm within a repetition), on the configuration's model at initialisation.
    Returns one row per (arm, batch): median seconds, the cost model's passes per step, and the fit
    cpu = a + b * batch per arm (b: the marginal CPU seconds per sequence)."""
    torch.set_num_threads(1)
    s = cfg.settings
    task = s.task
    model = TinyTransformer(TinyConfig(vocab_size=task.vocab_size, **s.model), seed=seed)
    data = {b: task.batch(seed, "train", 0, b) for b in batches}
    times: dict[tuple[str, int], list[float]] = {}
    methods = list(dict.fromkeys(Arm(a.mode, a.scheme, a.budget) for a in arms))
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        for arm in methods:
            for b in batches:
                t0 = time.process_time()
                gradient(model, arm, data[b], task.chunk_size, min(s.micro_batch, b), seed, rep)
                if rep:
                    times.setdefault((arm.name, b), []).append(time.process_time() - t0)
    rows = []
    for arm in methods:
        y = np.array([np.median(times[(arm.name, b)]) for b in batches])
        slope, icpt = np.polyfit(np.asarray(batches, dtype=float), y, 1)
        for b, v in zip(batches, y):
            rows.append({"arm": arm.name, "mode": arm.mode, "budget": arm.budget or 0, "batch": b, "cpu_s": float(v),
                         "passes": b * arm.passes(task.num_chunks), "cpu_s_per_seq": float(slope),
                         "cpu_s_fixed": float(icpt), "reps": reps})
    return pd.DataFrame(rows)


def write_costs(cfg: StudyConfig, out: Path, **kw) -> Path:
    """``measure_costs`` -> ``out/costs.csv`` (kept when it exists: a rerun measures nothing)."""
    path = Path(out) / "costs.csv"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_csv(path, measure_costs(cfg, cfg.arms, **kw))
    return path
