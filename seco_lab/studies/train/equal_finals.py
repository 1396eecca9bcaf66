"""Per-run final numbers and compute of the training study's equal-compute extension folders.

Compute of a run = steps x sequences per step x chunk passes per sequence (the cost model of
:mod:`seco_lab.stats.equal_compute`), relative to the main study's SeCO run (S x B x (4k - 1)); an arm's numbers
are at its tuned rate (lowest mean validation far-token loss among the rates it ran, as in the main study).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

from seco_lab.stats.equal_compute import chunk_passes

from ...report.markdown import MissingResultsError, read_json_table, read_stored_csv
from .summary import select_lr

__all__ = ["EXTENSION_FOLDERS", "TIER_FILES", "arm_fields", "check_tiers", "extension_finals", "load_folder",
           "run_finals", "run_finals_from_main", "tier_state", "tuned"]

EXTENSION_FOLDERS = {"equal_compute": "equal_compute", "second": "second_L4"}
#: the command that writes the extension folders (named when a stored file of one is refused)
PRODUCE_EXTENSIONS = "`seco-lab study train --part extensions`"


#: the files of a finished extension tier (its tables are written when its last run ends)
TIER_FILES = ("results.csv.gz", "runs.csv", "study.json")


def tier_state(folder: Path) -> str | None:
    """None when the extension tier ``folder`` holds its tables; else why its section is left out (for the report's
    "Left out" line: nothing there, an empty folder, no tables yet).  A link to nothing or a file in the folder's
    place is a :class:`MissingResultsError`: taken for absent, its section would go without a word (campaign 22)."""
    folder = Path(folder)
    if folder.is_symlink() and not folder.exists():
        raise MissingResultsError(f"{folder} is a link to nothing (to {os.readlink(folder)}): put the tier's results "
                                  f"there, or rerun {PRODUCE_EXTENSIONS}")
    if folder.exists() and not folder.is_dir():
        raise MissingResultsError(f"{folder} is not a folder: move it away, or rerun {PRODUCE_EXTENSIONS}")
    if not folder.exists():
        return "does not exist (the tier was not run, or its folder was removed)"
    lacking = [f for f in TIER_FILES if not (folder / f).exists()]
    if len(lacking) == len(TIER_FILES):
        return "holds none of its tables (not run, or its results removed)"
    if lacking:
        return f"lacks {', '.join(lacking)} (a tier not finished, or a file removed)"
    return None


def load_folder(folder: Path):
    """An extension tier's (results, runs, study), or None when :func:`tier_state` says it is left out."""
    folder = Path(folder)
    if tier_state(folder) is not None:
        return None
    return (read_stored_csv(folder / "results.csv.gz", PRODUCE_EXTENSIONS),
            read_stored_csv(folder / "runs.csv", PRODUCE_EXTENSIONS),
            read_json_table(folder / "study.json", PRODUCE_EXTENSIONS))


def _first_difference(got: dict, want: dict, prefix: str = "") -> tuple[str, object, object]:
    """The first (dotted key, got, wanted) where two recorded designs differ (None for a missing key)."""
    for key in sorted(set(got) | set(want), key=lambda k: (k not in ("settings", "model", "task"), k)):
        g, w = got.get(key), want.get(key)
        if isinstance(g, dict) and isinstance(w, dict):
            found = _first_difference(g, w, f"{prefix}{key}.")
            if found:
                return found
        elif json.dumps(g, sort_keys=True) != json.dumps(w, sort_keys=True):
            return f"{prefix}{key}", g, w
    return None


def check_tiers(folder: Path, study: dict) -> None:
    """Each extension folder under ``folder`` (the main study, whose record is ``study``) is that tier of this
    study, and its runs are what their ids say; else refused, naming the folder and the difference:

    * its ``study.json`` records the tier's settings (:func:`~.extensions.folder_settings`: ``equal_compute`` the
      main study's task and model with the noise probes, ``second_L4`` the main study's with 4 layers) and the main
      study's budgets, learning-rate grid and seeds; a folder swapped with the other tier's, or copied from another
      study, is "from another tier or study";
    * ``runs.csv`` has the runs ``study.json`` counts, and every row of it and of ``results.csv.gz`` agrees with
      its ``run_id`` (:func:`.stored.check_runs`)."""
    from .extensions import _cells_config, folder_settings
    from .stored import PRODUCE_TRAIN, check_runs, recorded_design

    folder = Path(folder)
    main = recorded_design(folder, study, PRODUCE_TRAIN)
    for sub in EXTENSION_FOLDERS.values():
        loaded = load_folder(folder / sub)
        if loaded is None:
            continue
        results, runs, tier_study = loaded
        path = folder / sub
        tier = recorded_design(path, tier_study, PRODUCE_EXTENSIONS)
        want = _cells_config(main, folder_settings(main, sub), tier.cells or ())
        diff = _first_difference(tier.to_dict(), want.to_dict())
        if diff:
            key, got, wanted = diff
            raise MissingResultsError(f"{path}/study.json records {key} = {json.dumps(got)}, but the {sub} tier of "
                                      f"the study in {folder} has {json.dumps(wanted)}: the folder is from another "
                                      f"tier or study; rerun {PRODUCE_EXTENSIONS} for the study in {folder}")
        done = tier_study.get("runs_done")
        if isinstance(done, int) and len(runs) != done:
            raise MissingResultsError(f"{path}/runs.csv has {len(runs)} runs, but {path}/study.json records {done}: "
                                      f"the table is incomplete or mixed; rerun {PRODUCE_EXTENSIONS}")
        check_runs(path, runs, results, tier_study, PRODUCE_EXTENSIONS)


