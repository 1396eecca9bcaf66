"""Issue 19, campaign 37 (on 9810f4b): each finding has a test here that fails on that commit.

A1 (data loss, arguable): a user's non-float tensors or note in the metadata of adapter_model.safetensors;
A2 (traceback): ``--lora --dtype bfloat16``; A3 (silent-wrong): a jitter above 1 or held in a tensor, set after the
first call; A4 (silent-wrong): SeCOTrainer ignored a loss_function set on the model; A5 (data loss, arguable): a
user's files under the tool's temporary names, a sharded checkpoint's shards, the marker; A6 (data loss, arguable):
a LoRA run's ``--resume`` wrote its adapter over a user's file."""

from __future__ import annotations

import pytest
import torch
from helpers import FAST
from test_issue19_campaign28 import _tiny_llama
from test_issue19_campaign30 import _lora_flags

from seco_lab.cli import main

NOTES = "my notes, keep them\n"


def _peft_weights(path):
    """The run's own adapter tensors, as a dict."""
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("case", ["uint8 text", "int8", "note in metadata"])
def test_a1_overwrite_keeps_adapter_weights_that_are_not_float_or_carry_a_users_metadata(tmp_path, capsys, case):
    """Campaign 37 A1: tensors of peft's names, shapes and rank but of integer dtype (a user's text as uint8), or the
    run's own weights re-saved with a user's note in the metadata, were deleted by --overwrite."""
    from safetensors.torch import save_file

    run = tmp_path / "r"
    assert main(["train", *_lora_flags(), "--run-dir", str(run)]) == 0
    path = run / "adapter" / "adapter_model.safetensors"
    real = _peft_weights(path)
    if case == "note in metadata":
        save_file(real, str(path), metadata={"format": "pt", "my_note": "results of the paper, keep"})
    else:
        dtype = torch.uint8 if case == "uint8 text" else torch.int8
        save_file({k: torch.full(t.shape, 77, dtype=dtype) for k, t in real.items()}, str(path))
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *_lora_flags(), "--run-dir", str(run), "--overwrite"]) == 2
    assert "adapter/adapter_model.safetensors (not peft's LoRA weights)" in capsys.readouterr().err
    assert path.read_bytes() == content


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "embed_tokens,lm_head,q_proj"])
def test_a2_lora_on_a_bfloat16_model_trains_its_adapters_in_bfloat16(tmp_path, capsys, targets):
    """Campaign 37 A2: ``--lora --dtype bfloat16`` stopped with a raw TypeError (peft kept the adapters float32: a
    model of two dtypes); the adapters now take the dtype of the layers they wrap, and the run replaces itself."""
    from seco_lab.models.hf import add_lora

    model = add_lora(_tiny_llama().to(torch.bfloat16), 4, 8, targets.split(","))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    flags = _lora_flags("--dtype", "bfloat16", "--lora-targets", targets)
    run = tmp_path / "r"
    assert main(["train", *flags, "--run-dir", str(run)]) == 0
    assert main(["train", *flags, "--run-dir", str(run), "--overwrite"]) == 0, capsys.readouterr().err
    assert all(t.dtype == torch.bfloat16 for t in _peft_weights(run / "adapter" / "adapter_model.safetensors").values())


@pytest.mark.parametrize("jitter", [2.0, 2, torch.tensor(0.1)], ids=["2.0", "int 2", "tensor 0.1"])
def test_a3_jitter_set_after_the_first_call_is_read_above_1_and_from_a_tensor(jitter):
    """Campaign 37 A3: a Mixtral probed deterministic on its first call, whose blocks' jitter_noise was then set to 2
    or to torch.tensor(0.1), was accepted (seco vs dense 2.7e-1, 2.0e-2): the attribute scan read only plain numbers
    in (0, 1]. Jitter is a magnitude, any value above 0 draws noise."""
    import transformers

    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, router_jitter_noise=0.0)
    model = HFChunkModel(transformers.MixtralForCausalLM(config).train())
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    seco_grad(model, x, x, 8)  # deterministic: accepted
    blocks = [m for m in model.modules() if hasattr(m, "jitter_noise")]
    assert blocks
    for block in blocks:
        block.jitter_noise = jitter
    with pytest.raises(ValueError, match="jitter_noise=.* draws dropout or noise in training mode"):
        seco_grad(model, x, x, 8)


def test_a3_names_that_only_mention_noise_stay_harmless():
    """The neighbours of campaign 36 Z1 stay accepted: a dropout-like name above 1 is no probability."""
    from seco_lab.models.hf import _random_values

    assert _random_values([("denoise_steps", 10), ("jitter_seed", 42), ("noise_level", 0.5), ("dropout", 2),
                           ("attention_dropout", torch.tensor(0.0)), ("jitter_noise", 0)]) == {}
    assert _random_values([("attention_dropout", torch.tensor(0.25)), ("jitter_noise", 3)]) == {
        "attention_dropout": 0.25, "jitter_noise": 3.0}


