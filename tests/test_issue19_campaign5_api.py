"""Issue 19, fifth hostile campaign (/work/c5/campaign.md F17-F21): the Python API's inputs it found coerced,
unguarded or failing late, each with the fix's test."""

import math
import re
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import random_batch, tiny_model

from seco_lab import accumulate_grads, chain_basis, enumerate_expectation, get_scheme, hop_strata, make_scheme
from seco_lab.core import checks
from seco_lab.estimators.schemes import Sampler
from seco_lab.stats import enumeration

HUGE = 10**400  # an int beyond float range (float(HUGE) raises OverflowError)

# ------------------------------------------------------------------ F17: scheme parameters are real numbers


@pytest.mark.parametrize("rho, error, message", [
    (True, TypeError, "rho must be a number in (0, 1] (or None for t/k), got True (bool)"),
    (np.bool_(True), TypeError, "rho must be a number in (0, 1]"),
    ("0.5", TypeError, "rho must be a number in (0, 1] (or None for t/k), got '0.5' (str)"),
    (HUGE, ValueError, "rho must be a number in (0, 1] (or None for t/k), got an integer too large for a float"),
    (float("nan"), ValueError, "rho must be a number in (0, 1] (or None for t/k), got nan"),
    (0, ValueError, "rho must lie in (0, 1], got 0"),
    (1.5, ValueError, "rho must lie in (0, 1], got 1.5"),
], ids=["True", "np.True_", "str", "HUGE", "nan", "0", "1.5"])
def test_a_bernoulli_rate_is_a_real_number_in_range_never_coerced(rho, error, message):
    with pytest.raises(error, match=re.escape(message)):
        get_scheme("bernoulli", rho=rho)
    with pytest.raises(error, match=re.escape(message)):  # the same check as the sampler's own
        Sampler("bernoulli", rho)


def test_a_valid_bernoulli_rate_is_kept_as_a_python_float():
    for rho in (0.5, 1, np.float32(0.5), np.int64(1), Fraction(1, 2)):
        s = get_scheme("bernoulli", rho=rho).sampler
        assert type(s.rho) is float and s.rho == float(rho)
        assert s.rate(4, 2) == Fraction(float(rho))
    assert get_scheme("bernoulli", rho=None).sampler.rate(4, 1) == Fraction(1, 4)


@pytest.mark.parametrize("cap", [True, "2", HUGE, float("inf"), float("nan"), 0],
                         ids=["True", "str", "HUGE", "inf", "nan", "0"])
def test_a_cap_is_a_real_finite_positive_number(cap):
    with pytest.raises(ValueError, match="cap must be a finite number > 0"):
        get_scheme("paper-capped", cap=cap)


# ------------------------------------------------------------------ F18: accumulate_grads' scale


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                          (True, TypeError), ("2", TypeError), (None, TypeError)])
def test_accumulate_grads_refuses_a_scale_seco_step_refuses(scale, error):
    from seco_lab import seco_step

    model = tiny_model(n_layers=1)
    tok, tgt = random_batch(17, 1, 8)
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with pytest.raises(error, match="scale must be a") as acc:
        accumulate_grads(model, grads, scale=scale)
    assert all(p.grad is None for p in model.parameters())  # nothing was written
    with pytest.raises(error) as step:
        seco_step(model, tok, tgt, 4, scale=scale)
    assert str(acc.value) == str(step.value)  # one check, one message


def test_accumulate_grads_still_scales_by_numbers():
    model = tiny_model(n_layers=1)
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    accumulate_grads(model, grads, scale=np.float64(2))
    accumulate_grads(model, grads, scale=3)
    assert all(torch.all(p.grad == 5) for p in model.parameters())


# ------------------------------------------------------------------ F19: boolean flags are bools


@pytest.mark.parametrize("flag", ["force", "remainder"])
@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None])
def test_hop_strata_flags_must_be_bools(flag, value):
    model = tiny_model(n_layers=1)
    tok, tgt = random_batch(17, 1, 8)
    with pytest.raises(TypeError, match=re.escape(f"{flag} must be True or False, got {value!r}")):
        hop_strata(model, tok, tgt, chunk_size=4, **{flag: value})


def test_force_no_does_not_switch_the_memory_guard_off(monkeypatch):
    model = tiny_model(n_layers=1)
    tok, tgt = random_batch(17, 1, 16)
    monkeypatch.setattr(checks, "MEMORY_GUARD_BYTES", 1)
    for call in (lambda f: hop_strata(model, tok, tgt, chunk_size=4, force=f),
                 lambda f: chain_basis(model, tok, tgt, chunk_size=4, max_hops=3, force=f)):
        with pytest.raises(TypeError, match="force must be True or False, got 'no'"):
            call("no")
        with pytest.raises(MemoryError):
            call(False)
        call(np.bool_(True))  # numpy's bool is a bool


