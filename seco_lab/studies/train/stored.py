"""The training study's stored results (``results.csv.gz``, ``runs.csv``, ``study.json``), read and refused unless
readable and consistent: :func:`load`."""

from __future__ import annotations

import math
import numbers
from pathlib import Path

import numpy as np
import pandas as pd

from ...report.markdown import MissingResultsError, read_json_table, read_results_csv, require
from ...store import study_owner
from ..registry import STUDIES
from .study import StudyConfig

__all__ = ["FINAL_METRICS", "PRODUCE_TRAIN", "RESULT_COLUMNS", "RUN_COLUMNS", "check_runs", "load", "recorded_design"]

PRODUCE_TRAIN = STUDIES["train"].produce
RESULT_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "step", "metric", "distance", "value")
FINAL_METRICS = ("train_loss", "val_loss", "val_far_loss", "test_loss", "test_far_loss")  # every run, last step
RUN_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "steps_done")  # runs.csv has these and more
#: the columns of results.csv.gz that repeat the run's identity
RESULT_IDENTITY = ("arm", "optimizer", "lr", "seed")


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
    check_runs(folder, runs, results, study, PRODUCE_TRAIN)
    return results, runs, study


def recorded_design(folder: Path, study: dict, produce: str) -> StudyConfig:
    """The study ``folder/study.json`` records (its design, read back by :meth:`StudyConfig.from_dict`), refused
    unless it reads back as recorded and matches the record's fingerprint."""
    try:
        cfg = StudyConfig.from_dict(study["design"])
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        why = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
        raise MissingResultsError(f"{folder}/study.json records no study design that reads back ({why[:160]}): the "
                                  f"record is damaged or was edited; rerun {produce}") from None
    if cfg.fingerprint() != study.get("fingerprint"):
        raise MissingResultsError(f"{folder}/study.json: its design has fingerprint {cfg.fingerprint()}, but the "
                                  f"record says {study.get('fingerprint')!r}: the record was edited; rerun {produce}")
    return cfg


def _same(got, want) -> bool:
    if isinstance(want, str):
        return ("" if got is None or (isinstance(got, float) and math.isnan(got)) else str(got)) == want
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def check_runs(folder: Path, runs: pd.DataFrame, results: pd.DataFrame, study: dict, produce: str) -> StudyConfig:
    """Every run of ``runs.csv`` and ``results.csv.gz`` is a run of the study ``study.json`` records, and its row
    agrees with what its ``run_id`` fixes (:meth:`RunSpec.record`: arm, optimizer, lr, seed, mode, scheme, budget,
    steps, batch size, chunk passes; :meth:`Arm.backprop_chunks`: chunks backpropagated per step; the steps done:
    all of them unless it diverged); else refused, naming the file, the run and the field (a row edited by hand
    would move the run into another arm or change its compute)."""
    folder = Path(folder)
    cfg = recorded_design(folder, study, produce)
    specs = {s.run_id: s for s in cfg.runs()}
    k = cfg.settings.task.num_chunks
    where = f"{folder}/runs.csv"
    for name, table, columns in (("runs.csv", runs, RUN_COLUMNS), ("results.csv.gz", results, ("run_id",))):
        lacking = [c for c in columns if c not in table]
        if lacking:
            raise MissingResultsError(f"{folder}/{name} lacks the column(s) {lacking}: it was written by another "
                                      f"version or is damaged; rerun {produce}")
    repeated = runs.run_id[runs.run_id.duplicated()]
    if len(repeated):
        raise MissingResultsError(f"{where} holds run {repeated.iloc[0]} twice: the table is damaged or mixed; "
                                  f"rerun {produce}")

    def refuse(line: int, run: str, field: str, got, want: str):
        raise MissingResultsError(f"{where} line {line} (run {run}): {field} is {got!r}, but run {run} {want}: the "
                                  f"row was edited or damaged; rerun {produce}")

    for i, row in enumerate(runs.to_dict("records")):
        run, line = row["run_id"], i + 2  # line 1: the header
        spec = specs.get(run)
        if spec is None:
            raise MissingResultsError(f"{where} line {line}: run {run} is not a run of the study {folder}/study.json "
                                      f"records: the table was edited or is from another study; rerun {produce}")
        want = spec.record(cfg.settings)
        for field, value in want.items():
            if field in row and not _same(row[field], value):
                refuse(line, run, field, row[field], f"has {field} {value!r}")
        lo, hi = spec.arm.backprop_chunks(k)
        got = row.get("backprop_chunks_per_step")
        if got is not None and not (isinstance(got, numbers.Real) and lo - 1e-9 <= got <= hi + 1e-9):
            refuse(line, run, "backprop_chunks_per_step", got, f"backpropagates {lo:g} of its k = {k} chunks per step"
                   if lo == hi else f"backpropagates {lo:g} to {hi:g} chunks per step")
        steps, done, diverged = want["steps"], row["steps_done"], str(row.get("diverged")) == "True"
        if not (isinstance(done, numbers.Real) and (done == steps or (diverged and 1 <= done <= steps))):
            refuse(line, run, "steps_done", done, f"has {steps} steps" + ("" if diverged else " and did not diverge"))
    stored = list(results.run_id.unique())
    stray = sorted(str(r) for r in set(stored) - set(specs))
    if stray:
        raise MissingResultsError(f"{folder}/results.csv.gz holds run {stray[0]}, which is not a run of the study "
                                  f"{folder}/study.json records: the table was edited or is from another study; "
                                  f"rerun {produce}")
    cols = [c for c in RESULT_IDENTITY if c in results]
    want = pd.DataFrame([{"run_id": r, **{c: specs[r].record(cfg.settings)[c] for c in cols}} for r in stored])
    merged = results[["run_id", *cols]].merge(want, on="run_id", how="left", suffixes=("", "_want"))
    for c in cols:
        if c in ("lr", "seed"):
            bad = ~np.isclose(pd.to_numeric(merged[c], errors="coerce"), merged[c + "_want"].astype(float),
                              rtol=1e-9, atol=1e-12)
        else:
            bad = merged[c].astype(str) != merged[c + "_want"].astype(str)
        if bad.any():
            r = merged[bad].iloc[0]
            raise MissingResultsError(f"{folder}/results.csv.gz: {int(bad.sum())} row(s) of run {r.run_id} give {c} "
                                      f"{r[c]!r}, but run {r.run_id} has {c} {r[c + '_want']!r}: the table was edited "
                                      f"or damaged; rerun {produce}")
    return cfg
