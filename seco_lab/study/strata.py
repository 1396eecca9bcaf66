"""Metrics of the study computed from hop strata Gram matrices beyond ``seco_lab.strata_stats``."""

from __future__ import annotations

import numpy as np

from ..strata_stats import StrataGram


def per_tensor_residual(gram: StrataGram, expected_weights) -> float:
    """min over one scale a_i per tensor of ||(a_i E ĝ_i − g_i)_i|| / ||g||, as the squared norm of the residual
    itself, sum_i (a_i w − 1)^T G_i (a_i w − 1) with a_i = w^T G_i 1 / w^T G_i w: no cancellation, so an
    unbiased scheme (w = 1, a_i = 1) gives exactly 0 (the difference form ||g_i||² − <m_i, g_i>²/||m_i||² of
    ``bias_metrics`` leaves a ~1e-8 floor after the square root)."""
    w = np.asarray(expected_weights, dtype=np.float64)
    one = np.ones_like(w)
    total = 0.0
    for G in gram.per_tensor:
        mm = float(w @ G @ w)
        a = float(w @ G @ one) / mm if mm > 0 else 0.0
        v = a * w - one
        total += max(float(v @ G @ v), 0.0)
    return float(np.sqrt(total / float(one @ gram.total @ one)))
