"""A ``.pt`` checkpoint archive read safely: ``torch.load(weights_only=True)`` (tensors and plain values only, so a
crafted file cannot run code), and whether a file is a checkpoint a given run wrote.  It depends on nothing else of
the trainer, so the run-folder checks (:mod:`seco_lab.training.run_checks`) and the run's files
(:mod:`seco_lab.training.run_files`) both use it; torch is imported when a file is read."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

__all__ = ["ANY_RUN", "is_own_checkpoint", "load_archive"]


def load_archive(path: Path, map_location=None, mmap: bool = False):
    """``torch.load(path, weights_only=True)`` of a regular file; numpy arrays (the RNG state of checkpoints written
    before it was stored as a tensor) are allowed too.  ``mmap``: the tensors are mapped, not read.  A file that is
    no zip archive is a ValueError; objects a safe load refuses, torch's ``pickle.UnpicklingError``."""
    import numpy as np
    import torch
    from numpy._core.multiarray import _reconstruct

    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else is
        raise ValueError("not a torch checkpoint archive (no zip structure): truncated, overwritten or foreign")
    with torch.serialization.safe_globals([_reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


#: ``is_own_checkpoint``'s ``run_id`` where the run's id is unknown (its marker is gone): any run's checkpoint
ANY_RUN = object()


def is_own_checkpoint(path: Path, run_id: str | None | object, step: int | None = None) -> bool:
    """``path`` is a checkpoint the run ``run_id`` wrote: a regular file, a torch archive (a zip holding
    ``*/data.pkl``) that loads safely (tensors mapped, not read) as a checkpoint recording ``run_id`` (None: a run
    folder made before run ids, whose checkpoints record none; :data:`ANY_RUN`: whichever) and the step its name
    (``step_N.pt``) says, or ``step`` (a sharded checkpoint's ``extra.pt``).  A zip of the user's, a damaged file or
    another run's checkpoint is not this run's, so never deleted (checkpoint pruning, ``--overwrite``: campaign 34
    X2)."""
    if step is None:  # a sharded checkpoint's extra.pt: the step its folder's name says
        match = re.fullmatch(r"step_(\d+)\.pt", Path(path).name)
        if match is None:
            return False
        step = int(match[1])
    if not Path(path).is_file():  # a FIFO would block the load
        return False
    try:
        with zipfile.ZipFile(path) as z:
            if not any(n.endswith("/data.pkl") for n in z.namelist()[:4096]):
                return False
        state = load_archive(path, map_location="cpu", mmap=True)
    except Exception:  # noqa: BLE001 -- not a zip, damaged, or not a checkpoint: not this run's
        return False
    return (isinstance(state, dict) and (run_id is ANY_RUN or state.get("run_id") == run_id) and "fingerprint" in state
            and state.get("step") == step)
