"""Issue 19, data loss and wrong resumes: --overwrite never deletes a user's files, --resume refuses
missing or foreign checkpoints (and loads them safely), extending a run keeps its schedule, SIGTERM
checkpoints like Ctrl-C, and checkpoint retention deletes only the run's own older checkpoints."""

import json
import os
import shutil
import signal
import warnings
from dataclasses import replace

import pytest
import torch
from test_run_dir import CFG, cli, final_state, run_for, same

from seco_lab.models.tiny import TinyConfig, TinyTransformer
from seco_lab.training.builders import build_data, load_into
from seco_lab.training.run_dir import (
    MARKER_NAME,
    RUN_TREE,
    RunDir,
    RunDirError,
    foreign_entries,
    read_metrics,
    remove_own,
)
from seco_lab.training.step import lr_factor, schedule_factor
from seco_lab.training.trainer import Trainer, TrainingInterrupted

TINY_ARGS = ["--seq-len", "24", "--chunk-size", "8", "--batch-size", "2", "--eval-batches", "1", "--no-progress",
             "--device", "cpu", "--d-model", "16", "--d-ff", "16", "--n-layers", "1", "--n-heads", "2",
             "--vocab-size", "17"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    t = Trainer(CFG, run_for(tmp_path_factory.mktemp("full"), "full"))
    t.fit()
    return final_state(t)


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---------------------------------------------------------------------------------------------- 1. --overwrite
def test_an_empty_run_dir_is_refused_and_the_current_directory_is_never_emptied(tmp_path):
    (tmp_path / "main.py").write_text("print('mine')\n")
    r = cli("train", *TINY_ARGS, "--steps", "2", "--run-dir", "", "--overwrite", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "--run-dir is empty" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "main.py").read_text() == "print('mine')\n"
    assert tree(tmp_path) == ["main.py"]


@pytest.mark.parametrize("where", ["cwd", "ancestor of cwd", "literal ~"])
def test_overwrite_refuses_the_current_directory_its_ancestors_and_a_literal_tilde(tmp_path, monkeypatch, where):
    run = tmp_path / "r"
    t = Trainer(CFG, run_for(tmp_path, "r"))
    t.prepare()  # a real run directory, so only the place is wrong
    t.close()
    (run / "checkpoints").mkdir(exist_ok=True)
    before = tree(tmp_path)
    if where == "cwd":
        monkeypatch.chdir(run)
        path, msg = ".", "the current directory"
    elif where == "ancestor of cwd":
        (run / "checkpoints" / "sub").mkdir()
        monkeypatch.chdir(run / "checkpoints" / "sub")
        path, msg = str(run), "an ancestor of the current directory"
        before = tree(tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "~").mkdir()
        (tmp_path / "~" / "notes.txt").write_text("x")
        path, msg = "~", "literal '~'"
        before = tree(tmp_path)
    with pytest.raises(RunDirError, match=msg):
        RunDir(path).open(resume=False, overwrite=True)
    assert tree(tmp_path) == before


def test_overwrite_refuses_a_directory_that_is_not_a_run_and_a_run_holding_a_users_file(tmp_path):
    user = tmp_path / "project"
    user.mkdir()
    (user / "main.py").write_text("x")
    (user / "metrics.jsonl").write_text('{"step": 1}\n')  # even with names a run also writes
    with pytest.raises(RunDirError, match="is not a seco-lab run directory"):
        RunDir(user).open(resume=False, overwrite=True)
    assert tree(user) == ["main.py", "metrics.jsonl"]
    r = cli("train", *TINY_ARGS, "--steps", "2", "--run-dir", str(user), "--overwrite")
    assert r.returncode == 2 and "not a seco-lab run directory" in r.stderr, r.stderr
    assert tree(user) == ["main.py", "metrics.jsonl"]

    run = tmp_path / "run"
    Trainer(replace(CFG, steps=2, warmup=1), run_for(tmp_path, "run")).fit()
    (run / "notes.txt").write_text("my notes")
    (run / "checkpoints" / "best.pt").write_bytes(b"mine")
    with pytest.raises(RunDirError, match=r"files seco-lab did not write \(checkpoints/best.pt, notes.txt\)"):
        RunDir(run).open(resume=False, overwrite=True)
    assert (run / "notes.txt").read_text() == "my notes" and (run / "checkpoints" / "best.pt").exists()


@pytest.mark.parametrize("legacy", [False, True])
def test_overwrite_replaces_a_run_atomically_and_leaves_nothing_behind(tmp_path, legacy):
    run = tmp_path / "run"
    Trainer(replace(CFG, steps=2, warmup=1, ckpt_every=1), run_for(tmp_path, "run")).fit()
    assert (run / MARKER_NAME).is_file()
    if legacy:  # a run written before the marker existed is recognised by its config.json
        (run / MARKER_NAME).unlink()
    t = Trainer(replace(CFG, steps=1, warmup=0), run_for(tmp_path, "run", overwrite=True))
    t.fit()
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001.pt"]
    assert (run / MARKER_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing set aside is left over


def test_removal_follows_the_allowlist_and_never_a_symlink(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002.dcp").mkdir(parents=True)
    (run / "checkpoints" / "step_000002.dcp" / "__0_0.distcp").write_bytes(b"")
    (run / "checkpoints" / "step_000002.dcp" / "mine.txt").write_text("x")
    (run / "config.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (run / "tensorboard").symlink_to(outside, target_is_directory=True)
    assert [str(p.relative_to(run)) for p in foreign_entries(run, RUN_TREE)] == [
        "checkpoints/step_000002.dcp/mine.txt", "tensorboard"]
    left = remove_own(run, RUN_TREE)
    assert sorted(str(p.relative_to(run)) for p in left) == ["checkpoints/step_000002.dcp/mine.txt", "tensorboard"]
    assert (outside / "precious").exists() and not (run / "config.json").exists()


# ---------------------------------------------------------------------------------------------- 2. missing ckpts
@pytest.mark.parametrize("deleted", ["step files", "checkpoints folder", "all damaged"])
def test_resume_with_the_checkpoints_gone_refuses_and_keeps_the_metrics(tmp_path, deleted):
    run = run_for(tmp_path, "r")
    Trainer(CFG, replace(run, stop_at=4)).fit()
    ckpts = tmp_path / "r" / "checkpoints"
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    if deleted == "step files":
        for p in ckpts.glob("step_*.pt"):
            p.unlink()
        msg = "latest names step_000004.pt, which is missing"
    elif deleted == "checkpoints folder":
        shutil.rmtree(ckpts)
        msg = "records step 4 but .* holds no checkpoint"
    else:
        for p in ckpts.glob("step_*.pt"):
            p.write_bytes(b"")
        msg = "records step 4 but .* holds no checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "all damaged": each damaged file is reported before the refusal
        with pytest.raises(RunDirError, match=msg):
            Trainer(CFG, replace(run, resume=True)).prepare()
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics
    r = cli("train", "--run-dir", run.run_dir, "--resume", "--device", "cpu", "--no-progress")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "start again with --overwrite" in r.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics


def test_a_latest_that_is_a_directory_is_a_one_line_error(tmp_path):
    run = run_for(tmp_path, "r")
    Trainer(CFG, replace(run, stop_at=2)).fit()
    latest = tmp_path / "r" / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir()
    with pytest.raises(RunDirError, match="latest is not a file"):
        Trainer(CFG, replace(run, resume=True)).prepare()


# ---------------------------------------------------------------------------------------------- 3. foreign ckpts
def test_a_checkpoint_of_another_run_or_step_is_refused(tmp_path):
    run = run_for(tmp_path, "mine")
    Trainer(CFG, replace(run, stop_at=4)).fit()
    Trainer(replace(CFG, seed=7), replace(run_for(tmp_path, "other"), stop_at=4)).fit()
    mine = tmp_path / "mine" / "checkpoints"
    metrics = (tmp_path / "mine" / "metrics.jsonl").read_text()
    shutil.copy(tmp_path / "other" / "checkpoints" / "step_000004.pt", mine / "step_000004.pt")
    with pytest.raises(RunDirError, match=r"step_000004.pt belongs to another experiment .*seed \(7 -> 0\)"):
        Trainer(CFG, replace(run, resume=True)).prepare()
    shutil.copy(mine / "step_000002.pt", mine / "step_000004.pt")
    with pytest.raises(RunDirError, match="step_000004.pt holds step 2, not 4"):
        Trainer(CFG, replace(run, resume=True)).prepare()
    assert (tmp_path / "mine" / "metrics.jsonl").read_text() == metrics


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_crafted_checkpoint_cannot_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = run_for(tmp_path, "r")
    Trainer(CFG, replace(run, stop_at=2)).fit()
    torch.save({"step": 2, "payload": _RunsCode()}, tmp_path / "r" / "checkpoints" / "step_000002.pt")
    with pytest.raises(RunDirError, match="safe load refuses"):
        Trainer(CFG, replace(run, resume=True)).prepare()
    assert not (tmp_path / "PWNED").exists()


def test_checkpoints_hold_only_tensors_and_plain_values_with_fingerprint_and_step(tmp_path):
    run = run_for(tmp_path, "r")
    t = Trainer(CFG, replace(run, stop_at=2))
    t.fit()
    state = torch.load(tmp_path / "r" / "checkpoints" / "step_000002.pt", weights_only=True)
    assert state["step"] == 2 and state["fingerprint"] == t.fingerprint and len(t.fingerprint) == 16
    assert Trainer(replace(CFG, seed=1), run).fingerprint != t.fingerprint
    assert Trainer(replace(CFG, steps=60), run).fingerprint == t.fingerprint  # extending keeps the experiment


def test_loading_another_architecture_is_a_one_line_error():
    small = TinyTransformer(TinyConfig(d_model=16, n_layers=1, n_heads=2, d_ff=16, vocab_size=17))
    wide = TinyTransformer(TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=16, vocab_size=17))
    with pytest.raises(RunDirError, match=r"another model architecture \(size mismatch") as e:
        load_into(small, wide.state_dict(), "runs/x/checkpoints")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- 4. extending
def test_extending_a_finished_run_continues_its_schedule_without_a_jump(tmp_path):
    run = run_for(tmp_path, "r")
    Trainer(CFG, run).fit()  # 6 steps, warm-up 2, floor 0.1 * lr
    t = Trainer(replace(CFG, steps=12), replace(run, resume=True))
    t.fit()
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "r") if "lr" in r}
    floor = CFG.lr * CFG.min_lr_ratio
    assert lrs[6] == pytest.approx(CFG.lr * lr_factor(5, 2, 6, 0.1), rel=1e-12)  # the first run, untouched
    assert [lrs[s] for s in range(7, 13)] == pytest.approx([floor] * 6, rel=1e-12)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["lr_cycles"] == [[0, 6]]
    # extending again keeps it
    t = Trainer(replace(CFG, steps=14, lr_cycles=[[0, 6]]), replace(run, resume=True))
    t.fit()
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "r") if "lr" in r}
    assert [lrs[s] for s in (13, 14)] == pytest.approx([floor] * 2, rel=1e-12)


