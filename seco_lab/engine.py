"""Dense and SeCO gradients, and the chunk sweep every estimator is built on.

SeCO (docs/estimators.md §2).  Pass 1 runs every chunk under ``no_grad`` and keeps its
KV cache as leaf tensors m'_j.  Pass 2 visits chunks j = k..1 in decreasing
order, rebuilds chunk j from the leaves m'_{<j} and backprops

    J_j + <m_j, G_j>,        G_j = gradient already accumulated on m'_j,

which accumulates grad_Theta and the earlier leaves' gradients.  Exact: equal to
dense backprop up to rounding.  Only one chunk's graph is alive at a time.

:func:`backward_sweep` is the general form used by every engine in the package:
relayed gradients are *labelled* (one label for SeCO, one per hop count for the
hop strata and hop-dependent SpaCO schemes, one per chain for the chain basis)
and each hop multiplies them by a factor chosen from the label.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from .checks import ceil_div, check_chunk_size
from .grads import GradDict, named_grads
from .protocol import ChunkCache, ChunkModel, ChunkOutput, flat_cache, unflat_cache


@dataclass
class ChunkedBatch:
    """Validated tokens/targets split into k chunks of ``chunk_size`` (last may be shorter)."""

    tokens: torch.Tensor  # (B, n) integer
    targets: torch.Tensor  # (B, n) integer, ignore_index allowed
    chunk_size: int
    ignore_index: int
    n_targets: int  # number of non-ignored targets: the loss normaliser

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_chunks(self) -> int:
        return ceil_div(self.length, self.chunk_size)

    def chunk(self, j: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        s = j * self.chunk_size
        e = min(s + self.chunk_size, self.length)
        return self.tokens[:, s:e], self.targets[:, s:e], s


def _as_2d(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{what} must have shape (batch, length) or (length,), got {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor of token ids, got dtype {x.dtype}")
    # embeddings and cross-entropy index with int64; int8/int16/int32/uint8 ids are widened, not refused
    return x.long()


def check_model(model) -> None:
    """Raise unless ``model`` implements the chunk-model protocol with one floating dtype."""
    if not callable(getattr(model, "chunk_forward", None)) or not callable(getattr(model, "named_parameters", None)):
        raise TypeError(
            f"{type(model).__name__} does not implement the chunk-model protocol: it needs "
            "chunk_forward(tokens, targets, past, start, ignore_index) and named_parameters() "
            "(see seco_lab.protocol.ChunkModel)"
        )
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to differentiate")
    if len(dtypes) > 1:
        raise TypeError(f"model parameters have mixed dtypes {sorted(map(str, dtypes))}; cast the model to one dtype")
    if dtypes and not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"model parameters must be floating point, got {dtypes.pop()}")
    if not getattr(model, "deterministic", True):
        raise ValueError(
            "the model is not deterministic (dropout is active in training mode): a chunk rebuild "
            "would not reproduce its first pass and the gradient would be wrong; call model.eval() "
            "or set dropout=0"
        )


def prepare(model, tokens, targets, chunk_size: int | None = None, ignore_index: int = -100) -> ChunkedBatch:
    """Validate the inputs of any engine; every error says what was wrong."""
    check_model(model)
    tokens = _as_2d(tokens, "tokens")
    targets = _as_2d(targets, "targets")
    if tokens.shape != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match tokens shape {tuple(tokens.shape)}")
    b, n = tokens.shape
    if b == 0 or n == 0:
        raise ValueError(f"empty input: tokens have shape {tuple(tokens.shape)}")
    chunk_size = n if chunk_size is None else check_chunk_size(chunk_size)
    max_pos = getattr(model, "max_positions", None)
    if max_pos is not None and n > max_pos:
        raise ValueError(f"sequence length {n} exceeds the model's maximum positions {max_pos}")
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), got range [{lo}, {hi}]")
        valid = targets[targets != ignore_index]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            raise ValueError(f"target ids must lie in [0, {vocab}) or equal ignore_index={ignore_index}")
    n_targets = int((targets != ignore_index).sum())
    if n_targets == 0:
        raise ValueError(f"every target equals ignore_index={ignore_index}: there is no loss to differentiate")
    device = next(iter(model.parameters())).device
    return ChunkedBatch(tokens.to(device), targets.to(device), chunk_size, ignore_index, n_targets)


def checked_chunk(out, j: int) -> ChunkOutput:
    """``out`` if it is a valid chunk output with a finite loss; otherwise a clear error naming chunk j."""
    if not isinstance(out, ChunkOutput):
        raise TypeError(
            f"chunk_forward must return seco_lab.protocol.ChunkOutput(loss_sum, cache), got {type(out).__name__}"
        )
    if not torch.isfinite(out.loss_sum).all():
        raise FloatingPointError(
            f"the loss of chunk {j} is {float(out.loss_sum.detach())}: the model's forward produced NaN/inf "
            "(non-finite weights, a negative or zero norm eps, or overflow in a low-precision dtype)"
        )
    return out


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("no parameter of the model requires grad")
    return params


@torch.no_grad()
def cache_leaves(model: ChunkModel, batch: ChunkedBatch, with_loss: bool = True,
                 include_last: bool = True) -> tuple[list[ChunkCache], torch.Tensor | None]:
    """Pass 1: forward every chunk without a graph; return the caches as leaves and the mean loss.

    ``with_loss=False`` passes no targets (a model may then skip its output head, e.g. the
    LM head over a large vocabulary) and returns ``None`` for the loss: for engines whose
    pass 2 rebuilds every chunk and sums the loss there (SeCO).  ``include_last=False`` (only
    with ``with_loss=False``) also skips the last chunk, whose cache no chunk reads: k - 1 leaves.
    """
    if with_loss and not include_last:
        raise ValueError("include_last=False needs with_loss=False: the last chunk's loss comes from its forward")
    leaves: list[ChunkCache] = []
    total = 0.0
    for j in range(batch.num_chunks if include_last else batch.num_chunks - 1):
        tok, tgt, start = batch.chunk(j)
        out = checked_chunk(model.chunk_forward(tok, tgt if with_loss else None, leaves, start, batch.ignore_index), j)
        total = total + out.loss_sum
        leaves.append(unflat_cache([t.detach().requires_grad_(True) for t in flat_cache(out.cache)]))
    return leaves, total / batch.n_targets if with_loss else None


def forward_loss(model: ChunkModel, tokens, targets, chunk_size: int | None = None,
                 ignore_index: int = -100) -> torch.Tensor:
    """Mean token loss sum_j J_j / N, chunk by chunk without a graph (any length, no activations kept)."""
    return cache_leaves(model, prepare(model, tokens, targets, chunk_size, ignore_index))[1]


Relay = Callable[[Hashable, int, int], "tuple[Hashable, float] | None"]
Collect = Callable[[Hashable, int, Sequence[torch.Tensor]], None]


def backward_sweep(
    model: ChunkModel,
    batch: ChunkedBatch,
    leaves: Sequence[ChunkCache],
    params: Sequence[torch.Tensor],
    visit: Sequence[int],
    *,
    direct_label: Callable[[int], Hashable],
    direct_scale: float,
    relay: Relay,
    collect: Collect,
    collect_total: bool = False,
) -> None:
    """Pass 2, generalised.  Visits ``visit`` in decreasing order; at chunk j backprops

        direct_scale * J_j / N  (under label direct_label(j))
        + sum_labels <m_j, G_j[label]>

    with one vector-Jacobian product per distinct label (batched when several).
    ``collect(label, j, param_grads)`` receives the parameter gradient of each label.
    ``collect_total=True`` is for callers that only want the sum over labels (SpaCO with a
    hop-dependent relay): ``collect(None, j, param_grads)`` then receives the summed
    parameter gradient, computed by one product of the summed seed w.r.t. the parameters,
    and only the labels that are relayed get a product of their own -- w.r.t. the earlier
    leaves alone, which skips every weight-gradient matmul (about half a backward each).
    The gradient a label's seed puts on an earlier visited leaf m'_i is added to
    G_i[new_label] * factor, where ``relay(label, j, i) -> (new_label, factor)``;
    ``None`` drops it.  Chunks outside ``visit`` are never rebuilt and receive nothing.

    When every chunk has one label and every hop the same factor (SeCO, constant-relay
    SpaCO) the sweep runs as :func:`relay_sweep` (gradients accumulated in place) and
    ``collect(label, None, param_grads)`` is called once with the sum over chunks.
    """
    order = sorted(set(int(j) for j in visit), reverse=True)
    constant = _constant_relay(order, direct_label, relay)
    if constant is not None:
        label, factor = constant
        tensors = list(params)
        saved = [p.grad for p in tensors]
        for p in tensors:
            p.grad = None
        try:
            relay_sweep(model, batch, leaves, tensors, order, direct_scale=direct_scale, relay_factor=factor)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in tensors]
        finally:
            for p, g in zip(tensors, saved):
                p.grad = g
        collect(label, None, grads)
        return
    visited = set(order)
    buffers: dict[int, dict[Hashable, list[torch.Tensor]]] = defaultdict(dict)
    for j in order:
        tok, tgt, start = batch.chunk(j)
        sources = [i for i in range(j) if i in visited]
        src_leaves = [t for i in sources for t in flat_cache(leaves[i])]
        with torch.enable_grad():
            out = model.chunk_forward(tok, tgt, leaves[:j], start, batch.ignore_index)
        outputs = [out.loss_sum] + flat_cache(out.cache)
        # Seeds: one per label; the direct term joins its label's relayed seed.
        seeds: dict[Hashable, list] = {}
        lab = direct_label(j)
        seeds[lab] = [out.loss_sum.new_tensor(direct_scale / batch.n_targets), None]
        for lab, g in buffers.pop(j, {}).items():
            seeds.setdefault(lab, [out.loss_sum.new_zeros(()), None])[1] = g
        labels = list(seeds)
        if collect_total:
            labels = [lab for lab in labels if any(relay(lab, j, i) is not None for i in sources)]
            grads = _vjp(outputs, [seeds[lab] for lab in labels], src_leaves, retain_graph=True) if labels else []
            collect(None, j, [g[0] for g in _vjp(outputs, [_summed(seeds.values())], list(params))])
            n_par = 0
        else:
            grads = _vjp(outputs, [seeds[lab] for lab in labels], list(params) + src_leaves)
            n_par = len(params)
        for s, lab in enumerate(labels):
            if not collect_total:
                collect(lab, j, [g[s] for g in grads[:n_par]])
            for pos, i in enumerate(sources):
                routed = relay(lab, j, i)
                if routed is None:
                    continue
                new_lab, factor = routed
                n_kv = len(flat_cache(leaves[i]))
                part = [grads[n_par + pos * n_kv + r][s] for r in range(n_kv)]
                buf = buffers[i].get(new_lab)
                if buf is None:  # this sweep's own tensors: kept as they are at factor 1, added into in place after
                    buffers[i][new_lab] = part if factor == 1.0 else [g * factor for g in part]
                else:
                    for a, g in zip(buf, part):
                        a.add_(g, alpha=factor)
        del out, outputs, grads


def _constant_relay(order: Sequence[int], direct_label, relay: Relay) -> tuple[Hashable, float] | None:
    """(label, factor) when every visited chunk seeds one label and every hop keeps it with one factor."""
    labels = {direct_label(j) for j in order}
    if len(labels) != 1:
        return None
    label = labels.pop()
    factors = set()
    for pos, j in enumerate(order):
        for i in order[pos + 1 :]:
            routed = relay(label, j, i)
            if routed is None or routed[0] != label:
                return None
            factors.add(float(routed[1]))
    if len(factors) > 1:
        return None
    return label, factors.pop() if factors else 1.0


def relay_sweep(
    model: ChunkModel,
    batch: ChunkedBatch,
    leaves: Sequence[ChunkCache],
    params: Sequence[torch.Tensor],
    visit: Sequence[int],
    *,
    direct_scale: float = 1.0,
    relay_factor: float = 1.0,
) -> torch.Tensor:
    """Pass 2 with one relay buffer: at chunk j (decreasing over ``visit``) backprop

        direct_scale * J_j / N + relay_factor * <m_j, R_j>,   R_j = leaf m'_j's ``.grad``,

    with ``torch.autograd.backward(..., inputs=params + earlier visited leaves)``: parameter
    gradients accumulate in place into ``p.grad`` (added to what is there), and the
    relayed gradient into the earlier leaves' ``.grad`` -- the relay buffers, released
    once used.  relay_factor = 1 is SeCO; a constant c_q = c is constant-relay SpaCO
    (each hop multiplies by c exactly once, when the buffer seeds its chunk).
    Returns the summed token loss of the visited chunks (detached).
    """
    order = sorted(set(int(j) for j in visit), reverse=True)
    visited = set(order)
    loss_sum = 0.0
    # a chunk without a leaf (the last one, when pass 1 skipped it) relays nothing to itself
    own_leaves = [flat_cache(leaves[j]) if j < len(leaves) else [] for j in range(max(order, default=-1) + 1)]
    for j in order:
        for leaf in own_leaves[j]:
            leaf.grad = None
    for j in order:
        tok, tgt, start = batch.chunk(j)
        src = [t for i in range(j) if i in visited for t in flat_cache(leaves[i])]
        with torch.enable_grad():  # checked before its backward: a NaN loss accumulates nothing
            out = checked_chunk(model.chunk_forward(tok, tgt, leaves[:j], start, batch.ignore_index), j)
        outs, seeds = [out.loss_sum], [out.loss_sum.new_tensor(direct_scale / batch.n_targets)]
        for o, leaf in zip(flat_cache(out.cache), own_leaves[j]):
            if leaf.grad is not None and o.requires_grad:
                outs.append(o)
                seeds.append(leaf.grad if relay_factor == 1.0 else leaf.grad.mul_(relay_factor))
        loss_sum = loss_sum + out.loss_sum.detach()
        live = [(o, g) for o, g in zip(outs, seeds) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live], inputs=list(params) + src)
        for leaf in own_leaves[j]:
            leaf.grad = None
        del out, outs, seeds, live
    return loss_sum if isinstance(loss_sum, torch.Tensor) else torch.zeros(())


def _summed(seeds) -> list:
    """The seed [sum of loss coefficients, sum of cache gradients] of several labels."""
    seeds = list(seeds)
    coef = sum(s[0] for s in seeds)
    caches = [s[1] for s in seeds if s[1] is not None]
    if not caches:
        return [coef, None]
    total = [g.clone() for g in caches[0]]
    for other in caches[1:]:
        for a, g in zip(total, other):
            a.add_(g)
    return [coef, total]


def _vjp(outputs: list[torch.Tensor], seeds: list[list], inputs: list[torch.Tensor],
         retain_graph: bool = False) -> list[torch.Tensor]:
    """Vector-Jacobian products of ``outputs`` for several seeds at once.

    Each seed is [loss_coefficient, cache_grads or None]; returns, for every
    input, a tensor with a leading seed dimension (zeros where unreachable).
    Autograd computes only what the requested ``inputs`` need: products w.r.t. the
    cache leaves alone skip the weight-gradient matmuls.
    """
    n = len(seeds)

    def stacked(idx: int) -> torch.Tensor:
        if idx == 0:
            return torch.stack([s[0] for s in seeds])
        ref = outputs[idx]
        return torch.stack([ref.new_zeros(ref.shape) if s[1] is None else s[1][idx - 1] for s in seeds])

    # outputs that no trainable parameter or leaf reaches (e.g. layer-0 keys when only LoRA
    # adapters on q/v train) carry no graph: they contribute nothing and are left out
    live = [i for i, o in enumerate(outputs) if o.requires_grad]
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
    res = torch.autograd.grad(outs, inputs, grad_outputs, retain_graph=retain_graph, is_grads_batched=True,
                              allow_unused=True, materialize_grads=True)
    return list(res)


def dense_grad(model: ChunkModel, tokens, targets, ignore_index: int = -100) -> tuple[torch.Tensor, GradDict]:
    """Reference gradient: backprop through the whole sequence at once.

    Returns (loss, grads) with loss = sum of token losses / number of targets.
    """
    batch = prepare(model, tokens, targets, None, ignore_index)
    params = trainable(model)
    with torch.enable_grad():
        out = checked_chunk(model.chunk_forward(batch.tokens, batch.targets, (), 0, ignore_index), 0)
        loss = out.loss_sum / batch.n_targets
        grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True, materialize_grads=True)
    return loss.detach(), named_grads(params, grads)


def truncated_grad(
    model: ChunkModel, tokens, targets, chunk_size: int, ignore_index: int = -100
) -> tuple[torch.Tensor, GradDict]:
    """The gradient cut at every cache: g(0), the direct term of every chunk and no relay.

    What a user gets by detaching the KV cache between chunks: one pass, chunk j runs forward
    with a graph on the detached caches of chunks < j and backprops J_j / N at once (every
    chunk backpropagated once, no pass 1, no cache gradient).  Equal to the 0-hop stratum of
    :func:`seco_lab.estimators.hop_strata` up to rounding (tested).
    """
    batch = prepare(model, tokens, targets, chunk_size, ignore_index)
    params = trainable(model)
    tensors = [p for _, p in params]
    acc = [torch.zeros_like(p) for p in tensors]
    past: list[ChunkCache] = []
    loss_sum = torch.zeros((), dtype=acc[0].dtype, device=acc[0].device)
    for j in range(batch.num_chunks):
        tok, tgt, start = batch.chunk(j)
        with torch.enable_grad():
            out = checked_chunk(model.chunk_forward(tok, tgt, past, start, batch.ignore_index), j)
            grads = torch.autograd.grad(out.loss_sum / batch.n_targets, tensors, allow_unused=True,
                                        materialize_grads=True)
        for a, g in zip(acc, grads):
            a.add_(g)
        loss_sum = loss_sum + out.loss_sum.detach()
        if j + 1 < batch.num_chunks:
            past.append(unflat_cache([t.detach() for t in flat_cache(out.cache)]))
    return loss_sum / batch.n_targets, named_grads(params, acc)


def accumulate_into(acc: list[torch.Tensor]) -> Collect:
    """A collector that adds every label's parameter gradients into ``acc``."""

    def collect(_label, _j, grads):
        for a, g in zip(acc, grads):
            a.add_(g)

    return collect


