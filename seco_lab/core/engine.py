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
from collections.abc import Callable, Collection, Hashable, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from .checks import (
    PASS1_LOGITS_BYTES,
    ChunkedBatch,
    as_float,
    check_recomputed,
    checked_batch,
    checked_chunk,
    computed_dtype,
    recompute_mode,
)
from .chunk_vjp import add_relayed, chunk_products, summed_seed
from .chunk_vjp import add_relayed as _add_relayed  # noqa: F401 (the names before seco_lab.core.chunk_vjp)
from .chunk_vjp import chunk_products as _products  # noqa: F401
from .chunk_vjp import seed_vjp as _seed_vjp  # noqa: F401
from .chunk_vjp import summed_seed as _summed  # noqa: F401
from .chunk_vjp import vjp as _vjp  # noqa: F401
from .grads import GradDict, float16_seed_scale, float32_accumulation, grads_in_isolation, named_grads
from .protocol import ChunkCache, ChunkModel, flat_cache, unflat_cache

__all__ = ["ChunkedBatch", "accumulate_into", "backward_sweep", "cache_leaves", "checked_batch", "dense_grad",
           "forward_loss", "hop_relay", "hop_sweep", "pass1_span", "relay_sweep", "require_autograd", "seco_grad",
           "seco_step", "trainable"]

Relay = Callable[[Hashable, int, int], "tuple[Hashable, float] | None"]
Collect = Callable[[Hashable, int, Sequence[torch.Tensor]], None]
prepare = checked_batch  # the name before checks.checked_batch; for code written against it


