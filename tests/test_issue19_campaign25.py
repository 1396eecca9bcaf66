"""Issue 19, hostile campaign 25 (docs/hostile_campaign_25.md): the findings in plotting, reports and seal."""
import json
import os
import shutil
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from seco_lab import store
from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"mode": "seco", "data": "synthetic", "seq_len": 64, "chunk_size": 32, "steps": 2, "seed": 0, "lr": 1e-3}


def _runs(tmp_path, names):
    runs = []
    for i, name in enumerate(names):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps(CONFIG))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10 - i / 100,
                                                               **({"eval_loss": 4.0} if s == 2 else {})}) + "\n"
                                                   for s in (1, 2)))
        runs.append(run)
    return runs


def _legend(fig):
    """The legend's entries as drawn: (text, drawn as mathtext), and the (colour, line style) of each entry."""
    FigureCanvasAgg(fig).draw()
    legend = fig.axes[0].get_legend()
    texts = [(t.get_text(), t._preprocess_math(t.get_text())[1]) for t in legend.get_texts()]
    styles = [(h.get_color(), h.get_linestyle()) for h in legend.legend_handles]
    return texts, styles


@pytest.mark.parametrize("names", [["_base", "other"], ["$x^2$", "_old"], ["a$b", "run_$LR$"]])
def test_n1_every_run_has_a_legend_entry_that_reads_as_its_folder(tmp_path, names):
    """N1 (PL01, PL02): matplotlib left out of the legend a run folder named ``_base`` (a label starting with
    ``_``), and drew ``$x^2$`` as mathtext: two curves, one legend entry, or an entry that is not the folder."""
    from seco_lab.report.runs import runs_figure

    texts, _ = _legend(runs_figure(_runs(tmp_path, names)))
    assert len(texts) == len(names)
    for name, (text, math) in zip(names, texts, strict=True):
        assert not math  # drawn literally
        assert text.replace(r"\$", "$").startswith(f"{name}: seco")


def test_n1_runs_past_ten_keep_distinct_styles_and_past_the_limit_are_refused(tmp_path):
    """N1 (K28): the 11th run reused the first run's colour, so two legend entries looked the same."""
    from seco_lab.report.runs import MAX_RUNS, runs_figure

    runs = _runs(tmp_path, [f"run{i:02d}" for i in range(MAX_RUNS + 1)])
    texts, styles = _legend(runs_figure(runs[:MAX_RUNS]))
    assert len(texts) == MAX_RUNS and len(set(styles)) == MAX_RUNS
    with pytest.raises(ValueError, match=f"at most {MAX_RUNS} can be told apart"):
        runs_figure(runs)


def test_n1_the_plot_command_draws_an_underscore_folder(tmp_path, capsys):
    runs = _runs(tmp_path, ["_base", "other"])
    out = tmp_path / "x.png"
    assert main(["plot", *map(str, runs), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_n5_runs_figure_of_no_runs_is_a_clear_error():
    """N5 (K30): ``runs_figure([])`` failed inside ``max()``."""
    from seco_lab.report.runs import distinct_names, runs_figure

    assert distinct_names([]) == []
    with pytest.raises(ValueError, match="no run folder given"):
        runs_figure([])


def test_n4_seal_names_a_link_to_a_results_folder_as_a_link_and_the_folder_to_seal(tmp_path, capsys):
    """N4 (SA08): seal on a symlink to a results folder said "is not a folder"; it is a folder -- reached by a link,
    which seal does not write through."""
    folder = tmp_path / "b"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    (tmp_path / "blink").symlink_to(folder)
    before = (folder / store.CHECKSUMS).read_bytes()
    with pytest.raises(SystemExit):
        main(["seal", str(tmp_path / "blink")])
    err = capsys.readouterr().err
    assert "is a link to the folder" in err and f"seco-lab seal {folder.resolve()}" in err
    assert "is not a folder" not in err
    assert (folder / store.CHECKSUMS).read_bytes() == before


def test_n4_a_results_name_not_in_utf8_is_refused_by_seal_and_report_with_the_remedy(tmp_path, capsys, monkeypatch):
    """N4 (SA13): a results file named in Latin-1 (``caf\\xe9.csv``) made seal fail with a bare codec error naming
    no file, while the report refusing the folder named seal as the fix."""
    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)
    folder = tmp_path / "b"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    latin1 = os.path.join(os.fsencode(folder), b"caf\xe9.csv")
    with open(latin1, "wb") as f:
        f.write(b"a\n1\n")
    before = (folder / store.CHECKSUMS).read_bytes()
    assert main(["seal", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "b'caf\\xe9.csv' is not named in UTF-8" in err and "rename it in UTF-8 or move it away" in err
    assert "codec" not in err and "nothing was written" in err
    assert (folder / store.CHECKSUMS).read_bytes() == before
    assert main(["report", "bench", "--results", str(folder), "--out", str(tmp_path / "b.md")]) == 2
    err = capsys.readouterr().err
    assert "is not named in UTF-8" in err and "rename it in UTF-8 or move it away" in err
    assert not (tmp_path / "b.md").exists()
    os.rename(latin1, folder / "cafe.csv")  # the remedy it names works
    assert main(["seal", str(folder)]) == 0


def test_n6_the_report_inside_an_audit_folder_keeps_its_bare_figures_folder(tmp_path, capsys):
    """N6's other side: ``report.md`` is the audit's own name inside the audit's folder (what `seco-lab audit`
    writes), so its figure stays in that folder's ``figures/``; only a report.md elsewhere gets ``figures/report``."""
    results = tmp_path / "a"
    shutil.copytree(ROOT / "reports" / "audit" / "k128", results)
    assert main(["report", "audit", "--results", str(results), "--out", str(results / "report.md")]) == 0
    assert (results / "figures" / "audit_strata_profile.png").is_file()
    assert "](figures/audit_strata_profile.png)" in (results / "report.md").read_text()
    assert not (results / "figures" / "report").exists()
