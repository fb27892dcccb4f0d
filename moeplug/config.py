"""Validated configuration: one frozen-at-construction dataclass per component.

Every check runs in ``__post_init__`` and raises :class:`ConfigError` whose message names the
class, the field, the bad value and the fix, so a bad config fails before any model, data or
process group exists. ``RootConfig`` cross-checks fields that span components.

Loading: :func:`load_config` merges, in order, the dataclass defaults, a YAML file, and dotted
overrides (``model.moe.num_experts=8``); unknown keys are errors (with the closest valid name).
A loaded config reports every problem at once (``ConfigError.errors``): each section's checks
keep going after a failure, and the cross-section checks still run over such sections.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import yaml

_log = logging.getLogger(__name__)  # notices; with no logging set up, Python prints them


class ConfigError(ValueError):
    """A config value is invalid. The message names the field, the value and the fix.

    ``errors``: one such message per problem; several when a config has several mistakes (the
    message then holds them one per line).
    """

    def __init__(self, *errors: str) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


# While config_from_dict builds a config, _fail records here instead of raising, so the
# remaining checks still run and report their own problems (None: raise at once).
_found: ContextVar[list[str] | None] = ContextVar("moeplug_config_errors", default=None)


def _fail(obj: Any, name: str, value: Any, rule: str, fix: str) -> None:
    message = f"{type(obj).__name__}.{name} = {value!r}: {rule}. Fix: {fix}"
    found = _found.get()
    if found is None:
        raise ConfigError(message)
    found.append(message)


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(obj, n, v, "must be a positive integer", f"set {n} to an integer >= 1")


def _non_negative(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            _fail(obj, n, v, "must be a number >= 0", f"set {n} to 0 or more")


# Expert activations (moeplug.ops.activations implements them); the gated ones double FC1.
ACTIVATIONS = ("swiglu", "geglu", "gelu", "squared_relu")
GATED_ACTIVATIONS = ("swiglu", "geglu")


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """The routed feed-forward block of an MoE layer."""

    num_experts: int = 8
    top_k: int = 2
    ffn_hidden_size: int = 384
    aux_loss_coeff: float = 1e-2
    # Expert (and shared-expert) activation; gated ones (swiglu, geglu) need a 2F-row FC1.
    activation: str = "swiglu"
    # Top-1 only: scale the expert's input rows by p instead of its activation (Megatron
    # moe_apply_probs_on_input): y = FC2(act(FC1(p * x))).
    apply_probs_on_input: bool = False
    # Shared experts: a dense MLP of this hidden size on every token (0 = none); with
    # shared_expert_gate its output is scaled by sigmoid(x . w_g), w_g [1, D].
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    # Which layers are MoE (Megatron moe_layer_freq): int N = every N-th layer (layer i is MoE
    # iff i % N == 0), or a 0/1 list with one entry per layer. ModelConfig.first_k_dense still
    # forces the first k layers dense; ModelConfig.moe_layer_pattern combines both.
    layer_freq: int | list = 1

    def __post_init__(self) -> None:
        _positive(self, "num_experts", "top_k", "ffn_hidden_size")
        _non_negative(self, "aux_loss_coeff", "shared_expert_ffn_hidden_size")
        if self.top_k > self.num_experts:
            _fail(self, "top_k", self.top_k, f"exceeds num_experts ({self.num_experts})",
                  f"set top_k <= {self.num_experts} or raise num_experts")
        if self.activation not in ACTIVATIONS:
            _fail(self, "activation", self.activation, "unsupported activation",
                  f"use one of {', '.join(map(repr, ACTIVATIONS))}")
        for n in ("apply_probs_on_input", "shared_expert_gate"):
            if not isinstance(getattr(self, n), bool):
                _fail(self, n, getattr(self, n), "must be a boolean", f"write {n}: true or false")
        if isinstance(self.shared_expert_ffn_hidden_size, float):
            _fail(self, "shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size,
                  "must be an integer", "set it to a whole number of units (0 = no shared expert)")
        if self.apply_probs_on_input and self.top_k != 1:
            _fail(self, "apply_probs_on_input", True,
                  f"needs top_k = 1 (got top_k = {self.top_k}): with several experts per token "
                  f"the input can be scaled by only one of their weights",
                  "set top_k: 1 or apply_probs_on_input: false")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            _fail(self, "shared_expert_gate", True, "gates a shared expert, but "
                  "shared_expert_ffn_hidden_size = 0 (none)",
                  "set shared_expert_ffn_hidden_size > 0 or shared_expert_gate: false")
        freq = self.layer_freq
        if isinstance(freq, bool) or not isinstance(freq, (int, list)):
            _fail(self, "layer_freq", freq, "must be an integer N or a list of 0/1",
                  "write layer_freq: 2 (every 2nd layer is MoE) or layer_freq: [0, 1, 1, 1]")
        if isinstance(freq, int) and freq < 1:
            _fail(self, "layer_freq", freq, "must be >= 1 (layer i is MoE iff i % N == 0)",
                  "set layer_freq: 1 for all-MoE, or N for every N-th layer")
        if isinstance(freq, list) and any(v not in (0, 1) or isinstance(v, float) for v in freq):
            _fail(self, "layer_freq", freq, "list entries must be 0 (dense) or 1 (MoE)",
                  "write one 0 or 1 per layer, e.g. [0, 1, 1, 1]")


ATTENTION_TYPES = ("gqa", "mla")


@dataclass(kw_only=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), used when ``model.attention = "mla"``.

    q = W_qb norm(W_qa x) (or W_q x when q_lora_rank = 0); [c_kv, k_rope] = W_kva x;
    [k_nope, v] = W_kvb norm(c_kv); each head's key is [k_nope; k_rope] with k_rope shared by all
    heads; RoPE touches only the rope part.
    """

    q_lora_rank: int = 0  # 0: queries projected directly from x (DeepSeek-V2-Lite style)
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # DeepSeek checkpoints store the rope dims as interleaved pairs (x0, x1), (x2, x3), ...;
    # False: the Llama "rotate half" layout.
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _non_negative(self, "q_lora_rank")
        if self.qk_rope_head_dim % 2:
            _fail(self, "qk_rope_head_dim", self.qk_rope_head_dim,
                  "is odd; RoPE rotates pairs of dimensions", "choose an even qk_rope_head_dim")
        if not isinstance(self.rope_interleave, bool):
            _fail(self, "rope_interleave", self.rope_interleave, "must be a boolean",
                  "write rope_interleave: true (DeepSeek checkpoints) or false")


# Activation recompute (moeplug.modules.recompute): Megatron's --recompute-modules names.
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "moe_act", "mlp", "moe",
                     "shared_experts")


@dataclass(kw_only=True, slots=True)
class RecomputeConfig:
    """What the backward recomputes instead of keeping (``model.recompute``).

    ``granularity: selective`` checkpoints the named ``modules`` in every layer; ``full``
    checkpoints whole transformer blocks: ``method: uniform`` groups each stage's blocks into
    chunks of ``num_layers`` (each chunk keeps only its input), ``block`` checkpoints the first
    ``num_layers`` blocks of each stage one by one. ``none`` keeps everything (the default).
    """

    granularity: str = "none"
    modules: list = field(default_factory=list)
    method: str = "uniform"
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.granularity not in ("none", "selective", "full"):
            _fail(self, "granularity", self.granularity, "unknown granularity",
                  "use none, selective or full")
        if not isinstance(self.modules, list):
            _fail(self, "modules", self.modules, "must be a list",
                  "write e.g. [core_attn, moe_act]")
        else:
            bad = [m for m in self.modules if m not in RECOMPUTE_MODULES]
            if bad:
                _fail(self, "modules", self.modules, f"unknown module name(s) {bad}",
                      f"use names from {', '.join(RECOMPUTE_MODULES)}")
            if self.modules and self.granularity != "selective":
                _fail(self, "modules", self.modules, f"needs granularity selective (got "
                      f"{self.granularity!r})", "set granularity: selective or drop modules")
        if self.method not in ("uniform", "block"):
            _fail(self, "method", self.method, "unknown method", "use uniform or block")
        _positive(self, "num_layers")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Decoder-only transformer. ``vocab_size = 0`` means: take it from the tokenizer."""

    vocab_size: int = 0
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    first_k_dense: int = 1
    dense_ffn_hidden_size: int = 768
    init_std: float = 0.02
    # Attention: "gqa" (grouped-query, Llama/Mixtral/Qwen) or "mla" (multi-head latent, see
    # MLAConfig). kv_channels: per-head width of q/k/v for gqa (Megatron's name, HF's head_dim);
    # 0 = hidden_size / num_heads. qk_norm: RMSNorm over each head's q and k before RoPE (Qwen3).
    attention: str = "gqa"
    kv_channels: int = 0
    qk_norm: bool = False
    mla: MLAConfig = field(default_factory=MLAConfig)
    # Multi-token prediction (DeepSeek-V3): mtp_num_layers extra blocks, block k predicting the
    # token k+1 ahead of the next; their mean loss times mtp_loss_scaling_factor joins the loss.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    moe: MoEConfig = field(default_factory=MoEConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)

    def __post_init__(self) -> None:
        _positive(self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len",
                  "dense_ffn_hidden_size")
        _non_negative(self, "vocab_size", "first_k_dense", "kv_channels", "mtp_num_layers",
                      "mtp_loss_scaling_factor")
        self._check_attention()
        if self.first_k_dense > self.num_layers:
            _fail(self, "first_k_dense", self.first_k_dense,
                  f"exceeds num_layers ({self.num_layers})", f"set first_k_dense <= {self.num_layers}")
        freq = self.moe.layer_freq
        if isinstance(freq, list) and len(freq) != self.num_layers:
            _fail(self.moe, "layer_freq", freq,
                  f"has {len(freq)} entries but num_layers = {self.num_layers}",
                  f"give exactly one 0/1 entry per layer ({self.num_layers})")

    def _check_attention(self) -> None:
        if self.attention not in ATTENTION_TYPES:
            _fail(self, "attention", self.attention, "unknown attention type",
                  f"use one of {', '.join(map(repr, ATTENTION_TYPES))}")
        if not isinstance(self.qk_norm, bool):
            _fail(self, "qk_norm", self.qk_norm, "must be a boolean", "write qk_norm: true or false")
        if isinstance(self.mtp_num_layers, float) or isinstance(self.kv_channels, float):
            name = "mtp_num_layers" if isinstance(self.mtp_num_layers, float) else "kv_channels"
            _fail(self, name, getattr(self, name), "must be an integer", f"set {name} to a whole number")
        if self.attention == "mla":
            # MLA has its own head widths (MLAConfig); num_kv_heads, kv_channels and qk_norm
            # do not apply, so reject the ones a user could believe take effect.
            if self.kv_channels:
                _fail(self, "kv_channels", self.kv_channels, "does not apply to attention 'mla'",
                      "set kv_channels: 0 and use mla.qk_nope_head_dim / mla.v_head_dim")
            if self.qk_norm:
                _fail(self, "qk_norm", True, "is not defined for attention 'mla' (it normalises "
                      "the latents instead)", "set qk_norm: false")
            return
        if self.kv_channels == 0 and self.hidden_size % self.num_heads:
            _fail(self, "hidden_size", self.hidden_size,
                  f"not divisible by num_heads ({self.num_heads}): "
                  f"{self.hidden_size} % {self.num_heads} = {self.hidden_size % self.num_heads}",
                  "choose hidden_size a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            _fail(self, "num_kv_heads", self.num_kv_heads,
                  f"does not divide num_heads ({self.num_heads})",
                  "choose num_kv_heads a divisor of num_heads")
        if self.kv_channels % 2:
            _fail(self, "kv_channels", self.kv_channels, "is odd; RoPE needs an even head dim",
                  "choose an even kv_channels (or 0 for hidden_size / num_heads)")
        if self.head_dim % 2:
            _fail(self, "hidden_size", self.hidden_size,
                  f"head dim {self.head_dim} is odd; RoPE needs an even head dim",
                  "choose hidden_size / num_heads even")

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Per layer, True if it is an MoE layer: moe.layer_freq, then the first
        ``first_k_dense`` layers forced dense."""
        freq = self.moe.layer_freq
        if isinstance(freq, int):
            pattern = [i % freq == 0 for i in range(self.num_layers)]
        else:
            pattern = [bool(v) for v in freq]
        return tuple(moe and i >= self.first_k_dense for i, moe in enumerate(pattern))

    @property
    def head_dim(self) -> int:
        """Per-head q/k/v width of gqa attention: kv_channels, or hidden_size / num_heads."""
        return self.kv_channels or self.hidden_size // self.num_heads


@dataclass(kw_only=True, slots=True)
class PluginsConfig:
    """Which plugin supplies each component, by registered name, plus per-plugin options."""

    router: str = "topk"
    dispatcher: str = "alltoall"
    experts: str = "grouped"
    precision: str = "fp32"
    # Options passed to the chosen plugin; validated by the plugin's own options dataclass.
    router_options: dict = field(default_factory=dict)
    dispatcher_options: dict = field(default_factory=dict)
    experts_options: dict = field(default_factory=dict)
    precision_options: dict = field(default_factory=dict)
    # Plugin names (component or entry-point names) never to load; joined with $MOEPLUG_BLOCK_PLUGINS.
    block: list = field(default_factory=list)

    def __post_init__(self) -> None:
        for n in ("router", "dispatcher", "experts", "precision"):
            v = getattr(self, n)
            if not isinstance(v, str) or not v:
                _fail(self, n, v, "must be a plugin name", "run `moeplug plugins` to list names")
        for n in ("router_options", "dispatcher_options", "experts_options", "precision_options"):
            if not isinstance(getattr(self, n), dict):
                _fail(self, n, getattr(self, n), "must be a mapping", f"write {n}: {{key: value}}")
        if isinstance(self.block, str):
            self.block = [s for s in self.block.split(",") if s]
        if not isinstance(self.block, list):
            _fail(self, "block", self.block, "must be a list of plugin names", "write block: [name, ...]")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The corpus and tokenizer. Token ids live in memory-mapped files under ``cache_dir``."""

    corpus: str = "shakespeare"
    tokenizer: str = "bpe"  # "bpe" (byte-level BPE trained locally) or "bytes"
    vocab_size: int = 2048  # BPE target vocabulary (ignored for "bytes")
    # Whole works held out for validation (file stems of shksprdata/texts/*_gut.txt).
    val_works: list = field(default_factory=lambda: ["hamlet_gut", "tempest_gut"])
    cache_dir: str = ""  # empty: $MOEPLUG_CACHE or ~/.cache/moeplug

    def __post_init__(self) -> None:
        if self.tokenizer not in ("bpe", "bytes"):
            _fail(self, "tokenizer", self.tokenizer, "unknown tokenizer", "use 'bpe' or 'bytes'")
        if self.tokenizer == "bpe" and not (256 < self.vocab_size <= 65536):
            _fail(self, "vocab_size", self.vocab_size, "BPE vocab must be in (256, 65536]",
                  "choose e.g. 2048")
        if self.corpus != "shakespeare" and not os.path.isdir(self.corpus):
            _fail(self, "corpus", self.corpus, "neither 'shakespeare' nor a directory of .txt files",
                  "use 'shakespeare' or a path to a folder of text files")

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.environ.get("MOEPLUG_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "moeplug")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimiser, schedule, batch shape, evaluation, checkpointing and logging."""

    steps: int = 600
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    # Precision-aware optimizer (Megatron --exp-avg-dtype / --exp-avg-sq-dtype): "bf16" stores
    # the AdamW moments in bf16 (half their bytes); the update math stays fp32.
    optimizer_dtype: str = "fp32"
    grad_clip: float = 1.0
    seed: int = 1234
    eval_interval: int = 100
    eval_batches: int = 8
    ckpt_interval: int = 0  # 0: only at the end
    log_interval: int = 10
    out_dir: str = "runs/default"
    resume: str = ""  # path to a checkpoint directory, or "auto" for the latest in out_dir
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    tensorboard: bool = False  # also write TensorBoard events to out_dir/tb (rank 0)
    time_breakdown: bool = True  # per-stage seconds in train records (CPU runs)
    # Also the peak bytes held for backward in the train records' per-rank memory (a
    # saved-tensor meter, ~17% of a default-model step; moeplug.training.memory).
    memory_stats: bool = False
    # "auto": cuda when torch sees a GPU, else cpu. Availability is checked by the CLI
    # (moeplug.training.distributed.resolve_device), not here: a config stays machine-free.
    device: str = "auto"

    @property
    def effective_warmup_steps(self) -> int:
        """Warmup steps the schedule uses: ``warmup_steps``, clamped to ``steps`` so a short
        trial run (``--steps 10``) warms up over the whole run instead of being refused."""
        return min(self.warmup_steps, self.steps)

    def __post_init__(self) -> None:
        _positive(self, "steps", "micro_batch_size", "grad_accum_steps", "seq_len", "eval_batches",
                  "log_interval")
        _non_negative(self, "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip",
                      "eval_interval", "ckpt_interval", "threads")
        if self.min_lr > self.lr:
            _fail(self, "min_lr", self.min_lr, f"exceeds lr ({self.lr})", "set min_lr <= lr")
        for n in ("beta1", "beta2"):
            v = getattr(self, n)
            if not 0.0 <= v < 1.0:
                _fail(self, n, v, "must be in [0, 1)", f"set {n} to e.g. 0.9")
        if self.optimizer_dtype not in ("fp32", "bf16"):
            _fail(self, "optimizer_dtype", self.optimizer_dtype, "must be fp32 or bf16",
                  "write optimizer_dtype: fp32 (default) or bf16 (bf16 AdamW moments)")
        for n in ("tensorboard", "time_breakdown", "memory_stats"):
            if not isinstance(getattr(self, n), bool):
                _fail(self, n, getattr(self, n), "must be a boolean", f"write {n}: true or false")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?",
                                                                self.device):
            _fail(self, "device", self.device, "must be auto, cpu, cuda or cuda:N",
                  "set device to auto (GPU when present), cpu, cuda or e.g. cuda:0")