def require_autograd(what: str) -> None:
    """Refuse a gradient computation under ``torch.inference_mode()``.  There no graph is recorded and
    ``torch.enable_grad()`` cannot turn it back on, so the sweeps would find no graph to backpropagate and
    return the right loss with an all-zero gradient.  ``torch.no_grad()`` is fine: the engine turns gradients
    on where it builds a graph (the chunk rebuilds), and pass 1 runs without one anyway."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{what} computes gradients with autograd, but it was called under "
                           "torch.inference_mode(), where autograd records nothing and every gradient would come "
                           f"out zero: call {what} outside the inference_mode block (torch.no_grad() is fine; "
                           "for the loss alone use forward_loss, which works in inference mode)")


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("no parameter of the model requires grad (all frozen), so there is no gradient to compute: "
                         "unfreeze the ones to differentiate (p.requires_grad_(True), or model.requires_grad_() "
                         "for all)")
    return params


@torch.no_grad()
def cache_leaves(model: ChunkModel, batch: ChunkedBatch, with_loss: bool = True, include_last: bool = True,
                 keep: Collection[int] = (), kept: dict | None = None) -> tuple[list[ChunkCache], torch.Tensor | None]:
    """Pass 1: forward every chunk without a graph; return the caches as leaves and the mean loss.

    ``with_loss=False`` passes no targets (a model may then skip its output head, e.g. the
    LM head over a large vocabulary) and returns ``None`` for the loss: for engines whose
    pass 2 rebuilds every chunk and sums the loss there (SeCO).  ``include_last=False`` (only
    with ``with_loss=False``) also skips the last chunk, whose cache no chunk reads: k - 1 leaves.

    ``keep`` (with a dict ``kept``): chunks forwarded *with* a graph, alone, whose outputs go to
    ``kept[j]``; pass 2 backpropagates them as they are instead of rebuilding them (:func:`relay_sweep`,
    :func:`backward_sweep`), which saves a chunk forward each at the price of holding their activations
    from pass 1 to pass 2.  Their leaves are their own keys/values, detached (a model with
    ``stored_cache`` puts them in its cache buffer), so what later chunks read is unchanged.
    """
    if with_loss and not include_last:
        raise ValueError("include_last=False needs with_loss=False: the last chunk's loss comes from its forward")
    keep = sorted(set(int(j) for j in keep))
    if keep and kept is None:
        raise ValueError("cache_leaves: keep needs a dict `kept` to hand the kept chunk outputs back in")
    leaves: list[ChunkCache] = []
    total = 0.0
    n_chunks = batch.num_chunks if include_last else batch.num_chunks - 1
    if keep and not 0 <= keep[0] <= keep[-1] < n_chunks:
        raise ValueError(f"cache_leaves: keep must name chunks 0..{n_chunks - 1}, got {keep}")
    span = pass1_span(model, batch.chunk_size, with_loss, batch.tokens.shape[0])
    # a model may keep the leaves in one buffer (so a chunk reads its prefix without copying it)
    buffer = getattr(model, "cache_buffer", None)
    end = min(n_chunks * batch.chunk_size, batch.length)
    with buffer(batch.tokens.shape[0], end) if callable(buffer) and end > 0 else nullcontext():
        for j, m in _pass1_pieces(n_chunks, span, keep):
            tok, tgt, start = batch.span(j, m)
            if j in keep:  # with a graph, handed to pass 2
                with torch.enable_grad():
                    out = checked_chunk(model.chunk_forward(tok, tgt if with_loss else None, leaves, start,
                                                            batch.ignore_index), j)
                kept[j] = out
                total = total + out.loss_sum.detach()
                store = getattr(model, "stored_cache", None)
                cache = store(out.cache, start) if callable(store) else out.cache
                leaves.append(unflat_cache([_own_version(t).requires_grad_(True) for t in flat_cache(cache)]))
                continue
            out = checked_chunk(model.chunk_forward(tok, tgt if with_loss else None, leaves, start,
                                                    batch.ignore_index), j if m == 1 else f"{j}..{j + m - 1}")
            total = total + out.loss_sum
            sizes = batch.chunk_lengths(j, m)
            parts = [_split_span(model, t.detach(), sizes) if m > 1 else (t.detach(),) for t in flat_cache(out.cache)]
            leaf = _own_version if keep else torch.Tensor.detach
            leaves += [unflat_cache([leaf(p[i]).requires_grad_(True) for p in parts]) for i in range(m)]
    return leaves, total / batch.n_targets if with_loss else None


def _own_version(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data (same storage, no copy) as a tensor with a version counter of its own.  A leaf that is a
    view of a cache buffer shares the buffer's counter, which every later chunk's write bumps; a graph kept from
    pass 1 saved the leaves it read and would refuse them as modified (they are not: the writes go elsewhere)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _pass1_pieces(n_chunks: int, span: int, keep: Sequence[int]) -> list[tuple[int, int]]:
    """Pass 1's forwards as (first chunk, chunks): spans of up to ``span`` chunks, each kept chunk alone."""
    pieces, j, stops = [], 0, list(keep) + [n_chunks]
    for stop in stops:
        while j < stop:
            m = min(span, stop - j)
            pieces.append((j, m))
            j += m
        if stop < n_chunks:
            pieces.append((stop, 1))
            j = stop + 1
    return pieces


