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
from .config import AuditConfig

__all__ = ["UNIT_COMMON_KEYS", "UNIT_KEYS", "missing_units", "missing_units_advice", "units_done", "read_audit_config",
           "read_sequences", "read_unit", "unit_problem"]


#: the keys the tables read from a unit of each stage (beside :data:`UNIT_COMMON_KEYS`); a unit lacking one is damaged
UNIT_KEYS = {"exact": (), "strata": ("sequence", "norm_ratio", "per_tensor_gram", "tensors", "n_layers",
                                     "remainder_ratio", "cpu_s", "wall_s"),
             "mc": ("sequence", "t", "sampler", "draw_gram", "draw_exact", "exact_gram"),
             "cost": ("sequence", "rows"), "data": ("sequence", "g_norm", "loss")}
UNIT_COMMON_KEYS = ("stage", "unit", "unit_wall_s", "unit_cpu_s")


def unit_problem(unit, stem: str | None = None) -> str | None:
    """Why a stored unit cannot be used (None when it can): not a JSON object, an unknown stage, a key its stage's
    tables read missing, a name that is not its sequence's (or, given ``stem``, not its file's), an impossible Gram
    matrix, or a negative or non-finite time, norm or ratio."""
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
    return unit if unit_problem(unit, Path(path).stem) is None else None


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
