"""Issue 19, campaigns 28 and 29 (docs/hostile_campaign_28.md, docs/hostile_campaign_29.md).  The first group: a
training checkpoint edited in a way no specific check can name -- a moment scaled, one parameter's step counter set
back, a weight nudged, an RNG state changed -- resumed without a word and continued another run than the one stopped.
Every ``.pt`` checkpoint now carries the digest of its own content (``run_files.content_digest``), checked after the
specific checks (``experiment.check_content_digest``), and required where the run's marker says so.  Then each other
finding of the two campaigns, each test failing on the commit its campaign probed."""

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


def _as_an_older_run(run):
    """The run folder as a seco-lab before checkpoint digests left it: its marker without ``digests``, and no
    checkpoint carrying one (nor ``corpus_text``, recorded since)."""
    import json

    marker = json.loads((run / ".seco-lab-run").read_text())
    marker.pop("digests")
    (run / ".seco-lab-run").write_text(json.dumps(marker) + "\n")
    for path in sorted((run / "checkpoints").glob("step_*.pt")):
        state = torch.load(path, weights_only=True)
        if CONTENT_DIGEST in state or "corpus_text" in state:
            state.pop(CONTENT_DIGEST, None)
            state.pop("corpus_text", None)
            torch.save(state, path)


def test_a_checkpoint_written_before_the_digest_resumes_as_the_run_would(r2, tmp_path, capsys):
    """A checkpoint without a digest in a run folder older than digests (its marker does not promise them) is refused
    by default (campaign 30 T1: so is an edited one whose every digest and marker were removed), naming
    --accept-undigested; with it, it continues the run exactly: step 3 equals the resume of the intact copy."""
    intact, old = copy_run(r2, tmp_path / "intact"), copy_run(r2, tmp_path / "old")
    _edit(old, lambda s: s.pop(CONTENT_DIGEST))
    _as_an_older_run(old)
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(old), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "carries no content digest, which every checkpoint seco-lab writes has" in err, err
    assert "resume it with --accept-undigested" in err and len(err.strip().splitlines()) == 1
    for run, flag in ((intact, []), (old, ["--accept-undigested"])):
        capsys.readouterr()
        assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume", *flag]) == 0
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


