"""One training run of the study: an arm (dense, SeCO or a SpaCO scheme at a budget), an optimizer,
a learning rate and a seed, on :class:`RecallTask`, built only on the library's low-level API.

Matched compute: every arm takes the same optimizer steps on the same token stream (batch
``step`` of the train split of seed ``seed``) from the same initial weights (model seed
``seed``).  SpaCO draws one chunk set per micro-batch from a generator seeded by
(seed, step, micro-batch), so arms that share a sampler and budget also share their draws.

Equal compute (issue 22): an arm may override the sequences per step (``Arm.batch_size``; SpaCO
then draws one chunk set per micro-batch of ``micro_batch`` sequences, the last one possibly
smaller, and averages the micro-batch estimates weighted by size) or the number of steps
(``Arm.steps``; the schedule keeps its shape: warm-up and decay scale with the steps).  Mode
``truncated`` is the gradient cut at every cache (``seco_lab.truncated_grad``: g(0) only).  Every
run records its compute: the cost model's chunk passes per step (``seco_lab.stats.equal_compute.
chunk_passes`` times the sequences) and the CPU time of its steps (``time.process_time``, one thread).

The run returns tidy rows (one per step x metric): training loss, held-out loss and far-token
loss (by distance), backpropagated chunks and wall time so far, and -- every ``probe_every``
steps, at the run's current parameters -- the exact first-order quality of the arm's expected
gradient on a fixed probe batch (docs/estimators.md §4):  E g_hat = sum_p w(p) g(p) from the hop
strata, compared with g by ``seco_lab.stats.strata.bias_metrics``.  With ``variance_groups`` > 0
the probe also estimates what the equal-compute best-scale MSE needs (``seco_lab.stats.equal_compute``):
the probe batch split into G groups gives unbiased cross-group estimates of ||g||^2, <m, g>, ||m||^2
and the data noise tr Cov_i(m_i); ``variance_draws`` draws of the arm's sampler, each swept over
every group, give the sampling noise A of one sequence and the covariance C of two sequences that
share a draw (E||D_h||^2 = A/n + (1 - 1/n) C, E<D_h, D_h'> = C for group deviations D_h = g_hat_h(I)
- m_h of n sequences each).

The run's definition (:class:`Arm`, :class:`RunSpec`, :class:`TrainSettings`) is in :mod:`.run_spec`
(re-exported here).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from seco_lab import (
    TinyConfig,
    TinyTransformer,
    accumulate_grads,
    flatten,
    get_scheme,
    hop_strata,
)
from seco_lab.core.checks import ceil_div
from seco_lab.stats.equal_compute import best_scale_mse, step_variance
from seco_lab.stats.strata import StrataGram, bias_metrics
from seco_lab.training.step import mode_grads

from .run_spec import MODES, NEW_SETTINGS, OPTIMIZERS, Arm, RunSpec, TrainSettings  # noqa: F401 (re-export)
from .task import RecallBatch, RecallTask

__all__ = ["Arm", "RunSpec", "TrainSettings", "evaluate", "gradient", "probe", "train_run"]


def make_optimizer(name: str, params, lr: float, settings: TrainSettings) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=settings.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")


def gradient(model, arm: Arm, batch: RecallBatch, chunk_size: int, micro_batch: int, seed: int, step: int):
    """(training loss, gradient dict, backpropagated chunks) of one optimizer step for ``arm``: the trainer's
    :func:`seco_lab.training.step.mode_grads` on the whole batch, or for SpaCO on each micro-batch (one draw each, from
    ``[seed, step, micro-batch, 7]``), averaged weighted by size."""
    if arm.mode != "spaco":
        loss, grads, chunks = mode_grads(model, batch.tokens, batch.targets, arm.mode, chunk_size)
        return float(loss), grads, float(chunks)
    total, losses, chunks = None, [], 0.0
    scheme = get_scheme(arm.scheme)
    n = batch.tokens.shape[0]
    for m, size in enumerate(micro_batches(n, micro_batch)):
        mb = batch.rows(slice(m * micro_batch, m * micro_batch + size))
        loss, g, drawn = mode_grads(model, mb.tokens, mb.targets, "spaco", chunk_size, scheme, arm.budget,
                                    np.random.default_rng([seed, step, m, 7]))
        share = size / n
        chunks += share * drawn
        losses.append(share * float(loss))
        if not drawn:  # an empty Bernoulli draw: the estimate is zero, the loss still counts
            continue
        # the micro-batch estimates are means over their own tokens; average them weighted by size
        total = {n_: share * g_ for n_, g_ in g.items()} if total is None else \
            {n_: total[n_] + share * g[n_] for n_ in total}
    if total is None:
        total = {n_: torch.zeros_like(p) for n_, p in model.named_parameters()}
    return float(sum(losses)), total, chunks


def micro_batches(batch: int, micro_batch: int) -> list[int]:
    """Sizes of a step's micro-batches (one SpaCO draw each): full ones of ``micro_batch``, then the rest."""
    full, rest = divmod(batch, micro_batch)
    return [micro_batch] * full + ([rest] if rest else [])


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
        k = ceil_div(batch.tokens.shape[1], chunk_size)
        w = get_scheme(arm.scheme).expected_weights(k, arm.budget, gram.max_hops)
        m = bias_metrics(gram, w)
        out.update(cos=1.0 - m["direction_bias"], rel_bias=m["rel_bias"],
                   best_scale_residual=m["best_scale_residual"], per_tensor_residual=m["per_tensor_residual"],
                   scale=m["scale"])
    elif arm.mode == "truncated":  # E g_hat = g_hat = g(0)
        m = bias_metrics(gram, np.eye(gram.max_hops + 1)[0])
        out.update(cos=1.0 - m["direction_bias"], rel_bias=m["rel_bias"],
                   best_scale_residual=m["best_scale_residual"], per_tensor_residual=m["per_tensor_residual"],
                   scale=m["scale"])
    else:  # exact methods: E g_hat = g
        out.update(cos=1.0, rel_bias=0.0, best_scale_residual=0.0, per_tensor_residual=0.0, scale=1.0)
    return out


