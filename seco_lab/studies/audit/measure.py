"""The units of an audit: each computes one stored result (a JSON file) from the definition alone.

* ``exact``  -- float64 on a short window: SeCO and sum_p g(p) + g(>P) against the dense gradient,
  the remainder against dense - sum_p g(p), the full decomposition (P = k - 1) against dense;
* ``strata`` -- one sequence: pass 1, the stratified sweep (g(0..P)) and a SeCO sweep over the same
  leaves (g, hence g(>P) = g - sum), the per-tensor Gram of [g(0..P), g(>P)], CPU time of each part;
* ``cost``   -- one sequence: CPU time of a forward, a SeCO step and every (scheme, t) with random draws;
* ``mc``     -- one (sequence, t, sampler): N draws, one stratified sparse sweep each (pass 1 shared),
  stored as Gram matrices against each other and the exact strata (every scheme of the sampler at once);
* ``data``   -- one sequence's exact gradient (reused from its strata unit when the lengths agree).
"""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ... import store
from ...core.checks import guard_memory
from ...core.engine import cache_leaves, dense_grad, forward_loss, prepare, seco_grad, trainable
from ...estimators.schemes import get_scheme
from ...estimators.spaco import flatten, hop_strata, spaco_grad, strata_sweep, total_sweep
from .config import AuditConfig
from .sources import SequenceSpec, build_model, sequence_specs, sequence_tokens
from .stored import RECOMPUTE_TOLERANCE  # a recomputed sequence's strata reproduce the stored Gram to it

__all__ = ["exact_unit", "strata_unit", "strata_rows", "restore_strata_vectors", "RECOMPUTE_TOLERANCE", "cost_unit",
           "mc_unit", "data_unit", "gram_of", "SAMPLER_CODES"]

SAMPLER_CODES = {"uniform": 0, "bernoulli": 1}


class Clock:
    """CPU (process) and wall seconds of named parts."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    @contextmanager
    def part(self, name: str):
        c, w = time.process_time(), time.perf_counter()
        yield
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w

    def record(self) -> dict:
        return {"cpu_s": self.cpu, "wall_s": self.wall,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def flat_rows(rows) -> torch.Tensor:
    """(R, d) matrix of R gradient lists (each a list of tensors), in their dtype (float32 for float32 models)."""
    return torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])


def gram_of(A: torch.Tensor, B: torch.Tensor | None = None) -> np.ndarray:
    """A B' accumulated in float64, in column blocks (no float64 copy of the whole matrices)."""
    B = A if B is None else B
    out = torch.zeros(len(A), len(B), dtype=torch.float64)
    for a, b in zip(torch.split(A, 1 << 20, dim=1), torch.split(B, 1 << 20, dim=1)):
        out += a.double() @ b.double().T
    return out.numpy()


def per_tensor_gram(rows: list[list[torch.Tensor]]) -> np.ndarray:
    """G_i[p, q] = <row_p[i], row_q[i]> per parameter tensor i, float64."""
    out = np.zeros((len(rows[0]), len(rows), len(rows)))
    for i in range(len(rows[0])):
        S = torch.stack([r[i].reshape(-1).double() for r in rows])
        out[i] = (S @ S.T).numpy()
    return out


def n_layers_of(model) -> int:
    n = getattr(model, "n_layers", None)
    return int(n) if n is not None else int(model.config.n_layers)


