"""Issue 19, campaign 57 (G1-G4) and the loss check's measured rounding.

Campaigns 51-57 each found a way to make the Trainer loss check's *model* of a float32 loss's rounding on a float64
model too large (silent-wrong: a term passed inside it) or too small (plain cross-entropy refused): which logits the
loss rounds, at what shift, in which layout, through which projection.  Campaign 57: a metric's softmax with a
gradient on shifted or bfloat16 logits beside a loss by hand let label smoothing pass at 76-25400x (G1); the reverse
refused plain cross-entropy (G2), as did cross-entropy on float32(z + a) less its row max (G3) and on a row max with a
gradient (G4).  The rounding is now measured on the loss's own code: the stock loss runs again on the same logits
with its casts kept in float64 (``_Widened``), and the difference is its rounding.  The G1 and G2-G4 tests fail on
d204d2d."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import trainer_case as tc
import transformers as T

from seco_lab.integrations.transformers import SeCOArguments, _Widened

TERM = r"in their gradient w\.r\.t\. the hidden states"


def _llama(loss, returned=lambda z: z, project=F.linear):
    """A float64 tiny Llama, lm_head frozen, whose forward projects with lm_head's weight (z = project(h, W), F.linear:
    float64, (B, T, V)), returns ``returned(z)`` and trains ``loss(z, y, items)``: y the shifted targets (B, T), items
    the num_items_in_batch the Trainer passes (else the target count)."""
    model = tc.for_seco(tc.tiny_llama()).to(torch.float64)

    def forward(input_ids=None, labels=None, attention_mask=None, **kwargs):
        passed = {"cache" if k == "past_key_values" else k: v for k, v in kwargs.items()
                  if k in ("position_ids", "past_key_values", "cache", "use_cache")}
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, **passed)
        z = project(hidden.last_hidden_state, model.lm_head.weight)
        value = None
        if labels is not None:
            y = F.pad(labels, (0, 1), value=-100)[..., 1:]
            items = kwargs.get("num_items_in_batch")
            value = loss(z, y, items if items is not None else (y != -100).sum())
        return T.modeling_outputs.CausalLMOutputWithPast(loss=value, logits=returned(z),
                                                         past_key_values=hidden.past_key_values)
    model.forward = forward
    model.lm_head.weight.requires_grad_(False)
    return model


def _trained(folder, model):
    trainer = tc.make_trainer(folder, seco=SeCOArguments(chunk_size=4), model=model, max_steps=1)
    trainer.train()
    return trainer.seco_loss_check_measured


def _by_hand(x, y, items, smoothing=0.0):
    """Cross-entropy (with label smoothing) by exp, sum and log: no softmax-family call."""
    keep = y != -100
    xk, yk = x[keep], y[keep]
    top = xk.amax(-1, keepdim=True).detach()
    logp = xk - ((xk - top).exp().sum(-1, keepdim=True).log() + top)
    nll = -logp.gather(-1, yk[:, None]).squeeze(-1)
    return ((1 - smoothing) * nll - smoothing * logp.mean(-1)).sum() / items


def _ce(x, y, items, smoothing=0.0):
    flat = x.reshape(-1, x.shape[-1])
    return F.cross_entropy(flat, y.reshape(-1), reduction="sum", label_smoothing=smoothing) / items


METRICS = {"on the logits + 1e4": lambda z: (z + 1e4).float(), "on a bfloat16 copy": lambda z: z.bfloat16().float()}


@pytest.mark.parametrize("metric", METRICS)
def test_c57_g1_a_metric_s_softmax_with_a_gradient_does_not_set_a_loss_by_hand_s_rounding(tmp_path, metric):
    """G1: an entropy metric computed with a gradient (not under no_grad) on shifted or bfloat16 logits was taken for
    the loss's softmax, and its rounding allowed (7e-5 / 3.3e-3): label smoothing 1e-5 by hand passed at 250x."""
    def loss(smoothing):
        def of(z, y, items):
            p = METRICS[metric](z).softmax(-1)  # logged, with a gradient
            of.entropy = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean().detach())
            return _by_hand(z.float(), y, items, smoothing)
        return of

    with pytest.raises(ValueError, match=TERM):
        _trained(tmp_path / "smoothed", _llama(loss(1e-5)))
    measured = _trained(tmp_path / "plain", _llama(loss(0.0)))
    assert measured["gradient"] <= measured["allowed"] / 2 and measured["rounding"] < 3e-7


