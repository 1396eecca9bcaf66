"""A training run's directory: one owner at a time, atomic files, recovery from torn writes.

    RUN_DIR/config.json      the experiment (TrainConfig) -- the truth a resume continues
    RUN_DIR/metrics.jsonl    one JSON record per line, appended
    RUN_DIR/checkpoints/     step_NNNNNN.pt (written to a temporary name, then renamed) and ``latest``;
                             sharded runs write step_NNNNNN.dcp/ directories (seco_lab.sharded_checkpoint)
    RUN_DIR/.lock            held with ``fcntl.flock`` by the trainer that owns the directory
    RUN_DIR/.seco-lab-run    the marker: this directory is a run of this tool

A second trainer on the same directory is refused with the owner's pid.  On resume a
damaged checkpoint (truncated, 0 bytes) is skipped for the previous intact one, and a
torn last line of ``metrics.jsonl`` (a kill mid-write) is dropped -- both with a warning.
A ``latest`` naming a checkpoint that is gone, or a checkpoint of another experiment, is refused.

Nothing a user owns is deleted.  ``--overwrite`` replaces only a directory that is recognisably a
run (the marker, or a ``config.json`` of a run written before the marker existed) and holds nothing
but the files a run writes (:data:`RUN_TREE`); the replacement is atomic -- a new directory is
built beside it and renamed into place, the old one moved aside, and then only the files named in
:data:`RUN_TREE` are removed from it (anything else stays, with a warning).  ``""``, ``/``, the
home directory, the current directory and their ancestors are never a run directory to overwrite.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch

from .folder_lock import LOCK_NAME, FolderBusy, hold_lock, release_lock
from .store import atomic_write, atomic_write_json, protected_paths

__all__ = ["CHECKPOINT_KEYS", "DCP_TREE", "MARKER_NAME", "RUN_TREE", "RunDir", "RunDirError", "check_usable",
           "checkpoint_steps", "read_config", "read_metrics", "remove_own", "safe_load"]

MARKER_NAME = ".seco-lab-run"
CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "torch_rng", "numpy_rng")
CHECKPOINT_FILE = re.compile(r"step_(\d+)\.pt")

FILE = None  # a leaf of a tree spec: a regular file (or a symlink, which is removed, never followed)
#: the files of a sharded checkpoint directory (torch.distributed.checkpoint's names, and ours)
DCP_TREE = {r"__\d+_\d+\.distcp": FILE, r"(__\d+)?\.metadata(\.tmp)?": FILE, r"extra\.pt(\.tmp\d*)?": FILE}
#: the checkpoints/ folder: step files, sharded step directories (complete, half-written or set aside), latest
CHECKPOINTS_TREE = {r"latest(\.tmp\d*)?": FILE, r"step_\d+\.pt(\.tmp\d*)?": FILE,
                    r"step_\d+\.dcp(\.tmp|\.old)?": DCP_TREE}
#: every name a run writes into its directory, as ``{name regex: FILE or subtree}``
RUN_TREE = {
    r"config\.json(\.tmp\d*)?": FILE, r"metrics\.jsonl(\.tmp\d*)?": FILE, r"loss(\.tmp\d+)?\.png": FILE,
    re.escape(LOCK_NAME): FILE, re.escape(MARKER_NAME) + r"(\.tmp\d*)?": FILE, "checkpoints": CHECKPOINTS_TREE,
    "tensorboard": {r"events\.out\.tfevents\..+": FILE},
    "adapter": {r"adapter_config\.json": FILE, r"adapter_model\.(safetensors|bin)": FILE, r"README\.md": FILE},
}


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (the message says why and what to do)."""


def _match(name: str, spec: dict):
    """The subtree (or FILE) of the first pattern of ``spec`` matching ``name`` in full; ``False`` when none does."""
    for pattern, sub in spec.items():
        if re.fullmatch(pattern, name):
            return sub
    return False


def foreign_entries(root: Path, spec: dict) -> list[Path]:
    """The entries under ``root`` that ``spec`` does not name (a directory where a file belongs, a file
    where a directory belongs, a symlinked directory, or an unknown name): what this tool did not write."""
    out = []
    for p in sorted(Path(root).iterdir()):
        sub = _match(p.name, spec)
        if sub is FILE and (p.is_symlink() or p.is_file()):
            continue
        if isinstance(sub, dict) and p.is_dir() and not p.is_symlink():
            out += foreign_entries(p, sub)
            continue
        out.append(p)
    return out


