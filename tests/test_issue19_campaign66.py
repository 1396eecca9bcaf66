"""Issue 19, campaign 63 F4 (docs/hostile_campaign_63.md, _64.md): on 16-bit logits -- a float32 model under
bfloat16 autocast, a bfloat16 model -- a loss that computes its cross-entropy in 16 bits itself (a float16
cross-entropy, a log-softmax by hand in bfloat16) and returns float32 was refused as "a term": the check held it to
float32's rounding (2.4e-7), and measured a loss's own rounding only on float32 and float64 outputs.  Its 16-bit
arithmetic is now kept in float32 in a second run (``_Widened`` on a 16-bit output), and what the two runs differ by
is the loss's rounding, as for a float32 model's bfloat16 loss (J4).

Campaign 66 (docs/hostile_campaign_66.md) then found two more false refusals of plain 16-bit losses, fixed in turn:
LSE16 (a 16-bit tensor read by two ops summed their gradients in 16 bits in the float32 run too) and F16BF (a float16
model's bfloat16 loss returned in float32, refused by the value check); their tests fail on 1440d1d.

Campaign 69 COPYSAME (a 16-bit model's logits copied into a buffer of their own dtype, then a cross-entropy there,
refused: every 16-bit step it recorded was of size 0) is fixed with its test; it fails on c246e16.
A hostile review of that fix found three more (``test_c69r_*``, each failing on 176c204): a 16-bit tensor's
``.dtype`` read float32 in the remeasure; a view written into and read through a fresh view; a no-op write of a
large constant sizing the write's rounding step.

Each F4 test fails on 45ca4bd, except the gated term's refused cases (0.05, 0.2), kept as guards of the new
remeasure; the terms' sizes are measured independently in float64 autograd."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import trainer_case as tc
from test_issue19_campaign57 import _by_hand, _ce, _HookedLoss, _llama
from test_issue19_campaign63 import PASSED, STATED, _effect, _stated

from seco_lab.integrations.transformers import SeCOArguments, _next_slice_of, _Widened


def _log_softmax_f16(z, y, items):
    logp = F.log_softmax(z.half(), -1).float()
    return F.nll_loss(logp.reshape(-1, logp.shape[-1]), y.reshape(-1), reduction="sum") / items


SIXTEEN_BIT = {  # (the model's dtype, bf16 autocast, the loss on its logits z)
    "autocast, float16 cross-entropy": (torch.float32, True, lambda z, y, n: _ce(z.half(), y, n).float()),
    "autocast, bfloat16 log-softmax by hand": (torch.float32, True,
                                               lambda z, y, n: _by_hand(z.bfloat16(), y, n).float()),
    "autocast, float16 log_softmax": (torch.float32, True, _log_softmax_f16),
    "bfloat16 model, log-softmax by hand": (torch.bfloat16, False, lambda z, y, n: _by_hand(z, y, n).float()),
    "bfloat16 model, float16 cross-entropy": (torch.bfloat16, False, lambda z, y, n: _ce(z.half(), y, n).float()),
}


def _trainer(folder, dtype, bf16, loss):
    model = _HookedLoss.of(tc.for_seco(tc.tiny_llama(dtype=dtype)), loss)
    return tc.make_trainer(folder, seco=SeCOArguments(chunk_size=4), model=model, max_steps=1, bf16=bf16)


@pytest.mark.parametrize("case", SIXTEEN_BIT)
def test_f4_a_16_bit_cross_entropy_on_16_bit_logits_trains(tmp_path, caplog, case):
    """The plain loss trains (it was refused, 1e-3..4e-3 apart against 2.4e-7 allowed); its rounding was measured
    (not zero: it does compute in 16 bits), and the passing warning says how and states the sizes."""
    dtype, bf16, loss = SIXTEEN_BIT[case]
    trainer = _trainer(tmp_path, dtype, bf16, loss)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    measured = trainer.seco_loss_check_measured
    assert 1e-4 < measured["rounding"] < 2 * torch.finfo(torch.bfloat16).eps
    passed = next(r.getMessage() for r in caplog.records if PASSED in r.getMessage())
    visible = float(STATED.search(passed).group(1))
    assert measured["gradient"] <= measured["allowed"] <= measured["not_seen_below"] == pytest.approx(visible, rel=0.05)
    assert "its casts and 16-bit arithmetic on the bfloat16 logits kept in float32" in passed


@pytest.mark.parametrize("smoothing", [0.05, 0.2])
@pytest.mark.parametrize("case", ["autocast, float16 cross-entropy", "bfloat16 model, log-softmax by hand"])
def test_f4_a_term_beyond_the_stated_size_is_refused(tmp_path, caplog, case, smoothing):
    """Label smoothing in the same 16-bit loss, whose effect on the gradient (float64 autograd on the logits the loss
    saw) exceeds the size the plain loss's check states for a term its float32 run computes too, is refused."""
    dtype, bf16, _ = SIXTEEN_BIT[case]
    seen = []

    def loss(z, y, items):
        seen.append((z.detach().clone(), y.clone()))
        x = z.half() if case.endswith("cross-entropy") else z
        return (_ce if case.endswith("cross-entropy") else _by_hand)(x, y, items, smoothing).float()

    plain = _trainer(tmp_path / "plain", dtype, bf16, SIXTEEN_BIT[case][2])
    with caplog.at_level(logging.WARNING):
        plain.train()
    stated = float(STATED.search(caplog.text).group(1))  # (the size of a term its float32 run sees too)
    with pytest.raises(ValueError, match="a term in the stock loss"):
        _trainer(tmp_path / "term", dtype, bf16, loss).train()
    z, y = seen[0]
    assert _effect(z, y, smoothing) > 1.1 * stated


