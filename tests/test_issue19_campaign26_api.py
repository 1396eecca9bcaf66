"""Issue 19, hostile campaign 26 (docs/hostile_campaign_26.md), API: a gradient asked for under
``torch.inference_mode()`` came back as the right loss with an all-zero gradient (seco_grad, spaco_grad, hop_strata,
seco_step) or torch's "element 0 of tensors does not require grad" (dense_grad) (P6); ``seco-lab audit --model DIR``
on a checkpoint folder without a tokenizer advised installing sentencepiece or tiktoken (P9); an all-frozen model is
refused saying how to unfreeze it.  Each fails on the code before the fix."""
import pytest
import torch
from helpers import random_batch, rel_err, tiny_model
from test_issue19_campaign25_models import intact  # noqa: F401 (a fixture)

from seco_lab import chain_basis, dense_grad, flatten, hop_strata, seco_grad, seco_step, spaco_grad, truncated_grad
from seco_lab.cli import main
from seco_lab.core.engine import cache_leaves, checked_batch, forward_loss, relay_sweep, trainable

VOCAB, CHUNK = 17, 4


@pytest.fixture(scope="module")
def model_batch():
    model = tiny_model(vocab=VOCAB)
    tok, tgt = random_batch(VOCAB, 1, 24)
    return model, tok, tgt


def _step(model, tok, tgt):
    model.zero_grad(set_to_none=True)
    loss = seco_step(model, tok, tgt, CHUNK)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


ENTRY_POINTS = {
    "dense_grad": lambda m, t, y: dense_grad(m, t, y),
    "truncated_grad": lambda m, t, y: truncated_grad(m, t, y, CHUNK),
    "seco_grad": lambda m, t, y: seco_grad(m, t, y, CHUNK),
    "seco_step": _step,
    "spaco_grad": lambda m, t, y: spaco_grad(m, t, y, CHUNK, budget=6),
    "hop_strata": lambda m, t, y: hop_strata(m, t, y, CHUNK),
    "chain_basis": lambda m, t, y: chain_basis(m, t, y, CHUNK, max_hops=1),
}


def _flat(result):
    if isinstance(result, tuple):
        return flatten(result[1])
    if hasattr(result, "vectors"):  # chain_basis
        return result.vectors.sum(0)
    return flatten(result.total())  # hop_strata


EXACT = {"dense_grad", "seco_grad", "seco_step", "spaco_grad", "hop_strata"}  # spaco_grad with t = k


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_p6_gradient_under_inference_mode_is_refused(model_batch, name):
    """Refused under inference_mode; torch.no_grad() is not: the engine turns gradients on where it builds a graph,
    so the gradient there is the one outside it (the dense one, for the exact entry points)."""
    model, tok, tgt = model_batch
    model.zero_grad(set_to_none=True)
    with torch.inference_mode(), pytest.raises(RuntimeError) as info:
        ENTRY_POINTS[name](model, tok, tgt)
    message = str(info.value)
    assert message.startswith(f"{name} computes gradients with autograd, but it was called under "
                              "torch.inference_mode()"), message
    assert f"call {name} outside the inference_mode block" in message
    assert "element 0" not in message
    assert all(p.grad is None for p in model.parameters())  # seco_step wrote nothing

    plain = _flat(ENTRY_POINTS[name](model, tok, tgt))
    with torch.no_grad():
        quiet = _flat(ENTRY_POINTS[name](model, tok, tgt))
    assert float(plain.abs().max()) > 0
    assert rel_err(quiet, plain) < 1e-12
    if name in EXACT:
        assert rel_err(plain, flatten(dense_grad(model, tok, tgt)[1])) < 1e-10


def test_p6_the_sweep_itself_refuses_inference_mode(model_batch):
    """What the public functions check, the backward sweep checks too (stats/ and the audit call it directly); the
    loss alone (forward_loss, pass 1) still works in inference mode."""
    model, tok, tgt = model_batch
    batch = checked_batch(model, tok, tgt, CHUNK)
    params = [p for _, p in trainable(model)]
    ref_loss = float(dense_grad(model, tok, tgt)[0])
    with torch.inference_mode():
        assert float(forward_loss(model, tok, tgt, CHUNK)) == pytest.approx(ref_loss, rel=1e-12)
    leaves, _ = cache_leaves(model, batch)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="^relay_sweep computes gradients with autograd"):
        relay_sweep(model, batch, leaves, params, range(batch.num_chunks))


def test_p6_all_frozen_model_is_refused_not_zero(model_batch):
    model, tok, tgt = model_batch
    frozen = tiny_model(vocab=VOCAB).requires_grad_(False)
    for run in (ENTRY_POINTS["seco_grad"], ENTRY_POINTS["dense_grad"], ENTRY_POINTS["spaco_grad"]):
        with pytest.raises(ValueError, match=r"no parameter of the model requires grad \(all frozen\).*"
                                             r"requires_grad_\(True\)"):
            run(frozen, tok, tgt)


def test_p9_audit_of_a_checkpoint_without_tokenizer_says_so(intact, tmp_path, capsys):  # noqa: F811
    assert not (intact / "tokenizer.json").exists() and not (intact / "tokenizer_config.json").exists()
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox. " * 400)
    rc = main(["audit", "--model", str(intact), "--params", "full", "--length", "128", "--chunk-size", "16",
               "--budgets", "2", "4", "--no-progress", "--texts", str(text), "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert f"model {intact}: the checkpoint folder holds no tokenizer that loads offline" in err
    assert "tokenizer.save_pretrained(" in err and str(intact) in err
    assert "sentencepiece" not in err and "tiktoken" not in err
    assert not (tmp_path / "a").exists()  # refused before anything is written