def remove_own(root: Path, spec: dict) -> list[Path]:
    """Remove the files under ``root`` that ``spec`` names, then the directories left empty (``root``
    too); anything else stays.  Returns what stayed.  Never a blanket ``rmtree``."""
    root = Path(root)
    left = []
    for p in sorted(root.iterdir()):
        sub = _match(p.name, spec)
        if sub is FILE and (p.is_symlink() or p.is_file()):
            p.unlink(missing_ok=True)
        elif isinstance(sub, dict) and p.is_dir() and not p.is_symlink():
            left += remove_own(p, sub)
        else:
            left.append(p)
    if not left:
        root.rmdir()
    return left


def check_path_given(path) -> Path:
    """Refuse a run directory that is no choice at all: ``""`` (which means the current directory)."""
    text = os.fspath(path)
    if not str(text).strip():
        raise RunDirError("--run-dir is empty; name a directory for the run, e.g. --run-dir runs/first")
    if str(text) == "~" or str(text).startswith("~/"):
        raise RunDirError(f"--run-dir {text}: a literal '~' (the shell did not expand it); write the path out")
    return Path(text)


def is_run(path: Path) -> bool:
    """A directory this tool created: the marker, or (older runs) a config.json recording a run's mode."""
    if (path / MARKER_NAME).is_file():
        return True
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and "mode" in d and "steps" in d


def check_replaceable(path: Path) -> None:
    """``--overwrite``: refuse anything but a run of this tool holding only its own files (and a symlink:
    the replacement renames the directory, which would replace the link, not the run it points to)."""
    check_path_given(path)
    if path.is_symlink():
        if not is_run(path.resolve()) or path.resolve() in protected_paths():
            raise RunDirError(f"--overwrite: {path} is a symlink to {path.resolve()}, which is not a seco-lab run "
                              "directory, so nothing is replaced; choose another --run-dir")
        raise RunDirError(f"--overwrite: {path} is a symlink to {path.resolve()}; pass --run-dir {path.resolve()} to "
                          "replace that run (the link is left alone)")
    resolved = path.resolve()
    what = protected_paths().get(resolved)
    if what is not None:
        raise RunDirError(f"--overwrite would replace {resolved}, {what}; choose a run directory of its own, "
                          "e.g. --run-dir runs/first")
    if not is_run(path):
        raise RunDirError(f"--overwrite: {path} is not a seco-lab run directory (no {MARKER_NAME} or run "
                          "config.json), so it is left alone; choose another --run-dir or empty it yourself")
    orphans = orphan_checkpoints(path)
    if orphans:
        raise RunDirError(f"--overwrite: {path} has no config.json, so its checkpoints ({orphans}) are the run's only "
                          "copy of the experiment and are left alone; continue it with --resume (config.json is "
                          f"rebuilt from the newest checkpoint), or delete {path / 'checkpoints'} yourself first")
    foreign = foreign_entries(path, RUN_TREE)
    if foreign:
        names = ", ".join(str(p.relative_to(path)) for p in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise RunDirError(f"--overwrite: {path} holds files seco-lab did not write ({names}); move them out "
                          "or choose another --run-dir")


def check_usable(path: Path, resume: bool, overwrite: bool) -> None:
    """Everything that can be checked without creating anything; raise :class:`RunDirError`."""
    path = check_path_given(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file; choose another --run-dir")
    parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {path}: {parent} is not writable; choose another --run-dir")
    if resume:
        if not (path / "config.json").is_file() and not checkpoint_steps(path):
            raise RunDirError(f"--resume: {path} holds no run (no config.json); start it without --resume")
    elif path.exists() and _contents(path):
        what = protected_paths().get(path.resolve())
        if what is not None:  # never a run's own directory: no --overwrite to suggest
            raise RunDirError(f"run directory {path} is {what} and not empty; a run needs a directory of its own, "
                              "e.g. --run-dir runs/first")
        orphans = orphan_checkpoints(path)
        if orphans and not overwrite:
            raise RunDirError(f"run directory {path} holds checkpoints ({orphans}) but no config.json; pass --resume "
                              "to continue from the newest one (config.json is rebuilt from it), or choose another "
                              "--run-dir")
        if not overwrite:
            raise RunDirError(f"run directory {path} exists and is not empty; pass --overwrite (replace it) or "
                              "--resume (continue it)")
        check_replaceable(path)


def orphan_checkpoints(path: Path) -> str:
    """``"steps 2, 4"`` when ``path`` holds checkpoints but no ``config.json`` (deleted): the checkpoints, which
    record the experiment, are then the run's only copy of it; ``""`` otherwise."""
    if (path / "config.json").is_file():
        return ""
    steps = checkpoint_steps(path)
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[-3:]))
    return f"step{'s' if len(steps) > 1 else ''} {'..., ' if len(steps) > 3 else ''}{shown}"