@pytest.mark.parametrize("digest", ["drop", None, 5, "0" * 64])
def test_an_edited_checkpoint_whose_digest_was_removed_is_refused(r2, tmp_path, capsys, digest):
    """Campaign 29 S1: the same edits with `content_digest` deleted (or None) resumed as a "pre-digest" checkpoint.
    A run's marker says its checkpoints carry digests; then a missing, None or other digest is refused."""
    run = copy_run(r2, tmp_path / "r")

    def change(state):
        _scale_moment(state)
        if digest == "drop":
            state.pop(CONTENT_DIGEST)
        else:
            state[CONTENT_DIGEST] = digest
    _edit(run, change)
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    says = {"drop": "carries no content digest, which every checkpoint of this run has",  # campaign 32 V2: a digest
            None: "carries content digest None, which seco-lab never writes",  # of another type is named as such
            5: "carries content digest 5, which seco-lab never writes"}.get(digest,
                                                                          "was changed after seco-lab wrote it")
    assert f"--resume: checkpoint step_000002.pt {says}" in err and len(err.strip().splitlines()) == 1, err


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
    _as_an_older_run(run)
    capsys.readouterr()
    rc = main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume", "--accept-undigested"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("field, value, says", [
    ("draws", -5, "draws is -5, but it must be an integer >= 1"),
    ("ci_level", 1.5, "ci_level is 1.5, but it must lie in (0, 1)"),
    ("seeds", [0, -1, 2], "seeds is [0, -1, 2], but seeds are integers >= 0"),
    ("draws", 5000, "its definition has digest"),  # in range, but not what the study ran with
    # campaign 29 S4, S5: the digest was checked only when study_format was exactly 4
    ("study_format", None, "records study_format None, not a format of a bias study"),
    ("study_format", "4", "records study_format '4', not a format of a bias study"),
    ("study_format+draws", (3, 100_000), "or written by a seco-lab older than study format"),
    ("study_format+ci_level", (3, 0.99), "its definition has digest"),
])
def test_a_bias_study_json_edited_by_hand_is_refused_by_the_report(tmp_path, capsys, field, value, says):
    """Campaign 28 (RP03): `draws` -5 in a sealed study.json was reported as "Each cell draws N = -5 sets"."""
    import json
    import shutil
    from pathlib import Path

    folder = tmp_path / "b"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/bias_study", folder)
    study = json.loads((folder / "study.json").read_text())
    if field.startswith("study_format"):
        if "+" in field:
            study["study_format"], study["config"][field.split("+")[1]] = value
        elif value is None:
            del study["study_format"]
        else:
            study["study_format"] = value
    else:
        study["config"][field] = value
    (folder / "study.json").write_text(json.dumps(study))
    assert main(["report", "bias", "--results", str(folder), "--out", str(tmp_path / "o.md")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.md").exists()


def _with_stdout_closed(args, cwd):
    """Run ``python -m seco_lab.cli ARGS`` with its standard output a pipe whose reader has gone (``| head -0``)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "seco_lab.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    return p.wait(timeout=600), err


@pytest.mark.parametrize("command", ["seal", "report"])
def test_a_closed_stdout_ends_the_command_quietly_after_its_work(tmp_path, command):
    """Campaign 28 (Z21, Z23): `seal b | head -0` sealed, then ended in a raw BrokenPipeError traceback; `study bias
    | head -1` wrote every result, then blamed the results folder ("cannot write the results to b: Broken pipe").
    The work is done, the status is 141 (a Unix tool's SIGPIPE), and nothing is said."""
    import shutil
    from pathlib import Path

    shutil.copytree(Path(__file__).resolve().parents[1] / "reports" / "bench", tmp_path / "b")
    args = ["seal", "b"] if command == "seal" else ["report", "bench", "--results", "b", "--out", "o.md"]
    rc, err = _with_stdout_closed(args, tmp_path)
    assert rc == 141 and err == "", err
    assert (tmp_path / ("b/checksums.sha256" if command == "seal" else "o.md")).is_file()


def test_an_empty_file_option_names_a_file_not_the_current_folder(tmp_path, monkeypatch, capsys):
    """Campaign 28 (Z04, Z15): `plot --out ''` advised "use . for the current directory", which was then refused as
    a folder; a file option now asks for a file by example."""
    monkeypatch.chdir(tmp_path)
    for args, example in ((["plot", "r", "--out", ""], "runs_loss.png"),
                          (["report", "bias", "--out", ""], "report.md"),
                          (["train", "--config", ""], "run.toml")):
        with pytest.raises(SystemExit):
            main(args)
        err = capsys.readouterr().err
        assert f"is empty: name a file, e.g. {example}" in err and "use ." not in err, err


@pytest.mark.parametrize("flag, values, says", [("--schemes", ["paper", "paper"], "schemes names 'paper' twice"),
                                                ("--budgets", ["2", "4", "2"], "budgets names 2 twice")])
def test_an_audit_naming_a_scheme_or_budget_twice_is_refused_up_front(tmp_path, capsys, flag, values, says):
    """Campaign 28 (AV08): `audit --schemes paper paper` ran, and its cost unit was then reported 9 times as damaged
    ("rows[3] and rows[2] are both the step spaco/paper/2/0 ... rerun the audit"), its sections left out."""
    rc = main(["audit", "--quick", "--model", "tiny", "--params", "full", "--no-progress", "--out",
               str(tmp_path / "a"), flag, *values])
    err = capsys.readouterr().err
    assert rc == 2 and f"{says}; name each once" in err, err
    assert not (tmp_path / "a").exists()


def test_a_rerun_over_an_edited_bias_study_json_writes_the_true_definition(tmp_path, capsys):
    """Campaign 28 (ST15): study.json's `draws` edited to -5 (its digest left alone), then the same study again:
    "8 already done", and the edited record was kept and vouched for (the report then said "N = -5")."""
    import json
    from dataclasses import replace

    from seco_lab.studies.bias.definition import QUICK
    from seco_lab.studies.bias.driver import run_study

    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100, paper_cells=())
    run_study(cfg, tmp_path, progress=False)
    path = tmp_path / "study.json"
    record = json.loads(path.read_text())
    record["config"]["draws"] = -5
    path.write_text(json.dumps(record))
    run_study(cfg, tmp_path, progress=False)
    assert "1 already done, 0 to compute" in capsys.readouterr().out
    assert json.loads(path.read_text())["config"]["draws"] == 100


def test_a_resume_whose_checkpoint_folder_config_was_edited_is_refused(tmp_path, capsys):
    """Campaign 28 (H35): `--hf-model DIR` run, then DIR/config.json's rms_norm_eps edited 1e-6 -> 0.1, then
    --resume: rc 0 without a word, and the run went on as another model.  The model built now is checked against the
    HF config the run recorded; the folder put back resumes."""
    import json
    import shutil

    import transformers

    folder = tmp_path / "ck"
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, intermediate_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(folder / "config.json", tmp_path / "config.orig.json")
    args = ["train", "--hf-model", str(folder), "--seq-len", "32", "--chunk-size", "8", "--batch-size", "1",
            "--warmup", "0", "--ckpt-every", "1", "--eval-every", "1", "--eval-batches", "1", "--no-progress",
            "--run-dir", str(tmp_path / "r")]
    assert main([*args, "--steps", "1"]) == 0
    edited = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**edited, "rms_norm_eps": 0.1}))
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "now builds another model than the run" in err and "rms_norm_eps (1e-06 -> 0.1)" in err, err
    assert "Traceback" not in err and sum("error" in line for line in err.splitlines()) == 1, err
    shutil.copy(tmp_path / "config.orig.json", folder / "config.json")
    assert main([*args, "--steps", "2", "--resume"]) == 0


