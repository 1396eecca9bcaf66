"""Time and memory of one training step of a real-shaped Hugging Face Llama: forward only,
HF full backprop, HF gradient checkpointing, SeCO and SpaCO (constant relay, bernoulli,
falling-factorial), with and without LoRA, as sequences grow.

    python -m experiments.bench_hf [--quick] [--layers 30] [--lengths 1024 2048 ...] [--chunk-sizes 64 128 512]
                                   [--out reports/bench]

Model: SmolLM2-135M's shape (hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152,
tied embeddings) with random weights, ``--layers`` decoder layers, float32, batch 1,
transformers' sdpa attention (SeCO/SpaCO run it through :class:`seco_lab.models.hf.HFChunkModel`).
SeCO and SpaCO run at every ``--chunk-sizes`` value; SpaCO (t/k = 1/ratio) visits a uniformly random
set of t chunks, a fresh seeded draw each time, and its time is the mean over ``--draws`` draws.
HF full = ``model(ids, labels=ids).loss.backward()``.  Time: one process per (length, lora)
runs every method in turn, round after round (interleaved) after a warm-up round; medians of
both the wall time and the process's CPU time.  On a shared machine run with ``--threads 1``:
a single-threaded process's CPU time counts the work it did, whatever else runs beside it
(wall time does not, and a multi-threaded process's CPU time counts its threads' spin-waits).
Memory: a fresh process per (method, length, lora); peak resident set during the step minus
the resident set after building the model and inputs.  ``os.getloadavg()`` is recorded with
every timing, because the machine is shared.  ``--profile`` adds a torch.profiler table of
one SeCO step's top operators (self CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from seco_lab.core.checks import MAX_THREADS
from seco_lab.estimators.schemes import SCHEME_NAMES
from seco_lab.report.bench_variants import ENGINE_VARIANTS  # the label suffixes of --compare, as the report reads them

if TYPE_CHECKING:
    import pandas as pd

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import MAX_SIZE, at_least, check_out_dir, positive_seconds
from .child import reset_peak_rss, rss_bytes, run_child

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384,
                    tie_word_embeddings=True, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


@dataclass(frozen=True)
class HFBenchConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    chunk_sizes: tuple[int, ...] = (512,)
    n_layers: int = 30
    ratio: int = 8  # SpaCO budget t = k / ratio where k allows
    draws: int = 8  # SpaCO: random draws of the visited chunks per round; its time is the mean over them
    schemes: tuple[str, ...] = ("released-unbiased", "bernoulli", "falling-factorial")
    lora: tuple[bool, ...] = (False, True)
    methods: tuple[str, ...] = ("forward", "hf_full", "hf_checkpoint", "seco", "spaco")
    rounds: int = 3
    warmup: int = 1  # untimed rounds before the timed ones
    seed: int = 0
    threads: int | None = None
    pass1_tokens: int | None = -1  # -1: the adapter's own (HFChunkModel.pass1_tokens); 0: pass 1 chunk by chunk
    compare: tuple[str, ...] = ()  # engine variants (ENGINE_VARIANTS) also timed for SeCO and SpaCO, interleaved
    keep_graphs: int = 0  # SpaCO: drawn chunks whose pass-1 graph pass 2 backpropagates (HFChunkModel.keep_graphs)
    hidden_size: int = SMOLLM2_135M["hidden_size"]
    intermediate_size: int = SMOLLM2_135M["intermediate_size"]
    vocab_size: int = SMOLLM2_135M["vocab_size"]


DEFAULT = HFBenchConfig()
QUICK = replace(DEFAULT, lengths=(128, 256), chunk_sizes=(32,), n_layers=2, hidden_size=72, intermediate_size=128,
                vocab_size=512, rounds=1, threads=1)


CHUNKED = ("seco", "spaco", "chunked_forward")
METHODS = ("forward", "hf_full", "hf_checkpoint", "seco", "spaco", "chunked_forward")


def methods(cfg: HFBenchConfig, n: int) -> list[dict]:
    """The measurements of one length: each method that does not chunk once, each chunked one per chunk size."""
    out = [{"method": m} for m in cfg.methods if m not in CHUNKED]
    for c in cfg.chunk_sizes:
        k = -(-n // c)
        out += [{"method": m, "chunk_size": c} for m in cfg.methods if m in CHUNKED and m != "spaco"]
        if "spaco" in cfg.methods and k % cfg.ratio == 0:
            out += [{"method": "spaco", "scheme": s, "budget": k // cfg.ratio, "ratio": cfg.ratio, "chunk_size": c}
                    for s in cfg.schemes]
    out += [{**m, "variant": v} for v in cfg.compare for m in list(out)
            if m["method"] in (("spaco",) if v == "keep" else ("seco", "spaco"))]
    return out


def rows_of(cfg: HFBenchConfig, m: dict) -> list[int]:
    """The chunk sizes a measurement of ``m`` is stored under (every one for a method that does not chunk)."""
    return [m["chunk_size"]] if "chunk_size" in m else list(cfg.chunk_sizes)




def label(m: dict) -> str:
    base = m["method"] if m["method"] != "spaco" else f"spaco {m['scheme']} t/k=1/{m['ratio']}"
    return base + (ENGINE_VARIANTS[m["variant"]][0] if "variant" in m else "")


def key(m: dict) -> str:
    return label(m) + (f" c={m['chunk_size']}" if "chunk_size" in m else "")


def build(cfg: HFBenchConfig, n: int, lora: bool):
    """(raw HF model, chunk adapter, tokens, targets) with SmolLM2-135M's shape and random weights."""
    import torch

    from seco_lab.models.hf import HFChunkModel, add_lora, build_hf_model

    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    over = {**SMOLLM2_135M, "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": max(SMOLLM2_135M["max_position_embeddings"], n)}
    model = build_hf_model("llama", over, attn_implementation="sdpa", dtype=torch.float32, seed=cfg.seed)
    if lora:
        model = add_lora(model, r=8, alpha=16)
    model.train()  # HF gradient checkpointing is active in training mode only; dropout is 0
    adapter = HFChunkModel(model)
    if cfg.pass1_tokens is not None and cfg.pass1_tokens >= 0:
        adapter.pass1_tokens = cfg.pass1_tokens or None
    adapter.keep_graphs = cfg.keep_graphs
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab_size, (1, n + 1), generator=gen)
    return model, adapter, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@contextmanager