def _contents(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.name != LOCK_NAME]


class RunDir:
    """The files of one run.  ``open`` takes the lock; the other methods assume it is held."""

    def __init__(self, path):
        self.path = check_path_given(path)
        self.checkpoints = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.config_path = self.path / "config.json"
        self._lock_file = None

    # ------------------------------------------------------------------ ownership
    def open(self, resume: bool, overwrite: bool) -> RunDir:
        """Check, create (or replace with ``overwrite``) and lock the directory."""
        check_usable(self.path, resume, overwrite)
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self._lock()
            check_usable(self.path, resume, overwrite)  # again, now that no other trainer can change it
        except RunDirError:
            self.close()
            if created:  # only what this call made: the lock file and the (then empty) directory
                remove_own(self.path, {re.escape(LOCK_NAME): FILE})
            raise
        if not resume and _contents(self.path):
            self._replace()
        if not resume:
            atomic_write(self.path / MARKER_NAME, json.dumps({"tool": "seco-lab"}) + "\n")
        self.checkpoints.mkdir(exist_ok=True)
        return self

    def _replace(self) -> None:
        """Swap in a fresh directory (built beside, then renamed) and remove the old run's own files.

        Called with the old directory locked and checked by :func:`check_replaceable`.  The old
        directory is renamed aside first, so a crash leaves either the old run or the new one in place
        (and at worst a ``.NAME.replaced-*`` folder beside it), never a half-emptied run."""
        parent, name = self.path.parent, self.path.name
        fresh = Path(tempfile.mkdtemp(prefix=f".{name}.new-", dir=parent))
        atomic_write(fresh / MARKER_NAME, json.dumps({"tool": "seco-lab"}) + "\n")
        aside = Path(tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent))
        os.rename(self.path, aside / name)  # the old run, with our lock on its .lock, moves aside
        os.rename(fresh, self.path)
        old_lock = self._lock_file
        self._lock_file = None
        self._lock()
        release_lock(old_lock)
        left = remove_own(aside / name, RUN_TREE)
        if left:
            warnings.warn(f"the replaced run's folder {aside / name} kept files seco-lab did not write: "
                          f"{', '.join(str(p) for p in left[:5])}", stacklevel=3)
        else:
            aside.rmdir()

    def _lock(self) -> None:
        try:
            self._lock_file = hold_lock(self.path, "trainer", "wait for it to finish or stop it, or choose another "
                                                              "--run-dir")
        except FolderBusy as e:
            raise RunDirError(f"run directory {e}") from None

    def close(self) -> None:
        if self._lock_file is not None:
            release_lock(self._lock_file)
            self._lock_file = None

    # ------------------------------------------------------------------ config
    def write_config(self, config: dict) -> None:
        atomic_write_json(self.config_path, config)

    def read_config(self) -> dict:
        return read_config(self.path)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, state: dict) -> Path:
        try:
            out = atomic_write(self.checkpoints / f"step_{state['step']:06d}.pt", lambda f: torch.save(state, f))
            atomic_write(self.checkpoints / "latest", out.name)
        except (OSError, RuntimeError) as e:  # disk full (torch reports it as a RuntimeError), a folder in the way
            raise RunDirError(f"cannot save the checkpoint of step {state['step']} in {self.checkpoints}: "
                              f"{getattr(e, 'strerror', None) or str(e).splitlines()[0]}; free disk space (or "
                              "remove what is in the way) and resume with --resume") from None
        return out

    def point_latest(self, name: str) -> None:
        """Name the newest complete checkpoint (file or sharded directory) in ``latest``."""
        atomic_write(self.checkpoints / "latest", name)

    def check_latest(self) -> None:
        """Refuse a ``latest`` that is not a file or names a checkpoint that is gone: the run's later steps
        would be lost without a word if the trainer fell back to an earlier one, or to step 0."""
        latest = self.checkpoints / "latest"
        if not latest.exists() and not latest.is_symlink():
            return
        if not latest.is_file():
            raise RunDirError(f"--resume: {latest} is not a file (it names the newest checkpoint); remove it to "
                              "resume from the newest checkpoint present")
        pointed = latest.read_text(errors="replace").strip()
        if not re.fullmatch(r"step_\d+\.(pt|dcp)", pointed):
            raise RunDirError(f"--resume: {latest} holds {pointed[:60]!r}, not a checkpoint name; remove it to resume "
                              "from the newest checkpoint present")
        if not (self.checkpoints / pointed).exists():
            raise RunDirError(f"--resume: {latest} names {pointed}, which is missing (deleted or moved); restore it, "
                              "or start again with --overwrite")

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints -- only this tool's ``step_NNNNNN.pt`` files and
        sharded ``step_NNNNNN.dcp`` directories (file by file), never the one ``latest`` names."""
        latest = self.checkpoints / "latest"
        pointed = latest.read_text().strip() if latest.is_file() else None
        found = sorted((p for p in self.checkpoints.iterdir()
                        if re.fullmatch(r"step_\d+\.pt", p.name) and p.is_file() and not p.is_symlink()
                        or re.fullmatch(r"step_\d+\.dcp", p.name) and p.is_dir() and not p.is_symlink()),
                       key=lambda p: int(p.name[5:].split(".")[0]))
        removed = []
        for p in found[:-keep] if keep > 0 else found:
            if p.name == pointed:
                continue
            if p.is_dir():
                remove_own(p, DCP_TREE)
            else:
                p.unlink()
            removed.append(p)
        return removed

    def load_checkpoint(self, map_location=None, check=None) -> dict | None:
        """The newest intact checkpoint (``latest`` first, then older steps), or None when there is none.
        A damaged one is reported with a warning and skipped; ``check(state, name)`` may refuse one
        (raising :class:`RunDirError`, which is not damage and stops the search)."""
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
                state = safe_load(self.checkpoints / name, map_location)
                if not isinstance(state, dict):
                    raise ValueError(f"holds a {type(state).__name__}, not a checkpoint")
                missing = [k for k in CHECKPOINT_KEYS if k not in state]
                if missing:
                    raise ValueError(f"missing {', '.join(missing)}")
            except RunDirError:
                raise
            except Exception as e:  # noqa: BLE001 -- any unreadable file is a damaged checkpoint
                skipped.append(name)
                warnings.warn(f"checkpoint {self.checkpoints / name} is damaged ({type(e).__name__}: "
                              f"{str(e)[:120]}); falling back to an earlier one", stacklevel=2)
                continue
            if check is not None:
                check(state, name)
            if skipped:
                warnings.warn(f"resuming from {name} (step {state['step']}) instead of damaged "
                              f"{', '.join(skipped)}", stacklevel=2)
            return state
        if skipped:
            warnings.warn(f"no intact checkpoint in {self.checkpoints}", stacklevel=2)
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


def safe_load(path: Path, map_location=None):
    """``torch.load(weights_only=True)``: tensors and plain values only, so a crafted file cannot run code.
    numpy arrays (the RNG state of checkpoints written before it was stored as a tensor) are allowed too."""
    import numpy as np
    from numpy._core.multiarray import _reconstruct

    if Path(path).is_file() and not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else is
        raise ValueError("not a torch checkpoint archive (no zip structure): truncated, overwritten or foreign")
    with torch.serialization.safe_globals([_reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            if "Weights only load failed" not in str(e):
                raise
            raise RunDirError(f"{path} holds objects a safe load refuses (not tensors or plain values); it is not a "
                              "seco-lab checkpoint, and loading it could run code -- remove it") from None


def read_config(run_dir) -> dict:
    path = Path(run_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: cannot read the run's config ({e})") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{path} holds a {type(config).__name__}, not a run's settings: the file is damaged or "
                          "not written by seco-lab train")
    return config


def read_metrics(run_dir) -> list[dict]:
    """The records of ``metrics.jsonl``; a torn last line is dropped with a warning, damage elsewhere raises."""
    path = Path(getattr(run_dir, "path", run_dir)) / "metrics.jsonl"  # a path or a RunDir
    if not path.exists():
        return []
    try:
        lines = path.read_text().split("\n")
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not text (not UTF-8): the metrics file is damaged or was overwritten") from None
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
