"""Strata-space statistics (the path to k = 128) against explicit vectors and the real sparse engine."""

import numpy as np
import pytest
import torch
from helpers import random_batch, tiny_model

from seco_lab import SCHEME_NAMES, dense_grad, flatten, get_scheme, hop_strata, spaco_grad
from seco_lab.stats.strata import StrataGram, bias_metrics, jackknife_sq_norm, strata_monte_carlo

TOL = 1e-10


@pytest.fixture(scope="module")
def problem():
    model = tiny_model(n_layers=2, seed=4)
    tok, tgt = random_batch(17, 1, 24, seed=4)
    return model, tok, tgt, hop_strata(model, tok, tgt, chunk_size=3, max_hops=2)  # k = 8, P = L


@pytest.mark.parametrize("name", SCHEME_NAMES)
@pytest.mark.parametrize("budget", [2, 3, 6])
def test_bias_metrics_equal_explicit_vectors(problem, name, budget):
    model, tok, tgt, strata = problem
    w = get_scheme(name).expected_weights(8, budget, 2)
    m = strata.combine(w)  # E g_hat as parameter tensors
    _, g = dense_grad(model, tok, tgt)
    mf, gf = flatten(m), flatten(g)
    got = bias_metrics(StrataGram.of(strata), w)
    assert abs(got["rel_bias"] - float((mf - gf).norm() / gf.norm())) <= TOL
    cos = float(mf @ gf / (mf.norm() * gf.norm()))
    assert abs(got["direction_bias"] - (1 - cos)) <= TOL
    a = float(mf @ gf / (mf @ mf))  # least squares: min_a ||a m - g||
    assert abs(got["best_scale_residual"] - float((a * mf - gf).norm() / gf.norm())) <= TOL
    resid = sum(float(((m[n] * float((m[n] * g[n]).sum() / (m[n] * m[n]).sum()) - g[n]) ** 2).sum())
                if float((m[n] ** 2).sum()) > 0 else float((g[n] ** 2).sum()) for n in g)
    assert abs(got["per_tensor_residual"] - (resid / float(gf @ gf)) ** 0.5) <= TOL
    assert got["per_tensor_residual"] <= got["best_scale_residual"] + TOL <= got["rel_bias"] + 2 * TOL


def test_unbiased_weights_give_exact_zeros(problem):
    # every residual is a quadratic form in (a w - 1): exactly zero at w = 1, no sqrt(eps) cancellation floor
    got = bias_metrics(StrataGram.of(problem[3]), [1.0, 1.0, 1.0])
    assert got["rel_bias"] == got["direction_bias"] == got["best_scale_residual"] == got["per_tensor_residual"] == 0
    scaled = bias_metrics(StrataGram.of(problem[3]), [0.5, 0.5, 0.5])  # a pure scale error
    assert scaled["best_scale_residual"] < 1e-14 and abs(scaled["rel_bias"] - 0.5) < 1e-14


def test_strata_monte_carlo_replays_the_sparse_engine(problem):
    model, tok, tgt, _ = problem
    schemes = {n: get_scheme(n) for n in ("paper", "paper-capped", "falling-factorial", "released")}
    n = 12
    mc = strata_monte_carlo(model, tok, tgt, 3, schemes["paper"].sampler, 3, schemes, n, generator=7, batches=4)
    _, g = dense_grad(model, tok, tgt)
    gf = flatten(g)
    rng = np.random.default_rng(7)
    draws = [schemes["paper"].sampler.draw(8, 3, rng) for _ in range(n)]
    for name, s in schemes.items():
        G = torch.stack([flatten(spaco_grad(model, tok, tgt, 3, s, 3, subset=d)[1]) for d in draws])
        mean = G.mean(0)
        sq_err = float((mean - gf) @ (mean - gf)) / float(gf @ gf)
        var = float(((G - mean) ** 2).sum() / (n - 1)) / float(gf @ gf)
        assert abs(mc[name].rel_sq_err - sq_err) <= TOL
        assert abs(mc[name].rel_var - var) <= TOL
        assert abs(mc[name].rel_sq_bias - (sq_err - var / n)) <= TOL
        assert mc[name].ci_low <= mc[name].rel_sq_bias <= mc[name].ci_high
        assert mc[name].mean_chunks == 3


def test_bernoulli_monte_carlo_handles_empty_draws(problem):
    model, tok, tgt, _ = problem
    s = get_scheme("bernoulli")
    mc = strata_monte_carlo(model, tok, tgt, 3, s.sampler, 1, {"bernoulli": s}, 60, generator=0, batches=6)
    assert 0 < mc["bernoulli"].mean_chunks < 3 and np.isfinite(mc["bernoulli"].rel_var)


def test_jackknife_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 5)) + 0.3
    u, se = jackknife_sq_norm(x @ x.T)

    def ustat(rows):
        return np.mean([x[a] @ x[b] for a in rows for b in rows if a != b])

    loo = np.array([ustat([b for b in range(7) if b != i]) for i in range(7)])
    assert abs(u - ustat(range(7))) <= 1e-12
    assert abs(se - np.sqrt(6 / 7 * ((loo - loo.mean()) ** 2).sum())) <= 1e-12


def test_bad_input(problem):
    model, tok, tgt, strata = problem
    with pytest.raises(ValueError, match="expected_weights must have 3 entries"):
        bias_metrics(StrataGram.of(strata), [1.0, 1.0])
    with pytest.raises(ValueError, match="not the shared"):
        strata_monte_carlo(model, tok, tgt, 3, get_scheme("paper").sampler, 2, {"b": get_scheme("bernoulli")}, 6,
                           batches=3)
    with pytest.raises(ValueError, match="multiple of batches"):
        strata_monte_carlo(model, tok, tgt, 3, get_scheme("paper").sampler, 2, {"p": get_scheme("paper")}, 7)
