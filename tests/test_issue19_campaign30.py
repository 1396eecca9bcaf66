"""Issue 19, hostile campaign 30 (docs/hostile_campaign_30.md): the findings left open by the seventh session
(T3, T6-T11), each with a test that fails on the campaign's commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_issue19_campaign28 import _tiny_llama


@pytest.mark.parametrize("kwargs, error, says", [
    ({"targets": ["q_proj", 1]}, ValueError, "names no module (1 is not a module name)"),
    ({"targets": None}, TypeError, "targets must be a list of module names (str), got None"),
    ({"targets": 5}, TypeError, "targets must be a list of module names (str), got 5"),
    ({"targets": b"q_proj"}, TypeError, "targets must be a list of module names (str), got b'q_proj'"),
    ({"targets": []}, ValueError, "targets [] names no module (an empty list)"),
    ({"dropout": "x"}, TypeError, "LoRA dropout must be a number in [0, 1), got 'x'"),
    ({"dropout": 1.5}, ValueError, "LoRA dropout must be a number in [0, 1), got 1.5"),
    ({"dropout": float("nan")}, ValueError, "LoRA dropout must be a number in [0, 1), got nan"),
    ({"init_lora_weights": "bogus"}, ValueError, "init_lora_weights must be True, False or one of 'gaussian'"),
])
def test_campaign30_add_lora_refuses_arguments_peft_or_torch_would_fail_on_or_ignore(kwargs, error, says):
    """T6/T7 (A01-A03, A06, A14-A16, A19): raw errors from hf.py, peft or torch; dropout=nan built no dropout."""
    from seco_lab.models.hf import add_lora

    with pytest.raises(error) as e:
        add_lora(_tiny_llama(), **kwargs)
    assert says in str(e.value)


def test_campaign30_add_lora_takes_a_transformers_model_only():
    """T6 (A17, A20, F09): None, a TinyTransformer, an HFChunkModel (wrap order swapped) reached peft."""
    from seco_lab.models.hf import HFChunkModel, add_lora
    from seco_lab.models.tiny import TinyConfig, TinyTransformer

    for model in (None, TinyTransformer(TinyConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, d_ff=16))):
        with pytest.raises(TypeError, match="add_lora wraps a transformers model"):
            add_lora(model)
    with pytest.raises(TypeError, match=r"add LoRA first: HFChunkModel\(add_lora\(model\)\)"):
        add_lora(HFChunkModel(_tiny_llama()))


def test_campaign30_add_lora_still_builds_what_it_is_asked():
    from seco_lab.models.hf import add_lora

    lora = add_lora(_tiny_llama(), r=2, targets=("q_proj",), dropout=0.25, init_lora_weights="gaussian")
    drops = [m.p for n, m in lora.named_modules() if n.endswith("lora_dropout.default")]
    assert drops == [0.25]


@pytest.mark.parametrize("kwargs, error, says", [
    ({"overrides": {1: 2}}, TypeError, "keyed by config field names (str), got the key 1"),
    ({"dtype": "float64"}, TypeError, "dtype must be one of torch.float32, torch.float64"),
    ({"dtype": torch.int64}, TypeError, "dtype must be one of torch.float32, torch.float64"),
    ({"dtype": torch.float8_e4m3fn}, TypeError, "got torch.float8_e4m3fn"),  # campaign 31 U5 (B01)
    ({"seed": "x"}, TypeError, "seed must be an integer, got 'x'"),
    ({"seed": 1.5}, TypeError, "seed must be an integer, got 1.5"),
    ({"seed": True}, TypeError, "seed must be an integer, got True"),
])
def test_campaign30_build_hf_model_refuses_keys_dtypes_and_seeds_of_the_wrong_kind(kwargs, error, says):
    """T6 (B04-B07: raw errors, "Invalid device string" for dtype='float64'), T7 (B09, F03: seed 1.5 and True
    built seed 1's weights)."""
    from seco_lab.models.hf import build_hf_model

    with pytest.raises(error) as e:
        build_hf_model("llama", **kwargs)
    assert says in str(e.value)


def test_campaign30_hfchunkmodel_refuses_a_base_model_without_an_lm_head():
    """T6 (F05): HFChunkModel(LlamaModel) was accepted; the first seco_grad raised "'BaseModelOutputWithPast'
    object has no attribute 'logits'"."""
    from transformers import LlamaModel

    from seco_lab.models.hf import HFChunkModel

    with pytest.raises(TypeError, match=r"LlamaModel, whose get_output_embeddings\(\) returns None .*ForCausalLM"):
        HFChunkModel(LlamaModel(_tiny_llama().config))


class _FullStream:
    """A standard output on a full disk (`> /dev/full`): every write and flush fails with ENOSPC."""

    def write(self, text):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")

    flush = write

    def fileno(self):
        import io

        raise io.UnsupportedOperation("fileno")


def test_campaign30_a_standard_output_that_fails_is_one_line_and_leaves_no_half_made_run(tmp_path, monkeypatch,
                                                                                           capsys):
    """T10 (T08): `train > /dev/full` ended in a raw OSError traceback and left a run folder (marker, lock, config,
    no checkpoint) that refused the retry as "exists and is not empty"."""
    import sys

    from helpers import FAST

    from seco_lab.cli import main

    run = tmp_path / "r"
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", _FullStream())
        assert main(["train", *FAST, "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err
    assert "seco-lab train: error: cannot write to standard output (No space left on device)" in err, err
    assert "Traceback" not in err and not run.exists()
    assert main(["train", *FAST, "--run-dir", str(run)]) == 0  # the retry is a first try
    # campaign 31 U2: an empty folder made beforehand (mkdir -p in a job script), and a run replaced by --overwrite,
    # were left holding a new run's marker and config, and the plain retry was refused as "not empty"
    for folder, extra in ((tmp_path / "empty", []), (run, ["--overwrite"])):
        folder.mkdir(exist_ok=True)
        with monkeypatch.context() as m:
            m.setattr(sys, "stdout", _FullStream())
            assert main(["train", *FAST, "--run-dir", str(folder), *extra]) == 1
        assert folder.is_dir() and not any(folder.iterdir()), sorted(folder.iterdir())
        assert main(["train", *FAST, "--run-dir", str(folder)]) == 0
    with monkeypatch.context() as m:  # a resumed run keeps everything
        m.setattr(sys, "stdout", _FullStream())
        assert main(["train", *FAST, "--run-dir", str(run), "--steps", "3", "--resume"]) == 1
    assert (run / "checkpoints" / "step_000002.pt").is_file()


def _hf_folder_with_tokenizer(root, text):
    from test_issue19_inputs import _byte_bpe_tokenizer

    from seco_lab.models.hf import build_hf_model

    folder = root / "t2"
    build_hf_model("llama", {"vocab_size": 320, "hidden_size": 16, "intermediate_size": 16,
                             "num_hidden_layers": 1}).save_pretrained(folder)
    tokenizer = _byte_bpe_tokenizer(text)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_campaign30_a_changed_tokenizer_is_named_not_blamed_on_the_text(tmp_path, capsys):
    """T3 (H19, H20): the checkpoint folder's tokenizer changed between --stop-at and --resume (text.txt untouched)
    was refused as "the file was edited, or a relative --text path names another file"; the text is now compared
    before its tokenizer, so the message names the tokenizer -- and an edited text is still named as such."""
    from tokenizers import normalizers

    from seco_lab.cli import main

    text = "Def F(X):\n    Return X + 1  # The Answer\n" * 60
    (tmp_path / "text.txt").write_text(text)
    folder, tokenizer = _hf_folder_with_tokenizer(tmp_path, text)
    run = tmp_path / "r"
    args = ["train", "--data", "text", "--text", str(tmp_path / "text.txt"), "--hf-model", str(folder),
            "--seq-len", "32", "--chunk-size", "8", "--steps", "2", "--warmup", "0", "--batch-size", "1",
            "--eval-batches", "1", "--eval-every", "1", "--ckpt-every", "1", "--no-progress", "--device", "cpu",
            "--run-dir", str(run)]
    assert main([*args, "--stop-at", "1"]) == 0
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()  # H20: other token ids for the same text
    tokenizer.save_pretrained(folder)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is the text the checkpoint of step 1 was trained on" in err and "tokenizes differently now" in err, err
    assert f"the tokenizer of --hf-model {folder} changed" in err and "edited" not in err
    (tmp_path / "text.txt").write_text(text.replace("Answer", "Question"))  # now the text too
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is not the text the checkpoint of step 1 was trained on" in err and "the file was edited" in err, err


def test_campaign30_another_runs_marker_is_named_not_blamed_on_the_checkpoints(r2, tmp_path, capsys):
    """T8 (K14): another run's marker copied over this run's was reported as "checkpoint step_000002.pt was written
    by another run ... put this run's checkpoints back" -- the checkpoints were this run's own."""
    import shutil

    from helpers import FAST, copy_run

    from seco_lab.cli import main

    run, other = copy_run(r2, tmp_path / "r"), copy_run(r2, tmp_path / "s")
    assert main(["train", *FAST, "--run-dir", str(other), "--overwrite"]) == 0  # a new run: another run id
    shutil.copy(other / ".seco-lab-run", run / ".seco-lab-run")
    capsys.readouterr()
    args = ["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the run marker" in err and "but every checkpoint" in err and "(2) records run" in err, err
    assert "the marker was replaced by another run's (remove it" in err
    (run / ".seco-lab-run").unlink()  # the way out the message gives
    assert main(args) == 0


@pytest.mark.parametrize("edit, says", [
    (lambda s: s.update(total_draws=10**9), "records total_draws 1000000000, while its definition makes 2,701,080"),
    (lambda s: s.update(total_draws="2701080"), "records total_draws '2701080'"),
    (lambda s: s["timing"].update(compute_seconds=99999), "records compute_seconds 99999 and worker seconds by part"),
    (lambda s: s["timing"]["draws_by_kind"].update(paper=5), "records draws by kind"),
    (lambda s: s["timing"]["worker_seconds_by_part"].update(chain_basis_grid=-1.0), "takes a positive time"),
])
def test_campaign30_run_totals_edited_in_study_json_are_refused_by_the_report(tmp_path, capsys, edit, says):
    """T9 (ST08): total_draws 10^9 and compute_seconds 99999 edited (and sealed) were printed as "Run: 1,000,000,000
    draws; 99999 s of worker time" beside "N = 100 sets": the digest covers the definition only."""
    import json
    import shutil
    from pathlib import Path

    from seco_lab.cli import main

    folder = tmp_path / "b"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/bias_study", folder)
    study = json.loads((folder / "study.json").read_text())
    edit(study)
    (folder / "study.json").write_text(json.dumps(study))
    assert main(["report", "bias", "--results", str(folder), "--out", str(tmp_path / "o.md")]) == 2
    err = capsys.readouterr().err
    assert says in err and "the record was edited" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.md").exists()


def test_campaign30_an_edited_audit_table_is_named_not_blamed_on_the_units(audit_copy, monkeypatch, capsys):
    """T11 (SE02): a leading space put in a bias.csv row's sequence field; --tables-only said "those units' files are
    gone or damaged (left out, named above) ... Restore those unit files" -- the units were intact and nothing was
    named above."""
    from seco_lab.cli import main

    monkeypatch.setenv("SECO_LAB_NO_CHECKSUMS", "0")
    table = audit_copy / "bias.csv"
    lines = table.read_text().splitlines(keepends=True)
    table.write_text("".join([lines[0], " " + lines[1], *lines[2:]]))
    before = {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")}
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy)]) == 2
    err = capsys.readouterr().err
    assert "bias.csv holds rows that no unit in" in err and "no longer matches the checksum" in err, err
    assert "the table was edited" in err and "Restore those unit files" not in err
    assert {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")} == before


def test_campaign30_every_digest_and_the_marker_removed_is_refused_by_default(r2, tmp_path, capsys):
    """T1's remainder (campaign 31 U1): an edited checkpoint whose digest was removed, every earlier checkpoint's
    digest removed and the marker deleted resumed as an older version's run; a checkpoint without a digest now needs
    --accept-undigested, which is refused without --resume."""
    from helpers import FAST, copy_run
    from test_issue19_campaign28 import _as_an_older_run

    from seco_lab.cli import main
    from seco_lab.training.run_dir import read_metrics

    run = copy_run(r2, tmp_path / "r")
    path = run / "checkpoints" / "step_000002.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"].mul_(2.0)
    torch.save(state, path)
    _as_an_older_run(run)
    (run / ".seco-lab-run").unlink()
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step_000002.pt carries no content digest" in err and "--accept-undigested" in err, err
    assert not any(r["step"] == 3 for r in read_metrics(run))
    assert main(["train", *FAST, "--run-dir", str(tmp_path / "n"), "--accept-undigested"]) == 2
    assert "--accept-undigested applies to a resumed run's checkpoints: add --resume" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["Gemma", "Cohere", "Olmo", "Llama-eager", "Bloom-eager"])
def test_campaign31_gemmas_rmsnorm_computes_in_float64_too(arch):
    """Campaign 31 U3 (C04): HFChunkModel(GemmaForCausalLM) in float64 matched dense to 9e-10 only: Gemma's RMSNorm
    (``(1 + weight) * x``, field ``eps``) was not rebound and computed in float32.  Every transformers *Norm now runs
    its own forward with float32 casts of float64 tensors made the identity, and so does a decoder layer whose code
    casts (Cohere rotates queries and keys in float32: its strata were off by 1.5e-10; Olmo's LayerNorm casts)."""
    import transformers

    from seco_lab import dense_grad, hop_strata, seco_grad
    from seco_lab.models.hf import HFChunkModel

    arch, _, attention = arch.partition("-")  # campaign 32 X01: transformers' eager softmax is float32
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **({"head_dim": 8} if arch == "Gemma" else {}))
    if arch == "Bloom":  # campaign 33 W7: its layers are BloomBlocks (strata were off by 4e-12)
        config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                                          attention_dropout=0.0)
    if attention:
        config._attn_implementation = attention
    model = HFChunkModel(getattr(transformers, f"{arch}ForCausalLM")(config).double())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 40), generator=g), torch.randint(0, 64, (2, 40), generator=g)
    _, dense = dense_grad(model, x, y)
    scale = max(float(v.abs().max()) for v in dense.values())
    for other in (seco_grad(model, x, y, 8)[1], hop_strata(model, x, y, 8).total()):
        assert max(float((other[k] - dense[k]).abs().max()) for k in dense) / scale < 1e-12
    norm = model.model.base_model.get_submodule("ln_f" if arch == "Bloom" else "norm")  # float32: transformers' own
    h = torch.randn(2, 3, 32, dtype=torch.float64)
    assert norm(h).dtype == torch.float64
    assert torch.equal(norm.float()(h.float()), type(norm).forward(norm, h.float()))


