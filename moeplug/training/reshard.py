"""Resuming a checkpoint under another parallel layout (resharding): any mix of DP, CP, PP
(with VPP and uneven stages), TP/SP, EP and ETP, with plain AdamW or the distributed optimizer
(ZeRO-1), into any other mix, one process included.

What a checkpoint records so that its shards can be put back together (a *manifest* per file,
JSON in the safetensors header's metadata under the key ``"moeplug"``, next to the tensors it
describes; nothing is pickled):

- model file: ``experts`` — the names of expert parameters (leading dim: this rank's experts,
  global experts ``ep_rank * L ..``), ``tp_dims`` — {name: dim} of TP-split parameters;
- optimizer file, plain AdamW: ``params`` — the parameter name of each state index;
- optimizer file, distributed optimizer: ``buckets`` — per bucket its parameter names, their
  (local) shapes and the global ranks of the bucket's replica group in group order: rank ``i``
  of that group holds elements ``[i*n, (i+1)*n)`` of the bucket's flattened moments.

Names are the one-process model's (a pipeline rank's chunks already use them; the ``<chunk>.``
prefix of its ModuleList is dropped). A saved rank's place in each group (its TP, CP, DP, PP,
EP, ETP, EDP coordinates) follows from the saved layout (``meta.json``'s ``parallel``).

Loading, for each name this rank needs (the tensors of other names are not read; every file
is still opened and hashed whole by the caller, moeplug.training.checkpoint):

1. *join* — the one-process tensor: pieces of ranks that differ only in DP, CP or EDP are
   replicas (one is read); expert parameters are joined over ETP (``down_proj`` along F =
   dim 2; ``gate_up_proj`` per half, gate and up, along dim 1) and then over EP along dim 0;
   a TP-split parameter along its ``tp_dims`` dim over TP; pipeline stages hold disjoint
   names. AdamW's moments go through the same join once each saved rank's per-parameter
   moments are known (the distributed optimizer's: its bucket group's slices concatenated,
   split by the shapes);
2. *cut* — this rank's shard, with the rules the model was built with
   (moeplug.parallel.sharding.shard_parameters), for each of its chunks; then the optimizer
   takes its moments per parameter (AdamW) or re-flattens them into its own buckets and keeps
   its slice (DistributedAdamW).

Checkpoints written before the manifests (no ``reshard_version`` in meta.json) reshard only
between layouts with cp = pp = etp = 1 and, for a saved TP or EP layout, without the
distributed optimizer: their file layout is then inferred from the model being loaded.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch
from torch import nn

from moeplug.training.optim import MAIN

MANIFEST = "moeplug"        # safetensors header metadata key of a file's manifest
VERSION = 2                 # meta.json "reshard_version" of checkpoints with manifests
MOMENTS = ("exp_avg", "exp_avg_sq")
TP_DIMS = "tp_dims"         # legacy meta.json entry: {name: dim} of rank 0's TP-split params
_KINDS = ("tp", "cp", "dp", "pp", "ep", "etp", "edp")
_LEGACY_SPLITTING = ("cp", "pp", "etp")


# --- which layouts reshard --------------------------------------------------------------------

def can_reshard(meta: dict, now: dict | None) -> bool:
    """True when the checkpoint with ``meta`` loads under layout ``now`` (None: one process).
    With manifests (``reshard_version``) every layout of the same model does; an older
    checkpoint only between layouts with cp = pp = etp = 1 (a saved TP layout needs meta's
    ``tp_dims``; a saved TP or EP layout the plain optimizer)."""
    if meta.get("reshard_version") == VERSION:
        return True
    saved = meta.get("parallel") or {}

    def ok(layout: dict | None) -> bool:
        return all((layout or {}).get(k, 1) == 1 for k in _LEGACY_SPLITTING)
    split = saved.get("ep", 1) > 1 or saved.get("tp", 1) > 1
    return (ok(saved) and ok(now) and not (split and saved.get("distributed_optimizer"))
            and (saved.get("tp", 1) == 1 or isinstance(meta.get(TP_DIMS), dict)))


# --- names ----------------------------------------------------------------------------------

def parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(state-dict prefix, module) of each piece of this rank's model whose parameter names
    are the one-process model's: the chunks of a pipeline rank's ModuleList, else the model."""
    from moeplug.training.distributed import pipeline_chunks
    chunks = pipeline_chunks(model)
    return [(f"{i}.", c) for i, c in enumerate(chunks)] if chunks else [("", model)]


