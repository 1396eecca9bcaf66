"""SeCOTrainer against the stock transformers Trainer (tiny random HF Llama, float64)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_case import (
    displacement_error,
    make_trainer,
    pad_collate,
    padded_examples,
    tiny_llama,
    trainable_state,
)
from transformers import TrainerCallback

from seco_lab import spaco_grad
from seco_lab.hf import HFChunkModel
from seco_lab.integrations.transformers import SeCOArguments, chunk_targets

TOL = 1e-10


def run(tmp_path, name, seco=None, lora=False, **kw):
    trainer = make_trainer(tmp_path / name, seco=seco, lora=lora, **kw)
    before = trainable_state(trainer.model)
    trainer.train()
    return trainer, before, trainable_state(trainer.model)


@pytest.mark.parametrize("lora", [False, True])
def test_seco_trainer_equals_stock_trainer(tmp_path, lora):
    """3 optimizer steps, accumulation 2, clipping active, right-padded batches with -100 labels."""
    stock, s0, s1 = run(tmp_path, "stock", lora=lora)
    seco, c0, c1 = run(tmp_path, "seco", SeCOArguments(chunk_size=4), lora=lora)
    assert set(c1) == set(s1) and (not lora or all("lora_" in n for n in c1))
    assert all(torch.equal(c0[n], s0[n]) for n in s0)  # same initial weights
    assert displacement_error(c1, c0, s1, s0) <= TOL
    logs = [e for e in stock.state.log_history if "grad_norm" in e]
    seco_logs = [e for e in seco.state.log_history if "grad_norm" in e]
    assert len(logs) == len(seco_logs) == 3
    assert all(e["grad_norm"] > stock.args.max_grad_norm for e in logs)  # clipping acts on every step
    for a, b in zip(seco_logs, logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=TOL)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOL)


def test_seco_trainer_without_accumulation_fix_equals_stock(tmp_path):
    """With average_tokens_across_devices off and an odd accumulation, still the stock loss scaling."""
    kw = dict(gradient_accumulation_steps=3, max_steps=2, examples=padded_examples(12, seed=3),
              average_tokens_across_devices=False)
    _, s0, s1 = run(tmp_path, "stock", **kw)
    _, c0, c1 = run(tmp_path, "seco", SeCOArguments(chunk_size=5), **kw)
    assert displacement_error(c1, c0, s1, s0) <= TOL


class GradCapture(TrainerCallback):
    """The gradient the optimizer is about to use."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