def arm_fields(name: str) -> dict:
    """mode, scheme, budget, batch and steps override of an arm name ('seco B=10', 'paper t=4 B=25', ...)."""
    parts = name.split(" ")
    out = {"base": " ".join(p for p in parts if not p.startswith(("B=", "steps="))), "batch_size": 0, "steps_o": 0}
    for p in parts:
        if p.startswith("B="):
            out["batch_size"] = int(p[2:])
        if p.startswith("steps="):
            out["steps_o"] = int(p[6:])
    return out


def run_finals(results: pd.DataFrame, runs: pd.DataFrame, settings: dict) -> pd.DataFrame:
    """One row per run: last-step validation and test far-token loss (NaN when diverged), compute."""
    k, B, S = settings["task"]["num_chunks"], settings["batch_size"], settings["steps"]
    runs = runs.copy()
    f = pd.DataFrame([arm_fields(a) for a in runs.arm])
    runs["base"] = f.base.to_numpy()
    if "steps" not in runs:
        runs["steps"] = S
    if "batch_size" not in runs:
        runs["batch_size"] = B
    runs["steps"] = runs["steps"].fillna(S).astype(int)
    runs["batch_size"] = runs["batch_size"].fillna(B).astype(int)
    passes = [chunk_passes(m, k, b if m == "spaco" else None) for m, b in zip(runs["mode"], runs.budget)]
    runs["rel_compute"] = runs.steps * runs.batch_size * np.asarray(passes) / (S * B * chunk_passes("seco", k))
    if "cpu_s" not in runs:
        runs["cpu_s"] = np.nan
    runs["cpu_ms_per_step"] = runs.cpu_s / runs.steps_done * 1000
    r = results[(results.distance == 0) & results.metric.isin(["val_far_loss", "test_far_loss"])]
    r = r.merge(runs[["run_id", "steps"]], on="run_id")
    last = r[r.step == r.steps].pivot_table(index="run_id", columns="metric", values="value").reset_index()
    out = runs.merge(last, on="run_id", how="left")
    for m in ("val_far_loss", "test_far_loss"):
        if m not in out:
            out[m] = np.nan
        out.loc[out.diverged.astype(bool), m] = np.nan
    return out


def extension_finals(folder: Path, sub: str, main_final: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """Finals of an extension folder; for 'equal_compute' the main study's runs are added (the arms at
    equal steps) and the replays left out (they only carry the probes, see ``prediction_table``)."""
    loaded = load_folder(Path(folder) / sub)
    if loaded is None:
        return None
    results, runs, study = loaded
    fin = run_finals(results, runs, study["design"]["settings"]).assign(source=sub)
    if main_final is not None:
        fin = pd.concat([main_final.assign(source="main"), fin[~fin.arm.isin(set(main_final.arm))]],
                        ignore_index=True)
    return fin


def run_finals_from_main(main_final: pd.DataFrame, settings: dict) -> pd.DataFrame:
    """The main study's ``final`` table with the compute columns of ``run_finals``."""
    k = settings["task"]["num_chunks"]
    f = main_final.copy()
    f["steps"], f["batch_size"] = settings["steps"], settings["batch_size"]
    f["base"] = f.arm
    passes = [chunk_passes(m, k, b if m == "spaco" else None) for m, b in zip(f["mode"], f.budget)]
    f["rel_compute"] = np.asarray(passes) / chunk_passes("seco", k)
    f["cpu_ms_per_step"] = np.nan
    return f


def tuned(final: pd.DataFrame) -> pd.DataFrame:
    """Runs at each (arm, optimizer)'s tuned rate."""
    sel = select_lr(final.assign(val_far_loss=final.val_far_loss))
    best = sel.loc[sel.best, ["arm", "optimizer", "lr"]]
    return final.merge(best, on=["arm", "optimizer", "lr"])
