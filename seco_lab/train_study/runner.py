"""One training run of the study: an arm (dense, SeCO or a SpaCO scheme at a budget), an optimizer,
a learning rate and a seed, on :class:`RecallTask`, built only on the library's low-level API.

Matched compute: every arm takes the same optimizer steps on the same token stream (batch
``step`` of the train split of seed ``seed``) from the same initial weights (model seed
``seed``).  SpaCO draws one chunk set per micro-batch from a generator seeded by
(seed, step, micro-batch), so arms that share a sampler and budget also share their draws.

The run returns tidy rows (one per step x metric): training loss, held-out loss and far-token
loss (by distance), backpropagated chunks and wall time so far, and -- every ``probe_every``
steps, at the run's current parameters -- the exact first-order quality of the arm's expected
gradient on a fixed probe batch (docs/estimators.md §4):  E g_hat = sum_p w(p) g(p) from the hop
strata, compared with g by ``seco_lab.strata_stats.bias_metrics``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from seco_lab import (
    TinyConfig,
    TinyTransformer,
    accumulate_grads,
    dense_grad,
    forward_loss,
    get_scheme,
    hop_strata,
    seco_grad,
    spaco_grad,
)
from seco_lab.strata_stats import StrataGram, bias_metrics

from .task import RecallBatch, RecallTask

__all__ = ["Arm", "RunSpec", "TrainSettings", "evaluate", "gradient", "probe", "train_run"]

OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class Arm:
    """A gradient method: ``mode`` 'dense', 'seco' or 'spaco' (then ``scheme`` and ``budget``)."""

    mode: str
    scheme: str | None = None
    budget: int | None = None

    def __post_init__(self):
        if self.mode not in ("dense", "seco", "spaco"):
            raise ValueError(f"unknown mode {self.mode!r}; use 'dense', 'seco' or 'spaco'")
        if (self.mode == "spaco") != (self.scheme is not None and self.budget is not None):
            raise ValueError("a spaco arm needs scheme and budget; dense and seco take neither")
        if self.scheme is not None:
            get_scheme(self.scheme)  # a clear error for an unknown name

    @property
    def name(self) -> str:
        return self.mode if self.mode != "spaco" else f"{self.scheme} t={self.budget}"


@dataclass(frozen=True)
class RunSpec:
    arm: Arm
    optimizer: str
    lr: float
    seed: int

    @property
    def run_id(self) -> str:
        return f"{self.arm.name.replace(' ', '_').replace('=', '')}__{self.optimizer}__lr{self.lr:g}__s{self.seed}"


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

    def __post_init__(self):
        if self.batch_size % self.micro_batch:
            raise ValueError(f"micro_batch={self.micro_batch} must divide batch_size={self.batch_size}")
        for name in ("steps", "eval_every", "probe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return {**asdict(self), "task": self.task.to_dict()}

    def lr_at(self, step: int, lr: float) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``lr * min_lr_ratio``."""
        if step < self.warmup:
            return lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(self.steps - self.warmup, 1)
        return lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(name: str, params, lr: float, settings: TrainSettings) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=settings.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")


def gradient(model, arm: Arm, batch: RecallBatch, chunk_size: int, micro_batch: int, seed: int, step: int):
    """(training loss, gradient dict, backpropagated chunks) of one optimizer step for ``arm``."""
    if arm.mode == "dense":
        loss, grads = dense_grad(model, batch.tokens, batch.targets)
        return float(loss), grads, batch.tokens.shape[1] / chunk_size
    if arm.mode == "seco":
        loss, grads = seco_grad(model, batch.tokens, batch.targets, chunk_size)
        return float(loss), grads, batch.tokens.shape[1] / chunk_size
    total, losses, chunks, parts = None, [], 0, batch.tokens.shape[0] // micro_batch
    scheme = get_scheme(arm.scheme)
    k = batch.tokens.shape[1] // chunk_size
    for m in range(parts):
        mb = batch.rows(slice(m * micro_batch, (m + 1) * micro_batch))
        subset = scheme.sampler.draw(k, arm.budget, np.random.default_rng([seed, step, m, 7]))
        chunks += len(subset)
        if not subset:  # an empty Bernoulli draw: the estimate is zero, the loss still counts
            losses.append(float(forward_loss(model, mb.tokens, mb.targets, chunk_size)))
            continue
        loss, g = spaco_grad(model, mb.tokens, mb.targets, chunk_size, scheme, arm.budget, subset=subset)
        losses.append(float(loss))
        total = g if total is None else {n: total[n] + g[n] for n in total}
    if total is None:
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    # the micro-batch estimates are means over their own tokens; average them (equal sizes)
    return float(np.mean(losses)), {n: g / parts for n, g in total.items()}, chunks / parts


