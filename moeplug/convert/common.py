"""What every family shares: reading and writing HF directories safely, the moeplug checkpoint
side (through moeplug.training.checkpoint), and the weight renames common to Llama-style models.

HF side: ``config.json`` (missing keys at transformers' defaults: :func:`hf_config`),
``generation_config.json``'s token ids, and ``*.safetensors`` only. Nothing here ever
unpickles: a directory with only ``.bin``/``.pt`` weights is refused (pickle files can run code
on load).

Weight layouts (D hidden, F expert FFN, E experts): ours keep experts fused —
``ffn.experts.gate_up_proj`` [E, 2F, D] (gate rows, then up rows) and ``ffn.experts.down_proj``
[E, D, F]. HF checkpoints on disk hold one matrix per expert (``experts.{e}.{gate,up,down}``);
transformers 5 fuses them at load time into the same layout as ours (which we also accept).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moeplug.config import ConfigError, ModelConfig, RootConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
HF_WEIGHTS = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"


class ConvertError(ConfigError):
    """A model cannot be converted; the message names the field, the value and the fix."""


def hf_fail(family: str, name: str, value: Any, rule: str, fix: str) -> None:
    raise ConvertError(f"{family}.{name} = {value!r}: {rule}. Fix: {fix}")


# --------------------------------------------------------------------------------------------
# config.json as transformers reads it
# --------------------------------------------------------------------------------------------
# A key missing from config.json takes the default of the family's transformers config class
# (MixtralConfig() etc.), as from_pretrained does. Each family module keeps the defaults it
# reads in a table (HF_DEFAULTS) rather than asking transformers at import time: transformers
# is an optional dependency (tests only), importing it costs seconds, and an import must mean
# the same model whether it is installed or not. tests/test_hf_import_defaults.py checks every
# entry against the installed transformers' classes, so a table that drifts fails there.

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class HFConfig(dict):
    """config.json with the family's transformers defaults filled in. Reading a key that is
    neither in config.json nor in the defaults table is a ConvertError naming it (not a bare
    KeyError traceback)."""

    def __init__(self, family: str, data: Mapping[str, Any]):
        super().__init__(data)
        self.family = family

    def __missing__(self, key: str) -> Any:
        raise ConvertError(f"config.json lacks {key!r}, which {self.family} has no default "
                           f"for. Fix: add \"{key}\" to config.json (its value from the model's "
                           f"source)")


def hf_config(family: str, defaults: Mapping[str, Any], aliases: Mapping[str, str],
              raw: Mapping[str, Any]) -> HFConfig:
    """``raw`` (config.json) as the family's transformers class reads it: ``aliases`` (its
    attribute_map: another name for the same field) renamed, missing keys at ``defaults``.
    A key present with null stays null, as in transformers."""
    if isinstance(raw, HFConfig):
        return raw
    data = dict(defaults)
    data.update({aliases[k]: v for k, v in raw.items() if k in aliases})
    data.update({k: v for k, v in raw.items() if k not in aliases})  # the real name wins
    return HFConfig(family, data)


def check_sizes(family: str, hf: Mapping[str, Any], *names: str) -> None:
    """Refuse, naming the HF field, a size that is not a positive integer (moeplug's own
    ModelConfig check would name its field, which the user never wrote)."""
    for name in names:
        v = hf[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            hf_fail(family, name, v, "must be a positive integer for moeplug to build the model",
                    f"import a model whose config.json sets {name} >= 1")


def token_ids(hf: Mapping[str, Any]) -> dict:
    """bos/eos/pad token ids of config.json (family defaults filled in)."""
    return {k: hf.get(k) for k in TOKEN_ID_KEYS}


# --------------------------------------------------------------------------------------------
# HF directories
# --------------------------------------------------------------------------------------------

def read_hf_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor of every *.safetensors file)."""
    return read_hf_config(path), read_hf_weights(path)


def read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConvertError(f"--hf {path!r}: no config.json there. Fix: pass a Hugging Face model "
                           f"directory (config.json + *.safetensors), e.g. one written by "
                           f"save_pretrained")
    return _json_file(cfg_path, "restore the model's config.json")


