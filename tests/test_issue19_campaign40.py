"""Issue 19, campaign 40 (on 2811d30 and 40680d9): each finding has a test here that fails on 40680d9.

D1 (silent-wrong): a loss switched mid-run through ``model.loss_function`` (or transformers' ``LOSS_MAPPING``) was
never checked again; D2 (silent-wrong): in 16-bit models the values check allowed 4 sqrt(eps) (35% in bfloat16) to
cover pass 1's spans, which let noise of a few percent through -- pass 1 now runs chunk by chunk there and the
allowance is eps; D4 (minor): a bad ``SECO_LAB_RECOMPUTE_CHECK`` was refused by a study or audit only after it made
its folder; D5 (data loss, arguable): a results table edited and sealed by the user was replaced by a rerun."""

from __future__ import annotations

import pytest
import torch
import trainer_case as tc
from test_hf_trainer_loss_check import SAYS, z_loss
from transformers import TrainerCallback

from seco_lab import seco_grad, spaco_grad
from seco_lab.core.checks import RECOMPUTE_ENV, RecomputationError
from seco_lab.core.engine import pass1_span
from seco_lab.integrations.transformers import SeCOArguments
from seco_lab.models.hf import HFChunkModel, build_hf_model


class LossAtStep(TrainerCallback):
    """Sets the model's loss_function to cross-entropy + a z-loss after the first optimizer step."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            from transformers.loss.loss_utils import ForCausalLMLoss

            def with_z(logits, labels, vocab_size, **kw):
                return ForCausalLMLoss(logits, labels, vocab_size, **kw) + 0.1 * logits.float().pow(2).mean()

            self.model.loss_function = with_z


def test_d1_a_loss_function_set_during_training_is_checked_on_the_next_micro_batch(tmp_path):
    model = tc.for_seco(tc.tiny_llama())
    trainer = tc.make_trainer(tmp_path, seco=SeCOArguments(chunk_size=4), model=model, callbacks=[LossAtStep(model)])
    with pytest.raises(ValueError, match=SAYS):
        trainer.train()
    assert trainer.state.global_step == 1
    assert z_loss  # the same z-loss as the campaign 39 C2 tests


def _noisy(dtype, noise):
    torch.manual_seed(0)
    model = build_hf_model("llama", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128,
                                     "max_position_embeddings": 1024}, dtype=dtype).eval()
    if noise is not None:
        model.model.layers[0].mlp.register_forward_hook(lambda mod, i, o: noise(o))
    return HFChunkModel(model)


NOISE = {"add 0.002": lambda o: o + 0.002 * torch.randn_like(o),
         "MC dropout 0.1": lambda o: torch.nn.functional.dropout(o, 0.1, training=True)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("noise", list(NOISE))
def test_d2_noise_in_a_16_bit_model_is_refused(dtype, noise):
    adapter = _noisy(dtype, NOISE[noise])
    x = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RecomputationError, match="differs from its first pass"):
        seco_grad(adapter, x, torch.roll(x, -1, 1), 32)
    with pytest.raises(RecomputationError, match="differs from its first pass"):
        spaco_grad(adapter, x, torch.roll(x, -1, 1), 32, "paper", budget=4, subset=(0, 2, 5, 7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_d2_pass_1_runs_chunk_by_chunk_in_16_bit_while_values_are_compared(dtype, monkeypatch):
    """16-bit (weights or autocast): spans of 512 tokens would round 1-3% apart from a chunk's rebuild; chunk by chunk
    the rebuild reproduces pass 1 and a deterministic model passes the tight allowance."""
    adapter = _noisy(dtype, None)
    spans = 512 // 32
    assert pass1_span(adapter, 32) == (spans if dtype == torch.float32 else 1)
    x = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(1))
    seco_grad(adapter, x, torch.roll(x, -1, 1), 32)  # no false refusal
    if dtype == torch.float32:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert pass1_span(adapter, 32) == 1
            seco_grad(adapter, x, torch.roll(x, -1, 1), 32)
    monkeypatch.setenv(RECOMPUTE_ENV, "metadata")
    assert pass1_span(adapter, 32) == spans  # the user's choice: spans again, metadata compared


def test_d4_a_bad_recompute_check_is_refused_before_a_study_or_audit_makes_its_folder(tmp_path, monkeypatch, capsys):
    from seco_lab.cli import main

    monkeypatch.setenv(RECOMPUTE_ENV, "strict")
    assert main(["study", "bias", "--quick", "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    assert main(["audit", "--quick", "--model", "tiny", "--out", str(tmp_path / "a")]) == 2
    assert f"{RECOMPUTE_ENV}='strict' is not a recompute check" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "a").exists()


def test_d5_a_rerun_keeps_a_sealed_edit_of_its_table_beside_the_new_one(tmp_path, monkeypatch):
    """``seal`` vouches for an edit on purpose; a rerun whose tables differ writes its own and keeps the stored one
    as results.replaced-1.csv, recorded in the checksums (a report still reads the folder)."""
    from dataclasses import replace

    from seco_lab.folder_lock import release_lock
    from seco_lab.store import _HELD_LOCKS, NO_CHECKSUMS_ENV, seal, verify_checksums
    from seco_lab.studies.bias.driver import QUICK, run_study

    monkeypatch.setenv(NO_CHECKSUMS_ENV, "0")
    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100, paper_cells=())
    run_study(cfg, tmp_path, progress=False)
    table = tmp_path / "results.csv"
    lines = table.read_text().splitlines()
    table.write_text("\n".join([lines[0] + ",my_note"] + [line + ",keep" for line in lines[1:]]) + "\n")
    edited = table.read_bytes()
    release_lock(_HELD_LOCKS.pop(tmp_path.resolve()))  # the study's lock lasts until its process ends: a later one
    seal(tmp_path)
    run_study(cfg, tmp_path, progress=False)
    assert (tmp_path / "results.replaced-1.csv").read_bytes() == edited
    assert "my_note" not in table.read_text()
    verify_checksums(tmp_path, "the bias study")


# --------------------------------------------------------------------------- campaign 41 (on 44e710b)


class PositionWeightedAtStep(TrainerCallback):
    """Campaign 41 E1: at step 1, a loss_function equal to cross-entropy on the first 8 tokens and twice it after."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            import torch.nn.functional as F

            def weighted(logits, labels, vocab_size, **kw):
                targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
                token = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
                weight = (torch.arange(targets.shape[-1]) >= 8).float() + 1.0
                return (token * weight).sum() / (targets != -100).sum()

            self.model.loss_function = weighted


