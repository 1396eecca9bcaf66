"""The training study (issue 14): does the bias of a SpaCO scheme change what the model learns?

    python -m experiments.train_study [--quick] [--jobs 2] [--out DIR] [--fresh]

Resumable: a rerun skips every finished run.  ``python -m seco_lab.train_study.report`` renders
``reports/training_study.md`` from the results.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from seco_lab.train_study import StudyConfig, quick_config, run_study
from seco_lab.train_study.study import collect_partial

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny grid that runs in well under a minute")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default reports/training_study, or runs/training_study_quick)")
    ap.add_argument("--fresh", action="store_true", help="discard finished runs in --out and start over")
    ap.add_argument("--collect-only", action="store_true",
                    help="assemble the runs finished so far (status 'partial') without running anything")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    cfg = quick_config() if args.quick else StudyConfig()
    out = args.out or (ROOT / "runs" / "training_study_quick" if args.quick else ROOT / "reports" / "training_study")
    meta = collect_partial(cfg, out) if args.collect_only else run_study(cfg, out, jobs=args.jobs, fresh=args.fresh)
    print(json.dumps({k: meta[k] for k in ("status", "runs_done", "study_wall_s", "fingerprint")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