def test_campaign31_add_lora_refuses_a_base_model_and_a_container_target():
    """Campaign 31 U4 (A09, A17): add_lora(LlamaModel) and targets=['self_attn'] ended in peft's raw errors."""
    import transformers

    from seco_lab.models.hf import add_lora

    model = _tiny_llama()
    with pytest.raises(TypeError, match="add_lora wraps a causal LM with an LM head, got LlamaModel"):
        add_lora(transformers.LlamaModel(model.config))
    with pytest.raises(ValueError, match="'self_attn' names a LlamaAttention, which LoRA cannot wrap"):
        add_lora(model, targets=["self_attn"])


def test_campaign31_build_hf_model_refuses_weights_larger_than_the_machine():
    """Campaign 31 U5 (B12): vocab_size 10**12 ended in torch's raw allocator error."""
    from seco_lab.models.hf import build_hf_model

    with pytest.raises(MemoryError, match="a LlamaForCausalLM of 64,000,000,018,592 parameters needs"):
        build_hf_model("llama", {"vocab_size": 10**12})


def test_campaign31_a_marker_and_checkpoints_of_two_runs_are_named_without_blame(r2, tmp_path, capsys):
    """Campaign 31 U6 (N22): another run's marker and its step-1 checkpoint copied in; the run's own step 2 was
    called "copied in from elsewhere"."""
    import shutil

    from helpers import FAST, copy_run

    from seco_lab.cli import main

    run, other = copy_run(r2, tmp_path / "r"), copy_run(r2, tmp_path / "s")
    assert main(["train", *FAST, "--run-dir", str(other), "--overwrite"]) == 0
    for name in (".seco-lab-run", "checkpoints/step_000001.pt"):
        shutil.copy(other / name, run / name)
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was written by another run than the one this folder's marker names" in err, err
    assert "the checkpoint was copied in from elsewhere, or the marker was" in err


