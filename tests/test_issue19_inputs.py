"""Issue 19 (second reliability round): inputs that gave a silent wrong result or a raw
traceback now give the right answer or a one-line error that names the problem."""

import pytest
from helpers import cut_train_study
from test_cli import run_cli  # the command line in-process: exit status, stdout, stderr

FAST = ["--seq-len", "64", "--chunk-size", "32", "--steps", "2", "--warmup", "1", "--batch-size", "2",
        "--eval-batches", "1", "--no-progress", "--device", "cpu", "--d-model", "16", "--d-ff", "16",
        "--n-layers", "1", "--n-heads", "2"]


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


def test_the_default_warmup_beyond_steps_is_a_warning_shown_once(monkeypatch):
    """Shown once per process: the command line and then the Trainer validate the same configuration, which
    printed it twice."""
    import warnings

    from seco_lab import config
    from seco_lab.config import TrainConfig

    monkeypatch.setattr(config, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        TrainConfig(steps=2).validate()
        TrainConfig(steps=2).validate()
    assert [str(w.message)[:21] for w in seen] == ["warmup=20 >= steps=2:"]
    assert seen[0].category is UserWarning


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
    from seco_lab.models.hf import build_hf_model

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
    from seco_lab.data.token_corpus import TokenCorpus, encode_text
    from seco_lab.training.builders import build_data

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
    from seco_lab.data.sources import KeyValueTask, TextCorpus

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
        ("HFChunkModel(TinyTransformer)", lambda m, x, y: __import__("seco_lab.models.hf").models.hf.HFChunkModel(m),
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
    from seco_lab.models.hf import build_hf_model

    with pytest.raises(ValueError, match="llama has no config field"):
        build_hf_model("llama", {"foo": 1})


def test_text_corpus_takes_one_path_as_a_string(tmp_path):
    from seco_lab.data.sources import TextCorpus

    f = tmp_path / "a.txt"
    f.write_text("hello world " * 100)
    assert TextCorpus(8, paths=str(f)).num_bytes == TextCorpus(8, paths=[f]).num_bytes == 1200


def test_chain_weights_beyond_float_range_on_zero_strata_give_a_finite_estimate():
    """k = 256, t = 8: W(p) = 32^p overflows a float from p = 205 on; those strata are exactly zero for a
    shallow model, so the estimate is sum_p W(p) g(p) over the first ones (before: OverflowError)."""
    import torch

    from seco_lab.estimators.spaco import HopStrata

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
    from seco_lab.studies.bias import load_cell

    args = {"n_layers": 1, "num_chunks": 4, "seed": 0, **bad}
    with pytest.raises(TypeError, match="must be an integer"):
        load_cell(tmp_path, **args)


# ------------------------------------------------------------------ tracebacks of the command line


def test_a_toml_config_with_a_scalar_model_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "m.toml"
    f.write_text("model = 5\n")
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "r"), "--config", str(f))
    assert rc == 2 and "model must be a table of TinyConfig fields" in err and "Traceback" not in err


@pytest.mark.parametrize("flag, value", [("--batch-size", "100000000"), ("--vocab-size", "1000000000")])
def test_a_run_that_cannot_fit_in_memory_is_refused_up_front(tmp_path, capsys, flag, value):
    run = tmp_path / "r"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--device", "cpu", flag, value)
    assert rc == 2 and "this run needs at least" in err and "GiB of memory" in err, err
    assert not run.exists()


def test_the_memory_estimate_counts_parameters_exactly():
    """The parameter term of the estimate equals the model's own count (the rest is data and activations)."""
    from seco_lab import TinyTransformer
    from seco_lab.config import TrainConfig
    from seco_lab.training.memory_estimate import training_memory_bytes

    for model in (dict(vocab_size=50, d_model=16, n_heads=4, n_kv_heads=2, d_ff=24, n_layers=3),
                  dict(vocab_size=64, d_model=8, n_heads=2, d_ff=8, n_layers=1, tie_embeddings=True)):
        base = TrainConfig(model=model, batch_size=1, seq_len=1, chunk_size=1, warmup=0)
        bigger = TrainConfig(model={**model, "vocab_size": model["vocab_size"] + 1}, batch_size=1, seq_len=1,
                             chunk_size=1, warmup=0)
        params = TinyTransformer(base.model).num_parameters()
        data_and_activations = training_memory_bytes(base) - 4 * params * 4
        assert data_and_activations > 0
        # one more vocabulary entry: d (or 2d) more parameters, 4 copies of 4 bytes, plus one logit column
        extra = training_memory_bytes(bigger) - training_memory_bytes(base)
        per_entry = TinyTransformer(bigger.model).num_parameters() - params
        assert extra == 16 * per_entry + 3 * 1 * 1 * 4


def test_a_config_json_that_is_a_list_is_a_clear_error(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text("[1, 2]")
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", "--no-progress")
    assert rc == 2 and "not a run's settings" in err and "Traceback" not in err, err


# ------------------------------------------------------------------ item 9: binary files


def test_a_text_head_followed_by_nuls_is_skipped_as_binary(tmp_path):
    from seco_lab.data.sources import TextCorpus

    f = tmp_path / "head.txt"
    with open(f, "wb") as fh:  # 4 KiB of text, then 16 MiB of NUL bytes (sparse)
        fh.write(b"abc " * 1024)
        fh.truncate(4096 + (16 << 20))
    with pytest.raises(ValueError, match=r"1 file\(s\) skipped as binary"):
        TextCorpus(32, paths=[f])
    good = tmp_path / "good.txt"
    good.write_text("hello world\n" * 500)
    corpus = TextCorpus(32, paths=[f, good])
    assert corpus.binary_files == [f] and corpus.num_bytes == 6000  # the text file alone


def test_a_binary_text_file_is_reported_as_skipped(tmp_path, capsys):
    f = tmp_path / "blob.bin"
    f.write_bytes(bytes(range(256)) * 64)
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "r"), *FAST, "--data", "text", "--text",
                         str(f))
    assert rc == 2 and "skipped as binary" in err, err


# ------------------------------------------------------------------ item 10: plot


def _run_dir(tmp_path, metrics: str, config: dict | None = None):
    import json

    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    config = config if config is not None else {"mode": "seco", "data": "synthetic", "seq_len": 64, "chunk_size": 32}
    (run / "config.json").write_text(json.dumps(config))
    if metrics == "BINARY":
        (run / "metrics.jsonl").write_bytes(bytes(range(128, 256)) * 64)
    else:
        (run / "metrics.jsonl").write_text(metrics)
    return run


