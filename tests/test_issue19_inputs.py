"""Issue 19 (second reliability round): inputs that gave a silent wrong result or a raw
traceback now give the right answer or a one-line error that names the problem."""

import pytest

from seco_lab.cli import main as cli_main

FAST = ["--seq-len", "64", "--chunk-size", "32", "--steps", "2", "--warmup", "1", "--batch-size", "2",
        "--eval-batches", "1", "--no-progress", "--device", "cpu", "--d-model", "16", "--d-ff", "16",
        "--n-layers", "1", "--n-heads", "2"]


def run_cli(capsys, *args):
    try:
        rc = cli_main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------ item 8: ignored or contradictory settings


@pytest.mark.parametrize("args, message", [
    (["--warmup", "5"], "warmup=5 >= steps=2"),
    (["--data", "text", "--n-pairs", "3"], "with --data text drop --n-pairs"),
    (["--lora-r", "4"], "--lora-r applies to --lora only"),
    (["--lora-alpha", "4"], "--lora-alpha applies to --lora only"),
    (["--lora-targets", "q_proj"], "--lora-targets applies to --lora only"),
    (["--attn", "eager"], "--attn needs an HF model"),
    # tracebacks that are now one-line errors
    (["--lr", "1e300"], "lr must be <= 10.0"),
    (["--dropout", "0.1"], "model.dropout=0.1"),
])
def test_ignored_or_contradictory_settings_are_refused(tmp_path, capsys, args, message):
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, *args)
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("seco-lab train: error: ")
    assert not run.exists()


def test_the_default_warmup_beyond_steps_is_a_warning():
    from seco_lab.config import TrainConfig

    with pytest.warns(UserWarning, match="warmup=20 >= steps=2"):
        TrainConfig(steps=2).validate()


# ------------------------------------------------------------------ item 6: a checkpoint directory's tokenizer


