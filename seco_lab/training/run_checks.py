"""What a run directory holds and when one is refused: the names a run writes (:data:`RUN_TREE`), the marker,
the refusals before a run starts (:func:`check_usable`, :func:`check_replaceable`) and the removal of only a
run's own files (:func:`remove_own`).  See :mod:`seco_lab.training.run_dir` for the directory's layout."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..folder_lock import LOCK_NAME, is_own_lock, lock_holder
from ..store import CONFIG_MAX_BYTES, protected_paths, read_json
from .checkpoint_archive import ANY_RUN, is_own_checkpoint

__all__ = ["CHECKPOINTS_TREE", "DCP_TREE", "FILE", "MARKER_NAME", "RUN_TREE", "RunDirError", "check_adapter_digests",
           "check_path_given", "check_replaceable", "check_usable", "checkpoint_steps", "file_sha256",
           "foreign_entries", "is_run", "not_peft_adapter", "not_run_file", "orphan_checkpoints", "remove_own",
           "run_contents", "run_tree"]

MARKER_NAME = ".seco-lab-run"

FILE = None  # a leaf of a tree spec: a regular file (or a symlink, which is removed, never followed)
#: the files of a sharded checkpoint directory (torch.distributed.checkpoint's names, and ours)
DCP_TREE = {r"__\d+_\d+\.distcp": FILE, r"(__\d+)?\.metadata(\.tmp)?": FILE, r"extra\.pt(\.seco-tmp\d+)?": FILE}
#: the checkpoints/ folder: step files, sharded step directories (complete, half-written or set aside), latest
CHECKPOINTS_TREE = {r"latest(\.seco-tmp\d+)?": FILE, r"step_\d+\.pt(\.seco-tmp\d+)?": FILE,
                    r"step_\d+\.dcp(\.tmp|\.old)?": DCP_TREE}
#: every name a run writes into its directory, as ``{name regex: FILE or subtree}``
RUN_TREE = {
    r"config\.json(\.seco-tmp\d+)?": FILE, r"metrics\.jsonl(\.seco-tmp\d+)?": FILE, r"loss\.png(\.seco-tmp\d+)?": FILE,
    re.escape(LOCK_NAME): FILE, re.escape(MARKER_NAME) + r"(\.seco-tmp\d+)?": FILE, "checkpoints": CHECKPOINTS_TREE,
    "tensorboard": {r"events\.out\.tfevents\..+": FILE},
    "adapter": {r"adapter_config\.json": FILE, r"adapter_model\.safetensors": FILE, r"README\.md": FILE},
}


#: folders a run writes only with an option (--lora, --tensorboard): its own only where its marker names them
OPTIONAL_FOLDERS = ("adapter", "tensorboard")


def run_tree(path: Path) -> dict:
    """:data:`RUN_TREE` of the run folder ``path``: the optional folders only where its marker records that the run
    wrote them (:meth:`~seco_lab.training.run_dir.RunDir.note_written`): files a user put under ``adapter/`` or
    ``tensorboard/`` of a run that never wrote there are not the run's to remove (campaign 29 S2)."""
    record = _marker(path)
    wrote = record.get("wrote", []) if isinstance(record, dict) and isinstance(record.get("wrote"), list) else []
    return {k: v for k, v in RUN_TREE.items() if k not in OPTIONAL_FOLDERS or k in wrote}


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (the message says why and what to do)."""


def _match(name: str, spec: dict):
    """The subtree (or FILE) of the first pattern of ``spec`` matching ``name`` in full; ``False`` when none does."""
    for pattern, sub in spec.items():
        if re.fullmatch(pattern, name):
            return sub
    return False


def foreign_entries(root: Path, spec: dict) -> list[Path]:
    """The entries under ``root`` that ``spec`` does not name (a directory where a file belongs, a file
    where a directory belongs, a symlinked directory, or an unknown name): what this tool did not write."""
    out = []
    for p in sorted(Path(root).iterdir()):
        sub = _match(p.name, spec)
        if sub is FILE and (p.is_symlink() or p.is_file()):
            continue
        if isinstance(sub, dict) and p.is_dir() and not p.is_symlink():
            out += foreign_entries(p, sub)
            continue
        out.append(p)
    return out


def remove_own(root: Path, spec: dict) -> list[Path]:
    """Remove the files under ``root`` that ``spec`` names, then the directories left empty (``root``
    too); anything else stays.  Returns what stayed.  Never a blanket ``rmtree``."""
    root = Path(root)
    left = []
    for p in sorted(root.iterdir()):
        sub = _match(p.name, spec)
        if sub is FILE and (p.is_symlink() or p.is_file()):
            p.unlink(missing_ok=True)
        elif isinstance(sub, dict) and p.is_dir() and not p.is_symlink():
            left += remove_own(p, sub)
        else:
            left.append(p)
    if not left:
        root.rmdir()
    return left


def check_path_given(path) -> Path:
    """Refuse a run directory that is no choice at all: ``""`` (which means the current directory)."""
    text = os.fspath(path)
    if not str(text).strip():
        raise RunDirError("--run-dir is empty; name a directory for the run, e.g. --run-dir runs/first")
    if str(text) == "~" or str(text).startswith("~/"):
        raise RunDirError(f"--run-dir {text}: a literal '~' (the shell did not expand it); write the path out")
    return Path(text)


#: what a run's config.json (``TrainConfig.to_dict``) always records
RUN_RECORD_KEYS = frozenset({"mode", "steps", "seq_len", "chunk_size", "seed", "lr"})


def _is_run_config(path: Path) -> bool:
    """``config.json`` as a run writes it: a training mode of this tool, the keys every run records, and no key a run
    does not write."""
    try:
        d = read_json(path, "run config", CONFIG_MAX_BYTES)
    except (OSError, ValueError, RecursionError):  # missing, not a regular file (a FIFO would block), too large,
        # not JSON, nested past Python's recursion limit
        return False
    from ..config import MODES, RunControl, TrainConfig

    known = {*TrainConfig.__dataclass_fields__, *RunControl.__dataclass_fields__}
    return isinstance(d, dict) and d.get("mode") in MODES and RUN_RECORD_KEYS <= d.keys() and d.keys() <= known


#: every key a run writes into a record of ``metrics.jsonl`` (seco_lab.training.trainer: a step's record, the
#: evaluation before training): a record with another key is a user's (campaign 34 X1)
METRIC_KEYS = frozenset({"step", "loss", "lr", "grad_norm", "tokens_per_s", "backprop_chunks", "seconds", "far_loss",
                         "eval_loss", "eval_far_loss"})
#: the keys every training step's record holds (``Trainer.train_step``); the evaluation before training (step 0)
#: writes ``eval_loss`` (and ``eval_far_loss``) alone
STEP_RECORD_KEYS = frozenset({"step", "loss", "lr", "grad_norm", "tokens_per_s", "backprop_chunks", "seconds"})
EVAL_RECORD_KEYS = frozenset({"step", "eval_loss", "eval_far_loss"})


def _is_metric_record(record, steps: int | None) -> bool:
    """A record a run writes: a training step's (every key of :data:`STEP_RECORD_KEYS`, none outside
    :data:`METRIC_KEYS`, a step from 1 to the run's ``steps``) or the evaluation before training (step 0,
    ``eval_loss``, nothing else of a step's)."""
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return False
    step, keys = record["step"], record.keys()
    if step == 0:
        return "eval_loss" in keys and keys <= EVAL_RECORD_KEYS
    return STEP_RECORD_KEYS <= keys <= METRIC_KEYS and 1 <= step <= (steps if steps is not None else step)