@pytest.mark.parametrize("edit", [
    lambda s: (s["timing"].update(compute_seconds=0.0), s["timing"].update(worker_seconds_by_part={})),
    lambda s: s["timing"]["worker_seconds_by_part"].pop("chain_basis_grid"),
    lambda s: s["timing"]["worker_seconds_by_part"].update(banana=99999.0),  # campaign 32 V3: a part it has not
])
def test_campaign31_a_study_json_whose_parts_took_no_time_is_refused(tmp_path, capsys, edit):
    """Campaign 31 U7 (N56): compute_seconds 0 with no parts (their sum) was printed as "0 s of worker time"."""
    import json
    import shutil
    from pathlib import Path

    from seco_lab.cli import main

    folder = tmp_path / "b"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/bias_study", folder)
    study = json.loads((folder / "study.json").read_text())
    edit(study)
    if study["timing"]["worker_seconds_by_part"]:
        study["timing"]["compute_seconds"] = sum(study["timing"]["worker_seconds_by_part"].values())
    (folder / "study.json").write_text(json.dumps(study))
    assert main(["report", "bias", "--results", str(folder), "--out", str(tmp_path / "o.md")]) == 2
    assert "takes a positive time, and compute_seconds is their sum" in capsys.readouterr().err


def test_campaign31_a_repeated_hf_override_and_a_misspelt_top_level_option(tmp_path, capsys):
    """Campaign 31 U8 (C15): `--hf-override hidden_size=32 --hf-override hidden_size=64` kept 64 without a word;
    U9 (C24): `seco-lab --verison` said "the following arguments are required: COMMAND"."""
    from seco_lab.cli import main

    assert main(["train", "--hf-model", "llama", "--hf-override", "hidden_size=32", "--hf-override",
                 "hidden_size=64", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--hf-override hidden_size is given twice (hidden_size=32 and hidden_size=64)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit) as e:
        main(["--verison"])
    assert e.value.code == 2
    assert "unrecognized arguments: --verison; did you mean --version?" in capsys.readouterr().err


def test_campaign31_a_rerun_writes_edited_run_totals_anew_and_a_failing_stdout_leaves_the_record(tmp_path, capsys,
                                                                                                  monkeypatch):
    """Campaign 31 U10 (N100, N101): the report's advice for an edited total_draws -- rerun the study -- wrote the
    edited study.json back as found ("kept byte for byte"), and the report refused again.  N145: a complete study
    rerun with its standard output failing left study.json marked 'running'."""
    import json
    import sys
    from dataclasses import replace

    from seco_lab.cli import main
    from seco_lab.studies.bias.definition import QUICK, run_totals_problem
    from seco_lab.studies.bias.driver import run_study

    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100, paper_cells=())
    run_study(cfg, tmp_path, progress=False)
    path = tmp_path / "study.json"
    record = json.loads(path.read_text())
    assert run_totals_problem(record, cfg) is None
    before = path.read_bytes()
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", _FullStream())
        with pytest.raises(OSError):  # the driver's own print (the CLI turns it into one line)
            run_study(cfg, tmp_path, progress=False)
    assert path.read_bytes() == before
    record["total_draws"] = 10**9
    path.write_text(json.dumps(record))
    run_study(cfg, tmp_path, progress=False)
    assert json.loads(path.read_text())["total_draws"] == sum(cfg.draws_by_kind().values())
    assert run_totals_problem(json.loads(path.read_text()), cfg) is None
    assert main(["report", "bias", "--results", str(tmp_path), "--out", str(tmp_path / "o.md")]) == 0


