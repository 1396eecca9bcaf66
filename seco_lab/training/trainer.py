"""A SeCO / SpaCO trainer: AdamW, warm-up + cosine, accumulation, clipping,
evaluation, checkpoints that resume bit for bit, and data-parallel training.

The loop lives here; its parts are separate: :mod:`seco_lab.config` (what a run is),
:mod:`seco_lab.training.builders` (its data and model), :mod:`seco_lab.training.run_dir` (lock, checkpoints, metrics),
:mod:`seco_lab.training.experiment` (config record, fingerprint, the checkpoint a resume continues from),
:mod:`seco_lab.training.metric_log`, :mod:`seco_lab.training.launch` (process group, stop signals) and
:mod:`seco_lab.training.step` (gradient of a micro-batch, all-reduce, schedule).  The trainer draws
nothing: ``seco-lab train`` plots ``loss.png`` from the metrics after the run
(:func:`seco_lab.report.runs.plot_run`).

Gradients of one optimizer step come from ``grad_accum`` micro-batches on every rank; the
data-parallel strategy, chosen once, reduces them once per optimizer step, never per chunk backward.
Both strategies have one interface (``step()``, ``accumulate``, ``reduce_mean``, ``clip_grads``,
checkpoints), so the step has one code path.  :class:`~seco_lab.training.replicated.ReplicatedModel` (default):
ranks all-reduce the accumulated gradient (a single flat buffer).  With ``--shard fsdp``
(:class:`~seco_lab.training.sharding.ShardedModel`) parameters, optimizer state and stored gradients are
sharded with FSDP2: the engine runs on the gathered parameters, the summed gradient is
reduce-scattered once per optimizer step and checkpoints are sharded (:mod:`seco_lab.training.sharded_checkpoint`).
SpaCO draws its chunk subsets from ``numpy.random.default_rng([seed, step, micro, rank])``: every rank
draws its own.

Resuming: every checkpoint carries the experiment's fingerprint (a hash of the TrainConfig without
its schedule length) and its step, both checked on load (``torch.load(weights_only=True)``: a checkpoint
holds tensors and plain values only).  Extending a run (``--resume`` with a larger ``--steps``) keeps the
schedule it had -- past its end the lr stays at ``min_lr_ratio * lr`` -- unless ``--rewarm`` asks for a new
warm-up + cosine cycle over the added steps (:func:`seco_lab.training.step.schedule_factor`).  SIGINT, SIGTERM and
SIGHUP (not under nohup) finish the step, checkpoint and raise :class:`TrainingInterrupted`; ``keep_checkpoints``
keeps the newest N.
"""

from __future__ import annotations

import math
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import DTYPES, MODES, RunControl, TrainConfig, parse_device
from ..core.checks import first_non_finite
from ..core.engine import forward_loss
from ..data.sources import Batch
from .builders import build_data, build_model, check_gather_policy, load_into  # noqa: F401 (load_into: re-export)
from .experiment import (
    carried_history,
    check_corpus,
    check_history,
    check_metrics_history,
    check_model_record,
    check_nothing_to_resume,
    check_step_record,
    config_differences,
    continued_cycles,
    corpus_digest,
    experiment_fingerprint,
    experiment_from_record,
    experiment_record,
    history_digests,
    load_newest_checkpoint,
    numpy_rng_state,
    read_experiment,
    record_digest,
    set_numpy_rng_state,
    step_record,
    warn_metrics_gap,
)
from .launch import catch_stop_signals, init_distributed_from_env
from .metric_log import MetricLogger
from .replicated import ReplicatedModel
from .run_checks import ADAPTER_CONTENT, check_adapter_digests, file_sha256, not_peft_adapter
from .run_dir import RunDir, RunDirError, check_usable, read_metrics
from .sharding import ShardedModel
from .step import chunk_grads, schedule_factor

__all__ = ["DTYPES", "MODES", "NonFiniteLoss", "RunControl", "TrainConfig", "Trainer", "TrainingInterrupted",
           "experiment_fingerprint", "init_distributed_from_env", "read_metrics"]


class NonFiniteLoss(RuntimeError):
    """The loss (or gradient norm) of a step is NaN or infinite; the step was not applied."""