PLAIN = {
    # G2: a metric with a gradient on the plain logits, the loss's F.cross_entropy on z + 1000
    "metric on z, loss on z + 1000": lambda z, y, n: (z.float().softmax(-1), _ce((z + 1000).float(), y, n))[1],
    # G3: cast first (rounding z + 1000), then subtract each row's max
    "loss on float32(z + 1000) less its row max": lambda z, y, n: _ce(
        (z + 1000).float() - (z + 1000).float().amax(-1, keepdim=True), y, n),
    # G4: a row max with a gradient, in the (B, V, T) layout
    "loss on z + 1000 less its row max (with a gradient), (B, V, T)": lambda z, y, n: F.cross_entropy(
        ((z + 1000) - (z + 1000).amax(-1, keepdim=True)).float().transpose(1, 2), y, reduction="sum") / n,
}


@pytest.mark.parametrize("loss", PLAIN)
def test_c57_g2_g4_plain_cross_entropy_on_shifted_logits_trains(tmp_path, loss):
    """G2-G4: plain cross-entropy computed on shifted float32 logits was refused where the check's model of its
    rounding read other logits (a metric's, z's) or missed a row max's gradient (2.2e-6 apart, 1.4e-7 allowed)."""
    measured = _trained(tmp_path / "plain", _llama(PLAIN[loss], returned=lambda z: z + 1000))
    assert measured["gradient"] <= measured["allowed"] / 2 and measured["rounding"] > 1e-7
    terms = {"metric on z, loss on z + 1000": lambda z, y, n: _ce((z + 1000).float(), y, n, 3e-5)}
    if loss in terms:
        with pytest.raises(ValueError, match=TERM):
            _trained(tmp_path / "smoothed", _llama(terms[loss]))


def test_c58_rounding_the_engine_shares_is_not_allowed_as_the_loss_s(tmp_path):
    """A forward that projects in bfloat16 rounds the stock loss's gradient by 3e-3, and the SeCO step's just as much
    (it runs the same forward): only what sets the two apart is rounding between them.  Allowed half the stock's own
    rounding, label smoothing 1e-3 passed (the SeCO step 1.7e-6 from the stock Trainer's plain run, the smoothed one
    another 1.7e-6 away); the engine's chunks now run widened too, and the allowance is half the rounding between
    them."""
    def bf16(h, w):
        return F.linear(h.bfloat16(), w.bfloat16())

    measured = _trained(tmp_path / "plain", _llama(lambda z, y, n: _ce(z.float(), y, n), project=bf16))
    assert measured["gradient"] <= measured["allowed"] / 2 and measured["rounding"] < 1e-5
    with pytest.raises(ValueError, match=TERM):
        _trained(tmp_path / "smoothed", _llama(lambda z, y, n: _ce(z.float(), y, n, 1e-3), project=bf16))


DTYPE_TERMS = {"label smoothing where the logits are float32": lambda x: 3e-6 if x.dtype == torch.float32 else 0.0,
               "label smoothing of 25 eps of their dtype": lambda x: 25 * torch.finfo(x.dtype).eps,
               "label smoothing where they take 4 bytes": lambda x: 3e-6 if x.element_size() == 4 else 0.0,
               # campaign 58: dtype reads by other routes
               "... where their numpy copy is float32": lambda x: 3e-6 if str(x.detach().numpy().dtype) == "float32"
               else 0.0,
               "... where their storage holds 4 bytes each": lambda x: 3e-6 if x.untyped_storage().nbytes() == 4 *
               x.numel() else 0.0,
               "... where their text does not say float64": lambda x: 3e-6 if "float64" not in repr(x[:1, :1]) else 0.0,
               "... where their bits read as as many int32": lambda x: 3e-6 if x.detach().view(torch.int32).numel() ==
               x.numel() else 0.0}


@pytest.mark.parametrize("term", DTYPE_TERMS)
def test_c58_a_term_that_depends_on_the_dtype_is_seen_in_the_widened_run(tmp_path, term):
    """The rounding is the stock loss as it is less the loss run with its casts kept in float64: a term present only
    in float32 would count as rounding.  Code run widened reads the dtype the tensor has as it is, so the term is in
    both runs, and refused."""
    def loss(z, y, n):
        x = z.float()
        return _ce(x, y, n, DTYPE_TERMS[term](x))

    with pytest.raises(ValueError, match=TERM):
        _trained(tmp_path, _llama(loss))


def test_c58_a_random_term_is_not_taken_for_rounding(tmp_path):
    """Randomness after the compared output differs between the loss's runs as rounding does: the loss runs twice as
    it is, and a gradient that changes is refused as random."""
    def loss(z, y, n):
        x = z.float()
        return _ce(x, y, n) + 1e-6 * (torch.randn_like(x) * x).sum() / n

    with pytest.raises(ValueError, match="run twice on the same hidden states .* randomness"):
        _trained(tmp_path, _llama(loss))