def test_campaign31_a_byte_identical_copy_of_an_audit_text_is_one_text(tmp_path, monkeypatch, capsys):
    """Campaign 31 U11 (N102): t.txt and a copy t2.txt (another inode) were audited as four independent sequences
    (two windows, each twice).  Named directly: refused; inside a folder: skipped with a warning."""
    from seco_lab.studies.audit.config import AuditConfig
    from seco_lab.studies.audit.sources import text_sources

    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))
    (tmp_path / "t.txt").write_text(text)
    (tmp_path / "t2.txt").write_text(text)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(text)
    (tmp_path / "d" / "b.txt").write_text(text)
    (tmp_path / "d" / "c.txt").write_text(text + "more\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"texts /.*/t.txt and /.*/t2.txt hold the same bytes"):
        text_sources(AuditConfig(texts=("t.txt", "t2.txt")))
    with pytest.warns(UserWarning, match=r"1 file\(s\) skipped as byte-identical copies .*b.txt \(a copy of .*a.txt\)"):
        files = text_sources(AuditConfig(texts=("d",)))
    assert [f.name for _, f in files] == ["a.txt", "c.txt"]


def test_campaign32_accept_undigested_does_not_accept_a_checkpoint_of_a_version_that_writes_digests(r2, tmp_path,
                                                                                                     capsys):
    """Campaign 32 V1 (U1r-c, U1r-f, U1r-o): every digest stripped, the marker deleted, the newest checkpoint edited
    (an embedding zeroed), then --accept-undigested: resumed without a word.  The checkpoint records corpus_text,
    which only versions that write digests record."""
    from helpers import FAST, copy_run

    from seco_lab.cli import main
    from seco_lab.training.run_files import CONTENT_DIGEST

    run = copy_run(r2, tmp_path / "r")
    for path in sorted((run / "checkpoints").glob("step_*.pt")):
        state = torch.load(path, weights_only=True)
        state.pop(CONTENT_DIGEST)
        if path.name == "step_000002.pt":
            state["model"]["embed.weight"].zero_()
        torch.save(state, path)
    (run / ".seco-lab-run").unlink()
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume", "--accept-undigested"]) == 2
    err = capsys.readouterr().err
    assert "carries no content digest, but records corpus_text" in err and "does not apply" in err, err


def test_campaign32_overwrite_leaves_a_users_files_with_a_runs_names_alone(r2, tmp_path, capsys):
    """Campaign 32 V5 (D05, data loss): a run folder emptied with `rm -r run/*` (the marker, a dot file, stays) in
    which the user put their own config.json and metrics.jsonl: --overwrite deleted both and exited 0."""
    from helpers import FAST, copy_run

    from seco_lab.cli import main

    run = tmp_path / "r"
    run.mkdir()
    (run / ".seco-lab-run").write_bytes((r2 / ".seco-lab-run").read_bytes())
    (run / "config.json").write_text('{"mine": 1}\n')
    (run / "metrics.jsonl").write_text("my notes\nmore notes\n")
    capsys.readouterr()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "holds files with a run's names that seco-lab did not write (config.json (not a run's config), " \
           "metrics.jsonl (not a run's metrics log))" in err, err
    assert (run / "config.json").read_text() == '{"mine": 1}\n' and (run / "metrics.jsonl").read_text().startswith("my")
    own = copy_run(r2, tmp_path / "own")  # a run's own files are still replaced
    assert main(["train", *FAST, "--run-dir", str(own), "--overwrite"]) == 0



@pytest.mark.parametrize("field, value, says", [
    ("wall_seconds_this_run", -5, "wall_seconds_this_run -5, not a time"),
    ("jobs", 0, "jobs 0, not a number of workers"),
])
def test_campaign32_a_study_json_with_an_impossible_wall_time_or_worker_count_is_refused(tmp_path, capsys, field,
                                                                                        value, says):
    """Campaign 32 V3 (U7r-g): wall_seconds_this_run -5 and jobs 0, sealed, were printed as "last run -5.0 s wall with
    0 worker(s)"."""
    import json
    import shutil
    from pathlib import Path

    from seco_lab.cli import main

    folder = tmp_path / "b"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/bias_study", folder)
    study = json.loads((folder / "study.json").read_text())
    (study["timing"] if field.startswith("wall") else study)[field] = value
    (folder / "study.json").write_text(json.dumps(study))
    assert main(["report", "bias", "--results", str(folder), "--out", str(tmp_path / "o.md")]) == 2
    assert says in capsys.readouterr().err


def test_campaign32_a_resume_of_a_folder_a_trainer_is_starting_in_says_it_is_busy(tmp_path, capsys):
    """Campaign 32 V6 (D17a): --resume on a folder whose trainer holds the lock but has not written config.json yet
    said "holds no run ... start it without --resume", which would then be refused as busy."""
    from helpers import FAST

    from seco_lab.cli import main
    from seco_lab.folder_lock import hold_lock, release_lock

    run = tmp_path / "r"
    run.mkdir()
    lock = hold_lock(run, "trainer", "")
    try:
        assert main(["train", *FAST, "--run-dir", str(run), "--resume"]) == 2
    finally:
        release_lock(lock)
    err = capsys.readouterr().err
    assert "is in use by another trainer (pid" in err and "has not written its config.json yet" in err, err
    assert main(["train", *FAST, "--run-dir", str(run), "--resume"]) == 2  # free: the folder holds no run
    assert "holds no run (no config.json); start it without --resume" in capsys.readouterr().err


def test_campaign32_an_hf_override_that_is_no_number_and_a_missing_checkpoint_folder(tmp_path, capsys):
    """Campaign 32 V4 (C02h): `--hf-override rms_norm_eps=nan` passed transformers' strict-config TypeError through
    ("expected float, got str"); V7 (H05b): a checkpoint folder that is gone was reported as holding no tokenizer
    ("Repo id must use alphanumeric chars")."""
    from seco_lab.cli import main

    for value, says in (("nan", "rms_norm_eps must be a finite number"),
                        ("small", 'rms_norm_eps="small": rms_norm_eps is a number (the llama default is')):
        assert main(["train", "--hf-model", "llama", "--hf-override", f"rms_norm_eps={value}",
                     "--run-dir", str(tmp_path / "r")]) == 2
        assert says in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("some text\n" * 200)
    assert main(["train", "--hf-model", str(tmp_path / "gone"), "--data", "text", "--text", str(tmp_path / "t.txt"),
                 "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "gone: no such checkpoint folder" in err and "Repo id" not in err, err
    assert not (tmp_path / "r").exists()



def test_campaign32_audit_terms_of_sequences_that_do_not_vary_are_refused():
    """Campaign 32 V8 (U11r-f): t.txt and t.txt plus a newline gave identical windows; the tables ended in a raw
    ZeroDivisionError (tr Cov of the strata sequences is 0)."""
    from seco_lab.studies.audit.stats import population_terms

    rng = np.random.default_rng(0)
    strata = rng.standard_normal((3, 50))  # P = 3 strata of one sequence
    same = np.einsum("pd,qd->pq", strata, strata)
    cross = np.broadcast_to(same[None, :, None, :], (4, 3, 4, 3)).copy()  # four copies of it
    with pytest.raises(ValueError, match="4 strata sequences' exact gradients do not vary"):
        population_terms(cross, np.ones(3))
    vary = rng.standard_normal((4, 3, 50))
    terms = population_terms(np.einsum("ipd,jqd->ipjq", vary, vary), np.ones(3))
    assert terms["C"] == pytest.approx(terms["a"])  # SeCO's own weights: its own terms


def test_campaign32_a_resume_never_shortens_the_run(tmp_path, capsys):
    """Campaign 32 V10 (D16b): a 4-step run stopped at 2, resumed with --steps 3, "finished" at 3 with the 4-step
    schedule: a stop in disguise, said nowhere.  A resume keeps or extends --steps; --stop-at stops early."""
    from helpers import FAST

    from seco_lab.cli import main

    run = tmp_path / "r"
    assert main(["train", *FAST, "--steps", "4", "--stop-at", "2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume --steps 3: the run in" in err and "has 4 steps" in err and "pass --stop-at 3 instead" in err, err
    assert main(["train", *FAST, "--steps", "4", "--stop-at", "3", "--run-dir", str(run), "--resume"]) == 0


@pytest.mark.parametrize("arch, overrides", [("llama", {"num_hidden_layers": 3}),
                                             ("qwen2", {"num_hidden_layers": 3, "tie_word_embeddings": True})])
def test_campaign32_the_memory_check_counts_a_models_parameters_without_building_its_layers(monkeypatch, arch,
                                                                                          overrides):
    """Campaign 32 V11 (API3): num_hidden_layers 10**6 hung (memory growing) while the check built the model on the
    meta device; it now builds one and two layers and extrapolates -- the count is the model's own."""
    import time

    from seco_lab.models import hf

    model = hf.build_hf_model(arch, overrides)
    monkeypatch.setattr(hf, "host_memory_bytes", lambda: 1)
    with pytest.raises(MemoryError, match=f"of {sum(p.numel() for p in model.parameters()):,} parameters needs"):
        hf.build_hf_model(arch, overrides)
    monkeypatch.undo()
    start = time.process_time()
    with pytest.raises(MemoryError, match="of 14,771,216,512 parameters"):  # 10**6 is above MAX_HF_LAYERS
        hf.build_hf_model("llama", {"num_hidden_layers": 10**5, "hidden_size": 128, "intermediate_size": 256})
    assert time.process_time() - start < 120  # it hung past 240 s before



@pytest.mark.parametrize("name, content", [
    ("metrics.jsonl", "my notes of the run\n"),  # one line of text: taken for a torn record
    ("metrics.jsonl", '{"step": 1, "acc": 0.5}\n{"step": 2, "acc": 0.7}\n'),  # JSON with a step, no loss
    ("checkpoints/latest", "remember to rerun with seed 2\n"),
    ("loss.png", b"\x89PNG\r\n\x1a\n" + bytes(64)),  # V5r-m: a PNG seco-lab did not draw (no mark)
])
def test_campaign33_overwrite_judges_metrics_and_latest_by_content(r2, tmp_path, capsys, name, content):
    """Campaign 33 W1, W2 (data loss): a marker plus a user's one-line metrics.jsonl, or a user's checkpoints/latest,
    were deleted by --overwrite (rc 0)."""
    from helpers import FAST

    from seco_lab.cli import main

    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".seco-lab-run").write_bytes((r2 / ".seco-lab-run").read_bytes())
    content = content if isinstance(content, bytes) else content.encode()
    (run / name).write_bytes(content)
    capsys.readouterr()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    assert f"{name} (not" in capsys.readouterr().err
    assert (run / name).read_bytes() == content


def _seco_lab_figure(path):
    """A figure seco-lab draws (the tool's mark), drawn for no run."""
    from seco_lab.report.figures import new_figure, save_figure

    fig, axes = new_figure()
    axes[0][0].plot([0, 1], [1, 0])
    save_figure(fig, path)
    return path.read_bytes()


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints/step_000005.pt", "checkpoints/step_000009.pt",
                                  "loss.png"])
def test_campaign34_overwrite_keeps_run_like_files_that_are_not_this_runs(r2, tmp_path, capsys, name):
    """Campaign 34 X1-X3 (data loss, arguable): in a run's folder, a user's metrics.jsonl of records with a step, a
    loss and a key no run writes; a user's own torch.save(...) named checkpoints/step_000005.pt (only the archive's
    magic bytes were checked); a copy of another seco-lab figure named loss.png (only the tool's mark was checked):
    --overwrite deleted each, rc 0.  The run's own files are still replaced."""
    from helpers import FAST, copy_run

    from seco_lab.cli import main

    run = copy_run(r2, tmp_path / "r")
    path = run / name
    if name == "metrics.jsonl":
        path.write_text('{"step": 1, "loss": 0.5, "note": "my experiment A"}\n')
    elif name == "loss.png":
        _seco_lab_figure(path)
    elif name.endswith("5.pt"):
        torch.save({"my_weights": torch.ones(3)}, path)
    else:  # R21: a zip of the user's notes
        import zipfile

        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes/today.txt", "my notes")
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "holds files with a run's names that seco-lab did not write" in err and f"{name} (not a" in err, err
    assert path.read_bytes() == content
    own = copy_run(r2, tmp_path / "own")
    assert main(["train", *FAST, "--run-dir", str(own), "--overwrite"]) == 0
    assert main(["train", *FAST, "--run-dir", str(own), "--overwrite"]) == 0  # its own loss.png, checkpoints, log


def test_campaign33_a_resume_at_its_step_already_is_told_how_to_go_on(tmp_path, capsys):
    """Campaign 33 W4: a run stopped at 2 of 4, resumed with --steps 2, was advised "--stop-at 2" (refused)."""
    from helpers import FAST

    from seco_lab.cli import main

    run = tmp_path / "r"
    assert main(["train", *FAST, "--steps", "4", "--stop-at", "2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "2", "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is at step 2 of its 4 already" in err and "--stop-at 2" not in err, err


def test_campaign33_hfchunkmodel_takes_the_mode_of_the_model_it_wraps():
    """Campaign 33 W6: GPT-2 (dropout 0.1) put in eval mode, then wrapped, was refused as "not deterministic ... call
    model.eval()": the wrapper started in training mode."""
    import transformers

    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4))
    wrapped = HFChunkModel(model.eval())
    assert not wrapped.training and wrapped.deterministic
    x = torch.randint(0, 64, (1, 16))
    seco_grad(wrapped, x, x, 8)
    assert HFChunkModel(model.train()).training


def test_campaign33_the_wrapped_models_own_mode_decides_determinism(tmp_path, capsys):
    """Campaign 33 W6 (API5-Q2): the wrapper put in eval mode, then the model back in training mode (dropout active
    inside): accepted, seco 0.56 off dense.  W10: an empty --hf-model folder was told to "fix that field" of a
    config.json it does not hold."""
    import transformers

    from seco_lab import seco_grad
    from seco_lab.cli import main
    from seco_lab.models.hf import HFChunkModel

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4))
    wrapped = HFChunkModel(model)
    wrapped.eval()
    model.train()
    assert not wrapped.deterministic
    x = torch.randint(0, 64, (1, 16))
    with pytest.raises(ValueError, match="not deterministic"):
        seco_grad(wrapped, x, x, 8)
    (tmp_path / "e").mkdir()
    assert main(["train", "--hf-model", str(tmp_path / "e"), "--run-dir", str(tmp_path / "r")]) == 2
    assert "e holds no config.json: it is not a saved model folder" in capsys.readouterr().err


