"""The tiny transformer's shape (:class:`TinyConfig`), kept free of torch so that the
command line can build its flags, print ``--help`` and refuse bad input without
importing torch (seco_lab.models.tiny holds the model itself).

Every field is checked on construction: integers are integers (``True`` and ``2.0``
are refused), floats are finite numbers (``'1e-6'`` is refused), ``tie_embeddings``
is a bool (``'no'`` would otherwise be truthy and tie the embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.checks import as_bool, as_float, as_int

__all__ = ["TinyConfig"]


@dataclass
class TinyConfig:
    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (no grouping)
    d_ff: int = 64
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_positions")
        for name in positive:
            value = as_int(getattr(self, name), f"TinyConfig.{name}")
            if value < 1:
                raise ValueError(f"TinyConfig.{name} must be >= 1, got {value}")
            setattr(self, name, value)
        for name in ("rope_theta", "norm_eps", "dropout"):
            setattr(self, name, as_float(getattr(self, name), f"TinyConfig.{name}", finite=False))
        self.tie_embeddings = as_bool(self.tie_embeddings, "TinyConfig.tie_embeddings")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension d_model/n_heads must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        # a norm eps <= 0 divides by zero on a zero row; inf/NaN gives NaN everywhere
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise ValueError(f"norm_eps must be a finite number > 0, got {self.norm_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"rope_theta must be a finite number > 1, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_parameters(self) -> int:
        """The model's parameter count: embeddings (and an untied head), per block the attention projections,
        the gated MLP and two norm gains, and the final norm."""
        hd, d = self.head_dim, self.d_model
        block = d * (self.n_heads * hd) * 2 + 2 * d * (self.n_kv_heads * hd) + 3 * d * self.d_ff + 2 * d
        return self.vocab_size * d * (1 if self.tie_embeddings else 2) + self.n_layers * block + d
