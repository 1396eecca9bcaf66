"""What identifies a run's experiment, on disk and in its checkpoints.

* :func:`experiment_record` -- what ``config.json`` stores (for HF runs the HF model's config);
  :func:`experiment_from_record` reads it back as a :class:`~seco_lab.config.TrainConfig`.
* :func:`experiment_fingerprint` -- the hash every checkpoint carries (its schedule length left out, so an
  extended run keeps it); :func:`config_differences` -- the fields two experiments differ in.
* :func:`check_checkpoint` -- refuses a checkpoint of another experiment, of another run (its run id), one
  renamed to another step, or one trained on another learning-rate schedule than the run's record up to its
  step (:func:`past_schedule`: a copy of the run extended otherwise, an edited ``steps``), or whose weights or
  optimizer state hold a NaN or an infinity (:func:`first_non_finite`: damaged, or saved from a diverged run),
  then (:func:`check_content_digest`) one whose content was changed after seco-lab wrote it;
  :func:`load_newest_checkpoint` -- the checkpoint a resumed run continues from (sharded or ``.pt``), checked;
  :func:`check_nothing_to_resume` -- refuses a resume with no checkpoint of a run that logged steps;
  :func:`check_metrics_history` -- refuses a ``metrics.jsonl`` whose steps repeat or go backwards;
  :func:`check_history` -- refuses one whose records up to the checkpoint's step are not the ones the run
  logged (:func:`history_digests`: each record's digest, which every checkpoint carries).
* :func:`read_experiment` -- the record a resume continues: ``config.json``, or, when it was deleted, the
  experiment the newest intact checkpoint records (:func:`recover_record`; ``config.json`` is then rewritten).
* :func:`continued_cycles` -- the schedule cycles a resumed (extended, perhaps re-warmed) run keeps.
* :func:`numpy_rng_state`, :func:`set_numpy_rng_state` -- numpy's global RNG state as a checkpoint holds it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from ..config import RunControl, TrainConfig, warn_once
from ..core.checks import first_non_finite
from . import sharded_checkpoint
from .run_dir import RunDir, RunDirError, read_config, read_metrics, safe_load
from .run_files import (
    CONTENT_DIGEST,
    UnsafeCheckpoint,
    checkpoint_files,
    checkpoint_step,
    checkpoint_steps,
    content_digest,
)

__all__ = ["LATER_FIELDS", "RECORD_KEYS", "SCHEDULE_FIELDS", "check_complete_record", "check_corpus",
           "carried_history", "check_content_digest", "check_metrics_history", "check_history", "check_model_record",
           "corpus_digest", "history_digests", "record_digest",
           "check_step_record", "step_record",
           "metrics_gap", "past_schedule", "schedule_cycles",
           "warn_metrics_gap", "check_checkpoint", "check_nothing_to_resume",
           "config_differences", "continued_cycles", "experiment_fingerprint", "experiment_from_record",
           "experiment_record", "load_newest_checkpoint", "numpy_rng_state", "read_experiment",
           "recover_record", "set_numpy_rng_state"]

#: fields that may change when a run is resumed: its length, and the schedule cycles an extension adds
SCHEDULE_FIELDS = ("steps", "lr_cycles")


def experiment_fingerprint(config: dict) -> str:
    """16 hex digits of SHA-256 over the experiment (a ``TrainConfig.to_dict()``), its schedule length left out:
    equal for every checkpoint of one run, extended or not, and different for another seed, model or data."""
    d = {k: v for k, v in TrainConfig.from_dict(config).to_dict().items() if k not in SCHEDULE_FIELDS}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def numpy_rng_state() -> dict:
    """``np.random.get_state()`` as plain values and a tensor (a safe ``torch.load`` reads them)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_numpy_rng_state(state) -> None:
    """Restore numpy's global RNG from a checkpoint's :func:`numpy_rng_state`."""
    if isinstance(state, dict):
        state = (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                 state["cached_gaussian"])
    np.random.set_state(state)  # checkpoints written before this format hold the tuple itself


def experiment_record(cfg: TrainConfig, model) -> dict:
    """What ``config.json`` stores: the experiment; for HF runs the HF model's config, not the tiny one."""
    d = cfg.to_dict()
    if cfg.hf_model is not None:
        from ..models.hf import config_record

        d["model"] = {"hf_model": cfg.hf_model, "config": config_record(model)}
    return d


#: HF config entries that say nothing of the model a run trains (an upgrade of transformers changes the first)
_NOT_THE_MODEL = frozenset({"transformers_version"})