def seco_grad(
    model: ChunkModel, tokens, targets, chunk_size: int, ignore_index: int = -100
) -> tuple[torch.Tensor, GradDict]:
    """Exact gradient by sequential chunk-wise optimisation (SeCO, docs/estimators.md §2).

    ``.grad`` of the parameters is left as it was: the sweep accumulates into fresh
    ``.grad`` tensors, which are handed back (no copy) and the previous ones restored.
    """
    batch = prepare(model, tokens, targets, chunk_size, ignore_index)
    params = trainable(model)
    tensors = [p for _, p in params]
    saved = [p.grad for p in tensors]
    for p in tensors:
        p.grad = None
    try:
        loss = _seco_into_grad(model, batch, tensors, scale=1.0)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in tensors]
    finally:
        for p, g in zip(tensors, saved):
            p.grad = g
    return loss, named_grads(params, grads)


def _seco_into_grad(model: ChunkModel, batch: ChunkedBatch, params: Sequence[torch.Tensor], scale: float):
    # pass 2 rebuilds every chunk, so the loss is summed there: pass 1 needs no targets, and
    # not the last chunk at all (no chunk reads its cache) -- F/k less work than checkpointing
    leaves, _ = cache_leaves(model, batch, with_loss=False, include_last=False)
    loss_sum = relay_sweep(model, batch, leaves, params, range(batch.num_chunks), direct_scale=scale)
    return loss_sum / batch.n_targets


def seco_step(model: ChunkModel, tokens, targets, chunk_size: int, ignore_index: int = -100, scale: float = 1.0):
    """SeCO as a training step: accumulate ``scale`` times the exact gradient straight into
    ``.grad`` of trainable parameters (frozen ones stay untouched) and return the loss."""
    batch = prepare(model, tokens, targets, chunk_size, ignore_index)
    tensors = [p for _, p in trainable(model)]
    loss = _seco_into_grad(model, batch, tensors, scale)
    for p in tensors:
        if p.grad is None:  # unreachable from the loss: its gradient is zero
            p.grad = torch.zeros_like(p)
    return loss
