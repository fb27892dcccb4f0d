"""A checkpoint's names and its meta.json: the file names, the format tag, the RNG states it
records, and :func:`read_meta`, which checks every field the loaders use before they use it.

Split from :mod:`moeplug.training.checkpoint` (which writes and loads checkpoints) so what a
checkpoint directory *is* can be read without the saving and resharding machinery.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import torch

from moeplug.config import ConfigError

FORMAT = "moeplug-checkpoint-v1"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
LATEST = "latest"
FILES = "files"  # meta.json entry: {file name: {"sha256": hex digest, "bytes": size}}
TOKENIZER_DIR = "tokenizer"

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


def _uint_list(v: Any, bound: int) -> list:
    # np.asarray / torch.tensor would silently truncate floats or wrap large values.
    if not isinstance(v, list) or not all(type(x) is int and 0 <= x < bound for x in v):
        raise ValueError(f"expected a list of integers in [0, {bound})")
    return v


def _torch_rng(v: Any) -> torch.Tensor:
    state = torch.tensor(_uint_list(v, 256), dtype=torch.uint8)
    torch.Generator().set_state(state)  # a private generator checks it; the global is untouched
    return state


def _numpy_rng(v: Any) -> tuple:
    name, keys, pos, has_gauss, gauss = v
    state = (name, np.asarray(_uint_list(keys, 2**32), dtype=np.uint32), pos, has_gauss, gauss)
    np.random.RandomState().set_state(state)
    return state


def _python_rng(v: Any) -> tuple:
    version, internal, gauss = v
    state = (version, tuple(internal), gauss)
    random.Random().setstate(state)
    return state


_RNG_PARSERS = {"torch": _torch_rng, "numpy": _numpy_rng, "python": _python_rng}


def _parse_rng(state: Any, meta_path: str) -> dict:
    """The saved RNG states as the objects torch / numpy / random take, each tried on a private
    generator first so that a bad one is a CheckpointError naming it, not a traceback."""
    if not isinstance(state, dict) or not set(_RNG_PARSERS) <= set(state):
        raise meta_error(meta_path, "rng", state, "must be an object with the 'torch', "
                          "'numpy' and 'python' RNG states")
    out = {}
    for kind, parse in _RNG_PARSERS.items():
        try:
            out[kind] = parse(state[kind])
        except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as e:
            raise meta_error(meta_path, f"rng.{kind}", state[kind],
                              f"is not a {kind} RNG state ({e})") from None
    return out


def set_rng_state(state: dict, meta_path: str = META_FILE) -> None:
    parsed = _parse_rng(state, meta_path)
    torch.set_rng_state(parsed["torch"])
    np.random.set_state(parsed["numpy"])
    random.setstate(parsed["python"])


def meta_error(meta_path: str, field: str, value: Any, rule: str) -> CheckpointError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return CheckpointError(
        f"checkpoint metadata {meta_path!r}: field '{field}' = {shown} {rule}. Fix: restore this "
        f"{META_FILE} from a copy, resume from another checkpoint (another step_* directory of "
        f"the run), or start fresh (train.resume='')")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Optional meta.json entries and what each must be when present (None counts as absent).
# "hf": the record of a Hugging Face import (moeplug.convert), in its step-0 checkpoint only
# (it marks a model moeplug did not train); HF_ORIGIN: the same record, carried by the
# checkpoints of a run resumed from such an import (export reads its family and token ids).
HF_ORIGIN = "hf_origin"
_OPTIONAL_OBJECTS = ("metrics", "optimizer", "parallel", "config", "plugins", "scheduler", "hf",
                     HF_ORIGIN, FILES, "tp_dims")


def read_meta(path: str) -> dict:
    """The meta.json of checkpoint directory ``path``, checked field by field: anything the
    loaders use has the right type afterwards (CheckpointError naming the field otherwise)."""
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 (binary)
        raise CheckpointError(f"checkpoint metadata {meta_path!r} is unreadable ({e}). Fix: use "
                              f"a complete checkpoint directory (see 'latest' in the run dir)") from None
    if not isinstance(meta, dict):
        raise meta_error(meta_path, "(top level)", meta, f"is a JSON {type(meta).__name__}, "
                          f"not the JSON object moeplug writes")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r}: format = {meta.get('format')!r}, expected "
                              f"{FORMAT!r}. Fix: use a checkpoint written by this moeplug version")
    if not is_int(meta.get("step")) or meta["step"] < 0:
        raise meta_error(meta_path, "step", meta.get("step"), "must be an integer >= 0")
    _parse_rng(meta.get("rng"), meta_path)
    version = meta.get("reshard_version")  # absent: written before the per-file manifests
    if version is not None and not is_int(version):
        raise meta_error(meta_path, "reshard_version", version, "must be an integer")
    for key in _OPTIONAL_OBJECTS:
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise meta_error(meta_path, key, meta[key], "must be a JSON object")
    for key, ok, rule in (("tokens_seen", is_int, "an integer"),
                          ("train_seconds", is_number, "a number")):
        value = (meta.get("metrics") or {}).get(key, 0)
        if not ok(value) or value < 0:
            raise meta_error(meta_path, f"metrics.{key}", value, f"must be {rule} >= 0")
    for name, record in (meta.get(FILES) or {}).items():
        if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)
                and is_int(record.get("bytes"))):
            raise meta_error(meta_path, f"{FILES}.{name}", record,
                              "must be {\"sha256\": hex digest, \"bytes\": size}")
    return meta
