"""g(>P) as a stratum of its own (hop_relay(lump=True)), not as g - sum_p g(p).

The Monte Carlo of the audit weights a draw's remainder by a scheme's chain weight W(P + 1), 16^9 ~ 7e10 for
`paper` at k/t = 16: a float32 difference of nearly equal vectors (~1e-7 ||g|| of rounding) turned into a
variance of 1e6 ||g||^2.  Here the lumped remainder is checked against an independent computation, the sum of
the enumerated chain vectors of more than P hops inside the draw (float64, tight), and shown to be exactly 0 in
float32 where no chain of the draw has more than P hops.
"""

import pytest
import torch
from helpers import random_batch, tiny_model

from seco_lab.estimators.spaco import chain_basis, flatten, hop_strata


@pytest.mark.parametrize("subset", [None, (0, 1, 3, 4), (1, 2, 4)])
@pytest.mark.parametrize("P", [0, 1, 2])
def test_the_lumped_remainder_is_the_sum_of_the_deeper_chains(subset, P):
    model = tiny_model(n_layers=3, seed=1)
    tok, tgt = random_batch(17, 1, 15, seed=2)  # k = 5 chunks of 3
    basis = chain_basis(model, tok, tgt, chunk_size=3, max_hops=4)
    inside = [c for c, chain in enumerate(basis.chains) if subset is None or set(chain) <= set(subset)]
    deeper = [c for c in inside if basis.hops[c] > P]
    expected = basis.vectors[deeper].sum(0) if deeper else torch.zeros(basis.vectors.shape[1], dtype=torch.float64)
    st = hop_strata(model, tok, tgt, 3, max_hops=P, subset=subset, remainder=True)
    got = flatten(st.remainder).double()
    scale = float(basis.vectors[inside].sum(0).norm())
    assert float(expected.norm()) > 1e-6 * scale or not deeper  # a remainder that is there is not rounding
    assert float((got - expected).norm()) <= 1e-13 * scale
    for p, g in enumerate(st.strata):  # the strata themselves are unchanged by lumping
        ref = [c for c in inside if basis.hops[c] == p]
        assert float((flatten(g).double() - basis.vectors[ref].sum(0)).norm()) <= 1e-13 * scale


@pytest.mark.parametrize("subset,P", [((0, 2, 4), 2), ((1, 3), 1), ((4,), 0), ((0, 1, 2, 3, 4), 4)])
def test_a_draw_without_deeper_chains_has_a_remainder_of_exactly_zero_in_float32(subset, P):
    """|I| <= P + 1: no chain inside the draw has more than P hops, so g_I(>P) is 0 -- bit for bit, not ~1e-7
    ||g|| as total - sum_p g(p) was in float32."""
    model = tiny_model(n_layers=3, seed=1).float()
    tok, tgt = random_batch(17, 1, 15, seed=2)
    st = hop_strata(model, tok, tgt, 3, max_hops=P, subset=subset, remainder=True)
    assert all(int(torch.count_nonzero(g)) == 0 for g in st.remainder.values())
    assert float(flatten(st.total()).norm()) > 0
