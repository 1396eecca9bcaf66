"""Run directories: one trainer at a time, recovery from torn metrics and damaged checkpoints."""

import json
import os
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from seco_lab.config import RunControl, TrainConfig
from seco_lab.training.run_dir import RunDir, RunDirError, read_metrics
from seco_lab.training.trainer import Trainer

TINY = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16, vocab_size=17)
CFG = TrainConfig(mode="seco", data="synthetic", seq_len=24, chunk_size=8, batch_size=2, steps=6, lr=1e-2, warmup=2,
                  eval_every=2, eval_batches=1, ckpt_every=2, dtype="float64", model=dict(TINY))


def run_for(tmp_path, name, **kw):
    return RunControl(run_dir=str(tmp_path / name), device="cpu", progress=False, **kw)


def final_state(trainer):
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rows = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(trainer.run_dir.path)]
    return params, rows


def same(a, b):
    return all(torch.equal(a[0][n], b[0][n]) for n in a[0]) and a[1] == b[1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    t = Trainer(CFG, run_for(tmp_path_factory.mktemp("full"), "full"))
    t.fit()
    return final_state(t)


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "seco_lab.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.mark.slow
def test_a_second_trainer_on_a_locked_run_directory_is_refused(tmp_path):
    run = run_for(tmp_path, "busy")
    first = Trainer(CFG, replace(run, stop_at=2))
    first.fit()
    holder = RunDir(run.run_dir).open(resume=True, overwrite=False)  # this process owns it, as a running trainer
    try:
        before = (tmp_path / "busy" / "metrics.jsonl").read_text()
        for flag in ("--resume", "--overwrite"):  # a real second process
            r = cli("train", "--run-dir", run.run_dir, flag, "--device", "cpu", "--no-progress")
            assert r.returncode == 2, r.stderr
            assert f"is in use by another trainer (pid {os.getpid()})" in r.stderr
            assert "Traceback" not in r.stderr
        assert (tmp_path / "busy" / "metrics.jsonl").read_text() == before
    finally:
        holder.close()
    r = cli("train", "--run-dir", run.run_dir, "--resume", "--device", "cpu", "--no-progress")
    assert r.returncode == 0, r.stderr  # free again once the owner is gone


def test_torn_last_metrics_line_is_dropped_and_resume_matches(tmp_path, uninterrupted):
    run = run_for(tmp_path, "torn")
    Trainer(CFG, replace(run, stop_at=4)).fit()
    path = tmp_path / "torn" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 5, "loss": 3.1')  # a kill in the middle of a write
    with pytest.warns(UserWarning, match="torn last line") as caught:
        t = Trainer(CFG, replace(run, resume=True))
        t.fit()
    assert same(final_state(t), uninterrupted)
    # the resume read metrics.jsonl once: every check saw the same file, and the torn line was warned about once
    assert sum("torn last line" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, uninterrupted, damage):
    run = run_for(tmp_path, damage)
    Trainer(CFG, replace(run, stop_at=4)).fit()
    ckpt = tmp_path / damage / "checkpoints" / "step_000004.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(CFG, replace(run, resume=True))
        t.prepare()
    said = [str(w.message) for w in caught]
    assert any("step_000004.pt is damaged" in m for m in said)
    assert any("resuming from step_000002.pt (step 2) instead of damaged step_000004.pt" in m for m in said)
    assert t.step == 2  # resumed from the intact step-2 checkpoint
    assert max(r["step"] for r in read_metrics(t.run_dir.path)) == 2
    t.fit()
    assert same(final_state(t), uninterrupted)


def test_a_damaged_line_inside_metrics_is_an_error_not_a_silent_drop(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(RunDirError, match="line 2 is not JSON"):
        read_metrics(d)


def test_open_refuses_a_file_and_an_occupied_directory_without_creating_anything(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        RunDir(f).open(resume=False, overwrite=False)
    occupied = tmp_path / "occ"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(RunDirError, match="is not a seco-lab run .* choose another --run-dir"):  # campaign 16 N3:
        RunDir(occupied).open(resume=False, overwrite=False)  # not "pass --overwrite", which refuses it too
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]
    with pytest.raises(RunDirError, match="holds no run"):
        RunDir(tmp_path / "none").open(resume=True, overwrite=False)
    assert not (tmp_path / "none").exists()


def test_a_run_directory_of_the_former_format_resumes(tmp_path):
    run = run_for(tmp_path, "old")
    Trainer(CFG, replace(run, stop_at=2)).fit()
    path = tmp_path / "old" / "config.json"
    old = {**json.loads(path.read_text()), "run_dir": "elsewhere", "device": "auto", "resume": False,
           "overwrite": False, "progress": True, "stop_at": None}
    path.write_text(json.dumps(old))
    t = Trainer.resume(tmp_path / "old", device="cpu", progress=False)
    t.fit()
    assert t.step == CFG.steps


def test_checkpoints_are_written_atomically_and_read_back(tmp_path):
    rd = RunDir(tmp_path / "c").open(resume=False, overwrite=False)
    state = {"step": 3, "model": {"w": torch.arange(4.0)}, "optimizer": {}, "scheduler": {}, "torch_rng": None,
             "numpy_rng": None}
    rd.save_checkpoint(state)
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["latest", "step_000003.pt"]  # no temporaries
    got = rd.load_checkpoint()
    assert got["step"] == 3 and torch.equal(got["model"]["w"], torch.arange(4.0))
    rd.close()