def global_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its one-process name."""
    return {id(p): n for _, m in parts(model) for n, p in m.named_parameters()}


def _strip(key: str, pipeline: bool) -> str:
    return key.split(".", 1)[1] if pipeline else key


# --- manifests (written with each file) -----------------------------------------------------

def model_manifest(model: nn.Module) -> dict[str, str]:
    """The safetensors metadata of a rank's model file (see the module docstring)."""
    from moeplug.parallel.experts import expert_param_names
    experts: set[str] = set()
    dims: dict[str, int] = {}
    for _, m in parts(model):
        experts |= expert_param_names(m)
        dims.update({n: p.partition_dim for n, p in m.named_parameters()
                     if hasattr(p, "partition_dim")})
    return {MANIFEST: json.dumps({"experts": sorted(experts), "tp_dims": dims})}


def optimizer_manifest(model: nn.Module, optimizer: Any, groups: Any = None) -> dict[str, str]:
    """The safetensors metadata of a rank's optimizer file (see the module docstring)."""
    names = global_names(model)
    if hasattr(optimizer, "buckets"):  # DistributedAdamW
        buckets = [{"params": [names[id(p)] for p in b.params],
                    "shapes": [list(p.shape) for p in b.params],
                    "group": list(groups.members["edp" if b.is_expert else "dp_cp"])}
                   for b in optimizer.buckets]
        return {MANIFEST: json.dumps({"buckets": buckets})}
    return {MANIFEST: json.dumps({"params": [names[id(p)] for g in optimizer.param_groups
                                             for p in g["params"]]})}


# --- the saved ranks ------------------------------------------------------------------------

def _coords(layout: dict | None) -> list[dict[str, int]]:
    """Each saved rank's index in its group of every kind (all 0 for one process)."""
    if not layout:
        return [dict.fromkeys(_KINDS, 0)]
    from moeplug.config import ParallelConfig
    from moeplug.parallel.layout import layout_rank_groups
    pc = ParallelConfig(tp=layout["tp"], cp=layout["cp"], dp=layout["dp"], pp=layout["pp"],
                        ep=layout["ep"], etp=layout["etp"], order=layout["order"],
                        sequence_parallel=layout.get("sequence_parallel", False))
    tables = layout_rank_groups(pc.resolve(layout["world_size"]))
    out: list[dict[str, int]] = [{} for _ in range(layout["world_size"])]
    for kind in _KINDS:
        for group in tables[kind]:
            for i, r in enumerate(group):
                out[r][kind] = i
    return out


