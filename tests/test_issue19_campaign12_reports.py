"""Campaign 12, G3 and G7: `report bench` and `report train-compare` averaged rows with a repeated key and printed
derived or config values as stored.  Each test fails on 336b4dc, the commit before the fix."""

import csv
import json
import shutil
from pathlib import Path

import pytest

from seco_lab.cli import main
from seco_lab.report.markdown import MissingResultsError

ROOT = Path(__file__).resolve().parents[1]


def _copy(tmp_path, folder):
    out = tmp_path / folder
    shutil.copytree(ROOT / "reports" / folder, out)
    return out


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def _set(path, row, column, value):
    """Cell (data row ``row``, 1-based as in the file minus the header; ``column`` by name) set to ``value``."""
    rows = _rows(path)
    rows[row][rows[0].index(column)] = value
    _write(path, rows)


def _repeat(path, row, changes):
    """Data row ``row`` appended again, with ``changes`` (column -> value): a second study's row joined on."""
    rows = _rows(path)
    extra = list(rows[row])
    for column, value in changes.items():
        extra[rows[0].index(column)] = value
    _write(path, rows + [extra])


def _report(kind, folder, tmp_path, capsys):
    capsys.readouterr()
    rc = main(["report", kind, "--results", str(folder), "--out", str(tmp_path / "r.md")])
    return rc, capsys.readouterr().err


# -- G3: a repeated key is refused, not averaged ------------------------------------------------------------------

def test_g3_train_compare_refuses_two_far_loss_rows_of_one_step(tmp_path, capsys):
    """C04: a second (dense, step 0) row was averaged into 'Far-token loss at step 0' (4.045, stored 4.275)."""
    folder = _copy(tmp_path, "training")
    text = (folder / "far_loss.csv").read_text()
    (folder / "far_loss.csv").write_text(text.replace("\ndense,100,", "\ndense,0,"))
    rc, err = _report("train-compare", folder, tmp_path, capsys)
    assert rc == 2 and not (tmp_path / "r.md").exists()
    assert "far_loss.csv holds 1 row(s) whose (mode, step) repeats an earlier row" in err
    assert "mode=dense, step=0" in err and "two studies joined?" in err and len(err.strip().splitlines()) == 1


def test_g3_train_compare_refuses_two_throughput_rows_of_one_mode(tmp_path, capsys):
    folder = _copy(tmp_path, "training")
    _repeat(folder / "throughput.csv", 1, {"tokens_per_s": "1.0"})
    rc, err = _report("train-compare", folder, tmp_path, capsys)
    assert rc == 2 and "throughput.csv holds 1 row(s) whose (mode) repeats an earlier row" in err


def test_g3_bench_refuses_two_results_rows_of_one_measurement(tmp_path, capsys):
    """N08: two (2048, dense, peak_mib) rows were averaged: SeCO/dense memory 0.765 (was 0.595), and the dense
    memory growth was measured from 2048 instead of 1024."""
    folder = _copy(tmp_path, "bench")
    text = (folder / "results.csv").read_text()
    (folder / "results.csv").write_text(text.replace("\n1024,dense,dense,,,,", "\n2048,dense,dense,,,,", 1))
    rc, err = _report("bench", folder, tmp_path, capsys)
    assert rc == 2 and not (tmp_path / "r.md").exists()
    assert "results.csv holds 1 row(s) whose (length, label, metric) repeats an earlier row" in err
    assert "length=2048, label=dense, metric=peak_mib" in err


