"""What the bias study computes: the grid, the scheme variants, the seeding rule and
how each group's model and data are built from the stored definition.

A *group* is one (depth L, chunk count k, seed): one random float64 model and one
random token sequence.  A *cell* is a group and a budget t.

Seeding rule (one for everything random in the study)::

    numpy.random.SeedSequence([base_seed, L, k, seed, purpose, *extra])

with the purposes below.  ``extra`` is empty except for Monte Carlo draws, which
append (t, sampler code) so every cell and sampler has its own stream.  Purposes:

* ``MODEL``        -- the model's initial weights (one 63-bit integer seed);
* ``TOKENS``       -- the token sequence (a torch generator seeded from the stream);
* ``MONTE_CARLO``  -- the N Monte Carlo draws of one (t, sampler), shared by all
  schemes of that sampler (common random numbers);
* ``ENGINE_CHECK`` -- the few drawn sets on which the real sparse engine is compared
  with the chain-basis estimate;
* ``STRATA_MONTE_CARLO`` -- the draws of one (t, sampler) of a *paper-settings* group
  (k = 128 and up), where every draw is one stratified sparse sweep.

Two kinds of group: the *chain-basis* grid (``depths`` x ``chunk_counts`` x ``seeds``, k <= 16,
exact variance) and the *paper-settings* groups (``paper_cells`` x ``paper_seeds``, the paper's
k = 128 with t in ``paper_budgets``): exact first-order metrics from one stratified pass with
P = L (``seco_lab.stats.strata.bias_metrics``), variance and MSE by ``strata_monte_carlo``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from enum import IntEnum

import numpy as np
import torch

from ...estimators.schemes import Scheme, get_scheme
from ...models.tiny import TinyConfig, TinyTransformer
from .options import (
    BATCHES,
    DEFAULT_DRAWS,
    DEFAULT_PAPER_DRAWS,
    PAPER_BATCHES,
    QUICK_DRAWS,
    QUICK_PAPER_BATCHES,
    QUICK_PAPER_DRAWS,
)

__all__ = [
    "BERNOULLI", "CHECK_COLUMNS", "CONVERGENCE_COLUMNS", "DEFAULT", "FALLING_FACTORIAL", "GROUP_COLUMNS",
    "PAPER", "PAPER_CAPPED_2", "PAPER_CAPPED_4", "PAPER_CHAIN_CAPPED_2", "PAPER_CHAIN_CAPPED_4",
    "PAPER_COLUMNS", "Purpose", "QUICK", "RELEASED", "RELEASED_UNBIASED", "RESULT_COLUMNS", "SAMPLER_CODES",
    "SCHEMES", "STUDY_FORMAT", "SchemeVariant", "StudyConfig", "build_model", "build_tokens", "run_totals_problem",
    "seed_sequence",
]


class Purpose(IntEnum):
    MODEL = 0
    TOKENS = 1
    MONTE_CARLO = 2
    ENGINE_CHECK = 3
    STRATA_MONTE_CARLO = 4


SAMPLER_CODES = {"uniform": 0, "bernoulli": 1}  # the Monte Carlo stream's extra entropy per sampler kind

IGNORE_INDEX = -100
# Bumped whenever the seeding rule or the stored tables change, so a folder written by an older
# study is never resumed as if it were this one (2: one SeedSequence rule, checks.csv, groups.csv;
# 3: paper-settings groups and paper.csv, per_tensor_residual in results.csv).
STUDY_FORMAT = 4  # 4: matched-scale metrics (noise_to_signal, best_scale_mse)


@dataclass(frozen=True)
class SchemeVariant:
    """A scheme as the study runs it: its label in every table and figure, its name and cap."""

    label: str
    name: str
    cap: float | None = None

    def build(self) -> Scheme:
        return get_scheme(self.name) if self.cap is None else get_scheme(self.name, cap=self.cap)


# The variants by name, so the report refers to them without restating labels as strings.
PAPER = SchemeVariant("paper", "paper")
PAPER_CAPPED_2 = SchemeVariant("paper-capped C=2", "paper-capped", 2)
PAPER_CAPPED_4 = SchemeVariant("paper-capped C=4", "paper-capped", 4)
PAPER_CHAIN_CAPPED_2 = SchemeVariant("paper-chain-capped C=2", "paper-chain-capped", 2)
PAPER_CHAIN_CAPPED_4 = SchemeVariant("paper-chain-capped C=4", "paper-chain-capped", 4)
RELEASED = SchemeVariant("released", "released")
RELEASED_UNBIASED = SchemeVariant("released-unbiased", "released-unbiased")
FALLING_FACTORIAL = SchemeVariant("falling-factorial", "falling-factorial")
BERNOULLI = SchemeVariant("bernoulli", "bernoulli")
SCHEMES = (PAPER, PAPER_CAPPED_2, PAPER_CAPPED_4, PAPER_CHAIN_CAPPED_2, PAPER_CHAIN_CAPPED_4, RELEASED,
           RELEASED_UNBIASED, FALLING_FACTORIAL, BERNOULLI)

# Column layout of the stored tables (the report reads them by these names).
RESULT_COLUMNS = ("L", "k", "seed", "t", "scheme", "metric", "value")  # results.csv: one metric of one scheme x cell
PAPER_COLUMNS = RESULT_COLUMNS  # paper.csv: the same layout, for the paper-settings groups
CHECK_COLUMNS = ("L", "k", "seed", "t", "check", "value")  # checks.csv: internal exactness checks (t = 0: whole group)
GROUP_COLUMNS = ("L", "k", "seed", "metric", "value")  # groups.csv: per-group facts (gradient norm, strata, chains)
CONVERGENCE_COLUMNS = ("L", "k", "seed", "t", "scheme", "n", "rel_err", "exact_rel_bias")
GROUP_KEY = ("L", "k", "seed")


@dataclass(frozen=True)
class StudyConfig:
    """The study definition; its digest decides whether stored results can be resumed."""

    depths: tuple[int, ...] = (1, 2, 3)
    chunk_counts: tuple[int, ...] = (4, 8, 16)
    budgets: dict = field(default_factory=lambda: {4: (1, 2, 3, 4), 8: (1, 2, 3, 4, 8), 16: (1, 2, 3, 4, 8, 16)})
    seeds: tuple[int, ...] = (0, 1, 2)
    draws: int = DEFAULT_DRAWS
    batches: int = BATCHES
    ci_level: float = 0.95
    base_seed: int = 20250607
    chunk_size: int = 4
    model: dict = field(
        default_factory=lambda: dict(vocab_size=32, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, max_positions=4096)
    )
    max_enumerated_subsets: int = 5000
    engine_check_draws: int = 2
    schemes: tuple[SchemeVariant, ...] = SCHEMES
    arch: str = "tiny"  # "tiny" (seco_lab's transformer) or "hf-llama" / "hf-qwen2" (transformers, random weights)
    # paper-settings groups: (L, k) pairs x seeds, budgets t, Monte Carlo draws per (t, sampler) and batches
    paper_cells: tuple[tuple[int, int], ...] = ((2, 128), (4, 128), (2, 256))
    paper_budgets: tuple[int, ...] = (8, 16, 32)
    paper_seeds: tuple[int, ...] = (0, 1)
    paper_draws: int = DEFAULT_PAPER_DRAWS
    paper_batches: int = PAPER_BATCHES

    def groups(self) -> list[tuple[int, int, int]]:
        """Every chain-basis (L, k, seed), largest first so parallel workers finish together."""
        g = [(L, k, s) for L in self.depths for k in self.chunk_counts for s in self.seeds]
        return sorted(g, key=lambda x: (-x[1], -x[0], x[2]))

    def paper_groups(self) -> list[tuple[int, int, int]]:
        """Every paper-settings (L, k, seed), most expensive first."""
        g = [(L, k, s) for L, k in self.paper_cells for s in self.paper_seeds]
        return sorted(g, key=lambda x: (-x[0] * x[1], x[2]))

    def sampler_kinds(self) -> list[str]:
        """The kinds of sampler the study's schemes draw with (each gets its own Monte Carlo draws), sorted."""
        return sorted({variant.build().sampler.kind for variant in self.schemes})

    def draws_by_kind(self) -> dict[str, int]:
        """The Monte Carlo draws the study makes: ``chain`` (every chain-basis group: draws x budgets x samplers) and
        ``paper`` (every paper-settings group: paper_draws x paper budgets x samplers), as its groups count them."""
        samplers = len(self.sampler_kinds())
        return {"chain": sum(self.draws * len(self.budgets[k]) * samplers for _, k, _ in self.groups()),
                "paper": self.paper_draws * len(self.paper_budgets) * samplers * len(self.paper_groups())}

    def to_json(self) -> dict:
        d = asdict(self)
        d["budgets"] = {str(k): list(v) for k, v in self.budgets.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> StudyConfig:
        """Inverse of ``to_json`` (the definition stored in ``study.json``)."""
        d = dict(d)
        for name in ("depths", "chunk_counts", "seeds", "paper_budgets", "paper_seeds"):
            d[name] = tuple(d[name])
        d["paper_cells"] = tuple(tuple(c) for c in d["paper_cells"])
        d["budgets"] = {int(k): tuple(v) for k, v in d["budgets"].items()}
        d["schemes"] = tuple(SchemeVariant(**s) for s in d["schemes"])
        cfg = cls(**d)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Refuse a definition no study runs (a ``study.json`` edited by hand: its numbers would be reported as the
        study's): counts and sizes must be integers >= 1, budgets lie in [1, k], the interval level in (0, 1)."""
        def count(name, v):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} is {v!r}, but it must be an integer >= 1")
        for name in ("draws", "batches", "chunk_size", "max_enumerated_subsets", "engine_check_draws", "paper_draws",
                     "paper_batches"):
            count(name, getattr(self, name))
        for name in ("depths", "chunk_counts", "paper_budgets"):
            for v in getattr(self, name):
                count(f"an entry of {name}", v)
        for name in ("seeds", "paper_seeds"):
            if any(type(v) is not int or v < 0 for v in getattr(self, name)):
                raise ValueError(f"{name} is {list(getattr(self, name))!r}, but seeds are integers >= 0")
        for k, ts in self.budgets.items():
            if any(type(t) is not int or not 1 <= t <= k for t in ts):
                raise ValueError(f"budgets of k={k} are {list(ts)!r}, but each must be an integer in [1, {k}]")
        for L, k in self.paper_cells:
            count("an L of paper_cells", L)
            count("a k of paper_cells", k)
        if not (isinstance(self.ci_level, float) and 0 < self.ci_level < 1):
            raise ValueError(f"ci_level is {self.ci_level!r}, but it must lie in (0, 1)")

    def digest(self, study_format: int = STUDY_FORMAT) -> str:
        """Hash of the definition and of the study format (this version's ``STUDY_FORMAT``, or the one a stored
        ``study.json`` records): equal digests mean resumable results."""
        spec = {"study_format": study_format, **self.to_json()}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def run_totals_problem(meta: dict, cfg: StudyConfig) -> str | None:
    """What is wrong with the run totals a ``study.json`` (``meta``) records beside its definition ``cfg`` (the digest
    covers the definition only), or None: ``total_draws`` and ``timing.draws_by_kind`` must be the draws the
    definition makes (:meth:`StudyConfig.draws_by_kind`); ``timing.worker_seconds_by_part`` a positive time for each
    part the study has (the chain-basis grid, the paper-settings parts), and ``timing.compute_seconds`` their sum
    (campaign 30 T9, 31 U7).  The report refuses such a record; a rerun writes it again."""
    expected, timing = cfg.draws_by_kind(), meta.get("timing")
    timing = timing if isinstance(timing, dict) else {}
    recorded, by_kind = meta.get("total_draws"), timing.get("draws_by_kind")
    parts, seconds = timing.get("worker_seconds_by_part"), timing.get("compute_seconds")
    if type(recorded) is not int or recorded != sum(expected.values()):
        return f"total_draws {recorded!r}, while its definition makes {sum(expected.values()):,} draws"
    if not isinstance(by_kind, dict) or by_kind != expected:
        return f"draws by kind {by_kind!r:.80}, while its definition makes {expected}"
    samplers = cfg.sampler_kinds()
    expected_parts = ({"chain_basis_grid"} if cfg.groups() else set()) | (
        {"paper_exact", *(f"paper_monte_carlo_{kind}" for kind in samplers)} if cfg.paper_groups() else set())
    if (not isinstance(parts, dict) or set(parts) != expected_parts
            or not all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in parts.values())
            or type(seconds) not in (int, float) or not math.isclose(seconds, sum(parts.values()), rel_tol=1e-9,
                                                                      abs_tol=1e-9)):
        return (f"compute_seconds {seconds!r} and worker seconds by part "
                f"{'unreadable' if not isinstance(parts, dict) else repr(parts)[:80]}: each part of the study "
                f"({', '.join(sorted(expected_parts))}) takes a positive time, and compute_seconds is their sum")
    wall, jobs = timing.get("wall_seconds_this_run"), meta.get("jobs")
    if type(wall) not in (int, float) or not math.isfinite(wall) or wall < 0:
        return f"wall_seconds_this_run {wall!r}, not a time (a finite number of seconds >= 0)"
    if type(jobs) is not int or jobs < 1:
        return f"jobs {jobs!r}, not a number of workers (an integer >= 1)"
    return None


