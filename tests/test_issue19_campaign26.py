"""Issue 19, hostile campaign 26 (docs/hostile_campaign_26.md): the findings fixed after it."""
import os
import shutil
from pathlib import Path

import pytest
from test_issue19_campaign25 import _legend, _runs

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _latin1(folder: Path, name: bytes) -> Path:
    """``folder/name`` where ``name`` is bytes that are not UTF-8, as Python spells it (surrogates)."""
    return Path(os.fsdecode(os.path.join(os.fsencode(folder), name)))


def test_a_run_folder_not_named_in_utf8_is_plotted_with_its_name_escaped(tmp_path, capsys):
    """PL46: a run folder named in Latin-1 (``caf\\xe9``) made matplotlib's font renderer raise a TypeError."""
    from seco_lab.report.runs import runs_figure

    (run,) = _runs(tmp_path, ["r"])
    latin = _latin1(tmp_path, b"caf\xe9")
    run.rename(latin)
    texts, _ = _legend(runs_figure([latin]))
    assert texts[0][0].startswith("caf\\xe9: seco")
    assert main(["plot", str(latin), "--out", str(tmp_path / "x.png")]) == 0


def test_a_report_of_results_in_a_folder_not_named_in_utf8_is_written(tmp_path, capsys):
    """SE21b: `report bench --results r\\xe9s` failed with a UnicodeEncodeError traceback writing the Markdown (the
    folder's path is in its text); the path is written with its escape, and a report --out not in UTF-8 (its figure
    links would not resolve) is refused in one line."""
    results = _latin1(tmp_path, b"r\xe9s")
    shutil.copytree(ROOT / "reports" / "bench", results)
    out = tmp_path / "b.md"
    assert main(["report", "bench", "--results", str(results), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "r\\xe9s" in out.read_text(encoding="utf-8")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["report", "bench", "--results", str(results), "--out", str(_latin1(tmp_path, b"b\xe9.md"))])
    err = capsys.readouterr().err
    assert "is not named in UTF-8" in err and "Traceback" not in err