@pytest.mark.parametrize("smoothing", [0.01, 0.05, 0.2])
def test_f4_a_term_the_float32_run_leaves_out_is_refused_or_within_the_stated_size(tmp_path, caplog, smoothing):
    """A term gated on isinstance(x, torch.HalfTensor) -- on as the loss runs, off where its float16 copy is kept in
    float32 -- is taken for rounding only within the stated size (the ROUNDING_STEPS bound on the narrowings' steps):
    refused, or accepted with a stated size at least its effect (float64 autograd)."""
    seen = []

    def loss(z, y, items):
        seen.append((z.detach().clone(), y.clone()))
        x = z.half()
        return _ce(x, y, items, smoothing if isinstance(x, torch.HalfTensor) else 0.0).float()

    trainer = _trainer(tmp_path, torch.float32, True, loss)
    try:
        with caplog.at_level(logging.WARNING):
            trainer.train()
    except ValueError as error:
        assert "more than rounding at the narrowings" in str(error) or "a term in the stock loss" in str(error)
        assert smoothing > 0.01
        return
    z, y = seen[0]
    assert _effect(z, y, smoothing) <= _stated(caplog)


def test_f4_a_float32_loss_on_bfloat16_logits_is_still_held_to_float32_s_rounding(tmp_path):
    """The 16-bit remeasure runs only where the loss's gradient goes through 16-bit arithmetic: a float32
    cross-entropy with label smoothing 1e-3 on bfloat16 autocast logits is refused at float32's allowance, with no
    note of 16-bit rounding (on 45ca4bd it carried "that rounding ... may be all that differs here", untrue)."""
    loss = lambda z, y, n: _ce(z.float(), y, n, 1e-3)  # noqa: E731
    with pytest.raises(ValueError, match=r"relative in their gradient w\.r\.t\. the logits \(rounding allows 2\.4e-07\)"
                       ) as refused:
        _trainer(tmp_path, torch.float32, True, loss).train()
    assert "16 bits" not in str(refused.value) and "16-bit arithmetic" not in str(refused.value)


