"""Issue 19, campaign 38 (on adb8591): each finding has a test here that fails on that commit.

B1 (silent-wrong): random draws the probe's lists missed (rrelu, ``Tensor.bernoulli``/``multinomial`` methods,
``torch.alpha_dropout``/``feature_dropout``/``native_dropout``); B2 (silent-wrong): randomness added after the first
call by a hook or a module swapped in, or a jitter held in a numpy array; B3 (misleading): counts named like a dropout
or jitter (``dropout_warmup_steps=1``); B4 (silent-wrong): a Trainer subclass's ``compute_loss``; B5, B6 (data
loss, arguable): a user's note in the marker, a sharded folder with an empty ``extra.pt``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import FAST, copy_run
from test_issue19_campaign28 import _tiny_llama
from test_issue19_campaign37 import one_step

from seco_lab.cli import main

NOTES = "my notes, keep them\n"


def _noisy_hook(draw):
    return lambda mod, i, out: out + 0.1 * draw(out) if mod.training else out


DRAWS = {
    "rrelu module": None,
    "Tensor.bernoulli": lambda o: torch.full_like(o, 0.5).bernoulli(),
    "Tensor.multinomial": lambda o: torch.ones(o.shape[-1]).multinomial(o.shape[-1]).to(o.dtype).expand_as(o),
    "torch.alpha_dropout": lambda o: torch.alpha_dropout(o, 0.2, True),
    "torch.feature_dropout": lambda o: torch.feature_dropout(o, 0.2, True),
    "torch.native_dropout": lambda o: torch.native_dropout(o, 0.2, True)[0],
}


@pytest.mark.parametrize("case", ["rrelu module", "Tensor.bernoulli", "Tensor.multinomial", "torch.alpha_dropout",
                                  "torch.feature_dropout", "torch.native_dropout"])
@pytest.mark.parametrize("when", ["from the start", "after the first call"])
def test_b1_b2_random_draws_in_a_training_forward_are_refused_whenever_they_are_added(case, when):
    """Campaign 38 B1, B2: a Llama with nn.RReLU activations, or a forward hook drawing with the method forms
    Tensor.bernoulli / Tensor.multinomial or the torch.* dropouts, trained with seco vs dense 1.6e-2 to 1.29 apart; a
    hook registered (a module swapped in) after the first call was not probed."""
    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel

    base = _tiny_llama().double().train()
    model = HFChunkModel(base)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    if when == "after the first call":
        seco_grad(model, x, x, 8)  # deterministic: accepted, probed
    if case == "rrelu module":
        base.model.layers[0].mlp.act_fn = torch.nn.RReLU()
    else:
        base.model.layers[0].mlp.register_forward_hook(_noisy_hook(DRAWS[case]))
    with pytest.raises(ValueError, match="the model is not deterministic|draws dropout or noise in training mode"):
        seco_grad(model, x, x, 8)


def test_b1_a_draw_no_list_names_is_found_by_the_generator_advancing():
    """The safety net: a draw the probe's function mode does not see (here made with torch functions disabled) still
    advances the default generator, which the probe compares before and after the first training forward."""
    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel

    base = _tiny_llama().double().train()

    def hook(mod, i, out):
        with torch._C.DisableTorchFunction():
            noise = torch.rand(out.shape, dtype=out.dtype)
        return out + 0.1 * noise

    base.model.layers[0].mlp.register_forward_hook(hook)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"the random number generator advanced"):
        seco_grad(HFChunkModel(base), x, x, 8)


def test_b2_a_jitter_held_in_a_numpy_array_is_read():
    """Campaign 38 B2: jitter_noise = np.array(0.5) set after the first call was accepted (seco vs dense 6.5e-2)."""
    from seco_lab.models.hf import _random_values

    assert _random_values([("jitter_noise", np.array(0.5)), ("attention_dropout", np.float32(0.25))]) == {
        "jitter_noise": 0.5, "attention_dropout": np.float32(0.25)}


def test_b3_a_dropout_or_jitter_field_is_a_name_that_ends_with_it():
    """Campaign 38 B3 (misleading): counts whose names mention dropout or jitter (``dropout_warmup_steps=1``,
    ``jitter_noise_warmup_steps=100``) were refused as noise (the models train exactly: the campaign 36 Z1 test);
    the name must end with the field, and the fields of real configs still do."""
    from seco_lab.models.hf import _random_values

    assert _random_values([("dropout_warmup_steps", 1), ("jitter_noise_warmup_steps", 100),
                           ("jitter_eps_decay_steps", 5), ("n_jitter_noise_calls", 7)]) == {}
    assert set(_random_values([("hidden_dropout_prob", 0.1), ("dropout_rate", 0.1), ("router_jitter_noise", 0.1),
                               ("drop_path_rate", 0.1), ("resid_pdrop", 0.1)])) == {
        "hidden_dropout_prob", "dropout_rate", "router_jitter_noise", "drop_path_rate", "resid_pdrop"}


def test_b4_the_hf_trainer_refuses_a_subclass_whose_compute_loss_it_would_not_call(tmp_path):
    """Campaign 38 B4: a Trainer subclass overriding compute_loss (cross-entropy plus a logit penalty) mixed into
    SeCOTrainer trained plain cross-entropy without a word (5.3e-6 from the stock Trainer with the same override)."""
    import transformers

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer, SeCOTrainerMixin

    class Penalised(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
            loss = loss + 0.1 * out.logits.pow(2).mean()
            return (loss, out) if return_outputs else loss

    class SeCOPenalised(SeCOTrainerMixin, Penalised):
        pass

    class Subclass(SeCOTrainer):
        compute_loss = Penalised.compute_loss

    args, data = one_step(tmp_path)
    for cls in (SeCOPenalised, Subclass):
        with pytest.raises(ValueError, match="compute_loss overridden in .*would not call it"):
            cls(model=_tiny_llama(), args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=16))
    SeCOTrainer(model=_tiny_llama(), args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=16))


@pytest.mark.parametrize("case", ["note in the marker", "note as the marker's temporary file", "empty extra.pt"])
def test_b5_b6_overwrite_keeps_a_users_marker_note_and_a_sharded_folder_without_this_runs_extra(r2, tmp_path, capsys,
                                                                                                case):
    """Campaign 38 B5: a user's note added as a key of the run's marker, or a marker-like JSON with a note saved as
    the marker's temporary file, was deleted by --overwrite; B6: a sharded folder with an empty extra.pt let the
    user's notes saved as its shards be deleted."""
    import json

    run = copy_run(r2, tmp_path / "r")
    marker = run / ".seco-lab-run"
    if case == "note in the marker":
        path = marker
        path.write_text(json.dumps({**json.loads(marker.read_text()), "notes": "trained on the March data"}))
        says = ".seco-lab-run (not a run's marker)"
    elif case == "note as the marker's temporary file":
        path = run / ".seco-lab-run.seco-tmp2"
        path.write_text(json.dumps({"tool": "seco-lab", "notes": NOTES}))
        says = ".seco-lab-run.seco-tmp2 (not a complete .seco-lab-run"
    else:
        folder = run / "checkpoints" / "step_000005.dcp"
        folder.mkdir()
        (folder / "extra.pt").touch()
        path = folder / "__0_0.distcp"
        path.write_text(NOTES)
        says = "checkpoints/step_000005.dcp (no extra.pt of this run"
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    assert says in capsys.readouterr().err
    assert path.read_bytes() == content