class ZLossHookFromStep(TrainerCallback):
    """Campaign 41 E2: a hook registered before train() that changes the loss only from step 1 (a counter)."""

    def __init__(self):
        self.on = False

    def on_step_end(self, args, state, control, **kwargs):
        self.on = state.global_step >= 1


def test_e1_e2_the_loss_is_checked_on_the_whole_micro_batch_and_again_every_n_steps(tmp_path):
    model = tc.for_seco(tc.tiny_llama())
    trainer = tc.make_trainer(tmp_path / "e1", seco=SeCOArguments(chunk_size=4), model=model,
                              callbacks=[PositionWeightedAtStep(model)])
    with pytest.raises(ValueError, match=r"the loss the stock Trainer computes .* on the first (9|1\d) tokens"):
        trainer.train()  # the whole micro-batch (9-18 tokens), not 2 chunks of 4 (8 tokens, where the loss is CE)
    assert trainer.state.global_step == 1

    model = tc.for_seco(tc.tiny_llama())
    switch = ZLossHookFromStep()
    model.register_forward_hook(lambda mod, args, out: setattr(out, "loss", z_loss(out)) or out
                                if switch.on and out.loss is not None else out)
    trainer = tc.make_trainer(tmp_path / "e2", seco=SeCOArguments(chunk_size=4), model=model, callbacks=[switch])
    trainer.seco_loss_check_every = 2
    with pytest.raises(ValueError, match="something adds"):
        trainer.train()
    assert trainer.state.global_step == 2  # checked at steps 0 and 2: the change at step 1 is caught at step 2


