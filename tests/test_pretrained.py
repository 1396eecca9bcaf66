"""The real pretrained SmolLM2-135M (GGUF, dequantized) and tokenized text, float64 exactness on real text.

Marked ``real``: the first run on a fresh machine reads the GGUF file (~45 s) and
caches the dequantized weights (see seco_lab.models.pretrained); later runs load them in seconds.
"""

import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from seco_lab import flatten, hop_strata, seco_grad
from seco_lab.data.token_corpus import TokenCorpus, file_tokens, held_out
from seco_lab.models.hf import HFChunkModel, add_lora
from seco_lab.models.pretrained import build_pretrained, gguf_path, load_tokenizer

pytestmark = pytest.mark.real
TOL = 1e-10
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def text(tokenizer):
    """257 tokens of the standard library's argparse.py: 256 inputs and their next-token targets."""
    return file_tokens(tokenizer, STDLIB / "argparse.py", 257)


def hf_loss_grads(model, ids):
    """HF's own forward and backward under its labels convention: logits[:, i] predicts ids[:, i + 1], mean
    over the n - 1 predictions -- the chunk engines' (tokens, targets) = (ids[:-1], ids[1:]).  The loss is
    taken here in float64: ``model(ids, labels=ids).loss`` casts the logits to float32 (~1e-5 off)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    logits = model(input_ids=ids[None]).logits[0, :-1]
    loss = F.cross_entropy(logits, ids[1:])
    grads = torch.autograd.grad(loss, [p for _, p in params])
    return loss.detach(), {"model." + n: g for (n, _), g in zip(params, grads)}


def test_named_model_and_bad_paths():
    assert gguf_path("smollm2-135m").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ValueError, match="neither a known pretrained model"):
        gguf_path("smollm2-1.7b")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        gguf_path("/nonexistent/model.gguf")


def test_pretrained_model_predicts_real_python(text):
    model = build_pretrained("smollm2-135m", torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    with torch.no_grad():
        loss = float(model(input_ids=text[None], labels=text[None]).loss)
    # ln(49152) = 10.8 nats for a model that knows nothing; the pretrained model reads argparse.py's
    # opening (docstring and imports) at 2.36 nats/token
    assert loss < 3.0


def test_lora_seco_and_hop_strata_equal_hf_backward_on_real_text(text):
    model = build_pretrained("smollm2-135m", torch.float64, attn_implementation="eager_exact")
    torch.manual_seed(0)
    model = add_lora(model, r=8, alpha=16, init_lora_weights=False).double()  # B random: A gets a gradient
    adapter = HFChunkModel(model)
    ref_loss, ref = hf_loss_grads(model, text)
    loss, got = seco_grad(adapter, text[:-1], text[1:], chunk_size=32)
    assert float(abs(loss - ref_loss)) <= 1e-12 * float(ref_loss)
    assert set(got) == set(ref) and len(got) == 4 * 30
    assert rel_err(got, ref) <= TOL
    strata = hop_strata(adapter, text[:-1], text[1:], chunk_size=32)
    assert rel_err(strata.total(), ref) <= TOL
    # a pretrained LM sends a real share of its gradient through KV-cache hops
    assert strata.norms()[1] >= 0.1 * float(flatten(ref).norm())


def test_full_parameter_seco_equals_hf_backward(text):
    # every weight (the tied output head is the embedding); float64 gradients of 135M parameters
    # cost ~1 GiB each, so a short window: 2 chunks of 16 tokens (Σ_p g(p) over all parameters is
    # checked by the real study's exact-full cell; hop strata by the LoRA test above)
    model = build_pretrained("smollm2-135m", torch.float64, attn_implementation="eager_exact")
    ids = text[:33]
    _, ref = hf_loss_grads(model, ids)
    _, got = seco_grad(HFChunkModel(model), ids[:-1], ids[1:], chunk_size=16)
    assert len(got) == len(ref) == 272
    assert rel_err(got, ref) <= TOL


def test_token_corpus_is_deterministic_split_by_file_and_in_vocabulary(tokenizer):
    root = STDLIB / "json"
    make = lambda seed=0: TokenCorpus(64, tokenizer, paths=[root], holdout=0.3, max_tokens=40_000, seed=seed)  # noqa: E731
    a, b = make(), make()
    for split in ("train", "val"):
        x, y = a.batch(split, 3, 4), b.batch(split, 3, 4)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.targets, y.targets)
        assert x.tokens.shape == (4, 64) and torch.equal(x.tokens[:, 1:], x.targets[:, :-1])
    assert not torch.equal(a.batch("train", 3, 4).tokens, a.batch("train", 4, 4).tokens)
    assert not torch.equal(a.batch("train", 3, 4).tokens, make(seed=1).batch("train", 3, 4).tokens)
    # by file: disjoint, each file where its name's hash puts it, and the val stream is exactly its files' tokens
    train, val = a.split_files["train"], a.split_files["val"]
    assert train and val and not set(train) & set(val)
    assert all(held_out(n, 0.3) for n in val) and not any(held_out(n, 0.3) for n in train)
    stream = []
    for name in val:
        stream += tokenizer.encode((root / name).read_text(), add_special_tokens=False) + [tokenizer.eos_token_id]
    flat = a.val.reshape(-1).tolist()
    assert flat == stream[: len(flat)]
    for pool in (a.train, a.val):
        assert int(pool.min()) >= 0 and int(pool.max()) < len(tokenizer) == a.vocab_size


def test_token_corpus_errors_say_what_to_do(tokenizer, tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="too few for sequences of 64 tokens with a held-out split .* --seq-len"):
        TokenCorpus(64, tokenizer, paths=[tmp_path], holdout=0.5, max_tokens=1000)
    with pytest.raises(FileNotFoundError, match="not found"):
        TokenCorpus(64, tokenizer, paths=[tmp_path / "missing"])
    with pytest.raises(ValueError, match="window"):
        file_tokens(tokenizer, tmp_path / "a.py", 100)


def test_gram_metrics_equal_direct_vector_computation():
    import numpy as np

    from seco_lab import get_scheme
    from seco_lab.studies.real import gram_metrics

    rng = np.random.default_rng(0)
    S = rng.normal(size=(8, 50)) * np.geomspace(1, 1e-3, 8)[:, None]  # strata g(0..7) as rows
    g = S.sum(0)
    for name, budget in [("paper", 2), ("released", 4), ("falling-factorial", 2), ("bernoulli", 1)]:
        w = get_scheme(name).expected_weights(8, budget, 7)
        mean = w @ S
        cos = mean @ g / np.linalg.norm(mean) / np.linalg.norm(g)
        got = gram_metrics(S @ S.T, w)
        assert got["rel_bias"] == pytest.approx(np.linalg.norm(mean - g) / np.linalg.norm(g), rel=1e-12, abs=1e-15)
        assert got["direction_bias"] == pytest.approx(1 - cos, rel=1e-9, abs=1e-15)
        residual = np.linalg.norm(mean * (mean @ g) / (mean @ mean) - g) / np.linalg.norm(g)  # best scalar fit
        assert got["best_scale_residual"] == pytest.approx(residual, rel=1e-9, abs=1e-12)
