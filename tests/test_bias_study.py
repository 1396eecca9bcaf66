"""The bias study end to end on its quick grid, its statistics, its resume logic, its
determinism, and rebuilding a stored group with ``load_cell``."""

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from seco_lab import dense_grad, flatten, hop_strata
from seco_lab.report import bias_report, load_bias, summarize_bias
from seco_lab.report.bias_paper import PAPER_METRICS, paper_cells
from seco_lab.report.markdown import fmt
from seco_lab.stats.strata import StrataGram, bias_metrics
from seco_lab.studies.bias import (
    PAPER,
    QUICK,
    RESULT_COLUMNS,
    SCHEMES,
    Purpose,
    StudyDefinitionError,
    load_cell,
    run_group,
    run_paper_group,
    run_study,
    seed_sequence,
)
from seco_lab.studies.runner import KILL_HOOK

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("results", "checks", "groups", "convergence")
PAPER_TABLES = ("paper", "checks", "groups")  # the tables a paper-settings group writes


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("bias_quick")
    run_study(QUICK, out, jobs=1, progress=False)
    return out


def test_quick_study_writes_tidy_results_and_report(quick_study):
    res = pd.read_csv(quick_study / "results.csv")
    assert tuple(res.columns) == RESULT_COLUMNS
    assert not res.duplicated(["L", "k", "seed", "t", "scheme", "metric"]).any()  # one row per metric
    assert set(res.scheme) == {v.label for v in SCHEMES}  # no sentinel rows: checks live in checks.csv
    assert (res.t >= 1).all()
    assert "seconds" not in set(res.metric)  # timings only in study.json: the tables are reproducible
    md = bias_report(quick_study, quick_study / "report" / "bias_study.md")
    text = md.read_text()
    assert "## At the paper's settings" in text and "## Which scheme should I use?" in text
    assert "## The schemes" in text and "Software: Python" in text and "seco-lab bias-study" in text
    assert "docs/estimators.md" in text and "k/t = 16 (k = 16, t = 1)" not in text
    for fig in ["bias_vs_ratio", "variance_mse_vs_ratio", "convergence", "weights", "cap_tradeoff", "paper_settings"]:
        assert (md.parent / "figures" / "bias_study" / f"{fig}.png").stat().st_size > 10_000


def test_rows_are_sorted_into_a_fixed_order(quick_study):
    res = pd.read_csv(quick_study / "results.csv")
    key = ["L", "k", "seed", "t", "scheme", "metric"]
    assert res[key].equals(res[key].sort_values(key).reset_index(drop=True))


def test_quick_study_internal_checks_are_exact(quick_study):
    study = load_bias(quick_study)
    by = study.checks.groupby("check").value.max()
    assert by["chain_sum_vs_dense"] < 1e-12
    assert by["strata_beyond_depth"] < 1e-13
    assert by["engine_vs_chain_basis_uniform"] < 1e-12 and by["engine_vs_chain_basis_bernoulli"] < 1e-12
    assert by["enumerated_vs_analytic"] < 1e-12
    # every group and budget was checked
    n_cells = sum(len(QUICK.budgets[k]) for _, k, _ in QUICK.groups())
    assert (study.checks.check == "engine_vs_chain_basis_uniform").sum() == n_cells


def test_summary_numbers_come_from_the_cells(quick_study):
    """The pure summary step (no matplotlib) against a direct computation from the cell table."""
    study = load_bias(quick_study)
    s = summarize_bias(study)
    cells = study.cells
    paper = cells[(cells.scheme == PAPER.label) & (cells.k == s["headline"]["k"])
                  & (cells.t == s["headline"]["t"])]
    assert s["headline"]["rel_bias"] == pytest.approx(paper.rel_bias.mean(), rel=1e-12)
    hit, n = s["covered"]
    assert n == cells.mc_covered.notna().sum() and hit == int(cells.mc_covered.sum())