def _byte_bpe_tokenizer(text: str):
    """A small byte-level BPE tokenizer trained here, offline, the way a checkpoint ships one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    from seco_lab.hf import build_hf_model

    root = tmp_path_factory.mktemp("ckpt")
    corpus = root / "corpus"
    corpus.mkdir()
    text = "def f(x):\n    return x + 1\n" * 40
    for i in range(40):
        (corpus / f"m{i}.py").write_text(text + f"# file {i}\n")
    model = build_hf_model("llama", {"vocab_size": 320, "hidden_size": 16, "intermediate_size": 16,
                                     "num_hidden_layers": 1})
    bare, with_tok = root / "bare", root / "with_tokenizer"
    model.save_pretrained(bare)
    model.save_pretrained(with_tok)
    tokenizer = _byte_bpe_tokenizer(text)
    tokenizer.save_pretrained(with_tok)
    return corpus, bare, with_tok, tokenizer


def test_a_checkpoint_directory_reads_text_through_its_own_tokenizer(checkpoint_dirs):
    """Before: --hf-model DIR --data text packed raw bytes as token ids (SmolLM2: eval loss 6.95 for 4.54)."""
    from seco_lab.config import TrainConfig
    from seco_lab.token_corpus import TokenCorpus, encode_text
    from seco_lab.train import build_data

    corpus, _, with_tok, tokenizer = checkpoint_dirs
    cfg = TrainConfig(data="text", hf_model=str(with_tok), text_paths=[str(corpus)], seq_len=32, chunk_size=16,
                      warmup=1, steps=2).validate()
    data = build_data(cfg)
    assert isinstance(data, TokenCorpus) and data.vocab_size == len(tokenizer)
    # the packed stream is the tokenizer's encoding of the files (plus EOS), not their bytes
    first = sorted(corpus.iterdir())[0].read_text()
    ids = encode_text(tokenizer, first)
    stream = list(data.train.flatten().tolist()) + list(data.val.flatten().tolist())
    assert any(stream[i : i + len(ids[:20])] == ids[:20] for i in range(len(stream) - 20))
    assert max(stream) < len(tokenizer) and max(stream) > 255  # merged tokens: not bytes


def test_a_checkpoint_directory_without_a_tokenizer_is_refused_for_text(tmp_path, capsys, checkpoint_dirs):
    corpus, bare, _, _ = checkpoint_dirs
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--hf-model", str(bare), "--data", "text",
                         "--text", str(corpus), "--seq-len", "32", "--chunk-size", "16", "--steps", "2",
                         "--warmup", "1", "--no-progress", "--device", "cpu")
    assert rc == 2 and "holds no tokenizer" in err and "Traceback" not in err, err
    assert not run.exists()


# ------------------------------------------------------------------ item 11 and the API tracebacks


@pytest.fixture(scope="module")
def tiny():
    import torch

    from seco_lab import TinyConfig, TinyTransformer

    model = TinyTransformer(TinyConfig(vocab_size=17, d_model=16, n_layers=2, n_heads=4, d_ff=16),
                            dtype=torch.float64)
    tok = torch.randint(0, 17, (1, 12), generator=torch.Generator().manual_seed(0))
    return model, tok, torch.roll(tok, -1, 1)


def _api_cases():
    import torch

    from seco_lab import (
        TinyConfig,
        TinyTransformer,
        get_scheme,
        hop_strata,
        make_scheme,
        seco_grad,
        seco_step,
        spaco_grad,
    )
    from seco_lab.data import KeyValueTask, TextCorpus

    cfg = TinyConfig(vocab_size=17, d_model=16, n_layers=2, n_heads=4, d_ff=16)
    return [
        # item 11: silent wrong results
        ("seco_step scale=nan", lambda m, x, y: seco_step(m, x, y, 4, scale=float("nan")), "scale must be a finite"),
        ("estimate t=3 on a 2-chunk subset", lambda m, x, y: hop_strata(m, x, y, 4, subset=(0, 2)).estimate("paper", 3),
         "does not match the drawn subset"),
        ("cap=True", lambda m, x, y: get_scheme("paper-capped", cap=True), "cap must be a finite number > 0"),
        ("seed=1.7", lambda m, x, y: TinyTransformer(cfg, seed=1.7), "seed must be an integer"),
        ("seed=True", lambda m, x, y: TinyTransformer(cfg, seed=True), "seed must be an integer"),
        ("tie_embeddings='no'", lambda m, x, y: TinyConfig(tie_embeddings="no"), "must be True or False"),
        ("HFChunkModel(TinyTransformer)", lambda m, x, y: __import__("seco_lab.hf").hf.HFChunkModel(m),
         "HFChunkModel drives a transformers causal LM"),
        ("TextCorpus(0)", lambda m, x, y: TextCorpus(0), "seq_len must be an integer >= 1"),
        ("batch('test')", lambda m, x, y: KeyValueTask(16).batch("test", 0, 2), "split must be 'train' or 'val'"),
        # tracebacks that are one-line errors now
        ("ignore_index=1.5", lambda m, x, y: seco_grad(m, x, y, 4, ignore_index=1.5), "ignore_index must be an int"),
        ("ignore_index=None", lambda m, x, y: seco_grad(m, x, y, 4, ignore_index=None), "ignore_index must be an int"),
        ("generator=-1", lambda m, x, y: spaco_grad(m, x, y, 4, "paper", 2, generator=-1),
         "generator seed must be an integer >= 0"),
        ("cap=10**400", lambda m, x, y: get_scheme("paper-capped", cap=10**400), "cap must be a finite number > 0"),
        ("make_scheme nan", lambda m, x, y: make_scheme("x", float("nan"), 1), "direct factor c_0 must be a finite"),
        ("make_scheme inf", lambda m, x, y: make_scheme("x", 1, float("inf")), "hop factor c_q must be a finite"),
        ("make_scheme str", lambda m, x, y: make_scheme("x", "2", 1), "direct factor c_0 must be a number"),
        ("make_scheme cap nan", lambda m, x, y: make_scheme("x", 1, 1, cap=float("nan")), "cap must be a finite"),
        ("norm_eps='1e-6'", lambda m, x, y: TinyConfig(norm_eps="1e-6"), "TinyConfig.norm_eps must be a number"),
        ("device='cuda'", lambda m, x, y: TinyTransformer(cfg, device="cuda"), "CUDA is not available")
        if not torch.cuda.is_available() else
        ("device='cuda:99'", lambda m, x, y: TinyTransformer(cfg, device="cuda:99"), "CUDA device"),
        ("out-of-vocabulary forward", lambda m, x, y: m(torch.tensor([[0, 99]])), "token ids must lie in [0, 17)"),
        ("TextCorpus(paths=[])", lambda m, x, y: TextCorpus(8, paths=[]), "text paths is empty"),
        ("seq_len=-5", lambda m, x, y: TextCorpus(-5), "seq_len must be an integer >= 1"),
        ("seq_len=2.5", lambda m, x, y: TextCorpus(2.5), "seq_len must be an integer"),
        ("max_bytes=0", lambda m, x, y: TextCorpus(8, max_bytes=0), "max_bytes must be an integer >= 1"),
    ]


@pytest.mark.parametrize("case", _api_cases(), ids=lambda c: c[0])
def test_api_refuses_with_a_message(tiny, case):
    _, call, message = case
    with pytest.raises((ValueError, TypeError)) as info:
        call(*tiny)
    assert message in str(info.value)


def test_build_hf_model_refuses_unknown_config_keys():
    from seco_lab.hf import build_hf_model

    with pytest.raises(ValueError, match="llama has no config field"):
        build_hf_model("llama", {"foo": 1})


def test_text_corpus_takes_one_path_as_a_string(tmp_path):
    from seco_lab.data import TextCorpus

    f = tmp_path / "a.txt"
    f.write_text("hello world " * 100)
    assert TextCorpus(8, paths=str(f)).num_bytes == TextCorpus(8, paths=[f]).num_bytes == 1200


def test_chain_weights_beyond_float_range_on_zero_strata_give_a_finite_estimate():
    """k = 256, t = 8: W(p) = 32^p overflows a float from p = 205 on; those strata are exactly zero for a
    shallow model, so the estimate is sum_p W(p) g(p) over the first ones (before: OverflowError)."""
    import torch

    from seco_lab.estimators import HopStrata

    g = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, -1.0])}]
    strata = HopStrata(torch.tensor(0.0), g + [{"w": torch.zeros(2)} for _ in range(254)], 256, None)
    got = strata.estimate("paper", 8)["w"]
    want = g[0]["w"] + g[1]["w"] * 32
    assert torch.equal(got, want)
    strata.strata[-1]["w"][0] = 1.0  # a non-zero stratum under an infinite weight: refused, not inf/NaN
    with pytest.raises(ValueError, match="non-zero stratum g\\(255\\)"):
        strata.estimate("paper", 8)


@pytest.mark.parametrize("bad", [dict(n_layers="1"), dict(n_layers=1.0), dict(seed=True)])
def test_load_cell_refuses_non_integer_coordinates(tmp_path, bad):
    from seco_lab.study import load_cell

    args = {"n_layers": 1, "num_chunks": 4, "seed": 0, **bad}
    with pytest.raises(TypeError, match="must be an integer"):
        load_cell(tmp_path, **args)
