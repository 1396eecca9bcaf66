"""Campaign 9 (docs/hostile_campaign_9.md) J3, J4, J5, J9, J11, J12: the exact weights bounded in k, the Python
API's subset and weight checks, compressed tables read through a bounded decompression, range rules of the bench
tables, an upper bound on the benchmark lengths and sizes, and a damaged metrics.jsonl named as damaged."""

from __future__ import annotations

import gzip
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from seco_lab import get_scheme
from seco_lab.estimators import schemes
from seco_lab.report import markdown
from seco_lab.report.markdown import MissingResultsError, read_results_csv, read_stored_csv

# -- J3: the exact weights are bounded in k as well as in P - (k - 1) ------------------------------------------


def test_j3_chain_weights_exact_refuses_past_its_size_budget_naming_the_cost(monkeypatch):
    monkeypatch.setattr(schemes, "EXACT_BITS", 20_000, raising=False)
    with pytest.raises(ValueError, match=r"would take more than .* MB .*float chain_weights / expected_weights"):
        get_scheme("paper").chain_weights_exact(300, 1, 299)


@pytest.mark.parametrize("name,k,t", [("paper", 300, 1), ("paper", 300, 7), ("paper-chain-capped", 300, 7),
                                      ("released-unbiased", 250, 100), ("bernoulli", 300, 7),
                                      ("falling-factorial", 200, 50)])
def test_j3_float_weights_past_the_budget_are_the_exact_ones_in_log_space(monkeypatch, name, k, t):
    s = get_scheme(name)
    exact_cw, exact_ew = s.chain_weights(k, t, k - 1), s.expected_weights(k, t, k - 1)
    monkeypatch.setattr(schemes, "EXACT_BITS", 500, raising=False)
    with pytest.raises(ValueError, match="would take more than"):  # the budget is in force ...
        s.chain_weights_exact(k, t, k - 1)
    if t > 10 and name != "falling-factorial":  # (t expected weights of a uniform draw; falling: all 1)
        with pytest.raises(ValueError, match="would take more than"):
            s.expected_weights_exact(k, t, k - 1)
    cw, ew = s.chain_weights(k, t, k - 1), s.expected_weights(k, t, k - 1)  # ... and the floats still come
    assert np.array_equal(np.isinf(cw), np.isinf(exact_cw)) and np.array_equal(cw == 0, exact_cw == 0)
    finite = np.isfinite(exact_cw)
    np.testing.assert_allclose(cw[finite], exact_cw[finite], rtol=1e-11)
    np.testing.assert_allclose(ew, exact_ew, rtol=1e-11, atol=1e-300)


def test_j3_large_k_stays_exact_and_fast():
    s = get_scheme("paper")
    w = s.expected_weights_exact(4096, 2048, 4095)  # the closed form's terms were recomputed from scratch: 2 s
    assert w[3] == Fraction(2) ** 3 * Fraction(2048 * 2047 * 2046 * 2045, 4096 * 4095 * 4094 * 4093)
    assert w[2048] == 0 and len(w) == 4096
    W = s.chain_weights_exact(4096, 1, 4095)  # 1e8 bits: within the budget, exact
    assert W[-1] == 4096**4095
    k = 5000
    cw = s.chain_weights(k, 1, k - 1)  # past the budget: floats in log space (inf beyond float range)
    assert cw[:3].tolist() == [1.0, 5000.0, 25e6] and math.isinf(cw[-1])


def test_j3_chain_capped_factors_need_no_huge_product():
    s = get_scheme("paper-chain-capped")
    f = s.factors_exact(10**5, 1, 10**5 - 1)  # (k/t)^q once grew to 500,000 digits
    assert f[:3] == [Fraction(1), Fraction(2), Fraction(1)] and set(f[2:]) == {Fraction(1)}


# -- J9: ChainBasis.estimate names a bad subset and an integer weight too large for a float ---------------------


@pytest.fixture(scope="module")
def basis():
    from seco_lab import TinyConfig, TinyTransformer, chain_basis

    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, d_ff=32), seed=0, dtype=torch.float64)
    tokens = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    return chain_basis(model, tokens, tokens, 4, max_hops=2)


