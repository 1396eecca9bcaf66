"""Issue 19, campaign 24 (models and integrations): a damaged ``.gguf`` file is refused in one line before
transformers reads it (F3), SeCOTrainer refuses ``torch_compile=True`` up front (F5), and token tensors on the
meta device are refused by the input checks (F7)."""

import os
import struct

import pytest
import torch

from seco_lab import TinyConfig, TinyTransformer, dense_grad, forward_loss, seco_step
from seco_lab.models import pretrained

# ------------------------------------------------------------------ F3: damaged GGUF files


def _tiny_gguf(path):
    """A small well-formed GGUF file (one float tensor) written with the ``gguf`` package."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(16 * 8, dtype=np.float32).reshape(16, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _damaged(tmp_path):
    good = _tiny_gguf(tmp_path / "good.gguf")
    rng = __import__("random").Random(0)
    noise = bytes(rng.randrange(256) for _ in range(3000))
    return {
        "random.gguf": noise,
        "magic-then-random.gguf": b"GGUF" + noise,
        "v3-then-random.gguf": b"GGUF" + struct.pack("<IQQ", 3, 5, 7) + noise,
        "truncated-header.gguf": good[:100],
        "truncated-data.gguf": good[:-200],
        "empty.gguf": b"",
    }


LOADERS = {
    "build_pretrained": lambda path, cache: pretrained.build_pretrained(path, cache=cache),
    "load_tokenizer": lambda path, cache: pretrained.load_tokenizer(path, cache=cache),
    "build_causal_lm": lambda path, cache: pretrained.build_causal_lm(path),  # the cache of $SECO_LAB_CACHE
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_damaged_gguf_file_is_refused_in_one_line_before_transformers_reads_it(tmp_path, monkeypatch, loader):
    import transformers

    def never(*a, **k):  # pragma: no cover - reached only without the check
        raise AssertionError("transformers was asked to read a damaged GGUF file")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SECO_LAB_CACHE", str(cache))
    for name, data in _damaged(tmp_path).items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError, match="is not a readable GGUF file") as e:
            LOADERS[loader](str(path), cache)
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg and "damaged or truncated" in msg, (name, msg)
    assert not any(cache.glob("*/config.json")), "nothing is cached for a damaged file"


def test_a_damaged_gguf_file_is_one_cli_error_line(tmp_path, capsys, monkeypatch):
    from seco_lab.cli import main

    monkeypatch.setenv("SECO_LAB_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(_damaged(tmp_path)["truncated-header.gguf"])
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    rc = main(["train", "--hf-model", str(path), "--data", "text", "--text", str(text), "--steps", "1", "--warmup",
               "0", "--seq-len", "16", "--chunk-size", "8", "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert rc not in (0, None)
    err = capsys.readouterr().err
    assert "is not a readable GGUF file" in err and "Traceback" not in err, err


def test_a_well_formed_gguf_file_passes_the_check(tmp_path):
    path = tmp_path / "good.gguf"
    _tiny_gguf(path)
    pretrained.check_gguf_file(path)  # no error


def test_a_gguf_path_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    if not hasattr(os, "mkfifo"):  # pragma: no cover
        pytest.skip("no FIFOs here")
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        pretrained.gguf_path(str(fifo))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        pretrained.gguf_path(str(tmp_path / "missing.gguf"))


# ------------------------------------------------------------------ F5: torch_compile with SeCOTrainer


def test_seco_trainer_refuses_torch_compile_up_front(tmp_path):
    from trainer_case import make_trainer

    from seco_lab.integrations.transformers import SeCOArguments

    with pytest.raises(ValueError, match="torch_compile") as e:
        make_trainer(tmp_path, SeCOArguments(chunk_size=4), torch_compile=True)
    msg = str(e.value)
    assert "\n" not in msg and "torch_compile=False" in msg and "TinyTransformer" not in msg


# ------------------------------------------------------------------ F7: meta-device tokens


@pytest.fixture
def tiny():
    return TinyTransformer(TinyConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_ff=32), seed=0)


@pytest.mark.parametrize("which", ["tokens", "targets"])
@pytest.mark.parametrize("call", ["seco_step", "dense_grad", "forward_loss"])
def test_meta_device_tokens_are_refused_in_one_line(tiny, which, call):
    real = torch.zeros(1, 32, dtype=torch.long)
    meta = torch.zeros(1, 32, dtype=torch.long, device="meta")
    tokens, targets = (meta, real) if which == "tokens" else (real, meta)
    run = {"seco_step": lambda: seco_step(tiny, tokens, targets, chunk_size=8),
           "dense_grad": lambda: dense_grad(tiny, tokens, targets),
           "forward_loss": lambda: forward_loss(tiny, tokens, targets)}[call]
    with pytest.raises(ValueError, match=f"{which} are on the meta device") as e:
        run()
    assert "\n" not in str(e.value)
