"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of one run directory::

    out_dir/
      latest                    text file naming the newest complete checkpoint ("step_000600")
      step_000600/
        model.safetensors       model parameters and buffers
        optimizer.safetensors   optimizer state tensors, keyed "state.<param index>.<name>"
        meta.json               step, config, plugin names, RNG states, optimizer param groups,
                                scheduler position, metrics state
        tokenizer/              a Hugging Face tokenizer's files (tokenizer.json, ...), when the
                                run's tokenizer is one (data.tokenizer a path, or an import's):
                                each checkpoint carries it, so a resume, generate and export
                                need nothing outside it (:func:`carried_tokenizer`)

A multi-process run (:func:`save_sharded_checkpoint`) writes per-rank shards instead of the two
safetensors files: ``model_rank{r}.safetensors``, ``optimizer_rank{r}.safetensors`` and
``optimizer_rank{r}.json`` (that rank's param groups), plus ``meta.json`` whose ``parallel``
entry is the layout manifest. Every safetensors file carries, in its header's metadata, a
manifest of what its shards are (expert parameters, TP split dims, the optimizer's parameter
names or distributed-optimizer buckets), so a checkpoint loads under any other parallel layout
of the same model (moeplug.training.reshard); the same layout reads only this rank's files.

Atomicity: a checkpoint is written into ``.tmp-step_XXXXXX-<pid>`` next to its final place,
every file and the directory are fsynced, and only then is it renamed to ``step_XXXXXX``
(``os.replace``, atomic on POSIX). ``latest`` is updated the same way afterwards. A crash at
any point leaves either the old or the new checkpoint complete; leftover ``.tmp-*`` directories
are never read.

Integrity: ``meta.json`` records every other file's size and SHA-256 under ``files``; loading
recomputes each file's digest before reading it and refuses a mismatch, naming the file (a
flipped byte would otherwise resume silently with different weights). Checkpoints written
before the digests existed still load, with a notice that they are not verified. ``meta.json``
itself is checked field by field (:func:`read_meta`), so a damaged one is a CheckpointError
naming the field, never a traceback later.

Loading never unpickles: only ``safetensors`` and ``json`` parsers touch the files.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from moeplug.config import ConfigError, RootConfig, config_from_dict, model_differences
from moeplug.training.optim_base import Optimizer
from moeplug.training.checkpoint_meta import (FILES, FORMAT, LATEST, META_FILE, MODEL_FILE,
                                             OPTIM_FILE, TOKENIZER_DIR, CheckpointError,
                                             is_int, is_number, meta_error, read_meta,
                                             rng_state, set_rng_state, step_dir_name)

_log = logging.getLogger(__name__)  # notices; with no logging set up, Python prints them

# moeplug's optimizers (their own base) and torch's: both save and load torch's state-dict format.
AnyOptimizer = Optimizer | torch.optim.Optimizer

# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Tied weights appear under two names sharing storage; safetensors refuses shared storage,
    # so every tensor is stored once, cloned contiguous, and duplicates are restored on load
    # by load_state_dict (both names point at the same Parameter).
    # FSDP (parallel.fsdp): its shards saved whole, as the same layout without FSDP holds them
    # (moeplug.parallel.fsdp.whole_state; a collective), so one format reshards everywhere.
    from moeplug.parallel.fsdp import local, whole_state
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    state = model.state_dict()
    keep = {}
    for name, t in state.items():
        key = _alias_key(local(t))
        if key in seen:
            continue
        seen.add(key)
        keep[name] = t
    for name, t in whole_state(keep).items():
        tensors[name] = t.detach().contiguous().clone()
    return tensors