def check_model_record(record: dict, model, source: str) -> None:
    """Refuse to resume an HF run whose model, built now from ``--hf-model`` (a checkpoint folder's
    ``config.json``, or an architecture and its overrides), is not the one the run's ``record`` says it trained
    (:func:`experiment_record`): an epsilon, a rope base or an activation edited in the folder's config between
    the runs would continue the run as another model (campaign 28, H35).  Runs of the tiny transformer, and
    records without the HF config, pass."""
    theirs = record.get("model").get("config") if isinstance(record.get("model"), dict) else None
    if record.get("hf_model") is None or not isinstance(theirs, dict):
        return
    from ..models.hf import config_record

    ours = json.loads(json.dumps(config_record(model) or {}))  # as config.json holds it: lists, not tuples
    differ = [k for k in sorted((set(ours) | set(theirs)) - _NOT_THE_MODEL) if ours.get(k) != theirs.get(k)]
    if differ:
        shown = ", ".join(f"{k} ({theirs.get(k)!r} -> {ours.get(k)!r})" for k in differ[:4])
        raise RunDirError(f"--resume: --hf-model {record['hf_model']} now builds another model than the run in "
                          f"{source} trained: its config differs in {shown}{' ...' if len(differ) > 4 else ''}; "
                          "restore the checkpoint folder's config.json as it was when the run started, or start a "
                          "new --run-dir")


def experiment_from_record(d: dict, source: str) -> TrainConfig:
    """The :class:`TrainConfig` of a ``config.json`` record (``source`` names it in errors)."""
    # run directories written before RunControl existed stored its fields in config.json too
    d = {k: v for k, v in d.items() if k not in RunControl.__dataclass_fields__}
    if d.get("hf_model") is not None:
        d.pop("model", None)
    cfg = TrainConfig.from_dict(d, source=source)
    try:  # a record is checked as the command line is: an edited or damaged field is named, not used
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its warnings were given when the run started
            return cfg.validate()
    except (TypeError, ValueError) as e:
        raise RunDirError(f"{source}: {e} -- the run's record was edited or is damaged; restore it") from None


def config_differences(saved: TrainConfig, new: TrainConfig) -> list[str]:
    """Fields that define the experiment and differ (``steps`` may grow: that extends the run)."""
    a, b = saved.to_dict(), new.to_dict()
    out = [f"{k} ({a[k]!r} -> {b[k]!r})" for k in a if k not in SCHEDULE_FIELDS and a[k] != b[k]]
    return out


def schedule_cycles(config: dict) -> list[list[int]]:
    """The warm-up + cosine cycles ``[start, end]`` a run's record (``TrainConfig.to_dict()``) schedules: its
    ``lr_cycles``, or one cycle over its ``steps``."""
    return [list(c) for c in (config.get("lr_cycles") or [[0, config.get("steps")]])]


def past_schedule(config: dict, step: int) -> list[list[int]]:
    """The cycles of ``config`` that shaped the learning rate of steps before ``step``: two records with the same
    past schedule trained their first ``step`` steps alike (an extension or a re-warm adds cycles from then on)."""
    return [c for c in schedule_cycles(config) if c[0] < step]


def _non_finite_message(name: str, tensor: str) -> str:
    """The refusal of checkpoint ``name`` whose ``tensor`` is not finite (:func:`first_non_finite`)."""
    what = "optimizer state" if tensor.startswith("optimizer state") else "weights"
    return (f"--resume: checkpoint {name} holds non-finite {what} ({tensor}): it is damaged or was saved from a "
            "diverged run, and training from it gives NaN losses that no --lr mends; resume from an "
            f"earlier checkpoint (move {name} out of the run's checkpoints folder and delete checkpoints/latest) "
            "or start a new --run-dir")


