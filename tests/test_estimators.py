"""Tiers 1-3 for the SpaCO estimator family (docs/estimators.md §3, §5)."""

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import random_batch, rel_err, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from seco_lab import (
    SCHEME_NAMES,
    chain_basis,
    dense_grad,
    enumerate_expectation,
    flatten,
    get_scheme,
    hop_strata,
    make_scheme,
    seco_grad,
    spaco_grad,
)
from seco_lab.estimators.schemes import Sampler

TOL = 1e-12


# ----------------------------------------------------------------- tier 1: strata


@given(
    n_layers=st.integers(1, 4), length=st.integers(2, 14), chunk=st.integers(1, 5),
    seed=st.integers(0, 500), batch=st.integers(1, 2),
)
def test_hop_strata_sum_to_dense_and_vanish_beyond_depth(n_layers, length, chunk, seed, batch):
    model = tiny_model(n_layers=n_layers, seed=seed, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8)
    tok, tgt = random_batch(17, batch, length, seed=seed)
    _, g = dense_grad(model, tok, tgt)
    hs = hop_strata(model, tok, tgt, chunk_size=chunk)
    assert hs.max_hops == math.ceil(length / chunk) - 1
    assert rel_err(hs.total(), g) <= TOL
    norms = hs.norms()
    assert np.all(norms[n_layers + 1 :] <= 1e-13 * float(flatten(g).norm()))


def test_strata_beyond_depth_exist_below_it():
    # The bounded-chain claim is tight: with k > L every stratum p <= L is nonzero.
    model = tiny_model(n_layers=3, seed=4)
    tok, tgt = random_batch(17, 1, 18, seed=4)
    norms = hop_strata(model, tok, tgt, chunk_size=3).norms()
    assert np.all(norms[:4] > 1e-6) and np.all(norms[4:] < 1e-14)


# ----------------------------------------------------------------- tier 2: enumeration

CASES = [(1, 5, 1), (1, 5, 3), (2, 6, 2), (2, 6, 4), (3, 5, 2), (3, 5, 5)]  # (L, k, t)


@pytest.fixture(scope="module")
def problems():
    out = {}
    for L, k, _ in CASES:
        if (L, k) in out:
            continue
        model = tiny_model(n_layers=L, seed=10 + L, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8, vocab=11)
        tok, tgt = random_batch(11, 1, 2 * k, seed=L)
        _, g = dense_grad(model, tok, tgt)
        out[(L, k)] = (model, tok, tgt, flatten(g), hop_strata(model, tok, tgt, chunk_size=2))
    return out


@pytest.mark.parametrize("name", SCHEME_NAMES)
@pytest.mark.parametrize("L,k,t", CASES)
def test_enumerated_mean_equals_weighted_strata(problems, name, L, k, t):
    model, tok, tgt, g, hs = problems[(L, k)]
    scheme = get_scheme(name)
    exact = enumerate_expectation(model, tok, tgt, chunk_size=2, scheme=scheme, budget=t)
    w = scheme.expected_weights(k, t, k - 1)
    analytic = flatten(hs.combine(w))
    assert rel_err(flatten(exact.mean), analytic) <= TOL
    # the bias is exactly sum_p (w(p) - 1) g(p)
    bias = flatten(hs.combine(w - 1))
    assert float((flatten(exact.mean) - g - bias).norm()) <= TOL * float(g.norm())
    strata_present = hs.norms() > 1e-8 * float(g.norm())
    unbiased = bool(np.all(np.isclose(w[strata_present], 1.0, rtol=0, atol=1e-14)))
    err = rel_err(flatten(exact.mean), g)
    if name in ("falling-factorial", "bernoulli") and (t >= L + 1 or t == k):
        assert err <= TOL
    elif name == "falling-factorial":
        assert t < L + 1 and err > 1e-3  # strata p >= t are lost
    elif name != "bernoulli" and k > t:
        assert not unbiased and err > 1e-3, f"{name} should be biased at k={k} > t={t}"
    if unbiased:
        assert err <= TOL


