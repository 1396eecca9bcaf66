"""A tiny Llama-style causal transformer that runs chunk by chunk.

Token embedding -> L x [RMSNorm -> attention (RoPE at *global* positions,
grouped KV heads) -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm
-> output head.  Small enough to run thousands of times on a CPU in float64,
and built from ``nn.Linear`` so LoRA libraries can target its projections.

It implements :class:`seco_lab.core.protocol.ChunkModel`: ``chunk_forward`` takes the
previous chunks' caches and the chunk's global start position and returns the
chunk's summed loss and its own keys/values (keys already rotated, as in HF).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import parse_device
from ..core.checks import check_seed, host_memory_bytes
from ..core.protocol import ChunkCache, ChunkOutput
from .tiny_config import TinyConfig

__all__ = ["RMSNorm", "SwiGLU", "TinyConfig", "TinyTransformer", "rotary"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) by angle pos * theta^(-2i/h), pos = start + offset.

    Positions and angles are computed in float64 whatever the activations' dtype (bfloat16 holds
    only 8 significant bits: positions 1000, 1001, 1002 would coincide) and cast at the end.
    """
    t, h = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, h, 2, dtype=torch.float64, device=x.device) / h)
    pos = torch.arange(start, start + t, dtype=torch.float64, device=x.device)
    ang = torch.outer(pos, inv_freq)  # (t, h/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)

    def forward(self, x, past_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int):
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        q = self.q_proj(x).view(b, t, cfg.n_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
        q, k = rotary(q, start, cfg.rope_theta), rotary(k, start, cfg.rope_theta)
        keys = torch.cat([pk for pk, _ in past_kv] + [k], dim=2)
        values = torch.cat([pv for _, pv in past_kv] + [v], dim=2)
        n_past = keys.shape[2] - t
        # Query i of this chunk sits at global position start+i and sees every past key plus keys
        # 0..i of its own chunk; without a past that is plain causal attention (no mask to build).
        if n_past:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = torch.cat([torch.ones(t, n_past, dtype=torch.bool, device=x.device), causal], dim=1)
        else:
            mask = None
        # the fused kernel users run (grouped KV heads natively; the math path is exact in float64)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None and t > 1,
            dropout_p=cfg.dropout if self.training else 0.0, enable_gqa=cfg.n_heads != cfg.n_kv_heads,
        )
        out = out.transpose(1, 2).reshape(b, t, cfg.n_heads * hd)
        return self.o_proj(out), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, past_kv, start):
        a, kv = self.attn(self.attn_norm(x), past_kv, start)
        x = x + self.drop(a)
        x = x + self.drop(self.mlp(self.mlp_norm(x)))
        return x, kv


def _check_fits(config: TinyConfig, dtype: torch.dtype) -> None:
    """Refuse, before allocating, weights larger than this machine's memory (built in float32, then cast): torch's
    allocator would otherwise fail deep inside ``nn.Embedding`` (campaign 28, A68)."""
    need = config.num_parameters * max(4, dtype.itemsize)
    have = host_memory_bytes()
    if have is not None and need > have:
        raise MemoryError(f"a TinyTransformer of {config.num_parameters:,} parameters needs {need / 2**30:,.1f} GiB "
                          f"for its weights alone, more than this machine's {have / 2**30:.1f} GiB: lower vocab_size, "
                          "d_model, d_ff or n_layers")


class TinyTransformer(nn.Module):
    """Llama-style decoder implementing the chunk-model protocol.

    ``TinyTransformer(config, seed=0, dtype=torch.float64)`` initialises every
    weight from ``torch.Generator().manual_seed(seed)``: linear weights
    ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm gains 1.
    """

    def __init__(self, config: TinyConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if not isinstance(config, TinyConfig):
            raise TypeError(f"config must be a TinyConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
        if device is not None:
            device = parse_device(str(device))
        check_seed(seed)
        _check_fits(config, dtype)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.checkpoint_layers = False  # set True for layer-wise torch.utils.checkpoint
        self.reset_parameters(seed)
        self.to(device=device, dtype=dtype)

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def deterministic(self) -> bool:
        """False when dropout is active: a chunk rebuild would then differ from its first pass."""
        return not (self.training and self.config.dropout > 0)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(check_seed(seed))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))

    def logits_from_hidden(self, h):
        h = self.norm(h)
        return h @ self.embed.weight.T if self.lm_head is None else self.lm_head(h)

    def chunk_hidden(self, tokens, past: Sequence[ChunkCache], start: int):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got range "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        x = self.embed(tokens)
        cache = []
        for layer, block in enumerate(self.blocks):
            past_kv = [c[layer] for c in past]
            if self.checkpoint_layers and torch.is_grad_enabled():
                # layer-wise activation checkpointing: the baseline SeCO is compared against
                x, kv = checkpoint(block, x, past_kv, start, use_reentrant=False)
            else:
                x, kv = block(x, past_kv, start)
            cache.append(kv)
        return x, tuple(cache)

    def chunk_forward(self, tokens, targets, past: Sequence[ChunkCache] = (), start: int = 0, ignore_index: int = -100):
        h, cache = self.chunk_hidden(tokens, past, start)
        if targets is None:
            loss = h.new_zeros(())
        else:
            logits = self.logits_from_hidden(h)
            if logits.dtype in (torch.float16, torch.bfloat16):  # a 16-bit sum of token losses is ~1% off
                logits = logits.float()  # (campaign 42): from float32 logits, as HFChunkModel and transformers
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
            )
        return ChunkOutput(loss, cache)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits (B, T, V): the ordinary, non-chunked forward."""
        h, _ = self.chunk_hidden(tokens, (), 0)
        return self.logits_from_hidden(h)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
