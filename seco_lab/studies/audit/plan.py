"""The audit's units and their order: which sequences it measures and what each unit computes.

A unit is one stored result (``OUT/units/STEM.json``): ``exact``, ``strata-NAME``, ``cost-NAME``,
``mc-NAME-tT-SAMPLER`` and ``data-NAME`` (see :mod:`seco_lab.studies.audit.measure`).  They run in an order where
each finished one completes a reportable result: the first sequence's strata, the float64 check, the second
sequence's strata (a prose and a code window: the bias table), the first sequence's cost and Monte Carlo at
the smallest budget (with them the equal-compute table), the other sequences' strata, the data sequences,
then the Monte Carlo at the other budgets.
"""

from __future__ import annotations

from ...estimators.schemes import get_scheme
from . import measure
from .config import AuditConfig
from .sources import SequenceSpec, sequence_specs

__all__ = ["plan_units", "sequence_sets", "data_name"]


def sequence_sets(cfg: AuditConfig) -> tuple[list[SequenceSpec], list[SequenceSpec]]:
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
    strata, data = sequence_sets(cfg)
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
