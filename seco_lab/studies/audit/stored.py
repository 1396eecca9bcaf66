"""Reading an audit folder's stored records, each through :func:`seco_lab.store.read_json` (a FIFO or device in a
record's place is never opened, a file over its size limit is not read, a damaged one is named): a unit
(``units/NAME.json``), the definition (``config.json``) and the sequences (``sequences.json``).  The bottom of the
audit's modules: the tables, the driver and the sources read through it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from ... import store
from ...estimators.schemes import get_scheme
from .config import AuditConfig

__all__ = ["UNIT_COMMON_KEYS", "UNIT_KEYS", "DERIVED_TOLERANCE", "RECOMPUTE_TOLERANCE", "MC_GRAM_TOLERANCE",
           "missing_units", "missing_units_advice", "units_done", "read_audit_config", "read_sequences", "read_unit",
           "strata_of", "unit_problem", "cost_grid_problem"]


#: the keys the tables read from a unit of each stage (beside :data:`UNIT_COMMON_KEYS`); a unit lacking one is damaged
UNIT_KEYS = {"exact": (), "strata": ("sequence", "norm_ratio", "per_tensor_gram", "tensors", "n_layers",
                                     "remainder_ratio", "cpu_s", "wall_s"),
             "mc": ("sequence", "t", "sampler", "draw_gram", "draw_exact", "exact_gram"),
             "cost": ("sequence", "rows"), "data": ("sequence", "g_norm", "loss")}
UNIT_COMMON_KEYS = ("stage", "unit", "unit_wall_s", "unit_cpu_s")

#: a strata unit's ``norm_ratio`` and ``remainder_ratio`` must agree with what its own
#: ``per_tensor_gram`` gives to this relative error.  :func:`~seco_lab.studies.audit.measure.strata_unit` computes
#: them in float64 from that very float64 matrix, and JSON stores every float64 exactly (repr round-trips), so the
#: same operations here give them to the last bit (0.0 in the committed k = 128 units); only another summation order
#: (another numpy) could move them, by ~1e-15.  1e-6 is far above that rounding and far below any edit that changes
#: a table (a ratio edited by 1e-6 moves no printed digit that matters).
DERIVED_TOLERANCE = 1e-6

#: a recomputed sequence's strata must reproduce the stored Gram matrix to this relative (Frobenius) error
#: (:func:`~seco_lab.studies.audit.measure.restore_strata_vectors`)
RECOMPUTE_TOLERANCE = 1e-4

#: a Monte Carlo unit's ``exact_gram`` E must repeat its sequence's strata Gram S (the summed ``per_tensor_gram``)
#: entry by entry: |E_ij - S_ij| <= MC_GRAM_TOLERANCE (d_i + f ||g||) (d_j + f ||g||), d_i = sqrt(S_ii), f =
#: :data:`MC_GRAM_FLOOR`.  Not to the last bit: E is the Gram of the flat float32 strata vectors, which a resumed audit
#: (a fresh clone: they are not committed) recomputes, and a recomputed row differs by float32 noise: ~1e-6 of its norm
#: for g(0..P), and ~1e-7 ||g|| for g(>P), a float32 difference total - sum of strata (its rounding follows ||g||, not
#: its own norm, ~5e-4 ||g||).  Scaled so (Cauchy-Schwarz per entry; the floor f ||g|| for such a row), that noise
#: is ~1e-6 of the bound (2.1e-6 at most in the committed k = 128 units, whose vectors were recomputed): the tolerance
#: 1e-4 (= :data:`RECOMPUTE_TOLERANCE`) leaves it a margin of ~50, while an edit of one entry of g(0..P) by 1% (0.1% on
#: a diagonal), or of the remainder's squared norm by a factor 3, is caught.
MC_GRAM_TOLERANCE = RECOMPUTE_TOLERANCE
MC_GRAM_FLOOR = 3e-2


def unit_problem(unit, stem: str | None = None, strata: dict | None = None) -> str | None:
    """Why a stored unit cannot be used (None when it can): not a JSON object, an unknown stage, a key its stage's
    tables read missing, a name that is not its sequence's (or, given ``stem``, not its file's), an impossible Gram
    matrix, a negative or non-finite time, norm or ratio, a value derived from a Gram matrix that disagrees with it
    (a strata unit's norm ratios; given ``strata``, the usable strata unit of a Monte Carlo unit's sequence, its
    ``exact_gram``), or cost rows that are not one timed step each of the chunks their budget draws."""
    if not isinstance(unit, dict):
        return "not a readable JSON object"
    stage = unit.get("stage")
    if stage not in UNIT_KEYS:
        return f"no audit stage ({str(stage)[:40]!r}; one of {', '.join(UNIT_KEYS)})"
    lacking = [k for k in (*UNIT_COMMON_KEYS, *UNIT_KEYS[stage]) if k not in unit]
    if lacking:
        return f"a {stage} unit without {', '.join(lacking)}"
    if stem is not None and unit.get("unit") != stem:
        return f"a unit named {str(unit.get('unit'))[:40]!r} in the file of {stem!r} (moved or copied over another)"
    if not _named_for(unit):
        what = f"sequence {str(unit.get('sequence'))[:20]!r}"
        if stage == "mc":
            what += f", t {str(unit.get('t'))[:20]}, sampler {str(unit.get('sampler'))[:20]!r}"
        return f"a {stage} unit named {str(unit.get('unit'))[:40]!r} that holds {what} (its name says otherwise)"
    if (why := _gram_problem(unit)) is not None:
        return f"a {stage} unit whose {why}"
    bad = next(((name, v) for name, v in _measured(unit) if not _is_non_negative(v)), None)
    if bad is not None:
        return f"a {stage} unit whose {bad[0]} is {str(bad[1])[:40]} (a time, norm or variance is a finite number >= 0)"
    check = {"strata": _strata_problem, "mc": lambda u: _mc_problem(u, strata), "cost": _cost_rows_problem}.get(stage)
    if check is not None and (why := check(unit)) is not None:
        return f"a {stage} unit whose {why}"
    return None


def _close(have, want: float, tol: float = DERIVED_TOLERANCE) -> bool:
    return _is_non_negative(have) and abs(have - want) <= tol * abs(want) + 1e-300


def _strata_problem(unit: dict) -> str | None:
    """A strata unit's Gram matrices against what it derived from them (:func:`measure.strata_unit`): one Gram per
    tensor, of the R = max_hops + 2 rows g(0..P), g(>P); ``norm_ratio[p]`` = sqrt(G[p, p] / sum G) and
    ``remainder_ratio`` = sqrt(G[-1, -1] / sum G), G the sum over tensors (what the tables read; its ``g_norm``, read by
    no table, is left as stored: a recomputation is checked against the Gram itself, restore_strata_vectors)."""
    try:
        g = np.asarray(unit["per_tensor_gram"], dtype=float)
    except (TypeError, ValueError):
        return "per_tensor_gram is not an array of numbers"
    ratios, tensors = unit["norm_ratio"], unit["tensors"]
    if not isinstance(ratios, list) or not isinstance(tensors, list):
        return "norm_ratio or tensors is not a list"
    R = len(ratios)
    if g.ndim != 3 or g.shape != (len(tensors), R, R):
        return (f"per_tensor_gram has shape {g.shape}, not one {R} x {R} Gram (its {R} norm ratios) for each of its "
                f"{len(tensors)} tensors")
    if isinstance(unit.get("max_hops"), int) and R != unit["max_hops"] + 2:
        return f"norm_ratio holds {R} ratios, not max_hops + 2 = {unit['max_hops'] + 2} (g(0..P) and g(>P))"
    G = g.sum(0)
    g2 = float(G.sum())
    if not g2 > 0:
        return f"per_tensor_gram sums to {g2:g}, the squared norm of g (a positive number)"
    want = np.sqrt(np.maximum(np.diag(G), 0)) / np.sqrt(g2)
    derived = [*((f"norm_ratio[{p}]", r, float(w)) for p, (r, w) in enumerate(zip(ratios, want))),
               ("remainder_ratio", unit["remainder_ratio"], float(want[-1]))]
    for name, have, w in derived:
        if not _close(have, w):
            return (f"{name} {str(have)[:24]} disagrees with its per_tensor_gram, which gives {w:.17g} (relative "
                    f"tolerance {DERIVED_TOLERANCE:g}): the unit was edited")
    return None


def _mc_problem(unit: dict, strata: dict | None) -> str | None:
    """A Monte Carlo unit's matrices: N draws of R rows (``draw_gram`` N x R x N x R, ``draw_exact`` N x R x R,
    ``exact_gram`` R x R, ``subsets`` N sets of t chunks for a uniform sampler) and, given its sequence's strata unit,
    ``exact_gram`` = that unit's summed ``per_tensor_gram`` (the same strata) within :data:`MC_GRAM_TOLERANCE`."""
    try:
        Dg, De, Eg = (np.asarray(unit[k], dtype=float) for k in ("draw_gram", "draw_exact", "exact_gram"))
    except (TypeError, ValueError):
        return "draw_gram, draw_exact or exact_gram is not an array of numbers"
    if Eg.ndim != 2 or De.ndim != 3 or Dg.ndim != 4:
        return "draw_gram, draw_exact or exact_gram is not an array of the shape the draws give"
    n, R = De.shape[0], Eg.shape[0]
    if Eg.shape != (R, R) or De.shape != (n, R, R) or Dg.shape != (n, R, n, R):
        return (f"draw_gram {Dg.shape}, draw_exact {De.shape} and exact_gram {Eg.shape} are not the matrices of "
                f"{n} draws of {R} strata rows")
    subsets, t = unit.get("subsets"), unit["t"]
    if subsets is not None:
        if not isinstance(subsets, list) or len(subsets) != n:
            return f"subsets is not a list of its {n} draws"
        if unit["sampler"] == "uniform" and any(not isinstance(s, list) or len(set(map(str, s))) != t or len(s) != t
                                               for s in subsets):
            return f"subsets holds a draw that is not {t} distinct chunks (a uniform draw of t = {t})"
    if strata is not None and strata.get("sequence") == unit.get("sequence"):
        S = np.asarray(strata["per_tensor_gram"], dtype=float).sum(0)
        if S.shape != Eg.shape:
            return (f"exact_gram is {Eg.shape[0]} x {Eg.shape[1]}, its sequence's strata unit strata-"
                    f"{unit['sequence']} holds {S.shape[0]} x {S.shape[1]} strata")
        scale = np.sqrt(np.clip(np.diag(S), 0, None)) + MC_GRAM_FLOOR * np.sqrt(max(float(S.sum()), 0.0))
        diff = np.abs(Eg - S) / (np.outer(scale, scale) + 1e-300)
        i, j = np.unravel_index(int(np.argmax(diff)), diff.shape)
        if not diff[i, j] <= MC_GRAM_TOLERANCE:
            return (f"exact_gram differs from the Gram of the same strata in strata-{unit['sequence']}.json: entry "
                    f"[{i}][{j}] {Eg[i, j]:.9g} against {S[i, j]:.9g}, {diff[i, j]:.2e} of its scale (tolerance "
                    f"{MC_GRAM_TOLERANCE:g}): one of the two was edited")
    return None