def test_f4_16_bit_arithmetic_is_kept_in_float32_and_its_leaves_keep_their_dtype():
    """``_Widened`` on a 16-bit output, checked against an independent float32 computation: a float16 cross-entropy on
    bfloat16 logits computes, widened, the float32 cross-entropy of the same values -- value and gradient exactly
    (the gradient rounded to bfloat16 at the leaf, as the loss's is as it runs); the float16 cast is a narrowing
    recorded at eps of float16 x the logits' largest magnitude; a leaf put in the model's output keeps bfloat16."""
    torch.manual_seed(0)
    z0 = (3 * torch.randn(2, 13, 64)).bfloat16()
    y = torch.randint(0, 64, (2, 13))

    def run(widen, loss):
        z = z0.clone().requires_grad_(True)
        sites = []
        with _Widened(torch.bfloat16, sites) if widen else torch.enable_grad():
            value = loss(z)
            grad = torch.autograd.grad(value, z)[0]
        return float(value.detach()), grad, sites

    value, grad, sites = run(True, lambda z: _ce(z.half(), y, 26).float())
    exact, exact_grad, _ = run(False, lambda z: _ce(z.float(), y, 26))
    as_is, as_is_grad, _ = run(False, lambda z: _ce(z.half(), y, 26).float())
    assert value == exact and torch.equal(grad, exact_grad) and grad.dtype == torch.bfloat16
    assert not torch.equal(as_is_grad, exact_grad)  # (float16 rounds as it runs: what the check measures)
    assert sites[0][1:] == (torch.finfo(torch.float16).eps, float(z0.float().abs().max()))
    leaves = []
    hook = _next_slice_of(z0, leaves)
    with _Widened(torch.bfloat16):
        hook(None, None, torch.zeros(2, 5, 64, dtype=torch.bfloat16))
    assert leaves[0].dtype == torch.bfloat16 and torch.equal(leaves[0], z0[:, :5])


def test_a_float32_loss_of_a_float64_model_is_not_said_to_narrow_by_a_route_unseen(tmp_path):
    """A float64 model's float32 cross-entropy with a term is refused; the refusal said "the loss run with its casts
    kept in float64 still computed in torch.float32: it narrows by a route the check does not widen", read from the
    dtype the widened run's loss reports (float32 by design) rather than the one it computed in (float64)."""
    model = _llama(lambda z, y, items: _ce(z.float(), y, items, 1e-4))
    with pytest.raises(ValueError, match="a term in the stock loss") as refused:
        tc.make_trainer(tmp_path, seco=SeCOArguments(chunk_size=4), model=model, max_steps=1).train()
    assert "still computed in" not in str(refused.value)


def _logsumexp_minus_gathered(z, y, items):
    """Cross-entropy as logsumexp(x) - x[target] in bfloat16, returned in float32."""
    x, keep = z.bfloat16(), y != -100
    return ((torch.logsumexp(x[keep], -1) - x[keep].gather(-1, y[keep][:, None]).squeeze(-1)).sum() / items).float()


@pytest.mark.parametrize("dtype,bf16", [(torch.float32, True), (torch.bfloat16, False)])
def test_c66_lse16_logsumexp_minus_the_gathered_logit_in_16_bits_trains(tmp_path, dtype, bf16):
    """Campaign 66 LSE16: the two reads of the 16-bit logits (logsumexp, gather) each had their gradient rounded to
    bfloat16 and summed in it in the float32 run too, 0.004 apart from the cross-entropy's: refused as a term
    (fails on 1440d1d).  Each tensor is now read in float32 through one copy."""
    trainer = _trainer(tmp_path, dtype, bf16, _logsumexp_minus_gathered)
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"] and measured["rounding"] > 1e-4


