"""Every number of an audit, as quadratic forms in stored Gram matrices (docs/audit.md derives them).

Per sequence i the strata stage stores S_i = [g_i(0), ..., g_i(P), g_i(>P)] (P + 2 vectors; the last is
the measured remainder, so 1'S_i = g_i exactly).  A scheme with expected weights w (w(P+1), the weight
of the first unmeasured stratum, stands for the remainder) has conditional mean m_i = w'S_i.

* bias (one sequence): ``seco_lab.stats.strata.bias_metrics`` on the per-tensor Gram of S_i, with the
  remainder bound  |error| <= span_w * ||g(>P)|| / ||g||  (times the best scale |a| for the best-scale
  residual), span_w = max - min of w(p) over P < p <= L, assuming the strata beyond P do not cancel
  (sum_{p>P} ||g(p)|| ~ ||g(>P)||);
* Monte Carlo (one sequence, N draws I_n): x_n = W'S_{I_n}; tr Sigma_hat = sum_n ||x_n - xbar||^2/(N-1)
  with a delete-one jackknife interval; noise-to-signal tr Sigma / ||E g_hat||^2 with the exact E g_hat;
* data noise (N sequences): tr Sigma_d = sum_i ||g_i - gbar||^2/(N-1),
  ||gbar||^2 debiased = ||mean g_i||^2 - tr Sigma_d/N = sum_{i != j} <g_i, g_j>/(N(N-1));
* equal compute (batch B, SeCO cost c_0, scheme cost c_s, B_s = B c_0/c_s):
  MSE_0(B) = (a/B) / (G + a/B),  MSE_s(B) = 1 - X^2 / (G (M + v/B)),  v = (tr Cov_i m_i + E_i tr Sigma_s,i) c_s/c_0,
  with G = ||gbar||^2, a = tr Sigma_d, M = ||mbar||^2, X = <mbar, gbar> (``population_terms``: G and a from
  the data sequences, the scheme's ratios to them from the strata sequences); SeCO has the smaller error for
  B > B* = (X^2 a - G^2 v) / (G (G M - X^2)).
"""

from __future__ import annotations

import numpy as np
from scipy import stats as sps

from ...stats.strata import StrataGram, bias_metrics

__all__ = ["remainder_bound", "strata_bias", "mc_stats", "jackknife", "data_noise", "population_terms",
           "equal_compute_mse", "crossover_batch", "weights_with_remainder"]


def weights_with_remainder(scheme, k: int, t: int, max_hops: int) -> np.ndarray:
    """[w(0), ..., w(P), w(P+1)]: the expected weights, the last one standing for the remainder."""
    return scheme.expected_weights(k, t, max_hops + 1)


def remainder_bound(scheme, k: int, t: int, max_hops: int, n_layers: int, remainder_ratio: float) -> float:
    """span_w ||g(>P)|| / ||g||: how far lumping the strata beyond P (weighted w(P+1)) can move E g_hat / ||g||
    (when the strata beyond P do not cancel each other); 0 when no chain is deeper than P."""
    deepest = min(n_layers, k - 1)
    if deepest <= max_hops:
        return 0.0
    w = scheme.expected_weights(k, t, deepest)[max_hops + 1:]
    return float((w.max() - w.min()) * remainder_ratio)


def strata_bias(per_tensor_gram: np.ndarray, names, scheme, k: int, t: int, max_hops: int, n_layers: int,
                remainder_ratio: float) -> dict[str, float]:
    """Exact first-order metrics of one scheme from the per-tensor Gram of [g(0..P), g(>P)], and their bounds."""
    w = weights_with_remainder(scheme, k, t, max_hops)
    m = bias_metrics(StrataGram(np.asarray(per_tensor_gram, dtype=np.float64), list(names)), w)
    bound = remainder_bound(scheme, k, t, max_hops, n_layers, remainder_ratio)
    m["rel_bias_bound"] = bound
    m["best_scale_residual_bound"] = abs(m["scale"]) * bound
    m.update({f"w_p{p}": float(x) for p, x in enumerate(w[:-1])})
    m["w_rest"] = float(w[-1])
    return m


def jackknife(values_loo: np.ndarray, estimate: float, level: float = 0.95) -> tuple[float, float, float]:
    """(standard error, low, high): delete-one jackknife from the leave-one-out estimates, t quantile."""
    n = len(values_loo)
    se = float(np.sqrt((n - 1) / n * np.sum((values_loo - values_loo.mean()) ** 2)))
    q = sps.t.ppf(0.5 + level / 2, n - 1)
    return se, estimate - q * se, estimate + q * se


