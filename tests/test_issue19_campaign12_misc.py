"""Campaign 12 (docs/hostile_campaign_12.md), G9-G12: a LoRA target list with one unknown name, SeCOTrainer on a
batch without targets, a run whose checkpoints folder is a file, and packing an empty dataset."""

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from seco_lab.integrations.packing import pack_dataset
from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer
from seco_lab.models.hf import add_lora, build_hf_model
from seco_lab.training.run_checks import RunDirError, check_usable


def test_a_lora_target_list_with_one_unknown_name_is_refused():
    """G9: peft drops a target that matches nothing when another matches; a typo would train fewer adapters."""
    model = build_hf_model("llama", {"vocab_size": 64}, attn_implementation="sdpa", dtype=torch.float32)
    with pytest.raises(ValueError, match="'bogus_proj' matches no module.*q_proj"):
        add_lora(model, 4, 8, ("q_proj", "bogus_proj"))
    peft_model = add_lora(build_hf_model("llama", {"vocab_size": 64}, attn_implementation="sdpa"), 4, 8,
                          ("q_proj", "layers.0.self_attn.v_proj"))  # a dotted suffix is a name too (peft's rule)
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("v_proj" in n for n in trained) and any("q_proj" in n for n in trained)


def test_seco_trainer_on_a_batch_without_targets_skips_it(tmp_path):
    """G10: every label -100 in the whole batch: no ZeroDivisionError; the step has no loss and no gradient."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (4, 32)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": [[-100] * 32] * 4})
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, learning_rate=0.1, weight_decay=0.0)
    trainer = SeCOTrainer(model=model, args=args, train_dataset=data, seco_args=SeCOArguments(chunk_size=8))
    out = trainer.train()
    assert out.training_loss == 0.0
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_a_checkpoints_file_in_the_run_dir_is_named(tmp_path):
    """G11: r/checkpoints is a file: a one-line error naming it (was the bare OSError 'File exists')."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "checkpoints").write_text("x")
    for resume, overwrite in ((True, False), (False, True)):
        with pytest.raises(RunDirError, match="checkpoints is a file, not a folder"):
            check_usable(run, resume, overwrite)


def test_packing_an_empty_dataset_says_so():
    """G12: an empty dataset: 'holds no documents' (was: "Column name ['ids'] not in the dataset")."""

    class Tok:
        eos_token_id = 1

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[2, 3] for _ in texts]}

    with pytest.raises(ValueError, match="holds no documents"):
        pack_dataset(datasets.Dataset.from_dict({"text": []}), Tok(), 4)