def check_checkpoint(state: dict, name: str, cfg: TrainConfig, run_id: str | None = None,
                     saved: TrainConfig | None = None, fresh: dict | None = None, digests=False) -> None:
    """Refuse the checkpoint ``name`` (its ``state``) when it is of another experiment than ``cfg``, its
    step is not the step its name says, (``run_id``: the run folder's) it was written by another run,
    (``saved``: the run's record) it was trained on another learning-rate schedule than the run's record says
    (:func:`past_schedule`: a copy of the run extended otherwise, or an edited ``steps``), or (a ``.pt``
    checkpoint, which holds them) its weights or optimizer state are not finite (:func:`first_non_finite`).
    A refusal stops the resume: it does not fall back to an earlier checkpoint, as an unreadable file does --
    the file reads well, and the steps after an earlier one would be trained again without a word."""
    expected = checkpoint_step(name)
    step = state.get("step")
    if type(step) is not int:  # a bool, a float or a str is no step seco-lab wrote
        raise RunDirError(f"--resume: checkpoint {name} holds step {step!r}, not the integer {expected}: it was "
                          "edited or is not a seco-lab checkpoint; resume from an earlier checkpoint (move it out of "
                          "the run's checkpoints folder and delete checkpoints/latest) or start a new --run-dir")
    if step != expected:
        raise RunDirError(f"--resume: checkpoint {name} holds step {state.get('step')}, not {expected}; it was "
                          "renamed or copied from elsewhere")
    config = state.get("config")
    if not isinstance(state.get("fingerprint"), str):
        raise RunDirError(f"--resume: checkpoint {name} records no experiment fingerprint (every checkpoint "
                          "seco-lab writes has one), so it cannot be matched to this run: it was edited or "
                          "copied from elsewhere; put this run's checkpoints back or start a new --run-dir")
    try:
        found = state.get("fingerprint") or experiment_fingerprint(config)
    except (TypeError, ValueError, AttributeError):
        found = None
    expected_fingerprint = experiment_fingerprint(cfg.to_dict())
    if found != expected_fingerprint:
        diff = []
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            diff = config_differences(experiment_from_record(dict(config), name), cfg)
        raise RunDirError(f"--resume: checkpoint {name} belongs to another experiment (fingerprint {found}, this "
                          f"run's {expected_fingerprint}" + (f"; differs in {', '.join(diff)}" if diff else "")
                          + "): either the run's config.json was edited after the run was made (restore it), or the "
                          "checkpoint comes from another run (put this run's checkpoints back, or start a new "
                          "--run-dir)")
    if run_id is not None and state.get("run_id") != run_id:
        raise RunDirError(f"--resume: checkpoint {name} was written by another run than the one this folder's marker "
                          f"names (run id {state.get('run_id')}; the marker's {run_id}): the checkpoint was copied in "
                          "from elsewhere, or the marker was, and resuming would mix two runs' histories; put back "
                          "this run's own checkpoints and marker, or start a new --run-dir")
    if saved is not None:
        step = int(state["step"])
        if not isinstance(config, dict):
            raise RunDirError(f"--resume: checkpoint {name} records no experiment config (every checkpoint seco-lab "
                              "writes has one), so the schedule it was trained on is unknown: it was edited or "
                              "copied from elsewhere; put this run's checkpoints back or start a new --run-dir")
        theirs = past_schedule(config, step)
        ours = past_schedule(saved.to_dict(), step)
        if theirs != ours:
            raise RunDirError(f"--resume: checkpoint {name} was trained on another learning-rate schedule up to its "
                              f"step {step} (warm-up + cosine cycles {theirs}) than this run's config.json records "
                              f"({ours}): it comes from a copy of this run that was extended or re-warmed otherwise, "
                              "or config.json was edited; put this run's checkpoints (or its config.json) back, or "
                              "start a new --run-dir")
    bad = first_non_finite(state.get("model")) or first_non_finite(state.get("optimizer"))  # a .pt holds them
    if bad is not None:
        raise RunDirError(_non_finite_message(name, bad))
    problem = optimizer_state_problem(state.get("optimizer"), cfg, expected, fresh)
    if problem:
        raise RunDirError(_optimizer_message(name, problem))
    if name.endswith(".pt"):  # a sharded checkpoint's extras carry no digest: DCP's own files hold the tensors
        check_content_digest(state, name, digests(expected) if callable(digests) else digests)


#: checkpoint keys that only versions writing content digests write (``corpus_text``: campaign 30 T3): a checkpoint
#: holding one but no digest had it removed, whatever --accept-undigested says (campaign 32 V1)
DIGEST_ERA_KEYS = ("corpus_text",)


def check_content_digest(state: dict, name: str, required: bool | str = False) -> None:
    """Refuse checkpoint ``name`` whose content is not what seco-lab wrote (:func:`content_digest`, which every
    ``.pt`` checkpoint carries): a weight, a moment, a step counter, an RNG state or a record edited, or the file
    re-saved from an edited load, would continue another run than the one stopped, without a word.  Checked after
    every specific check (those name what is wrong).  A checkpoint without a digest passes only where it may be
    older than digests: not when ``required`` (:meth:`~seco_lab.training.run_dir.RunDir.digest_required`: ``"run"``
    where the run is known to write digests, ``"always"`` unless ``--accept-undigested``)."""
    recorded = state.get(CONTENT_DIGEST)
    back = (f"put the file seco-lab wrote back, resume from an earlier checkpoint (move {name} out of the run's "
            "checkpoints folder and delete checkpoints/latest), or start a new --run-dir")
    if CONTENT_DIGEST in state and not isinstance(recorded, str):  # seco-lab writes a str or no key at all
        raise RunDirError(f"--resume: checkpoint {name} carries content digest {recorded!r:.40}, which seco-lab never "
                          f"writes: the file was edited; {back}")
    if recorded is None:
        if required in ("run", True):
            raise RunDirError(f"--resume: checkpoint {name} carries no content digest, which every checkpoint of this "
                              "run has (its marker or an earlier checkpoint says so): the digest was removed from an "
                              f"edited file; {back}")
        if newer := [k for k in DIGEST_ERA_KEYS if k in state]:  # written by a version that writes digests
            raise RunDirError(f"--resume: checkpoint {name} carries no content digest, but records {newer[0]}, which "
                              "only a seco-lab that writes digests records: the digest was removed from an edited file "
                              f"(--accept-undigested does not apply); {back}")
        if required:
            raise RunDirError(f"--resume: checkpoint {name} carries no content digest, which every checkpoint seco-lab "
                              "writes has: the digest was removed from an edited file, or seco-lab wrote it before "
                              "checkpoints carried one (an older version's run: resume it with --accept-undigested, "
                              "unless its marker or an earlier checkpoint shows the run wrote digests); otherwise "
                              f"{back}")
        return
    if recorded != content_digest(state):
        raise RunDirError(f"--resume: checkpoint {name} was changed after seco-lab wrote it (its content no longer "
                          "matches the digest it carries: it was edited, or re-saved from an edited load); a resume "
                          "continues only the state a run saved, so put the file seco-lab wrote back, resume from an "
                          f"earlier checkpoint (move {name} out of the run's checkpoints folder and delete "
                          "checkpoints/latest), or start a new --run-dir")


