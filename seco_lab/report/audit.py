"""The audit report: a real model's hop strata, each scheme's exact bias, sampling noise against data noise,
and the equal-compute comparison with SeCO, generated from the tables ``seco-lab audit`` stores.

``write_report(results, out_md)`` renders whatever units are finished and says which are not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from ..store import (
    RECORD_MAX_BYTES,
    TABLE_MAX_BYTES,
    extra_fields,
    pandas_source,
    read_checked_bytes,
    read_csv,
    read_json,
)
from ..studies.registry import STUDIES
from .exactness import EXACT_TOL, above_tol, not_exact
from .figures import figure_folder, new_figure, save_figure
from .markdown import (
    MissingResultsError,
    fmt,
    generated_note,
    left_out,
    read_json_table,
    stored_file,
    table,
    verified_beside,
    write_markdown,
)

__all__ = ["write_report", "render", "audit_report", "DEFAULT_DIR", "PRODUCE"]

DEFAULT_DIR = Path("reports/audit/k128")
PRODUCE = "`make audit` (`seco-lab audit --committed --out reports/audit/k128`)"
# the other profiles on the figure: the toy k = 128 groups of the bias study and the real k = 16 cells (folder, file)
TOY = (Path("reports/bias_study"), "groups.csv")
REAL_K16 = (Path("reports/real_study/k16x16"), "strata.csv")
#: the columns the figure reads of each reference table
REFERENCE_COLUMNS = {"bias": ("k", "L", "seed", "metric", "value"), "real": ("params", "p", "norm_ratio")}


def _read(path: Path) -> pd.DataFrame:
    """A stored table, empty when it is absent or has no header (a table of no finished unit); a FIFO, device,
    folder or huge file is refused (:func:`~seco_lab.report.markdown.stored_file`), never opened."""
    try:
        stored_file(path, "stored results table", TABLE_MAX_BYTES, PRODUCE)
        df = pd.read_csv(**pandas_source(path))  # inside store.pinned: the bytes verified
        if problem := extra_fields(df):
            raise MissingResultsError(f"{path}: {problem}: the file is damaged; rerun {PRODUCE}")
        return df
    except MissingResultsError:
        raise
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame()
    except (ValueError, OSError) as e:  # ParserError, not UTF-8
        raise MissingResultsError(f"{path} cannot be read as CSV ({type(e).__name__}): rerun {PRODUCE}") from None


def _reference(root: Path, where: tuple[Path, str], study: str, what: str, notes: list[str],
               settings: dict | None = None) -> pd.DataFrame:
    """A reference table beside the audit (another study's), read verified; when absent, empty and a note.
    ``settings``: filled with the study's recorded settings (``study.json``'s ``config``), read verified too, for
    the curve's label."""
    folder, name = where
    produce = STUDIES[study].produce
    with verified_beside(root / folder, produce, name) as present:  # read verified, like the audit's own tables
        df = _read(root / folder / name) if present else pd.DataFrame()
        lacking = [c for c in REFERENCE_COLUMNS[study] if len(df.columns) and c not in df.columns]
        if lacking:  # as written, but another table: e.g. the folder a link to another study's
            raise MissingResultsError(f"this report also draws from {root / folder / name}, which has no "
                                      f"{', '.join(lacking)} column: it is not the {study} study's table (the folder a "
                                      f"link to another study's, or another study written there?); put the {study} "
                                      f"study's results there, or rerun {produce}")
        if settings is not None and len(df):
            record = read_json_table(root / folder / "study.json", produce)
            if not isinstance(record.get("config"), dict):
                raise MissingResultsError(f"{root / folder / 'study.json'} records no settings (no \"config\" "
                                          f"object): rerun {produce}")
            settings.update(record["config"])
    if not present or not len(df):
        absent = ("does not exist below the current directory (the audit looks for the other studies there: run "
                  "the report from the repository root)" if root == Path(".") else f"does not exist below {root}")
        notes.append(left_out(what, folder / name, absent if not present else "holds no rows", produce))
    return df