@torch.no_grad()
def evaluate(model, batch: RecallBatch, distances) -> dict[tuple[str, int], float]:
    """Mean token loss and far-token loss (all distances: key 0, and per distance d)."""
    logits = model(batch.tokens)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="none")
    nll, dist = nll.view_as(batch.targets), batch.distance
    out = {("loss", 0): float(nll.mean()), ("far_loss", 0): float(nll[dist > 0].mean())}
    for d in distances:
        sel = dist == d
        out[("far_loss", int(d))] = float(nll[sel].mean()) if sel.any() else float("nan")
    return out


def probe(model, arm: Arm, batch: RecallBatch, chunk_size: int) -> dict[str, float]:
    """Exact first-order quality of the arm's expected gradient at the current parameters."""
    n_layers = len(model.blocks) if hasattr(model, "blocks") else None
    strata = hop_strata(model, batch.tokens, batch.targets, chunk_size, max_hops=n_layers)
    gram = StrataGram.of(strata)
    norms = gram.norms()
    g_norm = math.sqrt(max(float(gram.total.sum()), 0.0))
    out = {"grad_norm": g_norm, "hop_share": float(np.sqrt(max(gram.total[1:, 1:].sum(), 0.0))) / g_norm,
           "stratum1_norm": float(norms[1]) if len(norms) > 1 else 0.0}
    if arm.mode == "spaco":
        k = batch.tokens.shape[1] // chunk_size
        w = get_scheme(arm.scheme).expected_weights(k, arm.budget, gram.max_hops)
        m = bias_metrics(gram, w)
        out.update(cos=1.0 - m["direction_bias"], rel_bias=m["rel_bias"],
                   best_scale_residual=m["best_scale_residual"], per_tensor_residual=m["per_tensor_residual"],
                   scale=m["scale"])
    else:  # exact methods: E g_hat = g
        out.update(cos=1.0, rel_bias=0.0, best_scale_residual=0.0, per_tensor_residual=0.0, scale=1.0)
    return out


def fixed_batch(task: RecallTask, seed: int, split: str, size: int) -> RecallBatch:
    """One deterministic held-out batch; index 0 of ``split`` for the seed-independent data seed."""
    return task.batch(seed, split, 0, size)


def train_run(spec: RunSpec, settings: TrainSettings, data_seed: int = 1234) -> tuple[list[dict], dict]:
    """Train one run; returns (tidy rows, summary).  Held-out sets do not depend on the run's seed."""
    torch.manual_seed(spec.seed)
    task, c = settings.task, settings.task.chunk_size
    cfg = TinyConfig(vocab_size=task.vocab_size, **settings.model)
    model = TinyTransformer(cfg, seed=spec.seed)
    init = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer(spec.optimizer, model.parameters(), spec.lr, settings)
    val = fixed_batch(task, data_seed, "val", settings.val_sequences)
    test = fixed_batch(task, data_seed, "test", settings.test_sequences)
    probe_batch = task.batch(data_seed, "val", 1, settings.probe_sequences)
    rows: list[dict] = []
    chunks, wall, diverged = 0.0, 0.0, False

    def record(step, metric, value, distance=0):
        rows.append({"step": step, "metric": metric, "distance": distance, "value": float(value)})

    def held_out(step, split, batch):
        for (metric, d), v in evaluate(model, batch, task.distances).items():
            record(step, f"{split}_{metric}", v, d)

    def probes(step):
        for metric, v in probe(model, spec.arm, probe_batch, c).items():
            record(step, f"probe_{metric}", v)

    held_out(0, "val", val)
    probes(0)
    for step in range(settings.steps):
        batch = task.batch(spec.seed, "train", step, settings.batch_size)
        t0 = time.perf_counter()
        loss, grads, n_chunks = gradient(model, spec.arm, batch, c, settings.micro_batch, spec.seed, step)
        opt.zero_grad(set_to_none=True)
        accumulate_grads(model, grads)
        if settings.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
        for group in opt.param_groups:
            group["lr"] = settings.lr_at(step, spec.lr)
        opt.step()
        wall += time.perf_counter() - t0
        chunks += n_chunks
        done = step + 1
        record(done, "train_loss", loss)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            diverged = True
            break
        if done % settings.eval_every == 0 or done == settings.steps:
            held_out(done, "val", val)
            record(done, "backprop_chunks", chunks)
            record(done, "wall_s", wall)
        if done % settings.probe_every == 0 or done == settings.steps:
            probes(done)
    if not diverged:
        held_out(settings.steps, "test", test)
    moved = float(sum((p.detach() - q).norm() ** 2 for p, q in zip(model.parameters(), init)) ** 0.5)
    summary = {"run_id": spec.run_id, "arm": spec.arm.name, "optimizer": spec.optimizer, "lr": spec.lr,
               "seed": spec.seed, "diverged": diverged, "steps_done": done, "param_distance": moved,
               "backprop_chunks_per_step": chunks / done, "wall_s": wall}
    return rows, summary
