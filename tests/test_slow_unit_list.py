"""The list of slow unit tests (tests/slow_unit_tests.txt, written by `python -m experiments.slow_unit_tests`) that
keeps `make test-unit` under a minute: every entry names a test that exists, and conftest marks exactly those."""

import re
from pathlib import Path

from conftest import SLOW_UNIT_TESTS, slow_unit_tests

ROOT = Path(__file__).resolve().parent.parent


def test_every_listed_slow_test_names_a_test_function_that_exists():
    listed = slow_unit_tests()
    assert listed, f"{SLOW_UNIT_TESTS} lists no test: rerun `python -m experiments.slow_unit_tests`"
    for node in listed:
        path, _, name = node.partition("::")
        function = re.sub(r"\[.*\]$", "", name)
        source = ROOT / path
        assert source.is_file(), f"{node}: no file {path} (rerun `python -m experiments.slow_unit_tests`)"
        assert re.search(rf"^\s*def {re.escape(function)}\(", source.read_text(), re.M), (
            f"{node}: no test {function} in {path} (rerun `python -m experiments.slow_unit_tests`)")


def test_the_listed_tests_are_marked_integration_and_the_others_are_not(request):
    listed = slow_unit_tests()
    items = request.session.items
    marked = {i.nodeid for i in items if i.get_closest_marker("integration")}
    collected = {i.nodeid for i in items}
    assert listed & collected <= marked
    assert request.node.nodeid not in marked  # this module is neither listed nor an integration module


def test_the_measuring_pass_can_ignore_the_list(monkeypatch):
    monkeypatch.setenv("SECO_LAB_TESTS_IGNORE_SLOW_LIST", "1")
    assert slow_unit_tests() == set()
    monkeypatch.delenv("SECO_LAB_TESTS_IGNORE_SLOW_LIST")
    assert slow_unit_tests()

