"""Campaign 13 (docs/hostile_campaign_13.md): the findings outside the stored-file class that checksums close
(tests/test_checksums.py).  Each test fails on 7974107 but the enumeration, which pins that the engine itself was
always right for a ragged last chunk (the trainer drew from the wrong k)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, random_batch, rel_err, tiny_model

from seco_lab import dense_grad, get_scheme, spaco_grad
from seco_lab.cli import main
from seco_lab.training.step import mode_grads

ROOT = Path(__file__).resolve().parents[1]


# -- H1: a sequence whose length is not a multiple of the chunk size has a last, shorter chunk --------------------

def test_h1_spaco_draws_the_last_partial_chunk():
    """mode_grads counted k = floor(30 / 8) = 3 chunks: the fourth (6 tokens) was never drawn, and Bernoulli at t = 3
    drew every one of the other three each step (inclusion probability 1): a biased 'unbiased' gradient."""
    model = tiny_model(n_layers=1, vocab=11)
    tok, tgt = random_batch(11, 1, 30, seed=1)
    rng = np.random.default_rng(0)
    drawn = []
    for _ in range(40):
        _, _, chunks = mode_grads(model, tok, tgt, "spaco", 8, get_scheme("bernoulli"), 3, rng)
        drawn.append(chunks)
    assert max(drawn) == 4 and min(drawn) < 3 + 1  # ~Binomial(4, 3/4): 4 chunks drawn now and then
    assert mode_grads(model, tok, tgt, "seco", 8)[2] == 4
    assert mode_grads(model, tok, tgt, "seco", 33)[2] == 1  # a chunk longer than the sequence: one chunk, not 0


def test_h1_the_expected_spaco_gradient_of_a_ragged_sequence_is_the_dense_one():
    """Exact, by enumeration: falling-factorial at t = 2 of k = ceil(30 / 8) = 4 (one layer: unbiased for t >= 2),
    the mean of spaco_grad over the C(4, 2) = 6 subsets the trainer draws from equals dense backprop (float64)."""
    from itertools import combinations

    model = tiny_model(n_layers=1, vocab=11)
    tok, tgt = random_batch(11, 1, 30, seed=2)
    _, dense = dense_grad(model, tok, tgt)
    subsets = list(combinations(range(4), 2))
    mean = {n: torch.zeros_like(g) for n, g in dense.items()}
    for s in subsets:
        _, g = spaco_grad(model, tok, tgt, 8, "falling-factorial", 2, subset=s)
        for n in mean:
            mean[n] += g[n] / len(subsets)
    assert rel_err(mean, dense) < 1e-12


def test_h1_train_with_a_ragged_last_chunk_logs_every_chunk_and_takes_budget_k(tmp_path, capsys):
    """--seq-len 30 --chunk-size 8: the banner says k = 4; --budget 4 raised a traceback ('t=4 exceeds k=3') and
    SeCO logged backprop_chunks 3."""
    base = list(FAST)
    base[base.index("--seq-len") + 1] = "30"
    for mode, extra, want in (("spaco", ["--scheme", "falling-factorial", "--budget", "4"], 4), ("seco", [], 4)):
        run = tmp_path / mode
        rc = main(["train", *base, "--mode", mode, *extra, "--run-dir", str(run)])
        assert rc == 0, capsys.readouterr().err
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        chunks = [r["backprop_chunks"] for r in rows if "backprop_chunks" in r]
        assert chunks and all(c == want for c in chunks), chunks


# -- H11, H12: what a report says of the wrong folder ----------------------------------------------------------------

@pytest.mark.parametrize("tier", ["second_L4", "equal_compute"])
def test_h11_report_train_on_a_tier_folder_names_the_study_folder(tier, tmp_path, capsys):
    """second_L4 gave a ValueError traceback (figures.py, int('4 B=25')); equal_compute 'results are incomplete'."""
    capsys.readouterr()
    rc = main(["report", "train", "--results", str(ROOT / "reports/training_study" / tier), "--out",
               str(tmp_path / "t.md")])
    err = capsys.readouterr().err
    assert rc == 2 and f"is the {tier} tier of the training study" in err and "Traceback" not in err
    assert f"--results {ROOT / 'reports/training_study'}" in err


def test_h12_report_quick_without_quick_results_advises_the_quick_study(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["report", "bias", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "make bias-study-quick" in err and "seco-lab study bias --quick" in err