def _variance_u(K: np.ndarray) -> tuple[float, np.ndarray]:
    """Unbiased tr Sigma from the Gram K of N iid vectors, and its N leave-one-out values.

    tr Sigma_hat = (sum_n K_nn - sum_{n,m} K_nm / N) / (N - 1)."""
    n = len(K)
    diag, row, tot = np.diag(K), K.sum(1), K.sum()
    est = (diag.sum() - tot / n) / (n - 1)
    if n < 3:
        return float(est), np.full(n, np.nan)
    m = n - 1
    loo_tot = tot - 2 * row + diag
    loo = ((diag.sum() - diag) - loo_tot / m) / (m - 1)
    return float(est), loo


def _cross_u(K: np.ndarray) -> tuple[float, np.ndarray]:
    """sum_{n != m} K_nm / (N(N-1)) (unbiased for ||E x||^2 or <E x, E y> from a cross Gram) and its
    leave-one-out values."""
    n = len(K)
    off = K.sum() - np.trace(K)
    est = off / (n * (n - 1))
    if n < 3:
        return float(est), np.full(n, np.nan)
    row, col, diag = K.sum(1), K.sum(0), np.diag(K)
    loo = (off - (row - diag) - (col - diag)) / ((n - 1) * (n - 2))
    return float(est), loo


def mc_stats(draw_gram: np.ndarray, draw_exact: np.ndarray, exact_gram: np.ndarray, W: np.ndarray, w: np.ndarray,
             level: float = 0.95) -> dict[str, float]:
    """Monte Carlo statistics of one scheme from Gram matrices.

    ``draw_gram[(n, p), (m, q)] = <S_{I_n}(p), S_{I_m}(q)>`` shaped (N, R, N, R) with R = P + 2 rows per draw
    (strata of the draw and its remainder), ``draw_exact[(n, p), r] = <S_{I_n}(p), S(r)>`` shaped (N, R, R)
    against the exact strata S, ``exact_gram`` = S S' (R, R).  W: chain weights (the draw's combination),
    w: expected weights (E g_hat = w'S exactly).
    """
    X = np.einsum("p,npmq,q->nm", W, draw_gram, W)  # <x_n, x_m>
    n = len(X)
    one = np.ones(len(w))
    xe = np.einsum("p,npr,r->n", W, draw_exact, w)  # <x_n, E g_hat>
    gg = float(one @ exact_gram @ one)
    ee = float(w @ exact_gram @ w)
    eg = float(w @ exact_gram @ one)
    var, var_loo = _variance_u(X)
    var_se, var_lo, var_hi = jackknife(var_loo, var, level)
    # debiased ||xbar - E g_hat||^2: the U statistic of <x_n - e, x_m - e> (0 in expectation: a check)
    D = X - xe[:, None] - xe[None, :] + ee
    dev, dev_loo = _cross_u(D)
    dev_se, dev_lo, dev_hi = jackknife(dev_loo, dev, level)
    out = {"n_draws": n, "g_norm2": gg, "mean_norm2": ee, "rel_var": var / gg, "rel_var_low": var_lo / gg,
           "rel_var_high": var_hi / gg, "rel_var_se": var_se / gg,
           "mean_dev": dev / gg, "mean_dev_low": dev_lo / gg, "mean_dev_high": dev_hi / gg,
           "mean_dev_covered": float(dev_lo <= 0.0 <= dev_hi)}
    if ee > 0:
        out.update(noise_to_signal=var / ee, noise_to_signal_low=var_lo / ee, noise_to_signal_high=var_hi / ee)
        out["best_scale_mse"] = 1.0 - eg**2 / (gg * (ee + var))
    else:
        out.update(noise_to_signal=np.inf, noise_to_signal_low=np.inf, noise_to_signal_high=np.inf,
                   best_scale_mse=1.0)
    return out


def data_noise(gram: np.ndarray) -> dict[str, float]:
    """tr Sigma_d, ||mean g_i||^2 and the debiased ||gbar||^2 from the Gram of N per-sequence gradients."""
    n = len(gram)
    if n < 2:
        raise ValueError("the data noise needs at least 2 sequences")
    tr, _ = _variance_u(gram)
    mean2 = float(gram.sum() / n**2)
    out = {"n_sequences": n, "tr_sigma_data": tr, "mean_norm2": mean2, "gbar_norm2": mean2 - tr / n,
           "mean_seq_norm2": float(np.trace(gram) / n)}
    out["data_noise_to_signal"] = tr / out["gbar_norm2"] if out["gbar_norm2"] > 0 else np.inf
    if n >= 3:
        _, loo = _variance_u(gram)
        _, lo, hi = jackknife(loo, tr)
        out.update(tr_sigma_data_low=lo, tr_sigma_data_high=hi)
    return out


