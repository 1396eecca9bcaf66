"""The study driver: the grid (arms x optimizers x learning rates x seeds), resumable, in a process pool
(``seco-lab study train [--quick] [--jobs 2] [--out DIR] [--fresh] [--collect-only]``).

Each run is written atomically to ``OUT/runs/<run_id>.csv`` (tidy rows) and ``.json`` (summary) as
soon as it finishes; a rerun skips every run whose files exist, provided the study definition is
unchanged (its fingerprint is checked against ``OUT/study.json``).  ``collect`` assembles
``OUT/results.csv.gz`` -- one row per run x step x metric x distance -- and ``OUT/runs.csv``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from ...store import (
    RECORD_MAX_BYTES,
    DefinitionMismatch,
    StudyFolder,
    atomic_write_csv,
    check_tables_unedited,
    fingerprint,
    read_csv,
    read_json,
    software_versions,
)
from ..runner import run_cells
from .runner import Arm, RunSpec, TrainSettings, train_run
from .task import RecallTask

__all__ = [
    "StudyConfig", "collect", "default_arms", "quick_config", "run_study",
    "study_folder",
]

SPACO_SCHEMES = ("paper", "paper-capped", "released", "released-unbiased", "falling-factorial", "bernoulli")


def default_arms(num_chunks: int, budgets) -> tuple[Arm, ...]:
    """dense, SeCO, and every SpaCO scheme at every budget -- except ``paper-capped`` where its cap
    (C = 2) does not bind (k/t <= 2): there it is ``paper`` step for step, draws included."""
    arms = [Arm("dense"), Arm("seco")]
    for t in budgets:
        for s in SPACO_SCHEMES:
            if s == "paper-capped" and num_chunks / t <= 2:
                continue
            arms.append(Arm("spaco", s, int(t)))
    return tuple(arms)


@dataclass
class StudyConfig:
    settings: TrainSettings = field(default_factory=lambda: TrainSettings(
        task=RecallTask(num_chunks=8, chunk_size=8, vocab_size=32, distances=(1, 4, 7), pairs=3),
        steps=250, micro_batch=16, eval_every=25, probe_every=50, val_sequences=96))
    budgets: tuple[int, ...] = (4, 2)  # t/k = 1/2 and 1/4 at k = 8
    lrs: dict = field(default_factory=lambda: {"adamw": (1e-3, 3e-3, 1e-2), "sgd": (0.1, 0.3, 1.0)})
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[Arm, ...] | None = None  # None: default_arms(k, budgets)
    # explicit cells (arm, optimizer, learning rates, seeds or None = all) instead of arms x lrs x seeds
    cells: tuple[tuple[Arm, str, tuple[float, ...], tuple[int, ...] | None], ...] | None = None

    def __post_init__(self):
        if self.cells is not None:
            self.cells = tuple((a, o, tuple(float(x) for x in lrs), None if sd is None else tuple(sd))
                               for a, o, lrs, sd in self.cells)
            arms = list(dict.fromkeys(c[0] for c in self.cells))
            if self.arms is not None and list(self.arms) != arms:
                raise ValueError("pass either cells or arms, not both")
            self.arms = tuple(arms)
        if self.arms is None:
            self.arms = default_arms(self.settings.task.num_chunks, self.budgets)
        k = self.settings.task.num_chunks
        for t in self.budgets:
            if not 1 <= t <= k:
                raise ValueError(f"budget {t} must lie in [1, num_chunks={k}]")
        if len(self.seeds) < 2:
            raise ValueError("the study needs >= 2 seeds for an interval")

    def runs(self) -> list[RunSpec]:
        """Seeds outermost, so an interrupted study has whole seeds first."""
        if self.cells is not None:
            return [RunSpec(arm, opt, lr, seed) for seed in self.seeds for arm, opt, lrs, seeds in self.cells
                    if seeds is None or seed in seeds for lr in lrs]
        return [RunSpec(arm, opt, float(lr), seed) for seed in self.seeds for opt, grid in self.lrs.items()
                for lr in grid for arm in self.arms]

    @classmethod
    def from_dict(cls, design: dict) -> StudyConfig:
        """The study a ``study.json`` design records (the inverse of :meth:`to_dict`); ValueError, KeyError or
        TypeError when it does not read back as recorded."""
        arms = tuple(Arm.from_record(a) for a in design["arms"])
        by_name = {a.name: a for a in arms}
        cells = design.get("cells")
        if cells is not None:
            cells = tuple((by_name[c["arm"]], c["optimizer"], tuple(c["lrs"]),
                           None if c["seeds"] is None else tuple(c["seeds"])) for c in cells)
        cfg = cls(settings=TrainSettings.from_dict(design["settings"]), budgets=tuple(design["budgets"]),
                  lrs={o: tuple(v) for o, v in design["lrs"].items()}, seeds=tuple(design["seeds"]),
                  arms=arms if cells is None else None, cells=cells)
        if json.dumps(cfg.to_dict(), sort_keys=True) != json.dumps(design, sort_keys=True):
            raise ValueError("the design does not read back as recorded")
        return cfg

    def to_dict(self) -> dict:
        d = {"settings": self.settings.to_dict(), "budgets": list(self.budgets),
             "lrs": {k: list(v) for k, v in self.lrs.items()}, "seeds": list(self.seeds),
             "arms": [{"name": a.name, **a.definition()} for a in self.arms]}
        if self.cells is not None:
            d["cells"] = [{"arm": a.name, "optimizer": o, "lrs": list(lrs), "seeds": None if sd is None else list(sd)}
                          for a, o, lrs, sd in self.cells]
        return d

    def fingerprint(self) -> str:
        """Hash of the definition.  A study of explicit cells hashes only its settings (what a run's result
        depends on besides its run id), so cells can be added to a folder, or run in tiers, and resumed."""
        return fingerprint(self.to_dict() if self.cells is None else {"settings": self.settings.to_dict(),
                                                                      "design": "cells"})


def quick_config() -> StudyConfig:
    """A few seconds per run: every arm and optimizer, a tiny grid, 2 seeds (the test's configuration)."""
    s = TrainSettings(task=RecallTask(num_chunks=4, chunk_size=6, vocab_size=16, distances=(1, 3), pairs=2),
                      model=dict(d_model=16, n_layers=1, n_heads=2, d_ff=32), steps=6, batch_size=4, micro_batch=2,
                      warmup=2, eval_every=3, probe_every=3, val_sequences=16, test_sequences=16, probe_sequences=4)
    return StudyConfig(settings=s, budgets=(2, 1), lrs={"adamw": (1e-2,), "sgd": (0.1,)}, seeds=(0, 1))


def study_folder(out: Path) -> StudyFolder:
    """The results folder: ``study.json`` and one ``runs/<run_id>.csv`` + ``.json`` pair per finished run."""
    return StudyFolder(out, cells="runs", key="fingerprint", keeps=("costs.csv",),  # extensions.write_costs: first
                       study="train", tables=("results.csv.gz", "runs.csv"))


def _work(args) -> dict:
    """One run in a worker: one thread (the pool already fills the cores), results written atomically."""
    spec, settings, out = args
    folder = study_folder(out)
    if folder.done(spec.run_id):  # finished meanwhile by another process (an earlier, interrupted driver's worker)
        return folder.read_cell(spec.run_id)
    torch.set_num_threads(1)
    rows, summary = train_run(spec, settings)
    df = pd.DataFrame(rows)
    for pos, key in enumerate(("run_id", "arm", "optimizer", "lr", "seed")):
        df.insert(pos, key, summary[key])
    study_folder(out).write_cell(spec.run_id, summary, {"rows": df}, table_suffix=".csv")  # .json last: done
    return summary


def run_study(cfg: StudyConfig, out: Path, jobs: int = 2, fresh: bool = False, progress: bool = True) -> dict:
    """Run every missing run of ``cfg`` into ``out``; returns the study record (also ``out/study.json``)."""
    out = Path(out)
    folder = study_folder(out)
    old = folder.open(cfg.fingerprint(), fresh)
    specs = cfg.runs()
    todo = [s for s in specs if not folder.done(s.run_id)]
    started = time.time()
    meta = {"fingerprint": cfg.fingerprint(), "design": cfg.to_dict(), "software": software_versions(),
            "runs_total": len(specs), "jobs": jobs, "study_wall_s": old.get("study_wall_s", 0.0),
            "sessions": old.get("sessions", []), "session_started_at": started}
    folder.write_manifest({**meta, "status": "running"})
    run_cells(_work, [(s, cfg.settings, out) for s in todo], jobs=jobs, progress=progress, desc="train-study runs",
              done=len(specs) - len(todo))
    runs = collect(out, specs)
    session = time.time() - started
    # wall time of the whole study: every session that completed (an interrupted one is not counted)
    meta.update(status="complete", runs_done=len(runs), study_wall_s=meta["study_wall_s"] + session,
                sessions=meta["sessions"] + [{"runs": len(todo), "wall_s": session}],
                run_wall_s_total=float(runs["wall_s"].sum()))
    folder.write_manifest(meta)
    return meta


def collect_partial(cfg: StudyConfig, out: Path, ended: bool = False) -> dict:
    """Assemble the runs of ``cfg`` finished so far (while a study still runs, or after it was stopped) and mark
    ``study.json`` 'partial'; its wall time counts the running session up to its latest finished run.
    ``ended=True`` (the driver, after its sessions of a tiered folder): no session is running; the status
    is 'complete' or 'incomplete'."""
    out = Path(out)
    meta_path = out / "study.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} not found: no study was started in {out}")
    meta = read_json(meta_path, "study record", RECORD_MAX_BYTES,
                     f"it is damaged; rerun the study into a new --out (the runs under {out / 'runs'} are kept)")
    if meta.get("fingerprint") != cfg.fingerprint():
        raise DefinitionMismatch(f"{out} holds a different study (fingerprint {meta.get('fingerprint')} != "
                                 f"{cfg.fingerprint()}); pass the folder this study wrote with --out")
    specs = cfg.runs()
    folder = study_folder(out)
    check_tables_unedited(out, folder.tables, "the study's rerun")  # a table the user edited is kept (c39 C6)
    runs = collect(out, specs)
    done = [folder.marker(s.run_id) for s in specs if folder.done(s.run_id)]
    started = meta.get("session_started_at", meta_path.stat().st_mtime)
    latest = max(p.stat().st_mtime for p in done)
    status = "complete" if len(done) == len(specs) else "partial"
    completed = sum(x["wall_s"] for x in meta.get("sessions", []))  # sessions that ran to the end
    # a session that has not (yet) completed; after the driver's last session nothing is running
    running = meta.get("status") in ("running", "partial") and not ended
    if ended and status != "complete":
        status = "incomplete"  # every session ended, some runs were never done
    meta.update(status=status, runs_done=len(runs), session_started_at=started, design=cfg.to_dict(),
                runs_total=len(specs),
                study_wall_s=completed + (max(latest - started, 0.0) if running else 0.0),
                run_wall_s_total=float(runs["wall_s"].sum()))
    study_folder(out).write_manifest(meta)
    return meta


