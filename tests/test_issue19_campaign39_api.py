"""Issue 19, campaign 39 (on 9be73a1), Python API: each finding has a test here that fails on that commit.

C1, C3, C4, C8 (silent-wrong): randomness that user code puts into a model's forward where no name shows it -- a
hook drawing in eval mode (MC dropout, noise), a second coin beside OPT's layerdrop coin, a private
``torch.Generator``, numpy, ``random``, a draw that starts at a later call.  The probe of
:class:`~seco_lab.models.hf.HFChunkModel` cannot prove arbitrary code deterministic; the general answer is the
comparison of every rebuilt chunk's cache with its first pass, by value and by default
(:func:`seco_lab.core.checks.check_recomputed`).  C2 (silent-wrong): a loss changed on the instance is tested in
tests/test_hf_trainer_loss_check.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers as T

from seco_lab import dense_grad, seco_grad, spaco_grad
from seco_lab.core.checks import RECOMPUTE_ENV, RecomputationError, rebuild_rounding, recompute_check
from seco_lab.models.hf import HFChunkModel, build_hf_model

GEN = torch.Generator().manual_seed(3)
CALLS = {"n": 0}


def _counted(k):
    """Noise from the k-th call of the hooked layer on (warm-up noise): the probe saw only the first calls."""
    def draw(o):
        CALLS["n"] += 1
        return o + 0.1 * torch.randn_like(o) if CALLS["n"] >= k else o
    return draw


NOISE = {  # campaign 39's probes: the hook's output given its input (every one draws, none by a name the probe reads)
    "eval: MC dropout": (True, lambda o: torch.nn.functional.dropout(o, 0.2, training=True)),
    "eval: randn_like": (True, lambda o: o + 0.1 * torch.randn_like(o)),
    "private generator: binomial": (False, lambda o: o * torch.binomial(torch.ones_like(o), torch.full_like(o, 0.9),
                                                                        generator=GEN) / 0.9),
    "private generator: one-number scale": (False, lambda o: o * (1.0 + float(torch.rand((), generator=GEN)))),
    "numpy": (False, lambda o: o + 0.1 * torch.from_numpy(np.random.randn(*o.shape)).to(o.dtype)),
    "python random coin": (False, lambda o: o * 0.0 if random.random() < 0.5 else o),
    "from the 3rd call": (False, _counted(3)),
    "from the 5th call": (False, _counted(5)),
}


def _llama64():
    """Two layers: noise in layer 0's MLP reaches layer 1's keys and values, the cache the later chunks read."""
    torch.manual_seed(0)
    return build_hf_model("llama", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 64,
                                    "max_position_embeddings": 64}).double()


@pytest.mark.parametrize("case", list(NOISE))
def test_c1_c4_c8_randomness_put_in_by_user_code_is_refused_naming_the_chunk(case):
    eval_mode, noise = NOISE[case]
    CALLS["n"] = 0
    model = _llama64()
    model.train(not eval_mode)
    model.model.layers[0].mlp.register_forward_hook(lambda mod, i, o: noise(o))
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RecomputationError, match=r"chunk \d's rebuilt cache tensor \d+ differs from its first pass .*"
                                                 r"not reproducible"):
        seco_grad(HFChunkModel(model), x, torch.roll(x, -1, 1), 16)


def test_c3_a_coin_beside_opts_layerdrop_coin_is_refused():
    torch.manual_seed(0)
    model = T.OPTForCausalLM(T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                         dropout=0.0, attention_dropout=0.0, layerdrop=0.0)).double()

    def coin(mod, i, o):
        h = o[0] if isinstance(o, tuple) else o
        h = h * 0.5 if float(torch.rand(())) < 0.5 else h
        return (h,) + tuple(o[1:]) if isinstance(o, tuple) else h

    model.model.decoder.layers[0].register_forward_hook(coin)
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    for training in (True, False):
        model.train(training)
        with pytest.raises(RecomputationError, match="differs from its first pass"):
            seco_grad(HFChunkModel(model), x, torch.roll(x, -1, 1), 16)


def test_a_deterministic_model_keeps_its_exact_gradient_under_the_default_check():
    model = HFChunkModel(_llama64())
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    _, got = seco_grad(model, x, y, 16)
    _, ref = dense_grad(model, x, y)
    assert max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_values_check_passes_the_rounding_of_low_precision_spans(dtype):
    """Pass 1 runs 512-token spans, the rebuild one chunk: their rounding differs and must stay below the allowance
    (measured on SmolLM2 in float32/float16/bfloat16: rebuild_rounding's docstring)."""
    torch.manual_seed(0)
    model = HFChunkModel(T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024)).to(dtype))
    x = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(1))
    loss, grads = seco_grad(model, x, torch.roll(x, -1, 1), 32)
    assert torch.isfinite(loss)
    eps = torch.finfo(dtype).eps
    assert rebuild_rounding(dtype) == pytest.approx(eps ** 0.5 if dtype == torch.float32 else eps)