def test_rewarm_starts_a_new_warm_up_from_the_floor_over_the_added_steps(tmp_path):
    run = run_for(tmp_path, "r")
    Trainer(CFG, run).fit()
    Trainer(replace(CFG, steps=12), replace(run, resume=True, rewarm=True)).fit()
    lrs = [r["lr"] for r in read_metrics(tmp_path / "r") if "lr" in r]
    r, lr = CFG.min_lr_ratio, CFG.lr
    expect = [lr * schedule_factor(s, 2, 12, r, [[0, 6], [6, 12]]) for s in range(6, 12)]
    assert lrs[6:] == pytest.approx(expect, rel=1e-12)
    assert expect[0] == pytest.approx(lr * (r + (1 - r) / 2)) and expect[1] == pytest.approx(lr)  # warm-up from r
    assert max(abs(b - a) for a, b in zip(lrs[5:], lrs[6:])) <= lr * (1 - r) / 2 + 1e-12  # no step larger than W's
    with pytest.raises(RunDirError, match="--rewarm starts a new schedule cycle"):
        Trainer(replace(CFG, steps=12, lr_cycles=[[0, 6], [6, 12]]), replace(run, resume=True, rewarm=True)).prepare()


def test_the_cycle_schedule_reduces_to_warm_up_and_cosine():
    for s in range(30):
        assert schedule_factor(s, 3, 20, 0.1) == lr_factor(s, 3, 20, 0.1)
        assert schedule_factor(s, 3, 40, 0.1, [[0, 20]]) == (lr_factor(s, 3, 20, 0.1) if s < 20 else 0.1)


