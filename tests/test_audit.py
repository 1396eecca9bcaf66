"""seco-lab audit: strata with the measured remainder, exact bias, Monte Carlo, data noise, equal compute.

Every stored number is checked against an independent computation in float64: enumeration of every draw
(exact mean and covariance), explicit per-sequence dense gradients, a direct simulation of batches of
explicit vectors.  Models: the tiny transformer and a tiny random Hugging Face Llama (LoRA).
"""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from seco_lab import dense_grad, enumerate_expectation, flatten, get_scheme, hop_strata
from seco_lab.studies.audit import (
    QUICK,
    AuditConfig,
    crossover_batch,
    data_noise,
    equal_compute_mse,
    load_sequence,
    run_audit,
)
from seco_lab.studies.audit.measure import SAMPLER_CODES

# k = 6 chunks of 4 tokens, L = 2 layers, P = L - 1: the remainder is exactly the stratum p = 2 (g(p) = 0 for
# p > L), so every first-order number is exact and comparable with enumeration to rounding
TINY = AuditConfig(model="tiny", params="full", dtype="float64", length=24, chunk_size=4, budgets=(2, 3),
                   max_hops=1, num_sequences=3, mc_sequences=1, mc_budgets=(2,), mc_draws=60, cost_sequences=1,
                   data_sequences=5, exact_length=16, exact_chunk_size=4, threads=1, batch_sizes=(1, 4))
HF = replace(TINY, model="hf-llama", params="lora", lora_r=2, lora_alpha=4, tiny=dict(QUICK.tiny, vocab_size=256))
MODELS = {"tiny": TINY, "hf-llama": HF}


@pytest.fixture(scope="module", params=list(MODELS))
def audit(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"audit-{request.param}")
    run_audit(MODELS[request.param], out, progress=False)
    return out


def _wide(df: pd.DataFrame, index) -> pd.DataFrame:
    return df.pivot_table(index=index, columns="metric", values="value").reset_index()


def test_remainder_is_dense_minus_the_strata_sum(audit):
    seq = load_sequence(audit, "s00")
    _, dense = dense_grad(seq.model, seq.tokens, seq.targets)
    for P in (0, 1):
        st = hop_strata(seq.model, seq.tokens, seq.targets, seq.config.chunk_size, max_hops=P, remainder=True)
        direct = flatten(dense) - flatten(st.total())
        assert float((flatten(st.remainder) - direct).norm() / flatten(dense).norm()) < 1e-12
    assert hop_strata(seq.model, seq.tokens, seq.targets, 4, max_hops=1).remainder is None  # callers unchanged


def test_exactness_unit(audit):
    ex = pd.read_json(audit / "units" / "exact.json", typ="series")
    for key in ("seco_vs_dense", "strata_plus_remainder_vs_dense", "remainder_vs_dense_minus_sum",
                "full_strata_sum_vs_dense"):
        assert ex[key] < 1e-12, key


