"""Issue 19, fourth hostile campaign (a reviewer who wrote none of the fixes, on a fresh clone): the inputs
it found still mishandled, and the ones left over from campaign 3, each with the fix's test."""

import pytest


@pytest.mark.parametrize("name", ["", "   "])
def test_build_hf_model_refuses_an_empty_name_before_asking_the_hub(name):
    """``Path("")`` is the current directory: an empty name used to reach transformers' Hub lookup."""
    from seco_lab.hf import build_hf_model

    with pytest.raises(ValueError, match="must name an architecture .* or a local checkpoint directory"):
        build_hf_model(name)


def test_the_readme_names_build_hf_models_arguments_as_they_are():
    import inspect
    from pathlib import Path

    from seco_lab.hf import build_hf_model

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = readme.split("`build_hf_model(", 1)[1].split(")`", 1)[0]
    params = list(inspect.signature(build_hf_model).parameters)
    assert [a.strip() for a in shown.split(",")[1:]] == params[1: len(shown.split(","))], shown
