"""Issue 19, campaign 39 C2 (silent-wrong): a loss changed on the *instance* -- ``model.forward = ...``, a forward hook
on the model editing ``out.loss``, ``trainer.compute_loss = ...``, a subclass inheriting
``seco_loss_is_cross_entropy`` -- was trained as plain cross-entropy.  SeCOTrainer now compares the stock
``compute_loss`` with the engine's cross-entropy on the first chunks of the first micro-batch (and again when such
an attribute or hook appears) and refuses a difference beyond rounding.  Each test fails on 9be73a1."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import trainer_case as tc
from transformers import LlamaForCausalLM, TrainerCallback

from seco_lab.integrations.transformers import SeCOArguments
from seco_lab.models.hf import build_hf_model

SAYS = r"the loss the stock Trainer computes \(compute_loss\) on the first \d+ tokens of this batch is .* something"


def z_loss(out):
    return out.loss + 0.1 * out.logits.float().pow(2).mean()


def instance_forward(model):
    forward = model.forward

    @functools.wraps(forward)
    def with_z(*args, **kwargs):
        out = forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = z_loss(out)
        return out

    model.forward = with_z


def top_hook(model):
    def hook(module, args, out):
        if getattr(out, "loss", None) is not None:
            out.loss = z_loss(out)
        return out

    model.register_forward_hook(hook)


def instance_compute_loss(trainer):
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        return (z_loss(out), out) if return_outputs else z_loss(out)

    trainer.compute_loss = compute_loss


class Flagged(LlamaForCausalLM):
    seco_loss_is_cross_entropy = True


class FlaggedWithZ(Flagged):  # inherits the parent's promise, adds a z-loss
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = z_loss(out)
        return out


FlaggedWithZ.forward.__signature__ = inspect.signature(LlamaForCausalLM.forward)  # the Trainer keeps the columns


def _model(cls=None):
    model = tc.for_seco(tc.tiny_llama())
    if cls is None:
        return model
    flagged = cls(model.config).double()
    flagged.load_state_dict(model.state_dict())
    return flagged


@pytest.mark.parametrize("change", ["model.forward set on the instance", "forward hook on the model",
                                    "trainer.compute_loss set on the instance", "inherited flag, z-loss added"])
def test_c2_a_loss_changed_where_the_class_checks_cannot_see_it_is_refused_before_any_step(tmp_path, change):
    model = _model(FlaggedWithZ if change.startswith("inherited") else None)
    if change.startswith("model.forward"):
        instance_forward(model)
    elif change.startswith("forward hook"):
        top_hook(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = tc.make_trainer(tmp_path, seco=SeCOArguments(chunk_size=4), model=model)
    if change.startswith("trainer.compute_loss"):
        instance_compute_loss(trainer)
    # a compute_loss that returns the mean also ignores num_items_in_batch: said as such (campaign 47 Q3, 48 R1)
    says = "does not use it.*a term besides" if change.startswith("trainer.compute_loss") else SAYS
    with pytest.raises(ValueError, match=says):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "a step was taken"


class HookAtStep(TrainerCallback):
    """Adds the z-loss hook to the model after the first optimizer step."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            top_hook(self.model)


def test_c2_a_hook_added_during_training_is_checked_on_the_next_micro_batch(tmp_path):
    model = _model()
    trainer = tc.make_trainer(tmp_path, seco=SeCOArguments(chunk_size=4), model=model, callbacks=[HookAtStep(model)])
    with pytest.raises(ValueError, match=SAYS):
        trainer.train()
    assert trainer.state.global_step == 1


def test_the_loss_check_passes_plain_flagged_and_float32_models_and_counts_no_step(tmp_path):
    """No false refusal: the model's own cross-entropy (float32 in transformers' loss, whatever the model's dtype),
    a flagged subclass, a float32 model; and the check's forward is not a step (the run equals the stock one)."""
    for i, model in enumerate([_model(), _model(Flagged),
                               tc.for_seco(build_hf_model("llama", attn_implementation="eager_exact",
                                                          dtype=torch.float32, seed=0))]):
        trainer = tc.make_trainer(tmp_path / str(i), seco=SeCOArguments(chunk_size=4), model=model, max_steps=1)
        trainer.train()
        assert trainer.state.global_step == 1 and trainer._seco_loss_checked is not None
