"""Time and memory of one training step (forward + backward, no optimizer):
forward only, dense, dense with layer-wise checkpointing, SeCO, and SpaCO at
several budgets (a constant-relay scheme and the stratified falling-factorial
scheme), as sequences grow.

    python -m experiments.bench [--quick] [--out reports/bench] [--device cpu|cuda]

Memory: every (method, length) runs in a fresh process; CPU peak = peak resident
set after the step minus the resident set after building the model and inputs;
GPU peak = the allocator's peak minus its baseline.  A configuration whose
process exceeds the memory cap (RLIMIT_AS on CPU) is recorded as out of memory.
Time: one process per length builds the model once and runs every method in
turn, round after round (interleaved), after a warm-up round; the median over
rounds is reported, so the ratios are taken side by side on a noisy machine.
On CPU the process's CPU time is recorded beside the wall time; with
``--threads 1`` it counts the step's work whatever else shares the machine,
and the report's ratios use it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import MAX_SIZE, at_least, check_out_dir, check_threads
from .child import reset_peak_rss, rss_bytes, run_child

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    chunk_size: int = 256
    ratios: tuple[int, ...] = (2, 4, 8, 16)  # SpaCO budgets t = k / ratio, where k allows
    constant_scheme: str = "released-unbiased"
    stratified_scheme: str = "falling-factorial"
    model: dict = field(default_factory=lambda: dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                                                     n_kv_heads=2, d_ff=512, max_positions=1 << 16))
    batch: int = 1
    rounds: int = 3
    memory_cap_gib: float = 14.0
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None  # torch threads per process; None: every core


DEFAULT = BenchConfig()
QUICK = replace(DEFAULT, lengths=(1024, 2048), chunk_size=256, ratios=(2,),
                model=dict(vocab_size=256, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256,
                           max_positions=4096), rounds=2, threads=1)


def methods(cfg: BenchConfig, n: int) -> list[dict]:
    k = -(-n // cfg.chunk_size)
    out = [{"method": "forward"}, {"method": "dense"}, {"method": "checkpoint"}, {"method": "seco"}]
    for r in cfg.ratios:
        if k % r == 0 and k // r >= 1:
            for scheme in (cfg.constant_scheme, cfg.stratified_scheme):
                out.append({"method": "spaco", "scheme": scheme, "budget": k // r, "ratio": r})
    return out


def label(m: dict) -> str:
    return m["method"] if m["method"] != "spaco" else f"spaco {m['scheme']} t/k=1/{m['ratio']}"


# ----------------------------------------------------------------------------- one step


def build(cfg: BenchConfig, n: int, device: str):
    import torch

    from seco_lab import TinyConfig, TinyTransformer

    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    model = TinyTransformer(TinyConfig(**cfg.model), seed=cfg.seed, dtype=getattr(torch, cfg.dtype), device=device)
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.model["vocab_size"], (cfg.batch, n + 1), generator=gen)
    return model, tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def step(cfg: BenchConfig, m: dict, model, tokens, targets) -> None:
    """One training step's gradient work for method m (no optimizer)."""
    import torch

    from seco_lab import dense_grad, seco_grad, spaco_grad
    from seco_lab.core.engine import cache_leaves, checked_batch

    if m["method"] == "forward":
        with torch.no_grad():
            cache_leaves(model, checked_batch(model, tokens, targets, cfg.chunk_size))
    elif m["method"] in ("dense", "checkpoint"):
        model.checkpoint_layers = m["method"] == "checkpoint"
        dense_grad(model, tokens, targets)
        model.checkpoint_layers = False
    elif m["method"] == "seco":
        seco_grad(model, tokens, targets, chunk_size=cfg.chunk_size)
    else:
        k = -(-tokens.shape[1] // cfg.chunk_size)
        subset = tuple(range(k - m["budget"], k))  # a fixed set: equal work on every round
        spaco_grad(model, tokens, targets, cfg.chunk_size, m["scheme"], m["budget"], subset=subset)


def _sync(device):
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def memory_child(cfg: BenchConfig, n: int, m: dict, device: str) -> dict:
    """Runs inside a fresh process: peak memory of one step above the post-build baseline."""
    import torch

    model, tokens, targets = build(cfg, n, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(cfg, m, model, tokens, targets)
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - base}
    reset_peak_rss()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = max(base, rss_bytes())
    step(cfg, m, model, tokens, targets)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": max(peak - base, 0)}


def timing_child(cfg: BenchConfig, n: int, device: str) -> list[dict]:
    """Runs inside one process per length: every method, interleaved, ``rounds`` times after a warm-up."""

    model, tokens, targets = build(cfg, n, device)
    ms = methods(cfg, n)
    skip = set()
    times: dict[str, list[float]] = {label(m): [] for m in ms}
    cpu: dict[str, list[float]] = {label(m): [] for m in ms}
    for rnd in range(cfg.rounds + 1):
        for m in ms:
            if label(m) in skip:
                continue
            try:
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                step(cfg, m, model, tokens, targets)
                _sync(device)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
            except (MemoryError, RuntimeError) as e:  # out of memory under the cap
                if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
                    raise
                skip.add(label(m))
                continue
            if rnd > 0:
                times[label(m)].append(dt)
                cpu[label(m)].append(dc)
    return [{"length": n, "label": lab, "time_s": float(np.median(v)) if v else np.nan,
             "cpu_s": float(np.median(cpu[lab])) if v and not device.startswith("cuda") else np.nan, "rounds": len(v)}
            for lab, v in times.items()]


# ----------------------------------------------------------------------------- driver


def _limit_memory(cap_gib: float):
    """The child's address-space cap: ``cap_gib``, or the limit already set on this process if lower (a process
    cannot raise its hard limit: ``setrlimit`` above it fails in the child, which then never starts)."""
    def apply():
        cap = int(cap_gib * (1 << 30))
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))

    return apply