def _alias_key(t: torch.Tensor) -> tuple:
    # Same storage *and* same view: only true aliases (tied weights) collide, not two slices.
    if not t.numel():
        return (id(t),)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _optimizer_payload(optimizer: AnyOptimizer) -> tuple[dict[str, torch.Tensor], list]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            tensors[f"state.{idx}.{k}"] = t.detach().contiguous().clone()
    return tensors, sd["param_groups"]


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str) -> str:
    """SHA-256 of a file, read in 1 MiB pieces (hashlib's SHA-256 runs at GB/s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def _file_records(directory: str, names: tuple[str, ...]) -> dict:
    return {n: {"sha256": file_sha256(os.path.join(directory, n)),
                "bytes": os.path.getsize(os.path.join(directory, n))} for n in names}


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_tokenizer(tmp: str, files: dict[str, bytes] | None) -> tuple[str, ...]:
    """The tokenizer's files into ``tmp/tokenizer/``, fsynced; their names as meta.json's
    ``files`` records them."""
    if not files:
        return ()
    folder = os.path.join(tmp, TOKENIZER_DIR)
    os.makedirs(folder)
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _fsync_path(folder)
    return tuple(f"{TOKENIZER_DIR}/{name}" for name in files)


def save_checkpoint(out_dir: str, step: int, model: torch.nn.Module,
                    optimizer: AnyOptimizer, meta: dict, keep_last: int = 0,
                    tokenizer_files: dict[str, bytes] | None = None) -> str:
    """Write ``out_dir/step_XXXXXX`` atomically, then point ``latest`` at it and keep only the
    newest ``keep_last`` checkpoints (0: all; :func:`prune_checkpoints`). Returns its path.

    ``meta`` holds the JSON-side state (config dict, plugin names, metrics state...); step, RNG
    states and optimizer param groups are added here. ``tokenizer_files``: a Hugging Face
    tokenizer's files (name -> bytes), written into ``tokenizer/`` and checksummed like the rest.
    """
    os.makedirs(out_dir, exist_ok=True)
    name = step_dir_name(step)
    final = os.path.join(out_dir, name)
    tmp = os.path.join(out_dir, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    from moeplug.training import reshard
    optim_tensors, param_groups = _optimizer_payload(optimizer)
    try:
        save_file(_model_tensors(model), os.path.join(tmp, MODEL_FILE),
                  metadata=reshard.model_manifest(model))
        save_file(optim_tensors, os.path.join(tmp, OPTIM_FILE),
                  metadata=reshard.optimizer_manifest(model, optimizer))
        _fsync_path(os.path.join(tmp, MODEL_FILE))
        _fsync_path(os.path.join(tmp, OPTIM_FILE))
        carried = _write_tokenizer(tmp, tokenizer_files)
        full_meta = dict(meta, format=FORMAT, step=step, rng=rng_state(),
                         reshard_version=reshard.VERSION,
                         optimizer={"param_groups": param_groups},
                         files=_file_records(tmp, (MODEL_FILE, OPTIM_FILE, *carried)))
        _test_pause_in_save()
        _write_json(os.path.join(tmp, META_FILE), full_meta)  # last: marks completeness
        _fsync_path(tmp)
    except BaseException:
        # A failed write (a full disk) or a stop (Ctrl-C) hands its space back now, not at the
        # next save.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(out_dir, name, tmp, final)
    prune_checkpoints(out_dir, keep_last)
    return final


# --------------------------------------------------------------------------------------------
# Finding and loading
# --------------------------------------------------------------------------------------------

def _rank_files(rank: int) -> tuple[str, str, str]:
    return (f"model_rank{rank}.safetensors", f"optimizer_rank{rank}.safetensors",
            f"optimizer_rank{rank}.json")


def save_sharded_checkpoint(out_dir: str, step: int, model: torch.nn.Module, optimizer: Any,
                            meta: dict, groups: Any, layout: dict, keep_last: int = 0,
                            tokenizer_files: dict[str, bytes] | None = None) -> str:
    """Every rank writes its shard into one temporary directory; rank 0 then writes meta.json
    (with ``parallel = layout``), renames the directory, updates ``latest`` and prunes exactly
    as :func:`save_checkpoint` does. Collective over all ranks; returns the final path."""
    import torch.distributed as dist

    rank = groups.rank
    name = step_dir_name(step)
    final = os.path.join(out_dir, name)
    box = [None]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        box[0] = os.path.join(out_dir, f".tmp-{name}-{os.getpid()}")
        shutil.rmtree(box[0], ignore_errors=True)
        os.makedirs(box[0])
    dist.broadcast_object_list(box, src=0)  # sync point: the directory exists for every rank
    tmp = box[0]
    from moeplug.training import reshard
    model_file, optim_file, groups_file = _rank_files(rank)
    optim_tensors, param_groups = _optimizer_payload(optimizer)
    # each file's manifest (header metadata) says what its shards are, for resharding
    save_file(_model_tensors(model), os.path.join(tmp, model_file),
              metadata=reshard.model_manifest(model))
    save_file(optim_tensors, os.path.join(tmp, optim_file),
              metadata=reshard.optimizer_manifest(model, optimizer, groups))
    _write_json(os.path.join(tmp, groups_file), param_groups)
    for f in (model_file, optim_file):
        _fsync_path(os.path.join(tmp, f))
    records = [None] * dist.get_world_size()
    # sync point: every shard is on disk (and hashed by its rank) before meta.json is written
    dist.all_gather_object(records, _file_records(tmp, _rank_files(rank)))
    if rank == 0:
        files = {name: rec for per_rank in records for name, rec in per_rank.items()}
        files.update(_file_records(tmp, _write_tokenizer(tmp, tokenizer_files)))
        full_meta = dict(meta, format=FORMAT, step=step, rng=rng_state(), parallel=layout,
                         reshard_version=reshard.VERSION, files=files)
        _test_pause_in_save()
        _write_json(os.path.join(tmp, META_FILE), full_meta)
        _fsync_path(tmp)
        _publish(out_dir, name, tmp, final)
        prune_checkpoints(out_dir, keep_last)
    dist.barrier()  # nobody starts the next step (or a resume) before the rename
    return final


def load_sharded_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, groups: Any,
                            layout: dict) -> dict:
    """Load this rank's shard of a checkpoint written by :func:`save_sharded_checkpoint` with
    the same ``layout``; return its meta. Raises CheckpointError on any other layout."""
    meta = read_meta(path)
    _check_layout(path, meta, layout)
    if meta.get("parallel") != layout:
        return _load_resharded(path, meta, model, optimizer, groups=groups)
    _note_if_unverified(path, meta)
    model_file, optim_file, groups_file = _rank_files(groups.rank)
    _load_model_state(path, model, _load_safetensors(path, meta, model_file))
    tensors = _load_safetensors(path, meta, optim_file)
    groups_path = _verified_file(path, meta, groups_file)
    try:
        with open(groups_path, encoding="utf-8") as f:
            param_groups = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"checkpoint {path!r}: {groups_file} is unreadable ({e}). Fix: "
                              "resume from a complete checkpoint") from None
    _load_optimizer_state(path, optimizer, tensors, param_groups, groups_path)
    set_rng_state(meta["rng"], os.path.join(path, META_FILE))
    return meta


def _check_layout(path: str, meta: dict, layout: dict | None) -> None:
    """Refuse a checkpoint written under another parallel layout (None: one process)."""
    from moeplug.training.reshard import can_reshard
    saved = meta.get("parallel")
    if (saved or None) == layout or can_reshard(meta, layout):
        return  # the same layout, or one that reshards (moeplug.training.reshard)
    if layout is None:
        raise CheckpointError(
            f"checkpoint {path!r} holds per-rank shards of a parallel run that splits the model "
            f"(layout {saved}); this is a single-process run, and a checkpoint that predates "
            f"the shard manifests (no 'reshard_version' in {META_FILE}) reshards only between "
            f"layouts with cp = pp = etp = 1 (data, expert and tensor parallelism). Fix: resume "
            f"with the "
            f"same parallel settings and number of processes (--nproc / torchrun), or start fresh "
            f"(train.resume='')")
    diff = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v} if saved else None
    raise CheckpointError(
        f"checkpoint {path!r} was written with parallel layout {saved or 'single-process'} "
        f"but this run's layout is {layout} (differs in (saved, now): {diff or 'all'}); "
        f"this checkpoint predates the shard manifests (no 'reshard_version' in {META_FILE}), "
        f"so it reshards only between layouts with cp = pp = etp = 1 (data, expert and tensor "
        f"parallelism; a saved EP or TP layout only without the distributed optimizer). "
        f"Fix: resume with the same parallel settings and number of processes, or start a "
        f"fresh run (train.resume='')")


def _publish(out_dir: str, name: str, tmp: str, final: str) -> None:
    """Rename the complete ``tmp`` to ``final`` and point ``latest`` at it (both atomic)."""
    if os.path.exists(final):  # re-saving the same step (e.g. resumed run that had finished)
        old = os.path.join(out_dir, f".old-{name}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_path(out_dir)

    latest_tmp = os.path.join(out_dir, f".tmp-{LATEST}-{os.getpid()}")
    with open(latest_tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(out_dir, LATEST))
    _fsync_path(out_dir)


def prune_checkpoints(out_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` ``step_*`` checkpoints of ``out_dir`` (0: keep
    all), and the temporary directories of saves that a crash interrupted. Called only after
    ``latest`` moved, so the checkpoint it names is never among the deleted."""
    own = f"-{os.getpid()}"
    for d in os.listdir(out_dir):
        # another process's .tmp-step_*: a save killed midway (the CLI refuses two live runs
        # in one out_dir), never read, only taking space
        if d.startswith(".tmp-step_") and not d.endswith(own):
            shutil.rmtree(os.path.join(out_dir, d), ignore_errors=True)
    if keep_last <= 0:
        return
    newest = _read_latest(os.path.join(out_dir, LATEST))
    steps = sorted((d for d in os.listdir(out_dir) if re.fullmatch(r"step_\d+", d)),
                   key=lambda d: int(d[5:]))
    for d in steps[:-keep_last]:
        if d != newest:  # resumed from an earlier step: the one just saved is not the highest
            shutil.rmtree(os.path.join(out_dir, d), ignore_errors=True)


