"""The small training problem the Trainer-integration tests share (also run by the 2-process worker).

A random-weight 2-layer HF Llama in float64 with ``eager_exact`` attention, variable-length
examples with prompt tokens masked to -100, right-padded by :func:`pad_collate`.  The stock
Trainer's loss goes through ``float64_causal_loss`` (transformers' ``ForCausalLMLoss`` casts
the logits to float32, which would hide float64 agreement).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer
from seco_lab.models.hf import add_lora, build_hf_model
from seco_lab.training.launch import leave_process_group

VOCAB = 64
PAD = 0


def float64_causal_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                        **kwargs):
    """transformers' ForCausalLMLoss without its cast to float32."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum" if num_items_in_batch is not None else "mean")
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def tiny_llama(lora: bool = False, dtype=torch.float64, attn: str = "eager_exact", seed: int = 0):
    model = build_hf_model("llama", attn_implementation=attn, dtype=dtype, seed=seed)
    model.loss_function = float64_causal_loss
    if lora:
        torch.manual_seed(seed + 1)
        # random B (peft's default B = 0 would make every gradient of A vanish)
        model = add_lora(model, r=4, alpha=8, init_lora_weights=False).to(dtype)
    return model


def padded_examples(n: int = 8, seed: int = 0, lengths=(9, 19), prompt: int = 3) -> list[dict]:
    """n examples of random length in [lengths); the first ``prompt`` labels are -100."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def pad_collate(rows: list[dict]) -> dict:
    """Right padding: pad ids, labels -100 and attention_mask 0 after each row's end."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def training_args(out, **overrides) -> TrainingArguments:
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=1e-2, max_grad_norm=0.05, lr_scheduler_type="constant", use_cpu=True, report_to=[],
              save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0,
              ddp_timeout=60)
    kw.update(overrides)
    return TrainingArguments(**kw)


def make_trainer(out, seco: SeCOArguments | None = None, lora: bool = False, examples=None, model=None,
                 callbacks=None, **overrides):
    """A stock Trainer (``seco=None``) or a SeCOTrainer on the shared problem."""
    model = model if model is not None else tiny_llama(lora=lora)
    kw = dict(model=model, args=training_args(out, **overrides), train_dataset=examples or padded_examples(),
              data_collator=pad_collate, callbacks=callbacks)
    return Trainer(**kw) if seco is None else SeCOTrainer(seco_args=seco, **{**kw, "model": for_seco(model)})


def for_seco(model):
    """``model`` without the float64 loss function :func:`tiny_llama` sets for the stock Trainer: SeCOTrainer
    refuses a loss function it would not call, and computes the cross-entropy in the model's dtype itself."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.__dict__.pop("_loss_function", None)
    return model


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def displacement_error(a: dict, a0: dict, b: dict, b0: dict) -> float:
    """||(a - a0) - (b - b0)|| / ||b - b0|| over all trainable parameters (b: the reference run)."""
    da = torch.cat([(a[n] - a0[n]).reshape(-1) for n in sorted(b)])
    db = torch.cat([(b[n] - b0[n]).reshape(-1) for n in sorted(b)])
    return float((da - db).norm() / db.norm())


if __name__ == "__main__":  # the 2-process worker: python -m torch.distributed.run ... trainer_case.py OUT KIND
    import torch.distributed as dist

    torch.set_num_threads(1)
    out, kind = sys.argv[1], sys.argv[2]
    seco = SeCOArguments(chunk_size=4) if kind == "seco" else None
    trainer = make_trainer(out, seco=seco, per_device_train_batch_size=1)
    calls = {"ddp": 0}

    def counting_hook(state, bucket):
        calls["ddp"] += 1
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(dist.group.WORLD, bucket)

    from transformers import TrainerCallback

    class HookDDP(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            wrapped = trainer.model_wrapped
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and not calls.get("hooked"):
                wrapped.register_comm_hook(None, counting_hook)
                calls["hooked"] = 1

    trainer.add_callback(HookDDP)
    before = trainable_state(trainer.model)
    trainer.train()
    if dist.get_rank() == 0:
        torch.save({"before": before, "after": trainable_state(trainer.model), "ddp_hook_calls": calls["ddp"],
                    "seco_allreduce_calls": getattr(trainer, "seco_allreduce_calls", 0),
                    "world": dist.get_world_size(), "log": trainer.state.log_history}, f"{out}/result.pt")
    leave_process_group(0)  # every rank done, the group destroyed, no interpreter teardown (see its docstring)