def test_e3_a_16_bit_models_loss_is_summed_in_float32():
    """Campaign 41 E3: the chunk losses of a bfloat16 model were summed in bfloat16 (4.7% off at 64 chunks); they
    are computed from float32 logits as transformers' loss does, within 1e-3 of the float64 model's loss."""
    torch.manual_seed(0)
    model = build_hf_model("llama", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128,
                                     "max_position_embeddings": 2048}, dtype=torch.float64)
    x = torch.randint(0, 128, (1, 2048), generator=torch.Generator().manual_seed(1))
    ref = float(seco_grad(HFChunkModel(model), x, torch.roll(x, -1, 1), 32)[0])
    loss = float(seco_grad(HFChunkModel(model.to(torch.bfloat16)), x, torch.roll(x, -1, 1), 32)[0])
    assert abs(loss - ref) <= 1e-3 * ref, (loss, ref)


@pytest.mark.parametrize("how", ["--fresh", "a table deleted"])
def test_e5_a_sealed_edit_is_kept_by_a_fresh_rerun_and_when_another_table_is_missing(tmp_path, monkeypatch, how):
    from dataclasses import replace

    from seco_lab.folder_lock import release_lock
    from seco_lab.store import _HELD_LOCKS, NO_CHECKSUMS_ENV, seal
    from seco_lab.studies.bias.driver import QUICK, run_study

    monkeypatch.setenv(NO_CHECKSUMS_ENV, "0")
    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100, paper_cells=())
    run_study(cfg, tmp_path, progress=False)
    table = tmp_path / "checks.csv"
    lines = table.read_text().splitlines()
    table.write_text("\n".join([lines[0] + ",my_note"] + [line + ",keep" for line in lines[1:]]) + "\n")
    edited = table.read_bytes()
    if how == "a table deleted":
        (tmp_path / "paper.csv").unlink()
    release_lock(_HELD_LOCKS.pop(tmp_path.resolve()))
    seal(tmp_path)
    run_study(cfg, tmp_path, fresh=how == "--fresh", progress=False)
    assert (tmp_path / "checks.replaced-1.csv").read_bytes() == edited


def test_e4_an_audit_rerun_keeps_a_sealed_edit_of_its_table(tmp_path, monkeypatch, capsys):
    """Campaign 41 E4: an audit rerun wrote its tables again from the stored units over a bias.csv the user edited
    and sealed; a table the units do not give is now kept as bias.replaced-1.csv (and a second rerun keeps going)."""
    from dataclasses import replace

    from test_issue19_campaign39 import tiny_audit_config

    from seco_lab.folder_lock import release_lock
    from seco_lab.store import _HELD_LOCKS, NO_CHECKSUMS_ENV, seal
    from seco_lab.studies.audit import run_audit

    monkeypatch.setenv(NO_CHECKSUMS_ENV, "0")
    cfg = tiny_audit_config()
    out = tmp_path / "a"
    run_audit(replace(cfg), out, progress=False)
    (out / "report.md").unlink(missing_ok=True)  # the CLI writes one; its digest would refuse a rerun over it
    table = out / "bias.csv"
    lines = table.read_text().splitlines()
    table.write_text("\n".join([lines[0] + ",my_note"] + [line + ",keep" for line in lines[1:]]) + "\n")
    edited = table.read_bytes()
    held = _HELD_LOCKS.pop(out.resolve(), None)
    if held is not None:
        release_lock(held)
    seal(out)
    run_audit(replace(cfg), out, progress=False)
    assert (out / "bias.replaced-1.csv").read_bytes() == edited and "my_note" not in table.read_text()
    says = "bias.csv is not what the stored units give (edited?): kept as bias.replaced-1.csv"
    assert says in capsys.readouterr().err
    run_audit(replace(cfg), out, progress=False)  # the kept copy is a file of the folder now: a rerun goes on
    assert not (out / "bias.replaced-2.csv").exists()
