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


def _audit_like(tmp_path):
    """A results folder as `seco-lab audit` leaves it: its own report.md recorded beside the tables."""
    folder = tmp_path / "a"
    folder.mkdir()
    store.start_checksums(folder)
    store.atomic_write_json(folder / "audit.json", {"command": "seco-lab audit", "versions": {}})
    store.atomic_write(folder / "bias.csv", "x\n1\n")
    store.atomic_write(folder / "report.md", "# audit\n")
    return folder


def test_campaign24_f6_seal_accepts_the_checksum_file_seco_lab_audit_writes(tmp_path, capsys, monkeypatch):
    """Campaign 24 F6: seal refused every folder `seco-lab audit` writes ("lists report.md ... not a checksum file
    seco-lab wrote"), the remedy the audit itself names for a unit deleted on purpose."""
    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)
    a = _audit_like(tmp_path)
    assert "report.md" in (a / store.CHECKSUMS).read_text()
    (a / "bias.csv").write_text("x\n2\n")  # edited on purpose: the user vouches for it
    assert main(["seal", str(a)]) == 0, capsys.readouterr().err
    store.verify_checksums(a, "the test")


@pytest.mark.parametrize("entry", ["fifo", "link", "folder", "newline"])
def test_campaign24_f4_seal_refuses_a_results_name_it_cannot_record_and_writes_nothing(tmp_path, capsys, entry):
    """Campaign 24 F4: seal said "sealed" while skipping a FIFO, a link or a name with a line break; every report
    then refused the folder and named seal as the fix, which changed nothing."""
    import os

    a = _audit_like(tmp_path)
    before = (a / store.CHECKSUMS).read_text()
    if entry == "fifo":
        os.mkfifo(a / "extra.csv")
    elif entry == "link":
        (a / "extra.csv").symlink_to(a / "bias.csv")
    elif entry == "folder":
        (a / "extra.csv").mkdir()
    else:
        (a / "ex\ntra.csv").write_text("x\n1\n")
    capsys.readouterr()
    assert main(["seal", str(a)]) == 2
    err = capsys.readouterr().err
    assert "nothing was written" in err and ("line break" in err if entry == "newline" else "extra.csv" in err)
    assert (a / store.CHECKSUMS).read_text() == before