@pytest.mark.parametrize("sizes", [{"d_model": 2**40}, {"vocab_size": 10**12}])
def test_a_tiny_transformer_larger_than_the_machine_is_refused_before_allocating(sizes):
    """Campaign 28 (A68, A71): torch's allocator failed inside nn.Embedding ("can't allocate memory: you tried to
    allocate 281474976710656 bytes"); the weights' size is now checked first, as the CLI's memory estimate does."""
    from seco_lab import TinyConfig, TinyTransformer

    with pytest.raises(MemoryError, match="needs .* GiB for its weights alone, more than this machine's"):
        TinyTransformer(TinyConfig(**sizes))


def test_num_parameters_is_the_models_count():
    from seco_lab import TinyConfig, TinyTransformer

    for cfg in (TinyConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_ff=32),
                TinyConfig(vocab_size=40, d_model=24, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=40,
                           tie_embeddings=False)):
        assert cfg.num_parameters == sum(p.numel() for p in TinyTransformer(cfg).parameters())


@pytest.mark.parametrize("user_file", ["adapter/README.md", "adapter/adapter_model.safetensors",
                                       "tensorboard/events.out.tfevents.mine"])
def test_overwrite_keeps_user_files_in_folders_the_run_never_wrote(r2, tmp_path, capsys, user_file):
    """Campaign 29 S2: `--overwrite` of a run that never used --lora or --tensorboard deleted a user's
    adapter/README.md, adapter_model.safetensors or tensorboard events file (the names a run may write)."""
    run = copy_run(r2, tmp_path / "r")
    (run / user_file).parent.mkdir()
    (run / user_file).write_text("mine\n")
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    assert f"holds files seco-lab did not write ({user_file.split('/')[0]})" in capsys.readouterr().err
    assert (run / user_file).read_text() == "mine\n"


def test_overwrite_replaces_an_optional_folder_the_run_wrote(r2, tmp_path, capsys):
    """The folder a run did write (its marker names it: RunDir.note_written, called by the metric logger and the
    adapter's save) is still its own to replace; the marker of a new run names none."""
    import json

    from seco_lab.training.run_dir import RunDir

    run = copy_run(r2, tmp_path / "r")
    assert "wrote" not in json.loads((run / ".seco-lab-run").read_text())
    RunDir(run).note_written("tensorboard")
    assert json.loads((run / ".seco-lab-run").read_text())["wrote"] == ["tensorboard"]
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host.2.0").write_bytes(b"x")
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 0
    assert not (run / "tensorboard").exists()


def _tiny_llama():
    from seco_lab.models.hf import build_hf_model

    return build_hf_model("llama", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 64,
                                    "max_position_embeddings": 64})


