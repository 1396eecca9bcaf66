"""pytest configuration: thread count, hypothesis profiles, the integration marker, and two shared fixtures (``r2``,
a finished 2-step run; ``audit_copy``, a copy of the committed k = 128 audit).  Shared helpers live in helpers.py."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)  # tests run in parallel workers; tiny models gain nothing from threads
# Reports verify every stored file against the checksums its study recorded (seco_lab.store.verify_checksums), which
# refuses any edited file first.  Most tests edit stored files on purpose to test the checks behind that one (for
# results a user vouched for with `seco-lab seal`), so the suite reads without it; tests/test_checksums.py and
# the regeneration of the committed reports turn it back on.
os.environ.setdefault("SECO_LAB_NO_CHECKSUMS", "1")

settings.register_profile(
    "seco",
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "explore": random examples, to probe tolerances over many --hypothesis-seed values once
settings.register_profile("explore", parent=settings.get_profile("seco"), derandomize=False, max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seco"))


# The unit loop (`make test-unit`: -m "not integration") leaves out what runs whole programs: every slow test,
# and the modules below (studies end to end, distributed ranks, HF and pretrained models, benchmarks, installs).
# `make test` runs everything.
INTEGRATION_MODULES = {"test_bench", "test_bias_study", "test_fsdp", "test_hf", "test_install", "test_pretrained",
                       "test_train_study"}
# ... and the unit tests measured slow (0.3 s or more) by `python -m experiments.slow_unit_tests`, which rewrites this
# list, so that the unit loop stays under a minute on 2 cores.
SLOW_UNIT_TESTS = Path(__file__).with_name("slow_unit_tests.txt")


def slow_unit_tests() -> set:
    if os.environ.get("SECO_LAB_TESTS_IGNORE_SLOW_LIST"):  # set by the measuring script's first pass
        return set()
    lines = SLOW_UNIT_TESTS.read_text().splitlines() if SLOW_UNIT_TESTS.exists() else []
    return {line for line in lines if line and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    slow = slow_unit_tests()
    for item in items:
        module = getattr(item, "module", None)
        if (item.get_closest_marker("slow") or (module is not None and module.__name__ in INTEGRATION_MODULES)
                or item.nodeid in slow):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def r2(tmp_path_factory):
    """A finished 2-step run of the tiny model (``helpers.FAST``), one per test module; copy it before changing it
    (``helpers.copy_run``)."""
    from helpers import FAST

    from seco_lab.cli import main

    base = tmp_path_factory.mktemp("runs")
    assert main(["train", *FAST, "--run-dir", str(base / "r2")]) == 0
    return base / "r2"


@pytest.fixture
def audit_copy(tmp_path):
    """A copy of the committed audit ``reports/audit/k128`` (its units, tables and stored Grams; without the flat
    vectors, which are not committed, and a lock file) to damage."""
    import shutil
    from pathlib import Path

    out = tmp_path / "a"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/audit/k128", out,
                    ignore=shutil.ignore_patterns("vectors", ".lock"))
    return out
