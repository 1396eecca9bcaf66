"""Per-rank memory and step time of FSDP sharding against replicated data parallelism (2 ranks).

    python -m experiments.bench_fsdp [--quick] [--rounds 3] [--steps 4] [--out reports/bench]

Every (round, mode) is a fresh ``torchrun --nproc_per_node 2`` launch of this module's child,
which builds the trainer (``--shard none`` = replicated, ``--shard fsdp`` with each gather
policy) and runs one untimed then ``--steps`` timed optimizer steps of SeCO.  Modes alternate
within a round and rounds repeat (interleaved), so a busy machine slows every mode alike.
Each rank reports its peak resident set (``ru_maxrss``), the resident set before the model
was built (after imports), the median step time and the collectives of its last step.
Children run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set.
Results go to ``OUT/fsdp_results.csv`` (written atomically); ``seco-lab report bench``
renders them (:mod:`seco_lab.report.bench_fsdp`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import at_least, check_out_dir

MODES = {"replicated": ("none", "step"), "fsdp step": ("fsdp", "step"), "fsdp chunk": ("fsdp", "chunk")}
MODEL = dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, d_ff=2048, max_positions=512)  # 34M parameters
QUICK_MODEL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_positions=512)
SEQ, CHUNK = 256, 64
# glibc serves allocations of at least this many bytes with mmap and returns them on free.  Its default
# threshold adapts upwards to 32 MiB, after which freed tensors stay in the heap and the resident
# high-water mark measures the allocator's history more than the tensors alive at once.
MMAP_THRESHOLD = 65536


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(spec: dict) -> None:
    """One rank of one (round, mode): build, warm up, time ``steps`` steps, report."""
    import numpy as np
    import torch

    from seco_lab.config import RunControl, TrainConfig
    from seco_lab.training.sharding import count_collectives
    from seco_lab.training.trainer import Trainer, init_distributed_from_env

    torch.set_num_threads(1)
    init_distributed_from_env()
    base = _rss_mib()
    shard, gather = MODES[spec["mode"]]
    cfg = TrainConfig(mode="seco", data="synthetic", seq_len=SEQ, chunk_size=CHUNK, batch_size=2, steps=100,
                      warmup=1, dtype="float32", model=dict(spec["model"])).validate()
    t = Trainer(cfg, RunControl(run_dir=spec["tmp"], device="cpu", progress=False, shard=shard, fsdp_gather=gather))
    times = []
    for s in range(spec["steps"] + 1):
        batch = t.data.batch("train", s, cfg.batch_size)
        with count_collectives() as counts:
            t0 = time.perf_counter()
            t.train_step(batch)
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rec = {"round": spec["round"], "mode": spec["mode"], "rank": t.rank, "world": t.world,
           "parameters": sum(p.numel() for p in t.model.parameters()), "base_mib": base, "peak_mib": peak,
           "step_s": float(np.median(times[1:])), "all_gather": counts["all_gather"],
           "reduce_scatter": counts["reduce_scatter"], "all_reduce": counts["all_reduce"],
           "loadavg": os.getloadavg()[0]}
    with open(Path(spec["out"]) / f"rank{t.rank}.json", "w") as f:
        json.dump(rec, f)
    from seco_lab.training.launch import leave_process_group

    leave_process_group(0)  # no interpreter teardown: a live gloo thread there can abort a finished rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, timeout: float) -> list[dict]:
    """``torchrun --nproc_per_node 2`` of the child; its two ranks' records."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": tmp, "tmp": str(Path(tmp) / "run")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), "-m", "experiments.bench_fsdp", "--child", json.dumps(spec)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode:
            raise RuntimeError(f"{spec['mode']} round {spec['round']} failed:\n{p.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]


def run(out: Path, rounds: int, steps: int, quick: bool = False, timeout: float = 1800.0) -> Path:
    import pandas as pd

    from seco_lab.store import atomic_write_csv, start_checksums

    out.mkdir(parents=True, exist_ok=True)
    start_checksums(out)  # the report verifies what it reads against what was written
    rows = []
    modes = list(MODES)
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            spec = {"round": r, "mode": mode, "steps": steps, "model": QUICK_MODEL if quick else MODEL}
            got = launch(spec, timeout)
            rows += got
            print(f"round {r} {mode}: peak {max(g['peak_mib'] for g in got):.0f} MiB, "
                  f"step {max(g['step_s'] for g in got):.3f} s", flush=True)
    df = pd.DataFrame(rows).assign(seq_len=SEQ, chunk_size=CHUNK, model=json.dumps(QUICK_MODEL if quick else MODEL),
                                   malloc_mmap_threshold=MMAP_THRESHOLD)
    path = out / "fsdp_results.csv"
    atomic_write_csv(path, df)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run on a tiny model")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--steps", type=at_least(1), default=4, help="timed optimizer steps per launch (after one untimed)")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    check_out_dir(ap, a.out)
    if a.child:
        child(json.loads(a.child))
        return 0
    t0 = time.perf_counter()
    path = run(a.out, a.rounds, a.steps, a.quick)
    print(f"FSDP benchmark written to {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