def _test_pause_in_save() -> None:
    # Tests only: widen the window in which a SIGKILL lands mid-save (tests/test_resume_kill.py)
    pause = os.environ.get("MOEPLUG_TEST_SAVE_PAUSE")
    if pause:
        import time
        time.sleep(float(pause))


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def find_latest(out_dir: str) -> str | None:
    """The newest complete checkpoint in ``out_dir``: ``latest`` if valid, else the highest
    ``step_*`` directory (covers a crash between the rename and the ``latest`` update)."""
    pointer = os.path.join(out_dir, LATEST)
    if os.path.isfile(pointer):
        candidate = os.path.join(out_dir, _read_latest(pointer))
        if _is_checkpoint(candidate):
            return candidate
    if not os.path.isdir(out_dir):
        return None
    steps = sorted(d for d in os.listdir(out_dir)
                   if d.startswith("step_") and _is_checkpoint(os.path.join(out_dir, d)))
    return os.path.join(out_dir, steps[-1]) if steps else None


def _read_latest(pointer: str) -> str:
    # moeplug writes it atomically, so anything but a step directory's name is damage or an
    # edit, not a torn write: refuse it instead of guessing.
    with open(pointer, "rb") as f:
        raw = f.read(4096)
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not re.fullmatch(r"step_\d+", name):
        raise CheckpointError(
            f"{pointer!r} should hold the name of the newest checkpoint directory (e.g. "
            f"step_000600) but holds {raw[:40]!r}. Fix: write the right step_* name into it, or "
            f"delete it (moeplug then resumes from the highest complete step_* directory)")
    return name