# ---------------------------------------------------------------------------------------------- 5. SIGTERM
class SignalAt:
    """The data of a run that receives ``signum`` while building the batch of step ``at`` (deterministic)."""

    def __init__(self, data, at, signum):
        self.data, self.at, self.signum = data, at, signum

    def __getattr__(self, name):
        return getattr(self.data, name)

    def batch(self, split, index, size):
        if split == "train" and index == self.at:
            os.kill(os.getpid(), self.signum)
        return self.data.batch(split, index, size)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_finishes_the_step_checkpoints_and_resumes_bit_for_bit(tmp_path, uninterrupted, signum):
    run = run_for(tmp_path, "r")
    t = Trainer(CFG, run, data=SignalAt(build_data(CFG), 2, signum))
    with pytest.raises(TrainingInterrupted) as e:
        t.fit()
    assert e.value.step == 3 and e.value.signum == signum  # the step under way (the 3rd) was finished
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_000003.pt"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the trainer's handlers are gone
    t = Trainer(CFG, replace(run, resume=True))
    t.fit()
    assert same(final_state(t), uninterrupted)


def test_keep_checkpoints_keeps_the_newest_and_only_deletes_its_own(tmp_path):
    run = run_for(tmp_path, "r", keep_checkpoints=2)
    ckpts = tmp_path / "r" / "checkpoints"
    t = Trainer(replace(CFG, ckpt_every=1), run)
    t.prepare()
    (ckpts / "my_step_000001.pt").write_text("mine")
    (ckpts / "step_000001.pt.bak").write_text("mine")
    t.fit()
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "my_step_000001.pt", "step_000001.pt.bak",
                                                        "step_000005.pt", "step_000006.pt"]
    r = cli("train", "--help")
    assert "--keep-checkpoints" in r.stdout and "--rewarm" in r.stdout