def profile_figure(results: Path, fig_dir: Path, root: Path, cfg: dict, notes: list[str] | None = None) -> str | None:
    """||g(p)|| / ||g|| against p on a log scale: toy k = 128, the real study's (k = 16 as committed), real (this
    audit).  A reference curve
    left out is said in ``notes``."""
    notes = [] if notes is None else notes
    strata = _read(results / "strata.csv")
    k = -(-cfg["length"] // cfg["chunk_size"])
    fig, ax = new_figure(figsize=(7, 4.4))
    ax = ax[0][0]
    toy = _reference(root, TOY, "bias", "the toy k = 128 curves of the strata profile", notes)
    if len(toy):
        rows = toy[(toy.k == 128) & toy.metric.str.startswith("stratum_norm_p")]
        if not len(rows):
            notes.append(left_out("the toy k = 128 curves of the strata profile", TOY[0] / TOY[1],
                                  "holds no k = 128 strata", STUDIES["bias"].produce))
        for (L, seed), g in rows.groupby(["L", "seed"]):
            p = g.metric.str.removeprefix("stratum_norm_p").astype(int)
            ax.plot(p, g.value, ":", color="grey", marker=".", label=f"toy L={L}, k=128 (seed {seed})")
    real_cfg: dict = {}
    real16 = _reference(root, REAL_K16, "real", "the SmolLM2 curve of the strata profile", notes, real_cfg)
    if len(real16):
        r = real16[real16.params == "lora"]
        if not len(r):
            notes.append(left_out("the SmolLM2 curve of the strata profile", REAL_K16[0] / REAL_K16[1],
                                  "holds no LoRA rows", STUDIES["real"].produce))
        # the settings the real study ran with (a rerun with --num-chunks / --chunk-size writes there too): positive
        # integers as recorded -- not coerced, so a vouched-for ``true`` or 16.7 is refused, never labelled k = 1 or 16
        k_real, c_real = real_cfg.get("num_chunks"), real_cfg.get("chunk_size")
        if not all(type(v) is int and v > 0 for v in (k_real, c_real)):
            raise MissingResultsError(f"{root / REAL_K16[0] / 'study.json'} does not record num_chunks and chunk_size"
                                      f" as positive integers (it holds {k_real!r} and {c_real!r}): rerun "
                                      f"{STUDIES['real'].produce}")
        ax.plot(r.p, r.norm_ratio, "--", marker="s", color="tab:blue",
                label=f"SmolLM2 LoRA, k={k_real} ({k_real * c_real} tok)")
    for name, g in strata.groupby("sequence"):
        g = g[(g.p != "rest") & (g.norm_ratio > 0)]  # exact zeros (p > L) have no place on a log scale
        ax.plot(g.p.astype(int), g.norm_ratio, "-", marker="o",
                label=f"{cfg['model']} {cfg['params']}, k={k}, {name} ({g.kind.iloc[0]})")
    if not len(strata) and not len(toy) and not len(real16):
        return None
    ax.set_yscale("log")
    ax.set_xlabel("hops p")
    ax.set_ylabel("‖g(p)‖ / ‖g‖")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, fig_dir / "audit_strata_profile.png")


def render(results: Path, out_md: Path, root: Path = Path(".")) -> list[str]:
    """The report's Markdown blocks: whatever units are finished, and which are not."""
    results = Path(results)
    audit = read_json_table(results / "audit.json", PRODUCE)
    cfg = audit.get("config")
    if not isinstance(cfg, dict):
        raise MissingResultsError(f"{results / 'audit.json'} records no audit settings (no \"config\" object): "
                                  f"rerun {PRODUCE}")
    return [*_header(results, out_md, cfg), *_what_ran(audit, cfg), *_exactness(audit.get("exactness")),
            *_profile(results, out_md, root, cfg), *_bias(results), *_noise(results, cfg), *_cost(results, cfg),
            *_equal_compute(results, audit), *ASSUMPTIONS]


def _produce(results: Path, cfg: dict) -> str:
    """How to rerun what the report shows: the committed study's command for the committed settings; for any other
    audit, the settings stored beside it (campaign 29 S11: a user's own audit was said to come from `--committed`)."""
    from ..studies.audit.config import COMMITTED, AuditConfig

    try:
        committed = AuditConfig.from_json(cfg).digest() == COMMITTED.digest()  # the definition: threads aside
    except (KeyError, TypeError, ValueError, AttributeError):
        committed = False
    if committed:
        return PRODUCE
    return (f"the `seco-lab audit` settings recorded in `{results / 'config.json'}` (`{results / 'audit.json'}` "
            "names the command that last wrote them)")


