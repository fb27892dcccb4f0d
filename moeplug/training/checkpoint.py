"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of one run directory::

    out_dir/
      latest                    text file naming the newest complete checkpoint ("step_000600")
      step_000600/
        model.safetensors       model parameters and buffers
        optimizer.safetensors   optimizer state tensors, keyed "state.<param index>.<name>"
        meta.json               step, config, plugin names, RNG states, optimizer param groups,
                                scheduler position, metrics state

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
    return final


# --------------------------------------------------------------------------------------------
# Finding and loading
# --------------------------------------------------------------------------------------------

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


def resolve_resume(resume: str, out_dir: str) -> str | None:
    """Map ``train.resume`` to a checkpoint directory (None: start fresh).

    "" → None; "auto" → newest in out_dir or None; a run directory → its newest checkpoint;
    a step directory → itself. Anything else is a CheckpointError.
    """
    if not resume:
        return None
    if resume == "auto":
        return find_latest(out_dir)
    if _is_checkpoint(resume):
        return resume
    found = find_latest(resume) if os.path.isdir(resume) else None
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


def load_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True) -> dict:
    """Load model (and optimizer) state in place from a checkpoint directory; return its meta."""
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

    model_sd = _load_safetensors(os.path.join(path, MODEL_FILE))
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

    if optimizer is not None:
        tensors = _load_safetensors(os.path.join(path, OPTIM_FILE))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = t
        # JSON turned tuples (AdamW betas) into lists; only "params" is a real list.
        groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v)
                   for k, v in g.items()} for g in meta["optimizer"]["param_groups"]]
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path!r}: optimizer state does not fit ({e}). Fix: "
                                  f"resume with the same model and optimizer config") from None
    if restore_rng:
        set_rng_state(meta["rng"])
    return meta


def _shares_storage_with(model: torch.nn.Module, key: str, stored: set[str]) -> bool:
    sd = model.state_dict()
    alias = _alias_key(sd[key])
    return any(_alias_key(sd[k]) == alias for k in stored if k in sd)
