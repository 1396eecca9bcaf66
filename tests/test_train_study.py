"""The training study (issue 14): task, run, resumable driver, statistics, report.

Every check compares with an independent computation: brute-force scans of the token stream,
enumeration of every draw for the expected gradient, closed forms of the t-distribution.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from seco_lab import TinyConfig, TinyTransformer, dense_grad, flatten, get_scheme, spaco_grad
from seco_lab.studies.registry import study_main
from seco_lab.studies.train import Arm, RecallTask, detectable_difference, paired_difference, quick_config, t_interval
from seco_lab.studies.train.extensions import extension_plan
from seco_lab.studies.train.report import load, render, summarize
from seco_lab.studies.train.runner import gradient, probe
from seco_lab.studies.train.summary import select_lr

# ----------------------------------------------------------------------------- task


def test_task_is_deterministic_and_splits_differ():
    task = RecallTask(num_chunks=8, chunk_size=8, distances=(1, 3, 5, 7), pairs=2, layout="random")
    a, b = task.batch(3, "train", 5, 4), task.batch(3, "train", 5, 4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.distance, b.distance)
    assert not torch.equal(a.tokens, task.batch(3, "val", 5, 4).tokens)
    assert not torch.equal(a.tokens, task.batch(3, "train", 6, 4).tokens)
    assert not torch.equal(a.tokens, task.batch(4, "train", 5, 4).tokens)


@pytest.mark.parametrize("layout,filler", [("random", "random"), ("anchored", "counting")])
def test_far_targets_are_the_values_paired_d_chunks_back(layout, filler):
    """Brute force: each far target's query key occurs in exactly one earlier place, in the chunk d
    before the query's, followed by the target value; the query is "0 key"."""
    distances, pairs = ((1, 3, 5, 7), 2) if layout == "random" else ((1, 4, 7), 3)
    task = RecallTask(num_chunks=8, chunk_size=8, distances=distances, pairs=pairs, layout=layout, filler=filler)
    K, c, k = task.n_keys, task.chunk_size, task.num_chunks
    batch = task.batch(0, "test", 0, 64)
    seen = set()
    for tok, tgt, dist in zip(batch.tokens.tolist(), batch.targets.tolist(), batch.distance.tolist()):
        far = [i for i, d in enumerate(dist) if d]
        assert len(far) == task.pairs
        for i in far:
            assert tok[i - 1] == 0 and 1 <= tok[i] <= K  # "0 key" -> value
            if layout == "random":
                assert i // c == k - 1
            where = [p for p in range(i - 1) if tok[p] == tok[i]]
            assert len(where) == 1 and where[0] // c == i // c - dist[i]
            assert tok[where[0] + 1] == tgt[i] and K < tgt[i] <= 2 * K
            seen.add(dist[i])
        assert tgt[:-1] == tok[1:]
        if filler == "counting":  # filler continues f, f+1, ... where nothing was placed
            fill = [(p, x) for p, x in enumerate(tok) if x > 2 * K]
            F = task.vocab_size - 1 - 2 * K
            assert all((x - y) % F == (p - q) % F for (p, x), (q, y) in zip(fill[1:], fill[:-1]))
    assert seen == set(task.distances)


def test_task_rejects_bad_settings():
    with pytest.raises(ValueError, match="distances must lie"):
        RecallTask(num_chunks=4, distances=(4,), pairs=1)
    with pytest.raises(ValueError, match="anchored layout queries every distance"):
        RecallTask(num_chunks=8, distances=(1, 2, 3), pairs=2)
    with pytest.raises(ValueError, match="layout must be"):
        RecallTask(layout="fixed")
    with pytest.raises(ValueError, match="queries"):
        RecallTask(num_chunks=8, chunk_size=4, distances=(1, 2, 3), pairs=2, layout="random")
    with pytest.raises(ValueError, match="unknown split"):
        RecallTask().batch(0, "dev", 0, 1)
    with pytest.raises(ValueError, match="spaco arm needs"):
        Arm("spaco", "paper")


