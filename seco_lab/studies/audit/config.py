"""What an audit measures: the model, the gradient, the text, the settings and the stages.

An :class:`AuditConfig` is stored as ``config.json`` in the results folder; a rerun resumes only
an equal definition (the fields in ``EXTENDABLE`` may grow: more sequences, more draws).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace

from ...core.checks import as_int, check_threads
from ...estimators.schemes import SCHEME_NAMES

__all__ = ["AuditConfig", "DEFAULT", "QUICK", "EXTENDABLE", "STAGES", "COMMITTED", "MAX_DRAWS"]

# the stages, in the order the driver runs their units (each finished unit is a complete result)
STAGES = ("exact", "strata", "cost", "mc", "data")
# fields a rerun may change without invalidating what is stored
EXTENDABLE = ("num_sequences", "data_sequences", "mc_sequences", "mc_draws", "mc_budgets", "cost_sequences",
              "cost_draws", "threads", "stages")


def tuple_or(value):
    return tuple(value) if isinstance(value, list) else value


#: the most Monte Carlo or cost draws an audit takes (each is a sparse sweep of the model)
MAX_DRAWS = 10_000


@dataclass(frozen=True)
class AuditConfig:
    """One audit.  ``texts`` entries are ``[KIND:]PATH`` (a file or a folder; relative paths are looked up
    in the working directory, then in the Python standard library); sequences are consecutive windows of
    ``length`` + 1 tokens, taken from the texts in turn (round robin)."""

    model: str = "smollm2-135m"  # smollm2-135m | a .gguf file | a local HF folder | tiny | hf-llama (random)
    params: str = "lora"  # lora | full
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    texts: tuple[str, ...] = ("prose:pydoc_data/topics.py", "code:argparse.py")
    length: int = 8192
    chunk_size: int = 64
    dtype: str = "float32"
    budgets: tuple[int, ...] = (8, 16, 32)
    schemes: tuple[str, ...] = SCHEME_NAMES
    max_hops: int = 6  # P: strata g(0..P) plus the measured remainder g(>P)
    remainder_tol: float = 1e-2  # the aim: ||g(>P)|| / ||g|| at most this (reported against it)
    num_sequences: int = 3  # sequences with strata (bias, equal compute)
    mc_sequences: int = 1
    mc_budgets: tuple[int, ...] = (8,)
    mc_draws: int = 16  # per (sequence, t, sampler)
    cost_sequences: int = 1
    cost_draws: int = 1  # random draws timed per (scheme, t)
    data_sequences: int = 8  # exact (SeCO) gradients for the data noise; includes the strata sequences
    data_length: int | None = None  # None: ``length`` (a shorter one is reported as such)
    exact_length: int = 256  # float64 exactness window
    exact_chunk_size: int = 16
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    seed: int = 20261130
    threads: int = 2
    tiny: dict = field(default_factory=lambda: dict(vocab_size=256, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                                                    d_ff=32, max_positions=4096))
    stages: tuple[str, ...] = STAGES

    def __post_init__(self):
        self._check_types()
        if self.params not in ("lora", "full"):
            raise ValueError(f"params must be 'lora' or 'full', got {self.params!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        for name in ("length", "chunk_size", "num_sequences", "mc_draws", "exact_length", "exact_chunk_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mc_draws < 3:
            raise ValueError(f"mc_draws must be >= 3 (the intervals are jackknifes over draws), got {self.mc_draws}")
        for name in ("mc_draws", "cost_draws"):  # each draw is a sparse sweep of the model, its rows held in memory
            if getattr(self, name) > MAX_DRAWS:
                raise ValueError(f"{name}={getattr(self, name):,} is above the {MAX_DRAWS:,} an audit takes (each draw "
                                 "is one sparse sweep of the model, minutes on a real one, and its strata are held "
                                 "in memory); 16-100 draws give intervals")
        if self.params == "full":
            default = {f.name: f.default for f in fields(self)}
            ignored = [n for n in ("lora_r", "lora_alpha", "lora_targets")
                       if tuple_or(getattr(self, n)) != default[n]]
            if ignored:
                raise ValueError(f"{', '.join(ignored)} apply to params='lora' only; with params='full' every "
                                 "parameter is audited (leave them out, or audit a LoRA gradient with params='lora')")
        k = self.num_chunks
        bad = [t for t in (*self.budgets, *self.mc_budgets) if not 1 <= t < k]
        if bad:
            raise ValueError(f"budgets {bad} must lie in [1, k) with k = {k} chunks ({self.length} tokens in chunks "
                             f"of {self.chunk_size}); choose smaller budgets or a longer sequence")
        missing = sorted(set(self.mc_budgets) - set(self.budgets))
        if missing:
            raise ValueError(f"mc_budgets {missing} are not among budgets {list(self.budgets)}")
        unknown = sorted(set(self.stages) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stages {unknown}; stages: {', '.join(STAGES)}")
        for name in ("budgets", "mc_budgets", "batch_sizes", "texts", "schemes", "stages", "lora_targets"):
            values = tuple_or(getattr(self, name))
            twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
            if twice is not None:  # campaign 28 (AV08): a scheme named twice made its cost unit's rows collide
                raise ValueError(f"{name} names {twice!r} twice; name each once")
        unknown = sorted(set(self.schemes) - set(SCHEME_NAMES))
        if unknown:
            raise ValueError(f"unknown schemes {unknown}; schemes: {', '.join(SCHEME_NAMES)}")
        if self.max_hops < 0 or self.max_hops >= k:
            raise ValueError(f"max_hops P={self.max_hops} must lie in [0, k) with k = {k}")
        if self.model in ("tiny",) and self.params == "lora":
            raise ValueError("the tiny model has no LoRA adapters: use params='full' with model 'tiny' "
                             "(or model 'hf-llama' for a tiny random HF Llama with LoRA)")

    def _check_types(self) -> None:
        """Whole numbers where counts belong (a bool or a float is refused, not truncated), text lists of
        strings (a bare string would be read letter by letter)."""
        for name in ("lora_r", "lora_alpha", "length", "chunk_size", "max_hops", "num_sequences", "mc_sequences",
                     "mc_draws", "cost_sequences", "cost_draws", "data_sequences", "exact_length",
                     "exact_chunk_size", "seed"):
            as_int(getattr(self, name), name)
        check_threads(self.threads)
        if self.data_length is not None:
            as_int(self.data_length, "data_length", minimum=1)
        for name in ("budgets", "mc_budgets", "batch_sizes"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)) or not values:
                raise TypeError(f"{name} must be a non-empty tuple of integers, got {values!r}")
            for v in values:
                as_int(v, f"{name} entry", minimum=1)
        for name in ("texts", "schemes", "lora_targets", "stages"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)) \
                    or not all(isinstance(v, str) and v.strip() for v in values):
                raise TypeError(f"{name} must be a tuple of non-empty strings, got {values!r} (a single one: "
                                f"{name}=('...',))")

    @property
    def num_chunks(self) -> int:
        return -(-self.length // self.chunk_size)

    @property
    def data_len(self) -> int:
        return self.length if self.data_length is None else self.data_length

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, d: dict) -> AuditConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown audit settings {unknown}")
        tuples = {f.name for f in fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items()})

    def identity(self) -> dict:
        """The definition without the fields a rerun may extend."""
        return {k: v for k, v in self.to_json().items() if k not in EXTENDABLE}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


DEFAULT = AuditConfig()
# the committed study (issue 21 §4): SmolLM2-135M, LoRA r = 8 on q/v, k = 128 (8,192 tokens in chunks of 64)
COMMITTED = replace(DEFAULT, max_hops=8, mc_budgets=(8, 16, 32), data_sequences=8)
# a newcomer's first run (< 2 minutes on 2 cores): a tiny random HF Llama with LoRA, byte tokens
QUICK = replace(DEFAULT, model="hf-llama", texts=("prose:pydoc_data/topics.py", "code:argparse.py"), length=256,
                chunk_size=16, budgets=(2, 4, 8), max_hops=3, num_sequences=3, mc_budgets=(4,), mc_draws=8,
                data_sequences=4, exact_length=64, exact_chunk_size=8, lora_targets=("q_proj", "v_proj"))