def test_c66_a_16_bit_tensor_read_twice_is_read_through_one_float32_copy():
    """Against an independent float32 computation: logsumexp(x) - x[y] on bfloat16 logits, widened, has exactly the
    float32 cross-entropy's gradient (rounded once to bfloat16); as it runs, it does not."""
    torch.manual_seed(0)
    z0 = (0.3 * torch.randn(26, 64)).bfloat16()
    y = torch.randint(0, 64, (26,))

    def grad(loss, widen):
        z = z0.clone().requires_grad_(True)
        with _Widened(torch.bfloat16, []) if widen else torch.enable_grad():
            return torch.autograd.grad(loss(z), z)[0]

    lse = lambda z: (torch.logsumexp(z, -1) - z.gather(-1, y[:, None]).squeeze(-1)).sum() / 26  # noqa: E731
    exact = grad(lambda z: F.cross_entropy(z.float(), y, reduction="sum") / 26, False)
    assert torch.equal(grad(lse, True), exact) and not torch.equal(grad(lse, False), exact)


def test_c66_f16bf_a_float16_model_s_bfloat16_loss_returned_in_float32_trains(tmp_path):
    """Campaign 66 F16BF: on a float16 model, a cross-entropy computed in bfloat16 and returned in float32 rounds its
    value 0.0047 apart, beyond float16's 4 eps (0.0039) the value check allowed: refused as "something adds to or
    changes the loss" (fails on 1440d1d).  Where the loss's gradient goes through a bfloat16 narrowing, 4 eps of
    bfloat16 are allowed; a scale of 1.05 on the same loss is still refused."""
    trainer = _trainer(tmp_path / "plain", torch.float16, False, lambda z, y, n: _ce(z.bfloat16(), y, n).float())
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"]
    with pytest.raises(ValueError, match="SeCOTrainer"):
        _trainer(tmp_path / "scaled", torch.float16, False,
                 lambda z, y, n: 1.05 * _ce(z.bfloat16(), y, n).float()).train()


def test_c67_a_16_bit_loss_returned_in_float64_is_held_to_float32_and_told_no_unseen_route(tmp_path):
    """Campaign 67: on a float16 model, a float16 loss returned in float64 went the 16-bit remeasure with float64's
    floor (4.4e-16) and a refusal note "still computed in float64: it narrows by a route the check does not widen",
    both untrue (its widened run computes in float32, wider than the float16 output).  The floor is float32's; the
    note only where the widened loss computes narrower than float32 (fails on 7d985ec)."""
    trainer = _trainer(tmp_path / "plain", torch.float16, False, lambda z, y, n: _by_hand(z.half(), y, n).double())
    trainer.train()
    assert trainer.seco_loss_check_measured["gradient"] <= trainer.seco_loss_check_measured["allowed"]
    with pytest.raises(ValueError, match=r"rounding allows [0-9.e-]+: 2\.4e-07 and half of the loss's own") as refused:
        _trainer(tmp_path / "term", torch.float16, False, lambda z, y, n: _ce(z.half(), y, n, 0.01).double()).train()
    assert "still computed in" not in str(refused.value)


def _after_a_metric_read_under_no_grad(z, y, items):
    """An accuracy metric read from the logits under no_grad, then a cross-entropy in their own 16-bit dtype."""
    with torch.no_grad():
        _ = (z.argmax(-1) == y).float().mean()
    return _ce(z, y, items).float()


def test_c67_ngread_a_16_bit_tensor_first_read_under_no_grad_keeps_its_gradient(tmp_path):
    """Campaign 67 NGREAD (a regression of 7d985ec): the float32 copy of the 16-bit logits made for a metric read
    under no_grad had no graph, and the cross-entropy after it reused it, so the widened run lost the gradient and
    the plain loss was refused as a term (fails on 7d985ec).  The copy is kept per grad mode."""
    trainer = _trainer(tmp_path, torch.bfloat16, False, _after_a_metric_read_under_no_grad)
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"] and measured["rounding"] > 1e-4


