"""Campaign 23's misleading findings about ``seco-lab seal`` (docs/hostile_campaign_23.md, M1 and M2)."""
import hashlib
import json

import pytest

from seco_lab import store
from seco_lab.cli import main


def _user_folder(tmp_path, record: str | None):
    d = tmp_path / "d"
    d.mkdir()
    (d / "data.csv").write_text("1,2\n")
    if record is not None:
        (d / "study.json").write_text(record)
    mine = f"{hashlib.sha256(b'1,2').hexdigest()}  data.csv\n"
    (d / "SHA256SUMS").write_text(mine)
    return d


@pytest.mark.parametrize("record", ["notjson\n", "{}\n", "[1, 2]\n", '{"name": "my-project"}\n'])
def test_m1_a_study_json_seco_lab_did_not_write_does_not_make_a_folder_sealable(tmp_path, capsys, record):
    """M1: any file named study.json (not JSON, ``{}``) made seal write a checksum file into a user's folder."""
    d = _user_folder(tmp_path, record)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    assert main(["seal", str(d)]) == 2
    err = capsys.readouterr().err
    assert "not a results folder seco-lab wrote" in err and "nothing was written" in err
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_m1_a_record_seco_lab_wrote_still_marks_its_folder(tmp_path, capsys):
    d = _user_folder(tmp_path, json.dumps({"config": {}, "software": {"seco_lab": "x"}}))
    assert main(["seal", str(d)]) == 0
    assert store.verify_checksums(d, "the test") is not None
    assert "data.csv" in (d / store.CHECKSUMS).read_text()


@pytest.mark.parametrize("content", [
    "SHA256 (data.csv) = " + "0" * 64 + "\n",  # sha256sum --tag
    "garbage line\n",
])
def test_m2_seal_refusing_a_foreign_checksum_file_does_not_name_itself_as_the_remedy(tmp_path, capsys, content):
    """M2: the refusal ended "... or `seco-lab seal d` to vouch for its files", the command that just refused."""
    d = _user_folder(tmp_path, json.dumps({"software": {}}))
    (d / store.CHECKSUMS).write_text(content)
    assert main(["seal", str(d)]) == 2
    err = capsys.readouterr().err
    assert "seco-lab seal" not in err.split("error:", 1)[1] and "move it away" in err
    assert (d / store.CHECKSUMS).read_text() == content


def test_m2_a_report_still_names_seal_as_the_remedy_for_a_damaged_checksum_file(tmp_path, monkeypatch):
    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)
    store.start_checksums(tmp_path)
    store.atomic_write(tmp_path / "a.csv", "x\n1\n")
    (tmp_path / store.CHECKSUMS).write_text("garbage\n")
    with pytest.raises(store.ChecksumError, match="the checksum file is damaged.*seco-lab seal"):
        store.verify_checksums(tmp_path, "the test")
