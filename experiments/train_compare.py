"""Training-mode comparison: throughput on the text demo configuration and the
far-token loss reached on the synthetic long-range task, for dense, SeCO and
every SpaCO scheme, in one invocation.

    python -m experiments.train_compare [--out reports/training] [--quick]

Writes ``throughput.csv``, ``far_loss.csv``, one run directory per mode under
``OUT/runs`` and ``far_loss.png``; ``seco-lab report train-compare``
writes ``reports/training.md`` from them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from seco_lab.data.sources import KeyValueTask
from seco_lab.estimators.schemes import SCHEME_NAMES
from seco_lab.store import atomic_write_csv, atomic_write_json, software_versions, start_checksums
from seco_lab.training.trainer import RunControl, TrainConfig, Trainer, read_metrics

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import check_out_dir

ROOT = Path(__file__).resolve().parents[1]

# The `make train-demo` configuration: byte-level text, 1024-token sequences, 8 chunks.
DEMO = TrainConfig.from_file(ROOT / "configs" / "demo.toml")
# The synthetic long-range task: a key-value pair in chunk 0 of 8, queried in chunk 7.
SYNTHETIC = TrainConfig(
    mode="seco", data="synthetic", seq_len=64, chunk_size=8, batch_size=16, steps=400,
    lr=3e-3, warmup=20, eval_every=50, eval_batches=4, ckpt_every=400, seed=0,
    model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=32),
)


def modes(base: TrainConfig, budget: int, schemes) -> list[tuple[str, TrainConfig]]:
    out = [("dense", replace(base, mode="dense")), ("seco", replace(base, mode="seco"))]
    out += [(f"spaco {s} t={budget}", replace(base, mode="spaco", scheme=s, budget=budget)) for s in schemes]
    return out


def run(out: Path, quick: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    start_checksums(out)  # the report verifies what it reads against what was written
    runs = ROOT / "runs" / "compare"  # run directories (checkpoints) stay out of reports/
    # 1. throughput, one optimizer step timed at a time, on the demo configuration (t/k = 1/4)
    demo = replace(DEMO, steps=4 if quick else 12, eval_every=1000, ckpt_every=1000)
    k = demo.num_chunks
    rows = []
    for label, cfg in modes(demo, k // 4, ["falling-factorial", "paper-capped"]):
        t = Trainer(cfg, RunControl(run_dir=str(runs / ("tp_" + label.replace(" ", "_"))), overwrite=True,
                                    progress=False))
        t.fit()
        recs = [r for r in read_metrics(t.run_dir) if "tokens_per_s" in r][2:]  # drop warm-up steps
        rows.append({"mode": label, "tokens_per_s": float(np.median([r["tokens_per_s"] for r in recs])),
                     "backprop_chunks": float(np.mean([r["backprop_chunks"] for r in recs])), "k": k,
                     "steps_timed": len(recs)})
        print(rows[-1], flush=True)
    atomic_write_csv(out / "throughput.csv", pd.DataFrame(rows))

    # 2. far-token loss on the synthetic task, every mode and scheme at t/k = 1/4
    syn = replace(SYNTHETIC, steps=60 if quick else SYNTHETIC.steps)
    far = []
    for label, cfg in modes(syn, syn.num_chunks // 4, SCHEME_NAMES):
        t = Trainer(cfg, RunControl(run_dir=str(runs / ("kv_" + label.replace(" ", "_"))), overwrite=True,
                                    progress=False))
        t.fit()
        m = read_metrics(t.run_dir)
        ev = [r for r in m if "eval_far_loss" in r]
        for r in ev:
            far.append({"mode": label, "step": r["step"], "eval_far_loss": r["eval_far_loss"],
                        "eval_loss": r["eval_loss"]})
        print(label, "far loss", ev[0]["eval_far_loss"], "->", ev[-1]["eval_far_loss"], flush=True)
    atomic_write_csv(out / "far_loss.csv", pd.DataFrame(far))
    meta = {"demo": demo.to_dict(), "synthetic": syn.to_dict(), "software": software_versions(),
            "n_keys": KeyValueTask(syn.seq_len, syn.model.vocab_size, syn.n_pairs).n_keys, "quick": quick}
    atomic_write_json(out / "training.json", meta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "training")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    check_out_dir(ap, a.out)
    run(a.out, a.quick)


if __name__ == "__main__":
    main()