#: a line of ``metrics.jsonl`` is one record of a few numbers: a longer one is no run's
METRIC_LINE_MAX_BYTES = 1 << 16


def _is_metrics_log(path: Path) -> bool:
    """``metrics.jsonl`` as a run writes it: one JSON object per line, each a record a run writes
    (:func:`_is_metric_record`: campaign 34 X1, 35 O01, O29 -- a user's records with a step and a loss were taken for
    a run's); the last line may be a record torn by a kill (it begins as one: ``{"step": ``)."""
    import json

    try:
        config = read_json(Path(path).parent / "config.json", "run config", CONFIG_MAX_BYTES)
    except (OSError, ValueError, RecursionError):
        config = None
    steps = config.get("steps") if isinstance(config, dict) and type(config.get("steps")) is int else None
    try:
        with open(path, "rb") as f:  # line by line, each at most a record's size: a file of any size is never held
            while line := f.readline(METRIC_LINE_MAX_BYTES):  # whole (campaign 38 B7: 7 GB without a newline)
                if not line.endswith(b"\n") and len(line) == METRIC_LINE_MAX_BYTES:
                    return False
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    if not line.endswith(b"\n") and line.startswith(b'{"step": '):  # the last line, torn
                        continue
                    return False
                if not _is_metric_record(record, steps):
                    return False
    except OSError:
        return False
    return True


