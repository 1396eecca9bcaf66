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


@pytest.mark.parametrize("name", [" lead.csv", "vt\vx.csv", "ls\u2028x.csv"])  # \v, U+2028: campaign 27 Q2
def test_p5_a_results_name_with_a_leading_space_is_refused_by_seal_and_report_alike(tmp_path, capsys, monkeypatch,
                                                                                     name):
    """P5: seal recorded ' lead.csv' in a line no reader could parse back; the report then called the checksum file
    damaged and named seal, which refused its own file as "it may be yours"."""
    from seco_lab import store

    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)
    folder = tmp_path / "b"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    (folder / name).write_text("a\n1\n")
    before = (folder / store.CHECKSUMS).read_bytes()
    assert main(["seal", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"{name!r} is named with a line break or a leading or trailing space" in err
    assert f"seco-lab seal: error: {folder}: the results file" in err  # the folder named once (campaign 28)
    assert "rename it or move it away, then seal; nothing was written" in err
    assert (folder / store.CHECKSUMS).read_bytes() == before
    assert main(["report", "bench", "--results", str(folder), "--out", str(tmp_path / "b.md")]) == 2
    err = capsys.readouterr().err
    assert f"{name!r} is named with a line break or a leading or trailing space" in err and "damaged" not in err
    (folder / name).rename(folder / "lead.csv")  # the remedy it names works
    assert main(["seal", str(folder)]) == 0


def test_p8_runs_figure_refuses_a_single_path_and_names_a_missing_run(tmp_path):
    """P8: ``runs_figure("run00")`` drew the runs r, u, n, 0, 0, and a missing folder was "holds no metrics yet"."""
    from seco_lab.report.runs import runs_figure

    (run,) = _runs(tmp_path, ["run00"])
    with pytest.raises(TypeError, match="got the single path"):
        runs_figure(str(run))
    with pytest.raises(ValueError, match="not a run directory"):
        runs_figure([tmp_path / "no_such_run"])