DEFAULT = StudyConfig()
QUICK = replace(DEFAULT, depths=(1, 2), chunk_counts=(4, 8), budgets={4: (1, 2, 4), 8: (1, 2, 3, 8)}, seeds=(0, 1),
                draws=QUICK_DRAWS, paper_cells=((2, 32),), paper_budgets=(2, 8), paper_seeds=(0,),
                paper_draws=QUICK_PAPER_DRAWS, paper_batches=QUICK_PAPER_BATCHES)


def seed_sequence(cfg: StudyConfig, n_layers: int, num_chunks: int, seed: int, purpose: Purpose,
                  *extra: int) -> np.random.SeedSequence:
    """The study's one seeding rule: SeedSequence([base_seed, L, k, seed, purpose, *extra])."""
    return np.random.SeedSequence([cfg.base_seed, n_layers, num_chunks, seed, int(purpose), *extra])


def build_model(cfg: StudyConfig, n_layers: int, num_chunks: int, seed: int) -> torch.nn.Module:
    """The float64 model of a group: the tiny transformer, or an HF architecture of the same shape."""
    init_seed = int(seed_sequence(cfg, n_layers, num_chunks, seed, Purpose.MODEL).generate_state(1, np.uint64)[0] >> 1)
    if cfg.arch == "tiny":
        return TinyTransformer(TinyConfig(n_layers=n_layers, **cfg.model), seed=init_seed, dtype=torch.float64)
    if not cfg.arch.startswith("hf-"):
        raise ValueError(f"unknown arch {cfg.arch!r}; use 'tiny', 'hf-llama' or 'hf-qwen2'")
    from ...models.hf import HFChunkModel, build_hf_model

    m = cfg.model
    overrides = dict(vocab_size=m["vocab_size"], hidden_size=m["d_model"], num_hidden_layers=n_layers,
                     num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
                     intermediate_size=m["d_ff"], max_position_embeddings=m["max_positions"])
    return HFChunkModel(build_hf_model(cfg.arch[3:], overrides, "sdpa", torch.float64, init_seed))


def build_tokens(cfg: StudyConfig, n_layers: int, num_chunks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of a group: k * chunk_size uniform random tokens, targets the next token
    (none for the last one, as in language modelling)."""
    state = seed_sequence(cfg, n_layers, num_chunks, seed, Purpose.TOKENS).generate_state(1, np.uint64)[0]
    gen = torch.Generator().manual_seed(int(state >> 1))
    tokens = torch.randint(0, cfg.model["vocab_size"], (1, num_chunks * cfg.chunk_size), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    targets[0, -1] = IGNORE_INDEX
    return tokens, targets
