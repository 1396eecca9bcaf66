"""Inputs that used to give a silent wrong number or a raw traceback (issue 11): each now
either gets the right answer or fails with a message that names the problem."""

import re

import numpy as np
import pytest
import torch
from helpers import random_batch, rel_err, tiny_model

from seco_lab import (
    TinyConfig,
    chain_basis,
    dense_grad,
    enumerate_expectation,
    forward_loss,
    get_scheme,
    hop_strata,
    seco_grad,
    spaco_grad,
)
from seco_lab.core.protocol import ChunkOutput
from seco_lab.models.tiny import rotary


@pytest.fixture(scope="module")
def problem():
    model = tiny_model(n_layers=2)
    tok, tgt = random_batch(17, 1, 12, seed=3)
    return model, tok, tgt


# ------------------------------------------------------------------ silent wrong -> error


@pytest.mark.parametrize("subset", [(1.7, 3.2), "13", (1, True), (np.float64(1.0), 3)])
def test_non_integer_subsets_are_refused(problem, subset):
    model, tok, tgt = problem
    with pytest.raises(TypeError, match="chunk indices must be integers|sequence of chunk indices"):
        spaco_grad(model, tok, tgt, chunk_size=3, scheme="paper", budget=2, subset=subset)


def test_repeated_chunks_are_refused_by_every_function(problem):
    model, tok, tgt = problem
    with pytest.raises(ValueError, match="repeats a chunk"):
        spaco_grad(model, tok, tgt, chunk_size=3, scheme="bernoulli", budget=2, subset=(1, 1, 2))
    with pytest.raises(ValueError, match="repeats a chunk"):
        hop_strata(model, tok, tgt, chunk_size=3, subset=(1, 1, 2))


@pytest.mark.parametrize("max_hops", [1.5, 2.0, "2", True, -1])
def test_max_hops_has_one_rule_everywhere(problem, max_hops):
    model, tok, tgt = problem
    calls = [
        lambda: spaco_grad(model, tok, tgt, 3, "paper", 2, subset=(0, 2), max_hops=max_hops),
        lambda: hop_strata(model, tok, tgt, 3, max_hops=max_hops),
        lambda: chain_basis(model, tok, tgt, 3, max_hops=max_hops),
        lambda: get_scheme("paper").expected_weights(4, 2, max_hops),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=re.escape("max_hops P must be an integer >= 0")):
            call()


def test_numpy_integers_are_accepted_wherever_ints_are(problem):
    model, tok, tgt = problem
    _, ref = spaco_grad(model, tok, tgt, 3, "paper", 2, subset=(0, 2))
    _, got = spaco_grad(model, tok, tgt, np.int64(3), "paper", np.int32(2), subset=np.array([0, 2]),
                        max_hops=np.int64(1))
    assert rel_err(got, ref) == 0.0
    assert len(hop_strata(model, tok, tgt, np.int64(3), max_hops=np.int8(1)).strata) == 2


def test_a_torch_generator_is_refused_with_a_hint(problem):
    model, tok, tgt = problem
    with pytest.raises(TypeError, match="numpy.random.default_rng"):
        spaco_grad(model, tok, tgt, 3, "paper", 2, generator=torch.Generator())


def test_bfloat16_rotary_positions_stay_distinct():
    # bf16 has 8 significant bits: positions built in bf16 collapse (1000 == 1001 == 1002), which
    # rotates late tokens by the wrong angle.  Now only the final cos/sin are rounded to bf16.
    x = torch.ones(1, 1, 4096, 8, dtype=torch.bfloat16)
    ref = rotary(x.double(), 0, 10000.0)
    err = (rotary(x, 0, 10000.0).double() - ref).abs().max()
    assert float(err) < 2e-2  # bf16 rounding of values in [-2, 2]: <= 2^-7
    bf16_positions = torch.arange(0, 4096, dtype=torch.bfloat16)
    assert torch.unique(bf16_positions).numel() < 1000  # what the old construction worked with
    old_angle = torch.outer(bf16_positions, torch.ones(1, dtype=torch.bfloat16)).double()[:, 0]
    assert float((old_angle.cos() - ref[0, 0, :, 0]).abs().max()) > 0.5  # the bound above can fail
    assert torch.unique(torch.arange(0, 4096, dtype=torch.float64)).numel() == 4096


def test_rotary_positions_match_float64_at_every_dtype():
    x = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    ref = rotary(x, 1000, 10000.0)
    got = rotary(x.float(), 1000, 10000.0).double()
    assert float((got - ref).abs().max()) < 1e-5


# ------------------------------------------------------------------ tracebacks -> clear errors


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_small_integer_token_dtypes_work(problem, dtype):
    model, tok, tgt = problem
    _, ref = seco_grad(model, tok, tgt, chunk_size=4)
    _, got = seco_grad(model, tok.to(dtype), tgt.to(dtype), chunk_size=4)
    assert rel_err(got, ref) == 0.0


class _NoParams(torch.nn.Module):
    def chunk_forward(self, tokens, targets, past, start, ignore_index=-100):
        raise AssertionError("never called")


class _TupleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_model(n_layers=1)

    def chunk_forward(self, tokens, targets, past, start, ignore_index=-100):
        out = self.inner.chunk_forward(tokens, targets, past, start, ignore_index)
        return out.loss_sum, out.cache


def test_model_without_parameters_is_refused(problem):
    _, tok, tgt = problem
    with pytest.raises(ValueError, match="has no parameters"):
        seco_grad(_NoParams(), tok, tgt, chunk_size=4)


def test_chunk_forward_returning_a_tuple_is_refused(problem):
    _, tok, tgt = problem
    with pytest.raises(TypeError, match=re.escape("must return seco_lab.core.protocol.ChunkOutput")):
        seco_grad(_TupleModel(), tok, tgt, chunk_size=4)
    assert ChunkOutput  # the type the message names exists


def test_non_finite_weights_are_reported_not_differentiated(problem):
    _, tok, tgt = problem
    model = tiny_model(n_layers=2)
    with torch.no_grad():
        model.blocks[1].mlp.up_proj.weight[0, 0] = float("nan")
    for call in (lambda: seco_grad(model, tok, tgt, 4), lambda: dense_grad(model, tok, tgt),
                 lambda: forward_loss(model, tok, tgt, 4), lambda: hop_strata(model, tok, tgt, 4)):
        with pytest.raises(FloatingPointError, match=r"loss of chunk \d+ is nan"):  # SeCO: found in pass 2
            call()


@pytest.mark.parametrize("field, value, message", [
    ("norm_eps", -1e-6, "norm_eps must be a finite number > 0"),
    ("norm_eps", float("nan"), "norm_eps must be a finite number > 0"),
    ("rope_theta", 0.5, "rope_theta must be a finite number > 1"),
    ("d_model", 16.0, "TinyConfig.d_model must be an integer"),
    ("n_layers", 0, "TinyConfig.n_layers must be >= 1"),
])
def test_tiny_config_refuses_values_that_train_to_nonsense(field, value, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        TinyConfig(**{field: value})


def test_forward_loss_equals_the_dense_loss(problem):
    model, tok, tgt = problem
    ref, _ = dense_grad(model, tok, tgt)
    assert abs(float(forward_loss(model, tok, tgt, 5)) - float(ref)) <= 1e-13


def test_enumeration_refuses_bad_budget_types(problem):
    model, tok, tgt = problem
    with pytest.raises(TypeError, match="budget t must be an integer"):
        enumerate_expectation(model, tok, tgt, 3, "paper", 2.0)