def find_checkpoint(path: str) -> str | None:
    """``path`` itself if it is a checkpoint, else the newest one in the run directory ``path``
    (None: neither)."""
    if _is_checkpoint(path):
        return path
    return find_latest(path) if os.path.isdir(path) else None


def resolve_resume(resume: str, out_dir: str) -> str | None:
    """Map ``train.resume`` to a checkpoint directory (None: start fresh).

    "" → None; "auto" → newest in out_dir or None; a run directory → its newest checkpoint;
    a step directory → itself. Anything else is a CheckpointError.
    """
    if not resume:
        return None
    if resume == "auto":
        return find_latest(out_dir)
    found = find_checkpoint(resume)
    if found:
        return found
    raise CheckpointError(
        f"TrainConfig.resume = {resume!r}: no checkpoint there (expected a directory with "
        f"{META_FILE}, or a run directory with '{LATEST}' or step_* checkpoints). Fix: pass a "
        f"checkpoint or run directory, 'auto' to resume from train.out_dir if possible, or '' to "
        f"start fresh")


def _verified_file(path: str, meta: dict, name: str) -> str:
    """``path/name`` after checking its SHA-256 against meta.json (unverified if meta.json
    records none: a checkpoint older than the checksums)."""
    file_path = os.path.join(path, name)
    if not os.path.isfile(file_path):
        raise CheckpointError(f"checkpoint file {file_path!r} is missing. Fix: point "
                              f"train.resume at a directory written by moeplug (model/optimizer "
                              f".safetensors + {META_FILE})")
    if meta.get(FILES) is None:
        return file_path
    record = meta[FILES].get(name)
    if record is None:
        raise CheckpointError(
            f"checkpoint {path!r}: {META_FILE} records no checksum for {name} (field "
            f"'{FILES}' lists {sorted(meta[FILES])}). Fix: resume from a checkpoint written "
            f"whole by moeplug (another step_* directory), or start fresh (train.resume='')")
    actual = file_sha256(file_path)
    if actual != record["sha256"]:
        raise CheckpointError(
            f"checkpoint file {file_path!r} is damaged: its SHA-256 is {actual[:16]}... but "
            f"{META_FILE} recorded {record['sha256'][:16]}... when it was saved ({record['bytes']}"
            f" bytes; now {os.path.getsize(file_path)}). It changed after saving (disk or copy "
            f"error, or an edit). Fix: restore it from a copy, or resume from another checkpoint "
            f"(an earlier step_* directory of the run)")
    return file_path


