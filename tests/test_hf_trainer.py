"""SeCOTrainer against the stock transformers Trainer (tiny random HF Llama, float64)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_case import (
    VOCAB,
    displacement_error,
    float64_causal_loss,
    for_seco,
    make_trainer,
    pad_collate,
    padded_examples,
    tiny_llama,
    trainable_state,
)
from transformers import TrainerCallback

from seco_lab import spaco_grad
from seco_lab.integrations.transformers import SeCOArguments, chunk_targets
from seco_lab.models.hf import HFChunkModel

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
    # evaluation is the Trainer's own full-sequence forward, on the trained weights (with the stock run's float64 loss)
    held_out = padded_examples(4, seed=9)
    (seco.model.get_base_model() if lora else seco.model).loss_function = float64_causal_loss
    assert seco.evaluate(held_out)["eval_loss"] == pytest.approx(stock.evaluate(held_out)["eval_loss"], rel=TOL)


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


def test_a_model_the_engine_cannot_drive_is_refused_at_construction(tmp_path):
    from seco_lab.models.hf import build_hf_model

    model = build_hf_model("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                           dtype=torch.float64)
    with pytest.raises(ValueError, match="sliding"):
        make_trainer(tmp_path, SeCOArguments(chunk_size=4), model=model)


def test_a_window_that_no_layer_uses_is_no_reason_to_refuse(tmp_path):
    """Campaign 47 Q5: a config that keeps a sliding_window value while its layer_types are all full attention (a
    Gemma-3 for experiments; Qwen2 with max_window_layers >= its layers) was refused as sliding-window, although no
    layer uses the window; the layer types decide."""
    from seco_lab.models.hf import build_hf_model, chunkable_reason

    model = build_hf_model("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                           dtype=torch.float64)
    assert "sliding" in chunkable_reason(model.config)
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    assert chunkable_reason(model.config) is None
    gemma = __import__("transformers").Gemma3TextConfig(sliding_window=512, num_hidden_layers=2,
                                                        layer_types=["full_attention"] * 2)
    assert chunkable_reason(gemma) is None
    gemma.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding" in chunkable_reason(gemma)


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


def word_tokenizer():
    """A tokenizer whose tokens are the model's ids (TRL's SFTTrainer needs one): pad t0, eos t2."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="t0", unk_token="t1", eos_token="t2")


def test_mixin_composes_with_trl_sft_trainer(tmp_path):
    """SeCOTrainerMixin + TRL's SFTTrainer trains exactly as SeCOTrainer (= the stock Trainer) on the same batches."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from seco_lab.integrations.transformers import SeCOTrainerMixin

    class SeCOSFTTrainer(SeCOTrainerMixin, SFTTrainer):
        pass

    rows = Dataset.from_list(padded_examples(8))
    states = {}
    for name, cls, extra in [("seco_sft", SeCOSFTTrainer, {"seco_args": SeCOArguments(chunk_size=4)}),
                             ("sft", SFTTrainer, {})]:
        args = SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=3, learning_rate=1e-2, max_grad_norm=0.05, lr_scheduler_type="constant",
                         use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, bf16=False,
                         activation_checkpointing=False)  # SFTConfig turns it on; SeCO refuses it
        model = for_seco(tiny_llama()) if extra else tiny_llama()
        trainer = cls(model=model, args=args, train_dataset=rows, processing_class=word_tokenizer(), **extra)
        before = trainable_state(trainer.model)
        trainer.train()
        states[name] = (trainable_state(trainer.model), before)
    _, c0, c1 = run(tmp_path, "seco", SeCOArguments(chunk_size=4))
    assert displacement_error(*states["seco_sft"], c1, c0) <= TOL
    # the stock SFTTrainer computes its loss in float32 (a fused head), so it agrees to float32 accuracy only
    assert displacement_error(*states["seco_sft"], *states["sft"]) <= 1e-4


class CharTokenizer:
    """A stand-in tokenizer: one id per character, eos = 0."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_pack_dataset_concatenates_documents_and_cuts_fixed_rows(tmp_path):
    from datasets import Dataset

    from seco_lab.integrations.transformers import pack_dataset

    docs = {"b.txt": "second document\nwith two lines", "a.txt": "first", "sub/c.txt": "third one"}
    for name, text in docs.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    order = ["a.txt", "b.txt", "sub/c.txt"]  # files of a folder: recursive, sorted
    stream = [t for name in order for t in [ord(c) for c in docs[name]] + [0]]
    for source in (tmp_path, Dataset.from_dict({"text": [docs[n] for n in order]})):
        rows = pack_dataset(source, CharTokenizer(), 7)
        assert rows["input_ids"] == [stream[i : i + 7] for i in range(0, len(stream) - 6, 7)]
        assert rows["labels"] == rows["input_ids"]
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_dataset(tmp_path, CharTokenizer(), 10_000)
    with pytest.raises(FileNotFoundError, match="no such"):
        pack_dataset(tmp_path / "missing.txt", CharTokenizer(), 8)