def test_strata_metrics_equal_enumeration(audit):
    """rel. bias, 1 - cos, best-scale and per-tensor residual from the stored Grams = the same from the enumerated
    exact mean and the dense gradient."""
    cfg = load_sequence(audit, "s00").config
    bias = _wide(pd.read_csv(audit / "bias.csv"), ["sequence", "t", "scheme"])
    for name in ("s01",):
        seq = load_sequence(audit, name)
        _, dense = dense_grad(seq.model, seq.tokens, seq.targets)
        g = flatten(dense)
        for t in cfg.budgets:
            for scheme in cfg.schemes:
                mean = enumerate_expectation(seq.model, seq.tokens, seq.targets, cfg.chunk_size, get_scheme(scheme),
                                             t).mean
                m = flatten(mean)
                row = bias[(bias.sequence == name) & (bias.t == t) & (bias.scheme == scheme)].iloc[0]
                cos = float(m @ g / (m.norm() * g.norm()))
                a = float(m @ g / (m @ m))
                per = sum(float((g_i.reshape(-1) - (m_i @ g_i.reshape(-1) / (m_i @ m_i)) * m_i).norm()) ** 2
                          for g_i, m_i in ((dense[n], mean[n].reshape(-1)) for n in dense) if float(m_i @ m_i) > 0)
                np.testing.assert_allclose(row.rel_bias, float((m - g).norm() / g.norm()), rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(row.direction_bias, 1 - cos, rtol=1e-6, atol=1e-12)
                np.testing.assert_allclose(row.best_scale_residual, float((a * m - g).norm() / g.norm()),
                                           rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(row.per_tensor_residual, np.sqrt(per) / float(g.norm()), rtol=1e-9,
                                           atol=1e-12)
                assert row.rel_bias_bound == 0.0  # P = L - 1: the remainder is one stratum, weighted exactly


def test_monte_carlo_variance_covers_the_enumerated_covariance(audit):
    """The jackknife interval of tr Sigma_hat (N = 60 draws through the real sparse sweep) holds the exact
    covariance trace from enumerating every draw.  A 95% interval: about 1 in 20 (scheme, model) pairs would
    miss by chance; the draws are seeded, so the outcome is fixed, and the check runs over 14 of them."""
    mc = _wide(pd.read_csv(audit / "mc.csv"), ["sequence", "t", "scheme"])
    seq = load_sequence(audit, "s00")
    cfg = seq.config
    _, dense = dense_grad(seq.model, seq.tokens, seq.targets)
    g2 = float(flatten(dense).norm()) ** 2
    misses = 0
    for _, row in mc.iterrows():
        ex = enumerate_expectation(seq.model, seq.tokens, seq.targets, cfg.chunk_size, get_scheme(row.scheme),
                                   int(row.t))
        exact = ex.cov_trace / g2
        misses += not row.rel_var_low <= exact <= row.rel_var_high
        assert abs(row.rel_var - exact) < 5 * row.rel_var_se, row.scheme  # ~never by chance (5 sigma)
        assert row.mean_dev_covered == 1.0
    assert misses <= 1, misses
    assert set(mc.scheme) == set(cfg.schemes) and len(SAMPLER_CODES) == 2


def test_data_noise_equals_explicit_per_sequence_gradients(audit):
    cfg = load_sequence(audit, "s00").config
    G = np.stack([flatten(dense_grad(s.model, s.tokens, s.targets)[1]).numpy()
                  for s in (load_sequence(audit, f"s{i:02d}") for i in range(cfg.data_sequences))])
    stored = dict(pd.read_csv(audit / "data.csv").values)
    tr = np.trace(np.atleast_2d(np.cov(G.T))) if G.shape[1] < 4000 else float(G.var(0, ddof=1).sum())
    np.testing.assert_allclose(stored["tr_sigma_data"], tr, rtol=1e-10)
    mean = G.mean(0)
    np.testing.assert_allclose(stored["gbar_norm2"], mean @ mean - tr / len(G), rtol=1e-10)
    explicit = data_noise(G @ G.T)
    assert explicit["tr_sigma_data"] == pytest.approx(tr, rel=1e-10)


def test_cost_and_tables(audit):
    cost = pd.read_csv(audit / "cost.csv")
    cfg = load_sequence(audit, "s00").config
    assert {"forward", "seco", "spaco"} <= set(cost.method)
    sp = cost[cost.method == "spaco"]
    assert len(sp) == len(cfg.budgets) * len(cfg.schemes) * cfg.cost_draws
    eq = pd.read_csv(audit / "equal_compute.csv")
    assert set(eq.t) == set(cfg.mc_budgets) and set(eq.B) == set(cfg.batch_sizes)
    assert (eq.mse_seco.between(0, 1)).all()


def test_resume_skips_finished_units_and_refuses_another_definition(audit):
    cfg = load_sequence(audit, "s00").config
    before = {p.name: p.stat().st_mtime_ns for p in (audit / "units").glob("*.json")}
    run_audit(cfg, audit, progress=False)
    assert before == {p.name: p.stat().st_mtime_ns for p in (audit / "units").glob("*.json")}
    with pytest.raises(ValueError, match="another definition"):
        run_audit(replace(cfg, chunk_size=3), audit, progress=False)


def test_equal_compute_formula_matches_a_direct_simulation():
    """Explicit vectors: 5 sequences, each with a scheme estimate drawn from 3 equally likely values; batches of
    B_s sequences drawn with replacement, one estimate each.  The formula's best-scale MSE equals
    1 - <E G, gbar>^2 / (||gbar||^2 E||G||^2) measured over 200,000 simulated batches (seeded; the tolerance is
    about 10 standard errors)."""
    rng = np.random.default_rng(0)
    n, d = 5, 7
    g = rng.normal(size=(n, d)) + 1.0
    draws = 0.7 * g[:, None, :] + rng.normal(size=(n, 3, d))  # biased, noisy estimates per sequence
    m = draws.mean(1)
    gbar, mbar = g.mean(0), m.mean(0)
    a = ((g - gbar) ** 2).sum(1).mean()  # population tr Sigma_d (the sequences are the population)
    C = ((m - mbar) ** 2).sum(1).mean()
    S = ((draws - m[:, None]) ** 2).sum(2).mean()
    c_ratio = 0.25  # the scheme costs a quarter: B_s = 4 B
    v = (C + S) * c_ratio
    G, M, X = gbar @ gbar, mbar @ mbar, mbar @ gbar
    for B in (1, 2):
        Bs = int(B / c_ratio)
        idx = rng.integers(0, n, size=(200_000, Bs))
        pick = rng.integers(0, 3, size=(200_000, Bs))
        batch = draws[idx, pick].mean(1)
        sim = 1 - (batch.mean(0) @ gbar) ** 2 / (G * (batch**2).sum(1).mean())
        seco_batch = g[rng.integers(0, n, size=(200_000, B))].mean(1)
        sim0 = 1 - (seco_batch.mean(0) @ gbar) ** 2 / (G * (seco_batch**2).sum(1).mean())
        mse0, mse_s = equal_compute_mse(G, a, M, X, v, B)
        assert mse_s == pytest.approx(sim, rel=0.02)
        assert mse0 == pytest.approx(sim0, rel=0.02)
    b_star = crossover_batch(G, a, M, X, v)
    assert 0 < b_star < np.inf
    m0, ms = equal_compute_mse(G, a, M, X, v, b_star)
    assert m0 == pytest.approx(ms, rel=1e-9)
    assert crossover_batch(G, a, G, G, v) == np.inf or crossover_batch(G, a, G, G, v) == 0.0  # no bias
    # a direction bias at the level of rounding (an unbiased scheme's float estimate) is no bias: never a finite B*
    assert crossover_batch(G, a, G * (1 + 1e-15), G, 0.5 * a) == np.inf
    assert 0 < crossover_batch(G, a, G * (1 + 1e-6), G, 0.5 * a) < np.inf


def test_out_that_is_no_audit_folder_of_its_own_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """issue 19: the audit's --out is guarded like a study's: a user's folder keeps its files untouched, and
    "", ~, the current directory and a file are refused; a folder in use by another audit is refused."""
    from seco_lab.folder_lock import FolderBusy, locked
    from seco_lab.studies.audit.driver import main

    user = tmp_path / "mine"
    user.mkdir()
    (user / "strata.csv").write_text("my numbers\n")
    (user / "notes.txt").write_text("keep\n")
    with pytest.raises(ValueError, match="not a seco-lab audit folder"):
        run_audit(TINY, user, progress=False)
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt", "strata.csv"]
    assert (user / "strata.csv").read_text() == "my numbers\n"
    monkeypatch.chdir(tmp_path)
    for bad, words in (("", "empty"), ("~", "literal '~'"), (".", "current directory"),
                       ("mine/notes.txt", "is a file")):
        with pytest.raises(ValueError, match=words):
            run_audit(TINY, bad, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert main(["--model", "tiny", "--out", "mine", "--no-progress"]) == 2
    busy = tmp_path / "busy"
    busy.mkdir()
    with locked(busy, "test", "wait"), pytest.raises(FolderBusy, match="in use by another seco-lab audit"):
        run_audit(TINY, busy, progress=False)


def test_a_resumed_audit_without_its_vectors_recomputes_and_checks_them(audit, tmp_path):
    """The flat vectors are not committed: an audit resumed on a fresh clone recomputes a finished sequence's
    rows, checks them against the unit it stored (as torch's checkpoint checks a recomputation), and the units
    computed from them equal those of the first run; rows that disagree with the stored unit are refused."""
    import json
    import shutil

    cfg = load_sequence(audit, "s00").config
    out = tmp_path / "resumed"
    shutil.copytree(audit, out)
    shutil.rmtree(out / "vectors")
    redo = [p.name for p in (out / "units").glob("*.json") if p.stem.startswith(("mc-", "data-"))]
    assert redo
    for name in redo:
        (out / "units" / name).unlink()
    run_audit(cfg, out, progress=False)
    assert sorted(p.name for p in (out / "vectors").glob("strata-*.pt")) == \
        sorted(p.name for p in (audit / "vectors").glob("strata-*.pt"))
    for name in redo:
        first, again = json.loads((audit / "units" / name).read_text()), json.loads((out / "units" / name).read_text())
        for key in ("draw_gram", "draw_exact", "exact_gram", "g_norm"):
            if key in first:
                np.testing.assert_allclose(np.asarray(again[key]), np.asarray(first[key]), rtol=1e-10, atol=1e-14)

    tampered = tmp_path / "tampered"
    shutil.copytree(audit, tampered)
    shutil.rmtree(tampered / "vectors")
    unit = tampered / "units" / "strata-s00.json"
    stored = json.loads(unit.read_text())
    stored["per_tensor_gram"] = (np.asarray(stored["per_tensor_gram"]) * 1.01).tolist()
    unit.write_text(json.dumps(stored))
    mc = sorted(p for p in (tampered / "units").glob("mc-s00-*.json"))[0]
    mc.unlink()
    with pytest.raises(ValueError, match="disagrees with its unit units/strata-s00.json"):  # the stored Gram's rows
        run_audit(cfg, tampered, progress=False)
    (tampered / "cross_gram.json").unlink()  # no Gram left to check the unit against: the recomputation is checked
    with pytest.raises(ValueError, match="differ from the stored unit strata-s00.json"):
        run_audit(cfg, tampered, progress=False)


def test_report_renders_every_section_from_the_stored_tables(audit, tmp_path):
    """The report is generated from the tables alone: every section of a finished audit, each recommendation,
    the strata-to-SeCO cost ratio of every strata unit; no missing value printed as nan."""
    import json

    from seco_lab.report.audit import write_report

    text = write_report(audit, tmp_path / "audit.md").read_text()
    for heading in ("## What ran", "## Exactness (float64)", "## The strata profile", "## Exact bias per scheme",
                    "## Sampling noise against data noise", "## Cost of one step", "## Equal compute",
                    "## Recommendation", "## Assumptions"):
        assert heading in text, heading
    rec = json.loads((audit / "recommendation.json").read_text())
    assert rec
    for per_b in rec.values():
        for B, r in per_b.items():
            assert f"B = {B}: **{r['choice']}**" in text
    cost = pd.read_csv(audit / "cost.csv")
    sweeps = cost[cost.method.isin(["strata P=1", "seco (strata unit)"])]
    assert set(sweeps.sequence) == {"s00", "s01", "s02"} and len(sweeps) == 6
    assert "strata / SeCO" in text and "nan" not in text.lower().replace("nano", "")
    assert "comes from 5 data sequences" in text and "Provisional" not in text and "(provisional)" not in text


def test_equal_compute_without_the_data_stage_names_its_source_and_is_provisional(audit, tmp_path):
    """With the data units not run, the equal-compute terms fall back on the strata sequences' gradients: the
    report says so (and how few degrees of freedom that is) and marks the recommendation provisional."""
    import shutil

    from seco_lab.report.audit import write_report
    from seco_lab.studies.audit.driver import rewrite_tables

    out = tmp_path / "partial"
    shutil.copytree(audit, out, ignore=shutil.ignore_patterns("data-*", "data_gram.json"))
    with pytest.raises(ValueError, match="units now missing in .*: data-s00"):
        rewrite_tables(out)  # the stored tables were made with the data units: not rewritten without them
    rewrite_tables(out, drop_missing_units=True)  # asked for (--drop-missing-units): the tables from the units left
    text = write_report(out, tmp_path / "audit.md").read_text()
    assert "comes from the 3 strata sequences' own gradients (the data stage has not finished: 2 degree(s)" in text
    assert "**Provisional:** 5 unit(s)" in text and "## Recommendation (provisional)" in text


@pytest.mark.parametrize("texts, words", [
    (("foo:",), "names no path"),                          # campaign 3, D16: '' became '.', every file audited
    (("BIN",), "binary or not UTF-8"),                     # D13: random bytes audited as text
    (("FIFO",), "not a regular file or folder"),           # D15: reading a FIFO hung
    (("EMPTY",), "no window|no text|too short|empty"),     # D17: a refused run left a folder behind
])
def test_bad_texts_are_refused_before_the_folder_is_made(tmp_path, texts, words):
    import os

    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 16)
    os.mkfifo(tmp_path / "ff")
    (tmp_path / "empty.txt").write_text("")
    paths = {"BIN": str(tmp_path / "bin.dat"), "FIFO": str(tmp_path / "ff"), "EMPTY": str(tmp_path / "empty.txt")}
    cfg = replace(TINY, texts=tuple(paths.get(t, t) for t in texts))
    with pytest.raises(ValueError, match=words):
        run_audit(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, error, words", [
    (dict(threads=0), ValueError, "threads must be an integer >= 1"),       # D18: set_num_threads traceback
    (dict(texts="argparse.py"), TypeError, "texts must be a tuple"),        # E66: read letter by letter
    (dict(budgets=(2.5,)), TypeError, "budgets entry must be an integer"),  # E65: 'not among budgets [2.5]'
    (dict(seed=True), TypeError, "seed must be an integer"),
])
def test_audit_settings_of_the_wrong_kind_are_refused(change, error, words):
    with pytest.raises(error, match=words):
        replace(TINY, **change)


def test_run_audit_refuses_a_dict_and_a_foreign_config_json(tmp_path, capsys):
    """E71: a dict config failed with AttributeError after creating the folder; D09: a user's config.json
    gave KeyError 'config'; C77: `study audit` into a user's folder was a traceback."""
    from seco_lab.studies.registry import study_main

    with pytest.raises(TypeError, match="cfg must be an AuditConfig"):
        run_audit({"length": 64}, tmp_path / "ra1", progress=False)
    assert not (tmp_path / "ra1").exists()
    user = tmp_path / "u2"
    user.mkdir()
    (user / "config.json").write_text('{"lr": 0.1}')
    with pytest.raises(ValueError, match="holds a config.json that is not an audit's"):
        run_audit(TINY, user, progress=False)
    assert sorted(p.name for p in user.iterdir()) == ["config.json"]
    (user / "notes.txt").write_text("x")
    (user / "config.json").unlink()
    try:
        rc = study_main(["audit", "--out", str(user), "--no-progress"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "is not a seco-lab audit folder" in err and "Traceback" not in err, err
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]


def test_a_damaged_unit_is_computed_again(audit, tmp_path):
    """D21: a unit file cut short stopped every later run with a bare JSON error; it is now computed again."""
    import json
    import shutil

    cfg = load_sequence(audit, "s00").config
    out = tmp_path / "damaged"
    shutil.copytree(audit, out)
    text = (out / "units" / "exact.json").read_text()
    (out / "units" / "exact.json").write_text(text[:100])
    run_audit(cfg, out, progress=False)
    again, first = json.loads((out / "units" / "exact.json").read_text()), json.loads(text)
    assert again["strata_norms"] == pytest.approx(first["strata_norms"], rel=1e-9, abs=1e-15)


def test_a_monte_carlo_unit_with_a_subtracted_remainder_is_stale_and_computed_again(audit, tmp_path, capsys):
    """Units stored before the remainder became a stratum of the sweep (their float32 differences, times W(P+1),
    faked variances of 1e6 ||g||^2 in the committed audit) are left out of the tables and computed again."""
    import json
    import shutil

    cfg = load_sequence(audit, "s00").config
    out = tmp_path / "stale"
    shutil.copytree(audit, out)
    unit = out / "units" / "mc-s00-t2-uniform.json"
    stored = json.loads(unit.read_text())
    assert stored["remainder"] == "lumped"
    del stored["remainder"]
    unit.write_text(json.dumps(stored))
    from seco_lab.studies.audit.tables import load_units

    assert "mc-s00-t2-uniform" not in load_units(out) and "exact" in load_units(out)
    run_audit(cfg, out, progress=False)
    assert "is stale" in capsys.readouterr().out  # tqdm.write
    again = json.loads(unit.read_text())
    assert again["remainder"] == "lumped" and again["subsets"] == stored["subsets"]
    assert np.allclose(again["draw_gram"], stored["draw_gram"], rtol=1e-10, atol=1e-14)


def test_the_audit_is_importable_as_seco_lab_audit():
    """Issue 21 §1 names the Python entry point ``seco_lab.audit``: the same objects as the implementation's."""
    import seco_lab.audit as front
    import seco_lab.studies.audit as impl

    assert front.__all__ == impl.__all__
    assert all(getattr(front, name) is getattr(impl, name) for name in impl.__all__)


@pytest.mark.parametrize("scheme", ["paper", "paper-capped", "falling-factorial", "bernoulli", "released"])
@pytest.mark.parametrize("P", [0, 1])
def test_the_remainder_bound_holds_against_the_unlumped_strata(scheme, P):
    """Lumping g(>P) under one weight w(P+1) moves the relative bias and the best-scale residual by at most the
    stated bound: checked against every stratum kept apart (the tiny model has L = 3, so g(p) = 0 for p > 3)."""
    import torch
    from helpers import random_batch, tiny_model

    from seco_lab.stats.strata import StrataGram, bias_metrics
    from seco_lab.studies.audit.measure import per_tensor_gram
    from seco_lab.studies.audit.stats import strata_bias

    model = tiny_model(n_layers=3, seed=3)
    tok, tgt = random_batch(17, 1, 15, seed=4)
    k, t, L = 5, 2, 3
    st = hop_strata(model, tok, tgt, 3, max_hops=L)
    rows = [list(g.values()) for g in st.strata]
    names = list(st.strata[0])
    lumped = rows[: P + 1] + [[sum(r[i] for r in rows[P + 1:]) for i in range(len(names))]]
    g = torch.cat([x.reshape(-1) for x in st.total().values()])
    ratio = float(torch.cat([x.reshape(-1) for x in lumped[-1]]).norm() / g.norm())
    assert ratio > 1e-3  # the remainder is there: the bound is not trivially 0
    sch = get_scheme(scheme)
    got = strata_bias(per_tensor_gram(lumped), names, sch, k, t, P, L, ratio)
    exact = bias_metrics(StrataGram(per_tensor_gram(rows), names), sch.expected_weights(k, t, L))
    assert abs(got["rel_bias"] - exact["rel_bias"]) <= got["rel_bias_bound"] + 1e-12
    assert abs(got["best_scale_residual"] - exact["best_scale_residual"]) <= got["best_scale_residual_bound"] + 1e-12


def test_population_terms_reduce_exactly_for_unbiased_and_rescaled_schemes():
    """population_terms on explicit random strata: weights 1 (an unbiased scheme) give SeCO's own terms, weights c
    (a pure rescaling) give c G, c^2 G, c^2 a -- exactly, whatever the sampling error of either set; and G, a are
    the debiased moments of the explicit per-sequence gradients (data_noise)."""
    from seco_lab.studies.audit.stats import population_terms

    rng = np.random.default_rng(5)
    N, R, d = 6, 4, 50
    S = rng.normal(size=(N, R, d)) + rng.normal(size=(1, R, d))  # a shared mean: G > 0
    cross = np.einsum("ipx,jqx->ipjq", S, S)
    g = S.sum(1)
    gbar = g.mean(0)
    tr = float(((g - gbar) ** 2).sum() / (N - 1))
    base = population_terms(cross, np.ones(R))
    assert base["a"] == pytest.approx(tr, rel=1e-12)
    assert base["G"] == pytest.approx(float(gbar @ gbar) - tr / N, rel=1e-12)
    assert base["M"] == pytest.approx(base["G"], rel=1e-12) and base["X"] == pytest.approx(base["G"], rel=1e-12)
    assert base["C"] == pytest.approx(base["a"], rel=1e-12)
    c = 0.37
    scaled = population_terms(cross, np.full(R, c))
    assert scaled["X"] == pytest.approx(c * base["G"], rel=1e-12)
    assert scaled["M"] == pytest.approx(c * c * base["G"], rel=1e-12)
    assert scaled["C"] == pytest.approx(c * c * base["a"], rel=1e-12)


def test_a_fresh_audit_records_every_file_it_wrote(audit, monkeypatch):
    """Campaign 15 A01/A16: config.json was written before the folder's checksums were started, so a fresh audit
    warned about its own file and `report audit` refused it as 'not recorded'."""
    from seco_lab import store

    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)
    store.verify_checksums(audit, "the audit")
    assert "config.json" in (audit / store.CHECKSUMS).read_text()