@pytest.mark.parametrize("dtype,bf16", [(torch.float16, False), (torch.float32, True), (torch.float32, False)])
def test_c67_f32r64_a_float32_loss_returned_in_float64_is_allowed_float32_s_rounding(tmp_path, dtype, bf16):
    """Campaign 67 F32R64: a float32 cross-entropy returned in float64 on float16, bfloat16-autocast or float32
    logits was held to float64's rounding in value (7.2e-8 apart, 1.4e-14 allowed: "a term that changes the value
    only") though it computes in float32 (fails on 7d985ec); label smoothing 1e-3 in it is still refused."""
    trainer = _trainer(tmp_path / "plain", dtype, bf16, lambda z, y, n: _ce(z.float(), y, n).double())
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["value"] <= measured["value_allowed"] <= 64 * torch.finfo(torch.float32).eps + 1e-12
    with pytest.raises(ValueError, match="a term in the stock loss"):
        _trainer(tmp_path / "term", dtype, bf16, lambda z, y, n: _ce(z.float(), y, n, 1e-3).double()).train()


def _copied_into(dtype, smoothing=0.0):
    def loss(z, y, items):
        """The logits copied into a buffer of ``dtype`` (copy_), a cross-entropy on it, returned in float32."""
        buffer = torch.empty(z.shape, dtype=dtype, device=z.device).copy_(z)
        return _ce(buffer, y, items, smoothing).float()
    return loss


@pytest.mark.parametrize("dtype,bf16,buffer", [(torch.float32, False, torch.bfloat16),
                                               (torch.float32, True, torch.float16),
                                               (torch.float16, False, torch.bfloat16)])
def test_c68_copybuf_a_loss_copied_into_a_narrower_buffer_is_measured(tmp_path, dtype, bf16, buffer):
    """Campaign 68 copybuf: the logits copied into a 16-bit buffer (torch.empty(..., dtype).copy_(z)) narrow there as
    the loss runs, but the write was not recorded as a narrowing, so the plain loss was refused (fails on f17bbd2);
    label smoothing 0.05 in it is still refused."""
    trainer = _trainer(tmp_path / "plain", dtype, bf16, _copied_into(buffer))
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"] and measured["rounding"] > 1e-5
    with pytest.raises(ValueError, match="a term in the stock loss"):
        _trainer(tmp_path / "term", dtype, bf16, _copied_into(buffer, 0.05)).train()


@pytest.mark.parametrize("loss", {
    "float64 cross-entropy": lambda z, y, n: _ce(z.double(), y, n).float(),
    "float32 log-softmax by hand, returned in float64": lambda z, y, n: _by_hand(z.float(), y, n).double()}.values(),
    ids=["float64 cross-entropy", "float32 by hand"])
def test_c68_f16hand_a_wider_loss_on_float16_logits_trains_and_a_term_is_still_refused(tmp_path, loss):
    """Campaigns 66 WIDER16 / 68 F16HAND: on a float16 model's logits, a cross-entropy computed in float64 (or by
    hand in float32) rounds a few gradient elements to the other 16-bit step than F.cross_entropy's float32 one does,
    1 ulp apart: refused at float32's 2.4e-7 (fails on e96d6b2).  Flips of 1 ulp on at most 1% of the elements are
    rounding now; label smoothing 1e-4 in the same loss (effect 1e-4, far below the stated 2 eps of float16) is
    still refused."""
    trainer = _trainer(tmp_path / "plain", torch.float16, False, loss)
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"] and 0 < measured["flips"] <= 0.01 * 2 * 13 * 64

    def smoothed(z, y, n):
        return _by_hand(z.float(), y, n, 1e-4).double()

    with pytest.raises(ValueError, match="a term in the stock loss"):
        _trainer(tmp_path / "term", torch.float16, False, smoothed).train()


def _set_into(dtype, smoothing=0.0):
    def loss(z, y, items):
        """The logits written into a zero buffer of ``dtype`` (buf[...] = z), a cross-entropy on it, in float32."""
        buffer = torch.zeros(z.shape, dtype=dtype, device=z.device)
        buffer[...] = z
        return _ce(buffer, y, items, smoothing).float()
    return loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("write", [_copied_into, _set_into], ids=["copy_", "setitem"])