def test_enumeration_covariance_matches_its_trace_and_is_psd(problems):
    model, tok, tgt, g, _ = problems[(2, 6)]
    ex = enumerate_expectation(model, tok, tgt, chunk_size=2, scheme="falling-factorial", budget=3)
    assert ex.cov is not None and ex.num_subsets == math.comb(6, 3)
    assert abs(float(torch.trace(ex.cov)) - ex.cov_trace) <= 1e-12 * ex.cov_trace
    assert float(torch.linalg.eigvalsh(ex.cov).min()) > -1e-12 * ex.cov_trace


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_full_budget_reproduces_seco_when_weights_are_one(problems, name):
    model, tok, tgt, _, _ = problems[(2, 6)]
    scheme = get_scheme(name)
    w = scheme.expected_weights(6, 6, 5)
    _, g_seco = seco_grad(model, tok, tgt, chunk_size=2)
    subset = range(6)
    _, g_hat = spaco_grad(model, tok, tgt, chunk_size=2, scheme=scheme, budget=6, subset=subset)
    assert np.allclose(w, 1.0, rtol=0, atol=1e-15)
    assert rel_err(g_hat, g_seco) <= TOL


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_one_stratified_pass_gives_every_scheme_and_the_chain_basis_agrees(problems, name):
    model, tok, tgt, _, _ = problems[(3, 5)]
    scheme = get_scheme(name)
    rng = np.random.default_rng(7)
    basis = chain_basis(model, tok, tgt, chunk_size=2, max_hops=4)
    for _ in range(3):
        subset = scheme.sampler.draw(5, 3, rng)
        if not subset:
            continue
        _, g_hat = spaco_grad(model, tok, tgt, chunk_size=2, scheme=scheme, budget=3, subset=subset)
        strata = hop_strata(model, tok, tgt, chunk_size=2, subset=subset)
        assert rel_err(strata.estimate(scheme, 3), g_hat) <= TOL
        W = scheme.chain_weights(5, 3, 4)
        assert rel_err(basis.estimate(subset, W), flatten(g_hat)) <= TOL


@pytest.mark.parametrize("name, labels", [
    ("paper", {0}), ("released", {0}), ("released-unbiased", {0}), ("bernoulli", {0}),
    ("falling-factorial", {0, 1, 2}), ("paper-chain-capped", {0, 1, 2}),
])
def test_relay_buffers_per_scheme(monkeypatch, problems, name, labels):
    """Constant-factor schemes relay through one buffer (one label); hop-dependent ones keep one
    buffer per hop count -- counted on the labels the real sweep uses, not on a predicate."""
    import seco_lab.core.engine as engine
    import seco_lab.estimators.spaco as est

    seen = set()
    real_sweep = engine.backward_sweep

    def spy(*args, relay, direct_label, **kw):
        def counting_relay(lab, j, i):
            seen.add(lab)
            out = relay(lab, j, i)
            if out is not None:
                seen.add(out[0])
            return out

        return real_sweep(*args, relay=counting_relay, direct_label=direct_label, **kw)

    monkeypatch.setattr(est, "backward_sweep", spy)  # the constant-relay path calls it directly,
    monkeypatch.setattr(engine, "backward_sweep", spy)  # the hop-dependent one through engine.hop_sweep
    model, tok, tgt, _, _ = problems[(2, 6)]
    scheme = get_scheme(name)  # k/t = 1.5: the chain cap C = 2 binds from p = 2 on
    spaco_grad(model, tok, tgt, chunk_size=2, scheme=scheme, budget=4, subset=(0, 1, 3, 5))
    assert seen == labels
    assert scheme.constant_relay(6, 4) == (labels == {0})


# ----------------------------------------------------------------- closed forms


def _inclusion_by_counting(sampler_kind, k, t, p):
    """P(p+1 given chunks all drawn) by counting subsets, not by the falling factorial."""
    if sampler_kind == "uniform":
        return Fraction(math.comb(k - p - 1, t - p - 1), math.comb(k, t)) if p + 1 <= t else Fraction(0)
    return Fraction(t, k) ** (p + 1)