def exact_unit(cfg: AuditConfig) -> dict:
    """float64 exactness on ``exact_length`` tokens of the first text in chunks of ``exact_chunk_size``."""
    model = build_model(cfg, "float64")
    spec = sequence_specs(cfg, 1, cfg.exact_length)[0]
    tok, tgt = sequence_tokens(cfg, spec)
    c = cfg.exact_chunk_size
    k = -(-len(tok) // c)
    P = min(cfg.max_hops, k - 1)
    _, dense = dense_grad(model, tok, tgt)
    d = flatten(dense)
    rel = lambda x: float((x - d).norm() / d.norm())  # noqa: E731
    out = {"tokens": len(tok), "chunk_size": c, "num_chunks": k, "max_hops": P, "dtype": "float64",
           "n_layers": n_layers_of(model), "text": spec.path}
    out["seco_vs_dense"] = rel(flatten(seco_grad(model, tok, tgt, c)[1]))
    st = hop_strata(model, tok, tgt, c, max_hops=P, remainder=True)
    summed = flatten(st.total())
    out["strata_plus_remainder_vs_dense"] = rel(summed + flatten(st.remainder))
    rest_direct = d - summed
    out["remainder_vs_dense_minus_sum"] = float((flatten(st.remainder) - rest_direct).norm() / d.norm())
    out["remainder_ratio"] = float(flatten(st.remainder).norm() / d.norm())
    full = hop_strata(model, tok, tgt, c)
    out["full_strata_sum_vs_dense"] = rel(flatten(full.total()))
    norms = full.norms() / float(d.norm())
    out["strata_norms"] = norms.tolist()
    L = out["n_layers"]
    out["strata_beyond_depth"] = float(max([0.0, *norms[L + 1:]]))
    return out


def strata_rows(cfg: AuditConfig, spec: SequenceSpec, clock: Clock | None = None) -> tuple[list, dict]:
    """[g(0), ..., g(P), g(>P)] of one sequence (each a list of tensors in the order of the trainable
    parameters) and what the strata unit records beside them (loss, chunks, tensor names)."""
    clock = clock or Clock()
    model = build_model(cfg)
    tok, tgt = sequence_tokens(cfg, spec)
    batch = prepare(model, tok, tgt, cfg.chunk_size)
    params = [p for _, p in trainable(model)]
    names = [n for n, _ in trainable(model)]
    with clock.part("forward"):
        leaves, loss = cache_leaves(model, batch)
    with clock.part("strata_sweep"):
        strata, _ = strata_sweep(model, batch, leaves, params, range(batch.num_chunks), cfg.max_hops)
    with clock.part("seco_sweep"):
        total = total_sweep(model, batch, leaves, params, range(batch.num_chunks))
    rest = [t - sum(s[i] for s in strata) for i, t in enumerate(total)]
    info = {"loss": float(loss), "num_chunks": batch.num_chunks, "n_layers": n_layers_of(model),
            "trainable": int(sum(p.numel() for p in params)), "tensors": names}
    return [*strata, rest], info


def _save_vectors(value: torch.Tensor, path: Path) -> None:
    """The flat vectors of a unit, written atomically (and recorded in the folder's checksum file)."""
    store.atomic_write(path, lambda f: torch.save(value, f))


def strata_unit(cfg: AuditConfig, spec: SequenceSpec, vectors: Path) -> dict:
    """g(0..P) and g(>P) of one sequence; the flat rows are saved to ``vectors`` (float32) for cross-sequence Grams."""
    clock = Clock()
    rows, info = strata_rows(cfg, spec, clock)
    gram = per_tensor_gram(rows)
    _save_vectors(flat_rows(rows), vectors)
    G = gram.sum(0)
    g2 = float(G.sum())
    return {"sequence": spec.name, **info, "max_hops": cfg.max_hops,
            "per_tensor_gram": gram.tolist(), "g_norm": float(np.sqrt(g2)),
            "norm_ratio": (np.sqrt(np.maximum(np.diag(G), 0)) / np.sqrt(g2)).tolist(),
            "remainder_ratio": float(np.sqrt(max(G[-1, -1], 0.0) / g2)), **clock.record()}




def restore_strata_vectors(cfg: AuditConfig, spec: SequenceSpec, vectors: Path, stored: dict) -> float:
    """Recompute the flat strata rows of a finished strata unit whose ``vectors`` file is absent (they are large
    and not committed: a fresh clone has the unit's JSON only), check them against the Gram matrix the unit
    stored -- as torch's checkpoint checks a recomputation against what was saved -- and save them.  Returns
    the relative difference; raises ValueError naming the unit when it exceeds :data:`RECOMPUTE_TOLERANCE`."""
    rows, _ = strata_rows(cfg, spec)
    gram, saved = per_tensor_gram(rows), np.asarray(stored["per_tensor_gram"])
    diff = float(np.linalg.norm(gram - saved) / max(np.linalg.norm(saved), 1e-300))
    if not diff <= RECOMPUTE_TOLERANCE:
        raise ValueError(f"the strata of sequence {spec.name} recomputed here differ from the stored unit "
                         f"strata-{spec.name}.json by {diff:.2e} (relative, Gram matrix; tolerance "
                         f"{RECOMPUTE_TOLERANCE:g}): the code or the model changed since it was stored; rerun the "
                         "audit into a new --out")
    _save_vectors(flat_rows(rows), vectors)
    return diff


def cost_unit(cfg: AuditConfig, spec: SequenceSpec, progress: bool = True) -> dict:
    """CPU seconds of a forward, a SeCO step and each (scheme, t) step on random draws (seeded)."""
    model = build_model(cfg)
    tok, tgt = sequence_tokens(cfg, spec)
    k = cfg.num_chunks
    rows = []

    def timed(method, fn, **extra):
        c, w = time.process_time(), time.perf_counter()
        fn()
        rows.append({"method": method, "cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - w, **extra})

    timed("forward", lambda: forward_loss(model, tok, tgt, cfg.chunk_size))
    timed("seco", lambda: seco_grad(model, tok, tgt, cfg.chunk_size))
    jobs = [(t, name, d) for t in cfg.budgets for name in cfg.schemes for d in range(cfg.cost_draws)]
    for t, name, d in tqdm(jobs, desc=f"cost {spec.name}", leave=False, disable=not progress):
        scheme = get_scheme(name)
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 3, spec.index, t, d]))
        subset = scheme.sampler.draw(k, t, rng)
        if not subset:
            rows.append({"method": "spaco", "scheme": name, "t": t, "draw": d, "chunks": 0, "cpu_s": 0.0,
                         "wall_s": 0.0})
            continue
        timed("spaco", lambda s=scheme, b=t, i=subset: spaco_grad(model, tok, tgt, cfg.chunk_size, s, b, subset=i),
              scheme=name, t=t, draw=d, chunks=len(subset))
    return {"sequence": spec.name, "rows": rows, "pass1_tokens": getattr(model, "pass1_tokens", None),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


#: how a Monte Carlo unit's draw remainders g_I(>P) were measured: "lumped", a stratum of the sweep itself
#: (:func:`~seco_lab.core.engine.hop_relay`).  Units without it subtracted the strata from the draw's total in
#: float32, and a scheme's weight W(P + 1) (16^9 for `paper` at k/t = 16) turned that rounding into a variance
#: of ~1e6 ||g||^2: they are stale, left out of the tables and computed again.
MC_REMAINDER = "lumped"


def mc_unit(cfg: AuditConfig, spec: SequenceSpec, budget: int, sampler_kind: str, vectors: Path,
            progress: bool = True) -> dict:
    """N draws I_n of one sampler; per draw the strata of the sparse sweep over I_n and its remainder, stored as
    Gram matrices (draws x draws, draws x exact strata) in float64."""
    clock = Clock()
    model = build_model(cfg)
    tok, tgt = sequence_tokens(cfg, spec)
    batch = prepare(model, tok, tgt, cfg.chunk_size)
    params = [p for _, p in trainable(model)]
    k, P = batch.num_chunks, cfg.max_hops
    sampler = next(get_scheme(s).sampler for s in cfg.schemes if get_scheme(s).sampler.kind == sampler_kind)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 4, spec.index, budget,
                                                        SAMPLER_CODES[sampler_kind]]))
    exact = torch.load(vectors)
    guard_memory("the Monte Carlo unit", cfg.mc_draws * exact.numel() * exact.element_size(),
                 f"{cfg.mc_draws} draws x {len(exact)} strata rows x {exact.shape[1]:,} parameters",
                 "lower --mc-draws or --max-hops", None)
    with clock.part("forward"):
        leaves, _ = cache_leaves(model, batch)
    draws, subsets = [], []
    for _ in tqdm(range(cfg.mc_draws), desc=f"mc {spec.name} t={budget} {sampler_kind}", disable=not progress,
                  leave=False):
        subset = sampler.draw(k, budget, rng)
        subsets.append(list(subset))
        if not subset:
            draws.append(torch.zeros_like(exact))
            continue
        with clock.part("draws"):
            strata, rest = strata_sweep(model, batch, leaves, params, subset, P, remainder=True)
            draws.append(flat_rows([*strata, rest]))
    D = torch.cat(draws)
    n, R = len(draws), len(exact)
    return {"sequence": spec.name, "t": budget, "sampler": sampler_kind, "subsets": subsets, "remainder": MC_REMAINDER,
            "draw_gram": gram_of(D).reshape(n, R, n, R).tolist(),
            "draw_exact": gram_of(D, exact).reshape(n, R, R).tolist(),
            "exact_gram": gram_of(exact).tolist(), **clock.record()}


def data_unit(cfg: AuditConfig, spec: SequenceSpec, vectors: Path, strata_vectors: Path | None) -> dict:
    """One sequence's exact gradient g_i (saved flat to ``vectors``): the sum of its strata rows when stored,
    else a SeCO step."""
    clock = Clock()
    if strata_vectors is not None and strata_vectors.is_file():
        rows = torch.load(strata_vectors)
        g = rows.sum(0, dtype=torch.float64).to(rows.dtype)
        loss, source = None, "strata"
    else:
        model = build_model(cfg)
        tok, tgt = sequence_tokens(cfg, spec)
        with clock.part("seco"):
            loss, grads = seco_grad(model, tok, tgt, cfg.chunk_size)
        g = torch.cat([v.reshape(-1) for v in grads.values()])
        loss, source = float(loss), "seco"
    _save_vectors(g, vectors)
    return {"sequence": spec.name, "length": spec.length, "loss": loss, "source": source,
            "g_norm": float(g.double().norm()), **clock.record()}