def test_a_study_folder_removes_only_its_own_temporaries_and_cells(tmp_path):
    """--out may be a study folder the user keeps other files in: opening (or --fresh) removes only the study's
    own temporaries (NAME.tmp<pid>) and cell files, never e.g. notes.tmp.txt or a user's notes in cells/.
    (A folder without study.json that holds files is not a study folder: refused, see test_issue19_inputs.)"""
    from seco_lab.store import StudyFolder

    folder = StudyFolder(tmp_path, cells="cells")
    (tmp_path / "study.json").write_text('{"fingerprint": "other"}\n')
    (tmp_path / "cells").mkdir()
    keep = [tmp_path / "notes.tmp.txt", tmp_path / "draft.tmp", tmp_path / "cells" / "README.md",
            tmp_path / "cells" / "zz_user.json", tmp_path / "cells" / "b.rows.csv"]  # no b.json: not a cell's
    gone = [tmp_path / "study.json.seco-tmp123", tmp_path / "cells" / "L1_k2_s0.json", tmp_path / "cells" / "a.json",
            tmp_path / "cells" / "a.rows.csv", tmp_path / "cells" / "a.json.seco-tmp99"]
    for p in keep + gone:  # a cell's record is a JSON object; a user's file with a cell's extension is not one
        # a temporary is the study's only empty (campaign 38 B9: one holding something is kept, with a warning)
        p.write_text('{"cell": 1}' if p.name in ("L1_k2_s0.json", "a.json") else "" if "seco-tmp" in p.name else "x")
    folder.open("digest", fresh=True)
    assert all(p.exists() for p in keep)
    assert not any(p.exists() for p in gone)