def expected_weights(arm: Arm, k: int, max_hops: int) -> np.ndarray:
    """w(p), p = 0..max_hops: the arm's E g_hat = sum_p w(p) g(p) (1 for exact methods, e_0 for truncated)."""
    if arm.mode == "spaco":
        return np.asarray(get_scheme(arm.scheme).expected_weights(k, arm.budget, max_hops), dtype=np.float64)
    return np.eye(max_hops + 1)[0] if arm.mode == "truncated" else np.ones(max_hops + 1)


def _cross_mean(X: torch.Tensor, Y: torch.Tensor) -> float:
    """mean over h != h' of <X_h, Y_h'> (rows of X and Y: G groups): unbiased for <E X, E Y>."""
    G = X.shape[0]
    full = float(X.sum(0) @ Y.sum(0))
    return (full - float((X * Y).sum())) / (G * (G - 1))


def noise_probe(model, arm: Arm, batch: RecallBatch, chunk_size: int, groups: int, draws: int,
                rng: np.random.Generator) -> dict[str, float]:
    """The terms of the equal-compute best-scale MSE at the current parameters (module docstring):
    cross-group estimates of ||g||^2, <m, g>, ||m||^2, the data noise of m_i and of g_i per sequence, and
    the sampling noise A and shared-draw covariance C of the arm's sampler (0 for exact / truncated)."""
    L = len(model.blocks)
    B = batch.tokens.shape[0]
    n = B // groups
    k = ceil_div(batch.tokens.shape[1], chunk_size)
    parts = [batch.rows(slice(h * n, (h + 1) * n)) for h in range(groups)]
    exact = [hop_strata(model, p.tokens, p.targets, chunk_size, max_hops=L) for p in parts]
    P = exact[0].max_hops
    w = torch.as_tensor(expected_weights(arm, k, P), dtype=torch.float64)
    S = torch.stack([torch.stack([flatten(s).double() for s in e.strata]) for e in exact])  # (G, P+1, d)
    g_h, m_h = S.sum(1), torch.einsum("p,gpd->gd", w, S)

    def data_var(X):  # n * sample variance of the group means: tr Cov_i per sequence
        return float(n * ((X - X.mean(0)) ** 2).sum() / (groups - 1))

    out = {"g_sq": _cross_mean(g_h, g_h), "inner": _cross_mean(m_h, g_h), "mean_sq": _cross_mean(m_h, m_h),
           "data_var": data_var(m_h), "seco_data_var": data_var(g_h), "sampling_var": 0.0, "shared_cov": 0.0}
    if arm.mode != "spaco":
        return out
    scheme = get_scheme(arm.scheme)
    own, cross = [], []
    for _ in range(draws):
        subset = scheme.sampler.draw(k, arm.budget, rng)
        if subset:
            est = torch.stack([flatten(hop_strata(model, p.tokens, p.targets, chunk_size, max_hops=L,
                                                  subset=subset).estimate(scheme, arm.budget)).double()
                               for p in parts])
        else:  # an empty Bernoulli draw: every estimate is 0
            est = torch.zeros_like(m_h)
        D = est - m_h
        own.append(float((D * D).sum()) / groups)
        cross.append(_cross_mean(D, D))
    C = float(np.mean(cross))
    out.update(sampling_var=n * (float(np.mean(own)) - (1 - 1 / n) * C), shared_cov=C)
    return out


def equal_compute_mse(noise: dict[str, float], arm: Arm, batch_size: int, micro_batch: int) -> dict[str, float]:
    """The best-scale MSE (and noise-to-signal) of the arm's step at its own batch and micro-batches."""
    sizes = micro_batches(batch_size, micro_batch) if arm.mode == "spaco" else None
    var = step_variance(noise["data_var"], noise["sampling_var"], batch_size, sizes, noise["shared_cov"])
    mse = best_scale_mse(noise["inner"], noise["mean_sq"], noise["g_sq"], var) if noise["g_sq"] > 0 else math.nan
    return {"ec_mse": mse, "step_var": var,
            "noise_to_signal": var / noise["mean_sq"] if noise["mean_sq"] > 0 else math.nan}


