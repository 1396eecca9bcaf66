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
