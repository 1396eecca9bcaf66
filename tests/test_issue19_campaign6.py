"""Issue 19, sixth hostile campaign (268 probes by a reviewer who wrote none of the fixes, on a fresh clone of
0382f31): each finding with the test of its fix.  F-numbers are the campaign's (docs/hostile_campaign_6.md)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--seq-len", "32", "--chunk-size", "8", "--steps", "2", "--warmup", "0", "--batch-size", "2",
        "--eval-batches", "1", "--eval-every", "1", "--ckpt-every", "1", "--no-progress", "--device", "cpu",
        "--d-model", "16", "--d-ff", "32", "--n-layers", "1", "--n-heads", "2"]
DEEP_JSON = "[" * 200_000 + "]" * 200_000  # 400 kB: under the 1 MiB settings limit, past Python's recursion limit


def test_f1_a_checkpoint_of_another_run_that_differs_only_in_its_schedule_is_refused(tmp_path, capsys):
    """F1: run r4 (--steps 4) and r2 (--steps 2) share every setting but the schedule length, so their
    fingerprints agree; r4's step-2 checkpoint copied over r2's resumed silently with r4's learning rates.
    Every run folder now draws a run id that its checkpoints record; another run's checkpoint is refused,
    while extending the run itself (--steps 3) still resumes."""
    r2, r4 = tmp_path / "r2", tmp_path / "r4"
    assert main(["train", *FAST, "--run-dir", str(r2)]) == 0
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(r4)]) == 0
    own = tmp_path / "own.pt"
    shutil.copy(r2 / "checkpoints/step_000002.pt", own)
    shutil.copy(r4 / "checkpoints/step_000002.pt", r2 / "checkpoints/step_000002.pt")
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(r2), "--resume"]) == 2
    assert "written by another run" in capsys.readouterr().err
    shutil.copy(own, r2 / "checkpoints/step_000002.pt")
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(r2), "--resume"]) == 0
    state = torch.load(r2 / "checkpoints/step_000003.pt", weights_only=True)
    assert isinstance(state["run_id"], str) and state["run_id"] in (r2 / ".seco-lab-run").read_text()


@pytest.mark.parametrize("where", ["config_json", "config_toml", "run_config", "study_json", "anywhere"])
def test_f2_a_file_nested_past_the_recursion_limit_is_a_one_line_error(where, tmp_path, capsys, monkeypatch):
    """F2: JSON or TOML nested 200,000 levels deep raised RecursionError with a traceback from every reader;
    the settings, run and report readers name the file, and the command line turns one from any other reader
    into a one-line error too."""
    if where == "config_json":
        (tmp_path / "c.json").write_text(DEEP_JSON)
        argv, words = ["train", *FAST, "--run-dir", str(tmp_path / "r"), "--config", str(tmp_path / "c.json")], "c.json"
    elif where == "config_toml":
        (tmp_path / "c.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000)
        argv, words = ["train", *FAST, "--run-dir", str(tmp_path / "r"), "--config", str(tmp_path / "c.toml")], "c.toml"
    elif where == "run_config":
        assert main(["train", *FAST, "--run-dir", str(tmp_path / "r")]) == 0
        (tmp_path / "r/config.json").write_text(DEEP_JSON)
        argv, words = ["plot", str(tmp_path / "r"), "--out", str(tmp_path / "p.png")], "config.json"
    elif where == "study_json":
        shutil.copytree(ROOT / "reports/bias_study", tmp_path / "b")
        (tmp_path / "b/study.json").write_text(DEEP_JSON)
        argv = ["report", "bias", "--results", str(tmp_path / "b"), "--out", str(tmp_path / "r.md")]
        words = "study.json"
    else:
        import seco_lab.cli as cli

        def deep(_argv):  # a reader of ours that parses without the checked reader
            import json

            return json.loads(DEEP_JSON)
        monkeypatch.setattr(cli, "plot_main", deep)
        argv, words = ["plot", "x"], "seco-lab plot: error"
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "nest" in err and "too deeply" in err and words in err and "Traceback" not in err


def test_f3_a_thread_count_beyond_any_machine_is_refused_before_torch_starts():
    """F3: `audit --threads 100000` crashed with SystemError while torch imported; `study real` the same."""
    from seco_lab.core.checks import MAX_THREADS
    from seco_lab.studies.audit.config import AuditConfig
    from seco_lab.studies.real_config import RealStudyConfig

    for make in (lambda n: AuditConfig(threads=n), lambda n: RealStudyConfig(threads=n).validate()):
        with pytest.raises(ValueError, match=f"at most {MAX_THREADS}"):
            make(100_000)
        make(MAX_THREADS)
    out = subprocess.run([sys.executable, "-m", "seco_lab.cli", "audit", "--quick", "--out", "o", "--threads",
                          "100000"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "at most" in out.stderr and "Traceback" not in out.stderr


def test_f4_audit_tables_only_refuses_settings_it_would_ignore(tmp_path, capsys):
    """F4: `audit --tables-only --out a --length 64 --model tiny` exited 0 and said nothing of the flags."""
    folder = tmp_path / "a"
    shutil.copytree(ROOT / "reports/audit/k128", folder, ignore=shutil.ignore_patterns("vectors"))
    assert main(["audit", "--tables-only", "--out", str(folder), "--length", "64", "--model", "tiny",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--length" in err and "--model" in err and "ignored" in err


def test_f5_trainer_arguments_refuse_spaco_settings_in_seco_mode():
    """F5: SeCOArguments(budget=4, scheme='bernoulli') trained SeCO and ignored both; `seco-lab train` refuses
    the same combination."""
    from seco_lab.integrations.trainer_args import SeCOArguments

    with pytest.raises(ValueError, match="scheme, budget are SpaCO's"):
        SeCOArguments(chunk_size=64, budget=4, scheme="bernoulli")
    with pytest.raises(ValueError, match="seed is SpaCO's"):
        SeCOArguments(chunk_size=64, seed=3)
    assert SeCOArguments(chunk_size=64, mode="spaco", budget=4, scheme="bernoulli", seed=3).budget == 4


@pytest.mark.parametrize("argv, words", [
    (["--pass1-tokens", "-5"], "--pass1-tokens"), (["--chunk-sizes", "0"], "--chunk-sizes"),
    (["--rounds", "0"], "--rounds"), (["--methods", "dense"], "invalid choice"),
    (["--schemes", "nope"], "invalid choice"), (["--no-lora", "--lora-only"], "exclude each other"),
    (["--no-time", "--no-memory"], "measures nothing"), (["--threads", "100000"], "at most"),
])
def test_f6_the_hf_benchmark_refuses_bad_arguments_before_measuring(argv, words, capsys, tmp_path):
    """F6: `python -m experiments.bench_hf` started a multi-minute benchmark on these arguments.  (--out lies under
    a file: were an argument accepted again, the run would fail at once instead of measuring.)"""
    from experiments import bench_hf

    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        bench_hf.main([*argv, "--out", str(tmp_path / "f" / "out")])
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("attr, value, words", [
    ("pass1_tokens", "abc", "pass1_tokens must be"), ("pass1_tokens", float("nan"), "pass1_tokens must be"),
    ("pass1_tokens", True, "pass1_tokens must be"), ("pass1_tokens", -3, "pass1_tokens must be"),
    ("cache_seq_dim", 1, "is not the sequence axis"), ("cache_seq_dim", 9, "is not the sequence axis"),
    ("cache_seq_dim", "x", "cache_seq_dim must be"),
])
def test_f7_a_wrong_pass1_setting_is_named(attr, value, words):
    """F7: pass1_tokens 'abc'/nan/inf or a wrong cache_seq_dim gave raw int() or split_with_sizes errors that
    did not name the attribute."""
    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel, build_hf_model

    adapter = HFChunkModel(build_hf_model("llama", dtype=torch.float64))
    setattr(adapter, attr, value)
    tok = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=words):
        seco_grad(adapter, tok, tok, 4)


@pytest.mark.parametrize("script", ["bench", "bench_hf", "bench_strata"])
def test_f8_benchmark_scripts_run_as_files(script):
    """F8: `python experiments/bench_hf.py --help` (the README names the file) raised ImportError: the scripts
    import their package's helpers relatively."""
    out = subprocess.run([sys.executable, f"experiments/{script}.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage:"), out.stderr


def test_eval_batches_beyond_any_use_are_refused(tmp_path, capsys):
    """Campaign 6 (noted, not counted): `--eval-batches 10**9` was accepted and evaluated for weeks (one past the
    bound here, so that a regression costs a minute, not weeks)."""
    from seco_lab.config import MAX_EVAL_BATCHES

    assert main(["train", *FAST, "--run-dir", str(tmp_path / "r"), "--eval-batches", str(MAX_EVAL_BATCHES + 1)]) == 2
    assert f"<= {MAX_EVAL_BATCHES}" in capsys.readouterr().err and not (tmp_path / "r").exists()
