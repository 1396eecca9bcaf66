"""Issue 19, campaign 25 (models), N3: a damaged local checkpoint folder (``--hf-model DIR``) is refused in one line
naming the file -- a truncated or empty ``model.safetensors`` (MD02, MD03), NaN weights (MD05), a config with a
negative size (MD16) or with heads that do not divide the hidden size (MD07) -- instead of a traceback from
safetensors, torch or transformers; and so is a well-formed ``.gguf`` file transformers cannot build a model from."""

import json
import shutil

import pytest
from test_issue19_campaign24_models import _tiny_gguf

from seco_lab.models import pretrained  # noqa: E402
from seco_lab.models.hf import build_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """A tiny valid Llama checkpoint folder (config.json + model.safetensors), written by save_pretrained."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("ckpt") / "ck"
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=64, intermediate_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _set_config(**fields):
    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(fields)
        (folder / "config.json").write_text(json.dumps(config))
    return damage


def _rewrite_weights(change):
    def damage(folder):
        path = folder / "model.safetensors"
        path.write_bytes(change(path.read_bytes()))
    return damage


def _drop_tensor(name):
    def damage(folder):
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        del weights[name]
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return damage


# name -> (damage, the file the message names, what it says)
DAMAGES = {
    "MD02-truncated": (_rewrite_weights(lambda b: b[:5000]), "model.safetensors", "is damaged or truncated"),
    "MD03-empty": (_rewrite_weights(lambda b: b""), "model.safetensors", "is damaged or truncated"),
    "MD05-nan-weights": (_rewrite_weights(lambda b: b[:-100] + b"\xff" * 100), "model.safetensors",
                         "holds non-finite weights"),
    "inf-weight": (_rewrite_weights(lambda b: b[:-4] + b"\x00\x00\x80\x7f"), "model.safetensors",  # float32 +inf
                   "holds non-finite weights"),
    "MD16-negative-vocab": (_set_config(vocab_size=-3), "config.json", "vocab_size is -3"),
    "MD07-heads-do-not-divide": (_set_config(hidden_size=30), "config.json", "not a multiple of the number of"),
    "zero-layers": (_set_config(num_hidden_layers=0), "config.json", "num_hidden_layers is 0"),
    "weights-do-not-fit-config": (_set_config(hidden_size=64), "", "does not load as a causal LM"),
    # campaign 26 (MD32, MD33, MD40, MD42): tracebacks, or a NaN loss at the first evaluation
    "zero-heads": (_set_config(num_attention_heads=0), "config.json", "is not a valid model config"),
    "unknown-activation": (_set_config(hidden_act="nonsense"), "config.json", "hidden_act is 'nonsense'"),
    "zero-rope-theta": (_set_config(rope_parameters={"rope_theta": 0.0, "rope_type": "default"}), "config.json",
                        "rope_theta is 0.0, but it must be > 0"),
    "negative-rope-theta": (_set_config(rope_parameters={"rope_theta": -5.0, "rope_type": "default"}),
                            "config.json", "rope_theta is -5.0"),
    "negative-norm-eps": (_set_config(rms_norm_eps=-1.0), "config.json", "rms_norm_eps is -1.0, but it must be >= 0"),
    # campaign 26 MD28: one tensor missing, which transformers initialised at random (only its load report said so)
    "missing-tensor": (_drop_tensor("model.norm.weight"), "model.safetensors",
                       "lacks 1 weight(s) the model needs (model.norm.weight)"),
}


def _damaged_copy(intact, tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(intact, folder)
    DAMAGES[name][0](folder)
    return folder


def test_an_intact_checkpoint_builds(intact):
    model = build_hf_model(str(intact))
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_damaged_checkpoint_folder_is_refused_in_one_line_naming_the_file(intact, tmp_path, name):
    folder = _damaged_copy(intact, tmp_path, name)
    _, file, says = DAMAGES[name]
    with pytest.raises(ValueError) as e:
        build_hf_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and says in msg, msg
    assert str(folder / file).rstrip("/") in msg, msg
    assert "re-save it with save_pretrained or copy it again" in msg, msg


def test_a_well_formed_gguf_file_transformers_cannot_build_is_refused_in_one_line(tmp_path):
    path = tmp_path / "m.gguf"
    _tiny_gguf(path)  # hidden size 8, transformers' default 32 heads: it cannot build a Llama from it
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="is a readable GGUF file, but transformers cannot build") as e:
        pretrained.build_pretrained(str(path), cache=cache)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "hidden size (8)" in msg, msg
    assert not any(cache.glob("*/config.json")), "nothing is cached for a file that does not build"


@pytest.mark.parametrize("name", ["MD02-truncated", "MD05-nan-weights"])
def test_a_damaged_checkpoint_folder_is_one_cli_error_line(intact, tmp_path, capsys, name):
    from seco_lab.cli import main

    folder = _damaged_copy(intact, tmp_path, name)
    rc = main(["train", "--hf-model", str(folder), "--data", "synthetic", "--steps", "1", "--warmup", "0",
               "--seq-len", "16", "--chunk-size", "8", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
               "--no-progress"])
    assert rc not in (0, None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("seco-lab train: error:")]
    assert len(lines) == 1 and str(folder / "model.safetensors") in lines[0], err
    assert "Traceback" not in err, err
