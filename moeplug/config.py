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

import codecs
import contextlib
import dataclasses
import difflib
import logging
import math
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping

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


class Problems:
    """Collects the ConfigErrors of independent checks, so one command reports them all."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as e:
            self.errors.extend(e.errors or [str(e)])

    def attempt(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None after recording its ConfigError."""
        with self.check():
            return fn(*args)
        return None

    def raise_all(self, error: type[ConfigError] = ConfigError) -> None:
        """``error`` listing every problem recorded (each once), if any."""
        if self.errors:
            raise error(*dict.fromkeys(self.errors))


# While config_from_dict builds a config, _fail records here instead of raising, so the
# remaining checks still run and report their own problems (None: raise at once).
_found: ContextVar[list[str] | None] = ContextVar("moeplug_config_errors", default=None)


def _fail(obj: Any, name: str, value: Any, rule: str, fix: str) -> None:
    head = f"{type(obj).__name__}.{name} = {value!r}: "
    found = _found.get()
    if found is None:
        raise ConfigError(f"{head}{rule}. Fix: {fix}")
    if not any(m.startswith(head) for m in found):  # one line per problem: the first rule wins
        found.append(f"{head}{rule}. Fix: {fix}")


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,),
          "dict": (dict,), "None": (type(None),)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "a boolean (true or false)",
               "list": "a list", "dict": "a mapping", "None": "null"}


def _check_fields(obj: Any) -> None:
    """The rules every field has from its annotation alone (so a new field is covered without
    listing it): the annotated type (bool is not a number), and a float must be finite (nan
    and inf pass every ``<``/``>`` rule silently and then poison the run). Runs first in each
    section's ``__post_init__``; the section's own value rules follow."""
    for f in fields(obj):
        v, names = getattr(obj, f.name), str(f.type).split(" | ")
        if not all(n in _TYPES for n in names):
            continue  # a sub-section: checked by its own class
        if not any(isinstance(v, _TYPES[n]) and not (isinstance(v, bool) and n != "bool")
                   for n in names):
            want = " or ".join(_TYPE_WORDS[n] for n in names)
            fix = f"write {f.name}: true or false" if names == ["bool"] else \
                f"set {f.name} to {want}"
            _fail(obj, f.name, v, f"must be {want}", fix)
        elif isinstance(v, float) and not math.isfinite(v):
            _fail(obj, f.name, v, "must be a finite number", f"set {f.name} to a real value")


def _above_zero(obj: Any, *names: str) -> None:
    # Physical scales (a RoPE base, a norm epsilon, a std): zero or negative means nothing.
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v > 0:
            _fail(obj, n, v, "must be > 0", f"set {n} to a positive number")


def _is_positive_int(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not _is_positive_int(v):
            _fail(obj, n, v, "must be a positive integer", f"set {n} to an integer >= 1")


SEED_LIMIT = 2 ** 63  # torch.manual_seed and numpy's generators take seeds in [0, 2**63)


def _check_seed(obj: Any, name: str, value: Any) -> None:
    if not 0 <= value < SEED_LIMIT:
        _fail(obj, name, value, "must be in [0, 2**63) (torch's and numpy's generators take "
              "no other)", f"set {name} to e.g. 1234")


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
    # Overlap (moeplug.modules.moe_overlap): split each micro-batch's tokens into this many
    # chunks whose dispatch/combine run in the background while another chunk's experts (and
    # the shared experts) compute. 1 = off. Dispatchers without split start/wait still work.
    overlap_chunks: int = 1
    # Megatron delay_wgrad_compute (moeplug.delayed_wgrad): the grouped experts' backward hands
    # its input gradient to the dispatch's backward exchange first and computes the weight
    # gradients while that exchange is in flight. Same gradients (bitwise at overlap_chunks 1).
    delay_wgrad_compute: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "num_experts", "top_k", "ffn_hidden_size", "overlap_chunks")
        _non_negative(self, "aux_loss_coeff", "shared_expert_ffn_hidden_size")
        # Only between two valid counts: a bad num_experts is its own error, and "set top_k
        # <= 0" would be no fix.
        if _is_positive_int(self.num_experts, self.top_k) and self.top_k > self.num_experts:
            _fail(self, "top_k", self.top_k, f"exceeds num_experts ({self.num_experts})",
                  f"set top_k <= {self.num_experts} or raise num_experts")
        if self.activation not in ACTIVATIONS:
            _fail(self, "activation", self.activation, "unsupported activation",
                  f"use one of {', '.join(map(repr, ACTIVATIONS))}")
        for n in ("apply_probs_on_input", "shared_expert_gate", "delay_wgrad_compute"):
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
    # eps of the q / kv latent RMSNorms. None: model.norm_eps, as Megatron's MLA; DeepSeek-V3's
    # reference code and Hugging Face fix it at 1e-6 whatever rms_norm_eps says.
    latent_norm_eps: float | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _non_negative(self, "q_lora_rank")
        v = self.latent_norm_eps
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                              not v > 0):
            _fail(self, "latent_norm_eps", v, "must be a number > 0, or null (model.norm_eps)",
                  "set latent_norm_eps to a positive number, or remove it")
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


# Fine-grained activation offloading (moeplug.modules.offload): Megatron's --offload-modules names.
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                   "expert_fc1", "moe_act")
# The recompute names whose checkpoint contains an offload name's tensors (never kept, so
# nothing would be offloaded): the pair is refused.
_OFFLOAD_INSIDE_RECOMPUTE = {"core_attn": ("core_attn",), "layernorm": ("attn_norm", "mlp_norm"),
                             "moe": ("expert_fc1", "moe_act")}


# The precisions the sync-free region runs (moeplug.modules.static_moe): autocast's dtypes and
# the built-in emulated recipes (moeplug.quant), whose expert GEMMs it runs over its budget rows.
SYNC_FREE_PRECISIONS = ("fp32", "bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise",
                        "mxfp8", "nvfp4")