# ---------------------------------------------------------------------------------------------- hostile campaign
def test_overwrite_through_a_symlink_is_refused_and_the_link_kept(tmp_path):
    """Campaign R14: the link was renamed aside and replaced by a stub directory, then the run failed."""
    run = tmp_path / "r0"
    Trainer(CFG, replace(run_for(tmp_path, "r0"), stop_at=2)).fit()
    link = tmp_path / "r0link"
    link.symlink_to(run)
    before = tree(tmp_path)
    with pytest.raises(RunDirError, match=r"r0link is a symlink to .*r0; pass --run-dir"):
        RunDir(link).open(resume=False, overwrite=True)
    assert link.is_symlink() and link.resolve() == run.resolve() and tree(tmp_path) == before


def test_a_literal_tilde_run_dir_is_refused_without_overwrite_too(tmp_path, monkeypatch):
    """Campaign R03: --run-dir '~' created ./~ (and said 'metrics in ~/metrics.jsonl', which reads as $HOME)."""
    monkeypatch.chdir(tmp_path)
    for path in ("~", "~/runs/x"):
        with pytest.raises(RunDirError, match="a literal '~'"):
            RunDir(path).open(resume=False, overwrite=False)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_without_a_fingerprint_is_refused(tmp_path):
    """Campaign S15: another experiment's weights, fingerprint removed and this run's config copied in, resumed."""
    run = run_for(tmp_path, "mine")
    Trainer(CFG, replace(run, stop_at=4)).fit()
    Trainer(replace(CFG, seed=7), replace(run_for(tmp_path, "other"), stop_at=4)).fit()
    mine = tmp_path / "mine" / "checkpoints" / "step_000004.pt"
    state = torch.load(tmp_path / "other" / "checkpoints" / "step_000004.pt", weights_only=True)
    del state["fingerprint"]
    state["config"] = torch.load(mine, weights_only=True)["config"]
    torch.save(state, mine)
    with pytest.raises(RunDirError, match="step_000004.pt records no experiment fingerprint"):
        Trainer(CFG, replace(run, resume=True)).prepare()


def test_a_file_that_is_no_checkpoint_falls_back_to_the_earlier_one(tmp_path):
    """Campaign S03: a text file in place of the newest checkpoint was refused as 'could run code'."""
    run = run_for(tmp_path, "r")
    Trainer(CFG, replace(run, stop_at=4)).fit()
    (tmp_path / "r" / "checkpoints" / "step_000004.pt").write_text("garbage\n")
    t = Trainer(CFG, replace(run, resume=True))
    with pytest.warns(UserWarning, match=r"step_000004.pt is damaged \(ValueError: not a torch checkpoint archive"):
        t.prepare()
    try:
        assert t.step == 2  # ckpt_every=2: the checkpoint before step 4
    finally:
        t.close()


LEAVE = """
import atexit, datetime, pathlib, sys
import torch.distributed as dist
from seco_lab.training.launch import leave_process_group, leaving_process_group
out, how = pathlib.Path(sys.argv[1]), sys.argv[2]
atexit.register(lambda: (out / "teardown").write_text("ran"))
dist.init_process_group("gloo", init_method=f"file://{out / 'init'}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
if how == "code":
    print("work done", flush=False)
    leave_process_group(3)
with leaving_process_group():
    if how == "raise":
        raise RuntimeError("a failing worker")
    print("work done", flush=False)
print("never reached")
"""


