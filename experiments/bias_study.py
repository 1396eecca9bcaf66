"""The bias study: every SpaCO compensation scheme against the exact gradient.

    python -m experiments.bias_study [--quick] [--jobs 2] [--out DIR] [--draws N] [--fresh]

A *group* is one (depth L, chunk count k, seed): one random float64 model and one
random token sequence.  For each group the exact chain basis, hop strata and Gram
matrix are computed once; each *cell* (group x budget t) then gets, for every
scheme: the exact bias, variance, MSE and direction bias, the exact covariance
by enumeration where the subset count is small, and a Monte Carlo run of N draws
shared by all schemes of the same sampler (common random numbers).

Results are tidy rows (one per scheme x cell x metric) written per group
atomically under ``OUT/cells``; a rerun skips finished groups (resume) as long
as the study definition is unchanged.  ``seco_lab.report`` turns them into the
report and figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- definition


@dataclass(frozen=True)
class SchemeVariant:
    label: str
    name: str
    cap: float | None = None

    def build(self):
        from seco_lab import get_scheme

        return get_scheme(self.name) if self.cap is None else get_scheme(self.name, cap=self.cap)


SCHEMES = (
    SchemeVariant("paper", "paper"),
    SchemeVariant("paper-capped C=2", "paper-capped", 2),
    SchemeVariant("paper-capped C=4", "paper-capped", 4),
    SchemeVariant("paper-chain-capped C=2", "paper-chain-capped", 2),
    SchemeVariant("paper-chain-capped C=4", "paper-chain-capped", 4),
    SchemeVariant("released", "released"),
    SchemeVariant("released-unbiased", "released-unbiased"),
    SchemeVariant("falling-factorial", "falling-factorial"),
    SchemeVariant("bernoulli", "bernoulli"),
)


@dataclass(frozen=True)
class StudyConfig:
    depths: tuple[int, ...] = (1, 2, 3)
    chunk_counts: tuple[int, ...] = (4, 8, 16)
    budgets: dict = field(default_factory=lambda: {4: (1, 2, 3, 4), 8: (1, 2, 3, 4, 8), 16: (1, 2, 3, 4, 8, 16)})
    seeds: tuple[int, ...] = (0, 1, 2)
    draws: int = 10_000
    batches: int = 50
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

    def groups(self) -> list[tuple[int, int, int]]:
        # largest first, so parallel workers finish together
        g = [(L, k, s) for L in self.depths for k in self.chunk_counts for s in self.seeds]
        return sorted(g, key=lambda x: (-x[1], -x[0], x[2]))

    def to_json(self) -> dict:
        d = asdict(self)
        d["budgets"] = {str(k): list(v) for k, v in self.budgets.items()}
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


DEFAULT = StudyConfig()
QUICK = replace(DEFAULT, depths=(1, 2), chunk_counts=(4, 8), budgets={4: (1, 2, 4), 8: (1, 2, 3, 8)}, seeds=(0, 1),
                draws=2000)

# ----------------------------------------------------------------------------- one group


def build_model(cfg: StudyConfig, L: int, seed: int):
    """The float64 model of a cell: the tiny transformer, or an HF architecture of the same shape."""
    if cfg.arch == "tiny":
        from seco_lab import TinyConfig, TinyTransformer

        return TinyTransformer(TinyConfig(n_layers=L, **cfg.model), seed=seed, dtype=torch.float64)
    if not cfg.arch.startswith("hf-"):
        raise ValueError(f"unknown arch {cfg.arch!r}; use 'tiny', 'hf-llama' or 'hf-qwen2'")
    from seco_lab.hf import HFChunkModel, build_hf_model

    m = cfg.model
    overrides = dict(vocab_size=m["vocab_size"], hidden_size=m["d_model"], num_hidden_layers=L,
                     num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
                     intermediate_size=m["d_ff"], max_position_embeddings=m["max_positions"])
    return HFChunkModel(build_hf_model(cfg.arch[3:], overrides, "sdpa", torch.float64, seed))


def run_group(cfg: StudyConfig, L: int, k: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every cell of one (L, k, seed): tidy metric rows and convergence rows."""
    from seco_lab import chain_basis, dense_grad, flatten, hop_strata, spaco_grad
    from seco_lab.analysis import (
        ChainSpace,
        Inclusion,
        MonteCarlo,
        enumerated_stats,
        exact_stats,
        monte_carlo_stats,
        scheme_chain_weights,
    )

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    model = build_model(cfg, L, 1000 * L + seed)
    gen = torch.Generator().manual_seed(cfg.base_seed + 7919 * seed + 31 * k + L)
    n = k * cfg.chunk_size
    tokens = torch.randint(0, cfg.model["vocab_size"], (1, n), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    targets[0, -1] = -100  # no target for the last token, as in language modelling

    _, dense = dense_grad(model, tokens, targets)
    dense = flatten(dense)
    basis = chain_basis(model, tokens, targets, cfg.chunk_size, max_hops=min(L, k - 1))
    strata = hop_strata(model, tokens, targets, cfg.chunk_size)
    space = ChainSpace.from_basis(basis)
    g_norm = float(dense.norm())
    chain_sum = basis.vectors.sum(0)
    base = dict(L=L, k=k, seed=seed)
    rows: list[dict] = []
    conv_rows: list[dict] = []

    def put(t, label, metric, value):
        rows.append({**base, "t": t, "scheme": label, "metric": metric, "value": float(value)})

    # group-level checks: the chain basis is the exact gradient, and chains stop at depth L
    put(0, "*", "check_chain_sum_vs_dense", float((chain_sum - dense).norm()) / g_norm)
    put(0, "*", "check_strata_beyond_depth", max([0.0] + list(strata.norms()[L + 1 :])) / g_norm)
    put(0, "*", "g_norm", g_norm)
    put(0, "*", "n_chains", len(basis.chains))
    for p, v in enumerate(strata.norms()[: L + 1]):
        put(0, "*", f"stratum_norm_p{p}", v / g_norm)

    rng_check = np.random.default_rng([cfg.base_seed, L, k, seed, 99])
    schemes = [(v, v.build()) for v in cfg.schemes]
    samplers = {s.sampler.kind: s.sampler for _, s in schemes}
    for t in cfg.budgets[k]:
        for kind, sampler in samplers.items():
            inc = Inclusion.of(space, sampler, k, t)
            rng = np.random.default_rng([cfg.base_seed, L, k, seed, t, 0 if kind == "uniform" else 1])
            mc = MonteCarlo.run(space, sampler, k, t, cfg.draws, rng, batches=cfg.batches)
            enumerable = sampler.num_subsets(k, t) <= cfg.max_enumerated_subsets
            for variant, scheme in schemes:
                if scheme.sampler.kind != kind:
                    continue
                W = scheme_chain_weights(scheme, k, t, basis.hops)
                ex = exact_stats(space, W, inc)
                for metric, value in ex.relative(space.g_norm2).items():
                    put(t, variant.label, metric, value)
                put(t, variant.label, "rel_sq_bias", ex.sq_bias / space.g_norm2)
                put(t, variant.label, "cost", float(sampler.rate(k, t)) * k if kind == "bernoulli" else t)
                for p, w in enumerate(scheme.expected_weights(k, t, L)):
                    put(t, variant.label, f"w_p{p}", w)
                ms = monte_carlo_stats(space, mc, W, cfg.ci_level)
                g2 = space.g_norm2
                put(t, variant.label, "mc_rel_sq_err", ms.sq_err / g2)
                put(t, variant.label, "mc_rel_sq_bias", ms.sq_bias / g2)
                put(t, variant.label, "mc_rel_sq_bias_se", ms.sq_bias_se / g2)
                put(t, variant.label, "mc_rel_sq_bias_ci_low", ms.ci_low / g2)
                put(t, variant.label, "mc_rel_sq_bias_ci_high", ms.ci_high / g2)
                put(t, variant.label, "mc_rel_bias", np.sqrt(max(ms.sq_bias, 0.0) / g2))
                put(t, variant.label, "mc_rel_var", ms.cov_trace / g2)
                put(t, variant.label, "mc_cost", mc.mean_size)
                # coverage is only meaningful where the estimate is random at all (not t = k)
                random_estimate = ex.cov_trace > 1e-20 * g2
                put(t, variant.label, "mc_covered",
                    float(ms.ci_low <= ex.sq_bias <= ms.ci_high) if random_estimate else np.nan)
                if enumerable:
                    sq_b, tr = enumerated_stats(space, W, sampler, k, t)
                    put(t, variant.label, "enum_rel_var", tr / g2)
                    put(t, variant.label, "check_enum_vs_analytic",
                        max(abs(sq_b - ex.sq_bias), abs(tr - ex.cov_trace)) / g2)
                for n_i, err in zip(mc.checkpoints, ms.convergence):
                    conv_rows.append({**base, "t": t, "scheme": variant.label, "n": int(n_i),
                                      "rel_err": err / g_norm, "exact_rel_bias": np.sqrt(max(ex.sq_bias, 0) / g2)})
            # the fast path must equal the real sparse engine on actual draws
            worst = 0.0
            for _ in range(cfg.engine_check_draws):
                subset = sampler.draw(k, t, rng_check)
                if not subset:
                    continue
                for _, scheme in schemes:
                    if scheme.sampler.kind == kind:
                        _, g_hat = spaco_grad(model, tokens, targets, cfg.chunk_size, scheme, t, subset=subset)
                        g_hat = flatten(g_hat)
                        fast = basis.estimate(subset, scheme.chain_weights(k, t, basis.max_hops))
                        worst = max(worst, float((fast - g_hat).norm() / max(float(g_hat.norm()), 1e-300)))
            put(t, f"* {kind}", "check_engine_vs_chain_basis", worst)
    put(0, "*", "seconds", time.perf_counter() - t_start)
    n_draws = cfg.draws * len(cfg.budgets[k]) * len(samplers)
    put(0, "*", "draws", n_draws)
    return pd.DataFrame(rows), pd.DataFrame(conv_rows)


# ----------------------------------------------------------------------------- driver


def atomic_write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _group_paths(out: Path, L: int, k: int, seed: int) -> tuple[Path, Path]:
    stem = f"L{L}_k{k}_s{seed}"
    return out / "cells" / f"{stem}.csv", out / "cells" / f"{stem}.convergence.csv"


def _work(args):
    cfg, out, (L, k, seed) = args
    res, conv = run_group(cfg, L, k, seed)
    res_path, conv_path = _group_paths(out, L, k, seed)
    atomic_write_csv(conv, conv_path)
    atomic_write_csv(res, res_path)  # written last: its presence marks the group done
    return float(res.loc[res.metric == "draws", "value"].iloc[0])


def software_versions() -> dict:
    import matplotlib
    import scipy

    return {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
            "scipy": scipy.__version__, "pandas": pd.__version__, "matplotlib": matplotlib.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count()}


def run_study(cfg: StudyConfig, out: Path, jobs: int = 1, fresh: bool = False, progress: bool = True) -> dict:
    out = Path(out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for stale in (out / "cells").glob("*.tmp*"):  # left by an interrupted run
        stale.unlink()
    manifest_path = out / "study.json"
    digest = cfg.digest()
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("digest") != digest and not fresh:
            raise SystemExit(
                f"{out} holds results of a different study definition (digest {old.get('digest')} != {digest}); "
                "pass --fresh to discard them or --out to write elsewhere"
            )
    if fresh:
        for f in (out / "cells").glob("*.csv"):
            f.unlink()
    manifest = {"digest": digest, "config": cfg.to_json(), "software": software_versions(), "status": "running"}
    atomic_write_text(json.dumps(manifest, indent=2), manifest_path)

    todo = [g for g in cfg.groups() if not _group_paths(out, *g)[0].exists()]
    done_before = len(cfg.groups()) - len(todo)
    print(f"bias study -> {out}: {len(cfg.groups())} groups, {done_before} already done, {len(todo)} to compute "
          f"with {jobs} worker(s); {cfg.draws} Monte Carlo draws per cell and sampler", flush=True)
    t0 = time.perf_counter()
    tasks = [(cfg, out, g) for g in todo]
    bar = tqdm(total=len(tasks), desc="groups", unit="group", disable=not progress)
    computed_now = 0.0
    if jobs > 1 and len(tasks) > 1:
        with get_context("spawn").Pool(jobs) as pool:
            for draws in pool.imap_unordered(_work, tasks):
                computed_now += draws
                bar.update()
    else:
        for task in tasks:
            computed_now += _work(task)
            bar.update()
    bar.close()
    wall = time.perf_counter() - t0

    results = pd.concat([pd.read_csv(_group_paths(out, *g)[0]) for g in cfg.groups()], ignore_index=True)
    conv = pd.concat([pd.read_csv(_group_paths(out, *g)[1]) for g in cfg.groups()], ignore_index=True)
    atomic_write_csv(results, out / "results.csv")
    atomic_write_csv(conv, out / "convergence.csv")
    draws = float(results.loc[results.metric == "draws", "value"].sum())
    compute = float(results.loc[results.metric == "seconds", "value"].sum())
    manifest.update(status="complete", wall_seconds_this_run=wall, groups_computed_this_run=len(todo),
                    total_draws=draws, compute_seconds=compute, draws_per_second_per_worker=draws / compute,
                    draws_per_second_this_run=computed_now / wall if todo else None, jobs=jobs)
    atomic_write_text(json.dumps(manifest, indent=2), manifest_path)
    rate = f"{computed_now / wall:,.0f} draws/s" if todo else "nothing to compute"
    print(f"done in {wall:.1f} s wall ({rate}; {draws:,.0f} Monte Carlo draws in the study, "
          f"{draws / compute:,.0f} draws/s per worker including exact work)", flush=True)
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, sub-minute smoke run")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=None, help="results folder (default reports/bias_study)")
    ap.add_argument("--draws", type=int, default=None, help="Monte Carlo draws per cell and sampler")
    ap.add_argument("--fresh", action="store_true", help="discard stored results of this folder")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--arch", default="tiny", choices=("tiny", "hf-llama", "hf-qwen2"),
                    help="model of every cell (HF architectures need the [hf] extra)")
    a = ap.parse_args(argv)
    cfg = replace(QUICK if a.quick else DEFAULT, arch=a.arch)
    if a.draws is not None:
        if a.draws < 2 * cfg.batches:
            ap.error(f"--draws must be at least {2 * cfg.batches}")
        cfg = replace(cfg, draws=a.draws - a.draws % cfg.batches)
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    name = ("_work/bias_study_quick" if a.quick else "bias_study") + ("" if a.arch == "tiny" else "_" + a.arch)
    out = a.out or (ROOT / "reports" / name)
    run_study(cfg, out, jobs=a.jobs, fresh=a.fresh, progress=not a.no_progress)


if __name__ == "__main__":
    main()