def expert_op_levers(m: "ModelConfig") -> dict[str, list[str]]:
    """The memory levers that act inside the routed experts' op, as asked for in ``m``, by
    ``model.*`` field: ``{"recompute.modules": ["moe_act"], "offload": ["expert_fc1", ...]}``
    (only those set). The op keeps FC1's output instead of the activation (moe_act recompute)
    and notes which of its saved tensors the offload names mean; a path that runs the experts
    otherwise would ignore them (RootConfig, plugin_host.check_plugins and
    training.distributed.resolve_device refuse them there)."""
    out: dict[str, list[str]] = {}
    rc = m.recompute
    if isinstance(rc, RecomputeConfig) and rc.granularity == "selective" and \
            isinstance(rc.modules, list) and "moe_act" in rc.modules:
        out["recompute.modules"] = ["moe_act"]
    inside = [n for n in ("expert_fc1", "moe_act") if isinstance(m.offload, list)
              and n in m.offload]
    if inside:
        out["offload"] = inside
    return out


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
    # Module inputs moved to the stash's second tier in forward, prefetched before backward.
    offload: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_fields(self)
        self._check_offload()
        _positive(self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len",
                  "dense_ffn_hidden_size")
        _non_negative(self, "vocab_size", "first_k_dense", "kv_channels", "mtp_num_layers",
                      "mtp_loss_scaling_factor")
        _above_zero(self, "rope_theta", "norm_eps", "init_std")
        for n in ("rope_theta", "norm_eps", "init_std"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                _fail(self, n, v, "must be a number", f"set {n} to a positive number")
        self._check_attention()
        # (against a valid num_layers only: "set first_k_dense <= 0" would be no fix)
        if _is_positive_int(self.num_layers) and self.first_k_dense > self.num_layers:
            _fail(self, "first_k_dense", self.first_k_dense,
                  f"exceeds num_layers ({self.num_layers})", f"set first_k_dense <= {self.num_layers}")
        # overlap_chunks composes with recompute of the MoE layer (selective "moe" or full):
        # the recomputed forward re-issues its chunks' exchanges inside the backward, on the
        # same thread and in the same order on every rank, next to the backward's own
        # (tests/test_overlap.py; Megatron's EP overlap excludes full recompute).
        freq = self.moe.layer_freq
        if isinstance(freq, list) and len(freq) != self.num_layers:
            _fail(self.moe, "layer_freq", freq,
                  f"has {len(freq)} entries but num_layers = {self.num_layers}",
                  f"give exactly one 0/1 entry per layer ({self.num_layers})")

    def _check_offload(self) -> None:
        if not isinstance(self.offload, list):
            _fail(self, "offload", self.offload, "must be a list",
                  "write e.g. offload: [expert_fc1, moe_act]")
            return
        bad = [m for m in self.offload if m not in OFFLOAD_MODULES]
        if bad:
            _fail(self, "offload", self.offload, f"unknown module name(s) {bad}",
                  f"use names from {', '.join(OFFLOAD_MODULES)}")
        rc = self.recompute
        if not isinstance(rc, RecomputeConfig):
            return
        if self.offload and rc.granularity == "full":
            _fail(self, "offload", self.offload, "is kept by nothing under full recompute (each "
                  "block keeps only its input)", "drop offload or use recompute granularity "
                  "selective")
        for r in rc.modules if rc.granularity == "selective" else ():
            clash = [o for o in _OFFLOAD_INSIDE_RECOMPUTE.get(r, ()) if o in self.offload]
            if clash:
                _fail(self, "offload", self.offload, f"names {clash}, which recompute module "
                      f"{r!r} already discards (it keeps only its inputs)",
                      f"drop {clash} from offload or {r!r} from recompute.modules")

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
        if self.head_dim % 2 and not self.kv_channels:  # an odd kv_channels: said above
            _fail(self, "hidden_size", self.hidden_size,
                  f"head dim {self.head_dim} is odd; RoPE needs an even head dim",
                  "choose hidden_size / num_heads even")

    @property
    def mla_latent_norm_eps(self) -> float:
        """The eps of MLA's q/kv latent RMSNorms: mla.latent_norm_eps, else norm_eps."""
        return self.norm_eps if self.mla.latent_norm_eps is None else self.mla.latent_norm_eps

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
        if isinstance(self.block, str):  # "a,b" from an override or the environment
            self.block = [s for s in self.block.split(",") if s]
        _check_fields(self)
        for n in ("router", "dispatcher", "experts", "precision"):
            v = getattr(self, n)
            if not isinstance(v, str) or not v:
                _fail(self, n, v, "must be a plugin name", "run `moeplug plugins` to list names")
        for n in ("router_options", "dispatcher_options", "experts_options", "precision_options"):
            if not isinstance(getattr(self, n), dict):
                _fail(self, n, getattr(self, n), "must be a mapping", f"write {n}: {{key: value}}")
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
        _check_fields(self)
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
    # Master weights (Megatron --main-params-dtype): "bf16" stores the parameters (and so their
    # grads) in bf16 and rounds each AdamW update into them stochastically; needs
    # plugins.precision: bf16 (autocast computes in bf16 anyway).
    master_dtype: str = "fp32"
    # Module parameters (Megatron --bf16's Float16Module with fp32 main params): "bf16" makes the
    # model's parameters (and so their grads) bf16 and keeps an fp32 main copy of each in the
    # optimizer, which updates it and copies it back into the parameter, rounded to nearest.
    # The bf16 GEMMs then read the weights as they are: no per-step weight casts. Needs
    # plugins.precision: bf16. With master_dtype: bf16 the parameters are bf16 whatever this
    # says, and there is no fp32 copy.
    param_dtype: str = "fp32"
    grad_clip: float = 1.0
    seed: int = 1234
    eval_interval: int = 100
    eval_batches: int = 8
    ckpt_interval: int = 0  # 0: only at the end
    keep_last: int = 0  # keep the newest N step_* checkpoints of out_dir, delete older; 0: all
    log_interval: int = 10
    out_dir: str = "runs/default"
    resume: str = ""  # path to a checkpoint directory, or "auto" for the latest in out_dir
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    # Keep freed host memory in the process for reuse (moeplug.runtime.retain_freed_memory):
    # by default glibc maps every large tensor fresh and the kernel zero-fills its pages on
    # first touch. The MoE layer's large buffers come from moeplug.ops.workspace's cache, so
    # it buys little there (benchmarks/test_bench_moe_layer.py: fp32 0.97 of the square
    # matmul with it, 0.93 without; bf16 no better). Off by default: glibc's heap then
    # fragments - a loop of 64 MiB tensors settled at 732 MB resident - so the footprint can
    # grow well past the peak.
    retain_freed_memory: bool = False
    tensorboard: bool = False  # also write TensorBoard events to out_dir/tb (rank 0)
    time_breakdown: bool = True  # per-stage seconds in train records (CPU runs)
    # Also the peak bytes held for backward in the train records' per-rank memory (a
    # saved-tensor meter, ~17% of a default-model step; moeplug.training.memory).
    memory_stats: bool = False
    # "auto": cuda when torch sees a GPU, else cpu. Availability is checked by the CLI
    # (moeplug.training.distributed.resolve_device), not here: a config stays machine-free.
    device: str = "auto"
    # A step whose loss or grad norm is NaN/Inf is never applied: "stop" ends the run with the
    # step and layer named; "skip" drops the update and goes on, at most max_skipped_steps in a
    # row (moeplug.training.faults).
    nonfinite: str = "stop"
    max_skipped_steps: int = 10

    @property
    def effective_warmup_steps(self) -> int:
        """Warmup steps the schedule uses: ``warmup_steps``, clamped to ``steps`` so a short
        trial run (``--steps 10``) warms up over the whole run instead of being refused."""
        return min(self.warmup_steps, self.steps)

    @property
    def bf16_params(self) -> bool:
        """The model's parameters are bf16 (param_dtype or master_dtype bf16)."""
        return "bf16" in (self.param_dtype, self.master_dtype)

    @property
    def main_params(self) -> bool:
        """The optimizer keeps an fp32 main copy of the bf16 parameters (param_dtype bf16 with
        master_dtype fp32)."""
        return self.param_dtype == "bf16" and self.master_dtype == "fp32"

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "steps", "micro_batch_size", "grad_accum_steps", "seq_len", "eval_batches",
                  "log_interval")
        _non_negative(self, "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip",
                      "eval_interval", "ckpt_interval", "keep_last", "threads")
        if self.min_lr > self.lr:
            _fail(self, "min_lr", self.min_lr, f"exceeds lr ({self.lr})", "set min_lr <= lr")
        _check_seed(self, "seed", self.seed)
        for n in ("beta1", "beta2"):
            v = getattr(self, n)
            if not 0.0 <= v < 1.0:
                _fail(self, n, v, "must be in [0, 1)", f"set {n} to e.g. 0.9")
        if self.optimizer_dtype not in ("fp32", "bf16"):
            _fail(self, "optimizer_dtype", self.optimizer_dtype, "must be fp32 or bf16",
                  "write optimizer_dtype: fp32 (default) or bf16 (bf16 AdamW moments)")
        if self.master_dtype not in ("fp32", "bf16"):
            _fail(self, "master_dtype", self.master_dtype, "must be fp32 or bf16",
                  "write master_dtype: fp32 (default) or bf16 (bf16 master weights)")
        if self.param_dtype not in ("fp32", "bf16"):
            _fail(self, "param_dtype", self.param_dtype, "must be fp32 or bf16",
                  "write param_dtype: fp32 (default) or bf16 (bf16 module weights, fp32 main "
                  "copy in the optimizer)")
        for n in ("tensorboard", "time_breakdown", "memory_stats"):
            if not isinstance(getattr(self, n), bool):
                _fail(self, n, getattr(self, n), "must be a boolean", f"write {n}: true or false")
        if self.nonfinite not in ("stop", "skip"):
            _fail(self, "nonfinite", self.nonfinite, "must be stop or skip",
                  "set nonfinite to stop (end the run) or skip (drop the update, go on)")
        _non_negative(self, "max_skipped_steps")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?",
                                                                self.device):
            _fail(self, "device", self.device, "must be auto, cpu, cuda or cuda:N",
                  "set device to auto (GPU when present), cpu, cuda or e.g. cuda:0")


