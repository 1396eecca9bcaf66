"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) with the distributed state-dict API.

    RUN_DIR/checkpoints/step_NNNNNN.dcp/     .metadata, one __R_0.distcp file per rank, extra.pt

Every rank writes its own shards of the model and optimizer state (``get_state_dict``:
DTensor shards under FSDP, whole tensors otherwise) into ``step_NNNNNN.dcp.tmp/``; rank 0
adds ``extra.pt`` (step, scheduler, RNG states, config) and, once every rank has finished,
renames the directory to ``step_NNNNNN.dcp`` and points ``latest`` at it -- so a
checkpoint directory is complete or absent, as with the ``.pt`` files of replicated runs.

Loading reads the checkpoint into whatever layout the loading trainer has: DCP reshards
on load, so a checkpoint saved by N ranks resumes on M ranks, sharded or not, and a
process without a process group reads it too.  A replicated run's ``.pt`` checkpoint
loads into a sharded trainer through :func:`load_replicated`.  Multi-node runs need the run directory on
a filesystem every node sees.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .run_dir import DCP_TREE, RunDirError, remove_own, safe_load

__all__ = ["intact", "load", "load_replicated", "newest", "save"]

SUFFIX = ".dcp"
EXTRA = "extra.pt"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}{SUFFIX}"


def is_sharded(path: Path) -> bool:
    return Path(path).name.endswith(SUFFIX)


def intact(path: Path) -> bool:
    """A renamed checkpoint directory with DCP's metadata and the extras (never a ``.tmp``)."""
    path = Path(path)
    return is_sharded(path) and (path / ".metadata").is_file() and (path / EXTRA).is_file()


def save(checkpoints: Path, step: int, model, optimizer, extra: dict) -> Path:
    """Write the model and optimizer state (every rank its shards) and ``extra`` (rank 0) as
    ``checkpoints/step_NNNNNN.dcp``; collective: every rank calls it.  Returns the directory."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank() if _distributed() else 0
    final = Path(checkpoints) / checkpoint_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.is_dir():  # a save killed half-way: remove its files (DCP's and ours), nothing else
            remove_own(tmp, DCP_TREE)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    if rank == 0:
        with open(tmp / EXTRA, "wb") as f:
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())
    _barrier()  # every rank's shards are on disk
    if rank == 0:
        old = final.with_name(final.name + ".old")
        if old.is_dir():
            remove_own(old, DCP_TREE)
        if final.exists():  # the same step saved before (a rerun after a damaged later checkpoint)
            os.replace(final, old)  # two renames back to back; the old copy is deleted only after
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old.is_dir():
            remove_own(old, DCP_TREE)
    _barrier()
    return final


def load(path: Path, model, optimizer, check=None) -> dict:
    """Read ``path`` into ``model`` and ``optimizer`` (resharding to their layout) and return the extras;
    ``check(extras, name)`` sees the extras (step, fingerprint) first and may refuse the checkpoint."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        extra = safe_load(Path(path) / EXTRA, map_location="cpu")
    except (ValueError, RuntimeError, OSError, EOFError) as e:
        if isinstance(e, RunDirError):
            raise
        raise RunDirError(f"--resume: {Path(path) / EXTRA} is damaged ({type(e).__name__}: {str(e)[:120]}); remove "
                          f"{path} to resume from an earlier checkpoint") from None
    if check is not None:
        check(extra, Path(path).name)

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    with warnings.catch_warnings():  # one process without a process group reads the whole checkpoint: intended
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp_load(state, checkpoint_id=str(path))
        except (CheckpointException, RuntimeError, OSError, ValueError, EOFError, KeyError) as e:  # a shard
            # truncated, deleted or foreign (DCP wraps each rank's failure in a CheckpointException, a BaseException)
            # DCP reports a failure on any rank to every rank, so each raises this and none waits on the others
            failures = getattr(e, "failures", None)  # a CheckpointException: {rank: the exception there}
            if isinstance(failures, dict) and failures:
                e = next(iter(failures.values()))
                e = e[0] if isinstance(e, tuple) and e else e  # (exception, traceback) in some versions
            first = str(e).strip().splitlines()[0][:100] if str(e).strip() else type(e).__name__
            raise RunDirError(f"--resume: the sharded checkpoint {path} is damaged ({type(e).__name__}: {first}); "
                              f"remove it to resume from an earlier checkpoint") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return extra


def load_replicated(state: dict, model, optimizer) -> None:
    """Load a replicated run's whole state (``step_N.pt``: ``model.state_dict()`` and
    ``optimizer.state_dict()``) into a sharded ``model`` and ``optimizer``: every rank keeps its shards.

    The optimizer's state is keyed by parameter position; positions are the trainable parameters
    in ``named_parameters()`` order (how the trainer builds AdamW), turned into names for
    ``set_state_dict(..., full_state_dict=True)``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    osd = state["optimizer"]
    if sorted(i for g in osd["param_groups"] for i in g["params"]) != list(range(len(names))):
        raise ValueError(f"the checkpoint's optimizer holds {sum(len(g['params']) for g in osd['param_groups'])} "
                         f"parameters, the model {len(names)} trainable ones")
    named = {"state": {names[i]: v for i, v in osd["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=named,
                   options=StateDictOptions(full_state_dict=True))


def newest(checkpoints: Path) -> list[Path]:
    """Sharded checkpoint directories, newest first; a damaged one (no metadata or extras) is
    reported with a warning and left out."""
    found = sorted((p for p in Path(checkpoints).glob(f"step_*{SUFFIX}") if p.is_dir()), reverse=True)
    good = []
    for p in found:
        if intact(p):
            good.append(p)
        else:
            warnings.warn(f"sharded checkpoint {p} is incomplete (no .metadata or {EXTRA}); skipping it", stacklevel=2)
    return good
