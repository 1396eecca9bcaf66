"""An up-front estimate of a training run's host memory, so that a run that cannot fit is refused
with its cost before anything is created (instead of a MemoryError mid-run, or the OOM killer).

For the tiny transformer with P parameters of b bytes (b = 4 for float32), batch B, micro-batch
B/A, sequence n, chunk c, width d, L layers, KV width d_kv and vocabulary V:

    parameters, gradients, AdamW m and v:   4 P b
    one step's batch (int64 ids, targets):  3 B (n + 1) 8
    KV caches of every chunk:               2 L (B/A) n d_kv b
    one chunk's logits and their gradient:  3 max((B/A) c V b, PASS1_LOGITS_BYTES)
                                            (pass 1's spans hold up to 128 MiB of logits with a loss)
    one chunk's activations:                16 L (B/A) c max(d, d_ff) b

The estimate is a lower bound of the true use (allocator slack, Python, torch itself add to it);
a run is refused when it alone exceeds the machine's physical memory.  The named HF architectures
(``llama``, ``qwen2`` with their overrides) are sized the same way from their config
(:func:`hf_parameter_count`); a checkpoint directory by its data only (its size is unknown before loading).
"""

from __future__ import annotations

from ..config import HF_ARCHITECTURE_DEFAULTS
from ..core.checks import PASS1_LOGITS_BYTES, host_memory_bytes

__all__ = ["host_memory_bytes", "training_memory_bytes", "check_fits_in_memory", "hf_parameter_count"]

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def training_memory_bytes(cfg) -> int:
    """The estimate above for a :class:`~seco_lab.config.TrainConfig`."""
    b = DTYPE_BYTES.get(cfg.dtype, 4)
    micro = -(-cfg.batch_size // cfg.grad_accum)
    n, c = cfg.seq_len, min(cfg.chunk_size, cfg.seq_len)
    total = 3 * cfg.batch_size * (n + 1) * 8
    if cfg.hf_model is None:
        m = cfg.model
        d_kv = m.n_kv_heads * m.head_dim
        total += 4 * m.num_parameters * b + 2 * m.n_layers * micro * n * d_kv * b + 3 * micro * c * m.vocab_size * b
        total += 16 * m.n_layers * micro * c * max(m.d_model, m.d_ff) * b
    elif cfg.hf_model in HF_ARCHITECTURE_DEFAULTS and _sizes_valid(cfg.hf_model, cfg.hf_overrides or {}):
        h = {**HF_ARCHITECTURE_DEFAULTS[cfg.hf_model], **(cfg.hf_overrides or {})}
        hd = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
        d_kv = h["num_key_value_heads"] * hd
        L, V = h["num_hidden_layers"], h["vocab_size"]
        total += 4 * hf_parameter_count(cfg.hf_model, cfg.hf_overrides or {}) * b
        total += 2 * L * micro * n * d_kv * b + 3 * max(micro * c * V * b, PASS1_LOGITS_BYTES)
        total += 16 * L * micro * c * max(h["hidden_size"], h["intermediate_size"]) * b
    return total


def _sizes_valid(name: str, overrides: dict) -> bool:
    """The sizes the estimate reads are integers >= 1 (else the model's own checks refuse them, with their
    message: the estimate does not get in their way)."""
    c = {**HF_ARCHITECTURE_DEFAULTS[name], **overrides}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads") + (("head_dim",) if c.get("head_dim") is not None else ())
    return all(isinstance(c.get(k), int) and not isinstance(c.get(k), bool) and c[k] >= 1 for k in keys)


def hf_parameter_count(name: str, overrides: dict) -> int:
    """Parameters of the named HF architecture ``name`` with ``overrides`` (without building it): embeddings
    V h (and an untied head V h), per layer the q/o projections h (n_h d_h) each, k/v h (n_kv d_h) each (qwen2
    with q/k/v biases), the MLP 3 h d_ff and two norms h; the final norm h."""
    c = {**HF_ARCHITECTURE_DEFAULTS[name], **overrides}
    h, V = c["hidden_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = 2 * h * q + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h + (q + 2 * kv if name == "qwen2" else 0)
    return V * h * (1 if c.get("tie_word_embeddings", False) else 2) + c["num_hidden_layers"] * layer + h


def _gib(x: float) -> str:
    return f"{x / 2**30:,.1f} GiB"


def check_fits_in_memory(cfg, available: int | None = None) -> None:
    """Refuse a run whose estimate exceeds the machine's physical memory, stating the cost."""
    available = host_memory_bytes() if available is None else available
    need = training_memory_bytes(cfg)
    if available is not None and need > available:
        raise ValueError(f"this run needs at least {_gib(need)} of memory (parameters and optimizer state, the "
                         f"batch of {cfg.batch_size:,} x {cfg.seq_len:,} tokens, KV caches and logits), more than "
                         f"this machine's {_gib(available)}: lower --batch-size (or raise --grad-accum), "
                         "--vocab-size, --d-model (--hf-override sizes of an HF model) or --seq-len")