def test_unbiased_intervals_cover_zero_and_paper_intervals_exclude_it(quick_study):
    """From the stored data alone.

    Unbiased (exact relative bias < 1e-10, t < k) cells: the debiased squared-bias
    estimate over its jackknife standard error must stay below the Bonferroni
    critical value of a t(B-1) law for a family-wise level of 1%, so this test
    has a false-positive rate of at most 1% (per the normal approximation) over
    Monte Carlo seeds; the seeds are fixed, so it is deterministic.  `paper` is
    biased in every cell with t < k: each of its 95% intervals must exclude 0.
    """
    study = load_bias(quick_study)
    cells, meta = study.cells, study.meta
    random = cells[cells.t < cells.k]
    unbiased = random[random.rel_bias < 1e-10]
    assert set(unbiased.scheme) == {"bernoulli", "falling-factorial"}
    ff = unbiased[unbiased.scheme == "falling-factorial"]
    assert (ff.t >= ff.L + 1).all()
    crit = stats.t.isf(0.01 / (2 * len(unbiased)), meta["config"]["batches"] - 1)
    z = unbiased.mc_rel_sq_bias / unbiased.mc_rel_sq_bias_se
    assert np.all(np.abs(z) < crit), unbiased.assign(z=z)[np.abs(z) >= crit]
    paper = random[random.scheme == "paper"]
    assert len(paper) and (paper.mc_rel_sq_bias_ci_low > 0).all()
    assert (paper.rel_bias > 0.1).all()


@pytest.mark.parametrize("scheme", ["paper", "released", "falling-factorial"])
def test_load_cell_recomputes_a_stored_bias(quick_study, scheme):
    """load_cell rebuilds a group; the exact relative bias stored in results.csv (from the chain basis
    and inclusion probabilities) is recomputed independently from hop strata: E ĝ = Σ_p w(p) g(p)."""
    L, k, seed, t = 2, 8, 1, 2
    cell = load_cell(quick_study, L, k, seed)
    _, dense = dense_grad(cell.model, cell.tokens, cell.targets)
    g = flatten(dense)
    strata = hop_strata(cell.model, cell.tokens, cell.targets, cell.config.chunk_size)
    variant = next(v for v in cell.config.schemes if v.label == scheme)
    w = variant.build().expected_weights(k, t, strata.max_hops)
    expected = sum(float(w[p]) * flatten(gp) for p, gp in enumerate(strata.strata))
    recomputed = float((expected - g).norm() / g.norm())
    res = pd.read_csv(quick_study / "results.csv")
    stored = res[(res.L == L) & (res.k == k) & (res.seed == seed) & (res.t == t) & (res.scheme == scheme)
                 & (res.metric == "rel_bias")].value
    assert len(stored) == 1 and recomputed > 0.01
    assert recomputed == pytest.approx(float(stored.iloc[0]), rel=1e-10)
    groups = pd.read_csv(quick_study / "groups.csv")
    g_norm = groups[(groups.L == L) & (groups.k == k) & (groups.seed == seed) & (groups.metric == "g_norm")].value
    assert float(g.norm()) == pytest.approx(float(g_norm.iloc[0]), rel=1e-13)


def test_load_cell_refuses_a_group_outside_the_study(quick_study):
    with pytest.raises(ValueError, match="not a group of the study"):
        load_cell(quick_study, 3, 8, 0)


def test_seeding_rule_gives_each_purpose_its_own_stream():
    draws = {p: seed_sequence(QUICK, 2, 8, 0, p).generate_state(2).tolist() for p in Purpose}
    assert len({tuple(v) for v in draws.values()}) == len(Purpose)
    # and the rule is the documented SeedSequence over (base, L, k, seed, purpose)
    ref = np.random.SeedSequence([QUICK.base_seed, 2, 8, 0, int(Purpose.TOKENS)]).generate_state(2).tolist()
    assert draws[Purpose.TOKENS] == ref


def _cli(out, *extra):
    return [sys.executable, "-m", "seco_lab.cli", "study", "bias", "--quick", "--draws", "500", "--jobs", "1",
            "--no-progress", "--out", str(out), *extra]