@pytest.mark.parametrize("metrics, config, out, message", [
    ("", None, "x.png", "holds no metrics yet"),
    ('{"step": 1, "loss": "high"}\n', None, "x.png", "not a number"),
    ('{"loss": 1.0}\n', None, "x.png", "no integer 'step'"),
    ('{"step": 1, "loss": 1.0}\n', {"data": "synthetic"}, "x.png", "lacks mode"),
    ('{"step": 1, "loss": 1.0}\n', None, "x.txt", "give the file a .png suffix"),
    ('{"step": 1, "loss": 1.0}\n', None, "DIR", "is a folder"),
    # campaign P19/P21/P22/P24: nothing finite to draw, steps out of order, a binary file
    ('{"step": 1, "loss": NaN}\n{"step": 2, "loss": NaN}\n', None, "x.png", "holds no finite loss"),
    ('{"step": 1, "loss": Infinity}\n{"step": 2, "loss": -Infinity}\n', None, "x.png", "holds no finite loss"),
    ('{"step": 2, "loss": 3}\n{"step": 1, "loss": 4}\n{"step": 2, "loss": 5}\n', None, "x.png",
     "has step 1 after step 2"),
    ('{"step": 1, "loss": 3}\n{"step": 1, "loss": 4}\n', None, "x.png", "has step 1 after step 1"),
    ("BINARY", None, "x.png", "metrics.jsonl is not text"),
])
def test_plot_refuses_what_it_cannot_draw_honestly(tmp_path, capsys, metrics, config, out, message):
    run = _run_dir(tmp_path, metrics, config)
    target = tmp_path if out == "DIR" else tmp_path / out
    rc, _, err = run_cli(capsys, "plot", str(run), "--out", str(target))
    assert rc == 2 and message in err and "Traceback" not in err, err
    if out != "DIR":
        assert not target.exists()


def test_plot_leaves_out_non_finite_losses_with_a_warning(tmp_path):
    from seco_lab.report.runs import plotted_metrics

    run = _run_dir(tmp_path, '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": NaN}\n{"step": 3, "loss": 1.5}\n')
    with pytest.warns(UserWarning, match="1 non-finite loss"):
        rows = plotted_metrics(run)
    assert [r.get("loss") for r in rows] == [2.0, None, 1.5]


# ------------------------------------------------------------------ item 7: incomplete results are refused

STUDY = __import__("pathlib").Path(__file__).resolve().parents[1] / "reports" / "bias_study"


@pytest.fixture
def study_copy(tmp_path):
    import shutil

    out = tmp_path / "study"
    out.mkdir()
    for f in STUDY.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out


def test_the_stored_study_loads_complete(study_copy):
    from seco_lab.report import load_bias

    study = load_bias(study_copy)
    assert len(study.cells) > 0


def _truncate(path, keep_rows):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: 1 + keep_rows]))


def _set_value(path, row, value):
    lines = path.read_text().splitlines(keepends=True)
    parts = lines[row].rstrip("\n").split(",")
    parts[-1] = value
    lines[row] = ",".join(parts) + "\n"
    path.write_text("".join(lines))


def _repeat_row(path, row, value=None):
    """Row ``row`` again right after itself (with its last field set to ``value``: a conflicting result)."""
    lines = path.read_text().splitlines(keepends=True)
    copy = lines[row] if value is None else ",".join(lines[row].rstrip("\n").split(",")[:-1] + [value]) + "\n"
    lines.insert(row + 1, copy)
    path.write_text("".join(lines))


def _keep_first_cell(path):
    """The header and every metric row of the first (L, k, seed, t, scheme) cell: a complete cell, the others lost."""
    lines = path.read_text().splitlines(keepends=True)
    cell = lambda line: line.split(",")[:5]  # noqa: E731
    path.write_text("".join([lines[0], *[ln for ln in lines[1:] if cell(ln) == cell(lines[1])]]))


def _delete_row(path, row):
    lines = path.read_text().splitlines(keepends=True)
    del lines[row]
    path.write_text("".join(lines))


@pytest.mark.parametrize("damage, message", [
    (lambda d: _keep_first_cell(d / "results.csv"), "results.csv lacks"),     # 1 cell of many
    (lambda d: _truncate(d / "checks.csv", 0), "header but no rows"),         # header only
    (lambda d: (d / "results.csv").write_text(""), "is empty"),
    (lambda d: _set_value(d / "results.csv", 1, "inf"), "holds infinity"),
    (lambda d: _set_value(d / "paper.csv", 1, "nan"), "NaN in 1 row"),
    (lambda d: _set_value(d / "groups.csv", 1, "abc"), "holds non-numbers"),
    (lambda d: (d / "study.json").write_text(""), "cannot be read as JSON"),
    (lambda d: (d / "study.json").write_text("[1, 2]"), "holds a list"),
    (lambda d: (d / "convergence.csv").write_text("garbage\x00,\n\x01\n"), "convergence.csv"),
    (lambda d: _truncate(d / "groups.csv", 3), "groups.csv lacks"),
    # campaign B12/B16/B18: a repeated row, a conflicting one, one exactness check deleted
    (lambda d: _repeat_row(d / "results.csv", 5), "results.csv holds 1 row"),
    (lambda d: _repeat_row(d / "paper.csv", 1, value="99.0"), "paper.csv holds 1 row"),
    (lambda d: _repeat_row(d / "convergence.csv", 1), "convergence.csv holds 1 row"),
    (lambda d: _delete_row(d / "checks.csv", 1), "checks.csv lacks 1 of"),
])
def test_incomplete_or_damaged_results_are_refused_naming_what_is_missing(study_copy, damage, message):
    from seco_lab.report import MissingResultsError, load_bias

    damage(study_copy)
    with pytest.raises(MissingResultsError, match=message.replace("(", r"\(")):
        load_bias(study_copy)


def test_a_check_over_no_cells_is_not_reported_as_yes():
    import pandas as pd

    from seco_lab.report.bias_summary import _verdict

    none = pd.Series([False, False])
    assert _verdict(pd.Series([True, True]), none) == "– (no cells)"
    assert _verdict(pd.Series([True, False]), pd.Series([True, True])) == "no (1/2)"


def test_report_on_a_missing_folder_says_so_not_cannot_write(tmp_path, capsys):
    from seco_lab.studies.registry import report_main

    for name in ("training", "bias"):
        rc = report_main([name, "--results", str(tmp_path / "nope"), "--out", str(tmp_path / "r.md")])
        err = capsys.readouterr().err
        assert rc == 2 and "cannot write" not in err and str(tmp_path / "nope") in err, err


# ------------------------------------------------------------------ item 7: a study verifies finished groups