class TrainingInterrupted(RuntimeError):
    """Stopped by SIGINT, SIGTERM or SIGHUP after checkpointing; ``step`` is the step saved, ``signum`` the signal."""

    def __init__(self, step: int, signum: int = signal.SIGINT):
        super().__init__(f"interrupted ({signal.Signals(signum).name}) at step {step}")
        self.step = step
        self.signum = int(signum)


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
        self._corpus_digest = corpus_digest(self.data)  # checkpoints record it; a resume on other text is refused
        self.model = model or build_model(cfg, self.data.vocab_size, self.device)
        # the data-parallel strategy, chosen once (sharding comes before the optimizer sees parameters)
        if self.run.shard == "fsdp":
            check_gather_policy(self.run.fsdp_gather, cfg)
            self.parallel = ShardedModel(self.model, self.run.fsdp_gather)
        else:
            self.parallel = ReplicatedModel(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.lr_factor)
        self.scheme = cfg.build_scheme() if cfg.mode == "spaco" else None
        self.run_dir = RunDir(self.run.run_dir, accept_undigested=self.run.accept_undigested)
        self.step = 0
        self.allreduce_calls = 0  # gradient collectives issued (all-reduces; reduce-scatters under --shard fsdp)
        self.logger: MetricLogger | None = None
        self._step_record: dict | None = None  # what metrics.jsonl records of the last step trained (checkpoints)
        self._history: list[tuple[int, int]] = []  # (step, digest) of every record logged (checkpoints carry it)
        self.redone_steps: list[int] = []  # resumed: the steps logged after the checkpoint, whose records are dropped
        self._stop_requested = False
        self._stop_signal = signal.SIGINT

    @property
    def sharded(self) -> ShardedModel | None:
        """The FSDP-sharded model under ``--shard fsdp``, else None."""
        return self.parallel if isinstance(self.parallel, ShardedModel) else None

    @property
    def engine_model(self):
        """What the engine runs: the model, or under ``--shard fsdp`` its gathered view."""
        return self.parallel.view

    def lr_factor(self, step: int) -> float:
        """The schedule at ``step`` (read from ``self.cfg``, whose cycles an extended resume sets)."""
        c = self.cfg
        return schedule_factor(step, c.warmup, c.steps, c.min_lr_ratio, c.lr_cycles)

    @classmethod
    def resume(cls, run_dir, **run) -> Trainer:
        """Continue the run in ``run_dir`` with its saved experiment (``run``: other RunControl fields)."""
        cfg = experiment_from_record(read_experiment(run_dir), str(run_dir))
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
        recovered = not self.run_dir.config_path.is_file()  # deleted: the newest checkpoint's record is used
        record = read_experiment(self.run_dir.path)
        saved = experiment_from_record(record, source)
        diff = config_differences(saved, self.cfg)
        if diff:
            raise RunDirError(f"--resume: the config differs from the run in {self.run_dir.path} in: "
                              + ", ".join(diff) + "; resume with the saved settings or start a new --run-dir")
        check_model_record(record, self.model, source)
        if self.cfg.lora:  # a run saved before the adapter digests: nothing proves its adapter/ the run's
            check_adapter_digests(self.run_dir.path, "--resume")
        foreign = not_peft_adapter(self.run_dir.path) if self.cfg.lora else []
        if foreign:  # the adapter saved at the end would write over them (campaign 37 A6)
            raise RunDirError(f"--resume: {self.run_dir.path} holds {', '.join(foreign)}, which this LoRA run writes "
                              "its adapter over when it ends; move them out of its adapter/ folder first")
        state = load_newest_checkpoint(self.run_dir, self.model, self.opt, self.cfg, saved)
        if state is not None:
            check_corpus(state, self.data, self.cfg)
        records = read_metrics(self.run_dir.path)  # read once: every check below sees the same file
        if state is None:
            check_nothing_to_resume(self.run_dir, records)
        else:
            if state["step"] > self.cfg.steps:
                raise RunDirError(f"--steps {self.cfg.steps} is below the run's step {state['step']}; a run can "
                                  "only be extended")
            if state["step"] == self.cfg.steps < saved.steps:  # campaign 33 W4: --stop-at could not help here
                raise RunDirError(f"--resume --steps {self.cfg.steps}: the run in {self.run_dir.path} is at step "
                                  f"{state['step']} of its {saved.steps} already, so nothing would be trained; resume "
                                  f"without --steps to continue to step {saved.steps} (--stop-at N stops earlier), or "
                                  f"pass a --steps above {saved.steps} to extend it")
            if self.cfg.steps < saved.steps:  # after the checkpoint's checks (an edited record is named as such)
                raise RunDirError(f"--resume --steps {self.cfg.steps}: the run in {self.run_dir.path} has "
                                  f"{saved.steps} steps and its learning-rate schedule spans them; a resume keeps "
                                  "them or extends them (a larger --steps), never shortens them (campaign 32 V9: a "
                                  f"stop in disguise): to stop at step {self.cfg.steps}, pass --stop-at "
                                  f"{self.cfg.steps} instead")
            if self.run.stop_at is not None and self.run.stop_at <= state["step"]:
                raise RunDirError(f"--stop-at {self.run.stop_at} is not past the run's step {state['step']}, so "
                                  f"nothing would be trained; pass a --stop-at above {state['step']} or drop it")
            if "model" in state:  # a replicated .pt checkpoint; a sharded one is already loaded
                self.parallel.load_whole_state(state, self.opt, self.run_dir.checkpoints)
            try:
                self.sched.load_state_dict(state["scheduler"])
                torch.set_rng_state(state["torch_rng"])
                set_numpy_rng_state(state["numpy_rng"])
            except (TypeError, ValueError, KeyError, RuntimeError, AttributeError, IndexError) as e:
                raise RunDirError(f"--resume: the checkpoint of step {state['step']} in {self.run_dir.checkpoints} "
                                  "holds a scheduler or random-number-generator state that cannot be restored "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): it is "
                                  "damaged or was edited; resume from an earlier checkpoint (move it out of the "
                                  "checkpoints folder and delete checkpoints/latest) or start a new --run-dir"
                                  ) from None
            self.step = int(state["step"])
        self._continue_schedule(saved)
        check_metrics_history(self.run_dir, self.step, records)
        if state is not None:
            check_step_record(self.run_dir, state, records)
            check_history(self.run_dir, state, records)
        if self.rank == 0:
            if state is not None:  # a deleted marker is written again with the id the checkpoints agree on
                self.run_dir.restore_marker(state.get("run_id"))
            warn_metrics_gap(self.run_dir, self.step, records)
            # metrics logged after the checkpoint belong to the part of the run redone now
            last = self.step if state is not None else -1
            self.redone_steps = [r["step"] for r in records if r["step"] > last]
            self.run_dir.truncate_metrics(last, records)
            carried = carried_history(state)  # checked against metrics.jsonl above: its records, gaps included
            self._history = carried if carried is not None else history_digests(records, self.step)
            if recovered or (saved.steps, saved.lr_cycles) != (self.cfg.steps, self.cfg.lr_cycles):
                self.run_dir.write_config(experiment_record(self.cfg, self.model))

    def _continue_schedule(self, saved: TrainConfig) -> None:
        """A resumed run keeps its schedule whatever ``--steps`` now says: the cycles it had (by default one
        over the saved ``steps``), plus, with ``--rewarm``, a new cycle from this step to the new ``steps``."""
        c = self.cfg
        c.lr_cycles = continued_cycles(saved, c.steps, self.step, self.run.rewarm)
        self.sched.base_lrs = [c.lr for _ in self.opt.param_groups]
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * self.lr_factor(self.step)  # the loaded lr was computed by the old schedule
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]

    @property
    def fingerprint(self) -> str:
        return experiment_fingerprint(self.cfg.to_dict())

    def save_checkpoint(self) -> None:
        extra = {"step": self.step, "scheduler": self.sched.state_dict(), "torch_rng": torch.get_rng_state(),
                 "numpy_rng": numpy_rng_state(), "config": self.cfg.to_dict(), "fingerprint": self.fingerprint,
                 "run_id": self.run_dir.run_id, "record": self._step_record, "corpus": self._corpus_digest,
                 "corpus_text": getattr(self.data, "text_digest", None),
                 "history": torch.tensor(self._history, dtype=torch.int64).reshape(-1, 2)}
        self.parallel.save_checkpoint(self.run_dir, self.opt, extra)  # sharded: collective, every rank its shards
        if self.rank == 0 and self.run.keep_checkpoints is not None:
            self.run_dir.prune_checkpoints(self.run.keep_checkpoints)

    def save_adapter(self):
        """peft's own adapter format, under run_dir/adapter (LoRA runs only), naming its base model.
        Sharded: every rank calls it (the full weights are gathered to rank 0, which writes them)."""
        from ..models.hf import save_lora_adapter, wrapped_lm

        if not self.cfg.lora or wrapped_lm(self.model) is None:
            return None
        state = self.parallel.full_state_dict()  # sharded: collective; replicated: None (the model's own)
        if self.rank != 0:
            return None
        self.run_dir.note_written("adapter")  # before peft writes it: --overwrite may then remove it
        self.run_dir.note_adapter_files(None)  # while peft writes (null), judged by content (a save killed half-way)
        out = save_lora_adapter(self.model, self.run_dir.path / "adapter", self.cfg.hf_model, self.cfg.lora_targets,
                                state)
        self.run_dir.note_adapter_files({name: file_sha256(out / name) for name, _, _ in ADAPTER_CONTENT
                                         if (out / name).is_file() and not (out / name).is_symlink()})
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
        with self.parallel.step():
            loss_sum, chunks = self._accumulate_micro_batches(batch)
            totals = {"loss": loss_sum, "chunks": chunks, "stop": float(self._stop_requested)}
            # replicated: the gradient's all-reduce; sharded: one reduce-scatter per FSDP group into the
            # sharded .grad; both: the statistics' all-reduce
            stats, calls = self.parallel.reduce_mean(totals, c.grad_accum, self.world)
        self.allreduce_calls += calls
        # one rank interrupted: every rank stops after this step; a signal caught during the reduction is kept (loaded
        # run 5 of docs/loaded_test_runs.md: a SIGTERM landing there was overwritten with the reduced False, ignored)
        self._stop_requested = self._stop_requested or stats["stop"] > 0
        gnorm = self._clip_and_check(stats["loss"])
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        elapsed = time.perf_counter() - t0
        self.step += 1
        return {"step": self.step, "loss": stats["loss"], "lr": lr, "grad_norm": gnorm,
                "tokens_per_s": c.batch_size * c.seq_len / elapsed, "backprop_chunks": stats["chunks"],
                "seconds": elapsed}

    def _accumulate_micro_batches(self, batch: Batch) -> tuple[float, int]:
        """Sum this rank's micro-batch gradients into the strategy; return the summed loss and chunk count."""
        loss_sum, chunks = 0.0, 0
        for micro, mb in enumerate(self.micro_batches(batch)):
            loss, grads, stats = self._micro_batch_grad(micro, mb)
            loss_sum += float(loss)
            chunks += stats["chunks"]
            self.parallel.accumulate(grads)
        return loss_sum, chunks

    def _micro_batch_grad(self, micro: int, mb: Batch):
        """``(loss, grads, stats)`` of micro-batch ``micro`` (:func:`seco_lab.training.step.chunk_grads`), its SpaCO
        subset drawn from ``[seed, step, micro, rank]``.  A NaN/inf forward gives loss NaN and zero gradients."""
        c = self.cfg
        mb = Batch(mb.tokens.to(self.device), mb.targets.to(self.device), mb.far)
        rng = np.random.default_rng([c.seed, self.step, micro, self.rank])
        try:
            return chunk_grads(self.engine_model, mb, c, rng, self.scheme)
        except FloatingPointError as err:
            # the engine refuses a NaN/inf forward; keep every rank in step (the all-reduce after the
            # micro-batches still runs) and let the finiteness check name the step.  Under --fsdp-gather chunk
            # the other ranks are still gathering per chunk: this rank cannot rejoin them, so it stops here
            if self.parallel.gather == "chunk":
                raise NonFiniteLoss(f"a non-finite loss at step {self.step + 1} on rank {self.rank}; with "
                                    "--fsdp-gather chunk the ranks cannot stay in step, so the run stops "
                                    "(the last checkpoint stays); lower --lr or train in float32/float64") from err
            grads = {n: torch.zeros_like(p) for n, p in self.engine_model.named_parameters() if p.requires_grad}
            return float("nan"), grads, {"chunks": 0}

    def _clip_and_check(self, loss: float) -> float:
        """Clip the reduced gradient to ``cfg.clip`` and return its norm; raise :class:`NonFiniteLoss` (the
        step not applied) when the loss or the norm is NaN or infinite."""
        gnorm = self.parallel.clip_grads(self.cfg.clip)
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            value = loss if what == "loss" else gnorm
            raise NonFiniteLoss(f"{what} is {value} at step {self.step + 1}; stopped without applying it (the "
                                f"last checkpoint stays); {self.non_finite_advice()}")
        return gnorm

    def non_finite_advice(self) -> str:
        """What to do about a NaN/inf loss: not a lower --lr where the weights were NaN before the step."""
        bad = first_non_finite([(n, p.detach()) for n, p in self.model.named_parameters()])
        if bad is not None:  # no learning rate mends weights that are NaN before the step
            return (f"the model's weights were already non-finite before this step ({bad}): the model was given or "
                    "loaded so (start from finite weights), or an earlier step overflowed them (train in --dtype "
                    "float32/float64)")
        return "lower --lr, or train in --dtype float32/float64"

    def forward_loss(self, tokens, targets) -> torch.Tensor:
        return forward_loss(self.engine_model, tokens.to(self.device), targets.to(self.device), self.cfg.chunk_size)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """``eval_loss`` (and ``eval_far_loss`` where the data has far targets): the mean over ``eval_batches``
        validation batches of the token-mean loss of each global batch -- the batch of ``batch_size`` sequences
        the one-process run evaluates, whatever the world size.  Every rank evaluates its slice of it
        (:meth:`rank_slice`); the loss sums and target counts are all-reduced (float64) before dividing.
        Collective when ``world > 1``: every rank calls it and runs the same forwards."""
        c = self.cfg
        sums = []  # per batch: [loss sum, targets, far loss sum, far targets] of this rank's slice
        far = False
        for i in range(c.eval_batches):
            full = self.data.batch("val", i, c.batch_size)  # the global batch, the same on every rank
            far = far or bool(full.far.any())
            b = self.rank_slice(full)
            sums.append([*self._loss_sum(b.tokens, b.targets, b.targets),
                         *(self._loss_sum(b.tokens, b.far_targets(), b.targets) if full.far.any() else (0.0, 0))])
        totals = torch.tensor(sums, dtype=torch.float64)
        if self.world > 1:
            totals = totals.to(self.device)
            dist.all_reduce(totals)
            totals = totals.cpu()
        out = {"eval_loss": float((totals[:, 0] / totals[:, 1]).mean())}
        if not math.isfinite(out["eval_loss"]):
            raise NonFiniteLoss(self._eval_failure(out["eval_loss"]))
        if far:
            has = totals[:, 3] > 0
            out["eval_far_loss"] = float((totals[has, 2] / totals[has, 3]).mean())
        return out

    def rank_slice(self, full: Batch) -> Batch:
        """This rank's ``batch_size // world`` sequences of the global batch ``full``."""
        per_rank = self.cfg.batch_size // self.world
        return full.slice(slice(self.rank * per_rank, (self.rank + 1) * per_rank))

    def _loss_sum(self, tokens, targets, fallback, ignore_index: int = -100) -> tuple[float, int]:
        """``(sum of the token losses, number of targets)`` over the non-ignored ``targets``.  A slice with
        none gives ``(0.0, 0)``; under a sharded model it still runs the forward (on ``fallback``) so that
        every rank joins the same parameter gathers."""
        n = int((targets != ignore_index).sum())
        if n == 0:
            if self.parallel.collective:
                self.forward_loss(tokens, fallback)
            return 0.0, 0
        try:
            return float(self.forward_loss(tokens, targets)) * n, n
        except FloatingPointError as err:  # the engine refuses a NaN/inf forward: every rank joins the all-reduce
            if self.parallel.gather == "chunk":  # the other ranks are gathering per chunk: this one cannot rejoin
                raise NonFiniteLoss(self._eval_failure(float("nan"), f" on rank {self.rank}")) from err
            return float("nan"), n

    def _eval_failure(self, value: float, where: str = "") -> str:
        """The message of a non-finite validation loss (:class:`NonFiniteLoss`)."""
        if self.step == 0:  # before any step: the model as built or loaded, not the training, is at fault
            advice = ("the model gives NaN/inf before any training step: its weights or its config are damaged "
                      "(e.g. NaN weights, a zero or negative rope_theta or norm eps in the checkpoint's "
                      "config.json); nothing was trained -- fix the model, then rerun with --overwrite")
        else:
            advice = f"the last checkpoint stays; {self.non_finite_advice()}"
        return f"the validation loss is {value} at step {self.step}{where}; {advice}"

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train to ``stop_at`` or ``steps``.  SIGINT, SIGTERM or SIGHUP finishes the step, checkpoints and
        raises :class:`TrainingInterrupted`; a non-finite loss raises :class:`NonFiniteLoss`."""
        c = self.cfg
        self.prepare()
        stop = self.run.stop_at or c.steps
        restore = catch_stop_signals(self._request_stop)
        bar = tqdm(total=stop, initial=self.step, desc=f"{c.mode} train", unit="step",
                   disable=not self.run.progress or self.rank != 0)
        last = {}
        try:
            if self.step == 0:  # every rank: evaluation is collective (the ranks' slices are all-reduced)
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
            if self.step == c.steps and (self.rank == 0 or self.parallel.collective):  # sharded: a gather
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
        self._step_record = step_record(rec)
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
            self._history.append((rec["step"], record_digest(rec)))

    def _request_stop(self, signum: int) -> None:
        """A SIGINT, SIGTERM or SIGHUP arrived: stop after this step (every rank: the step's statistics carry it)."""
        self._stop_requested = True
        self._stop_signal = signum

    def close(self) -> None:
        """Release the run directory (the lock) and the metric logger."""
        if self.logger is not None:
            self.logger.close()
        self.run_dir.close()
