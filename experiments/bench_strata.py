"""What LoRA hop strata cost next to a SeCO step, before and after a change, side by side in one run.

    python -m experiments.bench_strata [--before REV] [--length 2048] [--chunk-size 64] [--max-hops 6]
                                       [--rounds 1] [--parallel] [--out reports/bench]

Model: SmolLM2-135M (Q4_1-dequantized, ``seco_lab.models.pretrained``) with LoRA r = 8, alpha = 16 on q/v
(A and B random), float32, on ``--length`` tokens of ``pydoc_data/topics.py`` in chunks of
``--chunk-size``.  One fresh single-threaded process per (revision, round), revisions alternating
within each round (``--parallel``: at the same time).  In each process a warm-up SeCO step, then
SeCO and ``hop_strata(max_hops=P)`` in turn.  Time: the process's CPU time (one thread, so it
counts the work done whatever shares the machine); ratio = strata / SeCO within the process,
median over rounds.  ``--before`` is a git revision of this repository: its ``seco_lab`` is
exported (``git archive``) into a temporary folder and imported by the 'before' processes;
'after' is this checkout.  Results are appended to OUT/strata_cost.csv (one row per process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

if __package__ in (None, ""):  # run as a file (python experiments/X.py): import it as the package it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "experiments"
from .arguments import MAX_SIZE, at_least, check_out_dir, check_revision, positive_seconds
from .child import ROOT, run_child


def child(job: dict) -> dict:
    import torch

    import seco_lab
    from seco_lab import hop_strata, seco_grad
    try:
        from seco_lab.models.hf import HFChunkModel
        from seco_lab.studies.real import RealStudyConfig, load_model, window
    except ImportError:  # a 'before' revision from before the subpackages (d6fd243)
        from seco_lab.hf import HFChunkModel
        from seco_lab.real_study import RealStudyConfig, load_model, window

    torch.set_num_threads(1)
    cfg = RealStudyConfig(text_file=job["text_file"])
    model = HFChunkModel(load_model(cfg, torch.float32, lora=True))
    ids = window(cfg, job["length"])
    tok, tgt, c = ids[:-1], ids[1:], job["chunk_size"]

    def cpu(fn) -> float:
        start = time.process_time()
        fn()
        return time.process_time() - start

    cpu(lambda: seco_grad(model, tok[: 4 * c], tgt[: 4 * c], c))  # warm-up
    seco = cpu(lambda: seco_grad(model, tok, tgt, c))
    strata = cpu(lambda: hop_strata(model, tok, tgt, c, max_hops=job["max_hops"]))
    return {"seco_cpu_s": seco, "strata_cpu_s": strata, "ratio": strata / seco,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "code": str(Path(seco_lab.__file__).parent)}


def export(rev: str, folder: Path) -> None:
    """``seco_lab`` of git revision ``rev`` into ``folder``."""
    archive = subprocess.run(["git", "archive", rev, "seco_lab"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--before", default=None, help="git revision of the 'before' code (omit: 'after' only)")
    ap.add_argument("--length", type=at_least(1, MAX_SIZE), default=2048)
    ap.add_argument("--chunk-size", type=at_least(1, MAX_SIZE), default=64)
    ap.add_argument("--max-hops", type=at_least(0), default=6)
    ap.add_argument("--rounds", type=at_least(1), default=1)
    ap.add_argument("--text-file", default="pydoc_data/topics.py")
    ap.add_argument("--timeout", type=positive_seconds, default=14400, help="seconds per measuring process")
    ap.add_argument("--parallel", action="store_true", help="run a round's revisions at the same time")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    a = ap.parse_args(argv)
    if not a.child:
        if a.length < 4 * a.chunk_size:
            ap.error(f"--length {a.length} must be at least 4 chunks of --chunk-size {a.chunk_size} (the warm-up "
                     f"runs on 4): pass --length {4 * a.chunk_size} or more")
        check_revision(ap, a.before, ROOT)
        check_out_dir(ap, a.out)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    job = {"length": a.length, "chunk_size": a.chunk_size, "max_hops": a.max_hops, "text_file": a.text_file}
    git = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "seco_lab") else "")
    rows = []

    def measure(rnd, tag, code, rev):
        res = run_child("experiments.bench_strata", job, a.timeout, code=code)
        row = {"tag": tag, "rev": rev, "round": rnd, **job, "threads": 1, "parallel": a.parallel,
               "loadavg_1m": os.getloadavg()[0], **{k: v for k, v in res.items() if k != "code"}}
        print(json.dumps(row), flush=True)
        return row

    with tempfile.TemporaryDirectory() as tmp:
        versions = [("after", None, head)]
        if a.before:
            export(a.before, Path(tmp))
            versions.insert(0, ("before", Path(tmp), a.before))
        for rnd in range(a.rounds):
            if a.parallel:  # the revisions of a round at the same time, one process each (CPU time: own work)
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(len(versions)) as pool:
                    rows += list(pool.map(lambda v, r=rnd: measure(r, *v), versions))
            else:
                rows += [measure(rnd, *v) for v in versions]
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "strata_cost.csv"
    from seco_lab.store import atomic_write_csv, start_checksums, verify_checksums
    start_checksums(a.out)  # the report verifies what it reads against what was written
    produce = "the strata-cost benchmark into a new --out"
    # the rows kept are re-recorded with the new ones: they must be as written, not edited
    verified = verify_checksums(a.out, produce, only=(path.name,)) if path.exists() else None
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    if verified is not None:
        verified.check_unchanged(produce)

    atomic_write_csv(path, pd.concat([old, pd.DataFrame(rows)], ignore_index=True))
    print(pd.DataFrame(rows).groupby("tag")[["seco_cpu_s", "strata_cpu_s", "ratio"]].median().to_string())


if __name__ == "__main__":
    main(sys.argv[1:])