def test_a_finished_group_is_done_only_while_its_tables_match_its_record(tmp_path):
    import pandas as pd

    from seco_lab.store import StudyFolder

    folder = StudyFolder(tmp_path)
    folder.open("abc")
    try:
        tables = {name: pd.DataFrame({"a": [1, 2, 3]}) for name in ("results", "checks", "groups", "convergence")}
        folder.write_cell("L1_k4_s0", {"seconds": 1.0}, tables)
        assert folder.done("L1_k4_s0")
        results = tmp_path / "cells" / "L1_k4_s0.results.csv"
        results.write_text(results.read_text() + "4\n")  # a changed table
        assert not folder.done("L1_k4_s0")
        folder.write_cell("L1_k4_s0", {"seconds": 1.0}, tables)
        results.unlink()  # a deleted table (before: "complete" from the .json alone)
        assert not folder.done("L1_k4_s0")
    finally:
        folder.close()


# ------------------------------------------------------------------ everyday use: the study's folder lock


def test_a_second_bias_study_into_the_same_folder_is_refused(tmp_path, capsys):
    from seco_lab.folder_lock import hold_lock, release_lock
    from seco_lab.studies.registry import study_main

    out = tmp_path / "study"
    out.mkdir()
    held = hold_lock(out, "bias-study", "")  # another run, holding the lock
    try:
        with pytest.raises(SystemExit) as e:
            study_main(["bias", "--quick", "--out", str(out), "--no-progress", "--jobs", "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "in use by another study run" in err and str(__import__("os").getpid()) in err
        assert not (out / "study.json").exists()  # nothing written
    finally:
        release_lock(held)


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    import subprocess
    import sys

    from seco_lab.folder_lock import LOCK_NAME, hold_lock, release_lock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_NAME).write_text(dead.stdout.strip())  # left behind by a process that died
    held = hold_lock(tmp_path, "bias-study", "")
    assert (tmp_path / LOCK_NAME).read_text() == str(__import__("os").getpid())
    release_lock(held)


# ------------------------------------------------------------------ everyday use: LoRA adapters offline


def test_saving_a_lora_adapter_makes_no_network_lookup(tmp_path, monkeypatch):
    import peft.utils.other
    import peft.utils.save_and_load

    from seco_lab.config import RunControl, TrainConfig
    from seco_lab.training.trainer import Trainer

    def no_network(*args, **kwargs):
        raise AssertionError(f"network lookup attempted: {args}")

    monkeypatch.setattr(peft.utils.save_and_load, "check_file_exists_on_hf_hub", no_network)
    monkeypatch.setattr(peft.utils.other, "check_file_exists_on_hf_hub", no_network)
    cfg = TrainConfig(mode="dense", seq_len=16, chunk_size=8, batch_size=1, steps=2, warmup=1, hf_model="llama",
                      hf_overrides={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1},
                      lora=True, lora_r=2, dtype="float32")
    trainer = Trainer(cfg, RunControl(run_dir=str(tmp_path / "run"), device="cpu", progress=False))
    trainer.prepare()
    try:
        out = trainer.save_adapter()
    finally:
        trainer.close()
    assert (out / "adapter_config.json").is_file()


# ------------------------------------------------------------------ checkpoints that cannot be written


def _state(step=4):
    import numpy as np
    import torch

    return {"step": step, "model": {"w": torch.ones(3)}, "optimizer": {}, "scheduler": {},
            "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state()}


def test_a_full_disk_during_a_checkpoint_is_an_error_and_leaves_no_tmp(tmp_path, monkeypatch):
    import errno

    import seco_lab.training.run_dir as run_dir_module
    from seco_lab.training.run_dir import RunDir, RunDirError

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"\0" * 1000)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    rd = RunDir(tmp_path / "run").open(resume=False, overwrite=False)
    try:
        monkeypatch.setattr(run_dir_module.torch, "save", full_disk)
        with pytest.raises(RunDirError, match="No space left on device"):
            rd.save_checkpoint(_state())
        assert not list(rd.checkpoints.glob("*tmp*")) and not list(rd.checkpoints.glob("step_*"))
    finally:
        rd.close()


def test_a_folder_named_latest_is_an_error_not_a_traceback(tmp_path):
    from seco_lab.training.run_dir import RunDir, RunDirError

    rd = RunDir(tmp_path / "run").open(resume=False, overwrite=False)
    try:
        (rd.checkpoints / "latest").mkdir()
        with pytest.raises(RunDirError, match="cannot save the checkpoint of step 4"):
            rd.save_checkpoint(_state())
        assert not list(rd.checkpoints.glob("*tmp*"))
    finally:
        rd.close()


# ------------------------------------------------------------------ hostile campaign: a study's --out is its own


def _user_folder(root):
    root.mkdir()
    (root / "cells").mkdir()
    files = {root / "results.csv": "mine\n", root / "notes.txt": "notes\n", root / "cells" / "L1_k4_s0.json": "m\n"}
    for f, text in files.items():
        f.write_text(text)
    return files


@pytest.mark.parametrize("fresh", [[], ["--fresh"]])
def test_a_study_never_writes_into_a_users_folder(tmp_path, capsys, fresh):
    """Campaign Y15/Y18: a folder without study.json but with results.csv was overwritten (--fresh: its cells too)."""
    from seco_lab.studies.registry import study_main

    files = _user_folder(tmp_path / "mine")
    with pytest.raises(SystemExit) as e:
        study_main(["bias", "--quick", "--out", str(tmp_path / "mine"), "--no-progress", "--jobs", "1", *fresh])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not a seco-lab study folder (no study.json)" in err and "results.csv" in err, err
    assert all(f.read_text() == text for f, text in files.items())
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["cells", "notes.txt", "results.csv"]


@pytest.mark.parametrize("out, message", [
    ("", "--out is empty"),
    (".", "the current directory"),
    ("..", "an ancestor of the current directory"),
    ("~", "a literal '~'"),
])
def test_a_study_out_that_is_no_folder_of_its_own_is_refused(tmp_path, capsys, monkeypatch, out, message):
    """Campaign Y10/Y11: --out '' wrote the study into the cwd, --out / into the filesystem root."""
    from seco_lab.studies.registry import study_main

    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "main.py").write_text("mine\n")
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as e:
        study_main(["bias", "--quick", "--out", out, "--no-progress", "--jobs", "1", "--fresh"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["main.py", "work"]


def test_the_filesystem_root_and_home_are_never_a_study_folder():
    from pathlib import Path

    from seco_lab.store import StudyFolder, StudyFolderError, check_study_out

    for path, what in ((Path("/"), "the filesystem root"), (Path.home(), "your home directory")):
        with pytest.raises(StudyFolderError, match=what):
            check_study_out(path)
        with pytest.raises(StudyFolderError, match=what):
            StudyFolder(path).check_usable()  # what open() checks before creating anything
    with pytest.raises(StudyFolderError, match="--out is empty"):
        StudyFolder("")


def test_a_damaged_study_json_is_named_not_a_traceback(tmp_path):
    from seco_lab.store import StudyFolder, StudyFolderError

    (tmp_path / "study.json").write_text("")
    with pytest.raises(StudyFolderError, match="study.json cannot be read as JSON"):
        StudyFolder(tmp_path).open("abc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.json"]


@pytest.mark.parametrize("name", ["results.csv", "study.json", "notes.txt"])
def test_a_report_never_overwrites_the_results_it_reads(study_copy, capsys, name):
    """Campaign E13: report bias --out RESULTS/results.csv replaced the study's table with Markdown."""
    from seco_lab.studies.registry import report_main

    before = {p.name: p.read_bytes() for p in study_copy.iterdir()}
    with pytest.raises(SystemExit) as e:
        report_main(["bias", "--results", str(study_copy), "--out", str(study_copy / name)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not a Markdown report" in err, err
    assert {p.name: p.read_bytes() for p in study_copy.iterdir()} == before


# ------------------------------------------------------------------ hostile campaign: --text paths


def test_a_text_file_named_twice_is_read_once(tmp_path):
    """Campaign D18/D23: a file named twice (or named and inside a named folder) was read twice, so the
    held-out split was a copy of training text."""
    from seco_lab.data.sources import TextCorpus

    (tmp_path / "ov").mkdir()
    good = tmp_path / "ov" / "good.txt"
    good.write_text("".join(f"line {i} of some text\n" for i in range(300)))
    once = TextCorpus(32, paths=[good])
    for paths in ([good, good], [tmp_path / "ov", good], [good, tmp_path / "ov" / ".." / "ov" / "good.txt"]):
        twice = TextCorpus(32, paths=paths)
        assert twice.num_bytes == once.num_bytes and twice.files == 1
        assert (twice.val == once.val).all()


def test_an_empty_text_path_is_refused(tmp_path, capsys):
    """Campaign D24: --text '' read the whole current directory."""
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "r"), *FAST, "--data", "text", "--text", "")
    assert rc == 2 and "an empty path ('') names no file" in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


def test_a_binary_file_skipped_beside_text_is_named_in_a_warning(tmp_path):
    """Campaign D22: --text good.txt --text /bin/ls dropped the binary file without a word."""
    from seco_lab.data.sources import TextCorpus

    good, blob = tmp_path / "good.txt", tmp_path / "blob.bin"
    good.write_text("hello world\n" * 500)
    blob.write_bytes(bytes(range(256)) * 64)
    with pytest.warns(UserWarning, match=r"1 text file\(s\) skipped as binary .*blob.bin"):
        corpus = TextCorpus(32, paths=[good, blob])
    assert corpus.binary_files == [blob]


# ------------------------------------------------------------------ hostile campaign: report train / report real

TRAIN_STUDY = STUDY.parent / "training_study"
REAL_STUDY = STUDY.parent / "real_study" / "k16x16"


@pytest.fixture(scope="module")
def small_train_study(tmp_path_factory):
    """The committed training study cut to its first 12 runs (fast to load; still complete)."""
    return cut_train_study(TRAIN_STUDY, tmp_path_factory.mktemp("train_small"))


@pytest.fixture
def train_copy(small_train_study, tmp_path):
    import shutil

    return shutil.copytree(small_train_study, tmp_path / "train")


def _gz_rows(path, edit):
    import pandas as pd

    df = pd.read_csv(path)
    edit(df).to_csv(path, index=False)


def test_the_small_training_study_loads(train_copy):
    from seco_lab.studies.train.report import load

    results, runs, _ = load(train_copy)
    assert len(runs) == 12 and set(results.run_id) == set(runs.run_id)


def _set_probe_cos_nan(df):
    df.loc[df.index[df.metric == "probe_cos"][0], "value"] = float("nan")
    return df


@pytest.mark.parametrize("damage, message", [
    # E16: a truncated results.csv.gz was an EOFError traceback
    (lambda d: (d / "results.csv.gz").write_bytes((d / "results.csv.gz").read_bytes()[:3000]),
     "cannot be decompressed"),
    # E17: half the runs removed from runs.csv
    (lambda d: _truncate(d / "runs.csv", 6), "runs.csv has 6 runs, but study.json records 12"),
    # E18: a NaN learning rate
    (lambda d: _set_field(d / "runs.csv", 1, 3, "nan"), "column 'lr' is empty or NaN"),
    # E19: every other results row dropped was a KeyError traceback
    (lambda d: _gz_rows(d / "results.csv.gz", lambda df: df.iloc[::2]), "lacks"),
    # E20: an empty study.json was a JSONDecodeError traceback
    (lambda d: (d / "study.json").write_text("\n"), "study.json cannot be read as JSON"),
    # E21: a NaN measurement
    (lambda d: _gz_rows(d / "results.csv.gz", _set_probe_cos_nan), "column 'value' is empty or NaN"),
    (lambda d: _gz_rows(d / "results.csv.gz", lambda df: df.iloc[[0, *range(len(df))]]), "repeats an earlier row"),
    (lambda d: (d / "runs.csv").write_text((d / "runs.csv").read_text().splitlines()[0] + "\n"), "header but no rows"),
])
def test_report_train_refuses_damaged_or_incomplete_results(train_copy, capsys, damage, message):
    _assert_report_refuses("train", train_copy, damage, message, capsys)


def _set_field(path, row, col, value):
    lines = path.read_text().splitlines(keepends=True)
    parts = lines[row].rstrip("\n").split(",")
    parts[col] = value
    lines[row] = ",".join(parts) + "\n"
    path.write_text("".join(lines))


@pytest.fixture
def real_copy(tmp_path):
    import shutil

    out = tmp_path / "real"
    out.mkdir()
    for name in ("study.json", "strata.csv", "results.csv"):
        shutil.copy(REAL_STUDY / name, out / name)
    return out


@pytest.mark.parametrize("damage, message", [
    # E23: results.csv cut mid-row was an IndexError traceback
    (lambda d: (d / "results.csv").write_bytes((d / "results.csv").read_bytes()[:1500]), "results.csv"),
    # E24: a NaN stratum norm
    (lambda d: _set_value(d / "strata.csv", 3, "nan"), "column 'norm_ratio' is empty or NaN"),
    # E25: header only
    (lambda d: _truncate(d / "results.csv", 0), "header but no rows"),
    # E26: the first 7 rows only
    (lambda d: _truncate(d / "results.csv", 7), "results.csv lacks 14 of 21 expected"),
    (lambda d: _repeat_row(d / "results.csv", 2), "repeats an earlier row"),
    (lambda d: _truncate(d / "strata.csv", 10), "strata.csv lacks 6 of 16"),
    (lambda d: (d / "study.json").write_text(""), "study.json cannot be read as JSON"),
])
def test_report_real_refuses_damaged_or_incomplete_results(real_copy, capsys, damage, message):
    _assert_report_refuses("real", real_copy, damage, message, capsys)


def _assert_report_refuses(study, results, damage, message, capsys):
    """Damage a copy of a study's results: its report exits 2 with ``message``, no traceback, and writes nothing."""
    from seco_lab.studies.registry import report_main

    damage(results)
    out = results.parent / "r.md"
    rc = report_main([study, "--results", str(results), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_report_real_renders_the_committed_study(real_copy, tmp_path):
    from seco_lab.report.real import real_report

    text = real_report(real_copy, tmp_path / "r.md").read_text()
    assert "falling-factorial" in text and "nan" not in text


# ------------------------------------------------------------------ hostile campaign: the cost of a study


@pytest.mark.parametrize("args, message", [
    (["--quick", "--draws", "10000000000"], "--draws 10,000,000,000 is above the 10,000,000 the study takes"),
    (["--quick", "--paper-draws", "10000000"], "--paper-draws 10,000,000 is above the 30,000"),
    (["--paper-draws", "30000"], "hours of worker time"),
    (["--draws", "9000000"], "above the 48 h guard"),
])
def test_a_study_beyond_the_cost_guard_is_refused_up_front(tmp_path, capsys, monkeypatch, args, message):
    """Campaign Y08: --draws 10000000000 was accepted and ran until killed."""
    import seco_lab.studies.bias.driver as driver
    from seco_lab.studies.registry import study_main

    def started(*a, **k):
        raise AssertionError("the study started")

    monkeypatch.setattr(driver, "run_study", started)
    rc = study_main(["bias", "--out", str(tmp_path / "y8"), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "y8").exists()


def test_the_cost_guard_passes_the_default_study_and_yields_to_force():
    from dataclasses import replace

    from seco_lab.studies.bias.definition import DEFAULT, QUICK
    from seco_lab.studies.bias.driver import check_cost

    assert check_cost(QUICK) < check_cost(DEFAULT) < 3600  # the studies the Makefile runs are far below the guard
    big = replace(DEFAULT, draws=10**7)
    with pytest.raises(ValueError, match="pass --force if you mean it"):
        check_cost(big)
    assert check_cost(big, force=True) > 48 * 3600


# ------------------------------------------------------------------ hostile campaign: one-line errors, not tracebacks


@pytest.mark.parametrize("args, message", [
    (["--num-chunks", "0"], "--num-chunks must be an integer >= 1, got 0"),
    (["--chunk-size", "0"], "--chunk-size must be an integer >= 1, got 0"),
    (["--num-chunks", "100000", "--chunk-size", "100000"], "beyond the 8,192-token context"),
    (["--text-file", "../../../etc/nothere"], "does not exist"),
    (["--text-file", ""], "--text-file is empty"),
    (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
])
def test_study_real_checks_its_options_before_loading_the_model(tmp_path, capsys, monkeypatch, args, message):
    """Campaign Y26-Y30: study real checked its options only inside the cells' processes (after loading the
    model and writing study.json), so each mistake was a worker's traceback."""
    import seco_lab.studies.real as real_study
    from seco_lab.studies.registry import study_main

    def started(*a, **k):
        raise AssertionError("the study started")

    monkeypatch.setattr(real_study, "run_study", started)
    rc = study_main(["real", "--out", str(tmp_path / "rr"), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "rr").exists()


def test_ctrl_c_during_a_study_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """Campaign G09: Ctrl-C during study bias --jobs 2 was a KeyboardInterrupt traceback."""
    import seco_lab.studies.bias.driver as driver
    from seco_lab.studies.registry import study_main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "run_study", interrupted)
    try:
        rc = study_main(["bias", "--quick", "--out", str(tmp_path / "s"), "--no-progress", "--jobs", "2"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped study_main (a traceback)")
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted; the cells finished so far are stored in" in err and "Traceback" not in err


def test_ctrl_c_stops_the_workers_at_once_without_a_traceback(capfd):
    """The pool's workers ignore SIGINT (the parent reports it once) and are stopped, not waited for."""
    import time

    from seco_lab.studies.runner import run_cells

    def stop(_):
        raise KeyboardInterrupt

    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_cells(time.sleep, [0.0, 60, 60, 60], jobs=2, progress=False, on_result=stop)
    assert time.perf_counter() - start < 30
    err = capfd.readouterr().err
    assert "Exception in thread" not in err and "Traceback" not in err, err


_CTRL_C_SCRIPT = """
import os, pathlib, signal, sys, threading, time
from tqdm.auto import tqdm
from seco_lab.studies.runner import run_cells

HERE = pathlib.Path(sys.argv[1])

def work(i):
    (HERE / f"started{i}").touch()
    for _ in tqdm(range(600), desc=f"cell {i}"):  # a bar, as every study's cell has
        time.sleep(0.1)
    return i

def interrupt_when_running():
    while len(list(HERE.glob("started*"))) < 2:
        time.sleep(0.05)
    os.killpg(os.getpgid(0), signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background launch ignores it)
    threading.Thread(target=interrupt_when_running, daemon=True).start()
    try:
        run_cells(work, range(4), jobs=2, progress=False)
    except KeyboardInterrupt:
        sys.exit(130)
"""


def test_ctrl_c_on_a_pool_leaks_no_semaphore(tmp_path):
    """Ctrl-C on --jobs 2 printed 'resource_tracker: There appear to be N leaked semaphore objects' at exit: the
    workers, stopped mid-cell, never released tqdm's multiprocessing write lock.  Workers now use a thread lock."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env, start_new_session=True)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "leaked semaphore" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--seed", "99999999999999999999"], "seed must be <= 9223372036854775807"),
    (["--seed", str(2**63)], "seed must be <= 9223372036854775807"),
    (["--config", "DIR"], "is a directory, not a JSON or TOML file"),
    (["--hf-model", ""], "--hf-model is empty"),
])
def test_more_train_mistakes_are_one_line_errors(tmp_path, capsys, args, message):
    """Campaign T038 (an overflow message naming no flag), C10 ('config file not found' for a directory),
    H16 (a Hub repo-id message for --hf-model '')."""
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "r"), *FAST, *args)
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


def test_the_seed_api_refuses_what_torch_cannot_take():
    from seco_lab.core.checks import check_seed

    assert check_seed(2**63 - 1) == 2**63 - 1
    with pytest.raises(ValueError, match=r"seed must be < 2\*\*63"):
        check_seed(2**63)


def test_a_huge_batch_is_refused_before_allocating(tmp_path):
    """Campaign A59: TextCorpus.batch('train', 0, 10**9) tried to allocate 7.5 GiB."""
    from seco_lab.data.sources import KeyValueTask, TextCorpus

    good = tmp_path / "good.txt"
    good.write_text("hello world\n" * 500)
    for corpus in (TextCorpus(64, paths=good), KeyValueTask(64)):
        with pytest.raises(MemoryError, match="a batch of 1,000,000,000 sequences would hold") as e:
            corpus.batch("train", 0, 10**9)
        assert "lower the batch size" in str(e.value) and "force=True" not in str(e.value)
        assert corpus.batch("train", 0, 4).tokens.shape == (4, 64)


def test_load_cell_names_a_damaged_study_json(tmp_path):
    """Campaign A65: an empty study.json was a raw JSONDecodeError naming no file."""
    from seco_lab.studies.bias.cell import load_cell

    (tmp_path / "study.json").write_text("")
    with pytest.raises(ValueError, match="study.json cannot be read as JSON"):
        load_cell(tmp_path, 1, 4, 0)
    (tmp_path / "study.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no readable study definition"):
        load_cell(tmp_path, 1, 4, 0)


def test_a_file_the_study_writes_before_its_record_does_not_make_the_folder_foreign(tmp_path):
    """The training study's extension tiers measure costs.csv before they open their folder (and keep it)."""
    from seco_lab.store import StudyFolderError
    from seco_lab.studies.train.study import study_folder

    (tmp_path / "costs.csv").write_text("arm,cpu_s\n")
    folder = study_folder(tmp_path)
    folder.open("abc")
    folder.close()
    other = tmp_path / "other"
    other.mkdir()
    (other / "runs.csv").write_text("mine\n")
    with pytest.raises(StudyFolderError, match=r"not a seco-lab study folder \(no study.json\) and holds files "
                                               r"\(runs.csv\)"):
        study_folder(other).open("abc")
    assert (other / "runs.csv").read_text() == "mine\n"


def test_hf_override_on_a_checkpoint_folder_is_refused_whatever_the_warmup(tmp_path):
    """The check sat in an ``elif`` after the warm-up warning: with the default warm-up at or beyond --steps an
    --hf-override on a checkpoint folder (which it cannot change) was silently accepted."""
    import warnings

    from seco_lab.config import TrainConfig

    for steps in (2, 100):  # warm-up 20 >= 2 (the warning's branch) and < 100
        with warnings.catch_warnings(), pytest.raises(ValueError, match="--hf-override applies to the named"):
            warnings.simplefilter("ignore")
            TrainConfig(steps=steps, hf_model=str(tmp_path), hf_overrides={"num_hidden_layers": 1}).validate()


# ------------------------------------------------------------------ campaign 3: study folders that are not this study's


def _exit_status(main, argv) -> int:
    """A command's exit status, whether it returns it or exits (argparse's error() raises SystemExit(2))."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_a_user_folder_with_its_own_study_json_is_refused_even_with_fresh(tmp_path, capsys):
    """Campaign 3, C08/C09: a user's folder holding a study.json of its own was taken for a study of another
    definition, and the advised --fresh overwrote the user's study.json and results.csv."""
    from seco_lab.studies.registry import study_main

    us = tmp_path / "us"
    us.mkdir()
    (us / "study.json").write_text('{"mine": 1}')
    (us / "results.csv").write_text("mine\n")
    for extra in ([], ["--fresh"]):
        rc = _exit_status(study_main, ["bias", "--quick", "--out", str(us), "--no-progress", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and "was not written by seco-lab" in err and "--fresh" not in err.split("error:")[-1], err
    assert (us / "study.json").read_text() == '{"mine": 1}' and (us / "results.csv").read_text() == "mine\n"
    assert sorted(p.name for p in us.iterdir()) == ["results.csv", "study.json"]


def test_another_studys_folder_is_named_and_never_discarded(tmp_path, capsys):
    """Campaign 3, C10/C16/C76: `study bias --out <a training-study folder> --fresh` replaced its study.json and
    left a mix no report could read; the message said 'fingerprint None' and advised --fresh."""
    import shutil
    from pathlib import Path

    from seco_lab.studies.registry import study_main

    root = Path(__file__).resolve().parents[1]
    ts = tmp_path / "ts"
    ts.mkdir()
    shutil.copy(root / "reports/training_study/study.json", ts / "study.json")
    before = (ts / "study.json").read_bytes()
    for extra in ([], ["--fresh"]):
        rc = _exit_status(study_main, ["bias", "--quick", "--out", str(ts), "--no-progress", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and "holds the results of the train study, not of the bias study" in err, err
    assert (ts / "study.json").read_bytes() == before and sorted(p.name for p in ts.iterdir()) == ["study.json"]


def test_fresh_deletes_only_the_cells_the_study_wrote(tmp_path):
    """Campaign 3, C07: --fresh deleted a user's cells/zz_user.json (any *.json in cells/ was taken as a cell)."""
    import json

    import pandas as pd

    from seco_lab.store import StudyFolder

    folder = StudyFolder(tmp_path / "s", study="bias", key="digest")
    folder.open("d1")
    folder.write_manifest({"digest": "d1", "study_format": 4})
    folder.write_cell("c0", {"x": 1}, {"results": pd.DataFrame({"a": [1]})})
    (folder.cells / "zz_user.json").write_text("u")
    folder.close()
    again = StudyFolder(tmp_path / "s", study="bias", key="digest")
    again.open("d2", fresh=True)
    assert [p.name for p in folder.cells.iterdir() if p.name != "checksums.sha256"] == ["zz_user.json"]
    assert (folder.cells / "zz_user.json").read_text() == "u"
    again.write_manifest({"digest": "d2", "study_format": 4})
    assert json.loads(again.manifest_path.read_text())["study"] == "bias"
    again.close()


# ------------------------------------------------------------------ round 3 (hostile review, training side)

CKPT = ["--ckpt-every", "1", "--eval-every", "1", "--warmup", "0"]


def _one_line_error(rc, err, *needles):
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("seco-lab train: error: "), err
    for needle in needles:
        assert needle in err, err


def test_a_run_whose_config_json_was_deleted_is_recovered_from_its_checkpoints(tmp_path, capsys, monkeypatch):
    """A44/A39/A43: with config.json deleted, --resume said "start it without --resume", a plain start "pass
    --overwrite", and --overwrite then deleted the checkpoints -- the run's only copy.  Now --resume continues
    from the newest checkpoint (rewriting config.json from the experiment it records) and --overwrite refuses."""
    from seco_lab import config

    monkeypatch.setattr(config, "_WARNED", set())
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, *CKPT)
    assert rc == 0, err
    saved = (run / "config.json").read_text()
    (run / "config.json").unlink()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())

    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, *CKPT)
    _one_line_error(rc, err, "holds checkpoints (steps 1, 2) but no config.json; pass --resume")
    assert "--overwrite" not in err
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, *CKPT, "--overwrite")
    _one_line_error(rc, err, "are the run's only copy of the experiment", "continue it with --resume", "yourself")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints

    with pytest.warns(UserWarning) as seen:
        rc, out, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", "--steps", "3", "--no-progress",
                               "--device", "cpu")
    assert rc == 0 and "resuming" in out and "from step 2 of 3" in out, err
    warned = [str(w.message) for w in seen if "config.json is missing" in str(w.message)]
    assert len(warned) == 1 and "checkpoint step_000002.pt" in warned[0], warned
    import json

    assert json.loads((run / "config.json").read_text()) == {**json.loads(saved), "steps": 3,
                                                             "lr_cycles": [[0, 2]]}


def test_a_run_with_no_config_json_and_no_readable_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".seco-lab-run").write_text("{}\n")
    (run / "checkpoints" / "step_000002.pt").write_bytes(b"junk")
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", "--no-progress", "--device", "cpu")
    _one_line_error(rc, err, "none of its checkpoints records the run's experiment", "restore config.json")
    assert (run / "checkpoints" / "step_000002.pt").read_bytes() == b"junk"


HF = ["--steps", "2", "--seq-len", "64", "--chunk-size", "16", "--batch-size", "2", "--warmup", "0", "--no-progress",
      "--device", "cpu", "--hf-model", "llama"]


@pytest.mark.parametrize("override, message", [
    ("num_hidden_layers=-1", "--hf-override num_hidden_layers=-1: num_hidden_layers is a size or count and must be "
                             "an integer >= 1"),
    ("num_hidden_layers=0", "num_hidden_layers=0: num_hidden_layers is a size or count"),
    ("hidden_size=-8", "hidden_size=-8: hidden_size is a size or count and must be an integer >= 1"),
    ("num_attention_heads=0", "num_attention_heads=0: num_attention_heads is a size"),
    ("intermediate_size=2.5", "intermediate_size=2.5: intermediate_size is a size or count"),
    ("vocab_size=0", "vocab_size=0: vocab_size is a size"),
    ("hidden_size=30", "hidden_size=30 must be divisible by num_attention_heads=4"),
    ("num_key_value_heads=3", "num_attention_heads=4 must be divisible by num_key_value_heads=3"),
])
def test_hf_override_sizes_are_range_checked(tmp_path, capsys, override, message):
    """B55/B54/E84/B22/B56/B57: num_hidden_layers=0 or -1 trained a model without layers (exit 0),
    hidden_size=-8 was a traceback, num_attention_heads=0 'integer division or modulo by zero'."""
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *HF, "--hf-override", override)
    _one_line_error(rc, err, message)
    assert not run.exists()


def test_build_hf_model_range_checks_its_overrides():
    """The API checks what the command line checks (both go through build_hf_model)."""
    from seco_lab.models.hf import build_hf_model

    with pytest.raises(ValueError, match="num_hidden_layers=0: num_hidden_layers is a size or count"):
        build_hf_model("llama", {"num_hidden_layers": 0})
    with pytest.raises(ValueError, match="must be divisible by num_attention_heads=3"):
        build_hf_model("qwen2", {"num_attention_heads": 3, "num_key_value_heads": 1})
    assert build_hf_model("llama", {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                                    "num_key_value_heads": 1, "intermediate_size": 8}).config.num_hidden_layers == 1


@pytest.mark.parametrize("flag", ["--steps", "--warmup", "--eval-every", "--ckpt-every", "--eval-batches",
                                  "--stop-at", "--keep-checkpoints"])
def test_step_counts_are_bounded(tmp_path, capsys, flag):
    """B04/E54: --steps 99999999999999999999 was accepted and ran (for ever)."""
    from seco_lab.config import MAX_EVAL_BATCHES, MAX_STEPS

    run = tmp_path / "run"
    bound = MAX_EVAL_BATCHES if flag == "--eval-batches" else MAX_STEPS  # validation batches per evaluation: fewer
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, flag, "99999999999999999999")
    _one_line_error(rc, err, f"{flag[2:].replace('-', '_')} must be <= {bound}, got 99999999999999999999")
    assert not run.exists()


def test_stop_at_not_past_the_resumed_step_is_refused(tmp_path, capsys):
    """A41/A42: --resume --stop-at 3 on a run at step 4 trained nothing and reported a normal stop."""
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, *CKPT, "--steps", "6", "--stop-at", "4")
    assert rc == 0, err
    before = (run / "metrics.jsonl").read_text()
    for stop in ("3", "4"):
        rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", "--stop-at", stop, "--no-progress",
                             "--device", "cpu")
        _one_line_error(rc, err, f"--stop-at {stop} is not past the run's step 4", "pass a --stop-at above 4")
    assert (run / "metrics.jsonl").read_text() == before
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc, out, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", "--stop-at", "5", "--no-progress",
                               "--device", "cpu")
    assert rc == 0 and "stopped at step 5 of 6" in out, err
    assert not [w for w in seen if "gap" in str(w.message)]  # a whole metrics.jsonl: no warning (A29/A30)


@pytest.mark.parametrize("damage, message", [
    ("delete", "metrics.jsonl is missing, so steps 0-4 have no record; resuming from the checkpoint of step 4"),
    ("cut", "metrics.jsonl has no record of steps 3-4 (cut short or edited); resuming from the checkpoint of step 4"),
])
def test_resuming_over_a_metrics_gap_warns_once(tmp_path, capsys, damage, message):
    """A29/A30: a resume whose metrics.jsonl was deleted, or ends before the checkpoint's step, left a silent gap."""
    import json

    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, *CKPT, "--steps", "6", "--stop-at", "4")
    assert rc == 0, err
    metrics = run / "metrics.jsonl"
    if damage == "delete":
        metrics.unlink()
    else:
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 2))
    with pytest.warns(UserWarning) as seen:
        rc, out, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", "--no-progress", "--device", "cpu")
    assert rc == 0 and "finished" in out, err
    gaps = [str(w.message) for w in seen if "gap" in str(w.message)]
    assert len(gaps) == 1 and message in gaps[0], gaps
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()][-2:] == [5, 6]