def test_campaign34_a_weight_decay_that_flips_the_weights_is_refused_up_front(tmp_path, capsys):
    """Campaign 34 G10: --weight-decay 1e6 trained to a NaN gradient norm at step 2 and advised "lower --lr"."""
    from helpers import FAST

    from seco_lab.cli import main

    assert main(["train", *FAST, "--weight-decay", "1e6", "--run-dir", str(tmp_path / "r")]) == 2
    assert "AdamW multiplies every weight by 1 - lr * weight_decay" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main(["train", *FAST, "--weight-decay", "0.1", "--run-dir", str(tmp_path / "ok")]) == 0


@pytest.mark.parametrize("override, says", [
    ("rms_norm_eps=-1", "rms_norm_eps is a float >= 0 (the llama default is 1e-06), e.g. rms_norm_eps=1e-06"),
    ("rms_norm_eps=1", "rms_norm_eps is a float (the llama default is 1e-06); write it as one, e.g. "
                       "rms_norm_eps=1.0"),
    ("rms_norm_eps=-1.0", "rms_norm_eps is -1.0, but it must be >= 0 and finite"),
    ("num_hidden_layers=10000000", "this run needs at least"),  # the CLI's memory estimate, before any config
])
def test_campaign33_hf_overrides_of_the_wrong_kind_or_size_are_named(tmp_path, capsys, override, says):
    """Campaign 33 W9 (V4r-d): rms_norm_eps=-1 passed transformers' strict-config TypeError through; W8 (API6-b):
    qwen2 with 10**7 layers gave no answer in 90 s."""
    from seco_lab.cli import main
    from seco_lab.models.hf import build_hf_model

    assert main(["train", "--hf-model", "llama", "--hf-override", override, "--run-dir", str(tmp_path / "r")]) == 2
    assert says in capsys.readouterr().err
    if override.startswith("num_hidden_layers"):
        with pytest.raises(ValueError, match="more than 100,000 layers"):
            build_hf_model("qwen2", {"num_hidden_layers": 10**7})


def test_campaign32_v8_dropping_a_sealed_units_removal_rewrites_the_grams_without_blaming_a_writer(tmp_path, capsys,
                                                                                                   monkeypatch):
    """Campaign 32 V8 (A02d, A02e): after a strata unit's removal was sealed, ``--tables-only --drop-missing-units``
    stored the Gram again without that sequence's rows and then took its own write for another writer's ("something
    writes into"); an immediate retry succeeded.  The Grams it stores are now told apart from a change by anyone else,
    which is still refused (test_checksums' swapped-unit test)."""
    import json

    from test_audit import TINY

    from seco_lab import store
    from seco_lab.cli import main
    from seco_lab.studies.audit import run_audit

    monkeypatch.setenv("SECO_LAB_NO_CHECKSUMS", "0")
    out = tmp_path / "a"
    run_audit(TINY, out, progress=False)
    names = json.loads((out / "cross_gram.json").read_text())["names"]
    assert len(names) == 3
    (out / "units" / f"strata-{names[0]}.json").unlink()
    assert main(["seal", str(out)]) == 0
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(out), "--no-progress"]) == 0, \
        capsys.readouterr().err
    assert json.loads((out / "cross_gram.json").read_text())["names"] == names[1:]
    store.verify_checksums(out, "the test")  # every table and the Gram written are recorded as the audit's
    assert main(["report", "audit", "--results", str(out), "--out", str(tmp_path / "r.md")]) == 0


_FUNCTIONAL_DROPOUT = {  # transformers models applying dropout as F.dropout(h, p=config.X): no nn.Dropout to find
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, num_hidden_layers=2, word_embed_proj_dim=32,
                                                max_position_embeddings=256), "dropout"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4), "hidden_dropout"),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(num_hidden_layers=2, new_decoder_architecture=False,
                                                         num_kv_heads=4), "hidden_dropout"),
}


