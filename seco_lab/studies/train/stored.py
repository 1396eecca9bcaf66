"""The training study's stored results (``results.csv.gz``, ``runs.csv``, ``study.json``), read and refused unless
readable and consistent: :func:`load`."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...report.markdown import MissingResultsError, read_json_table, read_results_csv, require
from ...store import study_owner
from ..registry import STUDIES

__all__ = ["FINAL_METRICS", "PRODUCE_TRAIN", "RESULT_COLUMNS", "RUN_COLUMNS", "load"]

PRODUCE_TRAIN = STUDIES["train"].produce
RESULT_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "step", "metric", "distance", "value")
FINAL_METRICS = ("train_loss", "val_loss", "val_far_loss", "test_loss", "test_far_loss")  # every run, last step
RUN_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "steps_done")  # runs.csv has these and more



def load(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The stored study, refused unless readable and consistent: ``study.json`` is a JSON object, both
    tables parse with their columns, hold finite numbers (NaN only for a diverged run, or a far-token loss
    at a distance with no target), no repeated rows, one ``runs.csv`` row per run ``study.json`` counts,
    the same runs in both tables, and every run has every measurement of its arm's other runs."""
    folder = Path(folder)
    require(folder, STUDIES["train"].stored_files, PRODUCE_TRAIN)
    study = read_json_table(folder / "study.json", PRODUCE_TRAIN)
    owner = study_owner(study)
    if owner != "train":
        whose = f"the {owner} study's" if owner else "not a seco-lab study's record"
        raise MissingResultsError(f"{folder}/study.json is {whose}, not the training study's: pass the folder "
                                  f"`seco-lab study train` wrote with --results (or run {PRODUCE_TRAIN})")
    runs = read_results_csv(folder / "runs.csv", RUN_COLUMNS, PRODUCE_TRAIN,
                            text_columns=("run_id", "arm", "optimizer"), key=("run_id",), more_columns=True)
    done = study.get("runs_done", study.get("runs_total"))
    if isinstance(done, int) and len(runs) != done:
        raise MissingResultsError(f"{folder}/runs.csv has {len(runs)} runs, but study.json records {done}: the table "
                                  f"is incomplete or mixed; rerun {PRODUCE_TRAIN} (or assemble the finished runs with "
                                  "`seco-lab study train --collect-only`)")
    diverged = set(runs.run_id[runs["diverged"].astype(str) == "True"]) if "diverged" in runs else set()

    def unusable(d):  # rows whose NaN or inf is a measurement, not damage
        return d.run_id.isin(diverged) | d.metric.str.endswith("far_loss")

    results = read_results_csv(folder / "results.csv.gz", RESULT_COLUMNS, PRODUCE_TRAIN,
                               text_columns=("run_id", "arm", "optimizer", "metric"), nan_allowed=unusable,
                               inf_allowed=lambda d: d.run_id.isin(diverged),
                               key=("run_id", "step", "metric", "distance"))
    for missing, where in ((set(runs.run_id) - set(results.run_id), "results.csv.gz"),
                           (set(results.run_id) - set(runs.run_id), "runs.csv")):
        if missing:
            raise MissingResultsError(f"{folder}/{where} lacks {len(missing)} run(s) the other table holds (e.g. "
                                      f"{sorted(missing)[0]}): the results are incomplete or mixed; rerun "
                                      f"{PRODUCE_TRAIN}")
    keys = results[~results.run_id.isin(diverged)].groupby("run_id")[["step", "metric", "distance"]]
    have = {run: set(map(tuple, rows.itertuples(index=False))) for run, rows in keys}
    last = dict(zip(runs.run_id, runs.steps_done.astype(int)))
    for run, got in sorted(have.items()):  # what the tables of the report are made of: the last step's losses
        lacking = [m for m in FINAL_METRICS if (last[run], m, 0) not in got]
        if lacking:
            raise MissingResultsError(f"{folder}/results.csv.gz lacks {', '.join(lacking)} of run {run} at its last "
                                      f"step {last[run]}: the table is incomplete; rerun {PRODUCE_TRAIN}")
    arm_of = dict(zip(runs.run_id, runs.arm))
    for arm in sorted(set(arm_of.values())):
        sets = {run: have[run] for run in have if arm_of.get(run) == arm}
        union = set().union(*sets.values())
        for run, got in sorted(sets.items()):
            if got != union:
                step, metric, distance = sorted(union - got)[0]
                raise MissingResultsError(f"{folder}/results.csv.gz lacks {len(union - got)} measurement(s) of run "
                                          f"{run} (e.g. {metric} at step {step}, distance {distance}) that the arm's "
                                          f"other runs have: the table is incomplete; rerun {PRODUCE_TRAIN}")
    return results, runs, study