@dataclass(kw_only=True, slots=True)
class ParallelSection:
    """The ``parallel:`` section: degrees and layout (moeplug.parallel.layout.ParallelConfig),
    pipeline split (moeplug.parallel.pipeline.PipelineConfig), distributed optimizer, timeout.

    The degree fields are checked by ParallelConfig / PipelineConfig themselves (one rule, one
    place); model-dependent checks run in RootConfig; checks that need the world size run in
    moeplug.training.distributed.resolve_layout (the CLI calls it before launching any rank).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 0  # 0: world size / (tp * cp * pp)
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    cp_comm: str = "allgather"
    vpp: int = 1
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None
    # ZeRO-1: AdamW state sharded over DP (dense params) / expert-DP (expert params).
    distributed_optimizer: bool = False
    # Process-group timeout: a rank waiting this long on a dead peer raises instead of hanging.
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self.layout()  # ParallelConfig's own checks
        self.pipeline()
        if not isinstance(self.distributed_optimizer, bool):
            _fail(self, "distributed_optimizer", self.distributed_optimizer, "must be a boolean",
                  "write distributed_optimizer: true or false")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            _fail(self, "timeout_s", self.timeout_s, "must be a number of seconds > 0",
                  "set timeout_s to e.g. 300")

    def layout(self) -> Any:
        """The degrees as a (not yet resolved) moeplug.parallel.ParallelConfig."""
        from moeplug.parallel.layout import ParallelConfig
        return ParallelConfig(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, ep=self.ep,
                              etp=self.etp, sequence_parallel=self.sequence_parallel,
                              order=self.order, cp_comm=self.cp_comm)

    def pipeline(self) -> Any:
        """The layer split as a moeplug.parallel.pipeline.PipelineConfig."""
        from moeplug.parallel.pipeline import PipelineConfig
        return PipelineConfig(vpp=self.vpp, num_layers_in_first_stage=self.num_layers_in_first_stage,
                              num_layers_in_last_stage=self.num_layers_in_last_stage)


@dataclass(kw_only=True, slots=True)
class RootConfig:
    """The whole run. Cross-component checks live here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            _fail(self.train, "seq_len", self.train.seq_len,
                  f"exceeds model.max_seq_len ({self.model.max_seq_len})",
                  f"set train.seq_len <= {self.model.max_seq_len} or raise model.max_seq_len")
        self._check_parallel_fits_model()

    def _check_parallel_fits_model(self) -> None:
        # Shards must split evenly (heads % TP, experts % EP, layers per pipeline stage, seq_len
        # per CP/SP shard). No world size needed, so this runs on every load.
        from moeplug.parallel.layout import validate_model
        m, par = self.model, self.parallel
        # pp = 1 here: the layer split (even or uneven stages) is PipelineConfig's to check.
        validate_model(dataclasses.replace(par.layout(), pp=1), num_experts=m.moe.num_experts,
                       num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                       num_layers=m.num_layers, ffn_hidden_size=m.moe.ffn_hidden_size,
                       seq_len=self.train.seq_len)
        par.pipeline().rank_layer_counts(m.num_layers, par.pp)
        # The MTP blocks and their loss are built unsharded (not tensor/vocab-parallel) and MTP
        # shifts tokens across CP shards, so the model build would refuse these layouts: say so
        # here, before any rank starts, instead of as a traceback from build_model.
        for degree in ("tp", "cp"):
            if m.mtp_num_layers and getattr(par, degree) > 1:
                _fail(m, "mtp_num_layers", m.mtp_num_layers,
                      f"multi-token prediction does not support parallel.{degree} = "
                      f"{getattr(par, degree)} yet ("
                      + ("the MTP blocks and loss are not tensor/vocab-parallel" if degree == "tp"
                         else "MTP shifts tokens across context-parallel shards") + ")",
                      f"set model.mtp_num_layers: 0 or parallel.{degree}: 1")
        if par.pp > 1 and par.vpp > 1 and self.train.grad_accum_steps % par.pp:
            _fail(self.train, "grad_accum_steps", self.train.grad_accum_steps,
                  f"the interleaved pipeline schedule (parallel.vpp = {par.vpp}) needs a "
                  f"multiple of parallel.pp = {par.pp} micro-batches",
                  f"set train.grad_accum_steps to a multiple of {par.pp}, or parallel.vpp: 1")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The fields that define a model's weights and the function they compute: a checkpoint resumed
