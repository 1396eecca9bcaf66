"""Issue 19, after campaign 27 (Q3's neighbourhood): a training checkpoint edited in a way no specific check can name
-- a moment scaled, one parameter's step counter set back, a weight nudged, an RNG state changed -- resumed without
a word and continued another run than the one stopped.  Every ``.pt`` checkpoint now carries the digest of its own
content (``run_files.content_digest``), checked after the specific checks (``experiment.check_content_digest``)."""

from __future__ import annotations

import pytest
import torch
from helpers import FAST, copy_run
from test_issue19_campaign25_train import _resume

from seco_lab.cli import main
from seco_lab.training.run_dir import read_metrics
from seco_lab.training.run_files import CONTENT_DIGEST, content_digest, safe_load

CKPT = "checkpoints/step_000002.pt"


def _edit(run, change):
    path = run / CKPT
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def _scale_moment(state):
    state["optimizer"]["state"][3]["exp_avg"].mul_(2.0)


def _step_counter_back(state):
    state["optimizer"]["state"][3]["step"] = torch.tensor(1.0)  # within [1, 2]: the bias correction changes


def _nudge_weight(state):
    name = next(iter(state["model"]))
    state["model"][name].view(-1)[0] += 1e-3


def _torch_rng(state):
    state["torch_rng"] = torch.manual_seed(123).get_state()


def _numpy_rng_pos(state):
    state["numpy_rng"]["pos"] = (state["numpy_rng"]["pos"] + 1) % 624


@pytest.mark.parametrize("change", [_scale_moment, _step_counter_back, _nudge_weight, _torch_rng, _numpy_rng_pos],
                         ids=["moment-scaled", "step-counter-back", "weight-nudged", "torch-rng", "numpy-rng"])
def test_an_edited_checkpoint_is_refused_by_its_content_digest(r2, tmp_path, capsys, change):
    """Each edit keeps every value finite and every field in range, so only the digest tells it; before, the run
    resumed (rc 0) and its step 3 was not the uninterrupted run's."""
    run = copy_run(r2, tmp_path / "r")
    _edit(run, change)
    before = (run / "metrics.jsonl").read_text()
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert "--resume: checkpoint step_000002.pt was changed after seco-lab wrote it" in err, err
    assert "resume from an earlier checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert (run / "metrics.jsonl").read_text() == before


def test_the_digest_is_of_the_content_saved_and_names_any_change(r2):
    """The recorded digest is the digest of the loaded file (tensors, RNG states, records), and changes with any
    single value: a tensor element, a tensor's dtype with the same bytes' worth, a plain number, a key."""
    state = safe_load(r2 / CKPT)
    assert isinstance(state[CONTENT_DIGEST], str) and state[CONTENT_DIGEST] == content_digest(state)
    for change in (lambda s: s["model"][next(iter(s["model"]))].view(-1)[-1].add_(1e-7),
                   lambda s: s.__setitem__("step", 2.0),
                   lambda s: s["optimizer"]["state"][0].update(step=s["optimizer"]["state"][0]["step"].double()),
                   lambda s: s.__setitem__("extra", None)):
        edited = safe_load(r2 / CKPT)
        change(edited)
        assert content_digest(edited) != state[CONTENT_DIGEST]


def test_a_checkpoint_written_before_the_digest_resumes_as_the_run_would(r2, tmp_path, capsys):
    """A checkpoint without a digest (written by an earlier version) is not refused, and continues the run exactly:
    step 3 equals the resume of the intact copy."""
    intact, old = copy_run(r2, tmp_path / "intact"), copy_run(r2, tmp_path / "old")
    _edit(old, lambda s: s.pop(CONTENT_DIGEST))
    for run in (intact, old):
        capsys.readouterr()
        assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 0
    keys = ("loss", "grad_norm", "far_loss", "eval_loss", "eval_far_loss")  # not the timings
    a, b = ([[r[k] for k in keys] for r in read_metrics(run) if r["step"] == 3] for run in (intact, old))
    assert a and a == b


def test_a_checkpoint_without_its_config_is_named_as_such(r2, tmp_path, capsys):
    """Campaign 28 (review): the config removed from a checkpoint was refused as 'trained on another learning-rate
    schedule ... (warm-up + cosine cycles None)', blaming the schedule."""
    run = copy_run(r2, tmp_path / "r")
    _edit(run, lambda s: s.pop("config"))
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert "--resume: checkpoint step_000002.pt records no experiment config" in err, err
    assert "schedule" not in err.split("config")[0] and len(err.strip().splitlines()) == 1, err


def test_a_run_dir_going_up_out_of_a_missing_folder_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Campaign 28 (T29): `--run-dir x/../../../` was refused as the filesystem root only after `x` was made."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *FAST, "--run-dir", "x/../../../"]) == 2
    assert "goes up ('..') out of x, which is not an existing folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "runs").mkdir()
    assert main(["train", *FAST, "--run-dir", "runs/../r"]) == 0  # up out of a folder that exists: allowed
    assert (tmp_path / "r" / "config.json").is_file()


def _without_digest(change):
    def edit(state):
        state.pop(CONTENT_DIGEST)  # as a checkpoint written before checkpoints carried one
        change(state)
    return edit


@pytest.mark.parametrize("change, says", [
    (lambda s: s.__setitem__("step", "2"), "holds step '2', not the integer 2"),
    (lambda s: s.__setitem__("step", 2.0), "holds step 2.0, not the integer 2"),
    (lambda s: s.__setitem__("optimizer", []), "the optimizer state in"),
    (lambda s: s.__setitem__("torch_rng", torch.zeros(10, dtype=torch.uint8)),
     "holds a scheduler or random-number-generator state that cannot be restored"),
    (lambda s: s.__setitem__("numpy_rng", {"name": "MT19937"}),
     "holds a scheduler or random-number-generator state that cannot be restored"),
    (lambda s: s.__setitem__("scheduler", [1, 2]),
     "holds a scheduler or random-number-generator state that cannot be restored"),
], ids=["step-str", "step-float", "optimizer-list", "torch-rng-short", "numpy-rng-partial", "scheduler-list"])
def test_a_checkpoint_without_a_digest_with_unusable_values_is_one_line(r2, tmp_path, capsys, change, says):
    """Campaign 28 (K_step-field-str, K_optimizer-list, K_rng-garbage): raw TypeError / RuntimeError tracebacks
    from a checkpoint's step, optimizer or RNG state of the wrong kind -- now refused by the digest, and by name
    for a checkpoint that carries none."""
    run = copy_run(r2, tmp_path / "r")
    _edit(run, _without_digest(change))
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("field, value, says", [
    ("draws", -5, "draws is -5, but it must be an integer >= 1"),
    ("ci_level", 1.5, "ci_level is 1.5, but it must lie in (0, 1)"),
    ("seeds", [0, -1, 2], "seeds is [0, -1, 2], but seeds are integers >= 0"),
    ("draws", 5000, "its definition has digest"),  # in range, but not what the study ran with
])
def test_a_bias_study_json_edited_by_hand_is_refused_by_the_report(tmp_path, capsys, field, value, says):
    """Campaign 28 (RP03): `draws` -5 in a sealed study.json was reported as "Each cell draws N = -5 sets"."""
    import json
    import shutil
    from pathlib import Path

    folder = tmp_path / "b"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/bias_study", folder)
    study = json.loads((folder / "study.json").read_text())
    study["config"][field] = value
    (folder / "study.json").write_text(json.dumps(study))
    assert main(["report", "bias", "--results", str(folder), "--out", str(tmp_path / "o.md")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.md").exists()
