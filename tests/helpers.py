"""Helpers shared by the tests: one relative-error measure, a tiny float64 model, a random batch."""

import torch

from seco_lab import TinyConfig, TinyTransformer


def rel_err(a, b, floor: float = 1e-2) -> float:
    """Relative error of ``a`` against the reference ``b``.

    Tensors: ||a - b|| / ||b||.  Gradient or parameter dictionaries: the max over entries of
    ||a_i - b_i|| / max(||b_i||, floor * ||b||).

    Why the floor: float64 rounding in a gradient is relative to the magnitude of the
    terms summed, i.e. to the whole gradient ||b||, not to one parameter's own norm.  A
    parameter whose true gradient is (near) zero -- e.g. the query projection when every
    query sees a single key -- holds ~1e-17 * ||b|| of rounding noise in one engine and an
    exact 0 (or other noise) in another, so its own relative error is noise over noise.
    With ``floor = 1e-2`` and a tolerance of 1e-12, a parameter may differ by at most
    max(1e-12 * ||b_i||, 1e-14 * ||b||): still ~45 ulp of the whole gradient, while every
    parameter carrying >= 1% of the gradient is held to 1e-12 of its own norm.
    (The earlier floor of 1e-4 left 1e-16 * ||b|| for such parameters, below what the
    order of summation alone can change; pytest-xdist layouts tripped it.)
    """
    if isinstance(b, torch.Tensor):
        return float((a - b).norm() / b.norm())
    total = sum(float(g.norm()) ** 2 for g in b.values()) ** 0.5
    worst = 0.0
    for name, ref in b.items():
        den = max(float(ref.norm()), floor * total)
        diff = float((a[name] - ref).norm())
        worst = max(worst, diff / den if den > 0 else diff)
    return worst


def tiny_model(n_layers=2, seed=0, d_model=16, n_heads=4, n_kv_heads=2, d_ff=24, vocab=17, **kw):
    cfg = TinyConfig(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff, **kw
    )
    return TinyTransformer(cfg, seed=seed, dtype=torch.float64)


def random_batch(vocab, batch, length, seed=0, ignore_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (batch, length), generator=g)
    tgt = torch.randint(0, vocab, (batch, length), generator=g)
    if ignore_frac:
        drop = torch.rand(batch, length, generator=g) < ignore_frac
        drop[0, 0] = False  # keep at least one target
        tgt[drop] = -100
    return tok, tgt


# a seco-lab train run of 2 steps in about a second on a CPU (tiny model, every step evaluated and checkpointed)
FAST = ["--seq-len", "32", "--chunk-size", "8", "--steps", "2", "--warmup", "0", "--batch-size", "2",
        "--eval-batches", "1", "--eval-every", "1", "--ckpt-every", "1", "--no-progress", "--device", "cpu",
        "--d-model", "16", "--d-ff", "32", "--n-layers", "1", "--n-heads", "2"]


def copy_run(src, dest):
    """A copy of the run folder ``src`` at ``dest`` (without its lock file), returned."""
    import shutil

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


def edit_json(path, change):
    """Apply ``change`` to the JSON value stored at ``path`` (in place) and write it back."""
    import json

    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def csv_tables(folder):
    """{name: bytes} of the CSV tables directly in ``folder``: to show a refused rebuild left them as they were."""
    return {p.name: p.read_bytes() for p in folder.glob("*.csv")}


def cut_train_study(src, out, runs: int = 12, tiers: bool = False):
    """The training study at ``src`` with its main part cut to its first ``runs`` runs (fast to load; still
    complete), written to ``out``; with ``tiers`` its two tier folders are copied as they are.  Returns ``out``."""
    import json
    import shutil

    import pandas as pd

    table = pd.read_csv(src / "runs.csv").head(runs)
    results = pd.read_csv(src / "results.csv.gz")
    table.to_csv(out / "runs.csv", index=False)
    results[results.run_id.isin(table.run_id)].to_csv(out / "results.csv.gz", index=False)
    study = json.loads((src / "study.json").read_text())
    study["runs_done"] = len(table)
    (out / "study.json").write_text(json.dumps(study))
    for sub in ("equal_compute", "second_L4") if tiers else ():
        shutil.copytree(src / sub, out / sub)
    return out


def assert_refused_before_torch(argv, cwd, prelude: str = "") -> None:
    """``seco-lab ARGV`` run in a fresh interpreter (after ``prelude``) returns 2 with a one-line error, having
    imported neither torch, pandas nor scipy (so the refusal is instant)."""
    import subprocess
    import sys

    code = (f"import sys\n{prelude}\nfrom seco_lab.cli import main\nrc = main(sys.argv[1:])\n"
            "print('RC', rc, [m for m in ('torch', 'pandas', 'scipy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert "RC 2 []" in out.stdout, out.stdout + out.stderr
    assert "error:" in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr
