"""What every family shares: reading and writing HF directories safely, the moeplug checkpoint
side (through moeplug.training.checkpoint), and the weight renames common to Llama-style models.

HF side: ``config.json`` + ``*.safetensors`` only. Nothing here ever unpickles: a directory with
only ``.bin``/``.pt`` weights is refused (pickle files can run code on load).

Weight layouts (D hidden, F expert FFN, E experts): ours keep experts fused —
``ffn.experts.gate_up_proj`` [E, 2F, D] (gate rows, then up rows) and ``ffn.experts.down_proj``
[E, D, F]. HF checkpoints on disk hold one matrix per expert (``experts.{e}.{gate,up,down}``);
transformers 5 fuses them at load time into the same layout as ours (which we also accept).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moeplug.config import ConfigError, ModelConfig, RootConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
HF_WEIGHTS = "model.safetensors"


class ConvertError(ConfigError):
    """A model cannot be converted; the message names the field, the value and the fix."""


def hf_fail(family: str, name: str, value: Any, rule: str, fix: str) -> None:
    raise ConvertError(f"{family}.{name} = {value!r}: {rule}. Fix: {fix}")


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
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{cfg_path!r} is not valid JSON ({e}). Fix: restore the model's "
                           f"config.json") from None
    return config


def read_hf_weights(path: str) -> dict[str, torch.Tensor]:
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
    tensors: dict[str, torch.Tensor] = {}
    for p in files:
        try:
            tensors.update(load_file(p))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConvertError(f"{p!r} is not a valid safetensors file ({e}). Fix: re-download "
                               f"or re-save it") from None
    return tensors


def write_hf_dir(path: str, config: dict, tensors: Mapping[str, torch.Tensor]) -> None:
    """config.json + one model.safetensors (tensors cloned contiguous: no shared storage)."""
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(path, HF_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def rope_theta(family: str, hf: Mapping) -> float:
    """The RoPE base of a default-RoPE config (transformers 5 ``rope_parameters`` or 4.x keys)."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if hf.get("rope_scaling"):
        rope_type = hf["rope_scaling"].get("rope_type", hf["rope_scaling"].get("type"))
    if rope_type != "default":
        hf_fail(family, "rope_parameters.rope_type", rope_type,
                "moeplug implements only the default RoPE (no YaRN/linear/dynamic scaling)",
                "import a model with rope_type 'default'")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


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