def test_c69_copysame_a_16_bit_loss_copied_into_a_buffer_of_its_dtype_trains(tmp_path, dtype, write):
    """Campaign 69 COPYSAME: a 16-bit model's logits copied into a buffer of their own dtype (copy_, buf[...] = z),
    a cross-entropy on it: the loss's 16-bit arithmetic then read no 16-bit value but the buffer's, so every rounding
    step it recorded was of size 0 and the plain loss was refused as a term (fails on c246e16).  The write is now
    the first step of that arithmetic, as an op reading the logits is; label smoothing 0.05 in it is still refused."""
    trainer = _trainer(tmp_path / "plain", dtype, False, write(dtype))
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"] and measured["quantum"] > 0
    with pytest.raises(ValueError, match="a term in the stock loss"):
        _trainer(tmp_path / "term", dtype, False, write(dtype, 0.05)).train()


def _into_view(dtype):
    def loss(z, y, items):
        """The logits written into a view of a wider buffer (big[..., :V].copy_(z)), read back through a fresh view."""
        big = torch.zeros((*z.shape[:-1], z.shape[-1] + 8), dtype=dtype, device=z.device)
        big[..., :z.shape[-1]].copy_(z)
        return _ce(big[..., :z.shape[-1]], y, items).float()
    return loss


def _into_own_dtype(z, y, items, smoothing=0.0):
    """A buffer made with the logits' own dtype (dtype=z.dtype), the logits copied in, a cross-entropy on it."""
    return _ce(torch.empty(z.shape, dtype=z.dtype, device=z.device).copy_(z), y, items, smoothing).float()


def test_c69r_a_narrower_tensor_not_kept_wide_reads_its_own_dtype():
    """The campaign 69 review: under ``_Widened`` on a 16-bit output the 16-bit logits read their dtype (and
    element_size, itemsize) as float32, the dtype they are read in; and on a float64 output a float32 tensor made
    outside the loss read float64 (fails on 176c204).  Code that reads them sees what they are."""
    z = torch.randn(3, 4).bfloat16().requires_grad_(True)
    w = torch.ones(4)
    with _Widened(torch.bfloat16, []):
        assert (z.dtype, z.element_size(), z.itemsize, z.nbytes) == (torch.bfloat16, 2, 2, 24)
        assert torch.empty(z.shape, dtype=z.dtype).dtype == torch.bfloat16 and (z * 2).dtype == torch.bfloat16
    with _Widened(torch.float64, []):
        assert (w.dtype, w.element_size()) == (torch.float32, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loss", ["own dtype", "view"])
def test_c69r_a_16_bit_loss_written_into_a_buffer_of_the_logits_dtype_or_a_view_trains(tmp_path, dtype, loss):
    """The campaign 69 review: a buffer made with dtype=z.dtype (float32 in the widened run, so no 16-bit step was
    recorded), or a view of a buffer written into and read through a fresh view (the step was recorded on the
    written view, which the loss's gradient does not go through): the plain loss was refused (fails on 176c204)."""
    trainer = _trainer(tmp_path, dtype, False, _into_own_dtype if loss == "own dtype" else _into_view(dtype))
    trainer.train()
    measured = trainer.seco_loss_check_measured
    assert measured["gradient"] <= measured["allowed"] and measured["quantum"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c69r_a_term_gated_on_the_logits_dtype_is_refused(tmp_path, dtype):
    """The campaign 69 review: label smoothing 0.05 on where z.dtype is the 16-bit dtype -- on in training, off in
    the widened run, where z.dtype read float32 -- was counted as the loss's rounding and accepted (fails on
    176c204: effect 0.05 in float64 autograd, beyond the stated 0.0245 / 0.0049)."""
    def gated(z, y, items):
        buffer = torch.empty(z.shape, dtype=dtype, device=z.device).copy_(z)
        return _ce(buffer, y, items, 0.05 if z.dtype == dtype else 0.0).float()

    with pytest.raises(ValueError, match="a term in the stock loss"):
        _trainer(tmp_path, dtype, False, gated).train()


@pytest.mark.parametrize("dtype,bf16", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True)])
def test_c69r_a_no_op_write_of_a_large_constant_does_not_widen_the_bound(tmp_path, dtype, bf16):
    """The campaign 69 review: a no-op in-place add of a large 16-bit constant (buf.add_(C, alpha=0), C = 1024) made
    the write's rounding step eps x 1024, so label smoothing 0.3 gated on the buffer's type (off in the widened
    run) was accepted (fails on 176c204).  The step is now eps x the values stored; the plain loss still trains."""
    native = torch.float16 if dtype == torch.float16 else torch.bfloat16
    big = torch.full((1,), 1024.0, dtype=native)
    kind = torch.HalfTensor if native == torch.float16 else torch.BFloat16Tensor

    def loss(smoothing):
        def run(z, y, items):
            buffer = torch.empty(z.shape, dtype=native, device=z.device).copy_(z).add_(big, alpha=0)
            return _ce(buffer, y, items, smoothing if isinstance(buffer, kind) else 0.0).float()
        return run

    _trainer(tmp_path / "plain", dtype, bf16, loss(0.0)).train()
    with pytest.raises(ValueError, match="a term that depends on the dtype the loss computes in"):
        _trainer(tmp_path / "term", dtype, bf16, loss(0.3)).train()