def engine_variant(adapter, name: str):
    """Within: the adapter runs the engine as it was before a change -- ``pass1``: pass 1 chunk by chunk
    (before pass-1 spans); ``fused``: every layer gradient through autograd (before
    seco_lab.models.fused_grads); ``keep``: SpaCO rebuilds every drawn chunk (no graph kept from pass 1);
    ``values``: rebuilt chunks compared by metadata only (before the values check)."""
    if name == "values":
        from seco_lab.core.checks import recompute_check

        with recompute_check("metadata"):
            yield
        return
    attr, value = {"pass1": ("pass1_tokens", None), "fused": ("fused_grads", None), "keep": ("keep_graphs", 0)}[name]
    had = attr in vars(adapter)
    saved, _ = getattr(adapter, attr), setattr(adapter, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(adapter, attr, saved)
        else:
            delattr(adapter, attr)


def step(cfg: HFBenchConfig, m: dict, model, adapter, tokens, targets, draw: int = 0) -> None:
    """One training step's gradient work for method m (no optimizer); .grad is cleared afterwards.
    SpaCO visits a uniformly random set of ``budget`` chunks, seeded by ``draw``."""
    import torch

    from seco_lab import seco_grad, spaco_grad
    from seco_lab.core.engine import cache_leaves, checked_batch

    name = m["method"]
    if "variant" in m:  # the same step with an engine variant (ENGINE_VARIANTS): the engine before a change
        with engine_variant(adapter, m["variant"]):
            return step(cfg, {k: v for k, v in m.items() if k != "variant"}, model, adapter, tokens, targets, draw)
    if name == "forward":
        with torch.no_grad():
            model(input_ids=tokens, labels=tokens)
    elif name in ("hf_full", "hf_checkpoint"):
        if name == "hf_checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=tokens, labels=tokens).loss.backward()
        if name == "hf_checkpoint":
            model.gradient_checkpointing_disable()
    elif name == "seco":
        seco_grad(adapter, tokens, targets, chunk_size=m["chunk_size"])
    elif name == "chunked_forward":
        cache_leaves(adapter, checked_batch(adapter, tokens, targets, m["chunk_size"]))
    else:
        spaco_grad(adapter, tokens, targets, m["chunk_size"], m["scheme"], m["budget"], generator=cfg.seed + draw)
    model.zero_grad(set_to_none=True)


def memory_child(cfg: HFBenchConfig, n: int, lora: bool, m: dict) -> dict:
    """Inside a fresh process: peak resident set of one step above the post-build baseline."""
    built = build(cfg, n, lora)
    reset_peak_rss()
    base = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes())
    step(cfg, m, *built)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": max(peak - base, 0)}