# under another value either mismatches shapes (num_experts, hidden_size, vocabulary) or
# silently computes something else with the same tensors (top_k, activation, routing options).
MODEL_DEFINING = ("model", "plugins.router", "plugins.router_options", "data.tokenizer",
                  "data.vocab_size")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def model_differences(saved: RootConfig, requested: RootConfig) -> list[tuple[str, Any, Any]]:
    """(dotted field, saved value, requested value) for every MODEL_DEFINING field that
    differs; "(not set)" stands for an option present on one side only."""
    a, b = _flatten(saved.to_dict()), _flatten(requested.to_dict())
    if saved.data.tokenizer == requested.data.tokenizer == "bytes":
        a.pop("data.vocab_size"), b.pop("data.vocab_size")  # only BPE reads it
    unset = "(not set)"
    return [(k, a.get(k, unset), b.get(k, unset)) for k in {**b, **a}
            if any(k == f or k.startswith(f + ".") for f in MODEL_DEFINING)
            and a.get(k, unset) != b.get(k, unset)]


# --------------------------------------------------------------------------------------------
# Building from nested mappings (YAML, overrides, checkpoints)
# --------------------------------------------------------------------------------------------

class _Unbuilt(Exception):
    """A section could not be built at all; its problems are already recorded in ``_found``."""


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    """``cls`` from a nested mapping, recording every problem (unknown keys, failed checks) in
    the collector that :func:`config_from_dict` set. A section whose checks failed is still
    passed up, so the cross-section checks run too; one that could not be built stops its
    parents (``_Unbuilt``)."""
    found = _found.get()
    if not isinstance(data, Mapping):
        found.append(f"{path or cls.__name__} = {data!r}: must be a mapping. "
                     f"Fix: write it as `key: value` lines")
        raise _Unbuilt
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    complete = True
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(known)}"
            found.append(f"{cls.__name__}: unknown field '{path + key}'. Fix: {hint}")
            continue
        sub = _SUBCONFIGS.get((cls, key))
        if sub:
            try:
                value = _build(sub, value, f"{path}{key}.")
            except _Unbuilt:
                complete = False
                continue
        elif known[key].type == "float":
            value = _as_float(value)
        kwargs[key] = value
    if not complete:
        raise _Unbuilt
    try:
        return cls(**kwargs)
    except ConfigError as e:  # raised, not recorded (e.g. by moeplug.parallel.layout)
        found.extend(e.errors)
    except (TypeError, ArithmeticError):
        # A later check tripped over a value an earlier one already reported (a string where a
        # number belongs, a zero divisor): that report stands. With none, it is a real bug.
        if not found:
            raise
    raise _Unbuilt