def test_study_resumes_after_being_killed(tmp_path):
    out = tmp_path / "study"
    cells = out / "cells"
    # a deterministic crash: the driver SIGKILLs its own process group once 3 groups are done (whatever the load)
    proc = subprocess.run(_cli(out), cwd=ROOT, start_new_session=True, capture_output=True, text=True,
                          timeout=600, env={**os.environ, KILL_HOOK: "3"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    n_groups = len(QUICK.groups()) + len(QUICK.paper_groups())
    finished = sorted(cells.glob("*.json"))
    assert len(finished) == 3 < n_groups, "the kill lands mid-study"
    for f in finished:  # nothing half-written: every group marked done has all its tables
        for name in PAPER_TABLES if f.name.startswith("paper_") else TABLES:
            assert len(pd.read_csv(f.with_suffix(f".{name}.csv")))
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in finished}

    rerun = subprocess.run(_cli(out), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(finished)} already done, {n_groups - len(finished)} to compute" in rerun.stdout
    for f in finished:
        assert (f.stat().st_ino, f.stat().st_mtime_ns) == before[f.name], f"{f.name} was recomputed"
    assert len(list(cells.glob("*.json"))) == n_groups and not list(cells.glob("*tmp*"))
    # reproducible run to run: one group recomputed here, in another process, gives the same bytes
    cfg = replace(QUICK, draws=500)
    L, k, seed = cfg.groups()[-1]
    again = run_group(cfg, L, k, seed)
    for name, df in [("results", again.results), ("checks", again.checks), ("groups", again.facts),
                     ("convergence", again.convergence)]:
        stored = (cells / f"L{L}_k{k}_s{seed}.{name}.csv").read_text()
        assert df.to_csv(index=False) == stored, name


def test_changed_definition_is_refused_without_fresh(tmp_path):
    run_study(replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100), tmp_path, progress=False)
    with pytest.raises(StudyDefinitionError, match="different study definition"):
        run_study(replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=200), tmp_path, progress=False)


def test_an_hf_architecture_can_be_the_model_of_a_cell():
    cfg = replace(QUICK, arch="hf-llama", budgets={4: (2,)}, draws=100, batches=10)
    res = run_group(cfg, 2, 4, 0)
    checks = res.checks.groupby("check").value.max()
    assert checks["chain_sum_vs_dense"] < 1e-12
    assert checks["engine_vs_chain_basis_uniform"] < 1e-12
    assert checks["strata_beyond_depth"] < 1e-13
    assert set(res.results.scheme) >= {"paper", "falling-factorial", "bernoulli"}


def test_cli_help_lists_every_option_with_its_default(capsys):
    from seco_lab.studies.bias import build_parser, main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: seco-lab bias-study")
    for action in build_parser()._actions:
        assert any(opt in text for opt in action.option_strings)
    assert "10000" in text and "reports/bias_study" in text and "(default: None)" not in text


def test_cli_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    from seco_lab.studies.bias import main

    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--out", str(tmp_path / "f")])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- paper-settings groups


def test_paper_settings_group_is_stored_and_exact(quick_study):
    """The quick grid's paper-settings group (k = 32): one row per scheme x budget x metric in paper.csv,
    its strata sum to the dense gradient, and the Monte Carlo columns are present and sane."""
    paper = pd.read_csv(quick_study / "paper.csv")
    assert tuple(paper.columns) == RESULT_COLUMNS
    assert not paper.duplicated(["L", "k", "seed", "t", "scheme", "metric"]).any()
    cells = paper_cells(paper)
    (L, k), = QUICK.paper_cells
    assert set(zip(cells.L, cells.k)) == {(L, k)} and set(cells.t) == set(QUICK.paper_budgets)
    assert set(cells.scheme) == {v.label for v in SCHEMES}
    assert set(PAPER_METRICS) <= set(cells.columns)
    assert (cells.mc_rel_var > 0).all() and set(cells.mc_covered.dropna()) <= {0.0, 1.0}
    assert np.allclose(cells.rel_mse, cells.rel_bias**2 + cells.mc_rel_var, rtol=1e-12)
    checks = pd.read_csv(quick_study / "checks.csv")
    assert checks[checks.check == "paper_strata_sum_vs_dense"].value.max() < 1e-12
    assert len(pd.read_csv(quick_study / "results.csv").query("k == @k")) == 0  # kept apart from results.csv


