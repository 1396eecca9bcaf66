"""The study driver: the grid (arms x optimizers x learning rates x seeds), resumable, in a process pool.

Each run is written atomically to ``OUT/runs/<run_id>.csv`` (tidy rows) and ``.json`` (summary) as
soon as it finishes; a rerun skips every run whose files exist, provided the study definition is
unchanged (its fingerprint is checked against ``OUT/study.json``).  ``collect`` assembles
``OUT/results.csv.gz`` -- one row per run x step x metric x distance -- and ``OUT/runs.csv``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from .runner import Arm, RunSpec, TrainSettings, train_run
from .task import RecallTask

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

    def __post_init__(self):
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
        return [RunSpec(arm, opt, float(lr), seed) for seed in self.seeds for opt, grid in self.lrs.items()
                for lr in grid for arm in self.arms]

    def to_dict(self) -> dict:
        return {"settings": self.settings.to_dict(), "budgets": list(self.budgets),
                "lrs": {k: list(v) for k, v in self.lrs.items()}, "seeds": list(self.seeds),
                "arms": [{"name": a.name, **asdict(a)} for a in self.arms]}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def quick_config() -> StudyConfig:
    """A few seconds per run: every arm and optimizer, a tiny grid, 2 seeds (the test's configuration)."""
    s = TrainSettings(task=RecallTask(num_chunks=4, chunk_size=6, vocab_size=16, distances=(1, 3), pairs=2),
                      model=dict(d_model=16, n_layers=1, n_heads=2, d_ff=32), steps=6, batch_size=4, micro_batch=2,
                      warmup=2, eval_every=3, probe_every=3, val_sequences=16, test_sequences=16, probe_sequences=4)
    return StudyConfig(settings=s, budgets=(2, 1), lrs={"adamw": (1e-2,), "sgd": (0.1,)}, seeds=(0, 1))


def software_versions() -> dict:
    import matplotlib
    import scipy

    return {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
            "scipy": scipy.__version__, "pandas": pd.__version__, "matplotlib": matplotlib.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count()}


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    df.to_csv(tmp, index=False, compression="gzip" if path.suffix == ".gz" else None)
    os.replace(tmp, path)


def _run_paths(out: Path, spec: RunSpec) -> tuple[Path, Path]:
    return out / "runs" / f"{spec.run_id}.csv", out / "runs" / f"{spec.run_id}.json"


def _work(args) -> dict:
    """One run in a worker: one thread (the pool already fills the cores), results written atomically."""
    spec, settings, out = args
    torch.set_num_threads(1)
    rows, summary = train_run(spec, settings)
    df = pd.DataFrame(rows)
    for pos, key in enumerate(("run_id", "arm", "optimizer", "lr", "seed")):
        df.insert(pos, key, summary[key])
    csv, js = _run_paths(out, spec)
    atomic_write_csv(df, csv)
    atomic_write_text(json.dumps(summary, indent=1), js)  # written last: marks the run as done
    return summary


def run_study(cfg: StudyConfig, out: Path, jobs: int = 2, fresh: bool = False, progress: bool = True) -> dict:
    """Run every missing run of ``cfg`` into ``out``; returns the study record (also ``out/study.json``)."""
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for stale in (out / "runs").glob("*.tmp*"):  # left by an interrupted run
        stale.unlink()
    meta_path = out / "study.json"
    old = json.loads(meta_path.read_text()) if meta_path.exists() and not fresh else {}
    if old:
        if old.get("fingerprint") != cfg.fingerprint():
            raise ValueError(f"{out} holds a different study (fingerprint {old.get('fingerprint')} != "
                             f"{cfg.fingerprint()}); pass --fresh to discard it or choose another --out")
    if fresh:
        for f in (out / "runs").glob("*"):
            f.unlink()
    specs = cfg.runs()
    todo = [s for s in specs if not _run_paths(out, s)[1].exists()]
    started = time.time()
    meta = {"fingerprint": cfg.fingerprint(), "design": cfg.to_dict(), "software": software_versions(),
            "runs_total": len(specs), "jobs": jobs, "study_wall_s": old.get("study_wall_s", 0.0),
            "sessions": old.get("sessions", []), "session_started_at": started}
    atomic_write_text(json.dumps({**meta, "status": "running"}, indent=1), meta_path)
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="train-study runs", disable=not progress)
    work = [(s, cfg.settings, out) for s in todo]
    if jobs <= 1:
        for w in work:
            _work(w)
            bar.update()
    else:
        with get_context("spawn").Pool(jobs) as pool:
            for _ in pool.imap_unordered(_work, work):
                bar.update()
    bar.close()
    runs = collect(out, specs)
    session = time.time() - started
    # wall time of the whole study: every session that completed (an interrupted one is not counted)
    meta.update(status="complete", runs_done=len(runs), study_wall_s=meta["study_wall_s"] + session,
                sessions=meta["sessions"] + [{"runs": len(todo), "wall_s": session}],
                run_wall_s_total=float(runs["wall_s"].sum()))
    atomic_write_text(json.dumps(meta, indent=1), meta_path)
    return meta


def collect_partial(cfg: StudyConfig, out: Path) -> dict:
    """Assemble the runs finished so far (while a study still runs, or after it was stopped) and mark
    ``study.json`` 'partial'; its wall time counts the running session up to its latest finished run."""
    out = Path(out)
    meta_path = out / "study.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} not found: no study was started in {out}")
    meta = json.loads(meta_path.read_text())
    if meta.get("fingerprint") != cfg.fingerprint():
        raise ValueError(f"{out} holds a different study (fingerprint {meta.get('fingerprint')})")
    specs = cfg.runs()
    runs = collect(out, specs)
    done = [_run_paths(out, s)[1] for s in specs if _run_paths(out, s)[1].exists()]
    started = meta.get("session_started_at", meta_path.stat().st_mtime)
    latest = max(p.stat().st_mtime for p in done)
    status = "complete" if len(done) == len(specs) else "partial"
    completed = sum(x["wall_s"] for x in meta.get("sessions", []))  # sessions that ran to the end
    running = meta.get("status") in ("running", "partial")  # a session that has not (yet) completed
    meta.update(status=status, runs_done=len(runs), session_started_at=started,
                study_wall_s=completed + (max(latest - started, 0.0) if running else 0.0),
                run_wall_s_total=float(runs["wall_s"].sum()))
    atomic_write_text(json.dumps(meta, indent=1), meta_path)
    return meta


def collect(out: Path, specs: list[RunSpec]) -> pd.DataFrame:
    """Concatenate the finished runs into ``results.csv.gz`` (tidy) and ``runs.csv`` (one row per run)."""
    out = Path(out)
    frames, summaries = [], []
    arm_of = {s.run_id: s.arm for s in specs}
    for s in specs:
        csv, js = _run_paths(out, s)
        if js.exists():
            frames.append(pd.read_csv(csv))
            summaries.append(json.loads(js.read_text()))
    if not frames:
        raise ValueError(f"no finished runs under {out / 'runs'}")
    runs = pd.DataFrame(summaries)
    runs["mode"] = [arm_of[r].mode for r in runs.run_id]
    runs["scheme"] = [arm_of[r].scheme or "" for r in runs.run_id]
    runs["budget"] = [arm_of[r].budget or 0 for r in runs.run_id]
    atomic_write_csv(pd.concat(frames, ignore_index=True), out / "results.csv.gz")
    atomic_write_csv(runs, out / "runs.csv")
    return runs