@pytest.mark.parametrize("kwargs, error, says", [
    ({"targets": "q_proj"}, TypeError, "got the string 'q_proj' (use ['q_proj'])"),
    ({"r": True}, TypeError, "LoRA rank r must be an integer, got True"),
    ({"r": 2.5}, TypeError, "LoRA rank r must be an integer, got 2.5"),
    ({"alpha": 0}, ValueError, "LoRA alpha must be > 0, got 0"),
    ({"alpha": float("nan")}, ValueError, "LoRA alpha must be a finite number"),
])
def test_add_lora_checks_its_arguments(kwargs, error, says):
    """Campaign 29 S6, S8: a string of targets was split into letters (peft's NoMatchingPeftModuleError), r=True /
    2.5 reached torch's empty(), alpha=0 made every LoRA gradient exactly 0 without a word, alpha=nan failed later
    blaming the weights or the norm eps."""
    from seco_lab.models.hf import add_lora

    with pytest.raises(error) as e:
        add_lora(_tiny_llama(), **kwargs)
    assert says in str(e.value)


def test_build_hf_model_and_hfchunkmodel_refuse_arguments_of_the_wrong_kind():
    """Campaign 29 S6 (C36), S8 (D12): overrides as a list of pairs ended in str.join's TypeError;
    chunk_attention="no" switched the model to seco_sdpa as True does."""
    from seco_lab.models.hf import HFChunkModel, build_hf_model

    with pytest.raises(TypeError, match="overrides must be a dict of config field: value, got list"):
        build_hf_model("llama", [("hidden_size", 32)])
    model = _tiny_llama()
    with pytest.raises(TypeError, match="chunk_attention must be"):
        HFChunkModel(model, chunk_attention="no")
    assert model.config._attn_implementation == "sdpa"  # left as it was


def test_a_resume_with_another_warmup_is_told_that_a_resume_keeps_it(tmp_path, capsys):
    """Campaign 29 S11: `--resume --steps 3 --warmup 5` on a warm-up-1 run advised "lower --warmup below --steps";
    following it (--warmup 2) was refused as a config change.  The change itself is named first."""
    run = tmp_path / "r"
    assert main(["train", *FAST, "--warmup", "1", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--warmup", "5", "--resume", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the config differs from the run" in err and "warmup (1 -> 5)" in err and "lower --warmup" not in err, err


def test_a_plot_that_cannot_write_names_its_file(r2, tmp_path, monkeypatch, capsys):
    """Campaign 29 S10: a full disk during `plot` said "None: File too large" (a write error names no file)."""
    import errno

    from seco_lab.report import runs

    def full(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(runs, "plot_runs", full)
    assert main(["plot", str(r2), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'x.png'}: File too large" in err and "None" not in err, err


def test_hop_strata_of_an_hf_model_cast_to_float64_after_loading_are_exact(tmp_path):
    """Campaign 29 S9: a checkpoint loaded, then `.double()`: seco_grad matched dense to 2e-16 but hop strata were off
    by ~3e-8 (transformers' RMSNorm computes in float32; the float64 formula was installed only by build_hf_model's
    own dtype argument).  HFChunkModel installs it for any model it drives, effective whenever inputs are float64."""
    import transformers

    from seco_lab import dense_grad, hop_strata
    from seco_lab.models.hf import HFChunkModel, build_hf_model

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=64, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ck")
    model = HFChunkModel(build_hf_model(str(tmp_path / "ck"), attn_implementation="sdpa")).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 20), generator=g), torch.randint(0, 64, (2, 20), generator=g)
    _, dense = dense_grad(model, x, y)
    total = hop_strata(model, x, y, 5).total()
    scale = max(float(v.abs().max()) for v in dense.values())
    assert max(float((total[k] - dense[k]).abs().max()) for k in dense) / scale < 1e-12


def test_an_audit_report_names_how_its_own_results_are_rerun(tmp_path):
    """Campaign 29 S11: the report of a user's own audit said "rerun them with `make audit` (`seco-lab audit
    --committed ...`)", the committed SmolLM2 study, not what made its numbers."""
    import json
    from pathlib import Path

    from seco_lab.report.audit import PRODUCE, _produce
    from seco_lab.studies.audit.config import COMMITTED, AuditConfig

    committed = json.loads((Path(__file__).resolve().parents[1] / "reports/audit/k128/audit.json").read_text())
    assert _produce(Path("reports/audit/k128"), committed["config"]) == PRODUCE
    own = AuditConfig(model="tiny", params="full", dtype="float64", length=24, chunk_size=4, budgets=(2, 3),
                      max_hops=1, mc_budgets=(2,), exact_length=16, exact_chunk_size=4).to_json()
    text = _produce(tmp_path / "o", own)
    assert "--committed" not in text and f"{tmp_path / 'o' / 'config.json'}" in text
    assert _produce(tmp_path / "o", {**COMMITTED.to_json(), "threads": 7}) == PRODUCE  # threads: not the definition


def test_a_run_copied_without_its_marker_still_requires_digests(r2, tmp_path, capsys):
    """Campaign 30 (K21): a run copied with `cp -r base/r/* r/` (no dot files: no marker) resumed once -- the marker
    was written again without `digests` -- and then an edited checkpoint with its digest deleted resumed without a
    word.  A checkpoint of an earlier step carrying a digest requires one of every later checkpoint, and a marker
    written again says `digests` when every checkpoint carries one."""
    import json

    run = copy_run(r2, tmp_path / "r")
    (run / ".seco-lab-run").unlink()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 0
    assert json.loads((run / ".seco-lab-run").read_text()).get("digests") is True
    (run / ".seco-lab-run").unlink()  # and again: the earlier checkpoints' digests decide
    path = run / "checkpoints" / "step_000003.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"].mul_(2.0)
    state.pop(CONTENT_DIGEST)
    torch.save(state, path)
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(run), "--resume"]) == 2
    assert "step_000003.pt carries no content digest" in capsys.readouterr().err