def optimizer_state_problem(opt, cfg: TrainConfig, step: int, fresh: dict | None = None) -> str | None:
    """What is wrong with a checkpoint's AdamW state that would quietly change the run (campaign 26 P2, P7): none at
    all after a step (a slim or edited checkpoint: the moments would restart from zero, and the run differ from one
    never stopped), a negative second moment (its square root is NaN), or hyperparameters other than the run's
    (``load_state_dict`` restores the checkpoint's betas and weight decay over the config's); with ``fresh``
    (:func:`fresh_optimizer_state`) also anything else that departs from the run's own optimizer.  The learning
    rate is not checked: the schedule sets it at every step."""
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict):
        return None  # what a damaged file holds instead is named when it is loaded
    problem = None
    if step > 0 and not opt["state"] and isinstance(opt.get("param_groups"), list) and any(
            isinstance(g, dict) and g.get("params") for g in opt["param_groups"]):
        problem = "holds no optimizer state (AdamW's moments: a slim or edited checkpoint)"
    for i, per in opt["state"].items():
        sq = per.get("exp_avg_sq") if isinstance(per, dict) else None
        sq = sq.to_local() if hasattr(sq, "to_local") else sq  # a sharded tensor: this rank's shard
        if isinstance(sq, torch.Tensor) and sq.is_floating_point() and bool((sq < 0).any()):
            problem = problem or f"holds a negative second moment (exp_avg_sq of parameter {i}), which no AdamW writes"
    want = {"betas": [float(b) for b in cfg.betas], "weight_decay": float(cfg.weight_decay)}
    for g in opt.get("param_groups") if isinstance(opt.get("param_groups"), list) else []:
        got = {k: (list(g[k]) if k == "betas" and isinstance(g[k], (list, tuple)) else g[k])
               for k in want if isinstance(g, dict) and k in g}
        for k, v in got.items():
            if v != want[k]:
                problem = problem or f"records AdamW {k} {v}, not the run's {want[k]}"
        eps = g.get("eps") if isinstance(g, dict) else None
        if isinstance(eps, float) and not (math.isfinite(eps) and eps > 0):
            problem = problem or f"records AdamW eps {eps}, which must be finite and > 0"
    return problem or (_differs_from_fresh(opt, fresh, step) if fresh is not None else None)


#: param-group entries the schedule sets at every step: a checkpoint's may differ from a fresh optimizer's
_SCHEDULED = ("params", "lr", "initial_lr")