def test_a_lora_rank_above_the_targeted_layers_is_refused(tmp_path, capsys):
    """B26: --lora-r 100000 on 32-wide layers trained 12.8M adapter parameters that can do no more than rank 32."""
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *HF, "--lora", "--lora-r", "17")
    _one_line_error(rc, err, "--lora-r 17 is above 16, the smallest dimension of the targeted layers",
                    "(model.layers.0.self_attn.v_proj: 32 -> 16)", "pass --lora-r 16 or less")
    assert not run.exists()


@pytest.mark.parametrize("targets", ["", ",", "q_proj,,"])
def test_empty_lora_targets_are_refused_naming_the_flag(tmp_path, capsys, targets):
    """B25: --lora-targets "" gave peft's 'No `target_modules` passed but also no `target_parameters` found'."""
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *HF, "--lora", "--lora-targets", targets)
    if targets == "q_proj,,":  # empty names between commas are dropped; q_proj remains
        assert rc == 0, err
        return
    _one_line_error(rc, err, "--lora-targets '' names no module", "e.g. --lora-targets q_proj,v_proj")
    assert not run.exists()


def test_add_lora_refuses_empty_targets_and_a_rank_above_the_layers():
    from seco_lab.models.hf import add_lora, build_hf_model

    model = build_hf_model("llama", {"num_hidden_layers": 1})
    with pytest.raises(ValueError, match="names no module"):
        add_lora(model, targets=[""])
    with pytest.raises(ValueError, match="--lora-r 33 is above 32"):
        add_lora(model, r=33, targets=["q_proj"])


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_config_that_is_no_regular_file_is_named_so(tmp_path, capsys, kind):
    """B45/B46: --config /dev/zero or a FIFO said 'config file not found'."""
    import os

    if kind == "device":
        config = "/dev/zero"
    else:
        config = str(tmp_path / "fifo.toml")
        os.mkfifo(config)
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, "--config", config)
    _one_line_error(rc, err, f"config file {config} is not a regular file", "name a JSON or TOML file")
    assert not run.exists()