def _run_child(kind: str, cfg: BenchConfig, n: int, m: dict | None, device: str, timeout: float) -> dict | list:
    preexec = _limit_memory(cfg.memory_cap_gib) if not device.startswith("cuda") else None
    return run_child("experiments.bench", {"kind": kind, "cfg": asdict(cfg), "n": n, "m": m, "device": device},
                     timeout, preexec)


def run(cfg: BenchConfig, out: Path, device: str, timeout: float = 900.0) -> pd.DataFrame:
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    jobs = [(n, m) for n in cfg.lengths for m in methods(cfg, n)]
    for n, m in tqdm(jobs, desc="memory (fresh process each)"):
        r = _run_child("memory", cfg, n, m, device, timeout)
        base = {"length": n, "label": label(m), **{k: m.get(k) for k in ("method", "scheme", "budget", "ratio")}}
        if "error" in r:
            rows.append({**base, "metric": "error", "value": np.nan, "note": r["error"]})
        else:
            rows.append({**base, "metric": "peak_mib", "value": r["peak_bytes"] / (1 << 20), "note": ""})
    meta_by_label = {(n, label(m)): m for n, m in jobs}
    for n in tqdm(cfg.lengths, desc="time (interleaved)"):
        res = _run_child("timing", cfg, n, None, device, timeout * 4)
        if isinstance(res, dict) and "error" in res:
            for (ln, lab), m in meta_by_label.items():
                if ln == n:
                    rows.append({"length": n, "label": lab, "metric": "error", "value": np.nan, "note": res["error"],
                                 **{k: m.get(k) for k in ("method", "scheme", "budget", "ratio")}})
            continue
        for r in res:
            m = meta_by_label[(n, r["label"])]
            for metric in ("time_s", "cpu_s"):
                if np.isfinite(r.get(metric, np.nan)):
                    rows.append({"length": n, "label": r["label"], "metric": metric, "value": r[metric], "note": "",
                                 **{k: m.get(k) for k in ("method", "scheme", "budget", "ratio")}})
    df = pd.DataFrame(rows)
    from seco_lab.store import atomic_write_csv, atomic_write_json, software_versions, start_checksums
    start_checksums(out)  # the report verifies what it reads against what was written

    atomic_write_csv(out / "results.csv", df)
    import torch

    dev_name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    n_params = sum(p.numel() for p in build(cfg, cfg.lengths[0], "cpu")[0].parameters())
    atomic_write_json(out / "bench.json", {"config": asdict(cfg), "device": device, "device_name": dev_name,
                                           "n_params": n_params, "software": software_versions()})
    return df


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sub-minute smoke run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="torch threads per process (1 on a shared machine)")
    ap.add_argument("--lengths", type=at_least(1, MAX_SIZE), nargs="+", default=None,
                    help="sequence lengths (default 1K-16K; at most the model's positions)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    check_threads(ap, a.threads)
    if a.device != "auto":
        from seco_lab.config import parse_device

        try:
            parse_device(a.device)
        except ValueError as e:
            ap.error(f"--device: {e}")
    check_out_dir(ap, a.out)
    longest = (QUICK if a.quick else DEFAULT).model["max_positions"]
    if a.lengths and max(a.lengths) > longest:
        ap.error(f"--lengths: {max(a.lengths):,} tokens exceed the benchmark model's {longest:,} positions"
                 f"{' (--quick)' if a.quick else ''}; pass lengths <= {longest:,}")
    if a.child:
        job = json.loads(a.child)
        cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["cfg"].items()})
        if job["kind"] == "memory":
            print(json.dumps(memory_child(cfg, job["n"], job["m"], job["device"])))
        else:
            print(json.dumps(timing_child(cfg, job["n"], job["device"])))
        return
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    cfg = QUICK if a.quick else DEFAULT
    if a.threads is not None:
        cfg = replace(cfg, threads=a.threads)
    if a.lengths:
        cfg = replace(cfg, lengths=tuple(a.lengths))
    suffix = "" if device == "cpu" else "_gpu"
    out = a.out or ROOT / "reports" / (("_work/bench_quick" if a.quick else "bench") + suffix)
    t0 = time.perf_counter()
    run(cfg, out, device)
    print(f"benchmark written to {out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
