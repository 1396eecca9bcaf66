"""A SeCO / SpaCO trainer: AdamW, warm-up + cosine, accumulation, clipping,
evaluation, checkpoints that resume bit for bit, and data-parallel training.

The loop lives here; its parts are separate: :mod:`seco_lab.config` (what a run is),
:mod:`seco_lab.run_dir` (lock, checkpoints, metrics), :mod:`seco_lab.metric_log` and
:mod:`seco_lab.step` (gradient of a micro-batch, all-reduce, schedule).  The trainer draws
nothing: ``seco-lab train`` plots ``loss.png`` from the metrics after the run
(:func:`seco_lab.report.runs.plot_run`).

Gradients of one optimizer step come from ``grad_accum`` micro-batches on every
rank; ranks all-reduce the accumulated gradient once per optimizer step (a single
flat buffer), never per chunk backward.  With ``--shard fsdp`` (:mod:`seco_lab.sharding`)
parameters, optimizer state and stored gradients are sharded with FSDP2: the engine runs on the
gathered parameters, the summed gradient is reduce-scattered once per optimizer step and
checkpoints are sharded (:mod:`seco_lab.sharded_checkpoint`).  SpaCO draws its chunk subsets from
``numpy.random.default_rng([seed, step, micro, rank])``: every rank draws its own.

Resuming: every checkpoint carries the experiment's fingerprint (a hash of the TrainConfig without
its schedule length) and its step, both checked on load (``torch.load(weights_only=True)``: a checkpoint
holds tensors and plain values only).  Extending a run (``--resume`` with a larger ``--steps``) keeps the
schedule it had -- past its end the lr stays at ``min_lr_ratio * lr`` -- unless ``--rewarm`` asks for a new
warm-up + cosine cycle over the added steps (:func:`seco_lab.step.schedule_factor`).  SIGINT and SIGTERM
finish the step, checkpoint and raise :class:`TrainingInterrupted`; ``keep_checkpoints`` keeps the newest N.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from . import sharded_checkpoint
from .config import DTYPES, HF_ARCHITECTURES, MODES, RunControl, TrainConfig, parse_device
from .data import Batch, KeyValueTask, TextCorpus
from .engine import forward_loss
from .grads import accumulate_grads
from .metric_log import MetricLogger
from .model import TinyTransformer
from .run_dir import RunDir, RunDirError, check_usable, read_config, read_metrics
from .sharding import ShardedModel, ShardingError, clip_grad_norm
from .step import allreduce_mean, chunk_grads, schedule_factor

__all__ = ["DTYPES", "MODES", "NonFiniteLoss", "RunControl", "TrainConfig", "Trainer", "TrainingInterrupted",
           "experiment_fingerprint", "init_distributed_from_env", "read_metrics"]

#: fields that may change when a run is resumed: its length, and the schedule cycles an extension adds
SCHEDULE_FIELDS = ("steps", "lr_cycles")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class NonFiniteLoss(RuntimeError):
    """The loss (or gradient norm) of a step is NaN or infinite; the step was not applied."""


class TrainingInterrupted(RuntimeError):
    """Stopped by SIGINT or SIGTERM after checkpointing; ``step`` is the step saved, ``signum`` the signal."""

    def __init__(self, step: int, signum: int = signal.SIGINT):
        super().__init__(f"interrupted ({signal.Signals(signum).name}) at step {step}")
        self.step = step
        self.signum = int(signum)


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
    if isinstance(state, dict):
        state = (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                 state["cached_gaussian"])
    np.random.set_state(state)  # checkpoints written before this format hold the tuple itself


def experiment_record(cfg: TrainConfig, model) -> dict:
    """What ``config.json`` stores: the experiment; for HF runs the HF model's config, not the tiny one."""
    d = cfg.to_dict()
    if cfg.hf_model is not None:
        inner = getattr(model, "model", None)
        hf_config = getattr(inner, "config", None)
        d["model"] = {"hf_model": cfg.hf_model,
                      "config": hf_config.to_diff_dict() if hasattr(hf_config, "to_diff_dict") else None}
    return d


def experiment_from_record(d: dict, source: str) -> TrainConfig:
    # run directories written before RunControl existed stored its fields in config.json too
    d = {k: v for k, v in d.items() if k not in RunControl.__dataclass_fields__}
    if d.get("hf_model") is not None:
        d.pop("model", None)
    return TrainConfig.from_dict(d, source=source)


