"""``seco-lab study train``: the main study (issue 14) and issue 22's extension tiers, resumable.

    seco-lab study train [--quick] [--jobs 2] [--out DIR] [--fresh] [--collect-only] [--part main|extensions|TIER|all]

``main`` runs (or resumes) :class:`~seco_lab.studies.train.study.StudyConfig` into OUT; the extensions
(:func:`seco_lab.studies.train.extensions.extension_plan`) run tier by tier into OUT/equal_compute and
OUT/second_L4, whose fingerprints cover their settings only, so the tiers share a folder and a stopped
tier resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

from .extensions import extension_plan, folder_configs, second_layers, tier_folders, write_costs
from .options import add_arguments
from .study import StudyConfig, collect_partial, quick_config, run_study

__all__ = ["add_arguments", "run_from_args"]


def run_from_args(args) -> int:
    """``seco-lab study train``: run (or resume) the study into ``args.out``, or only collect it; then issue 22's
    extension tiers into ``args.out/equal_compute`` and ``args.out/second_L4`` (each folder's fingerprint covers
    its settings only, so the tiers share it and a stopped tier resumes)."""
    cfg = quick_config() if args.quick else StudyConfig()
    out, jobs = Path(args.out), 2 if args.jobs is None else args.jobs
    tiers = [tier for tier, _ in tier_folders(cfg)]
    if args.part not in ("main", "extensions", "all", *tiers):  # before any folder is read or written
        raise ValueError(f"unknown --part {args.part!r}; use main, extensions, all or one of {tiers}")
    if args.part in ("main", "all"):
        if args.collect_only:
            meta = collect_partial(cfg, out)
        else:
            meta = run_study(cfg, out, jobs=jobs, fresh=args.fresh, progress=args.progress)
        _print_meta("main", meta)
    if args.part == "main":
        return 0
    n_layers = second_layers(cfg)  # 4; 2 under --quick
    plan = extension_plan(cfg, out, n_layers)
    tiers = [p for p in plan if args.part in ("all", "extensions", p[0])]
    unions = folder_configs(cfg, out, n_layers)
    if not args.collect_only:
        for tier, sub, tier_cfg in tiers:
            if not tier_cfg.cells:  # e.g. lr-neighbours under --quick: one rate per optimizer, no neighbour
                print(json.dumps({"part": tier, "status": "nothing to run (the tier has no cells here)"}), flush=True)
                continue
            if tier in ("equal-compute", "second"):
                write_costs(tier_cfg, out / sub, reps=2 if args.quick else 7)
            _print_meta(tier, run_study(tier_cfg, out / sub, jobs=jobs, fresh=args.fresh, progress=args.progress))
            collect_partial(unions[sub], out / sub, ended=True)  # the folder's tables: every finished run
    for sub, union in unions.items():
        if (out / sub / "study.json").exists():
            _print_meta(sub, collect_partial(union, out / sub, ended=True))
    return 0


def _print_meta(part: str, meta: dict) -> None:
    keys = ("status", "runs_done", "study_wall_s", "fingerprint")
    print(json.dumps({"part": part, **{k: meta[k] for k in keys}}), flush=True)
