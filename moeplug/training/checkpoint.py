"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of one run directory::

    out_dir/
      latest                    text file naming the newest complete checkpoint ("step_000600")
      step_000600/
        model.safetensors       model parameters and buffers
        optimizer.safetensors   optimizer state tensors, keyed "state.<param index>.<name>"
        meta.json               step, config, plugin names, RNG states, optimizer param groups,
                                scheduler position, metrics state

A multi-process run (:func:`save_sharded_checkpoint`) writes per-rank shards instead of the two
safetensors files: ``model_rank{r}.safetensors``, ``optimizer_rank{r}.safetensors`` and
``optimizer_rank{r}.json`` (that rank's param groups), plus ``meta.json`` whose ``parallel``
entry is the layout manifest. Resume needs exactly the same layout (checked, clear error).

Atomicity: a checkpoint is written into ``.tmp-step_XXXXXX-<pid>`` next to its final place,
every file and the directory are fsynced, and only then is it renamed to ``step_XXXXXX``
(``os.replace``, atomic on POSIX). ``latest`` is updated the same way afterwards. A crash at
any point leaves either the old or the new checkpoint complete; leftover ``.tmp-*`` directories
are never read.

Loading never unpickles: only ``safetensors`` and ``json`` parsers touch the files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moeplug.config import ConfigError

FORMAT = "moeplug-checkpoint-v1"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
LATEST = "latest"


class CheckpointError(ConfigError):
    """A checkpoint cannot be found or read. Subclass of ConfigError: the CLI reports it as one."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# --------------------------------------------------------------------------------------------
# RNG state as JSON-friendly lists/ints
# --------------------------------------------------------------------------------------------

def rng_state() -> dict:
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "python": [py_version, list(py_internal), py_gauss],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_py = state["python"]
    random.setstate((version, tuple(internal), gauss_py))


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Tied weights appear under two names sharing storage; safetensors refuses shared storage,
    # so every tensor is stored once, cloned contiguous, and duplicates are restored on load
    # by load_state_dict (both names point at the same Parameter).
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in model.state_dict().items():
        key = _alias_key(t)
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous().clone()
    return tensors


def _alias_key(t: torch.Tensor) -> tuple:
    # Same storage *and* same view: only true aliases (tied weights) collide, not two slices.
    if not t.numel():
        return (id(t),)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _optimizer_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
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


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(out_dir: str, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict) -> str:
    """Write ``out_dir/step_XXXXXX`` atomically, then point ``latest`` at it. Returns its path.

    ``meta`` holds the JSON-side state (config dict, plugin names, metrics state...); step, RNG
    states and optimizer param groups are added here.
    """
    os.makedirs(out_dir, exist_ok=True)
    name = step_dir_name(step)
    final = os.path.join(out_dir, name)
    tmp = os.path.join(out_dir, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    optim_tensors, param_groups = _optimizer_payload(optimizer)
    save_file(_model_tensors(model), os.path.join(tmp, MODEL_FILE))
    save_file(optim_tensors, os.path.join(tmp, OPTIM_FILE))
    _fsync_path(os.path.join(tmp, MODEL_FILE))
    _fsync_path(os.path.join(tmp, OPTIM_FILE))
    full_meta = dict(meta, format=FORMAT, step=step, rng=rng_state(),
                     optimizer={"param_groups": param_groups})
    _write_json(os.path.join(tmp, META_FILE), full_meta)  # last: its presence marks completeness
    _fsync_path(tmp)
    _publish(out_dir, name, tmp, final)
    return final


# --------------------------------------------------------------------------------------------
# Finding and loading
# --------------------------------------------------------------------------------------------

def _rank_files(rank: int) -> tuple[str, str, str]:
    return (f"model_rank{rank}.safetensors", f"optimizer_rank{rank}.safetensors",
            f"optimizer_rank{rank}.json")


def save_sharded_checkpoint(out_dir: str, step: int, model: torch.nn.Module, optimizer: Any,
                            meta: dict, groups: Any, layout: dict) -> str:
    """Every rank writes its shard into one temporary directory; rank 0 then writes meta.json
    (with ``parallel = layout``), renames the directory and updates ``latest`` exactly as
    :func:`save_checkpoint` does. Collective over all ranks; returns the final path."""
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
    model_file, optim_file, groups_file = _rank_files(rank)
    optim_tensors, param_groups = _optimizer_payload(optimizer)
    save_file(_model_tensors(model), os.path.join(tmp, model_file))
    save_file(optim_tensors, os.path.join(tmp, optim_file))
    _write_json(os.path.join(tmp, groups_file), param_groups)
    for f in (model_file, optim_file):
        _fsync_path(os.path.join(tmp, f))
    dist.barrier()  # sync point: every shard is on disk before meta.json marks completeness
    if rank == 0:
        full_meta = dict(meta, format=FORMAT, step=step, rng=rng_state(), parallel=layout)
        _write_json(os.path.join(tmp, META_FILE), full_meta)
        _fsync_path(tmp)
        _publish(out_dir, name, tmp, final)
    dist.barrier()  # nobody starts the next step (or a resume) before the rename
    return final


def load_sharded_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, groups: Any,
                            layout: dict) -> dict:
    """Load this rank's shard of a checkpoint written by :func:`save_sharded_checkpoint` with
    the same ``layout``; return its meta. Raises CheckpointError on any other layout."""
    meta = read_meta(path)
    saved = meta.get("parallel")
    if saved != layout:
        diff = {k: (saved.get(k), v) for k, v in layout.items()
                if saved.get(k) != v} if saved else None
        raise CheckpointError(
            f"checkpoint {path!r} was written with parallel layout {saved or 'single-process'} "
            f"but this run's layout is {layout} (differs in (saved, now): {diff or 'all'}). "
            f"Fix: resume with the same parallel settings and number of processes, or start a "
            f"fresh run (train.resume='')")
    model_file, optim_file, groups_file = _rank_files(groups.rank)
    model_sd = _load_safetensors(os.path.join(path, model_file))
    _load_model_state(path, model, model_sd)
    tensors = _load_safetensors(os.path.join(path, optim_file))
    try:
        with open(os.path.join(path, groups_file), encoding="utf-8") as f:
            param_groups = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path!r}: {groups_file} is unreadable ({e}). Fix: "
                              "resume from a complete checkpoint") from None
    _load_optimizer_state(path, optimizer, tensors, param_groups)
    set_rng_state(meta["rng"])
    return meta


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


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def find_latest(out_dir: str) -> str | None:
    """The newest complete checkpoint in ``out_dir``: ``latest`` if valid, else the highest
    ``step_*`` directory (covers a crash between the rename and the ``latest`` update)."""
    pointer = os.path.join(out_dir, LATEST)
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as f:
            candidate = os.path.join(out_dir, f.read().strip())
        if _is_checkpoint(candidate):
            return candidate
    if not os.path.isdir(out_dir):
        return None
    steps = sorted(d for d in os.listdir(out_dir)
                   if d.startswith("step_") and _is_checkpoint(os.path.join(out_dir, d)))
    return os.path.join(out_dir, steps[-1]) if steps else None


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


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path!r} is missing. Fix: point train.resume at a "
                              f"directory written by moeplug (model/optimizer .safetensors + "
                              f"{META_FILE})")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint file {path!r} is not a valid safetensors file ({e}). moeplug never "
            f"unpickles checkpoints (pickle files can run code). Fix: re-save it with moeplug, "
            f"or convert it to safetensors with a tool you trust") from None


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint metadata {meta_path!r} is unreadable ({e}). Fix: use "
                              f"a complete checkpoint directory (see 'latest' in the run dir)") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r}: format = {meta.get('format')!r}, expected "
                              f"{FORMAT!r}. Fix: use a checkpoint written by this moeplug version")
    return meta


def _load_model_state(path: str, model: torch.nn.Module, model_sd: dict) -> None:
    missing, unexpected = model.load_state_dict(model_sd, strict=False)
    # Tied duplicates were stored once; a "missing" key is fine only if it shares storage with
    # a loaded one, which load_state_dict already filled through the shared Parameter.
    stored = set(model_sd)
    real_missing = [k for k in missing if not _shares_storage_with(model, k, stored)]
    if real_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path!r} does not match the model: missing {real_missing[:5]}, "
            f"unexpected {list(unexpected)[:5]}. Fix: resume with the same model config the "
            f"checkpoint was trained with (it is stored in {META_FILE} under 'config')")


def _load_optimizer_state(path: str, optimizer: Any, tensors: dict, param_groups: list) -> None:
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
                    optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True) -> dict:
    """Load model (and optimizer) state in place from a checkpoint directory; return its meta."""
    meta = read_meta(path)
    if meta.get("parallel"):
        raise CheckpointError(
            f"checkpoint {path!r} holds per-rank shards of a parallel run (layout "
            f"{meta['parallel']}); this is a single-process run. Fix: resume with the same "
            f"parallel settings and number of processes (--nproc / torchrun), or start fresh "
            f"(train.resume='')")
    _load_model_state(path, model, _load_safetensors(os.path.join(path, MODEL_FILE)))
    if optimizer is not None:
        _load_optimizer_state(path, optimizer, _load_safetensors(os.path.join(path, OPTIM_FILE)),
                              meta["optimizer"]["param_groups"])
    if restore_rng:
        set_rng_state(meta["rng"])
    return meta


def whole_model_file(path: str, meta: dict) -> str:
    """The file of checkpoint ``path`` (with ``meta``) that holds the whole model. A
    multi-process checkpoint has one when no degree splits the model (pure data parallelism,
    with or without the distributed optimizer, which shards only optimizer state): every rank
    saved the whole model, rank 0's is taken. Otherwise a CheckpointError."""
    layout = meta.get("parallel") or {}
    split = {k: layout[k] for k in ("tp", "cp", "pp", "ep", "etp") if layout.get(k, 1) != 1}
    if split:
        raise CheckpointError(
            f"checkpoint {path!r} holds per-rank shards of a {layout.get('world_size')}-process "
            f"run whose model is split ({', '.join(f'{k}={v}' for k, v in split.items())}); one "
            f"process cannot load it and moeplug does not merge such shards. Fix: use a "
            f"checkpoint of a one-process or data-parallel-only run")
    return os.path.join(path, _rank_files(0)[0] if layout else MODEL_FILE)


def load_model_weights(path: str, model: torch.nn.Module) -> dict:
    """Load only the model weights of checkpoint ``path`` into a one-process ``model`` (for
    inference; see :func:`whole_model_file`); return its meta."""
    meta = read_meta(path)
    _load_model_state(path, model, _load_safetensors(whole_model_file(path, meta)))
    return meta


def _shares_storage_with(model: torch.nn.Module, key: str, stored: set[str]) -> bool:
    sd = model.state_dict()
    alias = _alias_key(sd[key])
    return any(_alias_key(sd[k]) == alias for k in stored if k in sd)
