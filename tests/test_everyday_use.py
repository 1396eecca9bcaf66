"""Everyday use (issue 19): help and refusals without importing torch, help texts that say
what a flag does, a human-readable start and end of a training run."""

import subprocess
import sys

import pytest

from seco_lab.cli import end_summary
from seco_lab.cli import main as cli_main

HEAVY = ("torch", "pandas", "scipy")  # each costs a second or more to import


def _imports_torch(*args) -> tuple[bool, str]:
    """Whether the command imported torch, pandas or scipy (and what it printed)."""
    code = ("import sys\nfrom seco_lab.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    return proc.stdout.strip().endswith("HEAVY []") is False, proc.stdout + proc.stderr


@pytest.mark.parametrize("args", [
    ["--help"],
    ["train", "--help"],
    ["train", "--lr", "x"],           # argparse refusal
    ["train", "--lr", "-1"],          # range refusal
    ["train", "--chunk-sise", "3"],   # misspelt flag
    ["train", "--lora-r", "4"],       # contradictory settings
    ["trian"],                        # misspelt command
    ["report", "--help"],             # 3.7 s before (the report modules imported first)
    ["report", "nope"],               # unknown report
    *([*c, "--help"] for c in (["study", "bias"], ["study", "train"], ["study", "real"], ["study", "audit"],
                               ["bias-study"], ["audit"])),  # 3-5 s each before (issue 19, campaign 5 T1)
    ["study", "bias", "--draws", "x"],
    ["audit", "--budgets", "x"],
    ["audit", "--stages", "nope"],
    # 3-4 s each before (campaign 7, T1): refusals that look at a path or at the audit's settings
    ["plot", "r", "--out", "x.txt"], ["plot", "r", "--out", "."], ["report", "bias", "--out", "."],
    ["report", "bias", "--quick", "--results", "x", "--out", "y.md"], ["audit", "--length", "-5", "--out", "o"],
    ["audit", "--quick", "--threads", "0"], ["audit", "--tables-only", "--length", "64", "--out", "o"],
    ["audit", "--report", ".", "--out", "o"],
])
def test_help_and_refusals_do_not_import_torch(args):
    """torch, pandas and scipy cost seconds to import: --help and every refusal of bad input come before them."""
    imported, out = _imports_torch(*args)
    assert not imported, out


def test_no_progress_help_says_it_turns_the_bar_off(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-progress no progress bar" in text


def test_end_summary_names_the_steps_losses_and_files():
    line = end_summary("runs/x", 2, 5, 5, {"loss": 1.25, "eval_loss": 1.5, "step": 5}, 3.0)
    assert "finished: steps 2->5 in 3.0 s" in line and "loss 1.2500" in line and "eval loss 1.5000" in line
    assert "runs/x/metrics.jsonl" in line
    early = end_summary("runs/x", 0, 3, 5, {"loss": 1.0}, 1.0)
    assert "stopped at step 3 of 5" in early and "--resume" in early


def test_end_summary_says_when_no_curve_was_drawn():
    """Campaign 16 M3: the end line named loss.png after the warning that the curve was not drawn."""
    line = end_summary("runs/x", 0, 3, 5, {"loss": 1.0}, 1.0, drawn=False)
    assert "no curve drawn" in line and "loss.png" not in line