def _note_if_unverified(path: str, meta: dict) -> None:
    if meta.get(FILES) is None:
        _log.warning(f"moeplug: note: checkpoint {path!r} predates per-file checksums "
                     f"({META_FILE} has no '{FILES}'), so its files are loaded unverified; "
                     f"the next checkpoint this run saves has them")


def _load_safetensors(path: str, meta: dict, name: str) -> dict[str, torch.Tensor]:
    file_path = _verified_file(path, meta, name)
    try:
        return load_file(file_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint file {file_path!r} is not a valid safetensors file ({e}). moeplug never "
            f"unpickles checkpoints (pickle files can run code). Fix: re-save it with moeplug, "
            f"or convert it to safetensors with a tool you trust") from None


def _open_safetensors(path: str, meta: dict, name: str) -> Any:
    """A ``safe_open`` handle of a verified file: its header (keys, shapes, manifest) is read
    now, each tensor only when asked for (:mod:`moeplug.training.reshard` reads only the
    tensors this rank needs)."""
    file_path = _verified_file(path, meta, name)
    try:
        return safe_open(file_path, framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint file {file_path!r} is not a valid safetensors file ({e}). moeplug never "
            f"unpickles checkpoints (pickle files can run code). Fix: re-save it with moeplug, "
            f"or convert it to safetensors with a tool you trust") from None


def carried_tokenizer(path: str, meta: dict) -> str | None:
    """The ``tokenizer/`` directory checkpoint ``path`` carries (every file checked against its
    checksum), or None: its run's tokenizer is moeplug's own (bpe, bytes), or it is an import
    whose HF directory held no tokenizer.json."""
    names = [n for n in (meta.get(FILES) or {}) if n.startswith(TOKENIZER_DIR + "/")]
    for name in names:
        _verified_file(path, meta, name)
    return os.path.join(path, TOKENIZER_DIR) if names else None


