"""Campaign 15 (docs/hostile_campaign_15.md), L2: ``--resume`` compared only the ``metrics.jsonl`` record of the
checkpoint's own step with the checkpoint, so an earlier record edited by hand stayed in the run's log and loss
curve.  Every checkpoint now carries a digest of each record up to its step.  The refusals fail on 17655ed."""

import json
import math

import pytest
import torch
from helpers import FAST, copy_run

from seco_lab.cli import main
from seco_lab.training.experiment import check_history, history_digests, record_digest
from seco_lab.training.run_checks import RunDirError
from seco_lab.training.run_dir import RunDir, read_metrics, safe_load


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _write(run, records):
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))


def _resume(run, steps, capsys):
    capsys.readouterr()
    rc = main(["train", *FAST, "--steps", str(steps), "--run-dir", str(run), "--resume"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("step, key, change", [
    (1, "loss", lambda x: x + 0.25),        # an earlier step's loss edited
    (1, "grad_norm", lambda x: x * 1.000001),
    (0, "eval_loss", lambda x: x - 1.0),    # the evaluation before training
    (1, "tokens_per_s", lambda x: x * 2),   # a value no other check compares
])
def test_l2_an_earlier_record_edited_by_hand_is_refused(step, key, change, r2, tmp_path, capsys):
    run = copy_run(r2, tmp_path / "r")
    records = _records(run)
    rec = next(x for x in records if x["step"] == step)
    rec[key] = change(rec[key])
    _write(run, records)
    rc, err = _resume(run, 3, capsys)
    assert rc == 2
    assert f"the record of step {step} differs from the one the run logged" in err
    assert _records(run) == records  # nothing was trained or rewritten


def test_l2_a_gap_resumes_and_a_record_put_back_there_must_be_the_one_logged(r2, tmp_path, capsys):
    """A record deleted is a warned gap; the resumed run carries the checkpoint's digest of it on, so the genuine
    record put back later resumes (campaign 16 M2: it was refused as never logged) and a made-up one does not."""
    run = copy_run(r2, tmp_path / "r")
    records = _records(run)
    step1 = next(x for x in records if x["step"] == 1)
    _write(run, [x for x in records if x["step"] != 1])
    with pytest.warns(UserWarning, match="no record of step 1"):  # a gap: warned about, resumed
        rc, _ = _resume(run, 3, capsys)
    assert rc == 0
    assert [x["step"] for x in _records(run)] == [0, 2, 3]
    kept = _records(run)
    _write(run, sorted([*kept, {**step1, "loss": step1["loss"] + 1}], key=lambda x: x["step"]))
    rc, err = _resume(run, 4, capsys)
    assert rc == 2 and "the record of step 1 differs from the one the run logged" in err
    _write(run, sorted([*kept, step1], key=lambda x: x["step"]))  # the run's own record, put back
    rc, err = _resume(run, 4, capsys)
    assert rc == 0, err
    assert [x["step"] for x in _records(run)] == [0, 1, 2, 3, 4]


def test_l2_a_record_of_a_step_the_history_lacks_is_refused(tmp_path):
    run = RunDir(tmp_path)
    rec = {"step": 1, "loss": 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 4.0}) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(RunDirError, match="step 1 was not logged by the run"):
        check_history(run, {"step": 1, "history": torch.tensor([[0, record_digest({"step": 0, "eval_loss": 4.0})]])})


def test_l2_another_runs_history_is_refused(r2, tmp_path, capsys):
    """A seed-2 run's metrics copied over this run's, its last record replaced by this run's own (the one
    record the step-record check compares): the earlier records give it away."""
    run = copy_run(r2, tmp_path / "r")
    assert main(["train", *FAST, "--seed", "2", "--run-dir", str(tmp_path / "other")]) == 0
    mixed = [x for x in _records(tmp_path / "other") if x["step"] < 2] + [x for x in _records(run) if x["step"] == 2]
    _write(run, mixed)
    rc, err = _resume(run, 3, capsys)
    assert rc == 2 and "the records of steps 0, 1 differ" in err


def test_l2_each_checkpoint_carries_the_digests_of_the_records_up_to_its_step(r2, tmp_path, capsys):
    run = copy_run(r2, tmp_path / "r")
    rc, _ = _resume(run, 4, capsys)
    assert rc == 0
    records = read_metrics(run)
    for step in (1, 2, 3, 4):
        state = safe_load(run / "checkpoints" / f"step_{step:06d}.pt", map_location="cpu")
        assert state["history"].dtype == torch.int64
        assert [tuple(r) for r in state["history"].tolist()] == history_digests(records, step)
        assert [s for s, _ in history_digests(records, step)] == list(range(step + 1))


def test_l2_a_checkpoint_without_a_history_and_a_nan_record_pass(tmp_path):
    """Checkpoints written before they carried the history are not refused; a diverged step's NaN loss, written
    as NaN, has the digest it was logged with."""
    run = RunDir(tmp_path)
    rec = {"step": 1, "loss": math.nan, "lr": 0.1, "grad_norm": 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 4.0}) + "\n" + json.dumps(rec) + "\n")
    check_history(run, {"step": 1})
    check_history(run, {"step": 1, "history": torch.tensor([[0, record_digest({"step": 0, "eval_loss": 4.0})],
                                                            [1, record_digest(rec)]])})
    with pytest.raises(RunDirError, match="step 1 differs"):
        check_history(run, {"step": 1, "history": torch.tensor([[0, record_digest({"step": 0, "eval_loss": 4.0})],
                                                                [1, record_digest({**rec, "loss": 1.0})]])})


