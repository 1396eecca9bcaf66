"""The chunk-wise KV cache and the chunk attention kernel behind :class:`seco_lab.models.hf.HFChunkModel`.

Chunk j of a sequence attends to the keys/values of chunks 0..j-1 (the *prefix*,
held by the engine as separate per-chunk leaf tensors, P positions) and causally
to its own c.  With ``s = q k^T * scaling``, the attention of query i is split
into the prefix part and the own part and merged by their log-sum-exps
(as flash-decoding does):

    L_p = logsumexp_{k < P} s_k,   O_p = softmax_{k < P}(s) V_p
    L_o = logsumexp_{P <= k <= P + i} s_k,   O_o = causal softmax over the own keys
    L = logaddexp(L_p, L_o),   O = e^{L_p - L} O_p + e^{L_o - L} O_o.

The backward needs no gradient of L_p, L_o: with the merged O and L, the
attention backward of each part (P_k = e^{s_k - L}, D = rowsum(dO * O),
dS = P (dP - D)) yields exactly that part's share of dq and its own dK, dV, so
dq = dq_p + dq_o (:class:`SplitPrefixAttention`).

* :class:`PrefixCache` is a transformers ``Cache`` (public ``CacheLayerMixin``
  interface) built from the prefix leaves.  With ``split=True`` a layer's
  ``update`` returns the chunk's own keys/values tagged with the prefix leaves
  (:class:`PrefixedKV`), and the prefix is never concatenated with the own part;
  otherwise it returns ``[prefix leaves..., own]`` (one concatenation).  Either way
  it records the chunk's own keys/values -- the tensors the model produced -- so
  the chunk's cache output is an owned tensor of its c positions.
* ``seco_sdpa`` (registered through ``AttentionInterface`` and
  ``AttentionMaskInterface``) computes the same attention as transformers'
  ``sdpa``.  For the chunk pattern -- query i at position P+i attends keys
  0..P+i, no padding -- the mask function returns a marker (:class:`ChunkCausal`),
  not a dense mask.  On CPU the split attention above runs on PyTorch's flash
  attention kernels: the prefix part with the query heads that share a key/value
  head grouped into one query block, ``(B, H, c, d) -> (B, H_kv, (H/H_kv) c, d)``
  (keys/values never repeated), the own part causal.  The prefix keys/values are
  concatenated into one transient tensor per layer in forward and again in
  backward (nothing of size P is saved for backward), and its gradient is handed
  to the leaves as views.  Elsewhere the chunk pattern uses one grouped additive
  mask ``(1, 1, (H/H_kv) c, P + c)`` per forward.  Every other pattern (full
  sequence, padding, generation) goes to transformers' own ``sdpa`` unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

__all__ = ["CHUNK_ATTENTION", "ChunkCausal", "KVBuffer", "PrefixCache", "PrefixLayer", "PrefixedKV",
           "SplitPrefixAttention", "adjacent_view", "chunk_sdpa_attention", "chunk_sdpa_mask", "register",
           "split_attention_available"]

CHUNK_ATTENTION = "seco_sdpa"
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def split_attention_available(device: torch.device | str) -> bool:
    """Whether the split prefix/own attention runs on ``device`` (PyTorch's CPU flash attention kernels)."""
    return torch.device(device).type == "cpu" and _FLASH is not None and _FLASH_BACKWARD is not None


class PrefixedKV(torch.Tensor):
    """The running chunk's own keys (or values), ``(B, H_kv, c, d)``, with ``.prefix``: the prefix leaves."""

    prefix: list[torch.Tensor]

    def materialize(self) -> torch.Tensor:
        """``[prefix..., own]`` along the sequence axis (for attention paths that need it whole)."""
        return torch.cat([*self.prefix, self.as_subclass(torch.Tensor)], dim=-2)


def _prefixed(own: torch.Tensor, prefix: list[torch.Tensor]) -> PrefixedKV:
    out = own.as_subclass(PrefixedKV)
    out.prefix = prefix
    return out


class KVBuffer:
    """One sequence's keys/values, per layer one (B, length, H_kv, d) buffer of each, filled chunk by chunk.

    A chunk forward without a graph (pass 1) stores its keys/values at their positions and returns
    views of them as its cache, so the leaves of consecutive chunks are adjacent in memory and a later
    chunk reads its whole prefix as one strided view (no copy).  The buffer holds the KV cache once: it
    is the leaves' storage, nothing more."""

    def __init__(self, n_layers: int, batch_size: int, length: int):
        self.batch_size, self.length = batch_size, length
        self.buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers

    def store(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Views of ``keys``/``values`` (B, H_kv, c, d) written at ``start``; None where they do not fit."""
        b, kv_heads, c, d = keys.shape
        if torch.is_grad_enabled() or b != self.batch_size or start + c > self.length or values.shape != keys.shape:
            return None
        if self.buffers[layer] is None:
            self.buffers[layer] = tuple(torch.empty(b, self.length, kv_heads, d, dtype=keys.dtype, device=keys.device)
                                        for _ in range(2))
        views = []
        for buf, x in zip(self.buffers[layer], (keys, values)):
            if buf.shape[2:] != (kv_heads, d) or buf.dtype != x.dtype or buf.device != x.device:
                return None
            views.append(buf[:, start:start + c].copy_(x.transpose(1, 2)).transpose(1, 2))
        return tuple(views)


class PrefixLayer(CacheLayerMixin):
    """One layer's cache: the prefix chunks' keys/values, extended once by the running chunk."""

    is_sliding = False

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], split: bool = False,
                 store=None):
        super().__init__()
        self.prefix_keys, self.prefix_values = list(keys), list(values)
        self.length = sum(k.shape[-2] for k in self.prefix_keys)
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None
        self.split, self.store = split, store
        self.is_initialized = bool(self.prefix_keys)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """The own keys/values tagged with the prefix (``split``), else ``[prefix, own]``; keeps the own part."""
        if self.own is not None:
            raise RuntimeError("a PrefixCache serves exactly one chunk forward; build a new one for the next chunk")
        stored = self.store(self.length, key_states, value_states) if self.store is not None else None
        if stored is not None:
            key_states, value_states = stored
        self.own = (key_states, value_states)
        self.is_initialized = True
        self.length += key_states.shape[-2]
        if not self.prefix_keys:
            return key_states, value_states
        if self.split:
            return _prefixed(key_states, self.prefix_keys), _prefixed(value_states, self.prefix_values)
        return (torch.cat([*self.prefix_keys, key_states], dim=-2),
                torch.cat([*self.prefix_values, value_states], dim=-2))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class PrefixCache(Cache):
    """``Cache`` of one chunk forward: ``layers[l]`` holds the prefix leaves of layer l.

    ``split=True`` (for ``seco_sdpa`` only) hands the attention the own keys/values and the
    prefix leaves separately (:class:`PrefixedKV`) instead of their concatenation."""

    def __init__(self, past: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], n_layers: int,
                 split: bool = False, buffer: KVBuffer | None = None):
        stores = [None] * n_layers if buffer is None else [partial(buffer.store, l) for l in range(n_layers)]
        layers = [PrefixLayer([c[l][0] for c in past], [c[l][1] for c in past], split, stores[l])
                  for l in range(n_layers)]
        super().__init__(layers=layers)

    def own(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The running chunk's keys/values per layer, as the model produced them."""
        if any(layer.own is None for layer in self.layers):
            raise RuntimeError("the model did not update every cache layer; is it a decoder with full attention?")
        return tuple(layer.own for layer in self.layers)


# ----------------------------------------------------------------------------- attention


class ChunkCausal(torch.Tensor):
    """Marker (an empty tensor) for the chunk pattern: queries at P..P+c-1 attend keys 0..P+i, no padding.

    ``grouped_mask(rep)`` is the additive mask of that pattern for grouped query heads,
    ``(1, 1, rep * c, P + c)``, built on first use and shared by every layer of the forward."""

    q_length: int
    kv_length: int
    mask_dtype: torch.dtype
    _grouped: dict

    def grouped_mask(self, rep: int) -> torch.Tensor:
        if rep not in self._grouped:
            prefix = self.kv_length - self.q_length
            blocked = (torch.arange(self.q_length, device=self.device)[:, None] + prefix
                       < torch.arange(self.kv_length, device=self.device))
            mask = torch.zeros(self.q_length, self.kv_length, dtype=self.mask_dtype, device=self.device)
            self._grouped[rep] = mask.masked_fill_(blocked, float("-inf")).repeat(rep, 1)[None, None]
        return self._grouped[rep]


def chunk_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip: bool = True,
                    dtype: torch.dtype = torch.float32, config=None, device="cpu", **kwargs):
    """A :class:`ChunkCausal` marker for the chunk pattern; transformers' ``sdpa_mask`` for every other pattern."""
    plain_causal = (mask_function is causal_mask_function and kv_offset == 0 and q_offset == kv_length - q_length
                    and (attention_mask is None or bool(attention_mask.all())))
    if plain_causal and 1 < q_length < kv_length:
        marker = torch.empty(0, device=device).as_subclass(ChunkCausal)
        marker.q_length, marker.kv_length, marker.mask_dtype, marker._grouped = q_length, kv_length, dtype, {}
        return marker
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, dtype=dtype, config=config, device=device, **kwargs)