def config_dict(path: str, meta: dict) -> dict | None:
    """The config of checkpoint ``path`` as meta.json stores it, as this release reads it:
    ``data.tokenizer`` is the checkpoint's own copy of its tokenizer where it carries one (the
    path it was first read from may be gone), and a checkpoint from before vocabulary padding
    (no ``model.make_vocab_size_divisible_by``) keeps the rows it had, the tokenizer's own
    count (a multiple of 1)."""
    if meta.get("config") is None:
        return None
    data = copy.deepcopy(meta["config"])
    model, section = data.get("model"), data.get("data")
    if isinstance(model, dict) and "make_vocab_size_divisible_by" not in model:
        model["make_vocab_size_divisible_by"] = 1
    carried = carried_tokenizer(path, meta)
    if carried is not None and isinstance(section, dict):
        section["tokenizer"] = carried
    return data


def saved_config(path: str, meta: dict) -> RootConfig | None:
    """The RootConfig stored in a checkpoint's meta.json (None if it stores none), as
    :func:`config_dict` reads it. An invalid one is a CheckpointError: a run cannot be checked
    against a config nobody can read."""
    data = config_dict(path, meta)
    if data is None:
        return None
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise CheckpointError(
            f"checkpoint metadata {os.path.join(path, META_FILE)!r}: field 'config' is not a "
            f"valid moeplug config ({e}). Fix: restore this {META_FILE} from a copy, or start a "
            f"new run (another --out) instead of resuming") from None


def nothing_to_train(path: str, step: int, steps: int) -> CheckpointError:
    return CheckpointError(
        f"TrainConfig.steps = {steps}: checkpoint {path!r} is already at step {step}, so this "
        f"resume has nothing to train (train.steps is the run's total, not steps to add). Fix: "
        f"pass --steps N with N > {step} to train on, or resume from an earlier checkpoint")


def check_resume(path: str, cfg: RootConfig, config_source: str, layout: dict | None,
                 router_options: Any = None) -> dict:
    """Before anything is built: can checkpoint ``path`` continue a run configured as ``cfg``?

    Its meta.json must be sound; its config must define the same model: every field that
    changes the weights' shapes or what they compute (all of ``model``, the router and its
    options, the tokenizer) is compared and each difference named; its parallel layout must be
    ``layout`` (None: one process) and its step below ``train.steps``. ``config_source`` says
    where ``cfg`` came from, for the messages; ``router_options(router, options)`` resolves
    router options as the router reads them (PluginHost.defining_options), so an option
    written out at its default is no difference. A checkpoint of ``moeplug convert import``
    whose HF directory held no tokenizer.json carries none: the requested one is taken, and
    the embedding's saved shape must fit it; one that carries its tokenizer is compared like
    any (moeplug.training.resume.check_tokenizer compares what two tokenizers encode).
    Returns the meta.
    """
    meta = read_meta(path)
    saved = saved_config(path, meta)
    if saved is None:
        _log.warning(f"moeplug: note: checkpoint {path!r} stores no config in {META_FILE}; "
                     f"resuming with the model from {config_source}, checked against the "
                     f"saved tensors' shapes only")
    else:
        carries = carried_tokenizer(path, meta) is not None
        ignore = ("data.tokenizer", "data.vocab_size") if meta.get("hf") and not carries else ()
        diffs = model_differences(saved, cfg, router_options, ignore)
        if diffs:
            listed = "; ".join(f"{k}: checkpoint {a!r}, requested {b!r}" for k, a, b in diffs)
            raise CheckpointError(
                f"checkpoint {path!r} holds a different model than the one requested (from "
                f"{config_source} and the --set/flag overrides): {listed}. Fix: resume with the "
                f"model config the checkpoint was trained with (drop the overrides of these "
                f"fields; it is stored in {META_FILE} under 'config'), or start a new run in "
                f"another --out without --resume")
    _check_layout(path, meta, layout)
    if meta["step"] >= cfg.train.steps:
        raise nothing_to_train(path, meta["step"], cfg.train.steps)
    return meta


