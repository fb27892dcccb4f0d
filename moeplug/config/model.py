"""The ``model:`` section: the transformer, its MoE block, MLA, recompute and offload."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeplug.config._checks import (_above_zero, _check_fields, _fail,
                                      _is_positive_int, _non_negative, _positive)

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
    # Overlap (moeplug.moe.overlap): split each micro-batch's tokens into this many
    # chunks whose dispatch/combine run in the background while another chunk's experts (and
    # the shared experts) compute. 1 = off. Dispatchers without split start/wait still work.
    overlap_chunks: int = 1
    # Megatron delay_wgrad_compute (moeplug.ops.delayed_wgrad): the grouped experts' backward hands
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


def expert_op_levers(m: "ModelConfig") -> dict[str, list[str]]:
    """The memory levers that act inside the routed experts' op, as asked for in ``m``, by
    ``model.*`` field: ``{"recompute.modules": ["moe_act"], "offload": ["expert_fc1", ...]}``
    (only those set). The op keeps FC1's output instead of the activation (moe_act recompute)
    and notes which of its saved tensors the offload names mean; a path that runs the experts
    otherwise would ignore them (moeplug.config.modes refuses them there: capture, recompute,
    sync_free)."""
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
    """Decoder-only transformer. ``vocab_size = 0`` means: the tokenizer's vocabulary, padded
    up to a multiple of ``make_vocab_size_divisible_by`` (RootConfig.model_vocab_size)."""

    vocab_size: int = 0
    # Megatron's --make-vocab-size-divisible-by: the padded rows keep the embedding and head
    # GEMMs aligned and split over TP; no token id reaches them and generation never picks
    # them. Megatron pads to a multiple of this times TP; moeplug leaves TP out so that the
    # model's shape is the same in every layout (a checkpoint resumes under another TP).
    make_vocab_size_divisible_by: int = 128
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
                  "dense_ffn_hidden_size", "make_vocab_size_divisible_by")
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
        # Against recompute, capture and the experts backend: moeplug.config.modes (offload,
        # capture, recompute).

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