def timing_child(cfg: HFBenchConfig, n: int, lora: bool) -> list[dict]:
    """Inside one process per (length, lora): every method and chunk size, interleaved, after the warm-up
    rounds.  A SpaCO round is the mean over ``cfg.draws`` random draws (draw i of round r seeded r * draws + i)."""
    import torch

    built = build(cfg, n, lora)
    ms = methods(cfg, n)
    times: dict[str, list[float]] = {key(m): [] for m in ms}
    cpu: dict[str, list[float]] = {key(m): [] for m in ms}
    loads: list[float] = []
    for rnd in range(cfg.warmup + cfg.rounds):
        for m in ms:
            draws = cfg.draws if m["method"] == "spaco" else 1
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(draws):
                step(cfg, m, *built, draw=rnd * draws + i)
            if rnd >= cfg.warmup:
                times[key(m)].append((time.perf_counter() - t0) / draws)
                cpu[key(m)].append((time.process_time() - c0) / draws)
                loads.append(os.getloadavg()[0])
    return [{"m": m, "label": label(m), "time_s": float(np.median(times[key(m)])),
             "cpu_s": float(np.median(cpu[key(m)])), "rounds": len(times[key(m)]), "times": times[key(m)],
             "cpu_times": cpu[key(m)], "draws": cfg.draws if m["method"] == "spaco" else 1,
             "threads": torch.get_num_threads(), "load1": float(np.mean(loads)) if loads else float("nan")}
            for m in ms]