def test_j9_estimate_names_a_0d_tensor_subset(basis):
    w = get_scheme("paper").chain_weights(3, 2, 2)
    with pytest.raises(TypeError, match=r"subset must be a sequence of chunk indices .*single value tensor\(2\)"):
        basis.estimate(torch.tensor(2), w)
    with pytest.raises(ValueError, match="subset yields more than k=3 chunk indices"):
        basis.contained(iter(range(10**9)))  # an unsized iterable: read up to k + 1 items, not to its end
    assert torch.equal(basis.estimate(torch.tensor([0, 2]), w), basis.estimate([0, 2], w))


def test_j9_estimate_names_an_integer_weight_too_large_for_a_float(basis):
    with pytest.raises(ValueError, match=r"weight W\(0\) must be a finite number, got an integer too large for a "
                                         "float"):
        basis.estimate([0, 2], [10**400] * 3)
    exact = basis.estimate([0, 2], [Fraction(1, 2), 10**20, 1])  # exact numbers within float range are taken
    assert torch.allclose(exact, basis.estimate([0, 2], [0.5, 1e20, 1.0]))


# -- J4: compressed tables: NUL bytes and the size limit on the decompressed content; short column lists -------

TRAIN_COLUMNS = ("run_id", "arm", "optimizer", "lr", "seed", "step", "metric", "distance", "value")


def test_j4_gzipped_table_of_nul_bytes_is_refused_in_one_short_line(tmp_path):
    path = tmp_path / "results.csv.gz"
    path.write_bytes(gzip.compress(b"\0" * 10**6))
    for read in (lambda: read_results_csv(path, TRAIN_COLUMNS, "`seco-lab study train`"),
                 lambda: read_stored_csv(path, "`seco-lab study train`")):
        with pytest.raises(MissingResultsError) as e:
            read()
        msg = str(e.value)
        assert "holds NUL bytes once decompressed" in msg and len(msg) < 400 and "\n" not in msg, msg[:300]


def test_j4_gzip_bomb_is_refused_past_the_table_limit_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(markdown, "TABLE_MAX_BYTES", 50_000)
    path = tmp_path / "results.csv.gz"
    path.write_bytes(gzip.compress(b"a" * 10**6))  # 1 MB of 'a' in a 1 KB file
    for read in (lambda: read_results_csv(path, TRAIN_COLUMNS, "`seco-lab study train`"),
                 lambda: read_stored_csv(path, "`seco-lab study train`")):
        with pytest.raises(MissingResultsError, match=r"decompresses to more than 50,000 bytes.*rerun"):
            read()
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(b"\x1f\x8b not gzip at all")
    with pytest.raises(MissingResultsError, match=r"bad.csv.gz cannot be decompressed .*damaged"):
        read_results_csv(bad, TRAIN_COLUMNS, "x")