def one_step(tmp_path):
    """TrainingArguments of one CPU step and a dataset of two random 32-token rows (SeCOTrainer's checks)."""
    import transformers
    from datasets import Dataset

    ids = torch.randint(0, 64, (2, 32)).tolist()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=1,
                                          use_cpu=True, report_to=[], save_strategy="no")
    return args, Dataset.from_dict({"input_ids": ids, "labels": ids})


def test_a4_the_hf_trainer_refuses_a_loss_function_set_on_the_model(tmp_path):
    """Campaign 37 A4: a Llama whose loss_function was replaced (cross-entropy plus a logit penalty) trained plain
    cross-entropy under SeCOTrainer without a word (parameters 5.3e-6 from the stock Trainer's)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer

    def penalised(logits, labels, vocab_size, **kw):
        return ForCausalLMLoss(logits, labels, vocab_size, **kw) + 0.1 * logits.float().pow(2).mean()

    model = _tiny_llama()
    model.loss_function = penalised
    args, data = one_step(tmp_path)
    with pytest.raises(ValueError, match=r"a loss_function set on the model \(penalised\), which the engine would not"):
        SeCOTrainer(model=model, args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=16))
    model.loss_function = ForCausalLMLoss  # transformers' own: the engine's
    SeCOTrainer(model=model, args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=16))


@pytest.mark.parametrize("name", [
    "config.json.seco-tmp1", "metrics.jsonl.seco-tmp77", "loss.png.seco-tmp2", ".seco-lab-run.seco-tmp9",
    "checkpoints/latest.seco-tmp3", "checkpoints/step_000001.pt.seco-tmp5", "checkpoints/step_000005.dcp/__0_0.distcp",
    "checkpoints/step_000005.dcp.old/.metadata", ".seco-lab-run"])
def test_a5_overwrite_and_resume_keep_a_users_file_under_the_tools_temporary_and_sharded_names(r2, tmp_path, capsys,
                                                                                               name):
    """Campaign 37 A5: a user's notes saved under a name of the tool's temporary files (``NAME.seco-tmp<pid>``), as a
    shard of a sharded checkpoint of a run that has none, or into the marker, were deleted by --overwrite, rc 0. A
    temporary file is the run's when it holds what NAME must; a sharded folder when it has an extra.pt."""
    from helpers import copy_run

    run = copy_run(r2, tmp_path / "r")
    path = run / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(NOTES)
    capsys.readouterr()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    shown = name if "dcp" not in name else name.split("/")[0] + "/" + name.split("/")[1]
    assert shown in err and "(no" in err or f"{name} (not" in err, err
    assert path.read_text() == NOTES
    if name.endswith(".seco-tmp5"):  # a resume clears the run's own torn writes, never this one
        with pytest.warns(UserWarning, match=r"kept .*step_000001\.pt\.seco-tmp5: it is not a complete step_000001"):
            assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 0
        assert path.read_text() == NOTES


@pytest.mark.parametrize("name", ["config.json", "checkpoints/latest", "checkpoints/step_000002.pt"])
def test_a5_a_complete_temporary_file_of_the_run_is_still_its_own(r2, tmp_path, capsys, name):
    """The other side: a write killed after the temporary file was complete but before its rename leaves the run's
    own file under ``NAME.seco-tmp<pid>``: --overwrite replaces the run, a resume clears it."""
    import shutil

    from helpers import copy_run

    for flag in ("--resume", "--overwrite"):
        run = copy_run(r2, tmp_path / flag.strip("-"))
        shutil.copyfile(run / name, run / f"{name}.seco-tmp123")
        capsys.readouterr()
        steps = ["--steps", "3"] if flag == "--resume" else []
        assert main(["train", *FAST, *steps, "--run-dir", str(run), flag]) == 0, capsys.readouterr().err
        assert not (run / f"{name}.seco-tmp123").exists()


def test_a6_a_lora_resume_does_not_write_its_adapter_over_a_users_file(tmp_path, capsys):
    """Campaign 37 A6: ``--resume`` of a finished LoRA run wrote its adapter over a user's adapter_model.safetensors
    (which --overwrite already refused to delete); it is refused before training, naming the file."""
    from safetensors.torch import save_file

    run = tmp_path / "r"
    assert main(["train", *_lora_flags(), "--run-dir", str(run)]) == 0
    path = run / "adapter" / "adapter_model.safetensors"
    save_file({"my_embedding": torch.arange(4.0)}, str(path))
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *_lora_flags("--steps", "3"), "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "adapter/adapter_model.safetensors (not peft's LoRA weights)" in err and "move them out" in err, err
    assert path.read_bytes() == content
    path.unlink()  # the user moved it out: the run goes on
    assert main(["train", *_lora_flags("--steps", "3"), "--run-dir", str(run), "--resume"]) == 0