def profile_child(cfg: HFBenchConfig, n: int, lora: bool, top: int = 40) -> list[dict]:
    """Top operators (self CPU time) of one SeCO step at the first chunk size, after a warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    built = build(cfg, n, lora)
    m = {"method": "seco", "chunk_size": cfg.chunk_sizes[0]}
    step(cfg, m, *built)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(cfg, m, *built)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:top]] + [{"op": "(total)", "self_cpu_s": total / 1e6, "share": 1.0,
                                                          "calls": 0}]


# ----------------------------------------------------------------------------- driver


def _child(kind: str, cfg: HFBenchConfig, n: int, lora: bool, m: dict | None, timeout: float):
    return run_child("experiments.bench_hf", {"kind": kind, "cfg": asdict(cfg), "n": n, "lora": lora, "m": m}, timeout)


def run(cfg: HFBenchConfig, out: Path, tag: str = "after", timeout: float = 3600.0, memory: bool = True,
        profile_length: int | None = None, timing: bool = True, profile_lora: bool = False) -> pd.DataFrame:
    """Measure, append to ``out/hf_results.csv`` (rows of earlier runs with another tag are kept).  A method
    that does not chunk is measured once per length and stored under every chunk size of the run."""
    import pandas as pd
    from tqdm.auto import tqdm

    from seco_lab.store import atomic_write_csv, start_checksums, verify_checksums

    rows = []
    grid = [(n, lora) for n in cfg.lengths for lora in cfg.lora]
    head_dim = cfg.hidden_size // SMOLLM2_135M["num_attention_heads"]
    common = dict(tag=tag, n_layers=cfg.n_layers,
                  kv_bytes_per_token=2 * cfg.n_layers * SMOLLM2_135M["num_key_value_heads"] * head_dim * 4)
    path = out / "hf_results.csv"
    out.mkdir(parents=True, exist_ok=True)
    start_checksums(out)  # the report verifies what it reads against what was written
    produce = "`make bench-hf` into a new --out"
    # the rows kept are re-recorded with the new ones: they must be as written, not edited
    verified = verify_checksums(out, produce, only=(path.name,)) if path.exists() else None
    old = pd.read_csv(path) if path.exists() else None
    if verified is not None:
        verified.check_unchanged(produce)

    # what this run measures replaces the same rows of an earlier run, nothing else (a memory-only or
    # profile-only run keeps the stored timings of the same lengths)
    kinds = ({"time_s", "cpu_s", "error*"} if timing else set()) | ({"peak_mib", "error"} if memory else set())

    def save():  # after every child: a long run interrupted keeps what it measured
        df = pd.DataFrame(rows)
        if old is not None:
            kind = old.metric.where(~((old.metric == "error") & (old.label == "*")), "error*")
            df = pd.concat([old[~((old.tag == tag) & old.n_layers.eq(cfg.n_layers) & old.length.isin(cfg.lengths)
                                  & old.chunk_size.isin(cfg.chunk_sizes)
                                  & old.label.isin([label(m) for n in cfg.lengths for m in methods(cfg, n)] + ["*"])
                                  & old.lora.isin(cfg.lora) & kind.isin(kinds))], df], ignore_index=True)
        atomic_write_csv(path, df)
        return df

    if profile_length:
        prof = _child("profile", cfg, profile_length, profile_lora, None, timeout)
        if not (isinstance(prof, dict) and "error" in prof):
            c = cfg.chunk_sizes[0]
            atomic_write_csv(out / f"hf_profile_{tag}_c{c}{'_lora' if profile_lora else ''}.csv",
                             pd.DataFrame(prof).assign(tag=tag, length=profile_length, n_layers=cfg.n_layers,
                                                       chunk_size=c, lora=profile_lora))
    for n, lora in tqdm(grid if timing else [], desc="time (interleaved)"):
        res = _child("timing", cfg, n, lora, None, timeout)
        for r in ([] if isinstance(res, dict) else res):
            for metric, per_round in (("time_s", "times"), ("cpu_s", "cpu_times")):
                rows += [{**common, "chunk_size": c, "length": n, "lora": lora, "label": r["label"],
                          "metric": metric, "value": r[metric], "rounds": r["rounds"], "load1": r["load1"],
                          "threads": r["threads"], "draws": r["draws"],
                          "note": " ".join(f"{t:.9e}" for t in r[per_round])} for c in rows_of(cfg, r["m"])]
        if isinstance(res, dict):
            rows += [{**common, "chunk_size": c, "length": n, "lora": lora, "label": "*", "metric": "error",
                      "value": np.nan, "note": res["error"]} for c in cfg.chunk_sizes]
        save()
    jobs = [(n, lora, m) for n, lora in grid for m in methods(cfg, n)] if memory else []
    for n, lora, m in tqdm(jobs, desc="memory (fresh process each)"):
        r = _child("memory", cfg, n, lora, m, timeout)
        rows += [{**common, "chunk_size": c, "length": n, "lora": lora, "label": label(m),
                  "metric": "error" if "error" in r else "peak_mib",
                  "value": np.nan if "error" in r else r["peak_bytes"] / (1 << 20), "rounds": 1,
                  "load1": os.getloadavg()[0], "note": r.get("error", "")} for c in rows_of(cfg, m)]
        save()
    return save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sub-minute smoke run on a tiny Llama")
    ap.add_argument("--layers", type=at_least(1, 4096), default=None, help="decoder layers (SmolLM2-135M has 30)")
    ap.add_argument("--lengths", type=at_least(1, MAX_SIZE), nargs="+", default=None)
    ap.add_argument("--rounds", type=at_least(1), default=None)
    ap.add_argument("--warmup", type=at_least(0), default=None, help="untimed rounds first (default 1)")
    ap.add_argument("--chunk-sizes", type=at_least(1, MAX_SIZE), nargs="+", default=None,
                    help="chunk sizes of SeCO/SpaCO (default 512); each is a row of its own")
    ap.add_argument("--draws", type=at_least(1), default=None,
                    help="SpaCO: random draws per round, averaged (default 8)")
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="torch threads per process (1 on a shared machine)")
    ap.add_argument("--lora-only", action="store_true")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=None)
    ap.add_argument("--schemes", nargs="+", default=None, choices=SCHEME_NAMES,
                    help=f"SpaCO schemes (default: {' '.join(DEFAULT.schemes)})")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--profile", type=at_least(1), default=None,
                    help="length of the profiled SeCO step (at the first chunk size)")
    ap.add_argument("--profile-lora", action="store_true", help="profile the LoRA model")
    ap.add_argument("--pass1-tokens", type=at_least(0, MAX_SIZE), default=None,
                    help="tokens the engine's pass 1 forwards at once (default: the adapter's, 512; 0: chunk by chunk, "
                         "the engine before pass-1 spans)")
    ap.add_argument("--compare", nargs="+", choices=tuple(ENGINE_VARIANTS), default=None,
                    help="also time SeCO and SpaCO with the engine before a change, interleaved in the same process: "
                         "pass1 = pass 1 chunk by chunk (before pass-1 spans), fused = every layer gradient through "
                         "autograd (before seco_lab.models.fused_grads), keep = SpaCO without kept pass-1 graphs")
    ap.add_argument("--pass1-compare", action="store_true", help="the same as --compare pass1")
    ap.add_argument("--keep-graphs", type=at_least(0, MAX_SIZE), default=None,
                    help="SpaCO: pass 1 keeps the graphs of the last N drawn chunks for pass 2 (default 0; "
                         "--compare keep times the same steps with none kept)")
    ap.add_argument("--timeout", type=positive_seconds, default=3600.0,
                    help="seconds a measuring process may run before it is stopped and its rows recorded as errors "
                         "(default 3600; an 8K SpaCO run over 8 draws on a busy machine takes longer)")
    ap.add_argument("--tag", default="after", help="label of this run in the CSV (e.g. before/after a change)")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.no_lora and a.lora_only:
        ap.error("--no-lora and --lora-only exclude each other: give one (neither measures both)")
    if a.no_time and a.no_memory and a.profile is None:
        ap.error("--no-time --no-memory without --profile measures nothing")
    if a.threads is not None and a.threads > MAX_THREADS:
        ap.error(f"--threads {a.threads}: at most {MAX_THREADS} (this machine has {os.cpu_count()} cores)")
    check_out_dir(ap, a.out)
    if a.child:
        job = json.loads(a.child)
        cfg = HFBenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["cfg"].items()})
        fn = {"timing": lambda: timing_child(cfg, job["n"], job["lora"]),
              "memory": lambda: memory_child(cfg, job["n"], job["lora"], job["m"]),
              "profile": lambda: profile_child(cfg, job["n"], job["lora"])}[job["kind"]]
        print(json.dumps(fn()))
        return
    cfg = QUICK if a.quick else DEFAULT
    over = {"n_layers": a.layers, "lengths": tuple(a.lengths) if a.lengths else None, "rounds": a.rounds,
            "methods": tuple(a.methods) if a.methods else None, "schemes": tuple(a.schemes) if a.schemes else None,
            "lora": (False,) if a.no_lora else (True,) if a.lora_only else None, "warmup": a.warmup,
            "chunk_sizes": tuple(a.chunk_sizes) if a.chunk_sizes else None, "draws": a.draws, "threads": a.threads,
            "pass1_tokens": a.pass1_tokens, "keep_graphs": a.keep_graphs,
            "compare": tuple(dict.fromkeys((a.compare or []) + (["pass1"] if a.pass1_compare else []))) or None}
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
    t0 = time.perf_counter()
    run(cfg, a.out, a.tag, timeout=a.timeout, memory=not a.no_memory, profile_length=a.profile, timing=not a.no_time,
        profile_lora=a.profile_lora)
    print(f"HF benchmark ({a.tag}) written to {a.out / 'hf_results.csv'} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