#: the methods of a cost unit's rows: a forward, a SeCO step (all k chunks; no scheme, t, draw or chunks of their
#: own: cost.csv gives them chunks k) and SpaCO steps (one per scheme, budget t and draw)
COST_METHODS = ("forward", "seco", "spaco")


def _cost_rows_problem(unit: dict) -> str | None:
    """A cost unit's rows (:func:`measure.cost_unit`): each a timed step of a known method; a SpaCO row a known
    scheme, an integer budget t >= 1, draw >= 0 and chunk count, exactly t for a uniform sampler (a Bernoulli one
    draws t on average); no two rows of one (method, scheme, t, draw) -- a row relabelled to another budget doubles
    that budget's and empties its own (equal_compute.csv would lose it)."""
    rows = unit["rows"]
    seen: dict[tuple, int] = {}
    for i, row in enumerate(rows if isinstance(rows, list) else []):  # rows of the wrong kind: named by the tables
        if not isinstance(row, dict):
            continue
        if row.get("method") not in COST_METHODS:
            return f"rows[{i}] is not a timed step of one of {', '.join(COST_METHODS)}"
        fields = ("scheme", "t", "draw", "chunks")
        if row["method"] != "spaco":
            if any(k in row for k in fields):
                return (f"rows[{i}] ({row['method']}) carries a scheme, t, draw or chunks (its step backpropagates "
                        "all k chunks; only SpaCO rows have them)")
            key: tuple = (row["method"],)
        else:
            scheme, t, draw, chunks = (row.get(k) for k in fields)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (t, draw, chunks)) or t < 1 \
                    or draw < 0 or chunks < 0:
                return f"rows[{i}] (spaco) has no integer t >= 1, draw >= 0 and chunks >= 0"
            try:
                kind = get_scheme(scheme).sampler.kind
            except (ValueError, TypeError):
                return f"rows[{i}] (spaco) names no known scheme ({str(scheme)[:40]!r})"
            if kind == "uniform" and chunks != t:
                return (f"rows[{i}] (spaco {scheme}, t {t}, draw {draw}) backpropagated {chunks} chunks, not its t = "
                        f"{t} (a uniform draw is exactly t chunks): its t or chunks was edited")
            key = ("spaco", scheme, t, draw)
        if key in seen:
            return (f"rows[{i}] and rows[{seen[key]}] are both the step {'/'.join(map(str, key))} (one row per "
                    "method, scheme, t and draw): a row was relabelled or copied")
        seen[key] = i
    return None


