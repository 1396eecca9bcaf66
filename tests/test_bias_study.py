"""The bias study end to end on its quick grid, its statistics, and its resume logic."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from experiments.bias_study import QUICK, run_study
from seco_lab.report import bias_report, load_bias

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("bias_quick")
    run_study(QUICK, out, jobs=1, progress=False)
    return out


def test_quick_study_writes_tidy_results_and_report(quick_study):
    res = pd.read_csv(quick_study / "results.csv")
    assert list(res.columns) == ["L", "k", "seed", "t", "scheme", "metric", "value"]
    assert not res.duplicated(["L", "k", "seed", "t", "scheme", "metric"]).any()  # one row per metric
    md = bias_report(quick_study, quick_study / "report" / "bias_study.md")
    text = md.read_text()
    assert "## Headline numbers" in text and "Software: Python" in text
    for fig in ["bias_vs_ratio", "variance_mse_vs_ratio", "convergence", "weights", "cap_tradeoff"]:
        assert (md.parent / "figures" / "bias_study" / f"{fig}.png").stat().st_size > 10_000


def test_quick_study_internal_checks_are_exact(quick_study):
    cells, checks, _, _ = load_bias(quick_study)
    by = checks.groupby("metric").value.max()
    assert by["check_chain_sum_vs_dense"] < 1e-12
    assert by["check_strata_beyond_depth"] < 1e-13
    assert by["check_engine_vs_chain_basis"] < 1e-12
    assert cells.check_enum_vs_analytic.max() < 1e-12


def test_unbiased_intervals_cover_zero_and_paper_intervals_exclude_it(quick_study):
    """From the stored data alone.

    Unbiased (exact relative bias < 1e-10, t < k) cells: the debiased squared-bias
    estimate over its jackknife standard error must stay below the Bonferroni
    critical value of a t(B-1) law for a family-wise level of 1%, so this test
    has a false-positive rate of at most 1% (per the normal approximation) over
    Monte Carlo seeds; the seeds are fixed, so it is deterministic.  `paper` is
    biased in every cell with t < k: each of its 95% intervals must exclude 0.
    """
    cells, _, _, meta = load_bias(quick_study)
    random = cells[cells.t < cells.k]
    unbiased = random[random.rel_bias < 1e-10]
    assert set(unbiased.scheme) == {"bernoulli", "falling-factorial"}
    assert (unbiased[unbiased.scheme == "falling-factorial"].t >= unbiased[unbiased.scheme == "falling-factorial"].L
            + 1).all()
    crit = stats.t.isf(0.01 / (2 * len(unbiased)), meta["config"]["batches"] - 1)
    z = unbiased.mc_rel_sq_bias / unbiased.mc_rel_sq_bias_se
    assert np.all(np.abs(z) < crit), unbiased.assign(z=z)[np.abs(z) >= crit]
    paper = random[random.scheme == "paper"]
    assert len(paper) and (paper.mc_rel_sq_bias_ci_low > 0).all()
    assert (paper.rel_bias > 0.1).all()


def _cli(out, *extra):
    return [sys.executable, "-m", "experiments.bias_study", "--quick", "--draws", "500", "--jobs", "1",
            "--no-progress", "--out", str(out), *extra]


def test_study_resumes_after_being_killed(tmp_path):
    out = tmp_path / "study"
    cells = out / "cells"
    proc = subprocess.Popen(_cli(out), cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(cells.glob("L*_s?.csv"))) < 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = sorted(cells.glob("L*_s?.csv"))
    assert 2 <= len(finished) < 8, "the kill must land mid-study"
    for f in finished:  # nothing half-written: every stored group is complete
        df = pd.read_csv(f)
        assert "seconds" in set(df.metric)
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in finished}

    rerun = subprocess.run(_cli(out), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(finished)} already done, {8 - len(finished)} to compute" in rerun.stdout
    for f in finished:
        assert (f.stat().st_ino, f.stat().st_mtime_ns) == before[f.name], f"{f.name} was recomputed"
    assert len(list(cells.glob("L*_s?.csv"))) == 8 and not list(cells.glob("*.tmp*"))
    assert (out / "results.csv").exists()


def test_changed_definition_is_refused_without_fresh(tmp_path):
    run_study(replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100), tmp_path, progress=False)
    with pytest.raises(SystemExit, match="different study definition"):
        run_study(replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=200), tmp_path, progress=False)


def test_an_hf_architecture_can_be_the_model_of_a_cell():
    from experiments.bias_study import run_group

    cfg = replace(QUICK, arch="hf-llama", budgets={4: (2,)}, draws=100, batches=10)
    res, _ = run_group(cfg, 2, 4, 0)
    checks = res[res.scheme.str.startswith("*")].groupby("metric").value.max()
    assert checks["check_chain_sum_vs_dense"] < 1e-12
    assert checks["check_engine_vs_chain_basis"] < 1e-12
    assert checks["check_strata_beyond_depth"] < 1e-13
    assert set(res.scheme) >= {"paper", "falling-factorial", "bernoulli"}
