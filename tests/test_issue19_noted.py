"""Issue 19: small findings that earlier hostile campaigns noted and left (docs/hostile_campaign_16.md, _18.md)."""

from seco_lab.cli import main


def test_an_existing_file_without_suffix_as_report_target_gets_a_sensible_example(capsys, tmp_path, monkeypatch):
    """Campaign 16: `report real --out /dev/null` suggested `/dev/null/real_study.md`, a path under a device."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("mine\n")
    for out in ("/dev/null", "notes"):
        try:
            main(["report", "real", "--out", out])
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err
        assert "exists and is not a Markdown report" in err and "e.g. real_study.md" in err and f"{out}/" not in err
    assert (tmp_path / "notes").read_text() == "mine\n"


def test_a_byte_order_mark_before_the_first_metrics_record_is_not_a_torn_line(tmp_path, recwarn):
    """Campaign 18: a complete record behind a UTF-8 BOM (an editor's save) was dropped as "a torn last line"."""
    from seco_lab.training.run_dir import read_metrics

    (tmp_path / "metrics.jsonl").write_bytes(b'\xef\xbb\xbf{"step": 0, "eval_loss": 5.5}\n')
    assert read_metrics(tmp_path) == [{"step": 0, "eval_loss": 5.5}]
    assert not [w for w in recwarn if "torn" in str(w.message)]