FIRST_CALL = {  # (the model's dtype, bf16 autocast, the loss on its logits with label smoothing c)
    "bfloat16 model": (torch.bfloat16, False, lambda z, y, n, c: _ce(z, y, n, c).float()),
    "float16 model": (torch.float16, False, lambda z, y, n, c: _ce(z, y, n, c).float()),
    "float32 model, bfloat16 cross-entropy": (torch.float32, False, lambda z, y, n, c: _ce(z.bfloat16(), y, n,
                                                                                          c).float()),
    "autocast, by hand in bfloat16": (torch.float32, True, lambda z, y, n, c: _by_hand(z.bfloat16(), y, n, c).float()),
}


@pytest.mark.parametrize("case", FIRST_CALL)
def test_c70_a_term_on_the_loss_s_first_call_only_is_refused(tmp_path, case):
    """Campaign 70 A: where the check, refusing at first, found 16-bit arithmetic in the loss (a float32 model's
    bfloat16 loss, a 16-bit output's loss), it ran the loss again and checked that new call alone: label smoothing
    0.3 on the first call only (a one-time term, the very call the check was asked on and a training step uses) was
    accepted (fails on 4d1ae82).  That first call is now what the new one is compared with."""
    dtype, bf16, loss = FIRST_CALL[case]
    calls = []

    def once(z, y, items):
        calls.append(None)
        return loss(z, y, items, 0.3 if len(calls) == 1 else 0.0)

    with pytest.raises(ValueError, match="run twice on the same logits"):
        _trainer(tmp_path / "once", dtype, bf16, once).train()
    _trainer(tmp_path / "plain", dtype, bf16, lambda z, y, n: loss(z, y, n, 0.0)).train()  # the same loss, no term


@pytest.mark.parametrize("dtype,reentrant", [(torch.float64, False), (torch.float64, True), (torch.float32, True)])
def test_c70_a_loss_under_torch_checkpoint_is_refused_in_one_line(tmp_path, dtype, reentrant):
    """Campaign 70 B: a cross-entropy under torch.utils.checkpoint in the loss was a traceback from inside the check
    (reentrant: "incompatible with .grad()"; non-reentrant on a float64 model: its recomputation, run by the check's
    autograd.grad, mismatched the widened first run) (fails on 4d1ae82).  Now a ValueError that says so."""
    def loss(z, y, items):
        return torch.utils.checkpoint.checkpoint(lambda x: _ce(x.float(), y, items), z, use_reentrant=reentrant)

    with pytest.raises(ValueError, match="the stock loss runs under torch.utils.checkpoint"):
        _trainer(tmp_path, dtype, False, loss).train()