def _as_float(value: Any) -> Any:
    # YAML 1.1 reads "1e-3" (no dot) as a string, and users write lr=1e-3; ints are fine too.
    # Anything that is not a number stays as it is, so the field's own check reports it.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


_SUBCONFIGS: dict[tuple[type, str], type] = {
    (RootConfig, "model"): ModelConfig,
    (RootConfig, "plugins"): PluginsConfig,
    (RootConfig, "data"): DataConfig,
    (RootConfig, "train"): TrainConfig,
    (RootConfig, "parallel"): ParallelSection,
    (ModelConfig, "moe"): MoEConfig,
    (ModelConfig, "mla"): MLAConfig,
    (ModelConfig, "recompute"): RecomputeConfig,
}


def config_from_dict(data: Mapping[str, Any]) -> RootConfig:
    """A validated RootConfig; one ConfigError listing every problem in ``data`` otherwise."""
    found: list[str] = []
    token = _found.set(found)
    try:
        cfg = _build(RootConfig, data, "")
    except _Unbuilt:
        pass
    finally:
        _found.reset(token)
    if found:
        raise ConfigError(*found)
    return cfg


def _parse_scalar(text: str) -> Any:
    # YAML scalars: 8 -> int, 1e-3 -> float, true -> bool, [a, b] -> list, anything else -> str.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE. Fix: write e.g. "
                              f"--set model.moe.num_experts=8")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section. Fix: check the key path")
        node[parts[-1]] = _parse_scalar(raw)
    return data


