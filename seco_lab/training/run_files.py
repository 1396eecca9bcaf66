"""Reading a run's files: a checkpoint loaded safely (:func:`safe_load`), ``config.json``, ``metrics.jsonl`` (a
torn last line dropped) and the steps with a checkpoint.

A ``.pt`` checkpoint carries the digest of its own content (:func:`content_digest`: SHA-256 over every value, each
tensor's dtype, shape and bytes), so that a file edited or re-saved after seco-lab wrote it is told from the one it
wrote (:func:`seco_lab.training.experiment.check_content_digest`)."""

from __future__ import annotations

import hashlib
import pickle
import re
import warnings
from pathlib import Path

import torch

from ..store import CONFIG_MAX_BYTES, TABLE_MAX_BYTES, DuplicateKeyError, checked_file, loads_json, read_json
from .checkpoint_archive import load_archive
from .run_checks import RUN_RECORD_KEYS, RunDirError, checkpoint_steps

__all__ = ["CHECKPOINT_FILE", "CHECKPOINT_KEYS", "CONTENT_DIGEST", "UnsafeCheckpoint", "content_digest",
           "checkpoint_files", "checkpoint_records", "checkpoint_step", "checkpoint_run_ids",
           "checkpoint_steps", "read_config", "read_metrics", "run_file",
           "safe_load"]

CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "torch_rng", "numpy_rng")
CHECKPOINT_FILE = re.compile(r"step_(\d+)\.pt")
#: the key under which a ``.pt`` checkpoint carries :func:`content_digest` of the rest of it
CONTENT_DIGEST = "content_digest"


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint's name (``step_000004.pt``, ``step_000004.dcp``)."""
    return int(name.split("_")[1].split(".")[0])


def content_digest(state: dict) -> str:
    """SHA-256 of a checkpoint's values but :data:`CONTENT_DIGEST` (hex): dict entries in the order of their keys'
    ``repr``, lists and tuples in order, each tensor's dtype, shape and bytes, every other value's type and
    ``repr`` (a safe load holds nothing else).  The same before saving and after a load on the CPU."""
    h = hashlib.sha256()
    _digest_into(h, {k: v for k, v in state.items() if k != CONTENT_DIGEST})
    return h.hexdigest()


def _digest_into(h, x) -> None:
    import numpy as np

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(x, np.ndarray):  # the numpy RNG state of checkpoints written before it was a tensor
        h.update(f"A{x.dtype}{x.shape};".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, dict):
        h.update(f"D{len(x)};".encode())
        for k in sorted(x, key=repr):
            _digest_into(h, k)
            _digest_into(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"{'L' if isinstance(x, list) else 'U'}{len(x)};".encode())
        for v in x:
            _digest_into(h, v)
    else:
        h.update(f"{type(x).__name__}:{x!r};".encode())


class UnsafeCheckpoint(RunDirError):
    """A file in a checkpoint's place holding objects a safe load refuses (loading it could run code)."""


def run_file(path: Path, what: str, max_bytes: int | None = None) -> Path:
    """``path`` if it is a regular file of at most ``max_bytes`` (:func:`seco_lab.store.checked_file`), else a
    :class:`RunDirError` naming it: a FIFO, device or folder in a run directory is never opened (a read would
    block or never end), and a file far larger than the run writes is not read whole."""
    try:
        return checked_file(path, what, max_bytes, "remove it, or restore the file the run wrote")
    except ValueError as e:
        raise RunDirError(str(e)) from None