def test_the_default_check_is_set_by_the_environment_and_a_bad_value_is_refused(monkeypatch):
    eval_mode, noise = NOISE["eval: randn_like"]
    model = _llama64().eval()
    model.model.layers[0].mlp.register_forward_hook(lambda mod, i, o: noise(o))
    x = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(RECOMPUTE_ENV, "metadata")
    seco_grad(HFChunkModel(model), x, torch.roll(x, -1, 1), 16)  # the user's choice: metadata only
    with recompute_check("values"), pytest.raises(RecomputationError):  # the block's mode wins over the environment
        seco_grad(HFChunkModel(model), x, torch.roll(x, -1, 1), 16)
    monkeypatch.setenv(RECOMPUTE_ENV, "sometimes")
    with pytest.raises(ValueError, match=rf"{RECOMPUTE_ENV}='sometimes' is not a recompute check: use one of "
                                         r"\('values', 'metadata', 'none'\)"):
        spaco_grad(HFChunkModel(model), x, torch.roll(x, -1, 1), 16, "paper", budget=1, subset=(1,))


# --------------------------------------------------------------------------- the review of the campaign-39 fixes


def test_a_rebuilt_chunk_that_differs_ends_a_cli_training_with_a_message(r2, tmp_path, monkeypatch, capsys):
    """A RecomputationError (a RuntimeError) in the CLI's training loop is a one-line error, not a traceback; a bad
    SECO_LAB_RECOMPUTE_CHECK is refused before anything starts."""
    from helpers import FAST

    import seco_lab.core.engine as engine
    from seco_lab.cli import main

    def differs(first, rebuilt, j):
        raise RecomputationError(f"chunk {j}'s rebuilt cache tensor 0 differs from its first pass")

    monkeypatch.setattr(engine, "check_recomputed", differs)
    assert main(["train", *FAST, "--mode", "seco", "--run-dir", str(tmp_path / "a")]) == 1
    assert "seco-lab train: error: chunk" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv(RECOMPUTE_ENV, "sometimes")
    assert main(["train", *FAST, "--run-dir", str(tmp_path / "b")]) == 2
    assert f"{RECOMPUTE_ENV}='sometimes' is not a recompute check" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_a_marker_listing_a_non_name_is_not_a_marker_and_gives_no_traceback(r2, tmp_path, capsys):
    import json

    from helpers import FAST, copy_run

    from seco_lab.cli import main

    run = copy_run(r2, tmp_path / "r")
    marker = run / ".seco-lab-run"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "wrote": [["adapter"]]}))
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    assert ".seco-lab-run (not a run's marker)" in capsys.readouterr().err


def test_tensor_hooks_do_not_re_probe_the_forward_but_module_hooks_do():
    """FSDP registers a tensor hook on every forward with gradients: that must not count as a new forward (the
    probe would run on every chunk); a forward hook on a module, or a global one, must."""
    model = _llama64().train()
    adapter = HFChunkModel(model)
    before = adapter._forward_signature()
    torch.zeros(2, requires_grad=True).register_hook(lambda g: g)
    assert adapter._forward_signature() == before
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert adapter._forward_signature() != before
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert adapter._forward_signature() != before
    finally:
        handle.remove()
    assert adapter._forward_signature() == before


def test_a_library_class_method_replaced_by_the_users_function_is_the_users(tmp_path, monkeypatch):
    """``LlamaForCausalLM.forward = mine`` (or a Trainer's compute_loss): the function's module is the user's."""
    import trainer_case as tc
    from transformers import Trainer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer

    def forward(self, *args, **kwargs):
        return T.LlamaForCausalLM.__mro__[1].forward(self, *args, **kwargs)

    monkeypatch.setattr(T.LlamaForCausalLM, "forward", forward)
    with pytest.raises(ValueError, match=r"a forward of your own model class \(LlamaForCausalLM\)"):
        tc.make_trainer(tmp_path, seco=SeCOArguments(chunk_size=4))
    monkeypatch.undo()
    monkeypatch.setattr(SeCOTrainer, "compute_loss", compute_loss)
    with pytest.raises(ValueError, match="compute_loss overridden in SeCOTrainer"):
        tc.make_trainer(tmp_path, seco=SeCOArguments(chunk_size=4))