@pytest.mark.parametrize("arch", sorted(_FUNCTIONAL_DROPOUT))
def test_campaign34_dropout_a_model_applies_as_a_function_is_refused_in_training(arch):
    """Campaign 34 X4 (API6-opt, -bloom-hidden, -falcon-hidden): a model in training mode whose dropout is a config
    field applied with F.dropout was taken as deterministic; seco vs dense 0.42 / 1.7e-2 / 0.41.  With that field at 0
    the same model trains, exact."""
    import transformers

    from seco_lab import dense_grad, flatten, seco_grad
    from seco_lab.models.hf import HFChunkModel

    config_class, model_class, kw, field = _FUNCTIONAL_DROPOUT[arch]
    kw = dict(kw, vocab_size=64, hidden_size=32, num_attention_heads=4, attention_dropout=0.0)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    for p in (0.1, 0.0):
        config = getattr(transformers, config_class)(**kw, **{field: p})
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = HFChunkModel(getattr(transformers, model_class)(config).double().train())
        if p:
            assert not model.deterministic
            with pytest.raises(ValueError, match=f"its config's {field}=0.1 draws dropout or noise in training mode"):
                seco_grad(model, x, x, 8)
        else:
            assert model.deterministic and model.randomness is None
            _, dense = dense_grad(model, x, x)
            _, seco = seco_grad(model, x, x, 8)
            assert float((flatten(seco) - flatten(dense)).norm() / flatten(dense).norm()) < 1e-13


def test_campaign34_dropout_no_config_field_names_is_found_in_the_first_training_forward():
    """X4's class: whatever applies dropout in the forward (here a hook calling F.dropout, which neither a module nor a
    config field shows) is found the first time the model runs in a training mode; eval mode runs it as before."""
    from seco_lab import dense_grad, flatten, seco_grad
    from seco_lab.models.hf import HFChunkModel

    base = _tiny_llama().double().train()
    base.model.layers[0].mlp.register_forward_hook(lambda mod, i, out: torch.nn.functional.dropout(out, 0.1,
                                                                                                  mod.training))
    model = HFChunkModel(base)
    assert model.deterministic  # nothing to read: the forward shows it
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"its forward applies dropout \(p=0.1, dropout\) in training mode"):
        seco_grad(model, x, x, 8)
    model.eval()
    _, dense = dense_grad(model, x, x)
    _, seco = seco_grad(model, x, x, 8)
    assert float((flatten(seco) - flatten(dense)).norm() / flatten(dense).norm()) < 1e-13


def test_campaign34_the_hf_trainer_refuses_a_model_with_functional_dropout(tmp_path):
    """X4 (API7): SeCOTrainer trained a default OPT (dropout 0.1, applied with F.dropout) without a word."""
    import transformers
    from datasets import Dataset

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer

    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=32))
    ids = torch.randint(0, 64, (2, 32)).tolist()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=1,
                                          use_cpu=True, report_to=[], save_strategy="no")
    trainer = SeCOTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                          seco_args=SeCOArguments(chunk_size=16))
    with pytest.raises(ValueError, match="its config's dropout=0.1 draws dropout or noise in training mode"):
        trainer.train()


def test_campaign34_report_audit_on_a_training_run_says_it_is_no_audit(r2, tmp_path, capsys, monkeypatch):
    """Campaign 34 X5 (F24): `report audit --results RUN` said the run's files lacked a checksum file and advised
    `seco-lab seal RUN`, which then refused it; the bias report named the missing files."""
    from seco_lab.cli import main

    monkeypatch.setenv("SECO_LAB_NO_CHECKSUMS", "0")
    capsys.readouterr()
    assert main(["report", "audit", "--results", str(r2), "--out", str(tmp_path / "a.md")]) == 2
    err = capsys.readouterr().err
    assert f"{r2} lacks audit.json" in err and "seal" not in err, err
    assert not (tmp_path / "a.md").exists()


def test_campaign34_metric_keys_name_every_key_a_run_writes(r2):
    """X1's fix judges metrics.jsonl by its keys: every key a run writes must be in METRIC_KEYS (else --overwrite
    would keep a run's own log as a user's)."""
    import json

    from seco_lab.training.run_checks import METRIC_KEYS

    keys = set().union(*(json.loads(line) for line in (r2 / "metrics.jsonl").read_text().splitlines()))
    assert {"loss", "eval_loss", "far_loss", "eval_far_loss", "grad_norm", "lr"} <= keys <= METRIC_KEYS


def _length_dependent_rope_model(kind):
    import transformers

    layers = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4)
    torch.manual_seed(0)
    if kind == "phi3-longrope":
        config = transformers.Phi3Config(**layers, max_position_embeddings=128, original_max_position_embeddings=32,
                                         pad_token_id=0, rope_scaling={"type": "longrope", "short_factor": [1.0] * 4,
                                                                       "long_factor": [2.0] * 4})
        model = transformers.Phi3ForCausalLM(config)
    elif kind == "llama-longrope":
        config = transformers.LlamaConfig(**layers, max_position_embeddings=128, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 32, "factor": 4.0})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**layers, max_position_embeddings=32,
                                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
        model = transformers.LlamaForCausalLM(config)
    config._attn_implementation = "eager"
    return model.double().eval()


@pytest.mark.parametrize("kind", ["phi3-longrope", "llama-longrope"])
def test_campaign34_longrope_chunks_on_both_sides_of_its_switch_are_refused(kind):
    """Campaign 34 X6 (API9-phi3-longrope, API10, H15): longrope picks short or long frequencies for *every* position
    from the longest position of each forward; chunk by chunk the chunks within 32 positions took the short ones, the
    whole sequence the long ones: seco and hop strata vs dense 3.6e-3, accepted.  Now refused by name; chunks all on
    one side of the switch (a sequence within it, or a first chunk past it) stay exact."""
    from seco_lab import dense_grad, flatten, hop_strata, seco_grad, spaco_grad
    from seco_lab.models.hf import HFChunkModel

    model = HFChunkModel(_length_dependent_rope_model(kind))
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    for call in (lambda: seco_grad(model, x, x, 16), lambda: hop_strata(model, x, x, 16, max_hops=1),
                 lambda: spaco_grad(model, x, x, 16, subset=(0,))):  # campaign 35 Y7-a: chunk 0 rebuilt alone
        with pytest.raises(ValueError, match="longrope RoPE scaling picks its frequencies from the longest position"):
            call()
    with pytest.raises(ValueError, match="make the first chunk longer than 32 tokens"):  # the trainer asks first
        model.check_chunk_layout(64, 16)
    for tokens, chunk in ((x[:, :32], 8), (x, 40)):
        model.check_chunk_layout(tokens.shape[1], chunk)
        _, dense = dense_grad(model, tokens, tokens)
        _, seco = seco_grad(model, tokens, tokens, chunk)
        assert float((flatten(seco) - flatten(dense)).norm() / flatten(dense).norm()) < 1e-13


def test_campaign34_dynamic_rope_grown_by_a_longer_forward_is_reset_for_every_chunk():
    """X6's class, dynamic RoPE: after a forward longer than its positions (transformers grows the frequencies and
    keeps them for a forward ending at the limit exactly), dense used the grown frequencies and the chunks below the
    limit the original ones: seco vs dense 7.9e-4."""
    from seco_lab import dense_grad, flatten, seco_grad
    from seco_lab.models.hf import HFChunkModel

    base = _length_dependent_rope_model("llama-dynamic")
    base(input_ids=torch.randint(0, 64, (1, 64)))  # grows the rotary embedding's frequencies
    model = HFChunkModel(base)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    _, dense = dense_grad(model, x, x)
    _, seco = seco_grad(model, x, x, 8)
    assert float((flatten(seco) - flatten(dense)).norm() / flatten(dense).norm()) < 1e-13