def _json_file(path: str, fix: str) -> Any:
    """The JSON in ``path``; ConvertError naming it and ``fix`` when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ConvertError(f"{path!r} is not valid JSON ({e}). Fix: {fix}") from None


def read_hf_weights(path: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for p in hf_weight_files(path):
        try:
            tensors.update(load_file(p))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConvertError(f"{p!r} is not a valid safetensors file ({e}). Fix: re-download "
                               f"or re-save it") from None
    return tensors


def hf_weight_files(path: str) -> list[str]:
    """The directory's *.safetensors files; ConvertError when there are none."""
    # A listing, not glob: a user's directory name may hold glob characters ("hf[1]").
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        pickles = sorted(os.path.basename(p) for p in os.listdir(path)
                         if p.endswith(PICKLE_SUFFIXES))
        what = f"only pickle weights {pickles}" if pickles else "no weights"
        raise ConvertError(
            f"--hf {path!r}: {what}, no *.safetensors. moeplug never loads pickle files (.bin/.pt "
            f"can run code). Fix: convert them to safetensors with a tool you trust (e.g. "
            f"transformers' save_pretrained), then import that directory")
    return files


def read_generation_token_ids(path: str) -> dict | None:
    """bos/eos/pad of ``generation_config.json`` (what transformers' generate() stops at), or
    None without that file. A key it lacks is None, as in transformers' GenerationConfig."""
    gen_path = os.path.join(path, GENERATION_CONFIG)
    if not os.path.isfile(gen_path):
        return None
    gen = _json_file(gen_path, f"restore the model's {GENERATION_CONFIG}, or remove it "
                     f"(generation then takes the token ids of config.json)")
    if not isinstance(gen, dict):
        raise ConvertError(f"{gen_path!r} holds a JSON {type(gen).__name__}, not an object. Fix: "
                           f"restore the model's {GENERATION_CONFIG}, or remove it")
    return {k: gen.get(k) for k in TOKEN_ID_KEYS}