def test_a_config_file_setting_the_flags_contradict_names_the_file(tmp_path, capsys):
    """B42: budget = 1 in the config file with --mode seco said 'drop --budget' to a user who gave no --budget."""
    config = tmp_path / "c.toml"
    config.write_text('mode = "spaco"\nbudget = 1\n')
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, "--config", str(config), "--mode", "seco")
    _one_line_error(rc, err, "budget applies to --mode spaco only (mode is seco); drop --budget (--budget is "
                             f"`budget` in config file {config}: change it there)")
    assert not run.exists()


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_protected_run_dir_never_suggests_overwrite(tmp_path, capsys, overwrite):
    """A11: --run-dir / said 'pass --overwrite (replace it) or --resume'."""
    rc, _, err = run_cli(capsys, "train", "--run-dir", "/", *FAST, *overwrite)
    _one_line_error(rc, err, "run directory / is the filesystem root and not empty", "a directory of its own")
    assert "--overwrite" not in err


def test_overwrite_through_a_symlink_to_a_user_folder_does_not_suggest_its_target(tmp_path, capsys):
    """A06: the hint for a symlink to a user folder was 'pass --run-dir TARGET to replace that run'."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(user)
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(link), *FAST, "--overwrite")
    _one_line_error(rc, err, f"is a symlink to {user}, which is not a seco-lab run directory, so nothing is replaced")
    assert "to replace that run" not in err and (user / "notes.txt").read_text() == "mine"


def test_more_stop_signals_while_stopping_are_ignored_with_one_line(tmp_path, capfd, monkeypatch):
    """A22: three SIGINTs 20 ms apart ended in a raw KeyboardInterrupt traceback, the checkpoint not written.
    Now the first stops the run after its step and checkpoint; the others are ignored, with one line."""
    import os
    import signal

    from seco_lab.training.trainer import Trainer

    one_step = Trainer._one_step

    def step_under_signals(self, stop):
        if self.step == 0:
            for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), signum)
        return one_step(self, stop)

    monkeypatch.setattr(Trainer, "_one_step", step_under_signals)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN under a background (&) launch
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever launched the tests
    run = tmp_path / "run"
    # capfd: the handler writes to the stderr file descriptor itself
    rc, _, err = run_cli(capfd, "train", "--run-dir", str(run), *FAST, *CKPT, "--steps", "50", "--ckpt-every", "10")
    assert rc == 130 and "Traceback" not in err, err
    assert err.count("already stopping") == 1 and "already stopping (SIGINT ignored)" in err, err
    assert "interrupted; checkpoint at step 1 saved" in err
    assert (run / "checkpoints" / "step_000001.pt").is_file()
    try:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are put back
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("metric, value", [("mc_covered", 7.0), ("rel_var", -1.0), ("mc_cost", -0.5),
                                           ("noise_to_signal", -3.0)])
def test_impossible_values_in_the_bias_results_are_refused(tmp_path, metric, value):
    """Campaign 3, C36/C38/C39: a coverage of 7 ('700.0%'), a negative variance or cost went into the report."""
    import shutil
    from pathlib import Path

    import pandas as pd

    from seco_lab.report.bias_summary import load_bias
    from seco_lab.report.markdown import MissingResultsError

    root = Path(__file__).resolve().parents[1]
    folder = tmp_path / "b"
    shutil.copytree(root / "reports/bias_study", folder, ignore=shutil.ignore_patterns("cells"))
    df = pd.read_csv(folder / "results.csv")
    df.loc[df.index[df.metric == metric][0], "value"] = value
    df.to_csv(folder / "results.csv", index=False)
    with pytest.raises(MissingResultsError, match=rf"impossible value\(s\) \(e.g. {metric} = {value:g}"):
        load_bias(folder)


def test_a_training_report_on_another_studys_record_is_refused(tmp_path):
    """Campaign 3, C40: a bias study's study.json in a training-study folder gave KeyError: 'design'."""
    import shutil
    from pathlib import Path

    from seco_lab.report.markdown import MissingResultsError
    from seco_lab.studies.train.stored import load

    root = Path(__file__).resolve().parents[1]
    folder = tmp_path / "t"
    folder.mkdir()
    for name in ("results.csv.gz", "runs.csv"):
        shutil.copy(root / "reports/training_study" / name, folder / name)
    shutil.copy(root / "reports/bias_study/study.json", folder / "study.json")
    with pytest.raises(MissingResultsError, match="study.json is the bias study's, not the training study's"):
        load(folder)
    shutil.copy(root / "reports/training_study/study.json", folder / "study.json")
    load(folder)  # the training study's own record reads