def test_g3_bench_results_error_rows_may_repeat_values_may_not(tmp_path):
    """A memory error and a timing error of one configuration are two rows of metric 'error': no value, nothing
    averaged, both said; the key check leaves them be, and refuses a repeated value next to them."""
    from seco_lab.report.bench import load_bench

    folder = _copy(tmp_path, "bench")
    rows = _rows(folder / "results.csv")
    err = dict(zip(rows[0], rows[1]), metric="error", value="", note="timed out")
    _write(folder / "results.csv", rows + [[err[c] for c in rows[0]]] * 2)
    df, _ = load_bench(folder)
    assert (df.metric == "error").sum() == 2
    _repeat(folder / "results.csv", 1, {"value": "1.0"})
    with pytest.raises(MissingResultsError, match=r"whose \(length, label, metric\) repeats an earlier row \(first: "
                       r"row 130, length=1024, label=forward, metric=peak_mib\)"):
        load_bench(folder)


@pytest.mark.parametrize("table, row, changes, key", [
    ("hf_results.csv", 1, {"value": "1.0"}, "(tag, n_layers, chunk_size, length, lora, label, metric)"),
    ("fsdp_results.csv", 1, {"peak_mib": "1.0"}, "(round, mode, rank)"),
    ("strata_cost.csv", 1, {"seco_cpu_s": "1.0", "strata_cpu_s": "2.0", "ratio": "2.0"},
     "(length, chunk_size, max_hops, tag, rev, round)"),
    ("hf_profile_after.csv", 1, {}, "(op)"),
])
def test_g3_bench_sections_refuse_repeated_rows(table, row, changes, key, tmp_path):
    """The hf, fsdp, strata and profile tables are read by `report bench` too: a repeated row went into a median
    or a maximum as if it were another round or rank."""
    from seco_lab.report import bench, bench_fsdp, bench_hf

    folder = _copy(tmp_path, "bench")
    _repeat(folder / table, row, changes)
    read = {"hf_results.csv": lambda: bench_hf.render(folder), "fsdp_results.csv": lambda: bench_fsdp.render(folder),
            "strata_cost.csv": lambda: bench.strata_cost_section(folder / table),
            "hf_profile_after.csv": lambda: bench_hf.render(folder)}[table]
    with pytest.raises(MissingResultsError, match=r"whose " + key.replace("(", r"\(").replace(")", r"\)")
                       + r" repeats an earlier row .*two studies joined\?"):
        read()


# -- G7: a derived or config value is checked against what it derives from ---------------------------------------