def _header(results: Path, out_md: Path, cfg: dict) -> list[str]:
    k = -(-cfg["length"] // cfg["chunk_size"])
    model = ("SmolLM2-135M-Instruct, Q4_1-dequantized GGUF weights, not the original float weights"
             if cfg["model"] == "smollm2-135m" else "as named")
    grad = (f"LoRA r = {cfg['lora_r']}, α = {cfg['lora_alpha']} on {'/'.join(cfg['lora_targets'])} (A and B random)"
            if cfg["params"] == "lora" else "every parameter")
    budgets = ", ".join(map(str, cfg["budgets"]))
    texts = ", ".join(f"`{t}`" for t in cfg["texts"])
    return ["# Audit: a chunk-wise gradient estimator on a real model\n",
            generated_note("audit", results, out_md, _produce(results, cfg)),
            f"Model `{cfg['model']}` ({model}); gradient: {grad}; {cfg['dtype']}; {cfg['length']:,} tokens in chunks "
            f"of {cfg['chunk_size']} (k = {k}); budgets t ∈ {{{budgets}}}; hop strata g(p), p ≤ P = "
            f"{cfg['max_hops']}, plus the measured remainder g(>P) = g_SeCO − Σ_p g(p). Texts: {texts}. The formulas: "
            "`docs/audit.md`.\n"]


def _what_ran(audit: dict, cfg: dict) -> list[str]:
    md = ["## What ran\n"]
    rows = [{"stage": s, "units": v["units"], "wall h": v["wall_s"] / 3600, "CPU h": v["cpu_s"] / 3600,
             "wall per unit (min)": v["wall_s"] / 60 / v["units"],
             "peak RSS (GiB)": "n/a" if v.get("peak_rss_gib") is None else f"{v['peak_rss_gib']:.2f}"}
            for s, v in audit["stages"].items()]
    if rows:
        md.append(table(pd.DataFrame(rows), ("units",)))
    missing = audit["units_missing"]
    cpus = audit.get("versions", {}).get("cpus", "?")
    md.append("\nPeak RSS: the process's high-water mark when the stage's units finished (a resumed run restarts "
              "it), an upper bound on what one unit needs.")
    md.append(f"\nThreads: {cfg['threads']} per unit on a machine of {cpus} CPUs, shared with other work (wall times "
              f"include waiting for the CPU). Finished units: {len(audit['units_done'])}; not (yet) run: "
              + (", ".join(f"`{m}`" for m in missing) if missing else "none") + ".\n")
    for stem, why in audit.get("units_unusable", {}).items():
        md.append(f"- **`{stem}` is stored but {why}**: left out of every table below; rerun the audit.\n")
    return md


#: the float64 exactness checks of the audit's exact unit: relative errors against dense autograd
EXACT_CHECKS = ("seco_vs_dense", "strata_plus_remainder_vs_dense", "remainder_vs_dense_minus_sum",
                "full_strata_sum_vs_dense")


def _exactness(ex: dict | None) -> list[str]:
    if not ex:
        return []
    failed = above_tol(ex, EXACT_CHECKS)  # the float64 rule of every report (:mod:`.exactness`)
    verdict = (f"All four within {EXACT_TOL:g} of dense autograd: exact to float64 rounding.\n" if not failed else
               f"{not_exact(failed)} The chunked gradients differ from dense "
               "autograd on this model; the tables below rest on them and are not to be trusted.\n")
    return ["## Exactness (float64)\n",
            f"{ex['tokens']} tokens of `{Path(ex['text']).name}` in {ex['num_chunks']} chunks of "
            f"{ex['chunk_size']}, P = {ex['max_hops']}: SeCO vs dense {ex['seco_vs_dense']:.1e}; Σ_p g(p) + "
            f"g(>P) vs dense {ex['strata_plus_remainder_vs_dense']:.1e}; remainder vs dense − Σ_p g(p) "
            f"{ex['remainder_vs_dense_minus_sum']:.1e} (‖g(>P)‖/‖g‖ = {ex['remainder_ratio']:.2g}); full "
            f"decomposition (P = k − 1) vs dense {ex['full_strata_sum_vs_dense']:.1e}. " + verdict]


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _profile(results: Path, out_md: Path, root: Path, cfg: dict) -> list[str]:
    strata = _read(results / "strata.csv")
    notes: list[str] = []
    # the bare figures/ folder is audit.md's, and that of the report.md an audit folder holds -- ``report`` is the
    # audit's own name only there: any other report.md (beside a committed audit.md) gets its own (campaign 25 N6)
    own = ("audit", "report") if _same_folder(out_md.parent, results) else ("audit",)
    fig_dir = figure_folder(out_md, own, "")
    fig = profile_figure(results, fig_dir, root, cfg, notes)
    md = ["## The strata profile\n"]
    if fig:
        md.append(f"![strata profile]({Path(os.path.relpath(fig_dir / fig, out_md.parent)).as_posix()})\n")
    md += notes
    if not len(strata):
        return md + ["No sequence's strata are finished yet.\n"]
    wide = strata.pivot(index=["sequence", "kind"], columns="p", values="norm_ratio").reset_index()
    cols = ["sequence", "kind"] + [c for c in wide.columns if c not in ("sequence", "kind", "rest")] + ["rest"]
    md += ["‖g(p)‖/‖g‖ per sequence (`rest` = ‖g(>P)‖/‖g‖, the bound below; aim ≤ "
           f"{cfg['remainder_tol']:g}):\n", table(wide[cols])]
    cost = _read(results / "cost.csv")
    sweeps = cost[cost.method.isin([f"strata P={cfg['max_hops']}", "seco (strata unit)"])] if len(cost) else cost
    if len(sweeps) and sweeps.method.nunique() == 2:
        per = sweeps.pivot_table(index="sequence", columns="method", values="cpu_s").reset_index()
        per["strata / SeCO"] = per[f"strata P={cfg['max_hops']}"] / per["seco (strata unit)"]
        md += [f"\nCPU seconds of each strata unit's parts, one process: forward + the stratified sweep (P = "
               f"{cfg['max_hops']}, {cfg['max_hops'] + 1} labels) against forward + a SeCO sweep over the same cache:"
               "\n", table(per)]
    return md


def _bias(results: Path) -> list[str]:
    bias = _read(results / "bias.csv")
    if not len(bias):  # said, never dropped without a word (campaign 22 F1's class)
        return ["\n## Exact bias per scheme\n", left_out(
            "the exact bias per scheme", "bias.csv", "is absent or empty (no strata unit finished, or the table "
            "removed)", "`seco-lab audit --tables-only` (from the finished units) or " + PRODUCE)]
    wide = bias.pivot_table(index=["t", "scheme"], columns="metric", values="value", aggfunc="mean").reset_index()
    out = pd.DataFrame({"t": wide.t, "scheme": wide.scheme, "rel. bias": wide.rel_bias,
                        "± bound": wide.rel_bias_bound, "1 − cos": wide.direction_bias,
                        "best-scale": wide.best_scale_residual, "± bound ": wide.best_scale_residual_bound,
                        "per-tensor": wide.per_tensor_residual, "scale a": wide.scale})
    return ["\n## Exact bias per scheme\n",
            "Mean over the finished sequences. rel. bias = ‖E ĝ − g‖/‖g‖; best-scale = min_a ‖a E ĝ − g‖/‖g‖ "
            "(what SGD's step size cannot absorb); per-tensor = the same with one scale per tensor (what Adam "
            "cannot); ± = the bound lumping the strata beyond P puts on it.\n", table(out, ("t",))]


def _noise(results: Path, cfg: dict) -> list[str]:
    mc, data = _read(results / "mc.csv"), _read(results / "data.csv")
    md = ["\n## Sampling noise against data noise\n"]
    if len(data):
        d = dict(zip(data.metric, data.value))
        md.append(f"Data noise over {int(d['n_sequences'])} sequences of {cfg['data_length'] or cfg['length']:,} "
                  f"tokens (exact SeCO gradients): tr Σ_d / ‖ḡ‖² = {fmt(d['data_noise_to_signal'])} (‖ḡ‖² debiased "
                  f"by tr Σ_d/N); tr Σ_d / mean ‖g_i‖² = {fmt(d['tr_sigma_data'] / d['mean_seq_norm2'])}.\n")
    else:
        md.append("The data-noise stage has not finished.\n")
    if not len(mc):
        return md + ["\nNo Monte Carlo unit has finished.\n"]
    wide = mc.pivot_table(index=["sequence", "t", "scheme"], columns="metric", values="value").reset_index()
    interval = lambda lo, hi: [f"[{fmt(a)}, {fmt(b)}]" for a, b in zip(lo, hi)]  # noqa: E731
    out = pd.DataFrame({"seq": wide.sequence, "t": wide.t, "scheme": wide.scheme, "N": wide.n_draws,
                        "Var/‖g‖²": wide.rel_var, "95% CI": interval(wide.rel_var_low, wide.rel_var_high),
                        "Var/‖E ĝ‖² (noise-to-signal)": wide.noise_to_signal,
                        "95% CI ": interval(wide.noise_to_signal_low, wide.noise_to_signal_high),
                        "best-scale MSE (one sequence)": wide.best_scale_mse,
                        "mean check": ["ok" if c else "off" for c in wide.mean_dev_covered]})
    return md + ["Monte Carlo through the real sparse sweep (one stratified sweep per draw; every scheme of a "
                 "sampler on the same draws). The mean check: the debiased ‖mean − E ĝ‖²'s interval holds 0.\n",
                 table(out, ("t", "N"))]


def _cost(results: Path, cfg: dict) -> list[str]:
    cost = _read(results / "cost.csv")
    if not len(cost) or not (cost.method == "seco").any():
        return ["\n## Cost of one step (CPU seconds)\n", left_out(
            "the cost of one step", "cost.csv", "is absent or has no SeCO row (the cost unit not finished, or the "
            "table removed)", "`seco-lab audit --tables-only` (from the finished units) or " + PRODUCE)]
    base = cost[cost.method == "forward"].cpu_s.mean()
    seco = cost[cost.method == "seco"].cpu_s.mean()
    g = cost.groupby(["method", "scheme", "t"], dropna=False).agg(cpu_s=("cpu_s", "mean"),
                                                                  chunks=("chunks", "mean")).reset_index()
    g["× forward"] = g.cpu_s / base
    g["× SeCO"] = g.cpu_s / seco
    g["scheme"] = g.scheme.fillna("")
    return ["\n## Cost of one step (CPU seconds)\n",
            f"Random draws (seeded), {cfg['threads']} threads; CPU time of the process.\n", table(g, ("t",))]


def _equal_compute(results: Path, audit: dict) -> list[str]:
    eq = _read(results / "equal_compute.csv")
    md = ["\n## Equal compute\n"]
    if not len(eq):
        return md + ["Needs ≥ 2 finished strata sequences, a cost unit and a Monte Carlo unit; not all are "
                     "finished.\n"]
    data, first = _read(results / "data.csv"), eq.iloc[0]
    n_data, n_strata = int(first.n_data_sequences), int(first.n_strata_sequences)
    from_data = len(data) > 0 and int(dict(zip(data.metric, data.value))["n_sequences"]) == n_data
    source = (f"{n_data} data sequences (exact SeCO gradients)" if from_data else
              f"the {n_strata} strata sequences' own gradients (the data stage has not finished: "
              f"{n_strata - 1} degree(s) of freedom)")
    mc_seq = sorted({u.split("-")[1] for u in audit["units_done"] if u.startswith("mc-")})
    shown = {f"t{t}" for t in eq.t.unique()}  # a Monte Carlo unit at another budget changes no row shown here
    pending = [u for u in audit["units_missing"] if u.split("-")[0] in ("strata", "data")
               or (u.startswith("mc-") and u.split("-")[2] in shown)]
    md.append("Best-scale MSE of one optimizer step at equal compute (docs/audit.md): SeCO averages B sequences, "
              "a scheme B·c_SeCO/c_s. B* = the batch above which SeCO's error is the smaller (0: SeCO wins at "
              f"every B; inf: never). The data noise tr Σ_d / ‖ḡ‖² = {fmt(first.a / first.G)} comes from {source}; "
              f"the schemes' bias terms from {n_strata} strata sequences; the sampling variance from the Monte Carlo "
              f"of {', '.join(mc_seq) or 'no sequence'}."
              + (f" **Provisional:** {len(pending)} unit(s) that enter these numbers have not run yet "
                 "(see What ran)." if pending else "") + "\n")
    wide = eq.pivot_table(index=["t", "scheme", "cost_ratio", "crossover_B"], columns="B",
                          values=["mse_seco", "mse_scheme"]).reset_index()
    wide.columns = [c if not b else f"{'SeCO' if c == 'mse_seco' else 'scheme'} B={b}" for c, b in wide.columns]
    md.append(table(wide.rename(columns={"cost_ratio": "c_s/c_SeCO", "crossover_B": "B*"}), ("t",)))
    rec = read_json_table(results / "recommendation.json", PRODUCE)
    md.append("\n## Recommendation" + (" (provisional)" if pending else "") + "\n")
    md += [f"- t = {t}, B = {B}: **{r['choice']}** — {r['why']}." for t, per_b in rec.items() for B, r in per_b.items()]
    return md


ASSUMPTIONS = ["\n## Assumptions\n",
               "One optimizer step, the step size tuned per method (best scale), no curvature; bias persists across "
               "steps while noise averages, so this is a proxy the training study tests, not a proof. The "
               "remainder's bound assumes the strata beyond P do not cancel each other.\n"]


def write_report(results: str | Path, out_md: str | Path, root: str | Path = Path(".")) -> Path:
    results, out_md = Path(results), Path(out_md)
    if not (results / "audit.json").exists() and not (results / "audit.json").is_symlink():
        raise MissingResultsError(f"{results} lacks audit.json: run {PRODUCE} first, or pass the folder "
                                  "an audit wrote")
    verify_tables(results)
    return write_markdown(render(results, out_md, Path(root)), out_md)


#: what audit.json holds that a rerun changes (the software and the command line): not compared
VOLATILE = ("versions", "command")


def verify_tables(results: Path) -> None:
    """The stored tables are what the stored units give (``seco_lab.studies.audit.tables.derive_results``), up to float
    rounding: a table edited, truncated, damaged, deleted or copied from elsewhere is refused, naming it."""
    from ..studies.audit.stored import missing_units, missing_units_advice
    from ..studies.audit.tables import derive_results
    from ..studies.rerun_tables import table_difference, values_close

    fix = (f"rewrite the tables from the finished units with `seco-lab audit --tables-only --out {results}` "
           "(nothing is computed)")
    try:
        derived = derive_results(results)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MissingResultsError(f"{results} holds no readable audit (config.json, sequences.json or a unit: "
                                  f"{type(e).__name__}: {e}); rerun {PRODUCE}, or pass the folder an audit "
                                  "wrote") from None
    lost = missing_units(results)
    if lost:  # `--tables-only` alone would refuse: name the units and the ways out that work
        raise MissingResultsError(missing_units_advice(results, lost))
    for name, want in derived.items():
        path = results / name
        try:
            if name.endswith(".csv"):
                if read_checked_bytes(path, "stored table", TABLE_MAX_BYTES, fix) == want.to_csv(index=False).encode():
                    continue  # byte for byte what the units give (an empty table included)
                have = read_csv(path, "stored table", TABLE_MAX_BYTES, fix)
            else:
                have = read_json(path, "stored record", RECORD_MAX_BYTES, fix, expect=None)
        except FileNotFoundError:
            raise MissingResultsError(f"{path} is missing: {fix}") from None
        except ValueError as e:  # a FIFO, device or huge file (never opened), not CSV or JSON, nested too deeply
            raise MissingResultsError(str(e)) from None
        except OSError as e:
            raise MissingResultsError(f"{path} is not readable ({e.strerror or e}): {fix}") from None
        if name.endswith(".csv"):
            d = table_difference(have, want)
            same = d is not None and d <= 1
        else:
            keep = (lambda v: {k: x for k, x in v.items() if k not in VOLATILE}) if name == "audit.json" else dict
            same = isinstance(have, dict) and values_close(keep(have), keep(want))
        if not same:
            raise MissingResultsError(f"{path} does not match the audit's stored units (edited, damaged, or from "
                                      f"another folder): {fix}")


def audit_report(results: str | Path = DEFAULT_DIR, out_md: str | Path = Path("reports/audit.md")) -> Path:
    """``seco-lab report audit``: the committed audit's report."""
    return write_report(results, out_md)
