"""Issue 19, hangs and memory (items 14-15): worker pools are capped at the work and the cores, and work
that grows exponentially or with the number of strata is clipped where it is provably zero, or refused
up front with its cost stated (``force=True`` overrides)."""

import math
import os
import tracemalloc
from fractions import Fraction

import pytest
import torch
from helpers import random_batch, tiny_model

from seco_lab.core import checks
from seco_lab.estimators.schemes import get_scheme
from seco_lab.estimators.spaco import chain_basis, hop_strata
from seco_lab.studies import runner as study_runner
from seco_lab.studies.runner import worker_count


def test_workers_are_capped_at_the_work_and_the_usable_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert worker_count(1000, 8) == 2  # bias-study --quick --jobs 1000: 8 groups, 2 cores
    assert worker_count(1000, 1) == 1 and worker_count(2, 0) == 1 and worker_count(1, 8) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert worker_count(1000, 8) == 8 and study_runner.usable_cores() == 64


def test_expected_weights_with_a_huge_max_hops_costs_only_its_zeros():
    for name in ("falling-factorial", "paper", "released-unbiased"):  # uniform draws of t chunks
        scheme = get_scheme(name)
        exact = scheme.expected_weights_exact(4, 2, 3)
        tracemalloc.start()
        w = scheme.expected_weights(4, 2, 10**6)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(w) == 10**6 + 1 and peak < 64 << 20
        assert list(w[:4]) == [float(x) for x in exact] and not w[4:].any()
    # uniform sampling keeps no chain past t - 1 hops: the computed weights there were already exact zeros
    assert get_scheme("falling-factorial").expected_weights_exact(4, 2, 3)[2:] == [Fraction(0)] * 2
    with pytest.raises(ValueError, match=r"1,000,000,000,001 weights, but no chain of k=4 chunks has more than 3 "
                                         r"hops; pass P <= k - 1 = 3"):
        get_scheme("paper").expected_weights(4, 2, 10**12)
    # Bernoulli weights never vanish (rho^(p+1) W(p)): exact up to a bound past k - 1, refused beyond
    bern = get_scheme("bernoulli")
    assert len(bern.expected_weights(4, 2, 3 + 4096)) == 4100
    with pytest.raises(ValueError, match="no chain of k=4 chunks has more than 3 hops"):
        bern.expected_weights(4, 2, 10**6)


def test_hop_strata_clips_max_hops_to_k_minus_1_instead_of_allocating_a_copy_per_stratum():
    model = tiny_model(n_layers=1)
    tok, tgt = random_batch(17, 1, 16)
    full = hop_strata(model, tok, tgt, chunk_size=4)
    tracemalloc.start()
    huge = hop_strata(model, tok, tgt, chunk_size=4, max_hops=10**5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert huge.max_hops == 3 and peak < 64 << 20
    for a, b in zip(full.strata, huge.strata):
        assert all(torch.equal(a[n], b[n]) for n in a)
    # the same estimate through the scheme's weights (which are clipped the same way)
    est = huge.estimate("paper", 2)
    assert all(torch.equal(est[n], full.estimate("paper", 2)[n]) for n in est)


def test_exponential_and_per_stratum_work_is_refused_up_front_with_its_cost(monkeypatch):
    model = tiny_model(n_layers=1)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tok, tgt = random_batch(17, 1, 20)
    with pytest.raises(MemoryError, match=r"chain_basis would hold .* GiB \(1,048,575 chains of at most 19 hops over "
                                          r"k=20 chunks .*pass force=True"):
        chain_basis(model, tok, tgt, chunk_size=1, max_hops=19)
    assert 1_048_575 == sum(math.comb(20, m) for m in range(1, 21))
    monkeypatch.setattr(checks, "MEMORY_GUARD_BYTES", 3 * grad_bytes)  # room for 3 strata
    with pytest.raises(MemoryError, match=r"hop_strata would hold .* \(5 strata x "):
        hop_strata(model, tok, tgt, chunk_size=4)
    assert hop_strata(model, tok, tgt, chunk_size=4, max_hops=2).max_hops == 2
    assert hop_strata(model, tok, tgt, chunk_size=4, force=True).max_hops == 4
    small = chain_basis(model, tok[:, :8], tgt[:, :8], chunk_size=4, max_hops=1)  # 3 chains fit
    assert len(small.chains) == 3