def collect(out: Path, specs: list[RunSpec]) -> pd.DataFrame:
    """Concatenate the finished runs into ``results.csv.gz`` (tidy) and ``runs.csv`` (one row per run)."""
    out = Path(out)
    frames, summaries = [], []
    arm_of = {s.run_id: s.arm for s in specs}
    folder = study_folder(out)
    with folder.gathering_cells(["results.csv.gz", "runs.csv"]):  # the runs as their workers wrote them
        for s in specs:
            csv = folder.marker(s.run_id).with_suffix(".csv")
            if folder.done(s.run_id):  # a damaged run (a FIFO, device, altered table) is not finished: rerun it
                frames.append(read_csv(csv, "run table",
                                       fix="remove it and rerun the study (the run is computed again)"))
                summaries.append(folder.read_cell(s.run_id))
        if not frames:
            raise ValueError(f"no finished runs under {out / 'runs'}")
        runs = pd.DataFrame(summaries)
        runs["mode"] = [arm_of[r].mode for r in runs.run_id]
        runs["scheme"] = [arm_of[r].scheme or "" for r in runs.run_id]
        runs["budget"] = [arm_of[r].budget or 0 for r in runs.run_id]
        atomic_write_csv(out / "results.csv.gz", pd.concat(frames, ignore_index=True))
        atomic_write_csv(out / "runs.csv", runs)
    return runs