def cost_grid_problem(unit: dict, cfg: AuditConfig) -> str | None:
    """Why a cost unit's SpaCO rows are not this audit's (None when they are): they must be exactly its budgets x
    schemes x cost draws (a row relabelled to another budget or draw leaves its own empty: equal_compute.csv would lose
    that scheme), each of at most k chunks."""
    have = {(r["scheme"], r["t"], r["draw"]): r["chunks"] for r in unit["rows"] if r["method"] == "spaco"}
    want = [(s, t, d) for t in cfg.budgets for s in cfg.schemes for d in range(cfg.cost_draws)]
    lacking, extra = [w for w in want if w not in have], sorted(set(have) - set(want), key=str)
    if lacking or extra:
        say = lambda ks: ", ".join("/".join(map(str, k)) for k in ks[:3]) + (" ..." if len(ks) > 3 else "")  # noqa: E731
        return (f"its SpaCO rows are not this audit's budgets x schemes x draws (lacking {say(lacking) or 'none'}; "
                f"extra {say(extra) or 'none'})")
    over = next((w for w in want if have[w] > cfg.num_chunks), None)
    if over is not None:
        return f"its row spaco/{'/'.join(map(str, over))} records {have[over]} chunks, above k = {cfg.num_chunks}"
    return None


def _named_for(unit: dict) -> bool:
    """The unit's name is the one the audit gives the unit of its sequence (and budget, sampler): a unit whose
    fields were edited, or swapped with another's, would count one sequence twice or put its rows under another."""
    stage, seq, name = unit.get("stage"), str(unit.get("sequence")), unit.get("unit")
    if stage in ("strata", "cost"):
        return name == f"{stage}-{seq}"
    if stage == "mc":
        return name == f"mc-{seq}-t{unit.get('t')}-{unit.get('sampler')}"
    if stage == "data":  # data-NAME, or data-dNN when its windows have their own length (plan.data_name)
        return name == f"data-{seq}" or (isinstance(name, str) and re.fullmatch(r"data-d\d{2,}", name) is not None)
    return True