class SavedRanks:
    """The files of one checkpoint, opened lazily (``open_file(name)``: a verified
    ``safe_open`` handle, cached by the caller), seen as per-rank tensors under one-process
    names. ``model_files[r]`` / ``optim_files[r]``: rank r's file names."""

    def __init__(self, layout: dict | None, model_files: list[str], optim_files: list[str],
                 open_file: Callable[[str], Any], legacy_model: nn.Module | None = None,
                 legacy_tp_dims: dict | None = None) -> None:
        self.layout, self.open = layout, open_file
        self.coords = _coords(layout)
        self.pipeline = bool(layout) and layout.get("pp", 1) > 1
        self.model_files, self.optim_files = model_files, optim_files
        self.model_keys = [{_strip(k, self.pipeline): k for k in open_file(f).keys()}
                           for f in model_files]
        self.experts: set[str] = set()
        self.tp_dims: dict[str, int] = {}
        for f in model_files:
            manifest = _manifest(open_file(f))
            if manifest is None:  # legacy: the file layout is the model's being loaded
                from moeplug.parallel.experts import expert_param_names
                self.experts |= expert_param_names(legacy_model)
                self.tp_dims.update(legacy_tp_dims or {})
                break
            self.experts |= set(manifest["experts"])
            self.tp_dims.update({n: int(d) for n, d in manifest["tp_dims"].items()})
        self._legacy_model = legacy_model
        self._flat_cache: dict[tuple, torch.Tensor] = {}

    # model
    def model_tensor(self, name: str) -> torch.Tensor | None:
        """The one-process tensor ``name`` of the model (None: no rank stored it)."""
        holders = [r for r, keys in enumerate(self.model_keys) if name in keys]
        get = lambda r, n: self.open(self.model_files[r]).get_tensor(  # noqa: E731
            self.model_keys[r][n])
        return self._join(name, holders, get) if holders else None

    # optimizer
    def optimizer_state(self, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's step and moments at one-process shape for each of ``names`` that has
        state (none at all: saved before the first optimizer step)."""
        views = [self._optimizer_view(r) for r in range(len(self.optim_files))]
        out = {}
        for name in names:
            holders = [r for r, v in enumerate(views) if name in v]
            if not holders:
                continue
            # "main": the fp32 main copy of a bf16 parameter (train.param_dtype: bf16)
            keys = MOMENTS + ((MAIN,) if all(MAIN in views[r][name] for r in holders) else ())
            state = {k: self._join(name, holders, lambda r, n, k=k: views[r][n][k]())
                     for k in keys}
            out[name] = {"step": views[holders[0]][name]["step"](), **state}
        return out

    def _optimizer_view(self, r: int) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
        """{name: {"step" | moment: reader}} of saved rank r's optimizer state."""
        f = self.open(self.optim_files[r])
        keys = set(f.keys())
        if not any(k.startswith("state.") for k in keys):
            return {}
        manifest = _manifest(f) or self._legacy_optimizer_manifest()
        out: dict[str, dict[str, Callable[[], torch.Tensor]]] = {}
        if "buckets" in manifest:
            for b, bucket in enumerate(manifest["buckets"]):
                if f"state.{b}.step" not in keys:
                    continue
                offset = 0
                for name, shape in zip(bucket["params"], bucket["shapes"]):
                    numel = int(torch.Size(shape).numel())
                    saved = MOMENTS + ((MAIN,) if f"state.{b}.{MAIN}" in keys else ())
                    out[name] = {"step": lambda b=b: f.get_tensor(f"state.{b}.step"), **{
                        k: (lambda b=b, k=k, o=offset, m=numel, s=shape, g=bucket["group"]:
                            self._bucket_flat(tuple(g), b, k)[o:o + m].view(s))
                        for k in saved}}
                    offset += numel
            return out
        for i, name in enumerate(manifest["params"]):
            if f"state.{i}.exp_avg" in keys:
                main = (MAIN,) if f"state.{i}.{MAIN}" in keys else ()
                out[name] = {k: (lambda k=k, i=i: f.get_tensor(f"state.{i}.{k}"))
                             for k in ("step", *MOMENTS, *main)}
        return out

    def _bucket_flat(self, group: tuple[int, ...], b: int, k: str) -> torch.Tensor:
        """Moment ``k`` of bucket ``b`` flattened: the slices of the group's ranks in order."""
        key = (group, b, k)
        if key not in self._flat_cache:
            self._flat_cache[key] = torch.cat(
                [self.open(self.optim_files[g]).get_tensor(f"state.{b}.{k}") for g in group])
        return self._flat_cache[key]

    def _legacy_optimizer_manifest(self) -> dict:
        # Before manifests: every rank's optimizer had the loaded model's structure and the
        # distributed optimizer's one group was every rank (only pure DP resharded with it).
        model = self._legacy_model
        names = global_names(model)
        if self.layout and self.layout.get("distributed_optimizer"):
            from moeplug.training.dist_optim import bucket_plan
            return {"buckets": [{"params": [names[id(p)] for p in ps],
                                 "shapes": [list(p.shape) for p in ps],
                                 "group": list(range(self.layout["world_size"]))}
                                for _, ps, _ in bucket_plan(model, 0.0)]}
        from moeplug.training.optim import param_groups
        return {"params": [names[id(p)] for g in param_groups(model, 0.0) for p in g["params"]]}

    # the join
    def _join(self, name: str, holders: list[int],
              get: Callable[[int, str], torch.Tensor]) -> torch.Tensor:
        c = self.coords
        if name in self.experts:
            by = {}
            for r in holders:
                by.setdefault((c[r]["ep"], c[r]["etp"]), r)
            ep = 1 + max(e for e, _ in by)
            etp = 1 + max(t for _, t in by)
            missing = [k for k in ((e, t) for e in range(ep) for t in range(etp)) if k not in by]
            if missing:
                raise KeyError(f"{name}: no saved rank holds its (EP, ETP) shard {missing[0]}")
            return torch.cat([self._join_etp(name, [by[(e, t)] for t in range(etp)], get)
                              for e in range(ep)], dim=0)
        dim = self.tp_dims.get(name)
        if dim is None:
            return get(holders[0], name)
        by = {}
        for r in holders:
            by.setdefault(c[r]["tp"], r)
        if sorted(by) != list(range(len(by))):
            raise KeyError(f"{name}: the saved TP shards {sorted(by)} are not complete")
        return torch.cat([get(by[t], name) for t in range(len(by))], dim=dim)

    def _join_etp(self, name: str, ranks: list[int],
                  get: Callable[[int, str], torch.Tensor]) -> torch.Tensor:
        """One EP rank's experts of ``name`` joined over its ETP ranks (the inverse of
        moeplug.parallel.expert_tp.etp_slice)."""
        pieces = [get(r, name) for r in ranks]
        if len(pieces) == 1:
            return pieces[0]
        prefix, _, leaf = name.rpartition(".")
        if leaf == "down_proj":
            return torch.cat(pieces, dim=2)
        if leaf != "gate_up_proj":
            raise KeyError(f"{name}: an expert parameter split by ETP must be gate_up_proj or "
                           "down_proj")
        Fl = get(ranks[0], f"{prefix}.down_proj").shape[2]
        halves = pieces[0].shape[1] // Fl  # 2: gate rows then up rows; 1: a plain FC1
        split = [p.split(Fl, dim=1) for p in pieces]
        return torch.cat([torch.cat([s[h] for s in split], dim=1) for h in range(halves)], dim=1)


def _manifest(handle: Any) -> dict | None:
    raw = (handle.metadata() or {}).get(MANIFEST)
    return None if raw is None else json.loads(raw)


# --- the cut (this rank) --------------------------------------------------------------------

def _coords_of(groups: Any) -> dict[str, tuple[int, int]]:
    if groups is None:
        return {}
    return {k: (groups.rank_in(k), groups.size(k)) for k in ("ep", "etp", "tp")}


def local_model_state(model: nn.Module, saved: SavedRanks,
                      groups: Any) -> dict[str, torch.Tensor]:
    """This rank's state dict (keys as ``model.state_dict()``'s) from the saved ranks: each
    parameter cut to this rank's shard, buffers whole. Keys no rank stored are left out (tied
    weights are stored once; the loader checks the rest)."""
    from moeplug.parallel.sharding import shard_parameters
    out: dict[str, torch.Tensor] = {}
    for prefix, m in parts(model):
        full = {}
        for key in m.state_dict():
            t = saved.model_tensor(key)
            if t is not None:
                full[key] = t
        params = {n for n, _ in m.named_parameters()}
        cut = shard_parameters(m, full, caller="resharding", **_coords_of(groups))
        out.update({prefix + k: (cut[k] if k in params else v) for k, v in full.items()})
    return out


def load_optimizer_state(optimizer: Any, model: nn.Module, saved: SavedRanks,
                         groups: Any) -> None:
    """Cut the saved optimizer state for this rank's ``optimizer`` — a torch AdamW or a
    DistributedAdamW over ``model`` built with ``groups`` (None: one process) — and load it.
    Load the model first: the distributed optimizer re-reads its fp32 master slices from the
    parameters (where they are not the saved fp32 main copies of bf16 parameters)."""
    from moeplug.parallel.comm import group_rank, group_size
    from moeplug.parallel.sharding import shard_parameters
    from moeplug.training.dist_optim import DistributedAdamW, _flat

    names = global_names(model)
    state = saved.optimizer_state(list(names.values()))
    if not state:  # saved before the first optimizer step (e.g. a convert import): no moments
        if isinstance(optimizer, DistributedAdamW):  # but its master slices are the model's
            optimizer.reload_masters()
        return
    # The parameters stepped through an fp32 main copy (bf16 ones with train.param_dtype: bf16)
    if isinstance(optimizer, DistributedAdamW):
        wants_main = {id(p) for b in optimizer.buckets if b.holds_main for p in b.params}
    else:
        wants = getattr(optimizer, "wants_main", lambda p: False)
        wants_main = {id(p) for g in optimizer.param_groups for p in g["params"] if wants(p)}
    keys = MOMENTS + ((MAIN,) if wants_main else ())
    for _, m in parts(model):  # this rank's experts (and any other shard) of every moment
        params = dict(m.named_parameters())
        for k in keys:
            # A parameter without saved state keeps its place with its weight (then dropped).
            # Without a saved fp32 main copy, the saved weight is the best there is.
            full = {n: state[n][k] if n in state and k in state[n] else saved.model_tensor(n)
                    for n in params}
            cut = shard_parameters(m, full, caller="resharding", **_coords_of(groups))
            for n in params:
                if n in state:
                    state[n] = {**state[n], k: cut[n]}
    if isinstance(optimizer, DistributedAdamW):
        per_bucket = {}
        for b, bucket in enumerate(optimizer.buckets):
            W, r, n = group_size(bucket.group), group_rank(bucket.group), bucket.slice_len
            keys = MOMENTS + ((MAIN,) if id(bucket.params[0]) in wants_main else ())
            mine = {k: _flat([state[names[id(p)]][k].float() for p in bucket.params],
                             n * W)[r * n:(r + 1) * n].clone() for k in keys}
            per_bucket[b] = {"step": state[names[id(bucket.params[0])]]["step"].clone(), **mine}
        inner_groups = optimizer.inner.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": per_bucket, "param_groups": inner_groups})
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per_param = {i: {k: v.clone() for k, v in state[names[id(p)]].items()
                     if k != MAIN or id(p) in wants_main}
                 for i, p in enumerate(params) if names[id(p)] in state}
    optimizer.load_state_dict({"state": per_param,
                               "param_groups": optimizer.state_dict()["param_groups"]})
