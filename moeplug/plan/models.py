"""Models the planner knows beyond the presets, and the published rows it is checked against.

Published hyper-parameters (Hugging Face config.json of each model):
    qwen3_235b      Qwen3-235B-A22B: hidden 4096, 94 layers, 64 q / 4 kv heads of 128, 128 experts
                    top-8 of width 1536, vocab 151936
    mixtral_8x22b   Mixtral-8x22B: hidden 6144, 56 layers, 48 q / 8 kv heads, 8 experts top-2 of
                    width 16384, vocab 32768
    qwen2_57b       Qwen2-57B-A14B: hidden 3584, 28 layers, 28 q / 4 kv heads, 64 experts top-8 of
                    width 2560, gated shared expert of width 20480, vocab 151936
Rows: P26 = arXiv 2603.07685 (Table 20, Appendix B.2 switches), PF = arXiv 2504.14960, as
gathered in megatron_moe.md; the switches (recompute, 1F1B A2A overlap, dispatcher, offload)
are the published ones per platform, not tuned here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from moeplug.config import ConfigError, ModelConfig, load_config

PLAN_MODELS: dict[str, dict] = {
    "qwen3_235b": {"model": dict(
        vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        kv_channels=128, qk_norm=True, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
        first_k_dense=0, dense_ffn_hidden_size=12288,
        moe=dict(num_experts=128, top_k=8, ffn_hidden_size=1536, aux_loss_coeff=1e-3))},
    "mixtral_8x22b": {"model": dict(
        vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48, num_kv_heads=8,
        max_seq_len=65536, rope_theta=1e6, norm_eps=1e-5, first_k_dense=0,
        dense_ffn_hidden_size=16384,
        moe=dict(num_experts=8, top_k=2, ffn_hidden_size=16384, aux_loss_coeff=0.02))},
    "qwen2_57b": {"model": dict(
        vocab_size=151936, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6, first_k_dense=0,
        dense_ffn_hidden_size=18944,
        moe=dict(num_experts=64, top_k=8, ffn_hidden_size=2560,
                 shared_expert_ffn_hidden_size=20480, shared_expert_gate=True,
                 aux_loss_coeff=1e-3))},
}


def model_names() -> list[str]:
    from moeplug.config.presets import PRESETS
    return sorted([*PRESETS, *PLAN_MODELS])


def model_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset or of a planner model."""
    from moeplug.config.presets import PRESETS, preset
    if name in PLAN_MODELS:
        return load_config(None, [], base=copy.deepcopy(PLAN_MODELS[name])).model
    if name in PRESETS:
        return load_config(None, [], base=preset(name)).model
    raise ConfigError(f"--preset {name!r}: unknown model. Fix: use one of "
                      f"{', '.join(model_names())}")


def route_groups(name: str) -> int:
    """Expert groups a token may use (DeepSeek's group-limited routing), 0 when unlimited."""
    from moeplug.config.presets import PRESETS
    opts = PRESETS.get(name, {}).get("plugins", {}).get("router_options", {})
    return int(opts.get("group_topk", 0)) if opts.get("num_groups") else 0


@dataclass(frozen=True, kw_only=True)
class Row:
    """One published throughput row: model, system, mapping, switches and the target."""
    source: str
    model: str
    cluster: str
    gpus: int
    precision: str            # "bf16" or "fp8" (MXFP8 / blockwise FP8 run FP8 GEMMs)
    tp: int
    pp: int
    ep: int
    vpp: int
    mbs: int
    gbs: int
    seq: int = 4096
    cp: int = 1
    recompute: tuple = ()     # Megatron recompute_modules
    offload: tuple = ()       # fine-grained activation offloading modules
    a2a_overlap: bool = False  # combined-1F1B EP overlap
    dispatcher: str = "flex"   # HybridEP / DeepEP (token-based) vs "alltoall"
    tflops: float = 0.0       # published TFLOP/s per GPU (0: MFU row)
    mfu: float = 0.0          # published MFU (PF)
    note: str = ""
    extra: dict = field(default_factory=dict)
    # The published pipeline split, as moeplug train's parallel fields (Megatron's own flags):
    # a layout string, or the embedding / loss accounted in the split; {} for an even split.
    split: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.model} {self.cluster.upper()} {self.gpus} {self.precision} " \
               f"TP{self.tp} PP{self.pp} EP{self.ep} VPP{self.vpp}"


