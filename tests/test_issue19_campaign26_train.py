"""Issue 19, hostile campaign 26 (docs/hostile_campaign_26.md), training: a checkpoint's AdamW state that would
quietly change a resumed run (P2, P7), a NaN the engine raises past the trainer (P2), a config that cannot build a
model (P3), and a resume's --steps blamed on --warmup (TA63).  Each fails on the code before the fix."""
import json
import shutil

import pytest
import torch
from helpers import FAST, copy_run
from test_issue19_campaign25_models import intact  # noqa: F401 (a fixture)
from test_issue19_campaign25_train import _resume

from seco_lab.cli import main
from seco_lab.models.hf import build_hf_model, check_hf_overrides


def _edit_optimizer(run, change, step=2):
    path = run / "checkpoints" / f"step_{step:06d}.pt"
    state = torch.load(path, weights_only=False)
    change(state["optimizer"])
    torch.save(state, path)


def _group(key, value):
    def change(opt):
        opt["param_groups"][0][key] = value
    return change


def _negative_second_moment(opt):
    opt["state"][3]["exp_avg_sq"].fill_(-1.0)


def _slim(opt):
    opt["state"].clear()


def _state(key, value):
    def change(opt):
        opt["state"][3][key] = value(opt["state"][3])
    return change


def _drop_one(opt):
    del opt["state"][3]


def _reversed_params(opt):
    opt["param_groups"][0]["params"].reverse()


@pytest.mark.parametrize("change, says", [
    (_group("betas", (float("nan"), 0.95)), "records AdamW betas [nan, 0.95], not the run's [0.9, 0.95]"),
    (_group("weight_decay", float("nan")), "records AdamW weight_decay nan, not the run's 0.0"),
    (_group("betas", (0.5, 0.95)), "records AdamW betas [0.5, 0.95]"),
    (_group("eps", 0.0), "records AdamW eps 0.0, which must be finite and > 0"),
    (_negative_second_moment, "holds a negative second moment (exp_avg_sq of parameter 3)"),
    (_slim, "holds no optimizer state (AdamW's moments: a slim or edited checkpoint)"),
    # campaign 27 (K01, K02, K10, K12-K14, K16): raw tracebacks from torch's adam, or a quietly other update
    (_group("amsgrad", True), "records AdamW amsgrad True, not the run's False"),
    (_group("maximize", True), "records AdamW maximize True, not the run's False"),
    (_state("exp_avg", lambda per: torch.zeros(3)), "holds exp_avg of parameter 3 with shape (3,)"),
    (_state("step", lambda per: torch.tensor(-5.0)), "records AdamW's step counter -5.0 for parameter 3"),
    (_state("step", lambda per: torch.tensor(0.0)), "records AdamW's step counter 0.0 for parameter 3"),
    (_drop_one, "holds no optimizer state for parameter 3"),
    (_reversed_params, "lists the optimizer's parameters in another order or number"),
], ids=["nan-betas", "nan-weight-decay", "other-betas", "zero-eps", "negative-exp-avg-sq", "slim", "amsgrad",
        "maximize", "exp-avg-shape", "negative-step", "zero-step", "one-state-dropped", "params-reversed"])
def test_p2_p7_a_checkpoint_whose_adamw_state_would_change_the_run_is_refused(r2, tmp_path, capsys, change, says):
    """P2 (TR33, TR38, TR45, TR47): NaN betas or weight decay, or a negative second moment, made the weights NaN at
    the first resumed step and ended in a raw FloatingPointError traceback, every retry alike.  P7 (TR39): a
    checkpoint without AdamW's moments resumed without a word, restarting them (step 3 differed from an
    uninterrupted run).  Each is refused when the checkpoint is loaded, naming it and what to do."""
    run = copy_run(r2, tmp_path / "r")
    _edit_optimizer(run, change)
    before = (run / "metrics.jsonl").read_text()
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert f"--resume: checkpoint step_000002.pt {says}" in err, err
    assert "resume from an earlier checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert (run / "metrics.jsonl").read_text() == before


def test_p2_a_nan_the_engine_raises_past_the_trainer_is_one_line(r2, tmp_path, capsys, monkeypatch):
    """P2 (TR47): a FloatingPointError from a forward outside the trainer's own catch was a raw traceback."""
    from seco_lab.training.trainer import Trainer

    def nan_forward(self):
        raise FloatingPointError("the loss of chunk 3 is nan: the model's forward produced NaN/inf")

    monkeypatch.setattr(Trainer, "fit", nan_forward)
    run = copy_run(r2, tmp_path / "r")
    rc, err = _resume(run, capsys)
    assert rc == 1 and "Traceback" not in err, err
    assert "seco-lab train: error: at step 3: the loss of chunk 3 is nan" in err and "last checkpoint stays" in err


@pytest.mark.parametrize("overrides, says", [
    ({"hidden_act": "nonsense"}, "hidden_act is 'nonsense', an activation transformers does not know"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps is -1.0, but it must be >= 0 and finite"),
])
def test_p3_an_override_that_cannot_build_a_model_is_refused_up_front(overrides, says):
    """P2/P3: `--hf-override hidden_act=nonsense` was a raw KeyError when the model was built; rms_norm_eps=-1.0 a
    raw FloatingPointError at the first evaluation."""
    with pytest.raises(ValueError, match="--hf-override") as e:
        check_hf_overrides("llama", overrides)
    assert says in str(e.value)


def test_p3_a_checkpoint_config_with_an_unknown_activation_names_the_field(intact, tmp_path):  # noqa: F811
    folder = tmp_path / "ck"
    shutil.copytree(intact, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "nonsense"}))
    with pytest.raises(ValueError, match=r"config.json: hidden_act is 'nonsense'"):
        build_hf_model(str(folder))


def test_ta63_a_resume_with_steps_within_the_runs_warm_up_names_steps_not_warmup(tmp_path, capsys):
    """TA63: `--resume --steps 1` on a run with --warmup 1 said "lower --warmup below --steps", and following it
    was refused as a config change (a resume keeps the run's warm-up)."""
    run = tmp_path / "r"
    assert main(["train", *FAST, "--warmup", "1", "--run-dir", str(run)]) == 0  # the last --warmup counts
    capsys.readouterr()
    for again in ([], ["--warmup", "1"]):  # the run's own warm-up named again (campaign 27 TA63r): the same
        assert main(["train", "--steps", "1", "--run-dir", str(run), "--resume", "--no-progress", *again]) == 2
        err = capsys.readouterr().err
        assert "--steps 1: the run in" in err and "warms up for 1 steps" in err and "lower --warmup" not in err, err


def test_h20_a_checkpoint_config_with_dropout_is_one_line(intact, tmp_path, capsys):  # noqa: F811
    """Campaign 27 H20: attention_dropout 0.5 in a checkpoint folder's config.json ended in a raw traceback of the
    engine's determinism check at the step-0 evaluation (the --hf-override route was already one line)."""
    folder = tmp_path / "ck"
    shutil.copytree(intact, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    rc = main(["train", "--hf-model", str(folder), "--steps", "1", "--seq-len", "32", "--chunk-size", "8",
               "--batch-size", "1", "--warmup", "0", "--no-progress", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "sets dropout (attention_dropout=0.5)" in err, err
    assert not (tmp_path / "r").exists()  # campaign 28 (H02b): refused before the run folder is made