def fixed_batch(task: RecallTask, seed: int, split: str, size: int) -> RecallBatch:
    """One deterministic held-out batch; index 0 of ``split`` for the seed-independent data seed."""
    return task.batch(seed, split, 0, size)


class _RunLog:
    """The tidy rows of one run: ``record`` one value, ``held_out`` losses on a fixed batch, ``probes`` of the
    gradient's quality (and, with ``settings.variance_groups``, its noise) at the current parameters."""

    def __init__(self, model, spec: RunSpec, settings: TrainSettings, probe_batch: RecallBatch, batch_size: int,
                 micro: int, noise_rng: np.random.Generator):
        self.model, self.spec, self.settings, self.probe_batch = model, spec, settings, probe_batch
        self.batch_size, self.micro, self.noise_rng = batch_size, micro, noise_rng
        self.rows: list[dict] = []

    def record(self, step, metric, value, distance=0):
        self.rows.append({"step": step, "metric": metric, "distance": distance, "value": float(value)})

    def held_out(self, step, split, batch):
        for (metric, d), v in evaluate(self.model, batch, self.settings.task.distances).items():
            self.record(step, f"{split}_{metric}", v, d)

    def probes(self, step):
        model, spec, settings, c = self.model, self.spec, self.settings, self.settings.task.chunk_size
        for metric, v in probe(model, spec.arm, self.probe_batch, c).items():
            self.record(step, f"probe_{metric}", v)
        if settings.variance_groups:
            noise = noise_probe(model, spec.arm, self.probe_batch, c, settings.variance_groups,
                                settings.variance_draws, self.noise_rng)
            for metric, v in {**noise, **equal_compute_mse(noise, spec.arm, self.batch_size, self.micro)}.items():
                self.record(step, f"probe_{metric}", v)


def _optimizer_step(model, opt, spec: RunSpec, settings: TrainSettings, batch: RecallBatch, chunk_size: int,
                    micro: int, step: int, steps: int):
    """One training step: the arm's gradient into ``.grad``, clipped, the scheduled rate, the optimizer's step;
    returns (loss, chunks backpropagated)."""
    loss, grads, n_chunks = gradient(model, spec.arm, batch, chunk_size, micro, spec.seed, step)
    opt.zero_grad(set_to_none=True)
    accumulate_grads(model, grads)
    if settings.clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
    for group in opt.param_groups:
        group["lr"] = settings.lr_at(step, spec.lr, steps)
    opt.step()
    return loss, n_chunks


def train_run(spec: RunSpec, settings: TrainSettings, data_seed: int = 1234) -> tuple[list[dict], dict]:
    """Train one run; returns (tidy rows, summary).  Held-out sets do not depend on the run's seed."""
    torch.manual_seed(spec.seed)
    task, c = settings.task, settings.task.chunk_size
    record = spec.record(settings)  # what the run's id fixes (the report checks runs.csv against it)
    steps, batch_size = record["steps"], record["batch_size"]
    micro = min(settings.micro_batch, batch_size)
    noise_rng = np.random.default_rng([spec.seed, 11])
    cfg = TinyConfig(vocab_size=task.vocab_size, **settings.model)
    model = TinyTransformer(cfg, seed=spec.seed)
    init = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer(spec.optimizer, model.parameters(), spec.lr, settings)
    val = fixed_batch(task, data_seed, "val", settings.val_sequences)
    test = fixed_batch(task, data_seed, "test", settings.test_sequences)
    probe_batch = task.batch(data_seed, "val", 1, settings.probe_sequences)
    log = _RunLog(model, spec, settings, probe_batch, batch_size, micro, noise_rng)
    chunks, wall, cpu, diverged = 0.0, 0.0, 0.0, False

    log.held_out(0, "val", val)
    log.probes(0)
    for step in range(steps):
        batch = task.batch(spec.seed, "train", step, batch_size)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, n_chunks = _optimizer_step(model, opt, spec, settings, batch, c, micro, step, steps)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        chunks += n_chunks
        done = step + 1
        log.record(done, "train_loss", loss)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            diverged = True
            break
        if done % settings.eval_every == 0 or done == steps:
            log.held_out(done, "val", val)
            log.record(done, "backprop_chunks", chunks)
            log.record(done, "wall_s", wall)
            log.record(done, "cpu_s", cpu)
        if done % settings.probe_every == 0 or done == steps:
            log.probes(done)
    if not diverged:
        log.held_out(steps, "test", test)
    moved = float(sum((p.detach() - q).norm() ** 2 for p, q in zip(model.parameters(), init)) ** 0.5)
    summary = {"run_id": spec.run_id, **{k: record[k] for k in ("arm", "optimizer", "lr", "seed")},
               "diverged": diverged, "steps_done": done, "param_distance": moved,
               "backprop_chunks_per_step": chunks / done, "wall_s": wall, "cpu_s": cpu,
               **{k: record[k] for k in ("steps", "batch_size", "passes_per_step")}}
    return log.rows, summary