@pytest.mark.parametrize("name, overrides", [
    ("llama", {}), ("qwen2", {}),
    ("llama", {"tie_word_embeddings": True, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}),
    ("qwen2", {"tie_word_embeddings": True, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}),
    ("llama", {"head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 40}),
])
def test_the_hf_parameter_count_equals_the_built_models(name, overrides):
    """The memory estimate of a named HF architecture counts its parameters exactly, without building it."""
    from seco_lab.models.hf import build_hf_model
    from seco_lab.training.memory_estimate import hf_parameter_count

    model = build_hf_model(name, overrides)
    assert hf_parameter_count(name, overrides) == sum(p.numel() for p in model.parameters())


def test_an_hf_model_that_cannot_fit_in_memory_is_refused_up_front(tmp_path, capsys):
    """Campaign 3, B61: --hf-override sizes of ~100 GB had no guard (the tiny model's path had one)."""
    run = tmp_path / "r"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--hf-model", "llama", "--hf-override",
                         "hidden_size=16384", "--hf-override", "intermediate_size=65536", "--hf-override",
                         "num_hidden_layers=8", "--hf-override", "num_attention_heads=128", "--hf-override",
                         "num_key_value_heads=128", "--steps", "2", "--seq-len", "64", "--chunk-size", "16")
    assert rc == 2 and "this run needs at least" in err and "--hf-override sizes" in err, err
    assert not run.exists()
