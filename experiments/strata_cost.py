"""How long one stratified pass (hop strata, one relay buffer per hop count) takes
next to one SeCO step on the same model and sequence: median of interleaved repetitions.

    python -m experiments.strata_cost [--layers 2] [--chunks 8] [--chunk-size 4] [--reps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import MAX_SIZE, at_least


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=at_least(1, 4096), default=2)
    ap.add_argument("--chunks", type=at_least(1, 4096), default=8)
    ap.add_argument("--chunk-size", type=at_least(1, MAX_SIZE), default=4)
    ap.add_argument("--reps", type=at_least(1), default=30)
    a = ap.parse_args(argv)
    import numpy as np  # after the arguments are checked: a refusal answers at once
    import torch

    from seco_lab import TinyConfig, TinyTransformer, hop_strata, seco_grad

    torch.set_num_threads(1)
    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, n_layers=a.layers, n_heads=4, n_kv_heads=2,
                                       d_ff=32), seed=0, dtype=torch.float64)
    n = a.chunks * a.chunk_size
    tok = torch.randint(0, 32, (1, n), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(tok, -1, 1)
    runs = {"seco": lambda: seco_grad(model, tok, tgt, a.chunk_size),
            "hop_strata (P = k-1)": lambda: hop_strata(model, tok, tgt, a.chunk_size),
            f"hop_strata (P = L = {a.layers})": lambda: hop_strata(model, tok, tgt, a.chunk_size, max_hops=a.layers)}
    times = {k: [] for k in runs}
    for rep in range(a.reps + 2):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    base = np.median(times["seco"])
    print(f"L={a.layers}, k={a.chunks}, chunk {a.chunk_size}, {model.num_parameters()} parameters, float64, 1 thread")
    for name, v in times.items():
        print(f"{name:24s} {1e3 * np.median(v):8.2f} ms   {np.median(v) / base:5.2f}x SeCO")


if __name__ == "__main__":
    main()