def fresh_optimizer_state(optimizer) -> dict:
    """What a checkpoint's AdamW state is checked against (:func:`optimizer_state_problem`): this run's optimizer,
    before anything is loaded into it -- its param groups (every flag: amsgrad, maximize, ...) and each parameter's
    shape, by the ids ``state_dict`` gives them."""
    groups = optimizer.state_dict()["param_groups"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {"param_groups": groups, "shapes": {i: tuple(p.shape) for i, p in enumerate(params)}}


def _differs_from_fresh(opt: dict, fresh: dict, step: int) -> str | None:
    """How a checkpoint's AdamW state departs from what this run's optimizer would have written by ``step``
    (campaign 27): other flags (amsgrad, maximize: the update itself changes), parameters in another order or
    number, moments of another shape, a parameter without state, a step counter that is not the step's."""
    groups, ref = opt.get("param_groups"), fresh["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(ref) or not all(isinstance(g, dict) for g in groups):
        return f"holds {len(groups) if isinstance(groups, list) else 'no'} parameter group(s), not the run's {len(ref)}"
    for g, r in zip(groups, ref, strict=True):
        if list(g.get("params", ())) != list(r["params"]):
            return "lists the optimizer's parameters in another order or number than this model's"
        for k in sorted(set(g) & set(r) - set(_SCHEDULED)):
            got, want = (list(v) if isinstance(v, tuple) else v for v in (g[k], r[k]))
            if got != want:
                return f"records AdamW {k} {got}, not the run's {want}"
    shapes = fresh["shapes"]
    for i, shape in shapes.items():
        per = opt["state"].get(i)
        if per is None:
            if step > 0:
                return f"holds no optimizer state for parameter {i} (AdamW's moments: a slim or edited checkpoint)"
            continue
        if not isinstance(per, dict):
            return f"holds optimizer state of parameter {i} that is not AdamW's"
        for key, t in per.items():
            if key != "step" and isinstance(t, torch.Tensor) and tuple(t.shape) != shape:
                return f"holds {key} of parameter {i} with shape {tuple(t.shape)}, not the parameter's {shape}"
        count = per.get("step")
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = float(count)
        if not isinstance(count, (int, float)) or not 0 < count <= step:
            return (f"records AdamW's step counter {count} for parameter {i}, which after step {step} must lie in "
                    f"[1, {step}] (the bias correction would restart or break)")
    return None


def _optimizer_message(name: str, problem: str) -> str:
    return (f"--resume: checkpoint {name} {problem}: resuming from it would not continue the run; it is damaged or "
            "was edited -- resume from an earlier checkpoint (move this one out of the run's checkpoints folder and "
            "delete checkpoints/latest) or start a new --run-dir")


def load_newest_checkpoint(run_dir: RunDir, model, optimizer, cfg: TrainConfig,
                           saved: TrainConfig | None = None) -> dict | None:
    """The newest checkpoint's state, checked against ``cfg``, the run folder's run id
    (:meth:`RunDir.resume_run_id`) and (``saved``) the run's recorded schedule (:func:`check_checkpoint`): a
    sharded directory is read into ``model`` and ``optimizer`` here (resharded to this run's ranks) and its extras
    returned; a ``.pt`` file is returned whole.  None when ``run_dir`` holds no checkpoint."""
    run_dir.check_latest()
    sharded = sharded_checkpoint.newest(run_dir.checkpoints)
    # a .pt checkpoint's AdamW state is checked against this run's optimizer as built -- not a sharded model's, whose
    # parameters are shards (a replicated checkpoint is resharded into it)
    plain = optimizer is not None and not any(hasattr(p, "to_local") for g in optimizer.param_groups
                                              for p in g["params"])
    fresh = fresh_optimizer_state(optimizer) if plain else None
    check = functools.partial(check_checkpoint, cfg=cfg, run_id=run_dir.resume_run_id(), saved=saved, fresh=fresh,
                              digests=run_dir.digest_required)
    files = sorted(run_dir.checkpoints.glob("step_*.pt"))
    if sharded and (not files or sharded[0].name.split(".")[0] >= files[-1].name.split(".")[0]):
        extra = sharded_checkpoint.load(sharded[0], model, optimizer, check=check)
        # the weights are read into the model (this rank's shards): checked there, every rank told of any rank's
        bad = _on_any_rank(first_non_finite(model.state_dict()) or first_non_finite(optimizer.state_dict()))
        if bad is not None:
            raise RunDirError(_non_finite_message(sharded[0].name, bad))
        step = checkpoint_step(sharded[0].name)
        problem = _on_any_rank(optimizer_state_problem(optimizer.state_dict(), cfg, step))
        if problem is not None:
            raise RunDirError(_optimizer_message(sharded[0].name, problem))
        return extra
    # load_state_dict moves the tensors to the model's device
    return run_dir.load_checkpoint(map_location="cpu", check=check)


def _on_any_rank(found: str | None) -> str | None:
    """``found`` (this rank's finding), or in a process group the first finding of any rank (``"... on rank r"``),
    so that every rank refuses alike and none waits for the others in a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return next((f"{f} on rank {rank}" for rank, f in enumerate(everyone) if f is not None), None)


def _records(run_dir: RunDir, records: list | None) -> list:
    """The records of ``metrics.jsonl`` a resume read once (so every check sees the same file), or read now."""
    return read_metrics(run_dir.path) if records is None else records


def check_nothing_to_resume(run_dir: RunDir, records: list | None = None) -> None:
    """No checkpoint at all: resuming from step 0 is right only if the run never logged a training step.
    ``records``: the records of ``metrics.jsonl`` as the resume read them (default: read now), here and below."""
    steps = [r.get("step", 0) for r in _records(run_dir, records) if isinstance(r, dict)]
    done = max([s for s in steps if isinstance(s, int)], default=0)
    if done > 0:
        raise RunDirError(f"--resume: {run_dir.metrics_path} records step {done} but {run_dir.checkpoints} holds no "
                          "checkpoint to continue from (deleted, or the run stopped before its first checkpoint); "
                          "restore them, or start again with --overwrite")


def recover_record(run_dir) -> tuple[dict, str]:
    """``(experiment, checkpoint name)``: the experiment the newest intact checkpoint of ``run_dir`` records (every
    checkpoint stores its ``TrainConfig`` and its fingerprint), for a run whose ``config.json`` was deleted."""
    for name, target in reversed(checkpoint_files(run_dir)):
        try:
            state = safe_load(target, map_location="cpu")
            config = state["config"]
            if experiment_fingerprint(config) != state["fingerprint"]:
                continue
            experiment_from_record(dict(config), name)
        except UnsafeCheckpoint:  # a crafted file: named, not skipped
            raise
        except Exception:  # noqa: BLE001 -- a damaged or foreign checkpoint: try an earlier one
            continue
        return dict(config), name
    raise RunDirError(f"--resume: {run_dir} has no config.json and none of its checkpoints records the run's "
                      "experiment (damaged or foreign); restore config.json, or start a new --run-dir")


def read_experiment(run_dir) -> dict:
    """The record a resume of ``run_dir`` continues: ``config.json``; when it is missing but checkpoints remain,
    the experiment of the newest intact checkpoint (a warning says so; the trainer rewrites ``config.json``)."""
    path = Path(run_dir) / "config.json"
    if path.exists() or path.is_symlink() or not checkpoint_steps(run_dir):  # a folder or FIFO there: named
        return check_complete_record(read_config(run_dir), path)
    record, name = recover_record(run_dir)
    warn_once(f"{Path(run_dir) / 'config.json'} is missing; resuming with the experiment recorded in checkpoint "
              f"{name} (config.json is written again from it)")
    return record


#: fields of the experiment added after the first release: a record without them is an older run's, and their
#: defaults are what it did; any other field missing means the record was edited or damaged
LATER_FIELDS = frozenset({"lr_cycles"})


def check_complete_record(record: dict, path) -> dict:
    """``record`` (a run's ``config.json``) when it holds every field the run wrote -- the experiment's and, for the
    tiny transformer, the model's; otherwise a :class:`RunDirError` naming what is missing: a default filled in
    there would pass for the run's own setting."""
    from dataclasses import fields

    from ..models.tiny_config import TinyConfig

    skip = LATER_FIELDS | set(RunControl.__dataclass_fields__)
    lacking = [f.name for f in fields(TrainConfig) if f.name not in skip and f.name not in record]
    model = record.get("model")
    if record.get("hf_model") is None and isinstance(model, dict):
        lacking += [f"model.{f.name}" for f in fields(TinyConfig) if f.name not in model]
    if lacking:
        raise RunDirError(f"{path} lacks {', '.join(lacking)}: the run's record was edited or is damaged (every run "
                          "writes them all); restore the file the run wrote")
    return record


def continued_cycles(saved: TrainConfig, steps: int, step: int, rewarm: bool) -> list:
    """The ``lr_cycles`` of a run resumed at ``step`` with ``steps`` in all: the cycles it had (by default one
    over the saved ``steps``), plus, with ``rewarm``, a new cycle from ``step`` to ``steps`` ([] for the
    default single cycle)."""
    cycles = [list(x) for x in (saved.lr_cycles or [[0, saved.steps]])]
    if rewarm:
        if steps <= saved.steps or step >= steps:
            raise RunDirError(f"--rewarm starts a new schedule cycle over added steps; pass --steps above the "
                              f"run's {saved.steps}")
        cycles = [x for x in cycles if x[0] < step] + [[step, steps]]
    return cycles if cycles != [[0, steps]] else []


def metrics_gap(logged_steps, step: int) -> str:
    """``"steps 3-4, 7"``: the steps in 0..``step`` with no record among ``logged_steps`` ("" when none); step 0 is
    the evaluation every run logs before it trains."""
    logged = set(logged_steps)
    missing = [s for s in range(step + 1) if s not in logged]
    if not missing:
        return ""
    spans, start = [], missing[0]
    for prev, s in zip(missing, [*missing[1:], None]):
        if s != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = s
    return f"step{'s' if len(missing) > 1 else ''} {', '.join(spans[:5])}{', ...' if len(spans) > 5 else ''}"


def check_metrics_history(run_dir: RunDir, step: int, records: list | None = None) -> None:
    """Refuse a resume whose ``metrics.jsonl`` is not one run's history: a record without an integer step, or
    steps that repeat or go backwards (the file edited, or two runs' metrics joined) -- past ``step`` too, where
    the records of the part redone now are dropped by their step.  Found after training, the run's curve could
    not be drawn; resumed, the history would stay mixed."""
    path, prev = run_dir.metrics_path, None
    for i, r in enumerate(_records(run_dir, records), 1):
        s = r.get("step") if isinstance(r, dict) else None
        if isinstance(s, bool) or not isinstance(s, int):
            raise RunDirError(f"--resume: {path}: record {i} has no integer 'step' ({str(r)[:60]}): the file is "
                              "damaged; restore it, or remove that record")
        if prev is not None and s <= prev:  # past the checkpoint too: the part redone now is dropped by step
            raise RunDirError(f"--resume: {path}: record {i} has step {s} after step {prev} (steps repeat or go "
                              "backwards): the file was edited or two runs' metrics were joined; restore it, or "
                              "remove the repeated records")
        prev = s


#: what a checkpoint records of the step it was taken after, and a resume compares with ``metrics.jsonl``: values
#: the step computed, equal bit for bit in the run's own history (JSON keeps a float's exact value)
RECORD_KEYS = ("step", "loss", "lr", "grad_norm")


def step_record(metrics: dict) -> dict:
    """The part of a step's metrics a checkpoint records (:data:`RECORD_KEYS`)."""
    return {k: metrics[k] for k in RECORD_KEYS if k in metrics}


def check_step_record(run_dir: RunDir, state: dict, records: list | None = None) -> None:
    """Refuse a checkpoint whose recorded step (loss, lr, gradient norm) is not the one ``metrics.jsonl`` holds for
    that step: it continues another history -- a copy of the run extended or re-warmed otherwise, copied in with
    ``config.json`` gone, or any checkpoint the other checks cannot tell from the run's own.  Checkpoints written
    before they recorded their step, and a step ``metrics.jsonl`` has no record of (a gap, warned about), pass."""
    theirs = state.get("record")
    if not isinstance(theirs, dict) or not isinstance(theirs.get("step"), int):
        return
    ours = next((r for r in _records(run_dir, records) if isinstance(r, dict) and r.get("step") == theirs["step"]),
                None)
    if ours is None:
        return
    keys = [k for k in RECORD_KEYS if k in theirs]
    damaged = [f"{k} {'missing' if k not in ours else repr(ours[k])[:60]}" for k in keys if not _is_number(ours.get(k))]
    if damaged and all(_is_number(theirs[k]) for k in keys):
        raise RunDirError(f"--resume: {run_dir.metrics_path} is damaged: its record of step {theirs['step']} has "
                          f"{', '.join(damaged)} (not a number); restore the file, or delete that line to resume "
                          "with a gap in the run's metrics")
    differ = [f"{k} {theirs[k]!r} (metrics.jsonl: {ours.get(k)!r})" for k in keys
              if not _same_value(ours.get(k), theirs[k])]
    if differ:
        raise RunDirError(f"--resume: the checkpoint of step {theirs['step']} does not continue the history in "
                          f"{run_dir.metrics_path}: it recorded {', '.join(differ)}; either that record of "
                          "metrics.jsonl was edited (restore the file), or the checkpoint was trained by another run, "
                          "a copy of this one extended or re-warmed otherwise (put this run's checkpoints back, or "
                          "start a new --run-dir)")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same_value(a, b) -> bool:
    """Equal as the run logged them: the same number bit for bit, or both NaN (a diverged step's own loss)."""
    if _is_number(a) and _is_number(b) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def record_digest(record: dict) -> int:
    """The first 8 bytes of SHA-256 over a metrics record as ``metrics.jsonl`` stores it (``json.dumps``; a
    float keeps its exact value), as a signed 64-bit integer (a checkpoint holds them in a tensor)."""
    return int.from_bytes(hashlib.sha256(json.dumps(record).encode()).digest()[:8], "big", signed=True)


def history_digests(records, last_step: int) -> list[tuple[int, int]]:
    """``[(step, record_digest)]`` of the records up to ``last_step``: the run's history a checkpoint of that
    step carries (``state["history"]``, an ``(n, 2)`` int64 tensor), so a resume can tell an edited, added or
    swapped record from the ones the run logged."""
    return [(r["step"], record_digest(r)) for r in records
            if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= last_step]


def carried_history(state: dict | None) -> list[tuple[int, int]] | None:
    """The history a checkpoint carries (:func:`history_digests`), or None for one written before it carried it.
    A resumed run continues it -- the records a gap lacks included, so a record deleted and later put back is
    still the run's own."""
    theirs = (state or {}).get("history")
    if not isinstance(theirs, torch.Tensor) or theirs.dim() != 2 or theirs.shape[1] != 2:
        return None
    return [(int(s), int(d)) for s, d in theirs.tolist()]


def check_history(run_dir: RunDir, state: dict, records: list | None = None) -> None:
    """Refuse to resume when a record of ``metrics.jsonl`` up to the checkpoint's step is not the one the run
    logged: edited by hand (a loss changed), added into a gap, or taken from another run.  A record deleted or
    cut away is a gap (warned about by :func:`warn_metrics_gap`), not refused.  Checkpoints written before they
    carried the history pass."""
    theirs = carried_history(state)
    if theirs is None:
        return
    logged = dict(theirs)
    step = state.get("step")
    ours = history_digests(_records(run_dir, records), step if isinstance(step, int) else -1)
    edited = [s for s, d in ours if s in logged and logged[s] != d]
    added = [s for s, _ in ours if s not in logged]
    if not edited and not added:
        return
    what = "; ".join(part for part in (
        f"the record{'s' if len(edited) > 1 else ''} of step{'s' if len(edited) > 1 else ''} "
        f"{_steps_text(edited)} differ{'' if len(edited) > 1 else 's'} from the one{'s' if len(edited) > 1 else ''} "
        "the run logged" if edited else "",
        f"step{'s' if len(added) > 1 else ''} {_steps_text(added)} {'were' if len(added) > 1 else 'was'} not "
        "logged by the run" if added else "") if part)
    raise RunDirError(f"--resume: {run_dir.metrics_path} is not this run's history up to the checkpoint of step "
                      f"{step}: {what} (the checkpoint carries a digest of every record); the file was edited or "
                      "mixed with another run's -- restore it, or delete those lines to resume with a gap in the "
                      "run's metrics -- unless the checkpoint itself comes from a copy of this run trained "
                      "otherwise (then put this run's checkpoints back)")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")


def corpus_digest(data) -> str | None:
    """16 hex digits of SHA-256 over the token rows a text corpus trains and validates on (its ``train`` and
    ``val`` pools), or None for generated data (the seed and settings fix it).  A checkpoint records it, so a run
    resumed on other text -- the file edited, or a relative ``--text`` path naming another file from another
    folder -- is refused instead of trained on."""
    pools = [getattr(data, name, None) for name in ("train", "val")]
    if not all(isinstance(p, torch.Tensor) for p in pools):
        return None
    h = hashlib.sha256()
    for p in pools:
        p = p.detach().to("cpu", torch.int64).contiguous()
        h.update(repr(tuple(p.shape)).encode())
        h.update(p.numpy().data)  # the buffer itself, no copy
    return h.hexdigest()[:16]


def check_corpus(state: dict, data, cfg: TrainConfig) -> None:
    """Refuse to resume a checkpoint trained on other text than ``data`` now reads (:func:`corpus_digest`);
    checkpoints written before they recorded it pass."""
    theirs = state.get("corpus")
    if not isinstance(theirs, str):
        return
    ours = corpus_digest(data)
    if ours != theirs:
        where = ", ".join(map(str, cfg.text_paths)) or "the default corpus"
        text_then, text_now = state.get("corpus_text"), getattr(data, "text_digest", None)
        if isinstance(text_then, str) and text_then == text_now:  # the same text, other tokens (campaign 30 T3)
            raise RunDirError(f"--resume: the text under {where} is the text the checkpoint of step "
                              f"{state.get('step')} was trained on (text digest {text_now}), but it tokenizes "
                              f"differently now (corpus digest {ours} now, {theirs} then): the tokenizer of "
                              f"--hf-model {cfg.hf_model} changed (its vocabulary, merges or normalizer); put back "
                              "the tokenizer the run started with, or start a new --run-dir")
        if text_then is None and text_now is not None:  # a checkpoint from before the text digest: either cause
            raise RunDirError(f"--resume: the text under {where}, read through the tokenizer of --hf-model "
                              f"{cfg.hf_model}, is not the text the checkpoint of step {state.get('step')} was "
                              f"trained on (corpus digest {ours} now, {theirs} then): the file was edited, a relative "
                              "--text path names another file from this folder, or the model's tokenizer changed; "
                              "resume from the folder the run started in with the same text and tokenizer, or start "
                              "a new --run-dir")
        raise RunDirError(f"--resume: the text under {where} is not the text the checkpoint of step {state.get('step')}"
                          f" was trained on (corpus digest {ours} now, {theirs} then): the file was edited, or a "
                          "relative --text path names another file from this folder; resume from the folder the "
                          "run started in with the same text, or start a new --run-dir")


def warn_metrics_gap(run_dir: RunDir, step: int, records: list | None = None) -> None:
    """Warn when ``metrics.jsonl`` lacks steps the checkpoint of ``step`` has trained (the file deleted, or cut
    short): the resumed run logs from the next step on, so its curve would have a silent hole."""
    if step == 0:
        return
    steps = metrics_gap((r.get("step") for r in _records(run_dir, records) if isinstance(r, dict)), step)
    if not steps:
        return
    path = run_dir.metrics_path
    what = (f"{path} is missing, so {steps} have no record" if not path.exists() else
            f"{path} has no record of {steps} (cut short or edited)")
    warnings.warn(f"{what}; resuming from the checkpoint of step {step} anyway: the run's metrics and loss curve "
                  "have a gap there", stacklevel=4)
