"""Issue 22: the equal-compute formula, the truncated gradient, the noise probe and the equal-compute arms.

The formula is checked against a direct computation on explicit vectors: every batch and every draw
enumerated, the best scale found by a numerical minimiser.  The truncated gradient is checked against
the 0-hop stratum of the stratified sweep (a different code path), the noise probe against the group
gradients of the dense engine and the sparse engine run on the same draws.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import optimize

from seco_lab import flatten, hop_strata, spaco_grad, truncated_grad
from seco_lab.core.engine import dense_grad
from seco_lab.stats.equal_compute import (
    best_scale_mse,
    chunk_passes,
    crossover_batch,
    equal_batches,
    equal_compute_batch,
    noise_to_signal,
    step_variance,
)
from seco_lab.studies.train import Arm, RecallTask
from seco_lab.studies.train.extensions import near_rates
from seco_lab.studies.train.runner import gradient, micro_batches, noise_probe
from tests.helpers import rel_err, tiny_model

# ----------------------------------------------------------------------------- explicit vectors


def _population(seed=0, N=3, D=3, d=4):
    """N sequences, D draws with probabilities q: per sequence exact gradient g_i and estimate e[i, I]."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(N, d)) + np.array([1.0, 0.5, 0.0, -0.5])
    bias = rng.normal(size=d) * 0.3
    e = g[:, None, :] * rng.uniform(0.2, 1.6, size=(1, D, 1)) + bias + rng.normal(size=(N, D, d)) * 0.4
    q = rng.dirichlet(np.ones(D))
    return g, e, q


def _direct_mse(g, e, q, sizes):
    """Enumerate every iid batch (micro-batches of ``sizes``, one draw each) and every draw: the exact
    distribution of the step mean G; return min_a E||a G - g_bar||^2 / ||g_bar||^2 by a 1-d minimiser."""
    N, D, _ = e.shape
    B = sum(sizes)
    gbar = g.mean(0)
    mean, second = 0.0, 0.0
    for seqs in itertools.product(range(N), repeat=B):
        for draws in itertools.product(range(D), repeat=len(sizes)):
            p = np.prod([q[r] for r in draws]) / N**B
            G, pos = np.zeros_like(gbar), 0
            for size, r in zip(sizes, draws):
                G += e[list(seqs[pos:pos + size]), r].sum(0)
                pos += size
            G /= B
            mean = mean + p * G
            second = second + p * (G @ G)

    def err(a):
        return (a * a * second - 2 * a * (mean @ gbar) + gbar @ gbar) / (gbar @ gbar)

    res = optimize.minimize_scalar(err, bounds=(-10, 10), method="bounded", options={"xatol": 1e-12})
    return float(res.fun), mean, second


def _terms(g, e, q):
    """The formula's inputs from their definitions (iid sequences, so C = E_I ||E_i delta_i(I)||^2)."""
    m = np.einsum("r,nrd->nd", q, e)  # m_i = E[g_hat_i | i]
    mbar, gbar = m.mean(0), g.mean(0)
    data_var = float(((m - mbar) ** 2).sum(1).mean())
    delta = e - m[:, None, :]
    A = float(np.einsum("r,nr->", q, (delta**2).sum(2)) / len(g))
    C = float(np.einsum("r,r->", q, (delta.mean(0) ** 2).sum(1)))
    return mbar, gbar, data_var, A, C


@pytest.mark.parametrize("sizes", [(1, 1, 1), (3,), (2, 1), (1, 1)])
def test_best_scale_mse_at_a_batch_matches_enumeration(sizes):
    g, e, q = _population()
    direct, mean, second = _direct_mse(g, e, q, list(sizes))
    mbar, gbar, data_var, A, C = _terms(g, e, q)
    B = sum(sizes)
    var = step_variance(data_var, A, B, list(sizes), C)
    assert mean == pytest.approx(mbar, abs=1e-12)
    assert second - mean @ mean == pytest.approx(var, rel=1e-10)  # tr Var G
    assert best_scale_mse(mbar @ gbar, mbar @ mbar, gbar @ gbar, var) == pytest.approx(direct, abs=1e-9)
    if all(n == 1 for n in sizes):  # one draw per sequence: SPEC §4c's (V_d + A) / B
        assert var == pytest.approx((data_var + A) / B, rel=1e-12)
        assert step_variance(data_var, A, B) == pytest.approx(var, rel=1e-12)


