"""Issue 19, campaign 39 (on 9be73a1): each data-loss finding of section (c) has a test here that fails on that commit.

C5 (data loss, arguable): ``train --lora --overwrite`` of a run saved before the adapter digests (its marker without
``adapter_files``) deleted notes appended to ``adapter/README.md``; C6: a plain rerun of a study or an audit replaced a
results table the user edited (the folder's checksums already showed it); C7: a rerun wrote over a generated report
to which the user appended notes."""

from __future__ import annotations

import json

import pytest

from seco_lab.cli import main

NOTES = "\n## My notes\nTrained for the ACL paper; keep.\n"


@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
def test_c5_a_lora_run_saved_before_the_adapter_digests_keeps_its_adapter_folder(tmp_path, capsys, option):
    """Campaign 39 C5: a LoRA run whose marker records no adapter_files (saved by a seco-lab before campaign 38 B8)
    fell back to content checks, which a README.md with notes appended under peft's front matter passes:
    --overwrite deleted the notes.  Nothing proves such files the run's: --overwrite and a LoRA --resume refuse."""
    from test_issue19_campaign30 import _lora_flags

    run = tmp_path / "r"
    assert main(["train", *_lora_flags(), "--run-dir", str(run)]) == 0
    marker = run / ".seco-lab-run"
    record = json.loads(marker.read_text())
    del record["adapter_files"]  # as an older seco-lab wrote it
    marker.write_text(json.dumps(record) + "\n")
    readme = run / "adapter" / "README.md"
    readme.write_text(readme.read_text() + NOTES)
    content = readme.read_bytes()
    capsys.readouterr()
    flags = _lora_flags("--steps", "3") if option == "--resume" else _lora_flags()
    assert main(["train", *flags, "--run-dir", str(run), option]) == 2
    err = capsys.readouterr().err
    assert f"{option}: {run} is a LoRA run saved by a seco-lab that predates adapter digests" in err
    assert f"move or delete {run / 'adapter'} yourself" in err and len(err.strip().splitlines()) == 1
    assert readme.read_bytes() == content
    for path in run.joinpath("adapter").iterdir():  # and once the user moved adapter/ away, the run is usable
        path.unlink()
    run.joinpath("adapter").rmdir()
    assert main(["train", *flags, "--run-dir", str(run), option]) == 0
    assert "adapter_files" in json.loads(marker.read_text())