@pytest.mark.parametrize("how, code", [("code", 3), ("block", 0), ("raise", 1)])
def test_a_distributed_process_leaves_with_its_code_its_output_and_no_interpreter_teardown(tmp_path, how, code):
    """leave_process_group: the exit status is the given code, stdout is flushed, and the interpreter's teardown
    (where a live gloo thread can abort a finished rank) is skipped -- an atexit handler never runs; an exception
    inside leaving_process_group propagates with its traceback (and then the interpreter exits normally)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", LEAVE, str(tmp_path), how], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == code, p.stderr
    if how == "raise":
        assert "RuntimeError: a failing worker" in p.stderr
        assert (tmp_path / "teardown").exists()  # an ordinary exit: atexit ran
    else:
        assert "work done" in p.stdout and "never reached" not in p.stdout
        assert not (tmp_path / "teardown").exists()


CALLER_GROUP = """
import datetime, pathlib, sys
import torch.distributed as dist
from seco_lab.cli import main
out = pathlib.Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{out / 'init'}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
(out / "afile").write_text("a file, not a folder")
code = main(["train", "--data", "synthetic", "--steps", "1", "--run-dir", str(out / "afile" / "sub")])
print("caller continues", code, dist.is_initialized(), flush=True)
"""


def test_train_called_in_a_process_that_has_a_process_group_returns_and_leaves_the_group(tmp_path):
    """'seco-lab train' leaves (os._exit) only a process group it created itself under torchrun: called from code
    that has its own group, it returns its exit status and the caller's group stays."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", CALLER_GROUP, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "caller continues 2 True" in p.stdout, p.stdout + p.stderr


def test_a_resumed_run_moves_aside_a_foreign_file_where_it_saves_a_step(tmp_path):
    """Campaign 70 D: another run's checkpoint copied in as step_000004.pt and a user's file named step_000006.pt,
    beyond the step a resume starts from, were overwritten by the resumed run's own steps, exit 0 (fails on 4d1ae82).
    Each is kept under a new name, warned; the run's own checkpoints take their names."""
    run = run_for(tmp_path, "mine")
    Trainer(CFG, replace(run, stop_at=2)).fit()
    Trainer(replace(CFG, seed=7), replace(run_for(tmp_path, "other"), stop_at=4)).fit()
    ckpts = tmp_path / "mine" / "checkpoints"
    foreign = (tmp_path / "other" / "checkpoints" / "step_000004.pt").read_bytes()
    (ckpts / "step_000004.pt").write_bytes(foreign)
    (ckpts / "step_000006.pt").write_text("my notes")
    with pytest.warns(UserWarning, match=r"step_000004.pt is not a checkpoint of this run"):
        Trainer(CFG, replace(run, resume=True)).fit()
    kept = {p.read_bytes() for p in ckpts.glob("step_*.not-this-run.*/*")}
    assert kept == {foreign, b"my notes"}
    own = RunDir(tmp_path / "mine")
    assert all(own._own_checkpoint(ckpts / f"step_{s:06d}.pt", own.run_id) for s in (2, 4, 6))


def test_a_stop_signal_caught_during_the_step_s_reduction_is_kept(tmp_path):
    """Loaded run 5 (docs/loaded_test_runs.md): a SIGTERM caught while the step's statistics were being reduced
    was overwritten by the reduced flag (False) and the run went on (fails on 0eaf5f7).  Deterministic: the stop
    is requested from inside the reduction of step 2."""
    t = Trainer(CFG, run_for(tmp_path, "r"))
    t.prepare()
    reduce = t.parallel.reduce_mean

    def reduce_and_stop(totals, *args):
        if t.step == 1:
            t._request_stop(signal.SIGTERM)
        return reduce(totals, *args)

    t.parallel.reduce_mean = reduce_and_stop
    with pytest.raises(TrainingInterrupted):
        t.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "r") if "loss" in r] == [1, 2]
