"""The whole run (:class:`RootConfig`): the sections and the checks that span them; which
fields define a model (what a resume may not change)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from moeplug.config._checks import ConfigError, _check_fields, _fail, _record
from moeplug.config.data import DataConfig
from moeplug.config.model import ModelConfig
from moeplug.config.modes import check_modes
from moeplug.config.parallel import ParallelConfig, validate_model
from moeplug.config.plugins import PluginsConfig
from moeplug.config.runtime import RuntimeSection
from moeplug.config.train import TrainConfig


@dataclass(kw_only=True, slots=True)
class RootConfig:
    """The whole run. Cross-section checks live here; which modes combine, in
    moeplug.config.modes (run from here: the rules that need the config alone)."""

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
        self._check_parallel_fits_model()
        # Which modes combine (sync_free, capture, stash, overlap, delay_wgrad, recompute,
        # offload, recipes, fsdp, device): each mode's rules, moeplug.config.modes.
        check_modes(self)

    def _check_parallel_fits_model(self) -> None:
        # Shards must split evenly (heads % TP, experts % EP, layers per pipeline stage, seq_len
        # per CP/SP shard). No world size needed, so this runs on every load.
        m, par = self.model, self.parallel
        validate_model(par, num_experts=m.moe.num_experts, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, num_layers=None,
                       ffn_hidden_size=m.moe.ffn_hidden_size, seq_len=self.train.seq_len)
        try:  # the pipeline split, MTP blocks too; a layout string's own error stays the one
            par.layer_layout(m.num_layers, m.mtp_num_layers)
        except ConfigError as e:
            _record(e)
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
        if m.attention == "mla" and par.cp > 1:  # else a traceback from every rank's build
            _fail(m, "attention", "mla", f"multi-head latent attention does not support "
                  f"parallel.cp = {par.cp} yet", "set model.attention: gqa or parallel.cp: 1")
        if par.pp > 1 and par.vpp > 1 and self.train.grad_accum_steps % par.pp:
            _fail(self.train, "grad_accum_steps", self.train.grad_accum_steps,
                  f"the interleaved pipeline schedule (parallel.vpp = {par.vpp}) needs a "
                  f"multiple of parallel.pp = {par.pp} micro-batches",
                  f"set train.grad_accum_steps to a multiple of {par.pp}, or parallel.vpp: 1")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_vocab_size(self, tokenizer_vocab: int, tokenizer: str | None = None) -> int:
        """The embedding's rows for a tokenizer of ``tokenizer_vocab`` ids: ``model.vocab_size``,
        or (0) the tokenizer's padded up to a multiple of ``model.make_vocab_size_divisible_by``.
        ConfigError where a token id would have no row, or the rows do not split over TP.
        ``tokenizer``: how the tokenizer was named, for the message (default data.tokenizer)."""
        m, tp = self.model, self.parallel.tp
        named = tokenizer or f"data.tokenizer = {self.data.tokenizer!r}"
        if m.vocab_size:
            if m.vocab_size < tokenizer_vocab:
                raise ConfigError(
                    f"ModelConfig.vocab_size = {m.vocab_size}: smaller than the {tokenizer_vocab} "
                    f"ids of the tokenizer ({named}), so ids >= {m.vocab_size} would index "
                    f"past the embedding. Fix: use a tokenizer of at most {m.vocab_size} ids "
                    f"(the model's own), or set model.vocab_size: 0 (the tokenizer's, padded) "
                    f"or >= {tokenizer_vocab} on a new run")
            return m.vocab_size
        multiple = m.make_vocab_size_divisible_by
        padded = -(-tokenizer_vocab // multiple) * multiple
        if padded % tp:
            raise ConfigError(
                f"ModelConfig.make_vocab_size_divisible_by = {multiple}: the tokenizer's "
                f"{tokenizer_vocab} ids padded to {padded} rows do not split over parallel.tp = "
                f"{tp} (the embedding and head are split over TP). Fix: set "
                f"model.make_vocab_size_divisible_by to a multiple of {tp} (e.g. 128)")
        return padded


# The fields that define a model's weights and the function they compute: a checkpoint resumed
# under another value either mismatches shapes (num_experts, hidden_size, vocabulary) or
# silently computes something else with the same tensors (top_k, activation, routing options).
# A Hugging Face tokenizer (a path in data.tokenizer) is compared by what it encodes, not by
# its path (moeplug.training.resume compares the fingerprints).
MODEL_DEFINING = ("model", "plugins.router", "plugins.router_options", "data.tokenizer",
                  "data.vocab_size")
# Fields under "model" (and the sections below them) that change how the model runs, not what
# it computes: a resume may change them. Overlap on or off, recompute and offloading give the
# same outputs and gradients, bitwise (tests/test_overlap.py, test_recompute.py,
# test_offload.py); a run that resumes short of memory turns recompute or offloading on.
EXECUTION_ONLY = ("model.moe.overlap_chunks", "model.moe.delay_wgrad_compute", "model.recompute",
                  "model.offload")
# Fields under "model" that only weight a training loss: the model computes the same function
# whatever they are, so a resume (the fine-tuning of an import above all) may change them. The
# router declares its own such options (TopKOptions.training_only: aux/seq/z-loss coefficients,
# the expert-bias update rate, jitter), which PluginHost.defining_options leaves out.
TRAINING_ONLY = ("model.moe.aux_loss_coeff", "model.mtp_loss_scaling_factor")


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
    filled in, the ones that change only how it runs or only weight a training loss left out; None where it cannot tell, and
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
    if "bpe" not in (saved.data.tokenizer, requested.data.tokenizer):
        a.pop("data.vocab_size"), b.pop("data.vocab_size")  # only BPE reads it
    if not {saved.data.tokenizer, requested.data.tokenizer} & {"bpe", "bytes"}:
        a.pop("data.tokenizer"), b.pop("data.tokenizer")  # two paths: their fingerprints decide
    # The padding multiple counts only through the rows it gives, which the resume checks
    # against the checkpoint's embedding (moeplug.training.resume).
    a.pop("model.make_vocab_size_divisible_by", None)
    b.pop("model.make_vocab_size_divisible_by", None)
    if 0 in (saved.model.vocab_size, requested.model.vocab_size):
        # 0 means the tokenizer's vocabulary: the embedding's saved shape decides at load
        a.pop("model.vocab_size"), b.pop("model.vocab_size")
    if all(saved.model.moe_layer_pattern) and all(requested.model.moe_layer_pattern):
        a.pop("model.dense_ffn_hidden_size"), b.pop("model.dense_ffn_hidden_size")  # no dense
    unset = "(not set)"
    return [(k, a.get(k, unset), b.get(k, unset)) for k in {**b, **a}
            if _under(k, MODEL_DEFINING) and not _under(k, EXECUTION_ONLY + TRAINING_ONLY)
            and not _under(k, ignore) and a.get(k, unset) != b.get(k, unset)]