@pytest.mark.parametrize("scheme", ["paper", "paper-capped C=2", "released", "falling-factorial"])
def test_load_cell_recomputes_stored_paper_settings_metrics(quick_study, scheme):
    """Every first-order metric stored for a paper-settings cell, recomputed from load_cell + hop_strata with
    explicit vectors (E ĝ = Σ_p w(p) g(p), per tensor too), not through the Gram matrices the study used."""
    (L, k), = QUICK.paper_cells
    seed, t = QUICK.paper_seeds[0], QUICK.paper_budgets[0]
    cell = load_cell(quick_study, L, k, seed)
    _, dense = dense_grad(cell.model, cell.tokens, cell.targets)
    strata = hop_strata(cell.model, cell.tokens, cell.targets, cell.config.chunk_size, max_hops=L)
    variant = next(v for v in cell.config.schemes if v.label == scheme)
    w = variant.build().expected_weights(k, t, L)
    mean = {n: sum(float(w[p]) * s[n] for p, s in enumerate(strata.strata)) for n in dense}
    g, m = flatten(dense), flatten(mean)
    cos = float(m @ g / (m.norm() * g.norm()))
    # per tensor: the best scale a_i = <m_i, g_i> / ||m_i||², and what is left, ||a_i m_i − g_i||²
    resid = sum(float((float(mean[n].flatten() @ dense[n].flatten() / mean[n].norm() ** 2) * mean[n] - dense[n])
                      .norm() ** 2) for n in dense)
    expected = {"rel_bias": float((m - g).norm() / g.norm()), "direction_bias": 1 - cos,
                "best_scale_residual": float(np.sqrt(1 - cos**2)),
                "per_tensor_residual": float(np.sqrt(resid) / g.norm())}
    res = pd.read_csv(quick_study / "paper.csv")
    stored = res[(res.L == L) & (res.k == k) & (res.seed == seed) & (res.t == t) & (res.scheme == scheme)]
    stored = stored.set_index("metric").value
    assert expected["rel_bias"] > 0.01
    for name, value in expected.items():
        assert float(stored[name]) == pytest.approx(value, rel=1e-9, abs=1e-13), name
    # the library's difference form agrees where the residual is not tiny
    again = bias_metrics(StrataGram.of(strata), w)
    assert again["per_tensor_residual"] == pytest.approx(float(stored["per_tensor_residual"]), rel=1e-6)


def test_unbiased_schemes_have_exactly_zero_residuals_at_the_paper_settings(quick_study):
    """bernoulli is unbiased at every t: every first-order metric is 0 up to rounding, per tensor too (the
    residual is computed as a norm of the residual, not as a difference of squares)."""
    cells = paper_cells(pd.read_csv(quick_study / "paper.csv"))
    be = cells[cells.scheme == "bernoulli"]
    assert len(be) and (be[["rel_bias", "best_scale_residual", "per_tensor_residual"]].abs() < 1e-12).all().all()


def test_paper_settings_group_reruns_byte_identical(quick_study):
    (L, k), = QUICK.paper_cells
    seed = QUICK.paper_seeds[0]
    again, seconds = run_paper_group(QUICK, L, k, seed)
    assert set(seconds) == {"exact", "monte_carlo_uniform", "monte_carlo_bernoulli"}
    for name, df in [("paper", again.results), ("checks", again.checks), ("groups", again.facts)]:
        stored = (quick_study / "cells" / f"paper_L{L}_k{k}_s{seed}.{name}.csv").read_text()
        assert df.to_csv(index=False) == stored, name