@pytest.mark.parametrize("name", ["metrics.jsonl", "metrics.jsonl.seco-tmp3"])
def test_b7_a_huge_file_under_the_metrics_names_is_judged_without_reading_it_whole(r2, tmp_path, name):
    """Campaign 38 B7: a 7 GB file without a newline as metrics.jsonl (or its temporary name) was read whole by the
    content check: a MemoryError traceback from --overwrite (and --resume) under a 6 GB address-space limit. Lines
    are read up to a record's size. The file is sparse (no disk used)."""
    import resource
    import subprocess
    import sys

    run = copy_run(r2, tmp_path / "r")
    path = run / name
    with open(path, "wb") as f:
        f.truncate(7 << 30)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    out = subprocess.run([sys.executable, "-m", "seco_lab.cli", "train", *FAST, "--run-dir", str(run), "--overwrite"],
                         capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert out.returncode == 2 and f"{name} (not" in out.stderr, out.stderr[-2000:]
    assert path.stat().st_size == 7 << 30


def test_b1_a_one_number_draw_is_a_coin_only_in_a_model_with_layerdrop():
    """Campaign 38 (P-c5e-coin): a hook zeroing a layer's output on a torch.rand(()) coin (stochastic depth) was
    taken for OPT's layerdrop coin and accepted (seco vs dense 7.6e-2); a model without a layerdrop field is
    refused."""
    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel

    base = _tiny_llama().double().train()
    base.model.layers[0].mlp.register_forward_hook(
        lambda mod, i, out: out * float(torch.rand(()) < 0.5) if mod.training else out)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"the random number generator advanced"):
        seco_grad(HFChunkModel(base), x, x, 8)