def test_c58_a_loss_into_float32_buffers_and_a_float32_class_weight_is_measured(tmp_path):
    """Narrowings the widened run must follow: a float32 buffer filled in place, a float32 weight argument, a dtype
    argument; plain trains, label smoothing 1e-5 is refused."""
    def loss(smoothing):
        def of(z, y, n):
            buffer = torch.empty(z.shape, dtype=torch.float32)
            buffer.copy_(z)
            x = buffer + z.float() * 0
            weight = torch.ones(z.shape[-1], dtype=torch.float32)
            logp = x.log_softmax(-1, dtype=torch.float32)
            return F.nll_loss(logp.reshape(-1, z.shape[-1]), y.reshape(-1), weight=weight, reduction="sum") / n + (
                smoothing * -logp.mean(-1)[y != -100].sum() / n)
        return of

    measured = _trained(tmp_path / "plain", _llama(loss(0.0)))
    assert measured["gradient"] <= measured["allowed"] / 2
    with pytest.raises(ValueError, match=TERM):
        _trained(tmp_path / "smoothed", _llama(loss(1e-5)))


def test_widened_runs_in_float64_and_shows_the_narrower_dtype():
    """``_Widened``: casts and dtype arguments stay float64 (no rounding), code reads the dtype the tensor would have,
    and a custom autograd Function's backward runs widened too."""
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)

    class Squared(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t.float().square()

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return 2 * t.float() * grad

    with _Widened():
        y = x.float()
        assert y.dtype == torch.float32 and y.element_size() == 4 and y.type() == "torch.FloatTensor"
        assert (y + 1).dtype == torch.float32 and (y.double() - x).abs().max() == 0
        assert torch.finfo(y.dtype).eps == torch.finfo(torch.float32).eps
        assert torch.zeros(3, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.cat([y, y]).dtype == torch.float32 and torch.result_type(y, x) == torch.float64
        assert torch.result_type(y, x[0, 0]) == torch.float32 and (y * x[0, 0]).dtype == torch.float32
        assert y[0].dtype == (1 - y).dtype == torch.float32
        logp = x.log_softmax(-1, dtype=torch.float32)
        (grad,) = torch.autograd.grad(Squared.apply(x).sum() + logp.sum(), x)
    assert y.double().dtype == torch.float64
    exact = (2 * x + 1 - torch.softmax(x, -1) * x.shape[-1]).detach()
    assert torch.equal(logp.detach(), x.detach().log_softmax(-1)) and (grad - exact).abs().max() < 1e-14
    assert torch.finfo(grad.dtype).bits == 64


class _Float32CrossEntropy(torch.autograd.Function):
    """Cross-entropy (label smoothing ``smoothing``) computed in float32 forward and backward, returned in the
    logits' dtype: a loss narrower than the value it returns."""

    @staticmethod
    def forward(ctx, z, y, items, smoothing):
        x = z.float()
        ctx.save_for_backward(x, y)
        ctx.items, ctx.smoothing = items, smoothing
        return _ce(x, y, items, smoothing).to(z.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        keep = (y != -100)[..., None]
        target = F.one_hot(y.clamp(min=0), x.shape[-1]).float() * (1 - ctx.smoothing) + ctx.smoothing / x.shape[-1]
        return ((x.softmax(-1) - target) * keep / ctx.items * grad.float()).to(grad.dtype), None, None, None


def test_c58_a_float64_loss_that_computes_in_float32_is_measured(tmp_path):
    """A loss that computes in float32 but returns float64 (a custom autograd Function) was held to float64's 1024
    eps in value and 2 eps in gradient: plain cross-entropy refused.  On a float64 model every loss is now measured
    widened, and the first value check too; label smoothing 3e-6 is refused."""
    with pytest.raises(ValueError, match=TERM):
        _trained(tmp_path / "smoothed", _llama(lambda z, y, n: _Float32CrossEntropy.apply(z + 1000, y, n, 3e-6)))
    measured = _trained(tmp_path / "plain", _llama(lambda z, y, n: _Float32CrossEntropy.apply(z + 1000, y, n, 0.0)))
    assert measured["gradient"] <= measured["allowed"] / 2 and measured["rounding"] > 1e-7


def test_c58_a_float16_loss_of_shifted_logits_passes_the_first_value_check(tmp_path):
    """The first check compares the values on each side's own forward within 1024 eps of float32; a float16 loss of
    logits + 100 rounds its value by 3.7e-4: refused.  Where it fails on a float64 model both sides run again widened,
    within float64's 1024 eps plus half what the widening moved them."""
    def loss(smoothing):
        return lambda z, y, n: _ce((z + 100).half(), y, n, smoothing).float()

    measured = _trained(tmp_path / "plain", _llama(loss(0.0)))
    assert measured["gradient"] <= measured["allowed"] / 2 and measured["rounding"] > 1e-4
    with pytest.raises(ValueError, match=TERM):
        _trained(tmp_path / "smoothed", _llama(loss(3e-3)))


class _NumpyCrossEntropy(torch.autograd.Function):
    """Cross-entropy (label smoothing ``smoothing``) computed in numpy float32, out of torch's sight, as a compiled
    kernel would."""

    @staticmethod
    def forward(ctx, z, y, items, smoothing):
        x = z.detach().cpu().numpy().astype(np.float32)
        x = x - x.max(-1, keepdims=True)
        p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
        keep = (y != -100).numpy()
        target = np.zeros_like(p)
        target[keep, y.numpy()[keep]] = 1
        target = target * (1 - smoothing) + smoothing / x.shape[-1]
        logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        ctx.save_for_backward(torch.from_numpy((p - target) * keep[:, None] / np.float32(items)))
        return torch.tensor(float(-(target * logp)[keep].sum() / np.float32(items)), dtype=z.dtype)

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        return g.to(grad.dtype) * grad, None, None, None


def test_c58_a_loss_computed_outside_torch_in_float32_is_allowed_cross_entropy_s_float32_rounding(tmp_path):
    """Campaign 58 N-OPQ: a loss computed in float32 outside torch (numpy) cannot be run widened; its gradient,
    all float32 numbers, was held to float64's rounding: plain refused.  On the logits it is now allowed twice
    F.cross_entropy's float32 rounding on them; label smoothing 1e-5 is refused."""
    def loss(smoothing):
        return lambda z, y, n: _NumpyCrossEntropy.apply(z.reshape(-1, z.shape[-1]), y.reshape(-1), n, smoothing)

    def model(smoothing):  # the logits paired: the output layer computes them
        return tc.for_seco(_HookedLoss.of(tc.tiny_llama().to(torch.float64), loss(smoothing)))

    measured = _trained(tmp_path / "plain", model(0.0))
    assert measured["paired"] == "logits" and measured["gradient"] <= measured["allowed"] / 1.5
    with pytest.raises(ValueError, match="could not be run in float64"):
        _trained(tmp_path / "smoothed", model(1e-5))


class _HookedLoss:
    @staticmethod
    def of(model, loss):
        """``model`` whose output's loss is replaced by ``loss(logits, y, items)`` (a forward hook)."""
        def hook(module, args, kwargs, out):
            labels = kwargs.get("labels")
            if labels is not None:
                y = F.pad(labels, (0, 1), value=-100)[..., 1:]
                items = kwargs.get("num_items_in_batch")
                out.loss = loss(out.logits, y, items if items is not None else (y != -100).sum())
            return out
        model.register_forward_hook(hook, with_kwargs=True)
        return model


def _every_other_call():
    calls = [0]

    def smoothing(x):
        calls[0] += 1
        return 1e-3 if calls[0] % 2 == 0 else 0.0
    return smoothing


UNSEEN_TERMS = {
    "label smoothing where isinstance(x, torch.FloatTensor)": lambda: lambda x: 3e-6 if isinstance(
        x, torch.FloatTensor) else 0.0,
    "label smoothing on every other call": _every_other_call,
}


@pytest.mark.parametrize("term", UNSEEN_TERMS)
def test_c58_h1_h2_a_term_the_float64_run_leaves_out_is_held_to_what_rounding_can_make(tmp_path, term):
    """Campaign 58 H1/H2: a term the widened run does not compute (gated on a dtype test torch makes in C, or on a
    call counter) counted whole as rounding: label smoothing 0.1 passed at 2.2e6x.  The rounding allowed for may be
    at most 16x the largest step at which a narrowing the loss's gradient goes through rounds."""
    smoothing = UNSEEN_TERMS[term]()

    def loss(z, y, n):
        x = z.float()
        return _ce(x, y, n, smoothing(x))

    with pytest.raises(ValueError, match="more than rounding at the narrowings its gradient goes through can make"):
        _trained(tmp_path, _llama(loss))


def test_c58_h3_a_term_built_from_its_own_rounding_error_is_held_to_what_rounding_can_make(tmp_path):
    """Campaign 58 H3: lam * (z.float() - z).detach() * z is zero when widened; at lam 1e4 it passed as 2.2e-3 of
    "rounding" (plain cross-entropy's: 4e-8)."""
    def loss(z, y, n):
        return _ce(z.float(), y, n) + 1e4 * ((z.float().double() - z).detach() * z).sum() / n

    with pytest.raises(ValueError, match="more than rounding at the narrowings its gradient goes through can make"):
        _trained(tmp_path, _llama(loss))
