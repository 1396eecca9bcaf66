"""The pieces of one optimizer step, as plain functions.

* :func:`chunk_grads`, :func:`mode_grads` -- the gradient of one micro-batch with the configured engine.
* :func:`allreduce_mean` -- the mean over micro-batches and ranks of the gradient (one
  flat buffer in the parameters' dtype) and of the step's statistics (float64, so a
  bfloat16 run still logs its loss with 16 significant digits).
* :func:`scheduled_lr`, :func:`lr_factor`, :func:`schedule_factor` -- the learning-rate schedule (warm-up
  + cosine, and its cycles when a run is extended), functions of plain numbers.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ..core.checks import ceil_div
from ..core.engine import dense_grad, forward_loss, seco_grad, truncated_grad
from ..data.sources import Batch
from ..estimators.spaco import spaco_grad

__all__ = ["allreduce_mean", "chunk_grads", "lr_factor", "mode_grads", "schedule_factor", "scheduled_lr"]


def scheduled_lr(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """The learning rate of ``step``: linear warm-up, then cosine decay,

        lr(s) = lr * (s + 1) / W                                        for s < W
        lr(s) = lr * (r + (1 - r) * (1 + cos(pi * min(1, (s - W) / max(1, S - W)))) / 2)   otherwise

    with W = ``warmup``, S = ``steps``, r = ``min_lr_ratio``; lr(S) = lr * r.  The trainer's factor is
    ``lr_factor`` = this at lr = 1 (bit for bit); the training study calls it with its rate.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def lr_factor(step: int, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """The schedule's factor f(s) = :func:`scheduled_lr` at lr = 1 (the trainer's ``LambdaLR`` multiplies it by
    the base rate)."""
    return scheduled_lr(step, 1.0, warmup, steps, min_lr_ratio)


def schedule_factor(step: int, warmup: int, steps: int, min_lr_ratio: float, cycles=()) -> float:
    """:func:`lr_factor` over the run's cycles ``[[s_0, e_0], [s_1, e_1], ...]`` (empty: ``[[0, steps]]``).

    The cycle of ``step`` is the last with s_i <= step; with u = step - s_i:

        f = lr_factor(u, W, e_0 - s_0, r)                     in the first cycle (and r past e_0)
        f = r + (1 - r) * (u + 1) / W                         for u < W in a later cycle (re-warm from r)
        f = lr_factor(u, W, e_i - s_i, r)                     for u >= W (cosine from 1 to r at e_i, then r)

    A run extended without a new cycle therefore keeps f = r: the schedule it finished, continued.
    """
    cycles = list(cycles) or [[0, steps]]
    index = max(i for i, c in enumerate(cycles) if c[0] <= step or i == 0)
    start, end = cycles[index]
    u = step - start
    if index > 0 and u < warmup:
        return min_lr_ratio + (1 - min_lr_ratio) * (u + 1) / warmup
    return lr_factor(u, warmup, end - start, min_lr_ratio)


def chunk_grads(model, batch: Batch, cfg, generator: np.random.Generator | None, scheme=None):
    """``(loss, grads, stats)`` of one micro-batch: the mean token loss, the gradient of
    the trainable parameters by name, and ``{"chunks": chunks backpropagated}``.

    ``cfg`` is a :class:`~seco_lab.config.TrainConfig`; ``generator`` draws the SpaCO chunk
    subset (unused by ``dense`` and ``seco``); ``scheme`` defaults to ``cfg.build_scheme()``.
    """
    if cfg.mode == "spaco":
        scheme = scheme or cfg.build_scheme()
    loss, grads, chunks = mode_grads(model, batch.tokens, batch.targets, cfg.mode, cfg.chunk_size, scheme,
                                     cfg.budget, generator)
    return loss, grads, {"chunks": chunks}


def mode_grads(model, tokens, targets, mode: str, chunk_size: int, scheme=None, budget: int | None = None,
               generator: np.random.Generator | None = None):
    """``(loss, grads, chunks backpropagated)`` of one batch under ``mode``: 'dense', 'seco', 'truncated'
    (SeCO without the relay: the within-chunk gradient) or 'spaco' (``scheme`` at ``budget``, the subset
    drawn by ``generator``; an empty Bernoulli draw gives the forward loss and a zero gradient).  The
    trainer and the training study share it."""
    k = ceil_div(tokens.shape[1], chunk_size)  # the last chunk may be shorter: it is a chunk (drawn like the others)
    if mode == "dense":
        loss, grads = dense_grad(model, tokens, targets)
        return loss, grads, k
    if mode in ("seco", "truncated"):
        engine = seco_grad if mode == "seco" else truncated_grad
        loss, grads = engine(model, tokens, targets, chunk_size=chunk_size)
        return loss, grads, k
    if mode != "spaco" or scheme is None:
        raise ValueError(f"mode {mode!r}: use 'dense', 'seco', 'truncated', or 'spaco' with a scheme")
    subset = scheme.sampler.draw(k, budget, generator)
    if subset:
        loss, grads = spaco_grad(model, tokens, targets, chunk_size, scheme, budget, subset=subset)
    else:
        loss = forward_loss(model, tokens, targets, chunk_size)
        grads = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    return loss, grads, len(subset)


def allreduce_mean(params, stats: dict[str, float], count: int, world: int) -> tuple[dict[str, float], int]:
    """Replace each ``p.grad`` by the mean over ``count`` micro-batches and ``world`` ranks
    (``p.grad`` holds this rank's sum) and return the same mean of ``stats`` (this rank's
    sums) with the number of all-reduce calls made.

    Gradients travel in one flat buffer of the parameters' dtype; the statistics in
    float64 -- in the same buffer when the parameters are float64, else in a second one.
    """
    names = list(stats)
    denom = count * world
    stat_buf = torch.tensor([float(stats[n]) for n in names], dtype=torch.float64) / denom
    grads = torch.cat([p.grad.reshape(-1) for p in params]) / denom
    calls = 0
    if grads.dtype == torch.float64:
        flat = torch.cat([grads, stat_buf.to(grads.device)])
        if world > 1:
            dist.all_reduce(flat)
            calls = 1
        grads, stat_buf = flat[: grads.numel()], flat[grads.numel() :].cpu()
    elif world > 1:
        stat_buf = stat_buf.to(grads.device)
        dist.all_reduce(grads)
        dist.all_reduce(stat_buf)
        stat_buf, calls = stat_buf.cpu(), 2
    pos = 0
    for p in params:
        p.grad.copy_(grads[pos : pos + p.numel()].view_as(p))
        pos += p.numel()
    return dict(zip(names, stat_buf.tolist())), calls