@given(k=st.integers(1, 40), data=st.data())
def test_closed_form_weights_match_chain_weight_times_survival(k, data):
    t = data.draw(st.integers(1, k))
    p = data.draw(st.integers(0, 6))
    cap = data.draw(st.sampled_from([Fraction(3, 2), Fraction(2), Fraction(4)]))
    for name in SCHEME_NAMES:
        scheme = get_scheme(name, cap=cap) if "capped" in name else get_scheme(name)
        closed = scheme.expected_weights_exact(k, t, p)[p]
        c = scheme.factors_exact(k, t, p)
        W = math.prod(c, start=Fraction(1))
        assert closed == W * _inclusion_by_counting(scheme.sampler.kind, k, t, p), (name, k, t, p)


def test_custom_scheme_gets_expected_weights_for_free():
    s = make_scheme("half-relay", direct=lambda k, t, rho: Fraction(k, t), hop=Fraction(1, 2))
    w = s.expected_weights_exact(8, 4, 2)
    assert w == [Fraction(1), Fraction(1, 2) * Fraction(3, 7), Fraction(1, 4) * Fraction(3, 7) * Fraction(2, 6)]


def test_capped_schemes_cap_what_they_say():
    hop = get_scheme("paper-capped", cap=3).factors(16, 2, 3)
    chain = get_scheme("paper-chain-capped", cap=3).chain_weights(16, 2, 3)
    assert list(hop) == [1, 3, 3, 3] and list(chain) == [1, 3, 3, 3]
    assert list(get_scheme("paper-chain-capped", cap=10).chain_weights(16, 8, 4)) == [1, 2, 4, 8, 10]


# ----------------------------------------------------------------- samplers


def test_sampler_follows_its_documented_algorithm():
    # uniform: the t smallest of k iid U(0,1) from the generator; bernoulli: u < rho, chunk by chunk
    for seed in range(20):
        u = np.random.default_rng(seed).random((1, 12))
        assert Sampler("uniform").draw(12, 4, seed) == tuple(sorted(np.argsort(u[0])[:4].tolist()))
        assert Sampler("bernoulli").draw(12, 4, seed) == tuple(np.flatnonzero(u[0] < 4 / 12).tolist())
    # one generator advances: successive draws differ (not a fixed subset), seeds differ too
    rng = np.random.default_rng(3)
    assert len({Sampler("uniform").draw(12, 4, rng) for _ in range(20)}) > 10
    assert len({Sampler("uniform").draw(12, 4, s) for s in range(20)}) > 10


def test_uniform_sampler_is_uniform_over_subsets():
    # Chi-square goodness of fit over the C(6, 2) = 15 subsets; seeded, so deterministic.
    # Under a correct sampler the test would fail for a random seed with probability 1e-3.
    ind = Sampler("uniform").draw_indicator(6, 2, 30_000, np.random.default_rng(11))
    assert np.all(ind.sum(1) == 2)
    codes = (ind * (1 << np.arange(6))).sum(1)
    _, counts = np.unique(codes, return_counts=True)
    assert len(counts) == 15
    assert stats.chisquare(counts).pvalue > 1e-3