def test_exact_method_and_noise_to_signal():
    g, _, _ = _population(seed=1)
    e = np.repeat(g[:, None, :], 2, axis=1)  # an exact method: every draw gives g_i
    direct, _, _ = _direct_mse(g, e, np.array([0.5, 0.5]), [1, 1])
    mbar, gbar, data_var, A, C = _terms(g, e, np.array([0.5, 0.5]))
    assert A == pytest.approx(0, abs=1e-15) and C == pytest.approx(0, abs=1e-15)
    gg = gbar @ gbar
    assert best_scale_mse(gg, gg, gg, step_variance(data_var, 0, 2)) == pytest.approx(direct, abs=1e-9)
    # closed form for an exact method: (V/B) / (||g||^2 + V/B)
    assert direct == pytest.approx((data_var / 2) / (gg + data_var / 2), abs=1e-9)
    assert noise_to_signal(3.0, 4.0) == 0.75 and noise_to_signal(1.0, 0.0) == math.inf


def test_crossover_batch_is_where_the_errors_meet():
    g, e, q = _population(seed=2, N=4, D=3)
    mbar, gbar, data_var, A, _ = _terms(g, e, q)
    v0 = float(((g - gbar) ** 2).sum(1).mean())  # SeCO's data noise
    gg, cost, cost0 = gbar @ gbar, 14.0, 31.0

    def gap(B):  # MSE_SeCO(B) - MSE_scheme(B c0 / c), one draw per sequence
        Bs = equal_compute_batch(B, cost0, cost)
        ref = best_scale_mse(gg, gg, gg, v0 / B)
        return ref - best_scale_mse(mbar @ gbar, mbar @ mbar, gg, (data_var + A) / Bs)

    b_star = crossover_batch(mbar @ gbar, mbar @ mbar, gg, data_var + A, v0, cost, cost0)
    assert 0 < b_star < math.inf
    assert gap(b_star) == pytest.approx(0, abs=1e-12)
    assert gap(b_star / 4) > 0 > gap(b_star * 4)  # small batches: the cheap scheme; large: SeCO
    # unbiased (up to scale) and less noisy per compute: never overtaken; noisier: overtaken at once
    assert crossover_batch(2 * gg, 4 * gg, gg, 0.1, 1.0, 1.0, 1.0) == math.inf
    assert crossover_batch(2 * gg, 4 * gg, gg, 10.0, 1.0, 1.0, 1.0) == 0.0


def test_formula_rejects_bad_input():
    with pytest.raises(ValueError, match="g_sq"):
        best_scale_mse(1.0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="sum to batch"):
        step_variance(1.0, 1.0, 4, [2, 1])
    with pytest.raises(ValueError, match="positive integer"):
        step_variance(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="budget"):
        chunk_passes("spaco", 8)
    with pytest.raises(ValueError, match="unknown mode"):
        chunk_passes("sparse", 8, 2)


def test_cost_model_and_equal_batches():
    assert chunk_passes("seco", 8) == 31 and chunk_passes("truncated", 8) == 24
    assert chunk_passes("spaco", 8, 4) == 20 and chunk_passes("spaco", 8, 2) == 14
    assert equal_batches(8, 16, 4) == (10, 25) and equal_batches(8, 16, 2) == (7, 35)
    assert near_rates((0.1, 0.3, 1.0), 0.3, 0.5) == (0.1, 0.3)
    assert near_rates((0.1, 0.3, 1.0), 0.3, 2.0) == (0.3, 1.0)
    assert near_rates((0.001, 0.003, 0.01), 0.01, 2.0) == (0.003, 0.01)  # at the edge: the other neighbour


# ----------------------------------------------------------------------------- engines


def test_truncated_gradient_is_the_zero_hop_stratum():
    torch.manual_seed(0)
    model = tiny_model(n_layers=2)
    tokens = torch.randint(0, 17, (3, 20))
    targets = torch.randint(0, 17, (3, 20))
    loss, g = truncated_grad(model, tokens, targets, chunk_size=6)  # 4 chunks, the last one shorter
    strata = hop_strata(model, tokens, targets, 6)
    assert rel_err(g, strata.strata[0]) < 1e-12
    assert float(loss) == pytest.approx(float(dense_grad(model, tokens, targets)[0]), rel=1e-12)
    # and it is not the exact gradient: the relayed strata are not zero on this model
    assert rel_err(g, strata.total()) > 1e-3


def test_micro_batches_and_weighted_spaco_step():
    assert micro_batches(35, 16) == [16, 16, 3] and micro_batches(16, 16) == [16] and micro_batches(7, 16) == [7]
    task = RecallTask(num_chunks=4, chunk_size=6, vocab_size=17, distances=(1, 3), pairs=2)
    model = tiny_model(n_layers=1, vocab=17)
    batch = task.batch(0, "train", 0, 5)
    arm = Arm("spaco", "paper", 2, batch_size=5)
    loss, g, chunks = gradient(model, arm, batch, 6, 2, seed=3, step=1)
    # independent: each micro-batch through the sparse engine on its own draw, weighted by its size
    ref = None
    for m, (lo, hi) in enumerate([(0, 2), (2, 4), (4, 5)]):
        sub = __import__("seco_lab").get_scheme("paper").sampler.draw(4, 2, np.random.default_rng([3, 1, m, 7]))
        _, gm = spaco_grad(model, batch.tokens[lo:hi], batch.targets[lo:hi], 6, "paper", 2, subset=sub)
        ref = {n: (hi - lo) / 5 * v + (0 if ref is None else ref[n]) for n, v in gm.items()}
    assert rel_err(g, ref) < 1e-12 and chunks == 2