def _is_latest_pointer(path: Path) -> bool:
    """``checkpoints/latest`` as a run writes it: the name of one of its checkpoints."""
    try:
        with open(path, "rb") as f:
            text = f.read(64)
    except OSError:
        return False
    return re.fullmatch(rb"step_\d+\.(pt|dcp)\n?", text) is not None


def _is_run_png(path: Path, run_id: str | None) -> bool:
    """The loss curve seco-lab drew for this run: its PNG carries the tool's mark
    (:data:`seco_lab.store.FIGURE_MARK_KEY`) and, where the marker names the run, that run's id
    (:data:`seco_lab.store.RUN_FIGURE_KEY`).  Another PNG named ``loss.png`` is a user's (campaign 33 V5r-m), and so
    is another seco-lab figure copied there (campaign 34 X3)."""
    from ..store import FIGURE_MARK_KEY, FIGURE_MARK_VALUE, RUN_FIGURE_KEY, png_text

    text = png_text(path) or {}
    return text.get(FIGURE_MARK_KEY) == FIGURE_MARK_VALUE and (run_id is None or text.get(RUN_FIGURE_KEY) == run_id)


def _marker(path: Path) -> dict | None:
    """The JSON object of the run folder ``path``'s marker; None where it is missing or unreadable."""
    return _marker_record(Path(path) / MARKER_NAME)


#: the keys of a run's marker (:func:`seco_lab.training.run_dir.marker_text`, ``RunDir.note_written``)
MARKER_KEYS = frozenset({"tool", "run_id", "digests", "wrote", "adapter_files"})


def _marker_record(file: Path) -> dict | None:
    """The JSON object of the marker file ``file`` (``{"tool": "seco-lab", ...}``, only a marker's keys and values);
    None where it is not one."""
    try:
        record = read_json(file, "run marker", 4096)  # a FIFO or a folder is never read
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not (isinstance(record, dict) and record.get("tool") == "seco-lab" and record.keys() <= MARKER_KEYS):
        return None  # campaign 38 B5: a user's note added to the marker
    run_id, wrote = record.get("run_id"), record.get("wrote", [])
    if run_id is not None and not (isinstance(run_id, str) and re.fullmatch(r"[0-9a-f]{16}", run_id)):
        return None
    if not isinstance(wrote, list) or not all(isinstance(w, str) and w in OPTIONAL_FOLDERS for w in wrote) \
            or type(record.get("digests", True)) is not bool:
        return None
    files = record.get("adapter_files") or {}  # name -> SHA-256 of each file the last save wrote (null: one under way)
    if not isinstance(files, dict) or not all(name in {n for n, _, _ in ADAPTER_CONTENT} and isinstance(h, str)
                                              and re.fullmatch(r"[0-9a-f]{64}", h) for name, h in files.items()):
        return None
    return record


def marker_run_id(path: Path) -> str | None:
    """The run id the marker of the run folder ``path`` records (None where it records none or is unreadable)."""
    run_id = (_marker(path) or {}).get("run_id")
    return run_id if isinstance(run_id, str) and re.fullmatch(r"[0-9a-f]{16}", run_id) else None


def _head(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def _is_peft_card(path: Path) -> bool:
    """peft's model card: YAML front matter naming ``library_name: peft``."""
    head = _head(path, 4096)
    return head.startswith(b"---\n") and b"\nlibrary_name: peft\n" in head.split(b"\n---", 1)[0] + b"\n"


def _is_peft_config(path: Path) -> bool:
    try:
        d = read_json(path, "adapter config", CONFIG_MAX_BYTES)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(d, dict) and isinstance(d.get("peft_type"), str)


#: a tensor peft's ``save_pretrained`` writes for a LoRA adapter: a factor of a module (``lora_A``/``lora_B`` of a
#: linear layer, ``lora_embedding_A``/``_B`` of an embedding) or, with ``save_embedding_layers``, the base weight of an
#: adapted embedding or output head (``...embed_tokens.base_layer.weight``)
_LORA_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\."
                          r"(?P<part>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B|base_layer\.weight)")