def write_hf_dir(path: str, config: dict, tensors: Mapping[str, torch.Tensor],
                 generation: Mapping[str, Any] | None = None) -> None:
    """config.json + one model.safetensors (tensors cloned contiguous: no shared storage), and
    generation_config.json with the ``generation`` token ids when any is known (else none: a
    stale one from an earlier export would still steer generate())."""
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(path, HF_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    gen_path = os.path.join(path, GENERATION_CONFIG)
    known = {k: v for k, v in (generation or {}).items() if v is not None}
    if known:
        with open(gen_path, "w", encoding="utf-8") as f:
            json.dump(known, f, indent=2, sort_keys=True)
    elif os.path.isfile(gen_path):
        os.remove(gen_path)


class ReadTracker(Mapping):
    """A read-only view of HF weights that records which names were read (``in`` does not
    count), so the importer can refuse weights it would otherwise drop unseen."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        self.read.add(name)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


# HF tensors that carry nothing to import: RoPE inverse frequencies (recomputed from
# rope_theta; non-persistent since transformers 4.3x, older checkpoints saved them).
_DERIVED = re.compile(r"(^|\.)(original_)?inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_all_read(family: str, hf: Mapping[str, Any], tracker: ReadTracker, m: ModelConfig,
                   hints: tuple[tuple[str, str], ...],
                   ignored: Callable[[str, ModelConfig], bool] | None = None) -> None:
    """Refuse an import that would drop HF tensors: every tensor must have been read, except
    derived buffers (``inv_freq``), empty tensors (what save_pretrained writes for zero shared
    experts), a tied ``lm_head.weight`` equal to the embedding, and what ``ignored(name, m)``
    names (a family's copies, e.g. DeepSeek-V3's MTP embedding/head). ``hints``: (regex,
    config.json field) pairs naming the field that most likely should describe an unread
    tensor."""
    sd = tracker.tensors
    embed = sd.get("model.embed_tokens.weight")
    unread = []
    for name in sorted(set(sd) - tracker.read):
        t = sd[name]
        if _DERIVED.search(name) or t.numel() == 0 or (ignored and ignored(name, m)):
            continue
        if (name == "lm_head.weight" and m.tie_embeddings and embed is not None
                and t.shape == embed.shape and torch.equal(t, embed)):
            continue
        unread.append(name)
    if not unread:
        return
    field = None
    deep = [n for n in unread if _LAYER.match(n) and int(_LAYER.match(n).group(1)) >= m.num_layers]
    if deep:
        field = "num_hidden_layers"
    elif "lm_head.weight" in unread:
        field = "tie_word_embeddings"
    else:
        field = next((f for pattern, f in hints for n in unread if re.search(pattern, n)), None)
    shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
    cause = (f"{family}.{field} = {hf.get(field)!r} does not describe them" if field else
             "config.json does not describe them")
    raise ConvertError(f"{len(unread)} HF tensor(s) map to no weight of the model config.json "
                       f"describes ({shown}); importing would silently drop them. Likely cause: "
                       f"{cause}. Fix: correct config.json to match the weights (or remove "
                       f"tensors that do not belong to this model)")


def rope_theta(family: str, hf: Mapping) -> float:
    """The RoPE base of a default-RoPE config (transformers 5 ``rope_parameters`` or 4.x keys;
    ``hf`` from :func:`hf_config`, so ``rope_theta`` holds the family's default)."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if hf.get("rope_scaling"):
        rope_type = hf["rope_scaling"].get("rope_type", hf["rope_scaling"].get("type"))
    if rope_type != "default":
        hf_fail(family, "rope_parameters.rope_type", rope_type,
                "moeplug implements only the default RoPE (no YaRN/linear/dynamic scaling)",
                "import a model with rope_type 'default'")
    theta = params.get("rope_theta", hf["rope_theta"])
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        hf_fail(family, "rope_parameters.rope_theta", theta, "must be a number > 0",
                "import a model with a positive rope_theta")
    return float(theta)


def hf_rope(theta: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def require(family: str, hf: Mapping, name: str, allowed: tuple, fix: str) -> None:
    if hf.get(name, allowed[0]) not in allowed:
        hf_fail(family, name, hf.get(name), f"moeplug supports only {allowed}", fix)


# --------------------------------------------------------------------------------------------
# Weight renames shared by the families
# --------------------------------------------------------------------------------------------

GQA_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
            "q_norm": "q_norm", "k_norm": "k_norm"}
MLA_ATTN = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm",
            "q_b_proj": "q_b_proj", "kv_a_proj_with_mqa": "kv_a_proj",
            "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj"}


def block_pairs(m: ModelConfig, hf: str, ours: str, is_moe: bool, moe_name: str,
                ) -> list[tuple[str, str]]:
    """(HF name, our name) for one decoder block's non-expert weights.

    ``hf``/``ours``: the block prefixes ("model.layers.3.", "blocks.3."); ``moe_name``: the HF
    name of the MoE module ("mlp" or Mixtral's "block_sparse_moe").
    """
    pairs = [(hf + "input_layernorm.weight", ours + "attn_norm.weight"),
             (hf + "post_attention_layernorm.weight", ours + "ffn_norm.weight")]
    if m.attention == "mla":
        names = dict(MLA_ATTN)
        drop = ("q_proj",) if m.mla.q_lora_rank else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    else:
        names = dict(GQA_ATTN)
        drop = () if m.qk_norm else ("q_norm", "k_norm")
    for h, o in names.items():
        if h not in drop:
            pairs.append((f"{hf}self_attn.{h}.weight", f"{ours}attn.{o}.weight"))
    if not is_moe:
        pairs += [(f"{hf}mlp.{p}.weight", f"{ours}ffn.{p}.weight")
                  for p in ("gate_proj", "up_proj", "down_proj")]
        return pairs
    pairs.append((f"{hf}{moe_name}.gate.weight", f"{ours}ffn.router.weight"))
    if m.moe.shared_expert_ffn_hidden_size:
        pairs += [(f"{hf}{moe_name}.shared_experts.{p}.weight", f"{ours}ffn.shared.{p}.weight")
                  for p in ("gate_proj", "up_proj", "down_proj")]
    return pairs


def experts_from_hf(hf_sd: Mapping[str, torch.Tensor], prefix: str, num_experts: int,
                    names: tuple[str, str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [E, 2F, D], down_proj [E, D, F]) from HF's fused or per-expert layout.

    ``prefix``: "model.layers.3.mlp.experts."; ``names``: per-expert (gate, up, down) names,
    e.g. ("gate_proj", "up_proj", "down_proj") or Mixtral's ("w1", "w3", "w2").
    """
    if prefix + "gate_up_proj" in hf_sd:
        return hf_sd[prefix + "gate_up_proj"], hf_sd[prefix + "down_proj"]
    gate, up, down = names
    try:
        gate_up = torch.stack([torch.cat((hf_sd[f"{prefix}{e}.{gate}.weight"],
                                          hf_sd[f"{prefix}{e}.{up}.weight"]), dim=0)
                               for e in range(num_experts)])
        down_EDF = torch.stack([hf_sd[f"{prefix}{e}.{down}.weight"] for e in range(num_experts)])
    except KeyError as e:
        raise ConvertError(f"HF checkpoint lacks expert weight {e.args[0]!r} ({num_experts} "
                           f"experts expected from config.json). Fix: check that the weights "
                           f"and config.json belong to the same model") from None
    return gate_up, down_EDF


def experts_to_hf(gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor, prefix: str,
                  names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The per-expert on-disk layout HF checkpoints use."""
    gate, up, down = names
    F = down_EDF.shape[-1]
    out = {}
    for e in range(gate_up_E2FD.shape[0]):
        out[f"{prefix}{e}.{gate}.weight"] = gate_up_E2FD[e, :F]
        out[f"{prefix}{e}.{up}.weight"] = gate_up_E2FD[e, F:]
        out[f"{prefix}{e}.{down}.weight"] = down_EDF[e]
    return out


def take(sd: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise ConvertError(f"{where} lacks weight {name!r}. Fix: check that the weights and the "
                           f"config belong to the same model") from None


def main_blocks(m: ModelConfig) -> list[tuple[str, str, bool]]:
    """(HF prefix, our prefix, is MoE) of every decoder block."""
    return [(f"model.layers.{i}.", f"blocks.{i}.", moe) for i, moe in enumerate(m.moe_layer_pattern)]


def convert_model_weights(sd: Mapping[str, torch.Tensor], m: ModelConfig, moe_name: str,
                          expert_names: tuple[str, str, str], to_ours: bool,
                          extra_pairs: list[tuple[str, str]] = (),
                          blocks: list[tuple[str, str, bool]] | None = None
                          ) -> dict[str, torch.Tensor]:
    """Rename a whole model (embeddings, blocks, experts, final norm, head) in either direction.

    Extra (HF, ours) pairs (e.g. the router's expert bias) and extra blocks (MTP) come from the
    family; ``blocks`` defaults to :func:`main_blocks`.
    """
    blocks = main_blocks(m) if blocks is None else blocks
    pairs = [("model.embed_tokens.weight", "embed.weight"), ("model.norm.weight", "norm.weight")]
    if not m.tie_embeddings:
        pairs.append(("lm_head.weight", "head.weight"))
    for hf_prefix, ours, is_moe in blocks:
        pairs += block_pairs(m, hf_prefix, ours, is_moe, moe_name)
    pairs += list(extra_pairs)
    where = "HF checkpoint" if to_ours else "moeplug checkpoint"
    out = {(o if to_ours else h): take(sd, h if to_ours else o, where) for h, o in pairs}
    for hf_block, ours_block, is_moe in blocks:
        if not is_moe:
            continue
        hf_prefix, ours = f"{hf_block}{moe_name}.experts.", f"{ours_block}ffn.experts."
        if to_ours:
            out[ours + "gate_up_proj"], out[ours + "down_proj"] = experts_from_hf(
                sd, hf_prefix, m.moe.num_experts, expert_names)
        else:
            out.update(experts_to_hf(take(sd, ours + "gate_up_proj", where),
                                     take(sd, ours + "down_proj", where), hf_prefix, expert_names))
    return out


def topk_options(cfg: RootConfig, family: str) -> dict:
    """The built-in ``topk`` router's options, after checking the router is that one."""
    if cfg.plugins.router != "topk":
        hf_fail(family, "plugins.router", cfg.plugins.router, "export knows the weights of the "
                "built-in 'topk' router only", "train with plugins.router: topk")
    return dict(cfg.plugins.router_options)


# topk router options that leave what a trained model computes unchanged: how the router runs
# (its execution_only ones are dropped before this), the gate GEMM's precision, and what it
# adds in training only: balancing losses, input noise, the expert bias's update rate, and the
# zero-weight padding rows of quantized GEMMs. (token_drop_policy and pad_to_capacity act only
# with a capacity_factor, which no family expresses.) No HF family computes any of them.
INFERENCE_NEUTRAL = frozenset({
    "load_balancing_type", "aux_loss_coeff", "aux_loss_counts", "z_loss_coeff",
    "input_jitter_eps", "bias_update_rate", "dtype", "padding_for_quantization",
    "force_load_balancing_seed", "token_drop_policy", "pad_to_capacity"})
# A plain top-k router: what Mixtral and Qwen3-MoE compute (softmax, renormalised or not).
PLAIN_ROUTER = {"score_function": "softmax", "topk_scaling_factor": 1.0, "num_groups": None,
                "group_topk": None, "enable_expert_bias": False, "capacity_factor": None,
                "force_load_balancing": False}


def router_semantics(cfg: RootConfig, family: str) -> dict:
    """What the ``topk`` router computes at inference, as its options: defaults filled in,
    ``renormalize`` resolved (None: top_k > 1), the inference-neutral ones left out, and
    ``group_score`` only with groups. Refuses another router and invalid options."""
    from moeplug.plugin_host import PluginHost
    opts = topk_options(cfg, family)
    full = PluginHost.load(block=cfg.plugins.block).defining_options("router", "topk", opts)
    if full is None:
        hf_fail(family, "plugins.router_options", opts, "are not valid options of the topk "
                "router", "fix them as `moeplug train` reports, then export")
    sem = {k: v for k, v in full.items() if k not in INFERENCE_NEUTRAL}
    if sem["renormalize"] is None:
        sem["renormalize"] = cfg.model.moe.top_k > 1
    if (sem["num_groups"] or 1) <= 1:
        sem.pop("group_score")
    return sem


def check_router(family: str, sem: dict, expressed: dict, fix: str) -> None:
    """Refuse unless every routing option in ``sem`` (:func:`router_semantics`) has the value
    ``expressed`` gives it (a value, or a tuple of the values the family can write), or, when
    not named there, a plain router's (:data:`PLAIN_ROUTER`)."""
    for name, value in sem.items():
        want = expressed.get(name, PLAIN_ROUTER.get(name, value))
        ok = value in want if isinstance(want, tuple) else value == want
        if not ok:
            what = f"{want!r}" if not isinstance(want, tuple) else " or ".join(map(repr, want))
            hf_fail(family, f"plugins.router_options.{name}", value, f"{family.removesuffix('Config')} "
                    f"routes only with {name} = {what}, so the exported model would route "
                    f"differently", fix)


def check_moe_forward(cfg: RootConfig, family: str) -> None:
    """What every family computes the same way: each expert's output times its weight."""
    if cfg.model.moe.apply_probs_on_input:
        hf_fail(family, "model.moe.apply_probs_on_input", True, "the HF MoE blocks weight each "
                "expert's output, not its input (FC2's input differs after the activation)",
                "export a model trained with apply_probs_on_input: false")