@pytest.mark.parametrize("arm", [Arm("seco"), Arm("truncated"), Arm("spaco", "released", 2)])
def test_noise_probe_against_group_gradients(arm):
    """g_sq / inner / mean_sq / data_var from the dense engine's group gradients (and, for SpaCO, the sparse
    engine on the same draws); the U-statistics computed here by explicit loops over group pairs."""
    task = RecallTask(num_chunks=4, chunk_size=6, vocab_size=17, distances=(1, 3), pairs=2)
    model = tiny_model(n_layers=2, vocab=17)
    batch = task.batch(0, "val", 1, 6)
    got = noise_probe(model, arm, batch, 6, groups=3, draws=4, rng=np.random.default_rng(5))
    parts = [batch.rows(slice(2 * h, 2 * h + 2)) for h in range(3)]
    g = [flatten(dense_grad(model, p.tokens, p.targets)[1]) for p in parts]
    if arm.mode == "spaco":
        from seco_lab import get_scheme

        w = get_scheme(arm.scheme).expected_weights(4, 2, 2)
    else:
        w = [1.0, 0.0, 0.0] if arm.mode == "truncated" else [1.0, 1.0, 1.0]
    S = [[flatten(s) for s in hop_strata(model, p.tokens, p.targets, 6, max_hops=2).strata] for p in parts]
    m = [sum(float(wp) * s for wp, s in zip(w, Sh)) for Sh in S]
    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    assert got["g_sq"] == pytest.approx(np.mean([float(g[a] @ g[b]) for a, b in pairs]), rel=1e-10)
    assert got["inner"] == pytest.approx(np.mean([float(m[a] @ g[b]) for a, b in pairs]), rel=1e-10)
    assert got["mean_sq"] == pytest.approx(np.mean([float(m[a] @ m[b]) for a, b in pairs]), rel=1e-10)
    mbar = sum(m) / 3
    assert got["data_var"] == pytest.approx(2 * sum(float((x - mbar) @ (x - mbar)) for x in m) / 2, rel=1e-10)
    if arm.mode != "spaco":
        assert got["sampling_var"] == 0 and got["shared_cov"] == 0
        return
    from seco_lab import get_scheme

    rng, own, cross = np.random.default_rng(5), [], []
    for _ in range(4):
        sub = get_scheme(arm.scheme).sampler.draw(4, 2, rng)
        D = [flatten(spaco_grad(model, p.tokens, p.targets, 6, arm.scheme, 2, subset=sub)[1]) - mh
             for p, mh in zip(parts, m)]
        own.append(np.mean([float(x @ x) for x in D]))
        cross.append(np.mean([float(D[a] @ D[b]) for a, b in pairs]))
    C = float(np.mean(cross))
    assert got["shared_cov"] == pytest.approx(C, rel=1e-8, abs=1e-14)
    assert got["sampling_var"] == pytest.approx(2 * (np.mean(own) - 0.5 * C), rel=1e-8)


def test_matched_scale_metrics_against_explicit_draws():
    """seco_lab.stats.chain_space.matched_scale (the bias study's columns) against explicit estimator vectors: the exact
    noise-to-signal and the best-scale MSE found by a 1-d minimiser over the draws' distribution."""
    from seco_lab.stats.chain_space import matched_scale

    rng = np.random.default_rng(7)
    g = rng.normal(size=5)
    noise = rng.normal(size=(6, 5)) * 0.3
    draws = g / 8 + noise - noise.mean(0)  # a shrunken, noisy estimator: 6 equally likely draws, mean g / 8
    q = np.full(6, 1 / 6)
    mean = q @ draws
    var = float(q @ ((draws - mean) ** 2).sum(1))
    gg = g @ g

    def err(a):
        return float(q @ ((a * draws - g) ** 2).sum(1)) / gg

    direct = optimize.minimize_scalar(err, bounds=(-100, 100), method="bounded", options={"xatol": 1e-12}).fun
    got = matched_scale(mean @ g / gg, mean @ mean / gg, var / gg)
    assert got["best_scale_mse"] == pytest.approx(direct, abs=1e-9)
    assert got["noise_to_signal"] == pytest.approx(var / (mean @ mean), rel=1e-12)
    # the raw variance relative to ||g||² understates the noise a tuned rate sees by ||g||² / ||E ĝ||²
    assert got["noise_to_signal"] == pytest.approx(64 * var / gg, rel=1e-12)