_DSV3_GB = dict(model="deepseek_v3", dispatcher="flex")
_QWEN = dict(model="qwen3_235b", dispatcher="flex")
# Published layouts: megatron_moe.md (P26 Appendix B.2 and the Megatron-MoE-ModelZoo scripts):
# GB200/GB300 PP4 x VPP4 "Et*4|(tttt|)*14tmL", H100 PP8 x VPP4 "Et*3|(tt|)*29m|L" (also the
# ModelZoo's 256-GPU B200 PP8 EP32 line, which the GB200 BF16 PP8 x VPP4 row is); Qwen3-235B:
# the ModelZoo's model config sets --account-for-embedding/loss-in-pipeline-split.
_DSV3_PP4 = {"pipeline_layout": "Et*4|(tttt|)*14tmL"}
_DSV3_PP8 = {"pipeline_layout": "Et*3|(tt|)*29m|L"}
_QWEN_SPLIT = {"account_for_embedding_in_pipeline_split": True,
               "account_for_loss_in_pipeline_split": True}
P26_ROWS: tuple[Row, ...] = (
    Row(source="P26", cluster="gb300", gpus=256, precision="fp8", tp=1, pp=4, ep=64, vpp=4,
        split=_DSV3_PP4, mbs=1, gbs=8192, a2a_overlap=True, tflops=1233, **_DSV3_GB),
    Row(source="P26", cluster="gb200", gpus=256, precision="fp8", tp=1, pp=4, ep=64, vpp=4,
        split=_DSV3_PP4, mbs=1, gbs=8192, recompute=("mlp",), tflops=1048, **_DSV3_GB),
    Row(source="P26", cluster="gb200", gpus=256, precision="bf16", tp=1, pp=8, ep=32, vpp=4,
        split=_DSV3_PP8, mbs=1, gbs=4096, recompute=("mlp",), tflops=857, **_DSV3_GB),
    # Table 17 / the MZ script say PP8 (Table 20's PP4 is the inconsistency megatron_moe.md notes).
    Row(source="P26", cluster="h100", gpus=1024, precision="fp8", tp=2, pp=8, ep=64, vpp=4,
        split=_DSV3_PP8, mbs=1, gbs=8192, recompute=("mla_up_proj", "mlp"), a2a_overlap=True,
        tflops=368, **_DSV3_GB),
    Row(source="P26", cluster="gb300", gpus=256, precision="fp8", tp=1, pp=4, ep=64, vpp=6,
        mbs=2, gbs=3072, tflops=974, split=_QWEN_SPLIT, **_QWEN),
    Row(source="P26", cluster="gb200", gpus=256, precision="fp8", tp=1, pp=4, ep=64, vpp=6,
        mbs=3, gbs=3072, recompute=("moe_act", "layernorm"), offload=("expert_fc1", "moe_act"),
        a2a_overlap=True, tflops=919, split=_QWEN_SPLIT, **_QWEN),
    Row(source="P26", cluster="gb200", gpus=256, precision="bf16", tp=1, pp=4, ep=32, vpp=12,
        mbs=1, gbs=8192, recompute=("moe_act", "layernorm"), a2a_overlap=True, tflops=750,
        split=_QWEN_SPLIT, **_QWEN),
    Row(source="P26", cluster="h100", gpus=256, precision="bf16", tp=2, pp=8, ep=32, vpp=4,
        mbs=1, gbs=2048, recompute=("moe_act", "layernorm"), a2a_overlap=True, tflops=320,
        split=_QWEN_SPLIT, **_QWEN),
)

# PF: Mixtral-8x22B on 128 H100 (TP2 EP8 PP8, ETP1, seq 4096, GBS 256), BF16, alltoall
# dispatcher; Qwen2-57B-A14B on 64 H100 at 39.0 % MFU, whose mapping our sources do not give:
# it is checked against the planner's best mapping for that cluster (see tests/test_plan.py).
PF_ROWS: tuple[Row, ...] = (
    Row(source="PF", model="mixtral_8x22b", cluster="h100", gpus=128, precision="bf16", tp=2,
        pp=8, ep=8, vpp=1, mbs=1, gbs=256, dispatcher="alltoall", mfu=0.493),
    Row(source="PF", model="qwen2_57b", cluster="h100", gpus=64, precision="bf16", tp=1, pp=1,
        ep=1, vpp=1, mbs=1, gbs=256, dispatcher="alltoall", mfu=0.390,
        note="mapping not published in our sources: the planner's best mapping is compared"),
)

# P26 Table 3: DeepSeek-V3, BF16, PP4 x VPP4 x EP64 on 256 GPUs, per-GPU GB.
DSV3_MEMORY_ROW = Row(source="P26 Table 3", model="deepseek_v3", cluster="gb200", gpus=256,
                      precision="bf16", tp=1, pp=4, ep=64, vpp=4, mbs=1, gbs=8192,
                      split=_DSV3_PP4)
DSV3_MEMORY_GB = {"weights_grads": 36.4, "optimizer": 32.1, "activations": 131.0}