def test_records_logged_after_the_checkpoint_are_said_to_be_dropped(r2, tmp_path, capsys):
    """A kill between checkpoints leaves records past the newest one; the resume trains those steps again and
    drops their records -- and now says so in its start line."""
    run = copy_run(r2, tmp_path / "r")
    (run / "checkpoints" / "step_000002.pt").unlink()
    (run / "checkpoints" / "latest").write_text("step_000001.pt")
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "record of step 2, logged after that checkpoint, is dropped" in out
    assert [x["step"] for x in _records(run)] == [0, 1, 2, 3]


def test_a_deleted_step_0_record_is_a_warned_gap(r2, tmp_path, capsys):
    """Campaign 16 N1: the evaluation before training (step 0) deleted resumed without the gap warning."""
    run = copy_run(r2, tmp_path / "r")
    _write(run, [x for x in _records(run) if x["step"] != 0])
    with pytest.warns(UserWarning, match="no record of step 0"):
        rc, _ = _resume(run, 3, capsys)
    assert rc == 0


@pytest.mark.parametrize("late, words", [
    ({"step": "2"}, "has no integer 'step'"),                 # campaign 16 T1: a TypeError in truncate_metrics
    ({"loss": 1.0}, "has no integer 'step'"),                 # a KeyError there
    ([1, 2], "has no integer 'step'"),                        # a TypeError (list indices)
    ("own-step-1", "has step 1 after step 99"),               # M3: a record of the history moved past the checkpoint
])
def test_records_past_the_checkpoint_are_checked_too(late, words, r2, tmp_path, capsys):
    """The part of metrics.jsonl past the checkpoint (dropped on resume) was not checked: a damaged record there
    raised a traceback, and a record of the run's history moved there was kept out of order."""
    run = copy_run(r2, tmp_path / "r")
    (run / "checkpoints" / "step_000002.pt").unlink()
    (run / "checkpoints" / "latest").write_text("step_000001.pt")
    records = _records(run)
    if late == "own-step-1":
        late = next(x for x in records if x["step"] == 1)
        records = [x for x in records if x["step"] != 1]
    _write(run, [*records, {"step": 99, "loss": 0.5}, late])
    before = (run / "metrics.jsonl").read_text()
    rc, err = _resume(run, 3, capsys)
    assert rc == 2 and words in err and "Traceback" not in err
    assert (run / "metrics.jsonl").read_text() == before


def test_an_edited_record_of_the_checkpoints_own_step_is_not_blamed_on_the_checkpoint_alone(r2, tmp_path, capsys):
    """Campaign 17 F2: the message said only that the checkpoint was another run's."""
    run = copy_run(r2, tmp_path / "r")
    records = _records(run)
    next(x for x in records if x["step"] == 2)["loss"] += 0.5
    _write(run, records)
    rc, err = _resume(run, 3, capsys)
    assert rc == 2 and "that record of metrics.jsonl was edited (restore the file)" in err


def test_a_checkpoints_folder_that_is_a_link_is_refused_before_anything_is_pruned(r2, tmp_path, capsys):
    """Campaign 18 CK03b: a copy of a run whose checkpoints/ linked to the original's: --keep-checkpoints 1 on the
    copy deleted the original's checkpoints and moved its latest."""
    a = copy_run(r2, tmp_path / "a")
    b = copy_run(r2, tmp_path / "b")
    import shutil

    shutil.rmtree(b / "checkpoints")
    (b / "checkpoints").symlink_to(a / "checkpoints")
    before = sorted(p.name for p in (a / "checkpoints").iterdir())
    capsys.readouterr()
    rc = main(["train", *FAST, "--steps", "4", "--run-dir", str(b), "--resume", "--keep-checkpoints", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "checkpoints is a symbolic link" in err
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == before


def test_a_config_json_edited_after_the_run_is_named_as_a_possible_cause(r2, tmp_path, capsys):
    """Campaign 18 CK14b: an edited lr in config.json was blamed on the (genuine) checkpoints alone."""
    run = copy_run(r2, tmp_path / "r")
    config = json.loads((run / "config.json").read_text())
    config["lr"] = config["lr"] * 2
    (run / "config.json").write_text(json.dumps(config))
    rc, err = _resume(run, 3, capsys)
    assert rc == 2 and "config.json was edited after the run was made" in err