# ----------------------------------------------------------------------------- gradients and probes


def _tiny(seed=0):
    cfg = TinyConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    return TinyTransformer(cfg, seed=seed, dtype=torch.float64)


def test_full_budget_micro_batched_gradient_is_dense():
    """At t = k every chunk is drawn, the unbiased schemes are exact: averaging the micro-batch
    estimates must give the full batch's dense gradient."""
    task = RecallTask(num_chunks=4, chunk_size=6, vocab_size=16, distances=(1, 3), pairs=2)
    model, batch = _tiny(), task.batch(0, "train", 0, 4)
    _, ref = dense_grad(model, batch.tokens, batch.targets)
    for scheme in ("falling-factorial", "released-unbiased"):
        _, g, chunks = gradient(model, Arm("spaco", scheme, 4), batch, 6, micro_batch=2, seed=0, step=0)
        assert chunks == 4
        torch.testing.assert_close(flatten(g), flatten(ref), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scheme,budget", [("paper", 2), ("released", 2), ("paper-capped", 1), ("bernoulli", 2)])
def test_probe_matches_enumerated_expectation(scheme, budget):
    """The probe's cos / relative bias against E g_hat from every draw, weighted by its probability."""
    task = RecallTask(num_chunks=4, chunk_size=6, vocab_size=16, distances=(1, 3), pairs=2)
    model, batch = _tiny(1), task.batch(0, "val", 1, 3)
    s = get_scheme(scheme)
    mean = None
    for subset, prob in s.sampler.subsets(4, budget):
        if not subset:
            continue
        _, g = spaco_grad(model, batch.tokens, batch.targets, 6, s, budget, subset=subset)
        mean = float(prob) * flatten(g) if mean is None else mean + float(prob) * flatten(g)
    _, ref = dense_grad(model, batch.tokens, batch.targets)
    g = flatten(ref)
    got = probe(model, Arm("spaco", scheme, budget), batch, 6)
    cos = float(mean @ g / (mean.norm() * g.norm()))
    assert got["cos"] == pytest.approx(cos, abs=1e-10)
    assert got["rel_bias"] == pytest.approx(float((mean - g).norm() / g.norm()), rel=1e-9, abs=1e-12)
    assert got["grad_norm"] == pytest.approx(float(g.norm()), rel=1e-10)
    exact = probe(model, Arm("seco"), batch, 6)
    assert exact["cos"] == 1.0 and exact["rel_bias"] == 0.0


# ----------------------------------------------------------------------------- statistics


def test_t_interval_known_answer():
    """x = (1, 2, 3): mean 2, s = 1; for 2 degrees of freedom the t CDF is 1/2 + t / (2 sqrt(2 + t^2)),
    so the 0.975 quantile solves t^2 = 0.9025 (2 + t^2) / (1 - 0.9025) ... in closed form below."""
    q = math.sqrt(2 * 0.95**2 / (1 - 0.95**2))  # from 2 F(q) - 1 = q / sqrt(2 + q^2) = 0.95
    mean, lo, hi, n = t_interval([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3)
    assert hi - mean == pytest.approx(q / math.sqrt(3), rel=1e-12)
    assert mean - lo == pytest.approx(q / math.sqrt(3), rel=1e-12)
    # non-finite values (diverged runs) are dropped; one value has no interval
    assert t_interval([1.0, 2.0, 3.0, float("nan")])[:3] == (mean, lo, hi)
    assert math.isnan(t_interval([4.0])[1])
    d = paired_difference([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    t = 2.0 / (1.0 / math.sqrt(3))
    assert d["diff"] == 2.0 and d["diff_lo"] == pytest.approx(lo, rel=1e-12)
    assert d["p_value"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)  # closed-form df = 2 tail
    with pytest.raises(ValueError, match="level"):
        t_interval([1, 2], level=95)


def test_detectable_difference_has_its_power():
    """At the returned difference a paired t-test at 5% rejects in 80% of simulated studies
    (20000 seeded studies: binomial sd 0.003, tolerance 0.015 -> false-failure rate < 1e-6)."""
    n, sd = 5, 0.7
    mde = detectable_difference(sd, n)
    rng = np.random.default_rng(0)
    x = rng.normal(mde, sd, size=(20000, n))
    rejected = stats.ttest_1samp(x, 0.0, axis=1).pvalue < 0.05
    assert rejected.mean() == pytest.approx(0.8, abs=0.015)
    assert detectable_difference(0.0, n) == 0.0 and math.isnan(detectable_difference(1.0, 1))


def test_lr_selection_uses_validation_and_avoids_divergence():
    final = pd.DataFrame({
        "arm": ["a"] * 6, "optimizer": ["sgd"] * 6, "lr": [0.1, 0.1, 0.3, 0.3, 1.0, 1.0], "seed": [0, 1] * 3,
        "val_far_loss": [1.0, 1.2, 0.5, 0.7, 0.1, np.nan], "test_far_loss": [0.0] * 6,
        "diverged": [False, False, False, False, False, True]})
    sel = select_lr(final)
    assert sel[sel.best].lr.tolist() == [0.3]


# ----------------------------------------------------------------------------- end to end


def test_quick_study_end_to_end(tmp_path, capsys):
    """``--quick`` from a fresh folder: tidy results, every arm trained, resume skips finished runs,
    and the report renders."""
    out = tmp_path / "study"
    assert study_main(["train", "--quick", "--jobs", "2", "--out", str(out), "--part", "main"]) == 0
    results, runs, study = load(out)
    cfg = quick_config()
    assert study["runs_total"] == len(cfg.runs()) == len(runs)
    assert set(runs.arm) == {a.name for a in cfg.arms} and len(cfg.arms) == 2 + 5 + 6
    assert study["design"]["seeds"] == [0, 1] and set(study["design"]["lrs"]) == {"adamw", "sgd"}
    # tidy: one row per run x step x metric x distance
    assert list(results.columns) == ["run_id", "arm", "optimizer", "lr", "seed", "step", "metric", "distance",
                                     "value"]
    assert not results.duplicated(["run_id", "step", "metric", "distance"]).any()
    steps = cfg.settings.steps
    for run_id, g in results.groupby("run_id"):
        train = g[g.metric == "train_loss"]
        assert sorted(train.step) == list(range(1, steps + 1))
        assert np.isfinite(train.value).all(), run_id
        assert set(g[g.metric == "test_far_loss"].distance) == {0, *cfg.settings.task.distances}
    assert (runs.param_distance > 0).all() and not runs.diverged.any()
    # SpaCO backprops fewer chunks than SeCO (Bernoulli: t on average)
    k = cfg.settings.task.num_chunks
    assert (runs[runs["mode"] != "spaco"].backprop_chunks_per_step == k).all()
    uni = runs[(runs["mode"] == "spaco") & (runs.scheme != "bernoulli")]
    assert (uni.backprop_chunks_per_step == uni.budget).all()
    # dense and SeCO: the same gradient, so the same trajectory up to rounding
    fin = results[(results.metric == "test_far_loss") & (results.distance == 0)].set_index(
        ["optimizer", "lr", "seed", "arm"]).value.unstack("arm")
    np.testing.assert_allclose(fin["dense"], fin["seco"], rtol=1e-4)
    # resume: nothing is redone; a lost run is redone alone
    before = (out / "runs" / f"{cfg.runs()[0].run_id}.json").stat().st_mtime_ns
    (out / "runs" / f"{cfg.runs()[-1].run_id}.json").unlink()
    assert study_main(["train", "--quick", "--collect-only", "--out", str(out), "--part", "main"]) == 0
    partial = json.loads((out / "study.json").read_text())
    assert partial["status"] == "partial" and partial["runs_done"] == len(cfg.runs()) - 1
    assert partial["study_wall_s"] == study["study_wall_s"]  # no session was running: nothing added
    assert len(pd.read_csv(out / "runs.csv")) == len(cfg.runs()) - 1
    assert study_main(["train", "--quick", "--jobs", "1", "--out", str(out), "--part", "main"]) == 0
    study2 = json.loads((out / "study.json").read_text())
    assert [s["runs"] for s in study2["sessions"]] == [len(cfg.runs()), 1] and study2["status"] == "complete"
    assert (out / "runs" / f"{cfg.runs()[0].run_id}.json").stat().st_mtime_ns == before
    # the report
    tabs = summarize(*load(out))
    assert set(tabs["table"].arm) == set(runs.arm)
    md = render(tabs, study2, tmp_path / "report.md", tmp_path / "figs")
    text = md.read_text()
    for heading in ("## Verdict", "## Settings", "## Final metrics", "## Gradient quality", "## Compute"):
        assert heading in text
    assert len(list((tmp_path / "figs").glob("*.png"))) == 5
    # issue 22: the equal-compute tier, the replays and the second configuration on top of the main study
    for tier in ("equal-compute", "equal-compute-spaco", "replay-t2", "second"):
        assert study_main(["train", "--quick", "--jobs", "2", "--out", str(out), "--part", tier]) == 0
    ec = pd.read_csv(out / "equal_compute" / "runs.csv")
    k, B = cfg.settings.task.num_chunks, cfg.settings.batch_size
    # SeCO on round(B (k + 3t) / (4k - 1)) sequences at t = 2, 1 (4 * 10 / 15 -> 3, 4 * 7 / 15 -> 2)
    assert {"seco B=3", "seco B=2", "truncated"} <= set(ec.arm)
    model_passes = [4 * k - 1 if m == "seco" else 3 * k if m == "truncated" else k + 3 * t
                    for m, t in zip(ec["mode"], ec.budget)]
    assert np.allclose(ec.passes_per_step, ec.batch_size * np.asarray(model_passes))
    spaco = ec[ec.arm.str.contains(" t=2 B=")]
    assert len(spaco) and (spaco.batch_size == round(B * (4 * k - 1) / (k + 6))).all()
    assert (ec.cpu_s > 0).all() and (ec.passes_per_step > 0).all()
    assert (out / "equal_compute" / "costs.csv").exists() and (out / "second_L4" / "costs.csv").exists()
    ec_study = json.loads((out / "equal_compute" / "study.json").read_text())
    assert ec_study["status"] == "incomplete" and len(ec_study["sessions"]) == 3  # three tiers ran, others did not
    assert ec_study["runs_done"] == len(ec) < ec_study["runs_total"]
    replays = ec[ec.arm.isin(set(runs.arm))]
    replayed = {a.name for a in cfg.arms if a.mode == "seco" or (a.mode == "spaco" and a.budget == max(cfg.budgets))}
    assert set(replays.seed) == {0} and set(replays.arm) == replayed and len(replays) == 2 * len(replayed)
    md = render(tabs, study2, tmp_path / "report2.md", tmp_path / "figs2", extensions=out).read_text()
    for heading in ("## At equal compute", "## A second configuration", "## The prediction, tested"):
        assert heading in md
    assert "largest |Δ test far-token loss| = 0.000000" in md  # a replay reproduces its main-study run
    assert len(list((tmp_path / "figs2").glob("*.png"))) == 5 + 3
    # a tier with no cells (--quick has one rate per optimizer: no lr neighbours) is said so, not an error
    assert not dict((t, c) for t, _, c in extension_plan(cfg, out, 2))["lr-neighbours"].cells
    assert study_main(["train", "--quick", "--jobs", "1", "--out", str(out), "--part", "lr-neighbours"]) == 0
    assert "nothing to run" in capsys.readouterr().out


def test_resume_refuses_a_different_study(tmp_path, capsys):
    out = tmp_path / "s"
    (out).mkdir()
    (out / "study.json").write_text(json.dumps({"study": "train", "fingerprint": "something-else"}))
    with pytest.raises(SystemExit) as e:
        study_main(["train", "--quick", "--jobs", "1", "--out", str(out)])
    assert e.value.code == 2 and "different study definition" in capsys.readouterr().err

