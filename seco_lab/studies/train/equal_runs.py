"""What the equal-compute extension ran and what it cost: the cost model against measured CPU time, the
extension plan's tiers with their finished runs, and each folder's wall and CPU time."""

from __future__ import annotations

import math
from pathlib import Path

from ...report.markdown import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    left_out,
    read_json_table,
    read_results_csv,
    read_stored_csv,
)
from .equal_finals import EXTENSION_FOLDERS, PRODUCE_EXTENSIONS
from .equal_format import fmt, md_table

__all__ = ["costs_lines", "what_ran"]

#: the columns of ``costs.csv`` (:func:`seco_lab.studies.train.extensions.write_costs`)
COST_COLUMNS = ("arm", "mode", "budget", "batch", "cpu_s", "passes", "cpu_s_per_seq", "cpu_s_fixed", "reps")


def costs_lines(folder: Path, k: int) -> list[str]:
    """The cost model against measured CPU time (costs.csv)."""
    path = Path(folder) / "equal_compute" / "costs.csv"
    if not path.exists():  # the tier always writes it: said, not dropped (campaign 22 TS17)
        return [left_out("the cost model against measured CPU time", "equal_compute/costs.csv", "does not exist",
                         PRODUCE_EXTENSIONS), ""]
    if not len(read_stored_csv(path, PRODUCE_EXTENSIONS)):  # a header alone: nothing measured, said as such
        return [left_out("the cost model against measured CPU time", "equal_compute/costs.csv",
                         "has no SeCO row at B = 16 to compare with", PRODUCE_EXTENSIONS), ""]
    c = read_results_csv(path, COST_COLUMNS, PRODUCE_EXTENSIONS, text_columns=("arm", "mode"), key=("arm", "batch"),
                         ranges={"batch": COUNT, "budget": NON_NEGATIVE, "cpu_s": POSITIVE, "passes": POSITIVE,
                                 "reps": COUNT})
    if "seco" not in set(c.arm) or 16 not in set(c[c.arm == "seco"].batch):
        return [left_out("the cost model against measured CPU time", "equal_compute/costs.csv",
                         "has no SeCO row at B = 16 to compare with", PRODUCE_EXTENSIONS), ""]
    ref = c[c.arm == "seco"].set_index("batch")
    rows = []
    for arm, g in c.groupby("arm", sort=False):
        g = g.set_index("batch")
        common = sorted(set(g.index) & set(ref.index))  # compared at a batch both measured: B = 16 when it can be
        if not common:
            rows.append([arm, "no batch in common with SeCO", "", "", "", ""])
            continue
        b = 16 if 16 in common else common[len(common) // 2]
        at = "" if b == 16 else f" (at B = {b})"
        rows.append([arm, fmt(g.passes.loc[b] / ref.passes.loc[b], 3) + at,
                     fmt(g.cpu_s.loc[b] / ref.cpu_s.loc[b], 3) + at,
                     fmt(g.cpu_s_per_seq.iloc[0] / ref.cpu_s_per_seq.iloc[0], 3),
                     fmt(1000 * g.cpu_s.loc[b], 1) + at, fmt(1000 * g.cpu_s_fixed.iloc[0], 1)])
    return (["**The cost model against measured CPU time** (`costs.csv`: one process, one thread, CPU time of one "
             f"gradient step at initialisation, median of {int(c.reps.iloc[0])} interleaved repetitions, B ∈ "
             + "{" + ", ".join(str(int(b)) for b in sorted(c.batch.unique())) + "}"
             + "; a line cpu = fixed + per-sequence × B fitted per arm). Ratios to SeCO:", ""]
            + md_table(["arm", "cost model (passes)", "measured CPU at B = 16", "measured CPU per extra sequence",
                        "ms per step at B = 16", "fixed ms per step"], rows)
            + ["On this toy model a step's CPU time is mostly fixed overhead (Python, kernel launches on 8-token "
               "chunks), which a real model does not have, so compute here is the cost model (chunk passes, a "
               "backward = 2 forwards), which the FLOPs of a real model follow; the table shows how far the toy's "
               "CPU time agrees. Schemes with a hop-dependent relay (`falling-factorial`, `bernoulli`, "
               "`released-unbiased` at some t) keep one relay buffer per hop count and cost more than the model "
               "says; that extra is not charged to them here.", ""])


def what_ran(folder: Path, study: dict) -> list[str]:
    """Every tier of the extension plan with its finished runs, the folders' wall and CPU time, how to resume."""
    from .extensions import extension_plan
    from .study import StudyConfig

    lines = ["### What ran", "",
             "Issue 22's runs go in tiers, in priority order (`seco_lab.studies.train.extensions.extension_plan`); "
             "every tier is resumable and the report uses whatever finished.", ""]
    try:
        main = StudyConfig()
        if main.fingerprint() != study.get("fingerprint"):
            raise ValueError("not the default study")
        plan = extension_plan(main, folder)
    except (ValueError, KeyError, FileNotFoundError):
        plan = []
    rows, finished = [], {}
    for tier, sub, cfg in plan:
        if sub not in finished:  # the assembled table (the per-run files are not committed)
            table = Path(folder) / sub / "runs.csv"
            finished[sub] = set(read_stored_csv(table, PRODUCE_EXTENSIONS).run_id) if table.exists() else set()
        specs = cfg.runs()
        done = sum(s.run_id in finished[sub] for s in specs)
        arms = ", ".join(dict.fromkeys(f"{a.name} ({o})" for a, o, _, _ in cfg.cells))
        rows.append([tier, sub, f"{done}/{len(specs)}", arms])
    if rows:
        lines += md_table(["tier", "folder", "runs done", "cells"], rows)
    lines += [" ".join(_status_line(folder, s) for s in EXTENSION_FOLDERS.values()), "",
              "Resume (skips every finished run): `seco-lab study train --part extensions --jobs 2` "
              "(or `make train-study`, which also checks the main study), then `seco-lab report train`.", ""]
    return lines


def _status_line(folder: Path, sub: str) -> str:
    p = Path(folder) / sub / "study.json"
    if not p.exists():
        return f"`{sub}`: not run, or its results removed (no `{sub}/study.json` in the results folder)."
    s = read_json_table(p, PRODUCE_EXTENSIONS)
    return (f"`{sub}`: {s.get('runs_done')} of {s.get('runs_total')} runs ({s.get('status')}), wall time "
            f"{fmt(s.get('study_wall_s', math.nan) / 60, 1)} min over {len(s.get('sessions', []))} sessions, "
            f"{s.get('jobs')} worker processes; sum of per-run CPU time "
            f"{fmt(_cpu_total(Path(folder) / sub) / 60, 1)} min.")


def _cpu_total(folder: Path) -> float:
    runs = read_stored_csv(folder / "runs.csv", PRODUCE_EXTENSIONS) if (folder / "runs.csv").exists() else None
    return float(runs.cpu_s.sum()) if runs is not None and "cpu_s" in runs else math.nan
