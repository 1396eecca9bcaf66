"""A training run's directory: one owner at a time, atomic files, recovery from torn writes.

    RUN_DIR/config.json      the experiment (TrainConfig) -- the truth a resume continues
    RUN_DIR/metrics.jsonl    one JSON record per line, appended
    RUN_DIR/checkpoints/     step_NNNNNN.pt (written to a temporary name, then renamed) and ``latest``;
                             sharded runs write step_NNNNNN.dcp/ directories (seco_lab.sharded_checkpoint)
    RUN_DIR/.lock            held with ``fcntl.flock`` by the trainer that owns the directory

A second trainer on the same directory is refused with the owner's pid.  On resume a
damaged checkpoint (truncated, 0 bytes) is skipped for the previous intact one, and a
torn last line of ``metrics.jsonl`` (a kill mid-write) is dropped -- both with a warning.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from .store import atomic_write, atomic_write_json

__all__ = ["RunDir", "RunDirError", "check_usable", "checkpoint_steps", "read_config", "read_metrics"]

LOCK_NAME = ".lock"
CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "torch_rng", "numpy_rng")


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (the message says why and what to do)."""


def check_usable(path: Path, resume: bool, overwrite: bool) -> None:
    """Everything that can be checked without creating anything; raise :class:`RunDirError`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file; choose another --run-dir")
    parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {path}: {parent} is not writable; choose another --run-dir")
    if resume:
        if not (path / "config.json").is_file():
            raise RunDirError(f"--resume: {path} holds no run (no config.json); start it without --resume")
    elif path.exists() and _contents(path) and not overwrite:
        raise RunDirError(f"run directory {path} exists and is not empty; pass --overwrite (replace it) or "
                          "--resume (continue it)")


def _contents(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.name != LOCK_NAME]


class RunDir:
    """The files of one run.  ``open`` takes the lock; the other methods assume it is held."""

    def __init__(self, path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.config_path = self.path / "config.json"
        self._lock_file = None

    # ------------------------------------------------------------------ ownership
    def open(self, resume: bool, overwrite: bool) -> RunDir:
        """Check, create (or clear with ``overwrite``) and lock the directory."""
        check_usable(self.path, resume, overwrite)
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self._lock()
            check_usable(self.path, resume, overwrite)  # again, now that no other trainer can change it
        except RunDirError:
            self.close()
            if created:
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        if not resume:
            for p in _contents(self.path):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        self.checkpoints.mkdir(exist_ok=True)
        return self

    def _lock(self) -> None:
        f = open(self.path / LOCK_NAME, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise RunDirError(f"run directory {self.path} is in use by another trainer (pid {owner}); wait for it "
                              "to finish or stop it, or choose another --run-dir") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f

    def close(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------------ config
    def write_config(self, config: dict) -> None:
        atomic_write_json(self.config_path, config)

    def read_config(self) -> dict:
        return read_config(self.path)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, state: dict) -> Path:
        out = atomic_write(self.checkpoints / f"step_{state['step']:06d}.pt", lambda f: torch.save(state, f))
        atomic_write(self.checkpoints / "latest", out.name)
        return out

    def point_latest(self, name: str) -> None:
        """Name the newest complete checkpoint (file or sharded directory) in ``latest``."""
        atomic_write(self.checkpoints / "latest", name)

    def load_checkpoint(self, map_location=None) -> dict | None:
        """The newest intact checkpoint (``latest`` first, then older steps), or None when there is none.
        A damaged one is reported with a warning and skipped."""
        names = sorted((p.name for p in self.checkpoints.glob("step_*.pt")), reverse=True)
        latest = self.checkpoints / "latest"
        if latest.is_file():
            pointed = latest.read_text().strip()
            if pointed in names:  # the pointer names the newest file written completely
                names.remove(pointed)
                names.insert(0, pointed)
        skipped = []
        for name in names:
            try:
                state = torch.load(self.checkpoints / name, map_location=map_location, weights_only=False)
                missing = [k for k in CHECKPOINT_KEYS if k not in state]
                if missing:
                    raise ValueError(f"missing {', '.join(missing)}")
            except Exception as e:  # noqa: BLE001 -- any unreadable file is a damaged checkpoint
                skipped.append(name)
                warnings.warn(f"checkpoint {self.checkpoints / name} is damaged ({type(e).__name__}: "
                              f"{str(e)[:120]}); falling back to an earlier one", stacklevel=2)
                continue
            if skipped:
                warnings.warn(f"resuming from {name} (step {state['step']}) instead of damaged "
                              f"{', '.join(skipped)}", stacklevel=2)
            return state
        if skipped:
            warnings.warn(f"no intact checkpoint in {self.checkpoints}: starting again from step 0", stacklevel=2)
        return None

    # ------------------------------------------------------------------ metrics
    def append_metrics(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, last_step: int) -> None:
        """Keep the records up to ``last_step``: later ones belong to the part of the run being redone."""
        rows = [r for r in read_metrics(self.path) if r["step"] <= last_step]
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))


def read_config(run_dir) -> dict:
    path = Path(run_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: cannot read the run's config ({e})") from None


def read_metrics(run_dir) -> list[dict]:
    """The records of ``metrics.jsonl``; a torn last line is dropped with a warning, damage elsewhere raises."""
    path = Path(getattr(run_dir, "path", run_dir)) / "metrics.jsonl"  # a path or a RunDir
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 or all(not ln.strip() for ln in lines[i + 1 :]):
                warnings.warn(f"{path}: dropping a torn last line ({line[:40]!r}...)", stacklevel=2)
                break
            raise RunDirError(f"{path}: line {i + 1} is not JSON; the metrics file is damaged") from None
    return rows


def checkpoint_steps(run_dir) -> list[int]:
    """Steps with a checkpoint: ``step_NNNNNN.pt`` files and sharded ``step_NNNNNN.dcp`` directories."""
    return sorted({int(m.group(1)) for p in (Path(run_dir) / "checkpoints").glob("step_*")
                   if (m := re.fullmatch(r"step_(\d+)\.(pt|dcp)", p.name))})