def test_g7_strata_ratio_must_be_strata_over_seco(tmp_path, capsys):
    """Reproducer: ratio 0.5 was printed, though 96.571 / 31.249 = 3.090."""
    folder = _copy(tmp_path, "bench")
    _set(folder / "strata_cost.csv", 1, "ratio", "0.5")
    rc, err = _report("bench", folder, tmp_path, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "strata_cost.csv: row 2 holds ratio = 0.5, but strata_cpu_s / seco_cpu_s = 3.09042" in err


def test_g7_strata_ratio_rounded_to_fewer_digits_is_accepted(tmp_path):
    from seco_lab.report.bench import strata_cost_section

    folder = _copy(tmp_path, "bench")
    _set(folder / "strata_cost.csv", 1, "ratio", "3.09")  # 3.0904 rounded to its stored digits
    assert "| 1024 | 32 | 6 | before |" in "".join(strata_cost_section(folder / "strata_cost.csv"))
    _set(folder / "strata_cost.csv", 1, "ratio", "3.08")
    with pytest.raises(MissingResultsError, match=r"row 2 holds ratio = 3.08, but strata_cpu_s / seco_cpu_s"):
        strata_cost_section(folder / "strata_cost.csv")


@pytest.mark.parametrize("share, words", [("1.7", r"impossible value\(s\) of share \(e.g. 1.7 on line 2; it lies in "
                                                   r"\[0, 1\]\)"),
                                          ("0.5", r"row 2 holds share = 0.5, but self_cpu_s / 35.7965 .* = 0.609615")])
def test_g7_profile_share_is_self_time_over_total(share, words, tmp_path):
    """N04: share 0.61 -> 1.7 (self_cpu_s unchanged) was printed as 1.700."""
    from seco_lab.report import bench_hf

    folder = _copy(tmp_path, "bench")
    _set(folder / "hf_profile_after.csv", 1, "share", share)
    with pytest.raises(MissingResultsError, match=r"hf_profile_after.csv.*" + words):
        bench_hf.render(folder)


def test_g7_profile_of_two_steps_or_without_total_is_refused(tmp_path):
    from seco_lab.report import bench_hf

    folder = _copy(tmp_path, "bench")
    _set(folder / "hf_profile_after.csv", 3, "length", "4096")
    with pytest.raises(MissingResultsError, match=r"row 4 holds length = 4096, but row 2 holds 2048"):
        bench_hf.render(folder)
    folder = _copy(tmp_path / "b", "bench")
    rows = _rows(folder / "hf_profile_after.csv")
    _write(folder / "hf_profile_after.csv", [r for r in rows if r[0] != "(total)"])
    with pytest.raises(MissingResultsError, match=r"no '\(total\)' row"):
        bench_hf.render(folder)


def test_g7_throughput_k_is_ceil_of_seq_len_over_chunk_size(tmp_path, capsys):
    """C03: k 8 -> 16 gave 'sequences of 1024 tokens in chunks of 128 (k = 16)'."""
    folder = _copy(tmp_path, "training")
    for row in range(1, 5):
        _set(folder / "throughput.csv", row, "k", "16")
    rc, err = _report("train-compare", folder, tmp_path, capsys)
    assert rc == 2 and not (tmp_path / "r.md").exists() and len(err.strip().splitlines()) == 1
    assert "throughput.csv: row 2 (dense) holds k = 16, but k = ceil(seq_len / chunk_size) = ceil(1024 / 128) = 8" \
        in err


def test_g7_throughput_backprop_chunks_and_steps_timed(tmp_path, capsys):
    folder = _copy(tmp_path, "training")
    _set(folder / "throughput.csv", 3, "backprop_chunks", "9.0")
    rc, err = _report("train-compare", folder, tmp_path, capsys)
    assert rc == 2 and "row 4 (spaco falling-factorial t=2) holds backprop_chunks = 9, but at most k = 8" in err
    folder = _copy(tmp_path / "b", "training")
    _set(folder / "throughput.csv", 2, "steps_timed", "3")
    rc, err = _report("train-compare", folder, tmp_path, capsys)
    assert rc == 2 and "row 3 (seco) holds steps_timed = 3, but every mode was timed over the same steps" in err


def test_g7_bench_chunk_size_must_match_the_rows(tmp_path, capsys):
    """N11b: bench.json chunk_size 256 -> 512 was printed, though (length 1024, budget 2, t/k = 1/2) gives k = 4."""
    folder = _copy(tmp_path, "bench")
    meta = json.loads((folder / "bench.json").read_text())
    meta["config"]["chunk_size"] = 512
    (folder / "bench.json").write_text(json.dumps(meta))
    rc, err = _report("bench", folder, tmp_path, capsys)
    assert rc == 2 and not (tmp_path / "r.md").exists() and len(err.strip().splitlines()) == 1
    assert "budget x ratio = 2 x 2 = 4 chunks" in err and "chunk_size 512, i.e. k = ceil(1024 / 512) = 2" in err


def test_g7_bench_spaco_label_must_name_its_scheme_and_ratio(tmp_path):
    """The report pairs SpaCO rows by their scheme and ratio columns and prints them by label: a label that names
    another budget put one method's numbers under another's name."""
    from seco_lab.report.bench import load_bench

    folder = _copy(tmp_path, "bench")
    _set(folder / "results.csv", 5, "ratio", "4.0")
    with pytest.raises(MissingResultsError, match=r"row 6 is labelled 'spaco released-unbiased t/k=1/2', but its "
                       r"scheme and ratio make it 'spaco released-unbiased t/k=1/4'"):
        load_bench(folder)
