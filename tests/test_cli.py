"""The ``seco-lab`` command: bad input is refused before anything is created, help and
suggestions, resume from the run directory alone, Ctrl-C, plotting, the text corpus."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from seco_lab.cli import main as cli_main
from seco_lab.cli import resolve_train_config
from seco_lab.data.sources import TextCorpus, read_text_bytes
from seco_lab.report.runs import runs_figure
from seco_lab.training.run_dir import read_metrics

RUN = ["--seq-len", "40", "--chunk-size", "8", "--batch-size", "2", "--eval-batches", "1", "--no-progress",
       "--device", "cpu"]
SMALL = [*RUN, "--d-model", "16", "--d-ff", "16", "--n-layers", "1", "--n-heads", "2"]


def run_cli(capsys, *args):
    try:
        rc = cli_main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lr", "inf"], "lr must be finite, got inf"),
        (["--lr", "0"], "lr must be > 0"),
        (["--min-lr-ratio", "nan"], "min_lr_ratio must be finite"),
        (["--min-lr-ratio", "-5"], "min_lr_ratio must be >= 0.0"),
        (["--min-lr-ratio", "1.5"], "min_lr_ratio must be <= 1.0"),
        (["--clip", "nan"], "clip must be finite"),
        (["--clip", "-1"], "clip must be >= 0.0"),
        (["--warmup", "-3"], "warmup must be >= 0"),
        (["--seed", "-1"], "seed must be >= 0"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "CUDA"),
        (["--device", "banana"], "unknown device 'banana'"),
        (["--text", "{tiny}"], "only read with --data text"),
        (["--scheme", "paper"], "--scheme applies to --mode spaco only"),
        (["--mode", "seco", "--scheme", "falling-factorial"], "--scheme applies to --mode spaco only"),
        (["--mode", "dense", "--budget", "3"], "budget applies to --mode spaco only"),
        (["--mode", "seco", "--cap", "2"], "cap applies to --mode spaco only"),
        (["--mode", "spaco", "--scheme", "paper-capped", "--cap", "inf"], "cap must be finite"),
        (["--hf-override", "hidden_size=64"], "--hf-override needs an HF model"),
        (["--hf-model", "llama", "--hf-override", "bogus_field=3"], "llama has no config field(s) bogus_field"),
        (["--hf-model", "llama", "--hf-override", "hidden_size=abc"], "--hf-override"),
        (["--hf-model", "llama", "--hf-override", "max_position_embeddings=16"], "max_position_embeddings 16 < "),
        (["--hf-model", "llama", "--d-model", "8"], "with --hf-model use --hf-override"),
        (["--lora"], "--lora needs an HF model"),
        (["--mode", "sparse"], "invalid choice: 'sparse'"),
        (["--mode", "spaco", "--scheme", "nope"], "invalid choice: 'nope'"),
        (["--mode", "spaco", "--budget", "9"], "budget t=9 must lie in [1, k]"),
        (["--data", "text", "--text", "/no/such/path"], "text path(s) not found"),
        (["--data", "text", "--text", "/dev/zero"], "not a regular file or folder"),
        (["--data", "text", "--text", "{tiny}", "--seq-len", "4096"], "too few for sequences of 4096"),
        (["--config", "/no/such.json"], "config file not found"),
        (["--resume"], "holds no run"),
        (["--resume", "--overwrite"], "exclude each other"),
        (["--stop-at", "9", "--steps", "3"], "stop_at=9 must lie in [1, steps=3]"),
    ],
)
def test_bad_input_is_a_clear_error_and_creates_nothing(tmp_path, capsys, args, message):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 500)
    args = [a.replace("{tiny}", str(tiny)) for a in args]
    run = tmp_path / "bad"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *(RUN if "--hf-model" in args else SMALL), *args)
    assert rc == 2
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("seco-lab train: error: ")
    assert not run.exists()  # validated before anything was created


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps = 2.7\n", "steps must be int, got 2.7"),
        ("lr = \"fast\"\n", "lr must be float"),
        ("bogus = 1\n", "unknown key(s) bogus"),
        ("[model]\nd_model = \"wide\"\n", "d_model must be int"),
        ("steps = \n", "cannot parse"),
    ],
)
def test_config_file_errors_name_the_file(tmp_path, capsys, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "r"), "--config", str(f))
    assert rc == 2 and message in err and str(f) in err
    assert not (tmp_path / "r").exists()


def test_run_dir_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("")
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(f), *SMALL)
    assert rc == 2 and "is a file" in err


def test_config_file_and_flags_merge_into_typed_configs(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('mode = "spaco"\nscheme = "paper"\nbudget = 3\n[model]\nd_model = 32\n')
    cfg, run = resolve_train_config({"config": f, "budget": 2, "model.n_layers": 3, "run_dir": "x"})
    assert (cfg.mode, cfg.scheme, cfg.budget, cfg.model.d_model, cfg.model.n_layers) == ("spaco", "paper", 2, 32, 3)
    assert run.run_dir == "x" and not hasattr(cfg, "run_dir")


def test_help_is_grouped_and_a_typo_gets_a_suggestion(capsys):
    rc, out, _ = run_cli(capsys, "train", "--help")
    assert rc == 0
    for group in ("model:", "data:", "estimator:", "optimisation:", "run control:", "HF:", "distributed:"):
        assert group in out
    assert "MODEL." not in out and "(default: 0.003)" in out
    rc, _, err = run_cli(capsys, "train", "--chunk-sise", "4")
    assert rc == 2 and "did you mean --chunk-size?" in err
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and "chunk-wise long-context training" in out
    rc, _, err = run_cli(capsys, "trian")
    assert rc == 2 and "did you mean train?" in err
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.startswith("seco-lab ")


def test_resume_needs_only_the_run_dir_and_compares_the_experiment(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["train", "--run-dir", "ref", *SMALL, "--steps", "2", "--lr", "0.01"]
    rc, out, _ = run_cli(capsys, *base)
    assert rc == 0
    assert "tiny transformer" in out and "trainable" in out and "80 tokens per step" in out and "k=5" in out
    before = (tmp_path / "ref" / "metrics.jsonl").read_text()
    rc, _, err = run_cli(capsys, *base)
    assert rc == 2 and "pass --overwrite" in err
    # another spelling of the directory and of the device: the same run
    rc, out, _ = run_cli(capsys, "train", "--run-dir", str(tmp_path / "ref"), "--resume", "--device", "cpu:0")
    assert rc == 0 and "already complete at step 2" in out
    rc, _, err = run_cli(capsys, "train", "--run-dir", "./ref", "--resume", "--lr", "0.5")
    assert rc == 2 and "config differs" in err and "lr (0.01 -> 0.5)" in err
    assert (tmp_path / "ref" / "metrics.jsonl").read_text() == before
    rc, _, _ = run_cli(capsys, "train", "--run-dir", "./ref", "--resume", "--steps", "3", "--no-progress")
    assert rc == 0  # a finished run extended
    assert [r["step"] for r in read_metrics(tmp_path / "ref") if "loss" in r] == [1, 2, 3]
    assert json.loads((tmp_path / "ref" / "config.json").read_text())["steps"] == 3


def test_text_training_via_cli_and_plot_of_several_runs(tmp_path, capsys):
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    runs = []
    for mode in ("seco", "spaco"):
        run = tmp_path / mode
        extra = ["--scheme", "bernoulli", "--budget", "2"] if mode == "spaco" else []
        rc, _, err = run_cli(capsys, "train", "--data", "text", "--text", str(text), "--run-dir", str(run),
                             "--mode", mode, *extra, *SMALL, "--seq-len", "64", "--chunk-size", "16", "--steps", "3",
                             "--eval-every", "3")
        assert rc == 0, err
        saved = json.loads((run / "config.json").read_text())
        assert saved["mode"] == mode and saved["text_paths"] == [str(text)] and saved["model"]["vocab_size"] == 256
        assert len([r for r in read_metrics(run) if "loss" in r]) == 3
        runs.append(run)
    fig = runs_figure(runs)
    (ax,) = fig.axes
    assert len(ax.lines) == 4 and len(ax.get_legend().get_texts()) == 2  # a train line + eval dots per run
    out = tmp_path / "both.png"
    rc, _, _ = run_cli(capsys, "plot", *map(str, runs), "--out", str(out))
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = run_cli(capsys, "plot", str(tmp_path / "nothing"))
    assert rc == 2 and "not a run directory" in err
    (tmp_path / "link").symlink_to(runs[0])  # one run named twice (campaign 16: drawn twice, under two labels)
    for again in (runs[0], tmp_path / "link"):
        rc, _, err = run_cli(capsys, "plot", str(runs[0]), str(again), "--out", str(tmp_path / "twice.png"))
        assert rc == 2 and ("named twice" in err or "are the same run" in err) and "name each run once" in err
    assert not (tmp_path / "twice.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_ctrl_c_and_sigterm_checkpoint_plot_and_exit_non_zero(tmp_path, signum, status):
    run = tmp_path / "int"
    # SIGHUP as a terminal sends it: not ignored, even where the suite itself runs under nohup
    proc = subprocess.Popen([sys.executable, "-m", "seco_lab.cli", "train", "--run-dir", str(run), *SMALL,
                             "--steps", "100000", "--ckpt-every", "100000", "--eval-every", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    metrics = run / "metrics.jsonl"
    # the step-0 evaluation is logged after the handlers are installed: from then on a signal is caught,
    # whatever the machine's load (the signal then lands in some step >= 1, which the run finishes)
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.1)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == status, err
    assert "Traceback" not in err and "interrupted; checkpoint at step" in err
    step = int(err.split("checkpoint at step ")[1].split()[0])
    assert step >= 1
    assert (run / "checkpoints" / "latest").read_text() == f"step_{step:06d}.pt"
    assert (run / "loss.png").exists()
    assert max(r["step"] for r in read_metrics(run)) == step


def test_text_corpus_refuses_a_fifo_and_streams_a_huge_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        TextCorpus(32, paths=[fifo])
    folder = tmp_path / "with_fifo"
    folder.mkdir()
    os.mkfifo(folder / "pipe")
    (folder / "a.txt").write_text("hello world\n" * 100)
    assert TextCorpus(32, paths=[folder]).files == 1  # a FIFO inside a folder is skipped, never opened
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:  # 6 GB, sparse: text at the start, then zeros
        f.write(b"abc " * 1024)
        f.truncate(6 << 30)
    corpus = TextCorpus(32, paths=[huge], max_bytes=3000)
    assert corpus.num_bytes == 3000


def test_streamed_reading_equals_reading_whole_files(tmp_path):
    rng = np.random.default_rng(0)
    files = []
    for i, size in enumerate([100, 5000, 3, 9000, 4096]):
        f = tmp_path / f"f{i}.txt"
        data = bytearray(rng.integers(1, 256, size, dtype=np.uint8).tobytes())
        if i == 1:
            data[10] = 0  # a binary file: skipped
        f.write_bytes(bytes(data))
        files.append(f)
    for budget in (50, 100, 4000, 14000, 10**6):
        # the former rule, independently: whole files, skip a NUL in the first 4 KiB, cut the join at the budget
        whole = [f.read_bytes() for f in files]
        expect, total = [], 0
        for d in whole:
            if b"\0" in d[:4096]:
                continue
            expect.append(d)
            total += len(d)
            if total >= budget:
                break
        assert read_text_bytes(files, budget) == b"".join(expect)[:budget], budget


def test_hf_run_records_the_hf_model_and_prints_the_trainable_count(tmp_path, capsys):
    run = tmp_path / "hf"
    rc, out, err = run_cli(capsys, "train", "--run-dir", str(run), *RUN, "--steps", "1", "--hf-model", "llama",
                           "--hf-override", "hidden_size=16", "--hf-override", "intermediate_size=16", "--lora",
                           "--lora-r", "2", "--mode", "dense")
    assert rc == 0, err
    saved = json.loads((run / "config.json").read_text())["model"]
    assert saved["hf_model"] == "llama" and saved["config"]["hidden_size"] == 16 and "d_model" not in saved
    head = out.splitlines()[0]
    total, trainable = (int(x.replace(",", "")) for x in head.split(", ")[1].replace(" parameters (", " ").split()[:2])
    assert "HF llama + LoRA" in head and 0 < trainable < total


def test_tensorboard_logging_or_a_clear_error(tmp_path, capsys):
    import importlib.util

    run = tmp_path / "tb"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *SMALL, "--steps", "1", "--tensorboard")
    if importlib.util.find_spec("tensorboard") is None:
        assert rc == 2 and "needs the tensorboard package" in err and not run.exists()
    else:
        assert rc == 0 and any((run / "tensorboard").iterdir())