def test_report_paper_settings_table_comes_from_paper_csv(quick_study):
    """Parse the report's paper-settings table and compare every cell with paper.csv's mean over seeds."""
    md = bias_report(quick_study, quick_study / "report_paper" / "bias_study.md").read_text()
    section = md.split("## At the paper's settings", 1)[1].split("\n## ", 1)[0].split("<details>")[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| scheme")]
    assert rows, "the paper-settings table is missing"
    cells = paper_cells(pd.read_csv(quick_study / "paper.csv"))
    mean = cells.groupby(["L", "k", "t", "scheme"], as_index=False).mean(numeric_only=True)
    (L, k), = QUICK.paper_cells
    headline = {"paper", "paper-capped C=2", "released", "released-unbiased", "falling-factorial", "bernoulli"}
    seen = set()
    for r in rows:
        fields = [x.strip() for x in r.strip("|").split("|")]
        scheme, t = fields[0], int(fields[1])
        ref = mean[(mean.L == L) & (mean.k == k) & (mean.t == t) & (mean.scheme == scheme)].iloc[0]
        assert fields[2:] == [fmt(float(ref[m])) for m in PAPER_METRICS], (scheme, t)
        seen.add((scheme, t))
    assert seen == {(s, t) for s in headline for t in QUICK.paper_budgets}
    timing = load_bias(quick_study).meta["timing"]
    assert set(timing["worker_seconds_by_part"]) == {"chain_basis_grid", "paper_exact", "paper_monte_carlo_uniform",
                                                     "paper_monte_carlo_bernoulli"}


def test_guidance_numbers_come_from_paper_csv(quick_study):
    """The "Which scheme should I use?" variance prices and residuals against a direct computation."""
    s = summarize_bias(load_bias(quick_study))["paper"]
    cells = paper_cells(pd.read_csv(quick_study / "paper.csv"))
    (L, k), = QUICK.paper_cells
    g = s["guidance"][L]
    for t in QUICK.paper_budgets:
        def mean(scheme, metric, t=t):
            return cells[(cells.scheme == scheme) & (cells.t == t)][metric].mean()

        assert g["var_price"]["falling-factorial"][t] == pytest.approx(
            mean("falling-factorial", "mc_rel_var") / mean("paper", "mc_rel_var"), rel=1e-12)
        assert g["at"]["best_scale_residual"]["paper-capped C=2"][t] == pytest.approx(
            mean("paper-capped C=2", "best_scale_residual"), rel=1e-12)
    text = bias_report(quick_study, quick_study / "report_guide" / "bias_study.md").read_text()
    guide = text.split("## Which scheme should I use?", 1)[1].split("\n## ", 1)[0]
    t0 = QUICK.paper_budgets[0]
    assert f"t = {t0}: {g['var_price']['falling-factorial'][t0]:.3g}×" in guide


def test_matched_scale_metrics_are_stored_and_consistent(quick_study):
    """results.csv and paper.csv carry noise-to-signal and best-scale MSE (issue 22).  Unbiased cells: E ĝ = g, so
    noise-to-signal = rel_var and best-scale MSE = v / (1 + v) exactly; paper cells: with ||E ĝ||/||g|| = cos / scale
    (scale = <E ĝ, g> / ||E ĝ||²), noise-to-signal = var scale² / cos² and MSE = 1 - cos² x² / (x² + var)."""
    res = pd.read_csv(quick_study / "results.csv")
    cells = res.pivot_table(index=["L", "k", "seed", "t", "scheme"], columns="metric", values="value").reset_index()
    random = cells[cells.rel_var > 1e-12]
    assert len(random) and ((random.best_scale_mse >= 0) & (random.best_scale_mse <= 1)).all()
    unb = random[random.rel_bias < 1e-10]
    assert len(unb)
    np.testing.assert_allclose(unb.noise_to_signal, unb.rel_var, rtol=1e-9)
    np.testing.assert_allclose(unb.best_scale_mse, unb.rel_var / (1 + unb.rel_var), rtol=1e-9)
    biased = random[random.rel_bias > 1e-3]  # a shrunken mean: matched scale charges the noise more than ||g||² does
    assert len(biased) and (biased.best_scale_mse >= biased.best_scale_residual**2 - 1e-12).all()
    pc = paper_cells(pd.read_csv(quick_study / "paper.csv"))
    cos = 1 - pc.direction_bias
    x2 = (cos / pc.scale) ** 2
    np.testing.assert_allclose(pc.noise_to_signal, pc.mc_rel_var / x2, rtol=1e-8)
    np.testing.assert_allclose(pc.best_scale_mse, 1 - cos**2 * x2 / (x2 + pc.mc_rel_var), rtol=1e-8, atol=1e-14)


def test_a_rerun_keeps_the_stored_tables_it_reproduces_up_to_rounding(tmp_path, capsys):
    """A fresh clone recomputes the committed study (its cells are not committed), maybe on a CPU whose kernels
    round differently: stored tables reproduced up to float rounding stay byte for byte, and so does the record
    of the run that produced them; a real difference is written, and named."""
    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100, paper_cells=())
    run_study(cfg, tmp_path, progress=False)
    files = ["study.json", *(f"{name}.csv" for name in ("results", "paper", "checks", "groups", "convergence"))]
    computed = (tmp_path / "results.csv").read_bytes()

    def rerun_with_stored_values_scaled_by(factor):
        df = pd.read_csv(tmp_path / "results.csv")
        row = int(np.flatnonzero(df["value"].abs() > 1e-3)[0])
        df.loc[row, "value"] *= factor  # the stored value as another machine's kernels would have left it
        df.to_csv(tmp_path / "results.csv", index=False)
        before = {f: (tmp_path / f).read_bytes() for f in files}
        for f in (tmp_path / "cells").iterdir():  # a fresh clone: the tables and study.json, no cells
            f.unlink()
        capsys.readouterr()
        run_study(cfg, tmp_path, progress=False)
        return before, capsys.readouterr().out

    before, out = rerun_with_stored_values_scaled_by(1 + 3e-14)
    assert {f: (tmp_path / f).read_bytes() for f in files} == before, "a reproduced table was rewritten"
    assert "reproduces the stored tables" in out and before["results.csv"] != computed

    before, out = rerun_with_stored_values_scaled_by(1 + 1e-6)
    assert "WARNING: the rerun does not reproduce the stored results" in out
    assert (tmp_path / "results.csv").read_bytes() == computed, "the rerun's values replace a changed table"
    assert (tmp_path / "study.json").read_bytes() != before["study.json"]  # the record of this run


