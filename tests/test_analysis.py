"""seco_lab.stats.chain_space against brute force: every chain-space quadratic form equals the same
statistic computed on explicit parameter-space vectors with plain loops."""

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seco_lab import get_scheme
from seco_lab.estimators.spaco import ChainBasis
from seco_lab.stats.chain_space import (
    ChainSpace,
    Inclusion,
    MonteCarlo,
    enumerated_stats,
    exact_stats,
    monte_carlo_stats,
    scheme_chain_weights,
)

TOL = 1e-10


def random_basis(k: int, max_hops: int, d: int, seed: int) -> ChainBasis:
    """Every decreasing chain of <= max_hops hops over k chunks, each with a random vector."""
    rng = np.random.default_rng(seed)
    chains = [c for p in range(max_hops + 1) for c in itertools.combinations(range(k - 1, -1, -1), p + 1)]
    vecs = torch.as_tensor(rng.standard_normal((len(chains), d)) * rng.uniform(0.1, 2, (len(chains), 1)))
    return ChainBasis(chains=chains, hops=np.array([len(c) - 1 for c in chains]),
                      masks=np.array([sum(1 << j for j in c) for c in chains], dtype=np.int64),
                      vectors=vecs, num_chunks=k, max_hops=max_hops, loss=0.0, like={})


def estimate(basis, subset, chain_w) -> np.ndarray:
    """g_hat(I) as an explicit parameter-space vector."""
    inside = [set(c) <= set(subset) for c in basis.chains]
    out = np.zeros(basis.vectors.shape[1])
    for w, v, ok in zip(chain_w, basis.vectors, inside):
        if ok:
            out += w * v.numpy()
    return out


cells = st.tuples(st.integers(2, 6), st.integers(0, 3), st.integers(0, 10_000),
                  st.sampled_from(["paper", "paper-capped", "released", "falling-factorial", "bernoulli"]))


@settings(max_examples=40)
@given(cells, st.data())
def test_exact_stats_equal_explicit_enumeration(cell, data):
    k, max_hops, seed, name = cell
    t = data.draw(st.integers(1, k))
    basis = random_basis(k, min(max_hops, k - 1), 5, seed)
    space, scheme = ChainSpace.from_basis(basis), get_scheme(name)
    w = scheme_chain_weights(scheme, k, t, basis.hops)
    ex = exact_stats(space, w, Inclusion.of(space, scheme.sampler, k, t))
    g = basis.vectors.numpy().sum(0)
    draws = [(s, float(p)) for s, p in scheme.sampler.subsets(k, t)]
    G = np.array([estimate(basis, s, w) for s, _ in draws])
    p = np.array([q for _, q in draws])
    mean = p @ G
    cov_trace = float(p @ ((G - mean) ** 2).sum(1))
    scale = g @ g
    assert abs(ex.sq_bias - float((mean - g) @ (mean - g))) <= TOL * scale
    assert abs(ex.cov_trace - cov_trace) <= TOL * scale
    assert np.allclose(enumerated_stats(space, w, scheme.sampler, k, t), (ex.sq_bias, ex.cov_trace),
                       rtol=0, atol=TOL * scale)
    if mean @ mean > 0:
        assert abs(ex.cos - mean @ g / np.sqrt((mean @ mean) * scale)) <= 1e-12


def brute_force_jackknife(x: np.ndarray) -> tuple[float, float]:
    """U = sum_{b != b'} <x_b, x_b'> / (B(B-1)) and its delete-one jackknife standard error, by loops."""
    B = len(x)

    def u(rows):
        pairs = [(a, b) for a in rows for b in rows if a != b]
        return sum(float(x[a] @ x[b]) for a, b in pairs) / len(pairs)

    full = u(range(B))
    loo = np.array([u([b for b in range(B) if b != i]) for i in range(B)])
    return full, float(np.sqrt((B - 1) / B * np.sum((loo - loo.mean()) ** 2)))


@settings(max_examples=25)
@given(st.integers(3, 6), st.integers(0, 2), st.integers(0, 10_000), st.sampled_from([5, 8, 10]),
       st.sampled_from(["paper", "falling-factorial", "bernoulli"]))
def test_monte_carlo_statistics_equal_plain_loops(k, max_hops, seed, batches, name):
    t = max(1, k // 2)
    basis = random_basis(k, min(max_hops, k - 1), 4, seed)
    space, scheme = ChainSpace.from_basis(basis), get_scheme(name)
    w = scheme_chain_weights(scheme, k, t, basis.hops)
    n = batches * 12
    mc = MonteCarlo.run(space, scheme.sampler, k, t, n, np.random.default_rng(seed), batches=batches)
    st_ = monte_carlo_stats(space, mc, w)
    # the same draws, replayed (n <= one block, so one draw_indicator call)
    ind = scheme.sampler.draw_indicator(k, t, n, np.random.default_rng(seed))
    G = np.array([estimate(basis, np.flatnonzero(row), w) for row in ind])
    g = basis.vectors.numpy().sum(0)
    mean = G.mean(0)
    scale = g @ g
    assert abs(st_.sq_err - float((mean - g) @ (mean - g))) <= TOL * scale
    cov_trace = float(((G - mean) ** 2).sum(1).sum() / (n - 1))
    assert abs(st_.cov_trace - cov_trace) <= TOL * scale
    assert abs(st_.sq_bias - (float((mean - g) @ (mean - g)) - cov_trace / n)) <= TOL * scale
    assert abs(mc.mean_size - ind.sum() / n) <= 1e-12
    batch_means = G.reshape(batches, n // batches, -1).mean(1) - g
    u, se = brute_force_jackknife(batch_means)
    assert abs(st_.sq_bias_se - se) <= TOL * scale
    # the running-mean curve at each checkpoint
    for cp, conv in zip(mc.checkpoints, st_.convergence):
        assert abs(conv - np.linalg.norm(G[:cp].mean(0) - g)) <= 1e-9 * np.sqrt(scale)
    assert st_.ci_low <= st_.sq_bias <= st_.ci_high