def _split_span(model: ChunkModel, t: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """A span's cache tensor split into its chunks' along ``model.cache_seq_dim``, which must hold the span's
    tokens (another axis of the same length would give wrong leaves)."""
    axis = model.cache_seq_dim
    if not -t.dim() <= axis < t.dim() or t.shape[axis] != sum(sizes):
        raise ValueError(f"{type(model).__name__}.cache_seq_dim = {axis} is not the sequence axis of its cache "
                         f"tensors (shape {tuple(t.shape)}, {sum(sizes)} tokens in this span); set it to that axis, "
                         "or pass1_tokens = None to run pass 1 chunk by chunk")
    return t.split(list(sizes), dim=axis)


def pass1_span(model: ChunkModel, chunk_size: int, with_loss: bool = False, batch_size: int = 1) -> int:
    """How many chunks pass 1 forwards at once: ``model.pass1_tokens // chunk_size`` (at least 1) for a model
    that declares both ``pass1_tokens`` and ``cache_seq_dim`` (the sequence axis of its cache tensors, along
    which a span's cache is split into its chunks' leaves); 1 for any other.  Pass 1 keeps no graph, so its
    chunking is free: one forward over m chunks gives each chunk's keys/values up to rounding, with larger
    matrix products and m times fewer passes through the layers' Python (at 64-token chunks on SmolLM2's
    shape, pass 1 costs 8.8 s chunk by chunk and ~5.5 s in spans of 512 tokens, single-threaded).

    With a loss (``with_loss``) the span's logits, m c x batch x vocabulary (counted at 4 bytes or the
    parameters' width, whichever is larger), are kept under :data:`~seco_lab.core.checks.PASS1_LOGITS_BYTES`
    or one chunk's, whichever is larger: a small chunk size chosen to bound memory keeps bounding it.

    A model computing in 16-bit floats (its weights', or autocast's) runs pass 1 chunk by chunk while rebuilt chunks
    are compared by value (:func:`~seco_lab.core.checks.recompute_mode` "values"): a span's keys/values round 1-3%
    apart from a chunk's in bfloat16 (SmolLM2's shape), which would hide noise of that size; chunk by chunk the rebuild
    reproduces pass 1 exactly (0 measured, 4 and 30 layers, bfloat16 and float16) and the allowance is eps."""
    tokens, axis = getattr(model, "pass1_tokens", None), getattr(model, "cache_seq_dim", None)
    if tokens is None or tokens == 0 or axis is None:
        return 1
    bits = torch.finfo(computed_dtype(next(iter(model.parameters())))).bits
    if bits <= 16 and recompute_mode() in ("values", "checksum"):
        return 1  # 16-bit: a span rounds 1-3% apart from a chunk (campaign 40 D2); chunk by chunk the rebuild is exact
    name = type(model).__name__
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
        raise ValueError(f"{name}.pass1_tokens must be a whole number of tokens >= 0 (0 or None: pass 1 chunk by "
                         f"chunk), got {tokens!r}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ValueError(f"{name}.cache_seq_dim must be the integer axis of the cache tensors that runs along the "
                         f"sequence (e.g. -2 for (batch, heads, tokens, dim)), got {axis!r}")
    span = max(1, int(tokens) // chunk_size)
    if with_loss:
        vocab = getattr(model, "vocab_size", None)
        if not vocab:
            return 1
        width = max(4, next(iter(model.parameters())).element_size())
        span = min(span, max(1, PASS1_LOGITS_BYTES // (chunk_size * batch_size * int(vocab) * width)))
    return span


def hop_relay(max_hops: int, factors=None, lump: bool = False) -> Relay:
    """The relay of the hop strata: a gradient in stratum q moves to stratum q + 1 of the earlier chunk, times
    ``factors[q + 1]`` (1 without factors); strata above ``max_hops`` are dropped, or with ``lump`` (no
    factors) gathered in one more stratum ``max_hops + 1`` = every chain of more than P hops, g(>P), which
    relays into itself.  Lumping measures g(>P) directly: as g - sum_p g(p) it would be a difference of
    nearly equal vectors, whose float32 rounding (~1e-7 ||g||) a scheme's weight on deep chains (16^9 at
    k/t = 16) would turn into a fake variance."""
    if lump:
        if factors is not None:
            raise ValueError("hop_relay: lump gathers unweighted strata; it takes no factors")
        return lambda q, j, i: (min(q + 1, max_hops + 1), 1.0)
    if factors is None:
        return lambda q, j, i: (q + 1, 1.0) if q + 1 <= max_hops else None
    factors = [float(f) for f in factors]
    return lambda q, j, i: (q + 1, factors[q + 1]) if q + 1 <= max_hops else None


def hop_sweep(model: ChunkModel, batch: ChunkedBatch, leaves: Sequence[ChunkCache], params: Sequence[torch.Tensor],
              visit: Sequence[int], max_hops: int, collect: Collect, factors=None, collect_total: bool = False,
              lump: bool = False, kept: dict | None = None) -> None:
    """The stratified pass: chunk j's loss seeds stratum 0 (times ``factors[0]``), and what a chunk receives in
    stratum q reaches stratum q + 1 of the earlier visited chunks (:func:`hop_relay`); ``collect(q, j, grads)``
    gets each stratum's parameter gradient (the sum over strata with ``collect_total``; with ``lump`` also
    q = max_hops + 1, the chains of more hops, see :func:`hop_relay`).  The hop strata
    (factors = 1), their Monte Carlo and the hop-dependent SpaCO schemes (factors = c_q) all run on it."""
    backward_sweep(model, batch, leaves, params, visit, direct_label=lambda j: 0,
                   direct_scale=1.0 if factors is None else float(factors[0]), relay=hop_relay(max_hops, factors, lump),
                   collect=collect, collect_total=collect_total, kept=kept)


def forward_loss(model: ChunkModel, tokens, targets, chunk_size: int | None = None,
                 ignore_index: int = -100) -> torch.Tensor:
    """Mean token loss sum_j J_j / N, chunk by chunk without a graph (any length, no activations kept)."""
    return cache_leaves(model, checked_batch(model, tokens, targets, chunk_size, ignore_index))[1]




def backward_sweep(model: ChunkModel, batch: ChunkedBatch, leaves: Sequence[ChunkCache], params: Sequence[torch.Tensor],
                   visit: Sequence[int], *, direct_label: Callable[[int], Hashable], direct_scale: float, relay: Relay,
                   collect: Collect, collect_total: bool = False, batch_labels: bool | None = None,
                   kept: dict | None = None) -> None:
    """Pass 2, generalised.  Visits ``visit`` in decreasing order; at chunk j backprops

        direct_scale * J_j / N  (under label direct_label(j))
        + sum_labels <m_j, G_j[label]>

    with one vector-Jacobian product per distinct label.  ``batch_labels=True`` runs a chunk's labels as
    one batched product (``is_grads_batched``: fast where every operator has a vmap batching rule, as in
    the tiny transformer); ``False`` runs one product per label, each touching only the outputs its
    seed reaches (no LM head for a relayed label, no cache layer nothing reached), which is faster where
    vmap would fall back to a loop anyway (transformers' attention kernels).  The default is the model's
    ``batched_backward`` attribute (True when absent).
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
    ``kept``: chunk outputs pass 1 built with a graph (:func:`cache_leaves` ``keep``), used instead of
    rebuilding those chunks (and removed from the dict once backpropagated).
    """
    require_autograd("backward_sweep")
    order = sorted(set(int(j) for j in visit), reverse=True)
    constant = _constant_relay(order, direct_label, relay)
    if constant is not None:
        _collected_relay_sweep(model, batch, leaves, params, order, direct_scale, constant, collect, kept)
        return
    visited = set(order)
    buffers: dict[int, dict[Hashable, list[torch.Tensor | None]]] = defaultdict(dict)
    params = list(params)
    if batch_labels is None:
        batch_labels = getattr(model, "batched_backward", True)
    fused = bool(getattr(model, "fused_products", False))  # sharded models (seco_lab.training.sharding.GatheredView)
    for j in order:
        sources = [i for i in range(j) if i in visited]
        src_leaves = [t for i in sources for t in flat_cache(leaves[i])]
        out, outputs = _rebuild_chunk(model, batch, leaves, j, kept)
        seeds = _chunk_seeds(direct_label(j), direct_scale / batch.n_targets, buffers.pop(j, {}))
        relayed = [lab for lab in seeds if any(relay(lab, j, i) is not None for i in sources)]
        jobs = _chunk_jobs(seeds, relayed, collect_total)
        for lab, _, want_params, want_leaves, grads in chunk_products(outputs, jobs, params, src_leaves,
                                                                      batch_labels, fused):
            if want_params:
                collect(lab, j, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
            if want_leaves:
                _relay_to_earlier(buffers, relay, lab, j, sources, leaves, grads[len(params) if want_params else 0:])
            del grads
        del out, outputs


def _collected_relay_sweep(model: ChunkModel, batch: ChunkedBatch, leaves: Sequence[ChunkCache],
                           params: Sequence[torch.Tensor], order: Sequence[int], direct_scale: float,
                           constant: tuple[Hashable, float], collect: Collect, kept: dict | None = None) -> None:
    """A sweep with one label and one factor (:func:`_constant_relay`) as :func:`relay_sweep`, its parameter
    gradients (summed over chunks) handed to ``collect(label, None, grads)``."""
    label, factor = constant
    _, grads = grads_in_isolation(params, lambda: relay_sweep(
        model, batch, leaves, params, order, direct_scale=direct_scale, relay_factor=factor, kept=kept))
    collect(label, None, grads)


def _rebuild_chunk(model: ChunkModel, batch: ChunkedBatch, leaves: Sequence[ChunkCache], j: int,
                   kept: dict | None = None):
    """Chunk j rebuilt with a graph from the earlier leaves, checked against its pass-1 cache (or, when pass 1
    kept its graph, ``kept.pop(j)``); returns the chunk's output and the tensors its products start from,
    [summed token loss] + its flat cache."""
    if kept and j in kept:
        out = kept.pop(j)
        return out, [out.loss_sum] + flat_cache(out.cache)
    tok, tgt, start = batch.chunk(j)
    with torch.enable_grad():
        out = checked_chunk(model.chunk_forward(tok, tgt, leaves[:j], start, batch.ignore_index), j)
    check_recomputed(flat_cache(leaves[j]) if j < len(leaves) else [], flat_cache(out.cache), j)
    return out, [out.loss_sum] + flat_cache(out.cache)


def _chunk_seeds(direct: Hashable, loss_coef: float, received: dict) -> dict[Hashable, list]:
    """One chunk's seeds, one per label, [loss coefficient, cache gradients]: the direct term (label ``direct``,
    coefficient ``loss_coef``) joins its label's relayed seed; ``received`` holds what later chunks relayed."""
    seeds: dict[Hashable, list] = {direct: [loss_coef, None]}
    for lab, g in received.items():
        seeds.setdefault(lab, [0.0, None])[1] = g
    return seeds


def _chunk_jobs(seeds: dict[Hashable, list], relayed: list, collect_total: bool) -> list[tuple]:
    """The chunk's products, (label, seed, wants parameter gradients, wants earlier-leaf gradients) each: one per
    label, or (``collect_total``) one per relayed label w.r.t. the earlier leaves and one of the summed seed
    w.r.t. the parameters (label None)."""
    if collect_total:
        return [(lab, seeds[lab], False, True) for lab in relayed] + [(None, summed_seed(seeds.values()), True, False)]
    return [(lab, seed, True, lab in relayed) for lab, seed in seeds.items()]


def _relay_to_earlier(buffers: dict, relay: Relay, label: Hashable, j: int, sources: Sequence[int],
                      leaves: Sequence[ChunkCache], leaf_grads: Sequence[torch.Tensor | None]) -> None:
    """Relay what label ``label``'s seed at chunk j put on the earlier leaves (``leaf_grads``, source by source)
    into their buffers: buffers[i][new_label] += factor * part, where relay(label, j, i) -> (new_label, factor);
    None drops it."""
    for pos, i in enumerate(sources):
        routed = relay(label, j, i)
        if routed is None:
            continue
        new_lab, factor = routed
        n_kv = len(flat_cache(leaves[i]))
        add_relayed(buffers[i], new_lab, leaf_grads[pos * n_kv:(pos + 1) * n_kv], factor)


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
    kept: dict | None = None,
) -> torch.Tensor:
    """Pass 2 with one relay buffer: at chunk j (decreasing over ``visit``) backprop

        direct_scale * J_j / N + relay_factor * <m_j, R_j>,   R_j = leaf m'_j's ``.grad``,

    with ``torch.autograd.backward(..., inputs=params + earlier visited leaves)``: parameter
    gradients accumulate in place into ``p.grad`` (added to what is there), and the
    relayed gradient into the earlier leaves' ``.grad`` -- the relay buffers, released
    once used.  A model with ``fused_grads(params)`` (a context; :class:`~seco_lab.models.hf.HFChunkModel`)
    has its layers add their weight gradients into ``.grad`` themselves, one in-place product per
    chunk instead of a product and an add (:mod:`seco_lab.models.fused_grads`).  A 16-bit parameter's chunk
    gradients are summed in float32 and rounded once at the end (:func:`~seco_lab.core.grads.float32_accumulation`);
    a float16 model's seeds are scaled up while they run (:func:`~seco_lab.core.grads.float16_seed_scale`).
    relay_factor = 1 is SeCO; a constant c_q = c is constant-relay SpaCO
    (each hop multiplies by c exactly once, when the buffer seeds its chunk).
    ``kept``: chunk outputs built with a graph in pass 1 (:func:`cache_leaves` ``keep``), backpropagated
    as they are instead of rebuilt (each removed from the dict once used).
    Returns the summed token loss of the visited chunks (detached).
    """
    require_autograd("relay_sweep")
    order = sorted(set(int(j) for j in visit), reverse=True)
    visited, params = set(order), list(params)
    loss_sum = 0.0
    # a chunk without a leaf (the last one, when pass 1 skipped it) relays nothing to itself
    own_leaves = [flat_cache(leaves[j]) if j < len(leaves) else [] for j in range(max(order, default=-1) + 1)]
    for j in order:
        for leaf in own_leaves[j]:
            leaf.grad = None
    fuse = getattr(model, "fused_grads", None)
    relays = [leaf for j in order for leaf in own_leaves[j]]  # 16-bit relay buffers summed in float32 too
    seed_scale = float16_seed_scale(params + relays, len(order))
    with float32_accumulation(params + relays, seed_scale), fuse(params) if fuse is not None else nullcontext():
        for j in order:
            loss_sum = loss_sum + _relay_chunk(model, batch, leaves, params, own_leaves[j], visited, j,
                                               direct_scale * seed_scale, relay_factor, kept)
    return loss_sum if isinstance(loss_sum, torch.Tensor) else torch.zeros(())


def _relay_chunk(model: ChunkModel, batch: ChunkedBatch, leaves: Sequence[ChunkCache], params: Sequence[torch.Tensor],
                 own: Sequence[torch.Tensor], visited: set[int], j: int, direct_scale: float,
                 relay_factor: float, kept: dict | None = None) -> torch.Tensor:
    """One chunk of :func:`relay_sweep`: rebuilt and checked (or taken from ``kept``), backpropagated; returns its
    summed token loss."""
    src = [t for i in range(j) if i in visited for t in flat_cache(leaves[i])]
    out, _ = _rebuild_chunk(model, batch, leaves, j, kept)  # checked before its backward: a NaN loss adds nothing
    outs, seeds = [out.loss_sum], [out.loss_sum.new_tensor(direct_scale / batch.n_targets)]
    for o, leaf in zip(flat_cache(out.cache), own):
        if leaf.grad is not None and o.requires_grad:
            outs.append(o)
            seeds.append(leaf.grad if relay_factor == 1.0 else leaf.grad.mul_(relay_factor))
    live = [(o, g) for o, g in zip(outs, seeds) if o.requires_grad]
    if live:
        torch.autograd.backward([o for o, _ in live], [g for _, g in live], inputs=list(params) + src)
    for leaf in own:
        leaf.grad = None
    return out.loss_sum.detach()


def dense_grad(model: ChunkModel, tokens, targets, ignore_index: int = -100) -> tuple[torch.Tensor, GradDict]:
    """Reference gradient: backprop through the whole sequence at once.

    Returns (loss, grads) with loss = sum of token losses / number of targets.
    """
    require_autograd("dense_grad")
    batch = checked_batch(model, tokens, targets, None, ignore_index)
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
    :func:`seco_lab.estimators.spaco.hop_strata` up to rounding (tested).
    """
    require_autograd("truncated_grad")
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
    require_autograd("seco_grad")
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    params = trainable(model)
    loss, grads = grads_in_isolation([p for _, p in params], lambda: _seco_into_grad(model, batch,
                                                                                      [p for _, p in params], 1.0))
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
    require_autograd("seco_step")
    scale = as_float(scale, "scale")  # NaN or inf would be written into every .grad
    batch = checked_batch(model, tokens, targets, chunk_size, ignore_index)
    tensors = [p for _, p in trainable(model)]
    loss = _seco_into_grad(model, batch, tensors, scale)
    for p in tensors:
        if p.grad is None:  # unreachable from the loss: its gradient is zero
            p.grad = torch.zeros_like(p)
    return loss
