"""What defines one run of the training study: its :class:`Arm` (the gradient method, with the equal-compute
overrides of sequences per step and steps), its :class:`RunSpec` (arm x optimizer x learning rate x seed) and
the study's shared :class:`TrainSettings` (task, model, schedule, held-out sets, probes)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from seco_lab import get_scheme
from seco_lab.stats.equal_compute import chunk_passes
from seco_lab.training.step import scheduled_lr

from .task import RecallTask

__all__ = ["MODES", "NEW_SETTINGS", "OPTIMIZERS", "Arm", "RunSpec", "TrainSettings"]

OPTIMIZERS = ("adamw", "sgd")
MODES = ("dense", "seco", "truncated", "spaco")
# fields added after the first study: left out of the definition at their default (fingerprints stay)
NEW_SETTINGS = {"variance_groups": 0, "variance_draws": 0}


@dataclass(frozen=True)
class Arm:
    """A gradient method: ``mode`` 'dense', 'seco', 'truncated' or 'spaco' (then ``scheme`` and ``budget``);
    ``batch_size`` / ``steps`` override the study's sequences per step / optimizer steps (equal compute)."""

    mode: str
    scheme: str | None = None
    budget: int | None = None
    batch_size: int | None = None
    steps: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; use one of {MODES}")
        for name in ("batch_size", "steps"):
            v = getattr(self, name)
            if v is not None and (int(v) != v or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if (self.mode == "spaco") != (self.scheme is not None and self.budget is not None):
            raise ValueError("a spaco arm needs scheme and budget; dense and seco take neither")
        if self.scheme is not None:
            get_scheme(self.scheme)  # a clear error for an unknown name

    @property
    def base(self) -> str:
        """The method without its batch / steps override: 'seco', 'paper t=4', ..."""
        return self.mode if self.mode != "spaco" else f"{self.scheme} t={self.budget}"

    @property
    def name(self) -> str:
        return self.base + (f" B={self.batch_size}" if self.batch_size else "") + \
            (f" steps={self.steps}" if self.steps else "")

    def definition(self) -> dict:
        """The fields that define the arm (overrides only when set: older studies keep their fingerprint)."""
        d = asdict(self)
        return {k: v for k, v in d.items() if k in ("mode", "scheme", "budget") or v is not None}

    def passes(self, num_chunks: int) -> float:
        """Cost model: chunk passes per sequence (seco_lab.stats.equal_compute.chunk_passes)."""
        return chunk_passes(self.mode, num_chunks, self.budget)

    def backprop_chunks(self, num_chunks: int) -> tuple[float, float]:
        """(least, most) chunks a step backpropagates per sequence, on average over its micro-batches: all k for
        dense, SeCO and truncated; t for a SpaCO scheme whose sampler draws t chunks; 0 to k for a Bernoulli draw."""
        if self.mode != "spaco":
            return float(num_chunks), float(num_chunks)
        if get_scheme(self.scheme).sampler.kind == "uniform":
            return float(self.budget), float(self.budget)
        return 0.0, float(num_chunks)

    @classmethod
    def from_record(cls, record: dict) -> Arm:
        """The arm a ``study.json`` design lists (``{"name", **definition()}``); its name must be the arm's."""
        fields = {k: record.get(k) for k in ("mode", "scheme", "budget", "batch_size", "steps")}
        arm = cls(**fields)
        if record.get("name") != arm.name or {"name", *arm.definition()} != set(record):
            raise ValueError(f"the arm {record.get('name')!r} is recorded as {fields}, which is the arm {arm.name!r}")
        return arm


@dataclass(frozen=True)
class RunSpec:
    arm: Arm
    optimizer: str
    lr: float
    seed: int

    @property
    def run_id(self) -> str:
        return f"{self.arm.name.replace(' ', '_').replace('=', '')}__{self.optimizer}__lr{self.lr:g}__s{self.seed}"

    def record(self, settings: TrainSettings) -> dict:
        """What the run's row of ``runs.csv`` holds that the run's identity fixes (``train_run``'s summary and
        ``collect``'s columns): arm, optimizer, lr, seed, mode, scheme ('' for none), budget (0 for none), steps,
        sequences per step and chunk passes per step (the cost model)."""
        k = settings.task.num_chunks
        batch = self.arm.batch_size or settings.batch_size
        return {"arm": self.arm.name, "optimizer": self.optimizer, "lr": self.lr, "seed": self.seed,
                "mode": self.arm.mode, "scheme": self.arm.scheme or "", "budget": self.arm.budget or 0,
                "steps": self.arm.steps or settings.steps, "batch_size": batch,
                "passes_per_step": batch * self.arm.passes(k)}


@dataclass
class TrainSettings:
    """Everything shared by the runs of one study (recorded in study.json)."""

    task: RecallTask = field(default_factory=RecallTask)
    model: dict = field(default_factory=lambda: dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128))
    steps: int = 250
    batch_size: int = 16
    micro_batch: int = 8  # SpaCO draws one chunk set per micro-batch
    warmup: int = 25
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    clip: float = 1.0  # global gradient-norm clipping (0: off), as common fine-tuning recipes do
    momentum: float = 0.9
    eval_every: int = 25
    probe_every: int = 25
    val_sequences: int = 128
    test_sequences: int = 256
    probe_sequences: int = 16
    variance_groups: int = 0  # > 0: the probe estimates the equal-compute MSE's noise terms (groups of sequences)
    variance_draws: int = 0  # draws of the arm's sampler per probe for the sampling noise

    def __post_init__(self):
        if self.batch_size % self.micro_batch:
            raise ValueError(f"micro_batch={self.micro_batch} must divide batch_size={self.batch_size}")
        for name in ("steps", "eval_every", "probe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.variance_groups:
            g = self.variance_groups
            if g < 2 or self.probe_sequences % g:
                raise ValueError(f"variance_groups={g} must be >= 2 and divide probe_sequences={self.probe_sequences}")
            if self.variance_draws < 2:
                raise ValueError(f"variance_draws must be >= 2 with variance_groups, got {self.variance_draws}")

    @classmethod
    def from_dict(cls, d: dict) -> TrainSettings:
        """The settings ``to_dict`` recorded (in ``study.json``); a record that does not round-trip is refused."""
        task = dict(d["task"])
        settings = cls(**{**d, "task": RecallTask(**{**task, "distances": tuple(task["distances"])})})
        if json.dumps(settings.to_dict(), sort_keys=True) != json.dumps(d, sort_keys=True):
            raise ValueError("the settings do not read back as recorded (a field of the wrong type)")
        return settings

    def to_dict(self) -> dict:
        d = {**asdict(self), "task": self.task.to_dict()}
        for k, default in NEW_SETTINGS.items():
            if d[k] == default:
                del d[k]
        return d

    def lr_at(self, step: int, lr: float, steps: int | None = None) -> float:
        """The trainer's schedule (:func:`seco_lab.training.step.scheduled_lr`: linear warm-up over ``warmup`` steps,
        then cosine decay to ``lr * min_lr_ratio``); a run of
        ``steps`` != self.steps keeps the shape (warm-up scaled by steps / self.steps)."""
        steps = self.steps if steps is None else steps
        warmup = self.warmup if steps == self.steps else max(1, round(self.warmup * steps / self.steps))
        return scheduled_lr(step, lr, warmup, steps, self.min_lr_ratio)