@pytest.mark.parametrize("scheme", ["falling-factorial", "paper"])
def test_spaco_mode_with_fixed_subset_equals_spaco_grad(tmp_path, scheme):
    examples = padded_examples(2, seed=5, lengths=(16, 17))  # one batch of 2 x 16 tokens: 4 chunks of 4
    capture = GradCapture()
    seco = SeCOArguments(chunk_size=4, mode="spaco", scheme=scheme, budget=2, subset=(0, 2))
    trainer = make_trainer(tmp_path, seco, examples=examples, callbacks=[capture], gradient_accumulation_steps=1,
                           max_steps=1, max_grad_norm=0.0)
    trainer.train()
    batch = pad_collate(examples)
    tokens, targets = chunk_targets(batch)
    _, ref = spaco_grad(HFChunkModel(tiny_llama()), tokens, targets, 4, scheme, 2, subset=(0, 2))
    got = capture.grads[0]
    flat_got = torch.cat([got[n].reshape(-1) for n in sorted(got)])
    flat_ref = torch.cat([ref["model." + n].reshape(-1) for n in sorted(got)])
    assert float((flat_got - flat_ref).norm() / flat_ref.norm()) <= TOL
    assert trainer.seco_draws == [(0, 0, (0, 2))]


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_stop_and_resume_is_bit_identical_with_spaco_draws(tmp_path):
    seco = SeCOArguments(chunk_size=3, mode="spaco", scheme="falling-factorial", budget=2, seed=11)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, examples=padded_examples(16, seed=2))
    whole = make_trainer(tmp_path / "whole", seco, **kw)
    whole.train()
    stopped = make_trainer(tmp_path / "part", seco, callbacks=[StopAt(2)], **kw)
    stopped.train()
    assert stopped.state.global_step == 2 and (tmp_path / "part" / "checkpoint-2" / "seco_trainer.json").is_file()
    resumed = make_trainer(tmp_path / "part", seco, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    final, ref = trainable_state(resumed.model), trainable_state(whole.model)
    assert all(torch.equal(final[n], ref[n]) for n in ref)
    assert stopped.seco_draws + resumed.seco_draws == whole.seco_draws
    assert len({d[2] for d in whole.seco_draws}) > 1  # the draws vary from micro-batch to micro-batch
    other = make_trainer(tmp_path / "other", SeCOArguments(chunk_size=3, mode="spaco", budget=2, seed=12), **kw)
    other.train()
    assert other.seco_draws != whole.seco_draws  # the seed drives the draws


def test_bf16_autocast_on_cpu_tracks_stock_trainer(tmp_path):
    """Mixed precision (float32 weights, bf16 autocast): the first step's gradient agrees with the stock
    Trainer's to bf16 accuracy, and both differ from the float32 gradient at bf16 level."""
    grads = {}
    for name, seco, bf16 in [("stock", None, True), ("seco", SeCOArguments(chunk_size=4), True),
                             ("fp32", None, False)]:
        capture = GradCapture()
        trainer = make_trainer(tmp_path / name, seco, model=tiny_llama(dtype=torch.float32, attn="sdpa"),
                               callbacks=[capture], bf16=bf16, max_steps=1, max_grad_norm=0.0)
        trainer.train()
        g = capture.grads[0]
        grads[name] = torch.cat([g[n].reshape(-1).double() for n in sorted(g)])

    def err(a, b):
        return float((grads[a] - grads[b]).norm() / grads[b].norm())

    assert err("seco", "fp32") > 1e-4 and err("stock", "fp32") > 1e-4  # autocast really ran in bfloat16
    assert err("seco", "stock") < min(3 * err("stock", "fp32"), 5e-2)


@pytest.mark.parametrize("batch,message", [
    ({"attention_mask": torch.tensor([[0, 1, 1, 1]])}, "right padding"),
    ({"attention_mask": torch.tensor([[1, 1, 0, 0]]), "labels": torch.tensor([[5, 6, 7, 8]])}, "padded positions"),
    ({"position_ids": torch.tensor([[0, 1, 0, 1]])}, "position_ids"),
    ({"pixel_values": torch.zeros(1)}, "pixel_values"),
])
def test_batches_the_engine_would_get_wrong_are_refused(batch, message):
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[5, 6, -100, -100]]), **batch}
    with pytest.raises(ValueError, match=message):
        chunk_targets(inputs)


@pytest.mark.parametrize("overrides,message", [
    ({"label_smoothing_factor": 0.1}, "label_smoothing"),
    ({"activation_checkpointing": True}, "activation_checkpointing"),
    ({"neftune_noise_alpha": 5.0}, "neftune"),
])
def test_unsupported_trainer_features_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, SeCOArguments(chunk_size=4), **overrides)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="mode"):
        SeCOArguments(chunk_size=4, mode="dense")
    with pytest.raises(ValueError, match="chunk_size"):
        SeCOArguments(chunk_size=0)
    with pytest.raises(ValueError, match="spaco"):
        SeCOArguments(chunk_size=4, subset=(0,))


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process(tmp_path):
    """torchrun, 2 CPU processes, per-device batch 1: the same global batches as 1 process with batch 2."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)]), "OMP_NUM_THREADS": "1"}
    results = {}
    for kind in ("seco", "stock"):
        out = tmp_path / kind
        out.mkdir()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(here / "trainer_case.py"), str(out), kind], env=env, check=True, timeout=400)
        results[kind] = torch.load(out / "result.pt", weights_only=False)
    _, r0, r1 = run(tmp_path, "one", None)
    two = results["seco"]
    assert two["world"] == 2
    assert displacement_error(two["after"], two["before"], r1, r0) <= TOL
    # the chunk backwards never armed DDP's reducer; one flat all-reduce per optimizer step instead
    assert two["ddp_hook_calls"] == 0 and two["seco_allreduce_calls"] == 3
    assert results["stock"]["ddp_hook_calls"] > 0
    assert displacement_error(results["stock"]["after"], results["stock"]["before"], r1, r0) <= TOL