def test_an_older_run_resumed_by_this_version_falls_back_to_its_digestless_checkpoint(r2, tmp_path, capsys):
    """A run made before digests (no digest in its checkpoints, a marker without `digests`), resumed by this version
    (its new checkpoint carries one), whose newest checkpoint is then damaged: the fallback to the older checkpoint
    is not refused for lacking a digest (only a checkpoint of an earlier step than one with a digest must have
    one)."""
    run = copy_run(r2, tmp_path / "r")
    _as_an_older_run(run)
    args = ["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume", "--accept-undigested"]
    assert main(args) == 0
    (run / "checkpoints" / "step_000003.pt").write_bytes(b"damaged")
    capsys.readouterr()
    with pytest.warns(UserWarning, match="instead of damaged step_000003.pt"):
        assert main(args) == 0



@pytest.mark.parametrize("second", ["./t.txt", "link.txt", "code:t.txt"])
def test_an_audit_naming_one_text_file_twice_is_refused(tmp_path, monkeypatch, capsys, second):
    """Campaign 30 (AU04-AU06): `--texts t.txt ./t.txt` (or a link to it, or the file under another kind) passed the
    repeat check by spelling and drew the file's windows twice as often as another text's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("some words of text. " * 400)
    (tmp_path / "link.txt").symlink_to("t.txt")
    rc = main(["audit", "--quick", "--model", "tiny", "--params", "full", "--no-progress", "--out", "o",
               "--texts", "t.txt", second])
    err = capsys.readouterr().err
    assert rc == 2 and "twice" in err and "name each text once" in err, err


def test_campaign30_the_model_check_ignores_the_transformers_version_and_counts_integer_dropout(tmp_path, capsys):
    """Campaign 30 T2: `set(ours) | set(theirs) - {...}` left transformers_version in (precedence), so an upgrade
    refused every HF resume; T4: `attention_dropout: 1` (an int) passed the up-front dropout check."""
    import json

    from seco_lab.training import experiment

    model = _tiny_llama()
    from seco_lab.models.hf import HFChunkModel, config_record

    chunk = HFChunkModel(model)
    record = {"hf_model": "llama", "model": {"config": {**json.loads(json.dumps(config_record(chunk))),
                                                          "transformers_version": "0.0.1"}}}
    experiment.check_model_record(record, chunk, "r/config.json")  # no refusal
    folder = tmp_path / "ck"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 1}))
    rc = main(["train", "--hf-model", str(folder), "--steps", "1", "--seq-len", "32", "--chunk-size", "8",
               "--batch-size", "1", "--warmup", "0", "--no-progress", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "sets dropout (attention_dropout=1)" in err, err
    assert not (tmp_path / "r").exists()


def test_campaign30_an_audit_text_and_its_hard_link_are_one_file(tmp_path, monkeypatch, capsys):
    """Campaign 30 T5 (AU24): a hard link to a text passed as another text."""
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("some words of text. " * 400)
    os.link(tmp_path / "t.txt", tmp_path / "hard.txt")
    rc = main(["audit", "--quick", "--model", "tiny", "--params", "full", "--no-progress", "--out", "o",
               "--texts", "t.txt", "hard.txt"])
    assert rc == 2 and "name each text once" in capsys.readouterr().err
