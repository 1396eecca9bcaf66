"""A training run's directory: one owner at a time, atomic files, recovery from torn writes.

    RUN_DIR/config.json      the experiment (TrainConfig) -- the truth a resume continues
    RUN_DIR/metrics.jsonl    one JSON record per line, appended
    RUN_DIR/checkpoints/     step_NNNNNN.pt (written to a temporary name, then renamed) and ``latest``;
                             sharded runs write step_NNNNNN.dcp/ directories (seco_lab.training.sharded_checkpoint)
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

Here: :class:`RunDir`, which owns and writes the directory; the refusals and the names a run writes are in
:mod:`seco_lab.training.run_checks`, the readers of its files in :mod:`seco_lab.training.run_files` (both re-exported
here).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import warnings
from pathlib import Path

import torch

from ..folder_lock import LOCK_NAME, FolderBusy, hold_lock, release_lock
from ..store import atomic_write, atomic_write_json, checked_file, loads_json
from .checkpoint_archive import is_own_checkpoint
from .run_checks import (  # noqa: F401 (re-export: defined here before)
    CHECKPOINTS_TREE,
    DCP_TREE,
    FILE,
    MARKER_NAME,
    RUN_TREE,
    RunDirError,
    _match,
    check_path_given,
    check_replaceable,
    check_usable,
    foreign_entries,
    is_run,
    not_run_file,
    remove_own,
    run_tree,
)
from .run_checks import run_contents as _contents
from .run_files import (  # noqa: F401 (re-export)
    CHECKPOINT_FILE,
    CHECKPOINT_KEYS,
    CONTENT_DIGEST,
    checkpoint_records,
    checkpoint_run_ids,
    checkpoint_step,
    checkpoint_steps,
    content_digest,
    read_config,
    read_metrics,
    run_file,
    safe_load,
)

__all__ = ["CHECKPOINT_KEYS", "DCP_TREE", "MARKER_NAME", "RUN_TREE", "RunDir", "RunDirError", "check_usable",
           "checkpoint_steps", "read_config", "read_metrics", "remove_own", "safe_load"]


def marker_text() -> str:
    """The marker file of a new run folder: whose it is, the run's identity (:attr:`RunDir.run_id`), and that its
    checkpoints carry a content digest (:meth:`RunDir.digest_required`); :meth:`RunDir.note_written` adds
    the optional folders the run writes (``adapter``, ``tensorboard``), which ``--overwrite`` may then remove."""
    return json.dumps({"tool": "seco-lab", "run_id": secrets.token_hex(8), "digests": True}) + "\n"

LATEST_MAX_BYTES = 4096  # ``latest`` holds one checkpoint name
MARKER_MAX_BYTES = 4096  # the marker holds a few keys


class RunDir:
    """The files of one run.  ``open`` takes the lock; the other methods assume it is held."""

    def __init__(self, path, accept_undigested: bool = False):
        self.path = check_path_given(path)
        self.accept_undigested = accept_undigested  # --accept-undigested: see digest_required
        self.checkpoints = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.config_path = self.path / "config.json"
        self._lock_file = None
        self.created = self.fresh = False  # open() made the folder / started a new run in it

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
            atomic_write(self.path / MARKER_NAME, marker_text())
        self.checkpoints.mkdir(exist_ok=True)
        self._clear_torn_writes()
        self.created = created
        self.fresh = not resume  # started anew: what the folder holds now is this run's own, made by this call
        return self

    def remove_unused(self) -> list[Path]:
        """Release the folder and remove the run's own files from it, when :meth:`open` made it or started a new run
        in it (an empty folder, or one replaced by ``--overwrite``) and the run stopped before it trained a step
        (its standard output failed before the first step, campaign 30 T10, 31 U2), so a retry starts as the first
        try would; a folder that existed before is kept (empty).  Returns what stayed (nothing is removed from a
        resumed run, or one that holds a checkpoint)."""
        self.close()
        if not (self.created or self.fresh) or any(self.checkpoints.glob("step_*.pt")):
            return [self.path]
        left = remove_own(self.path, run_tree(self.path))
        if not self.created:
            self.path.mkdir(exist_ok=True)
        return left

    def _clear_torn_writes(self) -> None:
        """Remove the temporary files a killed run left (``step_000016.pt.seco-tmp<pid>``, ``latest.seco-tmp<pid>``,
        ``config.json.seco-tmp<pid>``...): only names of :data:`RUN_TREE` ending in ``.seco-tmp<pid>``, regular
        files, and only with the lock held, so no live writer owns them (campaign 22 N3); and only those that hold
        what a run writes under their name, or nothing: a file torn half-way, or a user's under such a name
        (campaign 37), is kept with a warning."""
        for folder, tree in ((self.path, RUN_TREE), (self.checkpoints, CHECKPOINTS_TREE)):
            for p in folder.iterdir():
                if (re.fullmatch(r".+\.seco-tmp\d+", p.name) and _match(p.name, tree) is FILE and p.is_file()
                        and not p.is_symlink()):
                    what = not_run_file(self.path, p.relative_to(self.path).as_posix())
                    if what is None:
                        p.unlink()
                    else:
                        warnings.warn(f"kept {p}: it is not {what}", stacklevel=2)

    def _replace(self) -> None:
        """Swap in a fresh directory (built beside, then renamed) and remove the old run's own files.

        Called with the old directory locked and checked by :func:`check_replaceable`.  The old
        directory is renamed aside first, so a crash leaves either the old run or the new one in place
        (and at worst a ``.NAME.replaced-*`` folder beside it), never a half-emptied run."""
        parent, name = self.path.parent, self.path.name
        fresh = Path(tempfile.mkdtemp(prefix=f".{name}.new-", dir=parent))
        atomic_write(fresh / MARKER_NAME, marker_text())
        aside = Path(tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent))
        os.rename(self.path, aside / name)  # the old run, with our lock on its .lock, moves aside
        os.rename(fresh, self.path)
        old_lock = self._lock_file
        self._lock_file = None
        self._lock()
        release_lock(old_lock)
        try:
            left = remove_own(aside / name, run_tree(aside / name))
        except OSError as e:  # campaign 35 O24: an immutable or read-only file of the old run (the new one is in
            # place: it trains; what is left of the old one is said, never a hidden folder named as the error)
            warnings.warn(f"the replaced run's files could not all be removed ({e.filename or aside / name}: "
                          f"{e.strerror or e}); what is left of it stays in {aside / name}: remove it yourself once "
                          "it can be", stacklevel=3)
            return
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
            state = {**state, CONTENT_DIGEST: content_digest(state)}  # an edit is told (check_content_digest)
            target = self.checkpoints / f"step_{state['step']:06d}.pt"
            self._keep_foreign(target)
            out = atomic_write(target, lambda f: torch.save(state, f))
            atomic_write(self.checkpoints / "latest", out.name)
        except (OSError, RuntimeError) as e:  # disk full (torch reports it as a RuntimeError), a folder in the way
            earlier = [s for s in checkpoint_steps(self.path) if s < state["step"]]
            then = (f"resume with --resume (from step {max(earlier)})" if earlier else "start the run again with "
                    "--overwrite (no earlier checkpoint was saved to resume from)")
            raise RunDirError(f"cannot save the checkpoint of step {state['step']} in {self.checkpoints}: "
                              f"{getattr(e, 'strerror', None) or str(e).splitlines()[0]}; free disk space (or "
                              f"remove what is in the way) and {then}") from None
        return out

    def _keep_foreign(self, target: Path) -> None:
        """Move aside what is at ``target`` unless it is a checkpoint of this run: another run's checkpoint copied
        in, or a user's file of that name, is kept under a new name, warned (campaign 70 D: a resumed run saved its
        steps over both, exit 0)."""
        if not target.exists() and not target.is_symlink():
            return
        if target.is_file() and not target.is_symlink() and self._own_checkpoint(target, self.run_id):
            return
        aside = Path(tempfile.mkdtemp(prefix=f"{target.name}.not-this-run.", dir=self.checkpoints))
        target.rename(aside / target.name)
        warnings.warn(f"{target} is not a checkpoint of this run (another run's, or a file seco-lab did not write): "
                      f"moved to {aside / target.name}, and this run's step saved in its place", stacklevel=3)

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
        pointed = self._pointed()
        if not re.fullmatch(r"step_\d+\.(pt|dcp)", pointed):
            raise RunDirError(f"--resume: {latest} holds {pointed[:60]!r}, not a checkpoint name; remove it to resume "
                              "from the newest checkpoint present")
        if not (self.checkpoints / pointed).exists():
            raise RunDirError(f"--resume: {latest} names {pointed}, which is missing (deleted or moved); restore it, "
                              "or start again with --overwrite")

    def _pointed(self) -> str | None:
        """The name ``latest`` holds (None without one); a ``latest`` of more than a name's bytes is refused, not
        read whole."""
        latest = self.checkpoints / "latest"
        if not latest.is_file():
            return None
        return run_file(latest, "checkpoint pointer", LATEST_MAX_BYTES).read_text(errors="replace").strip()

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints -- only the ``step_NNNNNN.pt`` files this run wrote (torch
        archives recording this run's id and their own step: :meth:`_own_checkpoint`) and sharded
        ``step_NNNNNN.dcp`` directories (file by file, only the files DCP writes), never the one ``latest`` names.
        A user's file or another run's checkpoint of such a name is left where it is and not counted."""
        pointed = self._pointed()
        run_id = self.run_id
        found = sorted((p for p in self.checkpoints.iterdir()
                        if re.fullmatch(r"step_\d+\.pt", p.name) and p.is_file() and not p.is_symlink()
                        and self._own_checkpoint(p, run_id)
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

    @staticmethod
    def _own_checkpoint(path: Path, run_id: str | None) -> bool:
        """:func:`~seco_lab.training.checkpoint_archive.is_own_checkpoint`."""
        return is_own_checkpoint(path, run_id)

    @property
    def run_id(self) -> str | None:
        """The run's identity, drawn when the run folder was made (its marker file); every checkpoint records it,
        so a checkpoint copied in from another run folder is refused even when the two runs' settings differ only
        in the schedule length.  None when the marker is missing, damaged or of a run folder made before run ids
        (:meth:`resume_run_id` decides what a resume then checks)."""
        return self._read_marker()[0]

    def _read_marker(self) -> tuple[str | None, str]:
        """``(run id, problem)``: the id and "" for a readable marker; ``(None, "missing")``; ``(None, "no id")`` for
        a marker of a folder made before run ids; otherwise ``(None, what is wrong with it)``."""
        path = self.path / MARKER_NAME
        if not path.exists() and not path.is_symlink():
            return None, "missing"
        try:
            text = checked_file(path, "run marker", MARKER_MAX_BYTES).read_text()
        except (OSError, ValueError) as e:  # a FIFO, a device, a folder, too large, not UTF-8
            return None, str(e)
        try:
            record = loads_json(text)
        except (ValueError, RecursionError):
            return None, "not JSON"
        if not isinstance(record, dict) or record.get("tool") != "seco-lab":
            return None, "not a marker this tool writes"
        if "run_id" not in record:
            return None, "no id"
        run_id = record["run_id"]
        if not isinstance(run_id, str) or not re.fullmatch(r"[0-9a-f]{16}", run_id):
            return None, f"its run id {str(run_id)[:40]!r} is not one this tool draws"
        return run_id, ""

    def _marker_record(self) -> dict:
        """The marker's JSON object when it is readable (:meth:`_read_marker`), else {}."""
        if self._read_marker()[1]:
            return {}
        return loads_json((self.path / MARKER_NAME).read_text())

    def digest_required(self, step: int) -> str:
        """Whether the checkpoint of ``step`` must carry its content digest: always, unless ``--accept-undigested``
        asks to resume a checkpoint written before checkpoints carried one (campaign 30 T1: the digest removed from
        every checkpoint and the marker deleted resumed an edited file as an older one).  Even then it is required
        where it is known that the run wrote digests, so that one without it is an edited file, not an older one
        (campaign 29 S1): the marker says every checkpoint of the run does (a run made since checkpoints carry one),
        or -- the marker deleted, or the folder copied without its dot files -- a checkpoint of an earlier step
        carries one (once a run writes digests, every later checkpoint has one).  Returns ``"run"`` where the run
        is known to write digests, ``"always"`` where only the default requires one, ``""`` where none is."""
        if self._marker_record().get("digests") is True:
            return "run"
        records = checkpoint_records(self.path, CONTENT_DIGEST)
        if any(v is not None and checkpoint_step(name) < step for name, v in records.items()):
            return "run"
        return "" if self.accept_undigested else "always"

    def note_written(self, folder: str) -> None:
        """Record in the marker that the run writes the optional ``folder`` (``adapter``, ``tensorboard``): only a
        folder the marker names is the run's own to ``--overwrite`` (campaign 29 S2: a user's ``adapter/README.md``
        in a run that never used --lora was deleted)."""
        record = self._marker_record()
        if record and folder not in record.get("wrote", []):
            record["wrote"] = sorted({*record.get("wrote", []), folder})
            atomic_write(self.path / MARKER_NAME, json.dumps(record) + "\n")

    def note_adapter_files(self, files: dict[str, str] | None) -> None:
        """Record in the marker the SHA-256 of each file the adapter save wrote (``{name: digest}``), or
        mark a save under way (None: recorded as null, the files then judged by their content, as a save killed
        half-way leaves them): ``--overwrite`` and a LoRA resume then take only those files as the run's (campaign 38
        B8: a user's notes added to the adapter's README.md, a key to its config).  A marker without the key is a run
        saved before the digests, whose adapter files are refused as unproven (campaign 39 C5)."""
        record = self._marker_record()
        if record:
            record["adapter_files"] = files
            atomic_write(self.path / MARKER_NAME, json.dumps(record) + "\n")

    def resume_run_id(self) -> str | None:
        """The run id a resumed run's checkpoint must carry: the marker's; when the marker is missing (deleted) or
        older than run ids, the one id this folder's checkpoints record (None when they record none: a run made
        before run ids).  A damaged marker, or checkpoints recording different ids (another run's copied in), is
        refused: either would switch the check off, and a copied checkpoint would be resumed without a word."""
        run_id, problem = self._read_marker()
        if run_id is not None:
            ids = checkpoint_run_ids(self.path)
            found = set(ids.values())
            if len(found) == 1 and None not in found and run_id not in found:  # campaign 30 T8
                raise RunDirError(f"--resume: the run marker {self.path / MARKER_NAME} names run {run_id}, but every "
                                  f"checkpoint in {self.checkpoints} ({len(ids)}) records run {found.pop()}: either "
                                  "the marker was replaced by another run's (remove it to resume with the "
                                  "checkpoints' run id; it is written again), or every checkpoint was copied in from "
                                  "another run (put this run's back, or start a new --run-dir)")
            return run_id
        if problem not in ("missing", "no id"):
            raise RunDirError(f"--resume: the run marker {self.path / MARKER_NAME} is damaged ({problem}); it names "
                              "the run whose checkpoints may be resumed here.  Remove it to resume with the run id "
                              "this folder's checkpoints record (it is written again)")
        ids = checkpoint_run_ids(self.path)
        found = sorted({i for i in ids.values() if i is not None})
        if len(found) > 1:
            listed = ", ".join(f"{name} ({i})" for name, i in ids.items() if i is not None)
            raise RunDirError(f"--resume: {self.checkpoints} holds checkpoints of {len(found)} different runs "
                              f"(run ids: {listed}) and {self.path / MARKER_NAME}, which names this run, is {problem}; "
                              "resuming could mix two runs' histories; remove the checkpoints copied in from elsewhere")
        return found[0] if found else None

    def restore_marker(self, run_id: str | None) -> None:
        """Write the marker again with ``run_id`` (:meth:`resume_run_id`, after the checkpoint it continues passed
        its checks) when it was deleted or predates run ids; a readable marker is left as it is."""
        if run_id is not None and self._read_marker()[1] in ("missing", "no id"):
            every = checkpoint_records(self.path, CONTENT_DIGEST).values()  # all carry one: later ones will too
            record = {"tool": "seco-lab", "run_id": run_id,
                      **({"digests": True} if every and all(v is not None for v in every) else {})}
            atomic_write(self.path / MARKER_NAME, json.dumps(record) + "\n")

    def load_checkpoint(self, map_location=None, check=None) -> dict | None:
        """The newest intact checkpoint (``latest`` first, then older steps), or None when there is none.
        A damaged one is reported with a warning and skipped; ``check(state, name)`` may refuse one
        (raising :class:`RunDirError`, which is not damage and stops the search)."""
        names = sorted((p.name for p in self.checkpoints.glob("step_*.pt")), reverse=True)
        pointed = self._pointed()
        if pointed is not None:
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

    def truncate_metrics(self, last_step: int, records: list | None = None) -> None:
        """Keep the records up to ``last_step``: later ones belong to the part of the run being redone.
        ``records``: the file's records as already read (default: read now)."""
        rows = [r for r in (read_metrics(self.path) if records is None else records) if r["step"] <= last_step]
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
