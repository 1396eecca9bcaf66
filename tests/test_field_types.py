"""The field-type checker shared by the configuration and the CLI (``seco_lab.field_types``), and
``validate()`` checking without changing what it checks."""

from dataclasses import asdict

import pytest

from seco_lab.config import RunControl, TrainConfig
from seco_lab.field_types import type_name, type_ok, unwrap_optional


@pytest.mark.parametrize("value, hint, ok", [
    (1, int, True), (True, int, False), (1, float, True), (1.5, int, False), (None, float | None, True),
    ("a", float | None, False), ([1, 2], list[int], True), ([1, "x"], list[int], False), ((0.9, 0.95),
    tuple[float, float], True), ({"a": 1}, dict, True), (False, bool, True), (0, bool, False),
])
def test_type_ok(value, hint, ok):
    assert type_ok(value, hint) is ok


def test_unwrap_optional_and_type_name():
    assert unwrap_optional(float | None) == (float, True)
    assert unwrap_optional(int) == (int, False)
    assert type_name(list[str]) == "list[str]"


def test_validate_checks_without_changing_the_config():
    cfg = TrainConfig()
    cfg.clip = 0.0  # set after construction: validate must not rewrite it
    before = asdict(cfg)
    assert cfg.validate() is cfg and asdict(cfg) == before
    run = RunControl()
    before = asdict(run)
    assert asdict(run.validate()) == before


def test_clip_zero_means_no_clipping_from_construction_on():
    assert TrainConfig(clip=0.0).clip is None and TrainConfig(clip=0).clip is None
    assert TrainConfig.from_dict({"clip": 0}).clip is None
    with pytest.raises(ValueError, match="clip must be >= 0"):
        TrainConfig(clip=-1.0).validate()