def test_enumerate_expectations_flags_must_be_bools():
    model = tiny_model(n_layers=1)
    tok, tgt = random_batch(17, 1, 8)
    for flag in ("progress", "force"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
            enumerate_expectation(model, tok, tgt, 4, "paper", 1, **{flag: "no"})


# ------------------------------------------------------------------ F20: the full covariance under the memory guard


def test_enumeration_refuses_a_full_covariance_beyond_the_guard_before_any_draw(monkeypatch):
    model = tiny_model(n_layers=1, d_model=64, d_ff=256)
    d = sum(p.numel() for p in model.parameters())
    assert d * d * 8 > checks.MEMORY_GUARD_BYTES
    tok, tgt = random_batch(17, 1, 16)

    def no_draws(*a, **k):
        raise AssertionError("a draw was computed before the memory guard")

    monkeypatch.setattr(enumeration, "spaco_grad", no_draws)
    start = time.perf_counter()
    with pytest.raises(MemoryError, match=re.escape(f"{d:,} x {d:,} covariance of float64 = {d * d * 8:,} bytes")) as e:
        enumerate_expectation(model, tok, tgt, chunk_size=8, scheme="paper", budget=1, full_cov_max_params=10**7)
    assert time.perf_counter() - start < 5
    assert "lower full_cov_max_params below" in str(e.value) and "force=True" in str(e.value)
    # without the full covariance (the default limit) the same enumeration is under the guard
    monkeypatch.undo()
    ex = enumerate_expectation(model, tok, tgt, chunk_size=8, scheme="paper", budget=1)
    assert ex.cov is None and math.isfinite(ex.cov_trace)


def test_enumeration_guard_counts_the_draws_and_force_overrides_it(monkeypatch):
    model = tiny_model(n_layers=1)
    d = sum(p.numel() for p in model.parameters())
    tok, tgt = random_batch(17, 1, 8)
    monkeypatch.setattr(checks, "MEMORY_GUARD_BYTES", d * 8)  # less than the 2 draws' gradients
    with pytest.raises(MemoryError, match=re.escape(f"2 draw(s) x {d:,} parameters")):
        enumerate_expectation(model, tok, tgt, 4, "paper", 1, full_cov_max_params=0)
    ex = enumerate_expectation(model, tok, tgt, 4, "paper", 1, full_cov_max_params=0, force=True)
    assert ex.cov is None and ex.num_subsets == 2


@pytest.mark.parametrize("name, value, error", [("full_cov_max_params", -1, ValueError),
                                                ("full_cov_max_params", 1e3, TypeError),
                                                ("max_subsets", "10", TypeError), ("max_subsets", 0, ValueError)])
def test_enumeration_limits_are_integers(name, value, error):
    model = tiny_model(n_layers=1)
    tok, tgt = random_batch(17, 1, 8)
    with pytest.raises(error, match=name):
        enumerate_expectation(model, tok, tgt, 4, "paper", 1, **{name: value})


# ------------------------------------------------------------------ F21: factors beyond float range


@pytest.mark.parametrize("direct, hop, what", [(HUGE, 1, "direct factor c_0"), (1, HUGE, "hop factor c_q"),
                                               (Fraction(HUGE, 3), 1, "direct factor c_0")],
                         ids=["int-direct", "int-hop", "Fraction-direct"])
def test_make_scheme_refuses_a_factor_beyond_float_range(direct, hop, what):
    with pytest.raises(ValueError, match=re.escape(f"{what} must be a finite number >= 0 within float range")):
        make_scheme("x", direct, hop)


def test_a_factor_function_beyond_float_range_is_refused_naming_it():
    s = make_scheme("x", 1, lambda q, k, t, rho: HUGE)
    with pytest.raises(ValueError, match=re.escape("scheme 'x': hop(q=1, k=8, t=2, rho) returned, but c_q must be a "
                                                   "finite number >= 0 within float range")):
        s.factors(8, 2, 3)


def test_an_expected_weight_beyond_float_range_is_refused_naming_it():
    s = make_scheme("x", 1, 10**200)  # each factor is a float, their product is not
    assert s.factors(8, 8, 7)[1] == 1e200
    with pytest.raises(ValueError, match=re.escape("scheme 'x': the expected weight w(2) at k=8, t=8 is beyond float "
                                                   "range")):
        s.expected_weights(8, 8, 7)
    assert list(s.expected_weights(8, 8, 1)) == [1.0, 1e200]
    assert math.isinf(s.chain_weights(8, 8, 7)[-1])  # chain weights map overflow to inf, as documented