def test_bernoulli_sampler_rate():
    # Binomial test on 60,000 inclusions at rho = 3/8; false-positive rate 1e-3 for a random seed.
    ind = Sampler("bernoulli").draw_indicator(8, 3, 60_000 // 8, np.random.default_rng(5))
    assert stats.binomtest(int(ind.sum()), ind.size, 3 / 8).pvalue > 1e-3


# ----------------------------------------------------------------- tier 3: Monte Carlo


def _projection_z_scores(basis, scheme, k, t, n, seed, target):
    """z-scores of the Monte Carlo mean of <g_hat, u_i> against <target, u_i> for 5 fixed directions."""
    rng = np.random.default_rng(seed)
    ind = scheme.sampler.draw_indicator(k, t, n, rng)
    masks = (ind.astype(np.int64) << np.arange(k)).sum(1)
    inside = (basis.masks[None, :] & ~masks[:, None]) == 0  # (n, chains)
    W = scheme.chain_weights(k, t, basis.max_hops)[basis.hops]
    draws = torch.as_tensor(inside * W) @ basis.vectors  # (n, d): one real estimate per draw
    u = torch.randn(basis.vectors.shape[1], 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    proj = (draws @ u).numpy()
    se = proj.std(0, ddof=1) / np.sqrt(n)
    return (proj.mean(0) - (target @ u).numpy()) / se


def test_monte_carlo_mean_of_unbiased_scheme_lies_in_confidence_region():
    """Seeded Monte Carlo of 4,000 draws of falling-factorial at t >= L+1.

    The mean is projected onto 5 fixed random directions and each projection is
    z-tested at Bonferroni level 1e-3 / 5: for a random seed the test would fail
    with probability <= 1e-3 (CLT approximation).  The same check must reject
    the paper scheme, so it can fail.
    """
    model = tiny_model(n_layers=2, seed=3, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8)
    tok, tgt = random_batch(17, 1, 16, seed=3)
    _, g = dense_grad(model, tok, tgt)
    g = flatten(g)
    basis = chain_basis(model, tok, tgt, chunk_size=2, max_hops=2)
    crit = stats.norm.isf(1e-3 / 10)
    for name in ("falling-factorial", "bernoulli"):
        z = _projection_z_scores(basis, get_scheme(name), 8, 4, 4000, seed=1, target=g)
        assert np.all(np.abs(z) < crit), (name, z)
    z = _projection_z_scores(basis, get_scheme("paper"), 8, 4, 4000, seed=1, target=g)
    assert np.any(np.abs(z) > crit)


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: get_scheme("nope"), "valid schemes: paper, paper-capped"),
        (lambda: get_scheme("paper-capped", cap=0), "cap must be a finite number > 0"),
        (lambda: get_scheme("paper-capped", cap=-1), "cap must be a finite number > 0"),
        (lambda: get_scheme("paper-capped", cap=float("inf")), "cap must be a finite number > 0"),
        (lambda: get_scheme("paper-capped", cap=float("nan")), "cap must be a finite number > 0"),
        (lambda: get_scheme("paper", cap=2), "has no cap"),
        (lambda: get_scheme("bernoulli", rho=0.0), "rho must lie in (0, 1]"),
        (lambda: get_scheme("bernoulli", rho=1.5), "rho must lie in (0, 1]"),
        (lambda: get_scheme("paper").expected_weights(8, 0, 2), "budget t must be >= 1"),
        (lambda: get_scheme("paper").expected_weights(8, 9, 2), "exceeds the number of chunks"),
        (lambda: get_scheme("paper").expected_weights(8, 2, -1), "max_hops P must be an integer >= 0"),
    ],
)
def test_scheme_bad_input(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_engine_bad_input(problems):
    model, tok, tgt, _, _ = problems[(2, 6)]
    with pytest.raises(ValueError, match="budget t=7 exceeds the number of chunks k=6"):
        spaco_grad(model, tok, tgt, chunk_size=2, scheme="paper", budget=7)
    with pytest.raises(ValueError, match="budget t must be >= 1"):
        spaco_grad(model, tok, tgt, chunk_size=2, scheme="paper", budget=0)
    with pytest.raises(ValueError, match="draws exactly t=2 chunks"):
        spaco_grad(model, tok, tgt, chunk_size=2, scheme="paper", budget=2, subset=[1, 2, 3])
    with pytest.raises(ValueError, match="outside"):
        spaco_grad(model, tok, tgt, chunk_size=2, scheme="paper", budget=2, subset=[1, 9])
    with pytest.raises(ValueError, match="max_hops P must be an integer >= 0"):
        hop_strata(model, tok, tgt, chunk_size=2, max_hops=-1)
    with pytest.raises(ValueError, match="more than max_subsets=10"):
        enumerate_expectation(model, tok, tgt, chunk_size=2, scheme="paper", budget=3, max_subsets=10)
