"""Would batching the weight-gradient GEMMs of several chunks speed up SeCO's pass 2 at small chunks?

    python -m experiments.gemm_rows [--rows 64] [--groups 8] [--reps 20]

For each linear-layer shape of SmolLM2-135M (hidden 576, q/o 576 x 576, k/v 192 x 576, MLP 1536 x 576 and
576 x 1536) it times, on one thread (CPU time of this process), ``groups`` weight-gradient updates of ``rows``
rows each, ``dW += g^T x`` (one ``addmm_`` per chunk, as :mod:`seco_lab.models.fused_grads` does), against one
update over all their rows at once (the chunks' inputs and output gradients concatenated first).  A ratio
(batched / per chunk) near 1 or above means the per-chunk GEMMs are not what makes small chunks slow.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import MAX_SIZE, at_least

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))  # (out, in) of SmolLM2-135M's linear layers


def cpu_seconds(fn, reps: int) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps


def measure(d_out: int, d_in: int, rows: int, groups: int, reps: int) -> tuple[float, float]:
    """(seconds per chunk-by-chunk round, seconds per batched round) for one weight shape."""
    torch.manual_seed(0)
    w = torch.zeros(d_out, d_in)
    gs = [torch.randn(rows, d_out) for _ in range(groups)]
    xs = [torch.randn(rows, d_in) for _ in range(groups)]

    def per_chunk():
        for g, x in zip(gs, xs):
            w.addmm_(g.t(), x)

    def batched():
        w.addmm_(torch.cat(gs).t(), torch.cat(xs))

    per_chunk(), batched()  # warm-up
    return cpu_seconds(per_chunk, reps), cpu_seconds(batched, reps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=at_least(1, MAX_SIZE), default=64, help="rows per chunk (the chunk size x batch)")
    ap.add_argument("--groups", type=at_least(1, 4096), default=8, help="chunks batched into one GEMM")
    ap.add_argument("--reps", type=at_least(1), default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"dW += g^T x, {a.groups} chunks of {a.rows} rows, one thread, CPU s per round (mean of "
          f"{a.reps})")
    print("| out x in | per chunk, ms | batched, ms | batched / per chunk |\n|---|---|---|---|")
    for d_out, d_in in SHAPES:
        per, batch = measure(d_out, d_in, a.rows, a.groups, a.reps)
        print(f"| {d_out} x {d_in} | {per * 1e3:.2f} | {batch * 1e3:.2f} | {batch / per:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