def _load_model_state(path: str, model: torch.nn.Module, model_sd: dict) -> None:
    from moeplug.parallel.fsdp import shard_state
    try:
        # FSDP: each rank keeps its shard of the whole tensors the files hold
        missing, unexpected = model.load_state_dict(shard_state(model, model_sd), strict=False)
    except RuntimeError as e:  # shape mismatches: torch lists every one, keep the first few
        lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
        raise CheckpointError(
            f"checkpoint {path!r} does not match the model's shapes: {' '.join(lines[:3])}"
            f"{f' (+{len(lines) - 3} more)' if len(lines) > 3 else ''}. Fix: resume with the "
            f"same model config the checkpoint was trained with (it is stored in {META_FILE} "
            f"under 'config')") from None
    # Tied duplicates were stored once; a "missing" key is fine only if it shares storage with
    # a loaded one, which load_state_dict already filled through the shared Parameter.
    stored = set(model_sd)
    real_missing = [k for k in missing if not _shares_storage_with(model, k, stored)]
    if real_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path!r} does not match the model: missing {real_missing[:5]}, "
            f"unexpected {list(unexpected)[:5]}. Fix: resume with the same model config the "
            f"checkpoint was trained with (it is stored in {META_FILE} under 'config')")


def _value_kind(v: Any) -> Any:
    if v is None or isinstance(v, bool):
        return type(v)
    if is_number(v):
        return "number"
    if isinstance(v, (list, tuple)):
        return ("sequence", len(v), tuple(_value_kind(x) for x in v))
    return type(v)


def _check_param_groups(optimizer: Any, param_groups: Any, source: str, prefix: str) -> list:
    """The saved param groups, refused (naming the group and field) unless each hyper-parameter
    has the kind of value this optimizer holds: JSON cannot carry a wrong-typed value in
    silently, only for it to fail at the first optimizer step. ``source``: the JSON file they
    came from; ``prefix``: their place in it."""
    def fail(field: str, value: Any, rule: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint file {source!r}: field '{prefix}{field}' = {value!r} {rule}. Fix: resume "
            f"with the same optimizer config, or from another checkpoint (another step_* "
            f"directory of the run)")
    if not isinstance(param_groups, list):  # a count that differs: load_state_dict says so
        raise fail("param_groups", param_groups, "must be a list of parameter groups")
    for i, (saved, now) in enumerate(zip(param_groups, optimizer.param_groups)):
        if not isinstance(saved, dict):
            raise fail(f"param_groups[{i}]", saved, "must be a JSON object")
        params = saved.get("params")
        if not isinstance(params, list) or not all(is_int(p) and p >= 0 for p in params):
            raise fail(f"param_groups[{i}].params", params, "must be a list of indices")
        for key, value in now.items():
            if key == "params" or value is None or saved.get(key) is None:
                continue  # None: an unset option (foreach, fused), free to differ
            if _value_kind(saved[key]) != _value_kind(value):
                raise fail(f"param_groups[{i}].{key}", saved[key],
                           f"is not the kind of value this optimizer holds there ({value!r})")
    return param_groups


def _load_optimizer_state(path: str, optimizer: Any, tensors: dict, param_groups: Any,
                          source: str, prefix: str = "") -> None:
    param_groups = _check_param_groups(optimizer, param_groups, source, prefix)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    # JSON turned tuples (AdamW betas) into lists; only "params" is a real list.
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v)
               for k, v in g.items()} for g in param_groups]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path!r}: optimizer state does not fit ({e}). Fix: "
                              f"resume with the same model and optimizer config") from None