def test_b4_the_hf_trainer_refuses_a_model_class_whose_forward_may_add_a_loss(tmp_path):
    """Campaign 38 (P-c6d-V1b): a LlamaForCausalLM subclass whose forward adds a z-loss to out.loss trained plain
    cross-entropy under SeCOTrainer without a word; a forward of the user's own class is refused unless the class
    says its loss is the cross-entropy."""
    import transformers

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer

    class ZLoss(transformers.LlamaForCausalLM):
        def forward(self, *args, **kw):
            out = super().forward(*args, **kw)
            if out.loss is not None:
                out.loss = out.loss + 1e-4 * out.logits.logsumexp(-1).pow(2).mean()
            return out

    model = ZLoss(_tiny_llama().config)
    args, data = one_step(tmp_path)
    with pytest.raises(ValueError, match=r"a forward of your own model class \(.*ZLoss\)"):
        SeCOTrainer(model=model, args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=16))
    ZLoss.seco_loss_is_cross_entropy = True  # the user's word that it is
    SeCOTrainer(model=model, args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=16))


@pytest.mark.parametrize("file, edit", [
    ("README.md", lambda text: text + "\n## My notes\nTrained on the March data.\n"),
    ("adapter_config.json", lambda text: text.rstrip().rstrip("}") + ', "my_notes": "keep"}\n')])
def test_b8_the_adapter_files_a_run_saved_are_known_by_their_digest(tmp_path, capsys, file, edit):
    """Campaign 38 B8 (data loss, arguable): notes a user added to the adapter's README.md (under peft's front matter)
    were deleted by --overwrite, and a key added to adapter_config.json was written over by a LoRA --resume: the
    marker records the SHA-256 of each file the last save wrote."""
    from test_issue19_campaign30 import _lora_flags

    run = tmp_path / "r"
    assert main(["train", *_lora_flags(), "--run-dir", str(run)]) == 0
    assert main(["train", *_lora_flags(), "--run-dir", str(run), "--overwrite"]) == 0  # its own files
    path = run / "adapter" / file
    path.write_text(edit(path.read_text()))
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *_lora_flags(), "--run-dir", str(run), "--overwrite"]) == 2
    assert f"adapter/{file} (not the file this run saved" in capsys.readouterr().err
    assert main(["train", *_lora_flags("--steps", "3"), "--run-dir", str(run), "--resume"]) == 2
    assert f"adapter/{file} (not the file this run saved" in capsys.readouterr().err
    assert path.read_bytes() == content


def test_b9_a_study_rerun_keeps_a_users_file_under_a_temporary_name(tmp_path):
    """Campaign 38 B9 (data loss, arguable): rerunning ``study bias`` deleted a user's notes saved as
    ``cells/L1_k8_s0.results.csv.seco-tmp3`` or ``study.json.seco-tmp7`` as stale temporaries (``clear_stale``, and
    --fresh's clearing of the cells folder); only empty ones are removed now, others kept with a warning."""
    from seco_lab.store import StudyFolder, clear_stale

    folder = StudyFolder(tmp_path / "s")
    folder.cells.mkdir(parents=True)
    notes = [folder.cells / "L1_k8_s0.results.csv.seco-tmp3", folder.root / "study.json.seco-tmp7"]
    for path in notes:
        path.write_text(NOTES)
    empty = folder.cells / "L1_k8_s0.json.seco-tmp4"
    empty.touch()
    (folder.cells / "L1_k8_s0.json").write_text("{}")
    with pytest.warns(UserWarning, match="kept"):
        clear_stale(folder.cells)
        clear_stale(folder.root)
    assert not empty.exists() and all(p.read_text() == NOTES for p in notes)
    ours, foreign = folder._cell_files()
    assert notes[0] not in ours and notes[0].name in foreign


def test_campaign39_c9_a_trl_sft_loss_other_than_nll_is_refused(tmp_path):
    """Campaign 39 C9 (silent-wrong): TRL's SFTTrainer with SFTConfig(loss_type='dft') through SeCOTrainerMixin
    trained plain cross-entropy (parameters 7.3e-4 from the stock DFT SFTTrainer); the default 'nll' is taken."""
    from datasets import Dataset
    from test_hf_trainer import word_tokenizer
    from trl import SFTConfig, SFTTrainer

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainerMixin

    class SeCOSFTTrainer(SeCOTrainerMixin, SFTTrainer):
        pass

    ids = torch.randint(0, 64, (2, 32)).tolist()
    data = Dataset.from_dict({"input_ids": ids})
    for loss_type, refused in (("dft", True), ("nll", False)):
        args = SFTConfig(output_dir=str(tmp_path / loss_type), per_device_train_batch_size=2, max_steps=1,
                         use_cpu=True, report_to=[], save_strategy="no", activation_checkpointing=False,
                         loss_type=loss_type, bf16=False)
        kw = dict(model=_tiny_llama(), args=args, train_dataset=data, processing_class=word_tokenizer(),
                  seco_args=SeCOArguments(chunk_size=16))
        if refused:
            with pytest.raises(ValueError, match="loss_type='dft'"):
                SeCOSFTTrainer(**kw)
        else:
            SeCOSFTTrainer(**kw)