def merge_config_dicts(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict:
    """``top`` over ``base``: sections (mappings) merge key by key; any other value replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config_dicts(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | None = None, overrides: list[str] | None = None,
                base: Mapping[str, Any] | None = None) -> RootConfig:
    """Defaults ← ``base`` (a preset) ← YAML file ← dotted overrides, validated as one RootConfig."""
    data: dict = {}
    if path:
        if os.path.isdir(path):
            inside = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
            raise ConfigError(f"config file {path!r} is a directory, not a YAML file. Fix: pass "
                              f"a file" + (f" (there: {', '.join(inside)})" if inside else ""))
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist. Fix: pass an existing YAML "
                              f"file to --config, or leave --config out to use the packaged default")
        try:
            with open(path, encoding="utf-8") as f:
                loaded = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: "
                              f"{' '.join(str(e).split())}. Fix: correct the syntax there") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path!r} is not UTF-8 text ({e}). Fix: pass the YAML "
                              f"config file, not a binary one") from None
        if loaded is None and not base:
            # An empty file means the dataclass defaults (README "Config reference"), which
            # differ from the packaged default.yaml that no --config would have used.
            _log.warning(f"moeplug: note: config file {path!r} is empty: training the dataclass "
                         f"defaults (README 'Config reference'), not the packaged default.yaml")
        loaded = {} if loaded is None else loaded
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping. "
                              f"Fix: start with sections model:, plugins:, data:, train:")
        data = loaded
    if base:
        data = merge_config_dicts(base, data)
    apply_overrides(data, list(overrides or []))
    return config_from_dict(data)