def load_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: AnyOptimizer | None = None, restore_rng: bool = True) -> dict:
    """Load model (and optimizer) state in place from a checkpoint directory; return its meta.
    Every file is checked against its checksum in meta.json before it is read."""
    meta = read_meta(path)
    _check_layout(path, meta, None)
    if meta.get("parallel"):
        return _load_resharded(path, meta, model, optimizer, restore_rng)
    _note_if_unverified(path, meta)
    _load_model_state(path, model, _load_safetensors(path, meta, MODEL_FILE))
    if optimizer is not None:
        saved_groups = (meta.get("optimizer") or {}).get("param_groups")
        _load_optimizer_state(path, optimizer, _load_safetensors(path, meta, OPTIM_FILE),
                              saved_groups, os.path.join(path, META_FILE), "optimizer.")
    if restore_rng:
        set_rng_state(meta["rng"], os.path.join(path, META_FILE))
    return meta


def _load_resharded(path: str, meta: dict, model: torch.nn.Module, optimizer: Any,
                    restore_rng: bool = True, groups: Any = None) -> dict:
    """Load a checkpoint written under another layout that reshards into this rank's
    (``groups``; None: one process) — see moeplug.training.reshard; return its meta."""
    from moeplug.training import reshard
    _note_if_unverified(path, meta)
    saved = _saved_ranks(path, meta, model)  # a bad meta.json is its own CheckpointError
    try:
        local = reshard.local_model_state(model, saved, groups)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"checkpoint {path!r}: its model does not fit this model under the new layout "
            f"({e}). Fix: resume with the model config it was trained with") from None
    _load_model_state(path, model, local)
    if optimizer is not None:
        try:
            reshard.load_optimizer_state(optimizer, model, saved, groups)
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {path!r}: its optimizer state does not fit this model under the "
                f"new layout (missing or misshapen: {e}). Fix: resume with the model and "
                f"optimizer config it was trained with") from None
    if restore_rng:
        set_rng_state(meta["rng"], os.path.join(path, META_FILE))
    return meta


def _saved_ranks(path: str, meta: dict, legacy_model: torch.nn.Module | None = None) -> Any:
    """Checkpoint ``path``'s files, whatever layout wrote them, as a reshard.SavedRanks: each
    file verified against its checksum when first opened, then read tensor by tensor.
    ``legacy_model``: the model being loaded, which names the expert parameters of checkpoints
    written before the shard manifests."""
    from moeplug.training import reshard
    layout = meta.get("parallel")
    world = layout.get("world_size") if layout else 1
    if not is_int(world) or world < 1:
        raise meta_error(os.path.join(path, META_FILE), "parallel.world_size", world,
                          "must be an integer >= 1")
    ranks = range(world) if layout else ()
    handles: dict[str, Any] = {}

    def open_file(name: str) -> Any:
        if name not in handles:
            handles[name] = _open_safetensors(path, meta, name)
        return handles[name]

    return reshard.SavedRanks(layout, [_rank_files(r)[0] for r in ranks] or [MODEL_FILE],
                              [_rank_files(r)[1] for r in ranks] or [OPTIM_FILE], open_file,
                              legacy_model=legacy_model, legacy_tp_dims=meta.get(reshard.TP_DIMS))


def saved_model_shape(path: str, meta: dict, name: str) -> tuple[int, ...]:
    """The one-process shape of model tensor ``name`` in checkpoint ``path``, whatever layout
    wrote it (TP shards joined): e.g. the vocabulary rows of ``embed.weight``."""
    saved = _saved_ranks(path, meta)
    try:
        t = saved.model_tensor(name)
    except (KeyError, ValueError, RuntimeError) as e:
        t, why = None, f" ({e})"
    else:
        why = ""
    if t is None:
        raise CheckpointError(f"checkpoint {path!r} holds no complete {name!r}{why}. Fix: use a "
                              f"checkpoint written by moeplug train or moeplug convert import")
    return tuple(t.shape)


def _shares_storage_with(model: torch.nn.Module, key: str, stored: set[str]) -> bool:
    sd = model.state_dict()
    alias = _alias_key(sd[key])
    return any(_alias_key(sd[k]) == alias for k in stored if k in sd)