def test_j4_column_list_in_messages_is_cut(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("x" * 100_000 + "," + ",".join(f"c{i}" for i in range(500)) + "\n" + "1," * 500 + "1\n")
    with pytest.raises(MissingResultsError) as e:
        read_results_csv(path, TRAIN_COLUMNS, "x")
    msg = str(e.value)
    assert len(msg) < 1500 and "(100,000 characters)" in msg and "(501 columns)" in msg, msg[:300]


def test_j4_stored_reads_share_one_error_translation(tmp_path):
    assert callable(markdown.stored_read_errors)
    with pytest.raises(MissingResultsError, match="is missing: run x first"):
        markdown.read_json_table(tmp_path / "study.json", "x")
    with pytest.raises(MissingResultsError, match="is missing: run x first"):
        read_stored_csv(tmp_path / "runs.csv", "x")


# -- J5: range rules of the bench tables -----------------------------------------------------------------------


def test_j5_hf_results_with_a_negative_layer_count_is_refused(tmp_path):
    from seco_lab.report.bench_hf import read_hf_results

    path = tmp_path / "hf_results.csv"
    rows = "tag,n_layers,chunk_size,length,lora,label,metric,value\nafter,{},64,1024,False,seco,time_s,{}\n"
    path.write_text(rows.format(30, 1.5))
    assert read_hf_results(path).n_layers.tolist() == [30]
    path.write_text(rows.format(-5, 1.5))
    with pytest.raises(MissingResultsError, match=r"hf_results.csv: column 'n_layers' holds -5 \(row 2\), but it "
                                                  r"must be >= 1: .*rerun"):
        read_hf_results(path)
    path.write_text(rows.format(30, -1.5))
    with pytest.raises(MissingResultsError, match=r"column 'value' holds -1.5 \(row 2\), but it must be >= 0"):
        read_hf_results(path)


def test_j5_fsdp_and_strata_tables_range_checked(tmp_path):
    from seco_lab.report.bench import strata_cost_section
    from seco_lab.report.bench_fsdp import read_fsdp_results

    fsdp = tmp_path / "fsdp_results.csv"
    fsdp.write_text("round,mode,parameters,base_mib,peak_mib,step_s,all_gather,reduce_scatter,all_reduce,seq_len,"
                    "chunk_size,model\n0,fsdp,1000,1.0,2.0,-0.5,4,4,0,64,8,tiny\n")
    with pytest.raises(MissingResultsError, match=r"column 'step_s' holds -0.5 \(row 2\), but it must be >= 0"):
        read_fsdp_results(fsdp)
    strata = tmp_path / "strata_cost.csv"
    strata.write_text("length,chunk_size,max_hops,tag,rev,seco_cpu_s,strata_cpu_s,ratio,peak_rss_gib,loadavg_1m\n"
                      "2048,64,4,after,abc,1.0,2.0,0,0.5,1.0\n")
    with pytest.raises(MissingResultsError, match=r"column 'ratio' holds 0 \(row 2\), but it must be > 0"):
        strata_cost_section(strata)


# -- J11: benchmark lengths and sizes have an upper bound, refused at once ---------------------------------------


def test_j11_bench_lengths_beyond_the_model_are_refused_with_exit_2(capsys):
    from experiments import bench
    from experiments.arguments import MAX_SIZE, at_least

    parse = at_least(1, MAX_SIZE)
    assert parse("4096") == 4096
    for argv, said in ((["--lengths", "99999999999999999999"], "expected an integer in [1, 1,048,576], got 9999"),
                       (["--lengths", "1024", "70000"], "70,000 tokens exceed the benchmark model's 65,536 positions"),
                       (["--quick", "--lengths", "8192"], "8,192 tokens exceed the benchmark model's 4,096 positions")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err, err


@pytest.mark.parametrize("module,argv", [("bench_hf", ["--lengths", "10" * 10]),
                                         ("bench_hf", ["--chunk-sizes", "9" * 30]),
                                         ("bench_strata", ["--length", "9" * 20]),
                                         ("bench_strata", ["--chunk-size", "9" * 20]),
                                         ("gemm_rows", ["--rows", "9" * 20]),
                                         ("strata_cost", ["--chunk-size", "9" * 20]),
                                         ("strata_cost", ["--layers", "100000"])])
def test_j11_other_bench_sizes_are_bounded(module, argv, capsys):
    import importlib

    from experiments.arguments import MAX_SIZE  # noqa: F401 (the bound exists)

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"experiments.{module}").main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "expected an integer in [" in err and len(err.strip().splitlines()[-1]) < 200, err


def test_j11_a_huge_integer_text_is_quoted_short():
    import argparse

    from experiments.arguments import MAX_SIZE, at_least

    with pytest.raises(argparse.ArgumentTypeError) as e:
        at_least(1, MAX_SIZE)("9" * 10_000)  # past int()'s digit limit: 'not an integer', quoted cut
    assert len(str(e.value)) < 120


# -- J12: a metrics.jsonl of NUL bytes is damaged, not empty -----------------------------------------------------


def test_j12_metrics_of_nul_bytes_said_damaged(tmp_path):
    from seco_lab.report.runs import plotted_metrics

    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match=r"metrics.jsonl holds NUL bytes and no complete record: the metrics file "
                                         "is damaged"):
        plotted_metrics(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "lo')
    with pytest.raises(ValueError, match="holds only a torn line and no complete record"):
        plotted_metrics(run)
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics yet"):
        plotted_metrics(run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    assert plotted_metrics(run)[0]["loss"] == 2.5