def adjacent_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``cat(parts, dim=-2)`` of (B, H_kv, c_i, d) tensors as a view, when each part starts in memory where the
    one before ends along the sequence axis (chunks stored in one :class:`KVBuffer`); else None."""
    first = parts[0]
    if first.dim() != 4:
        return None
    stride, step = first.stride(), first.stride(2)
    offset = first.storage_offset() + first.shape[2] * step
    for p in parts[1:]:
        if (p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.stride() != stride
                or p.storage_offset() != offset or p.shape[:2] != first.shape[:2] or p.shape[3] != first.shape[3]):
            return None
        offset += p.shape[2] * step
    size = (*first.shape[:2], sum(p.shape[2] for p in parts), first.shape[3])
    return first.as_strided(size, stride, first.storage_offset())


def _seq_cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``cat(parts, dim=-2)`` of (B, H_kv, c_i, d) tensors: a view when they are adjacent in memory, else a
    copy laid out as (B, sum c_i, H_kv, d) (the layout of the projections the parts come from, and of the
    kernel's key/value gradients)."""
    if len(parts) == 1:
        return parts[0]
    view = adjacent_view(parts)
    if view is not None:
        return view
    return torch.cat([p.transpose(1, 2) for p in parts], dim=1).transpose(1, 2)


def _per_head(x: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, H_kv, c, d) -> (B, H_kv * rep, c, d), each key/value head repeated for its query heads."""
    return x if rep == 1 else x.repeat_interleave(rep, 1)


class SplitPrefixAttention(torch.autograd.Function):
    """softmax(q [K_p, K_o]^T * scale + causal mask) [V_p, V_o], merged from a prefix and an own part.

    ``apply(scale, n_prefix, q, k_own, v_own, *prefix_keys, *prefix_values)`` with q (B, H, c, d), own
    keys/values (B, H_kv, c, d) and ``n_prefix`` prefix leaves of each (B, H_kv, c_i, d); returns (B, H, c, d).
    Saved for backward: q, the own keys/values, the output and its log-sum-exp (all of c positions) and
    the leaves themselves.  The prefix is read as one view of the leaves when they are adjacent in memory
    (a :class:`KVBuffer`), else concatenated, transiently, in forward and again in backward.
    """

    @staticmethod
    def forward(scale, n_prefix, q, k_own, v_own, *prefix):
        b, heads, c, d = q.shape
        kv_heads = k_own.shape[1]
        rep = heads // kv_heads
        k_pre, v_pre = _seq_cat(prefix[:n_prefix]), _seq_cat(prefix[n_prefix:])
        out_p, lse_p = _FLASH(q.reshape(b, kv_heads, rep * c, d), k_pre, v_pre, 0.0, False, scale=scale)
        del k_pre, v_pre
        out_o, lse_o = _FLASH(q, _per_head(k_own, rep), _per_head(v_own, rep), 0.0, True, scale=scale)
        lse_p = lse_p.reshape(b, heads, c)
        lse = torch.logaddexp(lse_p, lse_o)
        out = out_p.reshape(b, heads, c, d) * (lse_p - lse).exp_().unsqueeze(-1).to(out_p.dtype)
        out.addcmul_(out_o, (lse_o - lse).exp_().unsqueeze(-1).to(out_o.dtype))
        return out, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        scale, n_prefix, q, k_own, v_own, *prefix = inputs
        out, lse = output
        ctx.scale, ctx.n_prefix = scale, n_prefix
        ctx.save_for_backward(q, k_own, v_own, out, lse, *prefix)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k_own, v_own, out, lse, *prefix = ctx.saved_tensors
        n, scale = ctx.n_prefix, ctx.scale
        b, heads, c, d = q.shape
        kv_heads = k_own.shape[1]
        rep = heads // kv_heads
        grad_out = grad_out.contiguous()
        k_pre, v_pre = _seq_cat(prefix[:n]), _seq_cat(prefix[n:])
        grouped = (b, kv_heads, rep * c, d)
        dq_p, dk_pre, dv_pre = _FLASH_BACKWARD(grad_out.reshape(grouped), q.reshape(grouped), k_pre, v_pre,
                                               out.reshape(grouped), lse.reshape(b, kv_heads, rep * c), 0.0, False,
                                               scale=scale)
        del k_pre, v_pre
        dq, dk_own, dv_own = _FLASH_BACKWARD(grad_out, q, _per_head(k_own, rep), _per_head(v_own, rep), out, lse,
                                             0.0, True, scale=scale)
        dq = dq.add_(dq_p.reshape(b, heads, c, d))
        if rep > 1:
            dk_own, dv_own = (g.reshape(b, kv_heads, rep, c, d).sum(2) for g in (dk_own, dv_own))
        sizes = [p.shape[-2] for p in prefix[:n]]
        return (None, None, dq, dk_own, dv_own, *dk_pre.split(sizes, dim=-2), *dv_pre.split(sizes, dim=-2))


def _split_applies(query, key, value, attention_mask, dropout) -> bool:
    return (isinstance(key, PrefixedKV) and isinstance(value, PrefixedKV) and isinstance(attention_mask, ChunkCausal)
            and not dropout and split_attention_available(query.device) and query.shape[2] == key.shape[2]
            and query.shape[1] % key.shape[1] == 0 and query.dtype == key.dtype
            # the custom kernel gets no autocast: mixed precision (a bf16 chunk over a float32 prefix) takes the
            # fallback, whose scaled_dot_product_attention autocast casts
            and not torch.is_autocast_enabled(query.device.type)
            and all(p.dtype == query.dtype for p in (*key.prefix, *value.prefix)))


def chunk_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """softmax(q k^T * scaling + mask) v: split prefix/own on CPU, else grouped query heads (no K/V repeat)."""
    if _split_applies(query, key, value, attention_mask, dropout):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        own_k, own_v = key.as_subclass(torch.Tensor), value.as_subclass(torch.Tensor)
        out, _ = SplitPrefixAttention.apply(scale, len(key.prefix), query, own_k, own_v, *key.prefix, *value.prefix)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(key, PrefixedKV):
        key, value = key.materialize(), value.materialize()
    if not isinstance(attention_mask, ChunkCausal):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(b, kv_heads, (heads // kv_heads) * q_len, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask.grouped_mask(heads // kv_heads), dropout_p=dropout,
        scale=scaling)
    return out.reshape(b, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation='seco_sdpa'`` available to every transformers model (idempotent)."""
    AttentionInterface.register(CHUNK_ATTENTION, chunk_sdpa_attention)
    AttentionMaskInterface.register(CHUNK_ATTENTION, chunk_sdpa_mask)