def _gram_problem(unit: dict) -> str | None:
    """A Gram matrix of the unit that no set of vectors has: not symmetric, or an entry above the product of the
    norms (Cauchy-Schwarz, up to rounding)."""
    for key in ("per_tensor_gram", "exact_gram"):
        value = unit.get(key)
        if not isinstance(value, list):
            continue
        try:
            g = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            return f"{key} is not a matrix of numbers"
        for i, m in enumerate(g.reshape(-1, *g.shape[-2:]) if g.ndim >= 2 else []):
            if m.shape[0] != m.shape[1] or not np.all(np.isfinite(m)):
                return f"{key}[{i}] is not a finite square matrix"
            d = np.sqrt(np.clip(np.diag(m), 0, None))
            bound = np.outer(d, d) * (1 + 1e-9) + 1e-300
            if np.any(np.abs(m - m.T) > 1e-9 * bound) or np.any(np.abs(m) > bound):
                return f"{key}[{i}] is not a Gram matrix (asymmetric, or an entry above the product of the norms)"
    return None


def _is_non_negative(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _measured(unit: dict):
    """(name, value) of what a unit measured that cannot be negative: its times, norms and ratios, the times of
    each cost row, and the diagonals of its Gram matrices (a squared norm each)."""
    for key in ("unit_cpu_s", "unit_wall_s", "g_norm", "remainder_ratio", "seco_vs_dense",
                "strata_plus_remainder_vs_dense", "remainder_vs_dense_minus_sum", "full_strata_sum_vs_dense"):
        if key in unit:
            yield key, unit[key]
    for key in ("cpu_s", "wall_s"):
        value = unit.get(key)
        for part, v in (value.items() if isinstance(value, dict) else [(None, value)] if key in unit else []):
            yield (f"{key}.{part}" if part is not None else key), v
    for i, r in enumerate(unit["norm_ratio"] if isinstance(unit.get("norm_ratio"), list) else []):
        yield f"norm_ratio[{i}]", r
    for i, row in enumerate(unit["rows"] if unit.get("stage") == "cost" and isinstance(unit["rows"], list) else []):
        for key in ("cpu_s", "wall_s"):
            yield f"rows[{i}].{key}", row.get(key) if isinstance(row, dict) else row
    for key in ("per_tensor_gram", "exact_gram"):
        for where, v in _diagonals(unit.get(key), key):
            yield where, v


def _diagonals(m, name: str):
    """The diagonal entries of a square matrix (a list of rows), or of each matrix of a list of them."""
    if not isinstance(m, list) or not m or not isinstance(m[0], list):
        return
    if m[0] and isinstance(m[0][0], list):
        for i, sub in enumerate(m):
            yield from _diagonals(sub, f"{name}[{i}]")
        return
    for i, row in enumerate(m):
        if isinstance(row, list) and i < len(row):
            yield f"{name}[{i}][{i}]", row[i]


def read_unit(path: Path) -> dict | None:
    """A stored unit (a JSON object, read by :func:`seco_lab.store.read_json`), or None when it is damaged: a FIFO
    or device in its place (never opened: a read would wait forever or never end), a file over
    :data:`~seco_lab.store.RECORD_MAX_BYTES`, not JSON, nested too deeply, not an object, unreadable, or lacking
    what its stage's tables read (:func:`unit_problem`)."""
    try:
        unit = store.read_json(path, "audit unit")
    except (OSError, ValueError):
        return None
    return unit if unit_problem(unit, Path(path).stem, strata_of(path, unit)) is None else None


def strata_of(path: Path, unit) -> dict | None:
    """The usable strata unit (``strata-SEQ.json`` beside ``path``) of a Monte Carlo unit's sequence, whose Gram its
    ``exact_gram`` must repeat; None for another unit, or when that strata unit is missing or damaged."""
    if not isinstance(unit, dict) or unit.get("stage") != "mc" or not isinstance(unit.get("sequence"), str):
        return None
    strata_path = Path(path).parent / f"strata-{unit['sequence']}.json"
    if not strata_path.is_file():
        return None
    try:
        strata = store.read_json(strata_path, "audit unit")
    except (OSError, ValueError):
        return None
    return strata if unit_problem(strata, strata_path.stem) is None else None


def read_audit_config(out: Path) -> AuditConfig:
    """The definition an audit folder's ``config.json`` records; a missing file raises FileNotFoundError, a damaged
    one (a FIFO, device, too large, not JSON, not the audit's record) a ValueError naming it."""
    path = Path(out) / "config.json"
    fix = "it is not the record seco-lab audit writes; pass the folder an audit wrote, or rerun the audit"
    record = store.read_json(path, "audit config", store.CONFIG_MAX_BYTES, fix)
    try:
        return AuditConfig.from_json(record["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"audit config {path} holds no readable audit definition ({type(e).__name__}: "
                         f"{str(e)[:80]}); {fix}") from None


def read_sequences(out: Path) -> dict:
    """The sequences an audit folder's ``sequences.json`` records ({} when absent); a damaged one is a ValueError
    naming it."""
    path = Path(out) / "sequences.json"
    if not path.exists() and not path.is_symlink():
        return {}
    specs = store.read_json(path, "audit sequences file", store.RECORD_MAX_BYTES,
                            "rerun the audit (it writes the file again)")
    if not all(isinstance(v, dict) for v in specs.values()):
        raise ValueError(f"audit sequences file {path} holds an entry that is not a sequence's record; rerun the "
                         "audit (it writes the file again)")
    return specs


def units_done(out: str | Path) -> list | None:
    """``audit.json``'s ``units_done`` (the units the stored tables were made from), or None when that file is
    missing, unreadable or holds no such list."""
    try:
        done = store.read_json(Path(out) / "audit.json", "audit summary").get("units_done")
    except (OSError, ValueError, AttributeError):
        return None
    return done if isinstance(done, list) else None


def missing_units(out: str | Path) -> list[str]:
    """The units the stored tables were made from (``audit.json``'s ``units_done``) whose files are gone from
    ``out/units`` (deleted or moved); [] without a readable ``audit.json`` (nothing to compare)."""
    out = Path(out)
    done = units_done(out)
    if done is None:
        return []
    units = out / "units"
    return sorted(str(u) for u in done if not (units / f"{u}.json").exists() and not (units / f"{u}.json").is_symlink())


def missing_units_advice(out: str | Path, lost: list[str]) -> str:
    """What to say when the stored tables were made from units now missing (``lost``): the units, and the three
    ways out that work (``audit --tables-only`` alone refuses, as the tables would lose their rows)."""
    out = Path(out)
    names = ", ".join(lost[:8]) + (f", ... ({len(lost)} in all)" if len(lost) > 8 else "")
    return (f"the stored tables of {out} were made from units now missing in {out / 'units'}: {names}.  Restore "
            f"those unit files; or rerun the audit with its stored settings and --out {out} to compute them again "
            f"(the finished units are kept); or rebuild the tables from the units left, dropping the missing ones: "
            f"`seco-lab audit --tables-only --drop-missing-units --out {out}`")