def test_readme_trainer_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Use SeCO/SpaCO in your Trainer", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(block.strip().splitlines()) <= 20
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and len(trainer.seco_draws) == 4  # 2 steps x 2 micro-batches
    assert all(len(d[2]) == 2 for d in trainer.seco_draws)  # SpaCO: 2 of the 4 chunks each


@pytest.mark.slow
@pytest.mark.real
def test_lora_example_compares_memory_with_stock_trainer(tmp_path):
    """The example script from the checkout, short: SmolLM2-135M, stock vs SeCO in fresh processes."""
    import json
    import textwrap as source  # a small real text: a stdlib module

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "examples" / "lora_trainer.py"), "--seq-len", "128",
                           "--chunk-size", "32", "--max-steps", "2", "--threads", "1", "--text", source.__file__,
                           "--output-dir", str(tmp_path), "--compare-memory"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'loss'" in proc.stdout and "peak RSS" in proc.stdout  # the Trainer's logs, then the table
    runs = {r["trainer"]: r for r in json.loads((tmp_path / "memory.json").read_text())["runs"]}
    assert set(runs) == {"stock", "seco"} and runs["seco"]["seq_len"] == 128
    # the same batches and the exact gradient: the same training loss up to float32 rounding
    assert runs["seco"]["train_loss"] == pytest.approx(runs["stock"]["train_loss"], rel=1e-4)
    assert (tmp_path / "seco" / "adapter" / "adapter_config.json").is_file()


def test_spaco_mode_with_a_cap_uses_it_as_the_cli_does(tmp_path):
    """SeCOArguments.cap (the CLI's --cap): paper-capped with C = 3 at k/t = 4 scales hops by 3, not the default 2;
    the trainer's gradient equals spaco_grad's with the same scheme value.  A cap without a capped scheme, or with
    mode='seco', is refused."""
    from seco_lab import get_scheme

    examples = padded_examples(2, seed=5, lengths=(32, 33))  # 8 chunks of 4, t = 2: k/t = 4 > C
    batch = pad_collate(examples)
    tokens, targets = chunk_targets(batch)
    got = {}
    for cap in (None, 3.0):
        capture = GradCapture()
        seco = SeCOArguments(chunk_size=4, mode="spaco", scheme="paper-capped", budget=2, subset=(1, 6), cap=cap)
        make_trainer(tmp_path / str(cap), seco, examples=examples, callbacks=[capture], gradient_accumulation_steps=1,
                     max_steps=1, max_grad_norm=0.0).train()
        scheme = get_scheme("paper-capped") if cap is None else get_scheme("paper-capped", cap=cap)
        _, ref = spaco_grad(HFChunkModel(tiny_llama()), tokens, targets, 4, scheme, 2, subset=(1, 6))
        g = capture.grads[0]
        flat_got = torch.cat([g[n].reshape(-1) for n in sorted(g)])
        flat_ref = torch.cat([ref["model." + n].reshape(-1) for n in sorted(g)])
        assert float((flat_got - flat_ref).norm() / flat_ref.norm()) <= TOL
        got[cap] = flat_got
    assert float((got[3.0] - got[None]).norm() / got[None].norm()) > 1e-3  # the cap is used, not dropped
    assert "cap" not in SeCOArguments(chunk_size=4).to_dict()  # settings stored before the field compare equal
    capped = dict(chunk_size=4, mode="spaco", scheme="paper-capped", budget=2)
    assert SeCOArguments(**capped, cap=2.0).to_dict() == SeCOArguments(**capped).to_dict()  # campaign 22 SH12
    assert SeCOArguments(**capped, cap=3.0).to_dict()["cap"] == 3.0
    import json
    from fractions import Fraction

    import numpy as np
    for cap in (np.float32(3), np.int64(3), Fraction(3)):  # campaign 23 HF08/HF22/HF25: a traceback at the first save
        stored = SeCOArguments(**capped, cap=cap).to_dict()
        assert json.loads(json.dumps(stored))["cap"] == 3.0 and type(stored["cap"]) is float
    with pytest.raises(ValueError, match="has no cap"):
        SeCOArguments(chunk_size=4, mode="spaco", scheme="falling-factorial", budget=2, cap=3.0)
    with pytest.raises(ValueError, match="cap is SpaCO's"):
        SeCOArguments(chunk_size=4, cap=3.0)