def safe_load(path: Path, map_location=None, mmap: bool = False):
    """``torch.load(weights_only=True)``: tensors and plain values only, so a crafted file cannot run code.
    numpy arrays (the RNG state of checkpoints written before it was stored as a tensor) are allowed too.
    ``mmap``: the tensors are mapped, not read (to look at a checkpoint's plain values cheaply)
    (:func:`~seco_lab.training.checkpoint_archive.load_archive`)."""
    run_file(path, "checkpoint")  # a FIFO would block torch.load forever
    try:
        return load_archive(path, map_location=map_location, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise
        raise UnsafeCheckpoint(f"{path} holds objects a safe load refuses (not tensors or plain values); it is "
                               "not a seco-lab checkpoint, and loading it could run code -- remove it") from None


def checkpoint_files(run_dir) -> list[tuple[str, Path]]:
    """``(checkpoint name, the file holding its plain values)`` of every checkpoint of ``run_dir``, oldest first:
    a ``step_N.pt`` file itself, a sharded ``step_N.dcp`` directory its extras file (``extra.pt``,
    :data:`seco_lab.training.sharded_checkpoint.EXTRA`)."""
    out = []
    for step in checkpoint_steps(run_dir):
        for name, inner in ((f"step_{step:06d}.pt", None), (f"step_{step:06d}.dcp", "extra.pt")):
            path = Path(run_dir) / "checkpoints" / name
            path = path / inner if inner else path
            if path.is_file():
                out.append((name, path))
    return out


def checkpoint_records(run_dir, key: str) -> dict[str, str | None]:
    """``{checkpoint name: the string it records under key}`` for every checkpoint of ``run_dir`` (tensors mapped,
    not read), None for one that records none or cannot be read (a damaged checkpoint is reported when a resume
    reaches it)."""
    out = {}
    for name, path in checkpoint_files(run_dir):
        try:
            state = safe_load(path, map_location="cpu", mmap=True)
            value = state.get(key) if isinstance(state, dict) else None
        except Exception:  # noqa: BLE001 -- damaged or foreign: it records nothing to agree on
            value = None
        out[name] = value if isinstance(value, str) else None
    return out


def checkpoint_run_ids(run_dir) -> dict[str, str | None]:
    """``{checkpoint name: the run id it records}`` (:func:`checkpoint_records`)."""
    return checkpoint_records(run_dir, "run_id")


def read_config(run_dir) -> dict:
    """The run's settings (``config.json``, a JSON object), read by :func:`seco_lab.store.read_json`: a missing,
    damaged (FIFO, device, too large, not JSON, too deep, not an object) or unreadable file is a
    :class:`RunDirError` naming it."""
    path = Path(run_dir) / "config.json"
    try:
        config = read_json(path, "run config", CONFIG_MAX_BYTES, "remove it, or restore the file the run wrote",
                           expect=None)
    except (OSError, ValueError) as e:
        raise RunDirError(str(e) if isinstance(e, ValueError) else
                          f"{path}: cannot read the run's config ({e.strerror or e})") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{path} holds a {type(config).__name__}, not a run's settings: the file is damaged or "
                          "not written by seco-lab train")
    lacking = [k for k in ("mode", "steps", "seq_len", "chunk_size", "seed", "lr") if k in RUN_RECORD_KEYS
               and k not in config]
    if lacking:  # every run records them; without, the defaults would pass for the run's settings
        raise RunDirError(f"{path} lacks {', '.join(lacking)}: it is not a run's record (damaged, or not written by "
                          "seco-lab train); restore the file the run wrote")
    return config


def read_metrics(run_dir) -> list[dict]:
    """The records of ``metrics.jsonl``; a torn last line is dropped with a warning, damage elsewhere raises."""
    path = Path(getattr(run_dir, "path", run_dir)) / "metrics.jsonl"  # a path or a RunDir
    if not path.exists():
        return []
    try:
        # utf-8-sig: a byte-order mark an editor saved in front of the first record is not part of it
        lines = run_file(path, "metrics file", TABLE_MAX_BYTES).read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not text (not UTF-8): the metrics file is damaged or was overwritten") from None
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(loads_json(line))
        except DuplicateKeyError as e:
            raise RunDirError(f"{path}: line {i + 1} is not a record this tool writes ({e}); the metrics file is "
                              "damaged") from None
        except (ValueError, RecursionError):
            if i == len(lines) - 1 or all(not ln.strip() for ln in lines[i + 1 :]):
                warnings.warn(f"{path}: dropping a torn last line ({line[:40]!r}...)", stacklevel=2)
                break
            raise RunDirError(f"{path}: line {i + 1} is not JSON; the metrics file is damaged") from None
    return rows