# Parallel dimension names of ParallelConfig.order (first name fastest in the rank numbering).
DIM_NAMES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """The ``parallel:`` section, every parallel field declared once: degrees, rank order,
    pipeline split, distributed optimizer, timeout. ``dp = 0``: derived in :meth:`resolve`.

    tp: tensor parallel (attention / dense MLP)    etp: tensor parallel inside each expert
    cp: context parallel (sequence split)           ep:  expert parallel (experts split)
    dp: data parallel of the dense grid             edp: data parallel of the expert grid (derived)
    pp: pipeline parallel (shared by both grids)    vpp: model chunks per pipeline rank
    sequence_parallel: shard activations outside TP regions along the sequence (tp > 1).

    Only arithmetic lives here (this module imports nothing of moeplug); the rank tables and
    process groups are moeplug.parallel's. Model-dependent checks run in RootConfig; checks
    that need the world size in :meth:`resolve` (the CLI calls it before launching any rank).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 0  # 0: world size / (tp * cp * pp)
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    # How CP ranks exchange K/V (moeplug.parallel.context_parallel): "allgather" (one collective
    # per layer; the default because gloo pays per message) or "ring" (send/recv per step).
    cp_comm: str = "allgather"
    # Pipeline split: vpp model chunks per rank (interleaved 1F1B when > 1); layers on pipeline
    # rank 0 / P-1 (None: an even share), useful as those also carry the embedding / the head.
    vpp: int = 1
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None
    # ZeRO-1: AdamW state sharded over DP (dense params) / expert-DP (expert params).
    distributed_optimizer: bool = False
    # Combined 1F1B EP overlap (Megatron overlap_moe_expert_parallel_comm; see
    # moeplug.parallel.ep_overlap): the backward of micro-batch m-1 runs on a second thread, over
    # a twin of every process group, while micro-batch m runs forward, so each one's exchanges
    # hide behind the other's compute. Needs grad_accum_steps >= 2; composes with tp (with or
    # without sequence_parallel), cp, ep, dp, and with pp > 1 every "backward, then forward"
    # step of the 1F1B op list runs side by side.
    overlap_moe_expert_parallel_comm: bool = False
    # Process-group timeout: a rank waiting this long on a dead or hung peer stops instead of
    # hanging (moeplug.training.faults). 90 s keeps a CPU run's abort under 2 minutes; raise it
    # when one rank may legitimately work alone longer (e.g. a slow checkpoint save).
    timeout_s: float = 90.0

    def __post_init__(self) -> None:
        _check_fields(self)
        for n in ("tp", "cp", "pp", "ep", "etp", "vpp"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(self, n, v, "must be a positive integer", f"set {n} to an integer >= 1")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 0:
            _fail(self, "dp", self.dp, "must be an integer >= 0",
                  "set dp to 0 (derive from the world size) or to the data-parallel degree")
        for n in ("num_layers_in_first_stage", "num_layers_in_last_stage"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                _fail(self, n, v, "must be null or an integer >= 0",
                      f"leave {n} unset for an even split, or give a layer count")
        for n in ("sequence_parallel", "distributed_optimizer", "overlap_moe_expert_parallel_comm"):
            if not isinstance(getattr(self, n), bool):
                _fail(self, n, getattr(self, n), "must be a boolean", f"write {n}: true or false")
        if self.cp_comm not in ("allgather", "ring"):
            _fail(self, "cp_comm", self.cp_comm, "is not a context-parallel K/V exchange",
                  "use 'allgather' or 'ring'")
        names = self.order.split("-") if isinstance(self.order, str) else None
        if names is None or sorted(names) != sorted(DIM_NAMES):
            _fail(self, "order", self.order, f"must name each of {'-'.join(DIM_NAMES)} exactly "
                  "once, joined by '-'", "use e.g. 'tp-cp-ep-dp-pp' (Megatron's default)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            _fail(self, "timeout_s", self.timeout_s, "must be a number of seconds > 0",
                  "set timeout_s to e.g. 300")

    def layout(self) -> "ParallelConfig":
        """This section (the degrees); kept so ``cfg.parallel.layout()`` reads as before."""
        return self

    def pipeline(self) -> "ParallelConfig":
        """This section (the layer split); kept so ``cfg.parallel.pipeline()`` reads as before."""
        return self

    @property
    def world_size(self) -> int:
        """TP·CP·DP·PP; only meaningful after :meth:`resolve`."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Data parallel of the expert grid: world / (ETP·EP·PP); 0 while dp is unresolved."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def min_world_size(self) -> int:
        """The fewest processes these degrees fit: TP·CP·DP·PP when dp is set, else the least
        common multiple of TP·CP·PP and ETP·EP·PP (both must divide the world in resolve)."""
        dense = self.tp * self.cp * self.pp * max(self.dp, 1)
        return dense if self.dp else math.lcm(dense, self.etp * self.ep * self.pp)

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``dp`` (hence ``edp``) filled for ``world_size``; raise ConfigError
        if the degrees do not tile the world or the two grids disagree on the pipeline groups."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size {world_size!r} must be a positive integer. "
                              "Fix: launch at least one process")
        tp, cp, pp, ep, etp = self.tp, self.cp, self.pp, self.ep, self.etp
        if self.dp == 0:
            if world_size % (tp * cp * pp):
                _fail(self, "dp", 0, f"cannot derive dp: TP·CP·PP = {tp}·{cp}·{pp} = "
                      f"{tp * cp * pp} does not divide world size {world_size}",
                      f"choose tp, cp, pp whose product divides {world_size}, or change the "
                      "number of processes")
            dp = world_size // (tp * cp * pp)
        else:
            dp = self.dp
            if tp * cp * dp * pp != world_size:
                _fail(self, "dp", dp, f"TP·CP·DP·PP = {tp}·{cp}·{dp}·{pp} = "
                      f"{tp * cp * dp * pp} ≠ world size {world_size}",
                      "set dp = 0 to derive it, or change the degrees or the number of processes")
        if world_size % (etp * ep * pp):
            _fail(self, "ep", ep, f"ETP·EP·PP = {etp}·{ep}·{pp} = {etp * ep * pp} does not "
                  f"divide world size {world_size}",
                  f"choose etp, ep, pp whose product divides {world_size}")
        if tp > 1 and ep > 1 and not self.sequence_parallel:
            # Megatron's rule: with TP and EP together the token dispatcher expects activations
            # already split along the sequence across TP ranks, or each TP rank routes duplicates.
            _fail(self, "sequence_parallel", False, f"tp = {tp} and ep = {ep} are both > 1, "
                  "which needs sequence parallelism",
                  "set sequence_parallel: true (or tp = 1 / ep = 1)")
        out = dataclasses.replace(self, dp=dp)
        # Both grids number ranks with one order; with pp > 1 their pipeline groups agree iff
        # the sizes of the names before 'pp' multiply to the same stride (dense: ep = 1;
        # expert: cp = 1, tp = ETP, dp = EDP). tests/test_config.py checks this rule against
        # the rank tables of moeplug.parallel.layout.
        before = self.order.split("-")[:self.order.split("-").index("pp")]
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp}
        expert = {"tp": etp, "cp": 1, "ep": ep, "dp": out.edp}
        if pp > 1 and math.prod(dense[n] for n in before) != math.prod(expert[n] for n in before):
            _fail(self, "order", out.order, f"the dense grid (DP = {dp}) and the expert grid "
                  f"(EDP = {out.edp}) give different pipeline groups, so a pipeline stage would "
                  "hold attention and experts of different layers",
                  "put 'pp' last in order (e.g. 'tp-cp-ep-dp-pp') or make EDP equal DP")
        return out

    def rank_layer_counts(self, num_layers: int, pp: int | None = None) -> list[int]:
        """Layers held by each of the ``pp`` (default self.pp) pipeline ranks; raises
        ConfigError when they cannot tile num_layers."""
        pp = self.pp if pp is None else pp
        first, last = self.num_layers_in_first_stage, self.num_layers_in_last_stage
        if pp == 1:
            if self.vpp != 1:
                _fail(self, "vpp", self.vpp, "virtual stages need pipeline parallelism (pp = 1)",
                      "set vpp = 1, or pp > 1")
            if first is not None or last is not None:
                name = "num_layers_in_first_stage" if first is not None else \
                    "num_layers_in_last_stage"
                _fail(self, name, getattr(self, name), "uneven stages need pp > 1", f"unset {name}")
            return [num_layers]
        if first is None and last is None:
            if num_layers % (pp * self.vpp):
                _fail(self, "vpp", self.vpp, f"num_layers {num_layers} is not divisible by "
                      f"PP·VPP = {pp}·{self.vpp} = {pp * self.vpp}", "choose pp and vpp whose "
                      "product divides num_layers, or set num_layers_in_first_stage / _last_stage")
            return [num_layers // pp] * pp
        fixed = {r: n for r, n in {0: first, pp - 1: last}.items() if n is not None}
        rest, middle = num_layers - sum(fixed.values()), pp - len(fixed)
        name = "num_layers_in_first_stage" if first is not None else "num_layers_in_last_stage"
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            _fail(self, name, fixed.get(0, fixed.get(pp - 1)),
                  f"with first = {first}, last = {last} the other {middle} stage(s) get "
                  f"{rest} of num_layers {num_layers} layers, which does not split evenly",
                  f"choose first/last so that num_layers - first - last is a multiple of the "
                  f"{middle} middle stage(s)" if middle else
                  f"make num_layers_in_first_stage + num_layers_in_last_stage = {num_layers}")
        counts = [fixed.get(r, rest // middle if middle else 0) for r in range(pp)]
        for r, n in enumerate(counts):
            if n % self.vpp:
                _fail(self, "vpp", self.vpp, f"pipeline rank {r} holds {n} layers (per-rank "
                      f"counts {counts}), not divisible into {self.vpp} chunks",
                      "choose stage layer counts that are multiples of vpp")
        return counts

    def chunk_layers(self, num_layers: int, pp: int | None = None) -> list[list[range]]:
        """``[rank][chunk]`` -> the global layer indices of that model chunk."""
        pp = self.pp if pp is None else pp
        counts = self.rank_layer_counts(num_layers, pp)
        sizes = [n // self.vpp for n in counts]  # layers per chunk on each rank
        out: list[list[range]] = [[] for _ in range(pp)]
        start = 0
        for c in range(self.vpp):  # virtual stage v = c * pp + r, in increasing v
            for r in range(pp):
                out[r].append(range(start, start + sizes[r]))
                start += sizes[r]
        return out


# Earlier names of the same section (the layer split and the YAML section had their own classes).
ParallelSection = PipelineConfig = ParallelConfig


def validate_model(pcfg: ParallelConfig, *, num_experts: int, num_heads: int, num_kv_heads: int,
                   num_layers: int | None, vpp: int = 1, ffn_hidden_size: int | None = None,
                   seq_len: int | None = None) -> None:
    """Model-dependent checks of a layout: shards must split evenly. Raises ConfigError.
    ``num_layers=None`` leaves the layer split to :meth:`ParallelConfig.rank_layer_counts`."""

    def need(value: int, what: str, degree: int, label: str, field_name: str, fix: str) -> None:
        # ``degree`` may be a product (2·CP·TP): the field's own value is named after it
        if value % degree:
            raise ConfigError(f"{what} {value} not divisible by {label} {degree} "
                              f"(ParallelConfig.{field_name} = {getattr(pcfg, field_name)}). "
                              f"Fix: {fix}")

    need(num_heads, "num_heads", pcfg.tp, "TP", "tp",
         "choose tp dividing num_heads, or change num_heads")
    need(num_kv_heads, "num_kv_heads", pcfg.tp, "TP", "tp",
         "choose tp dividing num_kv_heads (each TP rank needs whole KV heads)")
    need(num_experts, "num_experts", pcfg.ep, "EP", "ep",
         "choose ep dividing num_experts, or change num_experts")
    if not isinstance(vpp, int) or vpp < 1:
        raise ConfigError(f"vpp {vpp!r} must be a positive integer. Fix: use 1 for no "
                          "interleaving")
    if num_layers is not None:
        need(num_layers, "num_layers", pcfg.pp * vpp, f"PP·VPP = {pcfg.pp}·{vpp} =", "pp",
             "choose pp (and vpp) so every virtual stage gets the same number of layers")
    if ffn_hidden_size is not None:
        need(ffn_hidden_size, "ffn_hidden_size", pcfg.etp, "ETP", "etp",
             "choose etp dividing the expert ffn_hidden_size")
    if seq_len is not None:
        # Context parallel splits each sequence into 2·CP chunks (load-balanced causal attention);
        # sequence parallel then splits each CP shard across TP ranks.
        tp_sp = pcfg.tp if pcfg.sequence_parallel else 1
        cp_chunks = 2 * pcfg.cp if pcfg.cp > 1 else 1
        need(seq_len, "seq_len", cp_chunks * tp_sp,
             f"{'2·CP' if pcfg.cp > 1 else 'CP'}{'·TP' if tp_sp > 1 else ''} =", "cp",
             "choose seq_len a multiple of that product")


@dataclass(kw_only=True, slots=True)
class RuntimeSection:
    """The ``runtime:`` section: the paged stash of the routed experts' saved activations
    (moeplug.stash). Off by default: on the CPU the copy into the pool costs step time and
    saves no memory the pool does not itself hold (see README "Paged stash")."""

    stash: bool = False
    stash_page_bytes: int = 65536  # a multiple of 64: every dtype stays aligned
    stash_pages: int = 0  # 0: the sum of the registered layers' reservations
    stash_overflow: str = "rerun"  # rerun (once, without stash) | fail | keep
    # Sync-free MoE (moeplug.modules.static_moe): static shapes from a per-rank token budget,
    # no host synchronisation; a step over budget reruns once on the dynamic path.
    sync_free: bool = False
    token_budget: float = 2.0  # rows per (rank, expert) = ceil(T*K/E * token_budget)
    capture: bool = False  # capture the static region once, replay it every step (sync_free)
    # The second tier (model.offload's target): an unlinked sparse file in offload_dir ("" =
    # the system temp directory; a tmpfs there saves no RAM), offload_max_bytes of address range.
    offload_dir: str = ""
    offload_max_bytes: int = 64 << 30
    offload_min_bytes: int = 65536  # smaller saved tensors are not worth a copy: they stay

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("sync_free", "capture"):
            if not isinstance(getattr(self, name), bool):
                _fail(self, name, getattr(self, name), "must be a boolean",
                      f"write {name}: true or false")
        if (isinstance(self.token_budget, bool) or not isinstance(self.token_budget, (int, float))
                or not math.isfinite(self.token_budget) or self.token_budget <= 0):
            _fail(self, "token_budget", self.token_budget, "must be a finite number > 0",
                  "use e.g. token_budget: 2.0 (rows per expert = 2x the balanced load)")
        if self.capture and self.stash:
            _fail(self, "capture", self.capture, "cannot combine with runtime.stash (the "
                  "captured region keeps its saved tensors in its own compiled graph)",
                  "set runtime.stash: false, or capture: false")
        if self.capture and not self.sync_free:
            _fail(self, "capture", self.capture, "needs runtime.sync_free: true (only a region "
                  "with static shapes and no host sync can be captured and replayed)",
                  "set runtime.sync_free: true, or capture: false")
        if not isinstance(self.stash, bool):
            _fail(self, "stash", self.stash, "must be a boolean", "write stash: true or false")
        _positive(self, "stash_page_bytes")
        if self.stash_page_bytes % 64:
            _fail(self, "stash_page_bytes", self.stash_page_bytes, "must be a multiple of 64",
                  f"set stash_page_bytes to {-(-self.stash_page_bytes // 64) * 64}")
        _non_negative(self, "stash_pages")
        if isinstance(self.stash_pages, float):
            _fail(self, "stash_pages", self.stash_pages, "must be an integer",
                  "set stash_pages to a whole number of pages (0: sized from the model)")
        _positive(self, "offload_max_bytes")
        _non_negative(self, "offload_min_bytes")
        if self.offload_dir and not os.path.isdir(self.offload_dir):
            _fail(self, "offload_dir", self.offload_dir, "is not an existing directory",
                  "create it, or write offload_dir: \"\" (the system temp directory)")
        if self.stash_overflow not in ("rerun", "fail", "keep"):
            _fail(self, "stash_overflow", self.stash_overflow, "must be rerun, fail or keep",
                  "set stash_overflow: rerun (Megatron's behaviour), fail or keep")


@dataclass(kw_only=True, slots=True)
class RootConfig:
    """The whole run. Cross-component checks live here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.train.seq_len > self.model.max_seq_len:
            _fail(self.train, "seq_len", self.train.seq_len,
                  f"exceeds model.max_seq_len ({self.model.max_seq_len})",
                  f"set train.seq_len <= {self.model.max_seq_len} or raise model.max_seq_len")
        for name in ("master_dtype", "param_dtype"):  # both make the parameters bf16
            if getattr(self.train, name) == "bf16" and self.plugins.precision != "bf16":
                _fail(self.train, name, "bf16", f"needs plugins.precision bf16 (got "
                      f"{self.plugins.precision!r}): bf16 weights are computed with under bf16 "
                      f"autocast", f"set plugins.precision: bf16 or train.{name}: fp32")
        self._check_parallel_fits_model()
        self._check_sync_free()
        self._check_delay_wgrad()
        self._check_expert_op_levers()

    def _check_delay_wgrad(self) -> None:
        # The split backward lives in the grouped experts' fp32/bf16 CPU ops (moeplug.ops
        # expert_mlp, grouped_mlp); every other path computes its weight gradients inside
        # torch's autograd, where they cannot be moved behind the exchange.
        moe, name = self.model.moe, "delay_wgrad_compute"
        if moe.delay_wgrad_compute is not True:
            return
        if self.plugins.experts != "grouped":
            _fail(moe, name, True, f"needs the grouped experts backend (its op splits the "
                  f"backward), not plugins.experts = {self.plugins.experts!r}",
                  f"set plugins.experts: grouped or {name}: false")
        if self.plugins.precision not in ("fp32", "bf16"):
            _fail(moe, name, True, f"splits the fp32/bf16 expert GEMMs; plugins.precision = "
                  f"{self.plugins.precision!r} runs the experts through its own quantized op",
                  f"set plugins.precision: fp32 or bf16, or {name}: false")
        if self.runtime.sync_free:
            _fail(moe, name, True, "is not built into the static sync-free region "
                  "(runtime.sync_free runs its own expert backward)",
                  f"set runtime.sync_free: false or {name}: false")
        if self.runtime.stash:
            # The stash hands the experts' saved tensors back as views of its pages and frees
            # the pages when autograd drops them - right after the dgrad, before the deferred
            # weight GEMMs read them.
            _fail(moe, name, True, "cannot be combined with runtime.stash (its pages return to "
                  "the pool when the experts' backward node ends; the delayed weight GEMMs "
                  "read them later)", f"set runtime.stash: false or {name}: false")
        if self.train.device.startswith("cuda"):
            _fail(moe, name, True, f"is implemented for the CPU expert ops only (on CUDA the "
                  f"experts use torch's grouped_mm autograd), but train.device = "
                  f"{self.train.device!r}", f"set train.device: cpu or {name}: false")

    def _check_expert_op_levers(self) -> None:
        # The eager CPU static region (moeplug.modules.static_arena) keeps FC1's output, never
        # the activation (moe_act recompute is its only mode), and notes its saved tensors for
        # the expert offload names. The captured region is compiled: inductor decides what it
        # keeps and no saved-tensor hook sees inside, so either switch would do nothing there.
        # (A GPU's region: moeplug.training.distributed.check_cuda_expert_levers.)
        if not (self.runtime.sync_free and self.runtime.capture):
            return
        m = self.model
        for key, names in expert_op_levers(m).items():
            obj, field_name = (m.recompute, "modules") if key == "recompute.modules" \
                else (m, "offload")
            what = " and ".join(names) + (" acts" if len(names) == 1 else " act")
            _fail(obj, field_name, getattr(obj, field_name), f"{what} inside the expert ops; "
                  f"runtime.capture compiles the sync-free region, which would ignore "
                  f"{'it' if len(names) == 1 else 'them'}", f"drop {' and '.join(names)} "
                  f"from model.{key}, or set runtime.capture: false")

    def _check_sync_free(self) -> None:
        # The static region (moeplug.modules.static_moe) runs the experts' GEMMs itself, in the
        # autocast dtype or through a built-in emulated recipe: no other precision plugin's
        # GEMMs. It has its own static EP exchange (and ETP gather).
        if not self.runtime.sync_free:
            return
        if self.plugins.precision not in SYNC_FREE_PRECISIONS:
            _fail(self.runtime, "sync_free", True, f"runs the expert GEMMs in fp32, bf16 or an "
                  f"emulated recipe ({', '.join(SYNC_FREE_PRECISIONS[2:])}), not "
                  f"plugins.precision = {self.plugins.precision!r}",
                  "set plugins.precision to one of those, or runtime.sync_free: false")
        if self.runtime.capture and self.plugins.precision not in ("fp32", "bf16"):
            _fail(self.runtime, "capture", True, f"compiles the sync-free region in fp32 or bf16 "
                  f"only; plugins.precision = {self.plugins.precision!r} runs it eagerly",
                  "set runtime.capture: false, or plugins.precision: fp32 or bf16")
        chunks = self.model.moe.overlap_chunks
        if isinstance(chunks, int) and chunks > 1:
            # The chunked static region (moeplug.modules.static_overlap) is the eager CPU one;
            # silently ignoring one of the two switches elsewhere would hide it.
            where = ("runtime.capture compiles the region whole" if self.runtime.capture else
                     f"plugins.precision = {self.plugins.precision!r} runs the region through "
                     f"its recipe" if self.plugins.precision not in ("fp32", "bf16") else
                     f"train.device = {self.train.device!r} runs the GPU's region"
                     if self.train.device.startswith("cuda") else None)
            if where is not None:
                _fail(self.model.moe, "overlap_chunks", chunks, f"pipelines the sync-free "
                      f"region eagerly on the CPU in fp32 or bf16 only; {where}, unchunked",
                      "set model.moe.overlap_chunks: 1, or runtime.sync_free: false")

    def _check_parallel_fits_model(self) -> None:
        # Shards must split evenly (heads % TP, experts % EP, layers per pipeline stage, seq_len
        # per CP/SP shard). No world size needed, so this runs on every load.
        m, par = self.model, self.parallel
        validate_model(par, num_experts=m.moe.num_experts, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, num_layers=None,
                       ffn_hidden_size=m.moe.ffn_hidden_size, seq_len=self.train.seq_len)
        par.rank_layer_counts(m.num_layers)
        # Tensor parallelism splits the dense MLPs' hidden and the vocabulary (embedding, head)
        # over TP: refused here, else as a traceback from every rank's model build. A vocabulary
        # the tokenizer decides (model.vocab_size 0) is checked once it is known, before the
        # ranks start (moeplug.cli).
        if par.tp > 1 and not all(m.moe_layer_pattern) and m.dense_ffn_hidden_size % par.tp:
            _fail(m, "dense_ffn_hidden_size", m.dense_ffn_hidden_size, f"is not divisible by "
                  f"parallel.tp = {par.tp} (the dense layers' MLPs are split over TP)",
                  f"choose a multiple of {par.tp}")
        if par.tp > 1 and m.vocab_size % par.tp:
            _fail(m, "vocab_size", m.vocab_size, f"is not divisible by parallel.tp = {par.tp} "
                  f"(the embedding and head are split over TP)",
                  f"pad it to a multiple of {par.tp}, e.g. {-(-m.vocab_size // par.tp) * par.tp}")
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
        if m.attention == "mla" and par.cp > 1:  # else a traceback from every rank's build
            _fail(m, "attention", "mla", f"multi-head latent attention does not support "
                  f"parallel.cp = {par.cp} yet", "set model.attention: gqa or parallel.cp: 1")
        if par.overlap_moe_expert_parallel_comm is True:
            self._check_combined_1f1b()
        if par.pp > 1 and par.vpp > 1 and self.train.grad_accum_steps % par.pp:
            _fail(self.train, "grad_accum_steps", self.train.grad_accum_steps,
                  f"the interleaved pipeline schedule (parallel.vpp = {par.vpp}) needs a "
                  f"multiple of parallel.pp = {par.pp} micro-batches",
                  f"set train.grad_accum_steps to a multiple of {par.pp}, or parallel.vpp: 1")

    def _check_combined_1f1b(self) -> None:
        # Every layout composes: TP/SP, CP (both cp_comm modes), EP/ETP and DP collectives
        # (MLA's and MTP's included) all pass their group through
        # moeplug.parallel.comm.active_group, which puts the overlapped backward's on the twin
        # groups; PP's tagged p2p messages match by tag whichever thread sends them
        # (moeplug.parallel.schedules).
        par, name = self.parallel, "overlap_moe_expert_parallel_comm"
        if self.train.grad_accum_steps < 2:
            _fail(par, name, True, f"needs two micro-batches in flight, but "
                  f"train.grad_accum_steps = {self.train.grad_accum_steps}",
                  f"set train.grad_accum_steps >= 2 or {name}: false")
        rc = self.model.recompute
        jitter = self.plugins.router_options.get("input_jitter_eps", 0.0)
        recomputes = rc.granularity == "full" or bool(rc.modules)
        if isinstance(jitter, (int, float)) and jitter > 0 and recomputes:
            # A recompute replays the forward's RNG state on the helper thread (set, run,
            # restore) while this thread's forward draws the jitter from the same global
            # generator: the forward's draws would depend on the threads' timing.
            _fail(par, name, True, f"cannot be combined with recompute while the router "
                  f"draws input jitter (plugins.router_options.input_jitter_eps = {jitter}: "
                  f"the overlapped backward's recompute replays torch's global RNG while the "
                  f"forward draws from it)",
                  f"set plugins.router_options.input_jitter_eps: 0, recompute nothing "
                  f"(model.recompute.granularity: selective, modules: []) or {name}: false")
        if self.runtime.stash:
            _fail(par, name, True, "cannot be combined with runtime.stash (the stash pool "
                  "serves one forward or backward at a time)",
                  f"set runtime.stash: false or {name}: false")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The fields that define a model's weights and the function they compute: a checkpoint resumed
# under another value either mismatches shapes (num_experts, hidden_size, vocabulary) or
# silently computes something else with the same tensors (top_k, activation, routing options).
MODEL_DEFINING = ("model", "plugins.router", "plugins.router_options", "data.tokenizer",
                  "data.vocab_size")
# Fields under "model" (and the sections below them) that change how the model runs, not what
# it computes: a resume may change them. Overlap on or off, recompute and offloading give the
# same outputs and gradients, bitwise (tests/test_overlap.py, test_recompute.py,
# test_offload.py); a run that resumes short of memory turns recompute or offloading on.
EXECUTION_ONLY = ("model.moe.overlap_chunks", "model.moe.delay_wgrad_compute", "model.recompute",
                  "model.offload")


def _under(key: str, fields: tuple[str, ...]) -> bool:
    """``key`` (dotted) is one of ``fields`` or lies below one of them."""
    return any(key == f or key.startswith(f + ".") for f in fields)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def model_differences(saved: RootConfig, requested: RootConfig,
                      router_options: Callable[[str, dict], dict | None] | None = None,
                      ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted field, saved value, requested value) for every MODEL_DEFINING field that
    differs in what it means; "(not set)" stands for an option present on one side only.
    ``router_options(router, options)``: the options as the router reads them (its defaults
    filled in, the ones that change only how it runs left out; None where it cannot tell, and
    then both sides are compared as written), so an option written out at its default is no
    difference; ``ignore``: fields (and their sub-fields) not compared."""
    dicts = [saved.to_dict(), requested.to_dict()]
    if router_options is not None:
        read = [router_options(c.plugins.router, dict(c.plugins.router_options))
                for c in (saved, requested)]
        if None not in read:
            for d, opts in zip(dicts, read):
                d["plugins"]["router_options"] = opts
    a, b = (_flatten(d) for d in dicts)
    if saved.data.tokenizer == requested.data.tokenizer == "bytes":
        a.pop("data.vocab_size"), b.pop("data.vocab_size")  # only BPE reads it
    if 0 in (saved.model.vocab_size, requested.model.vocab_size):
        # 0 means the tokenizer's vocabulary: the embedding's saved shape decides at load
        a.pop("model.vocab_size"), b.pop("model.vocab_size")
    if all(saved.model.moe_layer_pattern) and all(requested.model.moe_layer_pattern):
        a.pop("model.dense_ffn_hidden_size"), b.pop("model.dense_ffn_hidden_size")  # no dense
    unset = "(not set)"
    return [(k, a.get(k, unset), b.get(k, unset)) for k in {**b, **a}
            if _under(k, MODEL_DEFINING) and not _under(k, EXECUTION_ONLY)
            and not _under(k, ignore) and a.get(k, unset) != b.get(k, unset)]


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
        found.append(f"{path.rstrip('.') or cls.__name__} = {data!r}: must be a mapping (the "
                     f"{cls.__name__} section). Fix: write it as `key: value` lines")
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
        elif known[key].type in ("float", "float | None"):
            value = _as_float(value)
        kwargs[key] = value
    if not complete:
        raise _Unbuilt
    try:
        return cls(**kwargs)
    except ConfigError as e:  # raised, not recorded (e.g. by validate_model)
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
    (RootConfig, "parallel"): ParallelConfig,
    (RootConfig, "runtime"): RuntimeSection,
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
        value = _parse_scalar(raw)
        old = node.get(parts[-1])
        # a section given as a mapping merges into it, as a file does over a preset
        node[parts[-1]] = (merge_config_dicts(old, value)
                           if isinstance(value, Mapping) and isinstance(old, Mapping) else value)
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


def _utf16_or_32(path: str) -> bool:
    """Text an editor saved as UTF-16/32: a byte-order mark and printable text behind it."""
    with open(path, "rb") as f:
        raw = f.read()
    for codec in ("utf-32", "utf-16"):  # utf-32 first: its little-endian BOM starts with utf-16's
        try:
            text = raw.decode(codec)
        except UnicodeDecodeError:
            continue
        if raw[:4] in (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE) or \
                raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
            return all(c.isprintable() or c in "\t\r\n" for c in text)
    return False


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last: a
    second `model:` block silently replaced the first)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"config file {self.name!r}: key {key!r} appears twice in one "
                                  f"section (lines "
                                  f"{seen[key] + 1} and {key_node.start_mark.line + 1}); YAML "
                                  f"would keep only the last. Fix: merge the two into one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


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
            what = "is not a regular file" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"config file {path!r} {what}. Fix: pass an existing YAML "
                              f"file to --config, or leave --config out to use the packaged default")
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a UTF-8 BOM is fine
                loaded = yaml.load(f, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: "
                              f"{' '.join(str(e).split())}. Fix: correct the syntax there") from None
        except UnicodeDecodeError as e:
            if _utf16_or_32(path):
                raise ConfigError(f"config file {path!r} is not UTF-8 text (it starts with a "
                                  f"UTF-16/32 byte-order mark). Fix: save it as UTF-8 "
                                  f"(e.g. iconv -f UTF-16 -t UTF-8)") from None
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
