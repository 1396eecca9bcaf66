"""The recomputation check of pass 2 (``seco_lab.core.checks.check_recomputed``): a rebuilt chunk whose cache
differs from its first pass is an error naming the chunk, not a silently wrong gradient."""

import pytest
import torch
from helpers import rel_err, tiny_model

from seco_lab import dense_grad, hop_strata, seco_grad, spaco_grad
from seco_lab.core.checks import RecomputationError, recompute_check
from seco_lab.core.protocol import ChunkOutput


class Rebuilt:
    """A chunk model (no ``deterministic`` attribute) whose forward under grad -- a pass-2 rebuild -- changes
    its cache: ``how`` = "dtype" casts it to float32, "noise" adds 1e-6 relative noise."""

    def __init__(self, inner, how: str):
        self.inner, self.how = inner, how

    def chunk_forward(self, tokens, targets, past, start, ignore_index=-100):
        out = self.inner.chunk_forward(tokens, targets, past, start, ignore_index)
        if not torch.is_grad_enabled():
            return out
        change = (lambda t: t.float()) if self.how == "dtype" else (lambda t: t * (1 + 1e-6))
        return ChunkOutput(out.loss_sum, tuple((change(k), change(v)) for k, v in out.cache))

    def parameters(self):
        return self.inner.parameters()

    def named_parameters(self):
        return self.inner.named_parameters()


def batch(n=12, vocab=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, n), generator=g), torch.randint(0, vocab, (2, n), generator=g)


def test_a_rebuilt_cache_of_another_dtype_is_refused_by_default_naming_the_chunk():
    tok, tgt = batch()
    model = Rebuilt(tiny_model(), "dtype")
    with pytest.raises(RecomputationError, match=r"chunk 1's rebuilt cache tensor 0 .*float32.*float64"):
        seco_grad(model, tok, tgt, chunk_size=4)
    with pytest.raises(RecomputationError, match="chunk"):
        hop_strata(model, tok, tgt, chunk_size=4)


def test_a_rebuilt_cache_with_other_values_is_refused_by_default_and_seen_only_by_the_values_check():
    tok, tgt = batch()
    model = Rebuilt(tiny_model(), "noise")
    says = r"chunk 1's rebuilt cache tensor 0 differs from its first pass \(\|rebuilt - first\| = 1e-06 \|first\|; "
    with pytest.raises(RecomputationError, match=says + r"rounding is allowed 1.5e-08\)"):
        seco_grad(model, tok, tgt, chunk_size=4)
    with pytest.raises(RecomputationError):
        spaco_grad(model, tok, tgt, 4, "paper", budget=2, subset=(0, 2))
    with recompute_check("checksum"), pytest.raises(RecomputationError):  # the older name of "values"
        seco_grad(model, tok, tgt, chunk_size=4)
    with recompute_check("metadata"):
        loss, grads = seco_grad(model, tok, tgt, chunk_size=4)  # metadata alike: not seen
    assert rel_err(grads, dense_grad(model.inner, tok, tgt)[1]) > 1e-10  # ... and the gradient is wrong


def test_a_deterministic_model_passes_the_values_check_and_keeps_its_exact_gradient():
    tok, tgt = batch()
    model = tiny_model()
    _, grads = seco_grad(model, tok, tgt, chunk_size=4)
    strata = hop_strata(model, tok, tgt, chunk_size=4)
    ref = dense_grad(model, tok, tgt)[1]
    assert rel_err(grads, ref) < 1e-12 and rel_err(strata.total(), ref) < 1e-12


def test_the_check_can_be_switched_off_and_a_bad_mode_is_refused():
    tok, tgt = batch()
    with recompute_check("none"):
        seco_grad(Rebuilt(tiny_model(), "dtype"), tok, tgt, chunk_size=4)
    with pytest.raises(ValueError, match="recompute_check mode must be one of"):
        with recompute_check("sometimes"):
            pass