def test_campaign34_a_file_that_cannot_be_replaced_is_named_not_its_temporary_file(tmp_path, monkeypatch):
    """Campaign 34 X7 (T07): an immutable metrics.jsonl on resume gave "r/metrics.jsonl.seco-tmp24697: Operation not
    permitted" -- a file the user never sees, and no way out."""
    import errno
    import os

    from seco_lab import store

    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")

    def refused(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PermissionError) as e:
        store.atomic_write(target, "new\n")
    assert e.value.filename == str(target) and "make it writable" in str(e.value), e.value
    monkeypatch.undo()
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_campaign34_seal_refuses_a_folder_a_running_study_holds(tmp_path, capsys):
    """Campaign 34 T03 (observation): `seal` of an audit folder while the audit ran was accepted without its lock."""
    import shutil
    from pathlib import Path

    from seco_lab.cli import main
    from seco_lab.folder_lock import locked

    folder = tmp_path / "b"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/bias_study", folder)
    before = (folder / "checksums.sha256").read_bytes()
    with locked(folder, "seco-lab bias-study", "wait"):
        assert main(["seal", str(folder)]) == 2
        assert "is in use by a running seco-lab process" in capsys.readouterr().err
    assert (folder / "checksums.sha256").read_bytes() == before
    assert main(["seal", str(folder)]) == 0


def test_campaign35_a_rope_type_given_per_layer_type_is_checked_too():
    """Campaign 35 (P03b-a): Gemma3 with its rope parameters per layer type (longrope for full attention) was not
    seen as length-dependent: seco vs HF's own gradient 0.25, accepted."""
    import transformers

    from seco_lab import dense_grad, flatten, seco_grad
    from seco_lab.models.hf import HFChunkModel

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=128, layer_types=["full_attention"] * 2,
        sliding_window=4096, use_sliding_window=False,
        rope_parameters={"full_attention": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                            "long_factor": [2.0] * 4, "original_max_position_embeddings": 32,
                                            "factor": 4.0, "rope_theta": 10000.0}})
    config._attn_implementation = "eager"
    model = HFChunkModel(transformers.Gemma3ForCausalLM(config).double().eval())
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="longrope RoPE scaling picks its frequencies"):
        seco_grad(model, x, x, 16)
    _, dense = dense_grad(model, x, x)
    _, seco = seco_grad(model, x, x, 48)
    assert float((flatten(seco) - flatten(dense)).norm() / flatten(dense).norm()) < 1e-13


@pytest.mark.parametrize("case", ["router-jitter", "layer-attribute", "noise-in-forward"])
def test_campaign35_noise_and_dropout_set_outside_the_config_are_refused_in_training(case):
    """Campaign 35 (Q01b, Q02b, U1, Q04): Mixtral's router_jitter_noise (a uniform_ draw, no dropout) was accepted in
    training mode (seco vs dense 2e-2); an OPT whose layers' dropout attribute was set after a first step, 0.42; and
    noise drawn in the forward by anything else is found by the first training forward."""
    import transformers

    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel

    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    if case == "router-jitter":
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64,
                                            router_jitter_noise=0.1)
        model = HFChunkModel(transformers.MixtralForCausalLM(config).train())
        says = "router_jitter_noise=0.1 draws dropout or noise in training mode"
    elif case == "layer-attribute":
        config = transformers.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                        dropout=0.0)
        model = HFChunkModel(transformers.OPTForCausalLM(config).double().train())
        seco_grad(model, x, x, 8)  # deterministic: accepted, and its training mode probed
        model.model.model.decoder.layers[0].dropout = 0.1
        says = "layers.0.dropout=0.1 draws dropout or noise in training mode"
    else:
        base = _tiny_llama().double().train()
        base.model.layers[0].mlp.register_forward_hook(
            lambda mod, i, out: out * torch.empty_like(out).uniform_(0.9, 1.1) if mod.training else out)
        model = HFChunkModel(base)
        says = r"its forward draws random numbers \(uniform_\) in training mode"
    with pytest.raises(ValueError, match=says):
        seco_grad(model, x, x, 8)


def test_campaign35_the_hf_trainer_refuses_an_moe_router_loss_it_would_leave_out(tmp_path):
    """Campaign 35 (U2): SeCOTrainer trained a Mixtral with output_router_logits=True without a word, leaving out
    the router's load-balancing loss the stock Trainer adds (stock loss 5.159, SeCO 4.158)."""
    import transformers
    from datasets import Dataset

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True)
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 64, (2, 32)).tolist()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=1,
                                          use_cpu=True, report_to=[], save_strategy="no")
    with pytest.raises(ValueError, match="SeCOTrainer cannot train with output_router_logits=True"):
        SeCOTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                    seco_args=SeCOArguments(chunk_size=16))
    model.config.output_router_logits = False
    SeCOTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                seco_args=SeCOArguments(chunk_size=16))


@pytest.mark.parametrize("records", [
    ['{"step": 1, "loss": 0.5}', '{"step": 3, "loss": 0.4}'],  # O01: a step and a loss, nothing else of a step's
    ['{"step": 9, "loss": 9.9, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0, "backprop_chunks": 4.0, '
     '"seconds": 0.1}'],  # O29: every key of a step's record, at step 9 of a 2-step run
    ['{"step": 0, "eval_loss": 1.0, "note": "mine"}'],
])
def test_campaign35_overwrite_takes_only_a_runs_own_records_for_its_metrics(r2, tmp_path, capsys, records):
    """Campaign 35 O01, O29 (data loss, arguable): a user's metrics.jsonl of {step, loss} records, or of records with
    every key of a step's at a step the run never reached, was deleted by --overwrite."""
    from helpers import FAST, copy_run

    from seco_lab.cli import main

    run = copy_run(r2, tmp_path / "r")
    (run / "metrics.jsonl").write_text("\n".join(records) + "\n")
    capsys.readouterr()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    assert "metrics.jsonl (not a run's metrics log)" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == "\n".join(records) + "\n"


@pytest.mark.parametrize("name", ["adapter/README.md", "checkpoints/step_000005.dcp/extra.pt",
                                  "adapter/adapter_model.safetensors"])
def test_campaign35_overwrite_keeps_a_users_files_under_the_adapter_and_sharded_names(tmp_path, capsys, name):
    """Campaign 35 O13b, O38 (data loss, arguable): a user's notes written into a LoRA run's adapter/README.md, or a
    user's torch.save archive as checkpoints/step_000005.dcp/extra.pt, were deleted by --overwrite; the run's own
    adapter (peft's card, config and weights) is still replaced."""
    from seco_lab.cli import main

    lora = _lora_flags()
    run = tmp_path / "r"
    assert main(["train", *lora, "--run-dir", str(run)]) == 0
    assert main(["train", *lora, "--run-dir", str(run), "--overwrite"]) == 0  # its own adapter files
    path = run / name
    path.parent.mkdir(exist_ok=True)
    if name.endswith(".md"):
        path.write_text("# my notes on this adapter\n")
    elif name.endswith(".safetensors"):  # campaign 36 Y6g: a user's own safetensors file
        from safetensors.torch import save_file

        save_file({"my_embedding": torch.ones(3)}, str(path))
    else:
        torch.save({"my_weights": torch.ones(3)}, path)
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *lora, "--run-dir", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"{name} (not" in err, err
    assert path.read_bytes() == content