def test_table_difference_is_none_for_anything_but_float_rounding():
    from seco_lab.studies.rerun_tables import table_difference

    a = pd.DataFrame({"scheme": ["paper", "capped"], "t": [1, 2], "value": [0.5, float("nan")]})
    assert table_difference(a, a.copy()) == 0.0
    assert 0 < table_difference(a, a.assign(value=[0.5 * (1 + 2e-10), float("nan")])) <= 1
    assert table_difference(a, a.assign(value=[0.5 * (1 + 1e-8), float("nan")])) > 1
    assert table_difference(a, a.assign(value=[0.5, 0.0])) is None  # NaN only where NaN
    assert table_difference(a, a.assign(scheme=["paper", "released"])) is None
    assert table_difference(a, a.assign(t=[1, 3])) is None
    assert table_difference(a, a.iloc[:1]) is None
    assert table_difference(a, a[["t", "scheme", "value"]]) is None


def test_rounding_floors_absorb_another_cpus_kernels_and_nothing_more():
    """Measured across kernels (AVX2 against AVX-512 on one machine): best_scale_residual 0 -> 2.6e-8 (a square
    root of rounding) and checks moved by 5.2e-15 -- a fresh clone on another CPU rewrote the committed tables
    and warned.  The study's floors absorb exactly such moves; a residual that moves by 1e-6 or a check by 1e-10
    is still a difference."""
    from seco_lab.studies.bias.driver import ROUNDING_FLOORS
    from seco_lab.studies.rerun_tables import table_difference

    res = pd.read_csv(ROOT / "reports/bias_study/results.csv")
    checks = pd.read_csv(ROOT / "reports/bias_study/checks.csv")
    zero = int(np.flatnonzero((res.metric == "best_scale_residual") & (res.value == 0))[0])
    mc = int(np.flatnonzero((res.metric == "mc_rel_var") & (res.value > 1e-3))[0])

    def moved(df, row, by):
        out = df.copy()
        out.loc[row, "value"] += by
        return out

    floor = ROUNDING_FLOORS["results"](res)
    assert table_difference(res, moved(res, zero, 2.6e-8)) > 1  # what the bare tolerance said
    assert table_difference(res, moved(res, zero, 2.6e-8), floor) <= 1
    assert table_difference(res, moved(res, zero, 1e-6), floor) > 1
    assert table_difference(res, moved(res, mc, 1e-6 * res.value[mc]), floor) > 1  # no floor for a Monte Carlo value
    cfloor = ROUNDING_FLOORS["checks"](checks)
    assert table_difference(checks, moved(checks, 0, 5.2e-15)) > 1
    assert table_difference(checks, moved(checks, 0, 5.2e-15), cfloor) <= 1
    assert table_difference(checks, moved(checks, 0, 1e-10), cfloor) > 1


def test_a_fresh_study_records_every_file_it_wrote(quick_study, monkeypatch):
    """The report verifies each stored file against the checksums the study recorded: a study that wrote a file
    outside them would have its own report refuse it (campaign 15 found that for the audit's config.json)."""
    from seco_lab import store

    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)
    store.verify_checksums(quick_study, "the study")