def _cov_u(A: np.ndarray) -> float:
    """Unbiased sample tr Cov(x, y) from the cross Gram A_ij = <x_i, y_j>: (tr A - sum A / N) / (N - 1)."""
    n = len(A)
    return float((np.trace(A) - A.sum() / n) / (n - 1))


def population_terms(cross: np.ndarray, w: np.ndarray, data_gram: np.ndarray | None = None) -> dict[str, float]:
    """G = ||gbar||^2, a = tr Sigma_d, M = ||mbar||^2, X = <mbar, gbar>, C = tr Cov_i(m_i) for weights w.

    ``cross[i, p, j, q] = <S_i(p), S_j(q)>`` over the strata sequences, ``data_gram`` the Gram of the data
    sequences' exact gradients (default: the strata sequences' own).  G and a come from the data sequences
    (debiased, ``data_noise``); the scheme enters through ratios measured on the strata sequences, each
    product a U statistic (unbiased):

        X = G * U(m, g) / U(g, g),   M = G * U(m, m) / U(g, g),   C = a * trCov(m) / trCov(g),

    so an unbiased scheme (m_i = g_i) reduces exactly to SeCO's terms and a pure rescaling m_i = c g_i
    to c G, c^2 G, c^2 a, whatever the two sets' sampling error.
    """
    one = np.ones(cross.shape[1])
    gg = np.einsum("p,ipjq,q->ij", one, cross, one)
    mg = np.einsum("p,ipjq,q->ij", w, cross, one)
    mm = np.einsum("p,ipjq,q->ij", w, cross, w)
    noise = data_noise(gg if data_gram is None else np.asarray(data_gram))
    G, a = noise["gbar_norm2"], noise["tr_sigma_data"]
    g_u, mg_u, mm_u = _cross_u(gg)[0], _cross_u(mg)[0], _cross_u(mm)[0]
    spread = _cov_u(gg)
    if not spread > 1e-12 * float(np.trace(gg)) / len(gg) or g_u == 0:  # campaign 32 V8: a ZeroDivisionError
        raise ValueError(f"the {len(gg)} strata sequences' exact gradients do not vary (tr Cov = {spread:.3g}): their "
                         "token windows are the same (texts that begin alike, or one text named twice), so there is "
                         "no data noise to compare the schemes' noise with; audit texts that differ (the units "
                         "computed are kept)")
    X = G * mg_u / g_u
    M = G * mm_u / g_u
    C = a * _cov_u(mm) / spread
    return {"G": G, "a": a, "M": M, "X": X, "C": C, "n_strata_sequences": len(gg),
            "n_data_sequences": noise["n_sequences"], "strata_gbar_norm2": g_u}


def equal_compute_mse(G: float, a: float, M: float, X: float, v: float, batch: float) -> tuple[float, float]:
    """(SeCO's, the scheme's) best-scale MSE at batch ``batch`` and equal compute; v is the scheme's per-sequence
    variance times its cost ratio c_s/c_0 (so its batch-mean variance is v / batch)."""
    if G <= 0:  # a debiased ||g||^2 that noise pushed to or below zero: no signal to align with
        return 1.0, 1.0
    seco = (a / batch) / (G + a / batch)
    scheme = 1.0 - X**2 / (G * (M + v / batch)) if M + v / batch > 0 else 1.0
    # estimated moments can break Cauchy-Schwarz by noise; the MSE of a best scale lies in [0, 1]
    return float(min(max(seco, 0.0), 1.0)), float(min(max(scheme, 0.0), 1.0))


def crossover_batch(G: float, a: float, M: float, X: float, v: float) -> float:
    """B* above which SeCO's equal-compute best-scale MSE is the smaller: 0 when SeCO wins at every B,
    inf when it never does."""
    bias = G * (G * M - X**2)  # >= 0 (Cauchy-Schwarz): the scheme's direction bias
    edge = X**2 * a - G**2 * v  # > 0: the scheme's noise advantage
    if edge <= 0:
        return 0.0
    if bias <= 1e-12 * G * G * M:  # no direction bias beyond rounding (an unbiased scheme): SeCO never overtakes
        return float("inf")
    return float(edge / bias)