#: the safetensors dtypes of a model's weights (a LoRA factor is one)
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _adapter_rank(folder: Path) -> int | None:
    """The LoRA rank ``r`` the peft config beside the weights records (None where it records none, or ranks per
    module)."""
    try:
        d = read_json(folder / "adapter_config.json", "adapter config", CONFIG_MAX_BYTES)
    except (OSError, ValueError, RecursionError):
        return None
    r = d.get("r") if isinstance(d, dict) and not d.get("rank_pattern") else None
    return r if type(r) is int and r >= 1 else None


def _is_lora_safetensors(path: Path) -> bool:
    """peft's LoRA weights in safetensors: a file safetensors itself reads (a header whose tensors fill the file
    exactly: campaign 36 Y6l, a user's notes behind a crafted header) with peft's metadata, every tensor one peft writes
    for a LoRA adapter (:data:`_LORA_TENSOR`, 2-D, floating point; campaign 36 Y6g, a user's own tensors), each
    adapted module with both factors, of one rank, the rank of ``adapter_config.json`` where it records one, and a base
    weight only of an adapted module."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            if f.metadata() not in (None, {"format": "pt"}):  # what peft records; a note of the user's is not
                return False
            tensors = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception:  # safetensors raises its own error (and OSError, ValueError) for a file it cannot read
        return False
    parts = {}
    for name, (dtype, shape) in tensors.items():
        m = _LORA_TENSOR.fullmatch(name)
        if m is None or len(shape) != 2 or dtype not in _FLOAT_DTYPES:  # campaign 37 A1: a user's text as uint8
            return False
        parts.setdefault(m["module"], {})[m["part"].removesuffix(".weight")] = shape
    ranks = set()
    for module in parts.values():
        factors = {k for k in module if k != "base_layer"}
        if factors not in ({"lora_A", "lora_B"}, {"lora_embedding_A", "lora_embedding_B"}):
            return False
        a, b = (module[k] for k in sorted(factors))
        ranks |= {a[0], b[1]}
    rank = _adapter_rank(path.parent)
    return len(ranks) == 1 and (rank is None or ranks == {rank})


#: what peft writes into a LoRA run's ``adapter/`` (``save_lora_adapter``): a user's file of one of these names is
#: kept.  peft writes its weights as safetensors only (``safe_serialization``), so an ``adapter_model.bin`` is never a
#: run's (:data:`RUN_TREE` leaves it out; campaign 36 Y6k)
ADAPTER_CONTENT = (("README.md", _is_peft_card, "model card"), ("adapter_config.json", _is_peft_config, "config"),
                   ("adapter_model.safetensors", _is_lora_safetensors, "LoRA weights"))


#: the name a temporary file of :func:`seco_lab.store.atomic_write` becomes: ``NAME.seco-tmp<pid>`` -> ``NAME``
_TEMPORARY = re.compile(r"(?P<name>.+)\.seco-tmp\d+")

#: what a run's own file of each name holds, as ``(name regex relative to the run folder, check(file, run_id, owner,
#: match), what it should be)``: campaign 32 V5 (a user's own config.json and metrics.jsonl in a folder that still had
#: a run's marker were replaced by --overwrite), 33 W2 (``latest``), 34 X2 and 35 O38 (a user's ``torch.save`` or zip
#: as a checkpoint or a sharded checkpoint's ``extra.pt``), 37 (a user's notes written into the marker)
RUN_FILE_CONTENT = (
    (r"config\.json", lambda f, run_id, owner, m: _is_run_config(f), "a run's config"),
    (r"metrics\.jsonl", lambda f, run_id, owner, m: _is_metrics_log(f), "a run's metrics log"),
    (r"loss\.png", lambda f, run_id, owner, m: _is_run_png(f, run_id), "a run's loss curve"),
    (re.escape(MARKER_NAME), lambda f, run_id, owner, m: _marker_record(f) is not None, "a run's marker"),
    (r"checkpoints/latest", lambda f, run_id, owner, m: _is_latest_pointer(f), "the name of a checkpoint"),
    (r"checkpoints/step_(\d+)\.pt|checkpoints/step_(\d+)\.dcp(\.tmp|\.old)?/extra\.pt",
     lambda f, run_id, owner, m: is_own_checkpoint(f, owner, step=int(m[1] or m[2])), "a checkpoint of this run"),
)


def _not_run_file(file: Path, name: str, run_id: str | None, owner) -> str | None:
    """What ``file``, kept under the name ``name`` in a run folder, should hold where it does not hold it (judged by
    :data:`RUN_FILE_CONTENT`; a temporary file ``NAME.seco-tmp<pid>`` as the ``NAME`` it was written for); None
    where it does, or where the name's content is not checked (the lock, a sharded checkpoint's shards)."""
    temporary = _TEMPORARY.fullmatch(name)
    for pattern, check, what in RUN_FILE_CONTENT:
        m = re.fullmatch(pattern, temporary["name"] if temporary else name)
        if m is not None:
            if check(file, run_id, owner, m):
                return None
            return what if not temporary else (f"a complete {m[0].rsplit('/', 1)[-1]} of this run: a write killed "
                                               "half-way leaves such a file; delete it if that is what it is")
    return None


def not_run_file(path: Path, name: str) -> str | None:
    """What the file ``name`` (relative to the run folder ``path``) should hold where it does not hold what a run
    writes under that name (:func:`_not_run_file`); None for a run's file, an empty file (nothing to lose) or a name
    whose content is not checked."""
    file = Path(path) / name
    if not file.is_file() or file.is_symlink() or file.stat().st_size == 0:
        return None
    return _not_run_file(file, name, marker_run_id(path), ANY_RUN if _marker(path) is None else marker_run_id(path))


def not_run_content(path: Path) -> list[str]:
    """The files of the run folder ``path`` that carry a run's name but not what a run writes there, each with what
    it should be (:func:`_not_run_file`): ``--overwrite`` leaves such a folder alone.  Also a sharded checkpoint
    folder without an ``extra.pt`` (campaign 37: a user's file as its ``__0_0.distcp``), a temporary file
    ``NAME.seco-tmp<pid>`` not holding what ``NAME`` must (campaign 37: a user's notes under such a name), and the
    adapter's files (:data:`ADAPTER_CONTENT`).  An empty file holds nothing to lose and a link is never followed."""
    run_id = marker_run_id(path)
    owner = ANY_RUN if _marker(path) is None else run_id  # the marker gone: any run's checkpoint of the step
    out = []

    def judge(folder: Path, prefix: str = ""):
        for file in sorted(folder.iterdir()):
            if file.is_file() and not file.is_symlink() and file.stat().st_size > 0:
                what = _not_run_file(file, prefix + file.name, run_id, owner)
                if what is not None:
                    out.append(f"{prefix}{file.name} (not {what})")

    judge(path)
    folder = path / "checkpoints"
    if folder.is_dir() and not folder.is_symlink():
        judge(folder, "checkpoints/")
        for d in sorted(folder.glob("step_*.dcp*")):
            if re.fullmatch(r"step_\d+\.dcp(\.tmp|\.old)?", d.name) and d.is_dir() and not d.is_symlink():
                extra = d / "extra.pt"
                if extra.is_file() and not extra.is_symlink() and extra.stat().st_size > 0:
                    judge(d, f"checkpoints/{d.name}/")  # its extra.pt this run's: its shards with it
                elif any(p.is_file() and p.stat().st_size > 0 for p in d.iterdir()):  # no checkpoint of this run
                    out.append(f"checkpoints/{d.name} (no extra.pt of this run: not a sharded checkpoint of it; a "
                               "sharded save killed half-way leaves such a folder, delete it if that is what it is)")
    return out + not_peft_adapter(path)


def not_peft_adapter(path: Path) -> list[str]:
    """The files under the run folder ``path``'s ``adapter/`` that carry the names peft writes but not what peft
    writes (:data:`ADAPTER_CONTENT`), each with what it should be: ``--overwrite`` would delete them (campaign 35
    O13b: a user's notes as the adapter's README.md) and a LoRA run's ``--resume`` write over them (campaign 37 A6)."""
    adapter = Path(path) / "adapter"
    if not adapter.is_dir() or adapter.is_symlink():
        return []
    saved = (_marker(path) or {}).get("adapter_files")  # what the run's last save wrote (campaign 38 B8)
    out = []
    for name, check, what in ADAPTER_CONTENT:
        file = adapter / name
        if not file.is_file() or file.is_symlink():
            continue
        if not check(file):
            out.append(f"adapter/{name} (not peft's {what})")
        elif saved is not None and saved.get(name) != file_sha256(file):  # none recorded: a run saved before
            out.append(f"adapter/{name} (not the file this run saved: changed since)")
    return out


def check_adapter_digests(path: Path, option: str) -> None:
    """Refuse (:class:`RunDirError`) ``--overwrite`` or a LoRA ``--resume`` (``option``) of the run folder ``path``
    whose ``adapter/`` holds files while its marker records no digests of them (``adapter_files``, written by every
    adapter save since campaign 38 B8; null while a save is under way): a run saved by an older seco-lab, whose files
    nothing proves the run's -- notes appended to its README.md pass peft's model-card check (campaign 39 C5)."""
    adapter = Path(path) / "adapter"
    if not adapter.is_dir() or adapter.is_symlink() or "adapter_files" in (_marker(path) or {}):
        return
    if any(p.is_symlink() or not p.is_file() or p.stat().st_size > 0 for p in adapter.iterdir()):
        raise RunDirError(f"{option}: {path} is a LoRA run saved by a seco-lab that predates adapter digests, so "
                          f"nothing proves the files in {adapter} are the run's (notes added to them would be lost); "
                          f"nothing is replaced: move or delete {adapter} yourself, then rerun")


def file_sha256(file: Path) -> str:
    """The SHA-256 of the file ``file``, read in blocks."""
    import hashlib

    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def is_run(path: Path) -> bool:
    """A directory this tool created: the marker, or (older runs, written before it) a config.json that is a
    run's record: a training mode of this tool, the keys every run records, and no key a run does not write."""
    return (path / MARKER_NAME).is_file() or _is_run_config(path / "config.json")


def check_replaceable(path: Path) -> None:
    """``--overwrite``: refuse anything but a run of this tool holding only its own files (and a symlink:
    the replacement renames the directory, which would replace the link, not the run it points to)."""
    check_path_given(path)
    if path.is_symlink():
        if not is_run(path.resolve()) or path.resolve() in protected_paths():
            raise RunDirError(f"--overwrite: {path} is a symlink to {path.resolve()}, which is not a seco-lab run "
                              "directory, so nothing is replaced; choose another --run-dir")
        raise RunDirError(f"--overwrite: {path} is a symlink to {path.resolve()}; pass --run-dir {path.resolve()} to "
                          "replace that run (the link is left alone)")
    resolved = path.resolve()
    what = protected_paths().get(resolved)
    if what is not None:
        raise RunDirError(f"--overwrite would replace {resolved}, {what}; choose a run directory of its own, "
                          "e.g. --run-dir runs/first")
    if not is_run(path):
        raise RunDirError(f"--overwrite: {path} is not a seco-lab run directory (no {MARKER_NAME} or run "
                          "config.json), so it is left alone; choose another --run-dir or empty it yourself")
    orphans = orphan_checkpoints(path)
    if orphans:
        raise RunDirError(f"--overwrite: {path} has no config.json, so its checkpoints ({orphans}) are the run's only "
                          "copy of the experiment and are left alone; continue it with --resume (config.json is "
                          f"rebuilt from the newest checkpoint), or delete {path / 'checkpoints'} yourself first")
    foreign = foreign_entries(path, run_tree(path))
    if foreign:
        names = ", ".join(str(p.relative_to(path)) for p in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise RunDirError(f"--overwrite: {path} holds files seco-lab did not write ({names}); move them out "
                          "or choose another --run-dir")
    check_adapter_digests(path, "--overwrite")
    unlike = not_run_content(path)
    if unlike:
        raise RunDirError(f"--overwrite: {path} holds files with a run's names that seco-lab did not write "
                          f"({', '.join(unlike[:5])}); nothing is replaced: move them out or choose another --run-dir")


def check_usable(path: Path, resume: bool, overwrite: bool) -> None:
    """Everything that can be checked without creating anything; raise :class:`RunDirError`."""
    path = check_path_given(path)
    for i, part in enumerate(path.parts):  # "x/.." of a missing x: mkdir would make x, then find the folder above
        if part == ".." and not Path(*path.parts[:i] or ".").is_dir():
            raise RunDirError(f"run directory {path} goes up ('..') out of {Path(*path.parts[:i])}, which is not an "
                              "existing folder; name the run directory without going through it")
    if path.is_symlink() and not path.exists():
        raise RunDirError(f"run directory {path} is a symbolic link to {os.readlink(path)}, which does not exist; "
                          "point it at a folder, or choose another --run-dir")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file; choose another --run-dir")
    parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not parent.is_dir():
        raise RunDirError(f"run directory {path}: {parent} is a file, so no directory can be made under it; choose "
                          "another --run-dir")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {path}: {parent} is not writable; choose another --run-dir")
    for sub in ("checkpoints",):  # a folder of the run's, where something else stands
        if (path / sub).is_symlink():  # pruning and --overwrite would act on the folder it points to
            raise RunDirError(f"{path / sub} is a symbolic link (to {os.readlink(path / sub)}): a run keeps its "
                              "checkpoints in a folder of its own, and pruning them (--keep-checkpoints) would delete "
                              "in the folder it points to; replace the link with a copy of that folder, or choose "
                              "another --run-dir")
        if (path / sub).exists() and not (path / sub).is_dir():
            raise RunDirError(f"{path / sub} is a file, not a folder (the run keeps its checkpoints in it); move it "
                              "away, or choose another --run-dir")
    if resume:
        if not (path / "config.json").is_file() and not checkpoint_steps(path):
            holder = lock_holder(path)  # a trainer starting there has not written it yet (campaign 32 V6)
            if holder is not None:
                raise RunDirError(f"run directory {path} is in use by another trainer (pid {holder}), which has not "
                                  "written its config.json yet; wait for it to finish or stop it, or choose another "
                                  "--run-dir")
            raise RunDirError(f"--resume: {path} holds no run (no config.json); start it without --resume")
    elif path.exists() and run_contents(path):
        what = protected_paths().get(path.resolve())
        if what is not None:  # never a run's own directory: no --overwrite to suggest
            raise RunDirError(f"run directory {path} is {what} and not empty; a run needs a directory of its own, "
                              "e.g. --run-dir runs/first")
        orphans = orphan_checkpoints(path)
        if orphans and not overwrite:
            raise RunDirError(f"run directory {path} holds checkpoints ({orphans}) but no config.json; pass --resume "
                              "to continue from the newest one (config.json is rebuilt from it), or choose another "
                              "--run-dir")
        if not overwrite and not is_run(path.resolve()):  # --overwrite would refuse it too: not suggested
            raise RunDirError(f"run directory {path} exists, is not empty and is not a seco-lab run (no {MARKER_NAME}"
                              " or run config.json); a run needs a directory of its own: choose another --run-dir, "
                              "e.g. --run-dir runs/first")
        if not overwrite:
            raise RunDirError(f"run directory {path} exists and is not empty; pass --overwrite (replace it) or "
                              "--resume (continue it)")
        check_replaceable(path)


def run_contents(path: Path) -> list[Path]:
    """What a run directory holds besides its lock file (a user's own ``.lock`` counts)."""
    return [p for p in path.iterdir() if not (p.name == LOCK_NAME and is_own_lock(p))]


def checkpoint_steps(run_dir) -> list[int]:
    """Steps with a checkpoint: ``step_NNNNNN.pt`` files and sharded ``step_NNNNNN.dcp`` directories."""
    return sorted({int(m.group(1)) for p in (Path(run_dir) / "checkpoints").glob("step_*")
                   if (m := re.fullmatch(r"step_(\d+)\.(pt|dcp)", p.name))})


def orphan_checkpoints(path: Path) -> str:
    """``"steps 2, 4"`` when ``path`` holds checkpoints but no ``config.json`` (deleted): the checkpoints, which
    record the experiment, are then the run's only copy of it; ``""`` otherwise."""
    if (path / "config.json").is_file():
        return ""
    steps = checkpoint_steps(path)
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[-3:]))
    return f"step{'s' if len(steps) > 1 else ''} {'..., ' if len(steps) > 3 else ''}{shown}"