def test_campaign35_a_replaced_run_that_cannot_be_emptied_is_said_and_the_new_run_trains(r2, tmp_path, capsys,
                                                                                          monkeypatch):
    """Campaign 35 O24: an immutable config.json under --overwrite gave "error: .u.replaced-nl7j22zj/u/config.json:
    Operation not permitted" (a hidden folder named, no way out) and left a new run folder holding only its marker."""
    import errno

    from helpers import FAST, copy_run

    import seco_lab.training.run_dir as run_dir
    from seco_lab.cli import main

    run = copy_run(r2, tmp_path / "u")

    def refused(path, tree):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path / "config.json"))

    monkeypatch.setattr(run_dir, "remove_own", refused)
    capsys.readouterr()
    with pytest.warns(UserWarning, match="the replaced run's files could not all be removed"):
        assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 0
    assert [r["step"] for r in run_dir.read_metrics(run)][-1] == 2
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".u.replaced-")]
    assert len(aside) == 1 and (aside[0] / "u" / "config.json").is_file()


def test_campaign35_the_curve_is_not_drawn_into_a_folder_another_trainer_holds(r2, tmp_path, capsys):
    """Campaign 35 M10 (observation): the trainer lets the run folder go before the curve is drawn; a trainer that
    took the folder meanwhile would have had this run's curve drawn into it.  The curve is drawn under the lock."""
    from helpers import copy_run

    from seco_lab.cli import draw_curve
    from seco_lab.folder_lock import locked

    run = copy_run(r2, tmp_path / "r")
    (run / "loss.png").unlink()
    with locked(run, "trainer", "wait"):
        assert draw_curve(str(run)) is False
    assert "the loss curve was not drawn" in capsys.readouterr().err and not (run / "loss.png").exists()
    assert draw_curve(str(run)) is True and (run / "loss.png").is_file()


def test_campaign36_the_hf_trainer_takes_gpt2_whose_loss_type_is_none(tmp_path):
    """Campaign 36 V5: SeCOTrainer refused a GPT2LMHeadModel (dropout 0) as "a model whose loss is not the causal-LM
    cross-entropy (loss_type None)": transformers' Trainer goes by loss_type, but GPT-2's forward computes
    ForCausalLMLoss.  It now trains, and its SGD steps equal the stock Trainer's (float64 loss)."""
    import copy

    import transformers
    from datasets import Dataset
    from trainer_case import float64_causal_loss

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer

    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        n_positions=64)).double()
    ids = torch.randint(0, 64, (4, 32)).tolist()

    def train(cls, name, **kw):
        model = copy.deepcopy(base)
        if cls is transformers.Trainer:
            model.loss_function = float64_causal_loss  # transformers' own casts the logits to float32
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                                              max_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                                              optim="sgd", learning_rate=0.1, gradient_accumulation_steps=2)
        cls(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}), **kw).train()
        return {n: p.detach() for n, p in model.named_parameters()}

    stock = train(transformers.Trainer, "stock")
    seco = train(SeCOTrainer, "seco", seco_args=SeCOArguments(chunk_size=8))
    start = dict(base.named_parameters())
    error = sum(float(((seco[n] - stock[n]) ** 2).sum()) for n in stock) ** 0.5
    moved = sum(float(((stock[n] - start[n]) ** 2).sum()) for n in stock) ** 0.5
    assert error / moved < 1e-10


@pytest.mark.parametrize("where, name, value", [
    ("config", "denoise_steps", 10), ("config", "jitter_seed", 42), ("module", "noise_level", 0.5),
    # campaign 38 B3: counts whose names mention dropout or jitter
    ("config", "dropout_warmup_steps", 1), ("config", "jitter_noise_warmup_steps", 100),
    ("config", "jitter_eps_decay_steps", 5), ("module", "n_jitter_noise_calls", 7)])
def test_campaign36_fields_that_only_mention_noise_do_not_refuse_a_deterministic_model(where, name, value):
    """Campaign 36 Z1 (misleading): a deterministic Llama whose config held denoise_steps=10 or jitter_seed=42, or a
    module an unused noise_level=0.5, was refused as drawing noise; it trains, exact.  Campaign 38 B3: so do counts
    named like a dropout or jitter field (``dropout_warmup_steps=1``)."""
    from seco_lab import dense_grad, flatten, seco_grad
    from seco_lab.models.hf import HFChunkModel

    base = _tiny_llama().double().train()
    setattr(base.config if where == "config" else base.model, name, value)
    model = HFChunkModel(base)
    assert model.deterministic
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    _, dense = dense_grad(model, x, x)
    _, seco = seco_grad(model, x, x, 8)
    assert float((flatten(seco) - flatten(dense)).norm() / flatten(dense).norm()) < 1e-13


def _lora_flags(*extra):
    from helpers import FAST

    return [*FAST[:FAST.index("--d-model")], "--hf-model", "llama", "--hf-override", "hidden_size=32",
            "--hf-override", "num_hidden_layers=1", "--hf-override", "num_attention_heads=4",
            "--hf-override", "num_key_value_heads=4", "--hf-override", "intermediate_size=64", "--lora", *extra]


def _crafted_header(path):
    """Campaign 36 Y6l: a user's notes behind an 8-byte length and a JSON header that names LoRA tensors."""
    import json

    header = json.dumps({"base_model.model.q.lora_A.weight": {"dtype": "F32", "shape": [4, 32],
                                                              "data_offsets": [0, 512]},
                         "base_model.model.q.lora_B.weight": {"dtype": "F32", "shape": [32, 4],
                                                              "data_offsets": [512, 1024]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"my notes, not tensors\n")


def _other_rank(path):
    """A user's LoRA factors of rank 3 beside a peft config of rank 4."""
    from safetensors.torch import save_file

    save_file({"base_model.model.q.lora_A.weight": torch.ones(3, 32),
               "base_model.model.q.lora_B.weight": torch.ones(32, 3)}, str(path))


@pytest.mark.parametrize("name, write, says", [
    ("adapter_model.bin", lambda p: p.write_text("my notes\n"), "adapter/adapter_model.bin"),
    ("adapter_model.bin", lambda p: torch.save({"base_model.model.q.lora_A.weight": torch.ones(4, 32)}, p),
     "adapter/adapter_model.bin"),
    ("adapter_model.safetensors", _crafted_header, "adapter/adapter_model.safetensors (not peft's LoRA weights)"),
    ("adapter_model.safetensors", _other_rank, "adapter/adapter_model.safetensors (not peft's LoRA weights)"),
])
def test_campaign36_overwrite_keeps_a_users_file_under_the_adapters_weight_names(tmp_path, capsys, name, write,
                                                                                  says):
    """Campaign 36 Y6k, Y6l (data loss, arguable): a user's file kept as adapter/adapter_model.bin (judged by its name:
    peft writes safetensors only, so a .bin is never the run's) or as adapter_model.safetensors behind a crafted
    header, or LoRA factors of another rank than the adapter's config, was deleted by --overwrite."""
    from seco_lab.cli import main

    run = tmp_path / "r"
    assert main(["train", *_lora_flags(), "--run-dir", str(run)]) == 0
    path = run / "adapter" / name
    write(path)
    content = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *_lora_flags(), "--run-dir", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert path.read_bytes() == content


def test_campaign36_overwrite_replaces_its_own_adapter_of_an_embedding_and_an_output_head(tmp_path, capsys):
    """peft saves the base weight of an adapted embedding or output head beside its factors
    (``...embed_tokens.base_layer.weight``): the run's own adapter of ``--lora-targets embed_tokens,lm_head,q_proj``
    is its own, replaced by --overwrite (the check of campaign 36 Y6g took it for a user's file)."""
    from safetensors import safe_open

    from seco_lab.cli import main

    flags = _lora_flags("--lora-targets", "embed_tokens,lm_head,q_proj", "--lora-r", "2")
    run = tmp_path / "r"
    assert main(["train", *flags, "--run-dir", str(run)]) == 0
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), framework="numpy") as f:
        assert {"base_model.model.model.embed_tokens.base_layer.weight",
                "base_model.model.lm_head.base_layer.weight"} <= set(f.keys())
    capsys.readouterr()
    assert main(["train", *flags, "--run-dir", str(run), "--overwrite"]) == 0, capsys.readouterr().err