def config_differences(saved: TrainConfig, new: TrainConfig) -> list[str]:
    """Fields that define the experiment and differ (``steps`` may grow: that extends the run)."""
    a, b = saved.to_dict(), new.to_dict()
    out = [f"{k} ({a[k]!r} -> {b[k]!r})" for k in a if k not in SCHEDULE_FIELDS and a[k] != b[k]]
    return out


class Trainer:
    """Train a chunk model with dense backprop, SeCO or SpaCO.

    ``Trainer(cfg, RunControl(run_dir=...)).fit()`` returns the last step's metrics; the
    run directory holds ``config.json``, ``metrics.jsonl``, ``checkpoints/`` and ``loss.png``.
    """

    def __init__(self, cfg: TrainConfig, run: RunControl | None = None, model=None, data=None):
        self.cfg, self.run = cfg.validate(), (run or RunControl()).validate()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if cfg.batch_size % (self.world * cfg.grad_accum):
            raise ValueError(f"batch_size={cfg.batch_size} must be divisible by world_size x grad_accum = "
                             f"{self.world} x {cfg.grad_accum}")
        if self.run.stop_at is not None and self.run.stop_at > cfg.steps:
            raise ValueError(f"stop_at={self.run.stop_at} must lie in [1, steps={cfg.steps}]")
        self.device = parse_device(self.run.device)
        self.dtype = DTYPES[cfg.dtype]
        self.data = data or build_data(cfg)
        self.model = model or build_model(cfg, self.data.vocab_size, self.device)
        self.sharded = None
        if self.run.shard == "fsdp":
            check_gather_policy(self.run.fsdp_gather, cfg)
            self.sharded = ShardedModel(self.model, self.run.fsdp_gather)  # before the optimizer sees parameters
        self.engine_model = self.model if self.sharded is None else self.sharded.view  # what the engine runs
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.lr_factor)
        self.scheme = cfg.build_scheme() if cfg.mode == "spaco" else None
        self.run_dir = RunDir(self.run.run_dir)
        self.step = 0
        self.allreduce_calls = 0  # gradient collectives issued (all-reduces; reduce-scatters under --shard fsdp)
        self.logger: MetricLogger | None = None
        self._stop_requested = False
        self._stop_signal = signal.SIGINT

    def lr_factor(self, step: int) -> float:
        """The schedule at ``step`` (read from ``self.cfg``, whose cycles an extended resume sets)."""
        c = self.cfg
        return schedule_factor(step, c.warmup, c.steps, c.min_lr_ratio, c.lr_cycles)

    @classmethod
    def resume(cls, run_dir, **run) -> Trainer:
        """Continue the run in ``run_dir`` with its saved experiment (``run``: other RunControl fields)."""
        cfg = experiment_from_record(read_config(run_dir), str(run_dir))
        return cls(cfg, RunControl(run_dir=str(run_dir), resume=True, **run))

    def describe(self) -> dict:
        """Model kind, parameter counts, tokens per step, chunks k and budget t."""
        c = self.cfg
        kind = f"HF {c.hf_model}" + (" + LoRA" if c.lora else "") if c.hf_model else "tiny transformer"
        return {"model": kind, "parameters": sum(p.numel() for p in self.model.parameters()),
                "trainable": sum(p.numel() for p in self.params), "tokens_per_step": c.batch_size * c.seq_len,
                "num_chunks": c.num_chunks, "budget": c.budget if c.mode == "spaco" else c.num_chunks}

    # ------------------------------------------------------------------ run directory
    def prepare(self) -> None:
        """Lock and create (or reload) the run directory; idempotent.  Errors come before any training."""
        if self.logger is not None:
            return
        check_usable(self.run_dir.path, self.run.resume, self.run.overwrite)  # every rank, before anyone creates
        self._barrier()
        err = None
        if self.rank == 0:
            try:
                self.run_dir.open(self.run.resume, self.run.overwrite)
            except RunDirError as e:
                err = str(e)
        if self.world > 1:
            box = [err]
            dist.broadcast_object_list(box, src=0)
            err = box[0]
        if err:
            raise RunDirError(err)
        try:
            if self.run.resume:
                self._resume()
            elif self.rank == 0:
                self.run_dir.write_config(experiment_record(self.cfg, self.model))
        except BaseException:
            self.run_dir.close()  # a refused resume releases the directory
            raise
        self._barrier()
        self.logger = MetricLogger(self.run_dir, self.run.tensorboard and self.rank == 0)

    def _resume(self) -> None:
        source = str(self.run_dir.config_path)
        saved = experiment_from_record(self.run_dir.read_config(), source)
        diff = config_differences(saved, self.cfg)
        if diff:
            raise RunDirError(f"--resume: the config differs from the run in {self.run_dir.path} in: "
                              + ", ".join(diff) + "; resume with the saved settings or start a new --run-dir")
        state = self._load_newest_checkpoint()
        if state is None:
            self._check_nothing_to_resume()
        else:
            if state["step"] > self.cfg.steps:
                raise RunDirError(f"--steps {self.cfg.steps} is below the run's step {state['step']}; a run can "
                                  "only be extended")
            if "model" in state:  # a replicated .pt checkpoint; a sharded one is already loaded
                load_into(self.model, state["model"], self.run_dir.checkpoints)
                try:
                    self.opt.load_state_dict(state["optimizer"])
                except (ValueError, KeyError, RuntimeError) as e:
                    raise RunDirError(f"--resume: the optimizer state in {self.run_dir.checkpoints} does not fit "
                                      f"this model ({str(e).splitlines()[0]})") from None
            self.sched.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["torch_rng"])
            set_numpy_rng_state(state["numpy_rng"])
            self.step = int(state["step"])
        self._continue_schedule(saved)
        if self.rank == 0:
            # metrics logged after the checkpoint belong to the part of the run redone now
            self.run_dir.truncate_metrics(self.step if state is not None else -1)
            if (saved.steps, saved.lr_cycles) != (self.cfg.steps, self.cfg.lr_cycles):
                self.run_dir.write_config(experiment_record(self.cfg, self.model))

    def _continue_schedule(self, saved: TrainConfig) -> None:
        """A resumed run keeps its schedule whatever ``--steps`` now says: the cycles it had (by default one
        over the saved ``steps``), plus, with ``--rewarm``, a new cycle from this step to the new ``steps``."""
        c = self.cfg
        cycles = [list(x) for x in (saved.lr_cycles or [[0, saved.steps]])]
        if self.run.rewarm:
            if c.steps <= saved.steps or self.step >= c.steps:
                raise RunDirError(f"--rewarm starts a new schedule cycle over added steps; pass --steps above the "
                                  f"run's {saved.steps}")
            cycles = [x for x in cycles if x[0] < self.step] + [[self.step, c.steps]]
        c.lr_cycles = cycles if cycles != [[0, c.steps]] else []
        self.sched.base_lrs = [c.lr for _ in self.opt.param_groups]
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * self.lr_factor(self.step)  # the loaded lr was computed by the old schedule
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]

    def _check_nothing_to_resume(self) -> None:
        """No checkpoint at all: resuming from step 0 is right only if the run never logged a training step."""
        steps = [r.get("step", 0) for r in read_metrics(self.run_dir.path)]
        done = max([s for s in steps if isinstance(s, int)], default=0)
        if done > 0:
            raise RunDirError(f"--resume: {self.run_dir.metrics_path} records step {done} but "
                              f"{self.run_dir.checkpoints} holds no checkpoint to continue from (deleted, or the run "
                              "stopped before its first checkpoint); restore them, or start again with --overwrite")

    def _check_state(self, state: dict, name: str) -> None:
        """Refuse a checkpoint of another experiment, or one whose step is not the step its name says."""
        expected = int(name.split("_")[1].split(".")[0])
        if int(state.get("step", -1)) != expected:
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
        if found != self.fingerprint:
            diff = []
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                diff = config_differences(experiment_from_record(dict(config), name), self.cfg)
            raise RunDirError(f"--resume: checkpoint {name} belongs to another experiment (fingerprint {found}, this "
                              f"run's {self.fingerprint}" + (f"; differs in {', '.join(diff)}" if diff else "")
                              + "); put this run's checkpoints back or start a new --run-dir")

    @property
    def fingerprint(self) -> str:
        return experiment_fingerprint(self.cfg.to_dict())

    def _load_newest_checkpoint(self) -> dict | None:
        """The newest checkpoint's state: a sharded directory is read into the model and optimizer
        here (resharded to this run's ranks) and its extras returned; a ``.pt`` file is returned whole."""
        self.run_dir.check_latest()
        sharded = sharded_checkpoint.newest(self.run_dir.checkpoints)
        files = sorted(self.run_dir.checkpoints.glob("step_*.pt"))
        if sharded and (not files or sharded[0].name.split(".")[0] >= files[-1].name.split(".")[0]):
            return sharded_checkpoint.load(sharded[0], self.model, self.opt, check=self._check_state)
        # load_state_dict moves the tensors to the model's device
        state = self.run_dir.load_checkpoint(map_location="cpu", check=self._check_state)
        if state is not None and self.sharded is not None:  # a replicated run continued sharded
            sharded_checkpoint.load_replicated(state, self.model, self.opt)
            state = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        return state

    def save_checkpoint(self) -> None:
        extra = {"step": self.step, "scheduler": self.sched.state_dict(), "torch_rng": torch.get_rng_state(),
                 "numpy_rng": numpy_rng_state(), "config": self.cfg.to_dict(), "fingerprint": self.fingerprint}
        if self.sharded is not None:  # collective: every rank writes its shards
            path = sharded_checkpoint.save(self.run_dir.checkpoints, self.step, self.model, self.opt,
                                           {**extra, "world_size": self.world})
            if self.rank == 0:
                self.run_dir.point_latest(path.name)
        elif self.rank == 0:
            self.run_dir.save_checkpoint({**extra, "model": self.model.state_dict(),
                                          "optimizer": self.opt.state_dict()})
        if self.rank == 0 and self.run.keep_checkpoints is not None:
            self.run_dir.prune_checkpoints(self.run.keep_checkpoints)

    def save_adapter(self):
        """peft's own adapter format, under run_dir/adapter (LoRA runs only), naming its base model.
        Sharded: every rank calls it (the full weights are gathered to rank 0, which writes them)."""
        inner = getattr(self.model, "model", None)
        if not self.cfg.lora or inner is None or not hasattr(inner, "save_pretrained"):
            return None
        state = None
        if self.sharded is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            state = {k.removeprefix("model."): v for k, v in full.items()}
        if self.rank != 0:
            return None
        for peft_cfg in getattr(inner, "peft_config", {}).values():
            peft_cfg.base_model_name_or_path = peft_cfg.base_model_name_or_path or self.cfg.hf_model
        out = self.run_dir.path / "adapter"
        # peft's "auto" asks the Hub whether the base model's vocabulary changed; it never does here, so say
        # whether embeddings are adapted and stay offline
        from peft.utils.other import EMBEDDING_LAYER_NAMES

        embeddings = any(t in EMBEDDING_LAYER_NAMES for t in self.cfg.lora_targets)
        inner.save_pretrained(str(out), save_embedding_layers=embeddings,
                              **({} if state is None else {"state_dict": state}))
        return out

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    # ------------------------------------------------------------------ one step
    def micro_batches(self, full: Batch) -> list[Batch]:
        """This rank's ``grad_accum`` slices of the global batch (the same global batch on every rank)."""
        c = self.cfg
        per_rank = c.batch_size // self.world
        per_micro = per_rank // c.grad_accum
        starts = [self.rank * per_rank + m * per_micro for m in range(c.grad_accum)]
        return [full.slice(slice(s, s + per_micro)) for s in starts]

    def train_step(self, batch: Batch) -> dict:
        """One optimizer step on the global ``batch``; raises :class:`NonFiniteLoss` before applying a bad one."""
        c = self.cfg
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        loss_sum, chunks = 0.0, 0
        with self.sharded.step() if self.sharded is not None else contextlib.nullcontext():
            for micro, mb in enumerate(self.micro_batches(batch)):
                mb = Batch(mb.tokens.to(self.device), mb.targets.to(self.device), mb.far)
                rng = np.random.default_rng([c.seed, self.step, micro, self.rank])
                try:
                    loss, grads, stats = chunk_grads(self.engine_model, mb, c, rng, self.scheme)
                except FloatingPointError as err:
                    # the engine refuses a NaN/inf forward; keep every rank in step (the all-reduce below
                    # still runs) and let the finiteness check name the step.  Under --fsdp-gather chunk the
                    # other ranks are still gathering per chunk: this rank cannot rejoin them, so it stops here
                    if self.sharded is not None and self.sharded.gather == "chunk":
                        raise NonFiniteLoss(f"a non-finite loss at step {self.step + 1} on rank {self.rank}; with "
                                            "--fsdp-gather chunk the ranks cannot stay in step, so the run stops "
                                            "(the last checkpoint stays); lower --lr or train in float32/float64"
                                            ) from err
                    loss, stats = float("nan"), {"chunks": 0}
                    grads = {n: torch.zeros_like(p) for n, p in self.engine_model.named_parameters()
                             if p.requires_grad}
                loss_sum += float(loss)
                chunks += stats["chunks"]
                if self.sharded is None:
                    accumulate_grads(self.model, grads)
                else:
                    self.sharded.accumulate(grads)
            totals = {"loss": loss_sum, "chunks": chunks, "stop": float(self._stop_requested)}
            if self.sharded is None:
                stats, calls = allreduce_mean(self.params, totals, c.grad_accum, self.world)
            else:  # one reduce-scatter per FSDP group into the sharded .grad, and the statistics' all-reduce
                stats, calls = self.sharded.reduce_mean(totals, c.grad_accum, self.world)
        self.allreduce_calls += calls
        self._stop_requested = stats["stop"] > 0  # one rank interrupted: every rank stops after this step
        max_norm = c.clip if c.clip is not None else float("inf")
        if self.sharded is None:
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        else:
            gnorm = clip_grad_norm(self.params, c.clip)
        if not (math.isfinite(stats["loss"]) and math.isfinite(gnorm)):
            what = "loss" if not math.isfinite(stats["loss"]) else "gradient norm"
            value = stats["loss"] if what == "loss" else gnorm
            raise NonFiniteLoss(f"{what} is {value} at step {self.step + 1}; stopped without applying it (the "
                                f"last checkpoint stays); lower --lr, or train in --dtype float32/float64")
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        elapsed = time.perf_counter() - t0
        self.step += 1
        return {"step": self.step, "loss": stats["loss"], "lr": lr, "grad_norm": gnorm,
                "tokens_per_s": c.batch_size * c.seq_len / elapsed, "backprop_chunks": stats["chunks"],
                "seconds": elapsed}

    def forward_loss(self, tokens, targets) -> torch.Tensor:
        return forward_loss(self.engine_model, tokens.to(self.device), targets.to(self.device), self.cfg.chunk_size)

    @torch.no_grad()
    def evaluate(self) -> dict:
        c = self.cfg
        losses, far = [], []
        for i in range(c.eval_batches):
            b = self.data.batch("val", i, max(1, c.batch_size // self.world))
            losses.append(float(self.forward_loss(b.tokens, b.targets)))
            if b.far.any():
                far.append(float(self.forward_loss(b.tokens, b.far_targets())))
        out = {"eval_loss": float(np.mean(losses))}
        if far:
            out["eval_far_loss"] = float(np.mean(far))
        return out

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train to ``stop_at`` or ``steps``.  SIGINT or SIGTERM finishes the step, checkpoints and
        raises :class:`TrainingInterrupted`; a non-finite loss raises :class:`NonFiniteLoss`."""
        c = self.cfg
        self.prepare()
        stop = self.run.stop_at or c.steps
        restore = self._catch_stop_signals()
        bar = tqdm(total=stop, initial=self.step, desc=f"{c.mode} train", unit="step",
                   disable=not self.run.progress or self.rank != 0)
        last = {}
        try:
            if self.step == 0 and (self.rank == 0 or self.sharded is not None):  # sharded: a collective forward
                self._log({"step": 0, **self.evaluate()})
            while self.step < stop:
                last = self._one_step(stop)
                bar.update()
                bar.set_postfix(loss=f"{last['loss']:.3f}")
                if self._stop_requested:
                    if self.step % c.ckpt_every and self.step != stop:
                        self.save_checkpoint()
                    raise TrainingInterrupted(self.step, self._stop_signal)
            self._barrier()
            if self.step == c.steps:
                if self.rank == 0 or self.sharded is not None:
                    self.save_adapter()
        finally:
            bar.close()
            restore()
            self.close()
        return last

    def _one_step(self, stop: int) -> dict:
        c = self.cfg
        batch = self.data.batch("train", self.step, c.batch_size)  # the global batch, built once
        rec = self.train_step(batch)
        if batch.far.any():  # an extra no-grad forward, outside the timed step
            rec["far_loss"] = float(self.forward_loss(batch.tokens, batch.far_targets()))
        if self.step % c.eval_every == 0 or self.step == c.steps:
            rec.update(self.evaluate())
        self._log(rec)
        if self.step % c.ckpt_every == 0 or self.step == stop:
            self.save_checkpoint()
        return rec

    def _log(self, rec: dict) -> None:
        if self.rank == 0:
            self.logger.log(rec)

    def close(self) -> None:
        """Release the run directory (the lock) and the metric logger."""
        if self.logger is not None:
            self.logger.close()
        self.run_dir.close()

    def _catch_stop_signals(self):
        """Turn the first SIGINT or SIGTERM (what schedulers send before killing a job) into 'stop after this
        step'; a second one of the same kind acts at once, as it would without the trainer."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

        def handler(signum, frame):
            self._stop_requested = True
            self._stop_signal = signum
            signal.signal(signum, previous[signum])

        for s in STOP_SIGNALS:
            signal.signal(s, handler)

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)

        return restore


def load_into(model, state_dict: dict, where) -> None:
    """``model.load_state_dict`` with a one-line error when the checkpoint is of another architecture."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0] if lines else ""
        raise RunDirError(f"--resume: the checkpoint in {where} is of another model architecture ({detail[:200]}); "
                          "resume with the run's own model settings or start a new --run-dir") from None


def build_data(cfg: TrainConfig):
    if cfg.data == "synthetic":
        return KeyValueTask(cfg.seq_len, vocab_size=cfg.model.vocab_size, n_pairs=cfg.n_pairs, seed=cfg.seed)
    if cfg.hf_model is not None and cfg.hf_model not in HF_ARCHITECTURES:
        # a pretrained LM or a checkpoint directory reads text through its own tokenizer (packed and split like
        # the byte corpus): bytes are not its token ids
        from .hf import checkpoint_tokenizer
        from .pretrained import is_pretrained, load_tokenizer
        from .token_corpus import TokenCorpus

        tokenizer = load_tokenizer(cfg.hf_model) if is_pretrained(cfg.hf_model) else checkpoint_tokenizer(cfg.hf_model)
        return TokenCorpus(cfg.seq_len, tokenizer, paths=cfg.text_paths or None, seed=cfg.seed)
    return TextCorpus(cfg.seq_len, paths=cfg.text_paths or None, seed=cfg.seed)


def check_gather_policy(gather: str, cfg: TrainConfig) -> None:
    """``--fsdp-gather chunk`` issues collectives per chunk forward and backward, so every rank must run
    the same number of them: refuse a sampler whose subset size differs between ranks (Bernoulli)."""
    if gather != "chunk" or cfg.mode != "spaco":
        return
    sampler = cfg.build_scheme().sampler
    if sampler.kind != "uniform":
        raise ShardingError(
            f"--fsdp-gather chunk with scheme {cfg.scheme!r}: its {sampler.kind} sampler draws a different number "
            "of chunks on each rank, so the ranks would issue different per-chunk all-gathers and deadlock; use "
            "--fsdp-gather step (one gather per step, any scheme) or a fixed-size (uniform) scheme")


def build_model(cfg: TrainConfig, vocab: int, device: torch.device):
    """The tiny transformer of ``cfg.model``, or the HF model (with LoRA) of ``cfg.hf_model``."""
    dtype = DTYPES[cfg.dtype]
    if cfg.hf_model is None:
        if cfg.model.vocab_size != vocab:
            raise ValueError(f"model vocab_size={cfg.model.vocab_size} does not match the data's vocabulary {vocab}")
        return TinyTransformer(cfg.model, seed=cfg.seed, dtype=dtype, device=device)
    from .hf import HFChunkModel, add_lora, check_hf_overrides
    from .pretrained import build_causal_lm

    overrides = dict(cfg.hf_overrides)
    if cfg.hf_model in ("llama", "qwen2"):
        overrides.setdefault("vocab_size", vocab)
        overrides.setdefault("max_position_embeddings", max(cfg.seq_len, 16))
        check_hf_overrides(cfg.hf_model, cfg.hf_overrides)
    try:
        hf = build_causal_lm(cfg.hf_model, overrides, cfg.attn_implementation, dtype, cfg.seed)
    except (TypeError, AttributeError) as e:  # a transformers config or layer refusing a value
        raise ValueError(f"--hf-override {cfg.hf_overrides}: {e}") from None
    if hf.config.vocab_size < vocab:
        raise ValueError(f"{cfg.hf_model} has vocab_size {hf.config.vocab_size} < the data's {vocab}")
    max_pos = getattr(hf.config, "max_position_embeddings", None)
    if max_pos is not None and max_pos < cfg.seq_len:
        raise ValueError(f"{cfg.hf_model} has max_position_embeddings {max_pos} < --seq-len {cfg.seq_len}")
    if cfg.lora:
        hf = add_lora(hf, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets)
    return HFChunkModel(hf).to(device)


def init_distributed_from_env() -> bool:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return True

