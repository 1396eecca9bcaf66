"""Vector-Jacobian products of one rebuilt chunk for labelled seeds: the products a chunk of
:func:`seco_lab.core.engine.backward_sweep` runs (one per label, batched, or fused for sharded models), and the
seeds and relay buffers they read and write.

A seed is ``[loss coefficient, cache gradients or None]``: the loss coefficient multiplies the chunk's summed
token loss, the cache gradients are what earlier sweeps relayed onto the chunk's cache (None where nothing
reached a tensor).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["add_relayed", "chunk_products", "seed_vjp", "summed_seed", "vjp"]


def chunk_products(outputs, jobs, params, src_leaves, batched: bool, fused: bool = False):
    """Yield (*job, gradients w.r.t. the job's inputs) for every job: one product per job, or (``batched``)
    the jobs that want the same inputs in one batched product, or (``fused``) at most two batched
    products, the earlier-leaf-only jobs first and the parameter jobs last, over every output.  A sharded
    model needs ``fused``: FSDP reshards a block once gradients have reached its inputs, so the products
    of one chunk graph must not outnumber the ones its backward hooks expect."""
    inputs = lambda job: (params if job[2] else []) + (src_leaves if job[3] else [])  # noqa: E731
    if fused:
        parts = [[job for job in jobs if not job[2]], [job for job in jobs if job[2]]]
        parts = [part for part in parts if part]
        for g, part in enumerate(parts):
            wants_leaves = any(job[3] for job in part)
            union = (params if part[0][2] else []) + (src_leaves if wants_leaves else [])
            res = vjp(outputs, [job[1] for job in part], union, retain_graph=g + 1 < len(parts))
            n_par = len(params) if part[0][2] else 0
            for s, job in enumerate(part):
                grads = [r[s] for r in res]
                yield (*job, grads[:n_par] + (grads[n_par:] if job[3] else []))
        return
    if not batched:
        for n, job in enumerate(jobs):
            yield (*job, seed_vjp(outputs, job[1], inputs(job), retain_graph=n + 1 < len(jobs)))
        return
    groups: dict[tuple[bool, bool, bool], list] = {}
    for job in jobs:  # a seed with a loss term apart: the others' product then skips the LM head
        groups.setdefault((job[2], job[3], float(job[1][0]) != 0.0), []).append(job)
    for g, (_, group) in enumerate(groups.items()):
        res = vjp(outputs, [job[1] for job in group], inputs(group[0]), retain_graph=g + 1 < len(groups))
        for s, job in enumerate(group):
            yield (*job, [r[s] for r in res])


def add_relayed(buffer: dict, label: Hashable, part: Sequence[torch.Tensor | None], factor: float) -> None:
    """buffer[label] += factor * part, tensor by tensor; None (nothing reached that tensor) adds nothing."""
    buf = buffer.get(label)
    if buf is None:  # this sweep's own tensors: kept as they are at factor 1, added into in place after
        buffer[label] = [g if g is None or factor == 1.0 else g * factor for g in part]
        return
    for r, g in enumerate(part):
        if g is None:
            continue
        if buf[r] is None:
            buf[r] = g if factor == 1.0 else g * factor
        else:
            buf[r].add_(g, alpha=factor)


def seed_vjp(outputs: Sequence[torch.Tensor], seed: list, inputs: Sequence[torch.Tensor],
             retain_graph: bool) -> list[torch.Tensor | None]:
    """The vector-Jacobian product of one seed [loss coefficient, cache gradients or None] w.r.t. ``inputs``
    (None where nothing reaches an input).

    Only the outputs the seed touches enter the product: a relayed seed (coefficient 0) skips the
    LM head and its log-softmax, and cache tensors nothing reached (the upper layers, for a gradient
    that has already descended some hops) are left out, so autograd never propagates zeros through
    them.  Products w.r.t. the earlier leaves alone skip every weight-gradient matmul.
    """
    coef, caches = seed
    outs, grads = [], []
    if float(coef) != 0.0 and outputs[0].requires_grad:
        outs.append(outputs[0])
        grads.append(outputs[0].new_tensor(float(coef)))
    for o, g in zip(outputs[1:], caches or ()):
        if g is not None and o.requires_grad:
            outs.append(o)
            grads.append(g)
    if not outs or not inputs:
        return [None] * len(inputs)
    return list(torch.autograd.grad(outs, list(inputs), grads, retain_graph=retain_graph, allow_unused=True))


def summed_seed(seeds) -> list:
    """The seed [sum of loss coefficients, sum of cache gradients] of several labels (None: reached by none)."""
    seeds = list(seeds)
    coef = sum(float(s[0]) for s in seeds)
    caches = [s[1] for s in seeds if s[1] is not None]
    if not caches:
        return [coef, None]
    total = [None if g is None else g.clone() for g in caches[0]]
    for other in caches[1:]:
        for r, g in enumerate(other):
            if g is not None:
                total[r] = g.clone() if total[r] is None else total[r].add_(g)
    return [coef, total]


def vjp(outputs: list[torch.Tensor], seeds: list[list], inputs: list[torch.Tensor],
        retain_graph: bool = False) -> list[torch.Tensor]:
    """Vector-Jacobian products of ``outputs`` for several seeds at once.

    Each seed is [loss_coefficient, cache_grads or None]; returns, for every
    input, a tensor with a leading seed dimension (zeros where unreachable).
    Autograd computes only what the requested ``inputs`` need: products w.r.t. the
    cache leaves alone skip the weight-gradient matmuls.
    """
    n = len(seeds)
    ref0 = outputs[0]

    def stacked(idx: int) -> torch.Tensor:
        if idx == 0:
            return ref0.new_tensor([float(s[0]) for s in seeds])
        ref = outputs[idx]
        return torch.stack([ref.new_zeros(ref.shape) if s[1] is None or s[1][idx - 1] is None else s[1][idx - 1]
                            for s in seeds])

    # outputs that no trainable parameter or leaf reaches (e.g. layer-0 keys when only LoRA
    # adapters on q/v train) carry no graph, and outputs no seed touches (the loss of relayed-only
    # labels, cache layers a relayed gradient never reached): they contribute nothing and are left out
    touched = [any(float(s[0]) != 0.0 for s in seeds)] + [
        any(s[1] is not None and s[1][r] is not None for s in seeds) for r in range(len(outputs) - 1)]
    live = [i for i, o in enumerate(outputs) if o.requires_grad and touched[i]]
    if not live:
        return [x.new_zeros((n, *x.shape)) for x in inputs]
    outs = [outputs[i] for i in live]
    grad_outputs = [stacked(i) for i in live]
    if n == 1:
        res = torch.autograd.grad(
            outs, inputs, [g[0] for g in grad_outputs], retain_graph=retain_graph, allow_unused=True,
            materialize_grads=True
        )
        return [r.unsqueeze(0) for r in res]
    # unused inputs come back as None (materialize_grads would drop the batch dimension): zeros of (n, *shape)
    res = torch.autograd.grad(outs, inputs, grad_outputs, retain_graph=retain_graph, is_grads_batched=True,
                              allow_unused=True)
    return [x.new_zeros((n, *x.shape)) if r is None else r for r, x in zip(res, inputs)]
