"""The pipeline split a mapping trains with, exactly as ``moeplug train`` would split it.

The split is moeplug train's own (``ParallelConfig.layer_layout``, see
moeplug.config.pipeline_layout): a mapping's ``layout`` (Megatron's layout string) or its
first / last stage counts are taken as given; otherwise an even split over PP x VPP, else the
most balanced uneven first / last stages train accepts, else a balanced layout string (every
virtual stage as even as whole layers allow, the MTP blocks counted as layers of the last
stage). The last two are proposals: the plan prints the parallel fields train then needs.
What each pipeline rank holds (:class:`RankPart`) is what the planner's memory and time models
read: its layers (MoE or dense, by chunk), the embedding (original or copy), the MTP blocks,
the head and loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moeplug.config import ConfigError, ModelConfig, ParallelConfig
from moeplug.config.pipeline_layout import (PipelineLayout, balanced_sizes, from_stage_sizes,
                                            layout_of_string)


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank holds: per chunk, the MoE flag of each block (decoder layers,
    then MTP blocks, which are of the last layer's kind); whether it holds the embedding (the
    first stage's, or a copy: MTP stage, tied head), the loss (norm + head) and MTP blocks."""

    chunks: tuple[tuple[bool, ...], ...]
    embedding: bool
    loss: bool
    mtp: int

    @property
    def layers(self) -> list[bool]:
        """Every block of the rank (MTP blocks included), chunk after chunk."""
        return [moe for chunk in self.chunks for moe in chunk]


def split_config(mp, **fields) -> ParallelConfig:
    """The ParallelConfig of ``mp``'s degrees with the split ``fields``."""
    return ParallelConfig(tp=mp.tp, cp=mp.cp, pp=mp.pp, ep=mp.ep, etp=mp.etp, vpp=mp.vpp,
                          sequence_parallel=mp.tp > 1, **fields)


def _given(mp) -> dict:
    if mp.layout is not None:
        return {"pipeline_layout": mp.layout}
    return {k: v for k, v in (("num_layers_in_first_stage", mp.first_stage_layers),
                              ("num_layers_in_last_stage", mp.last_stage_layers)) if v is not None}


def plan_layout(cfg: ModelConfig, mp) -> tuple[PipelineLayout, dict]:
    """(the layout train runs ``mp`` with, the parallel fields a config must then set: {} when
    the mapping gave its split or the even split works). Raises ConfigError naming --mapping."""
    n, mtp = cfg.num_layers, cfg.mtp_num_layers
    given = _given(mp)
    if given:
        try:
            return split_config(mp, **given).layer_layout(n, mtp), {}
        except ConfigError as e:
            key = "layout" if mp.layout is not None else "pp"
            value = mp.layout if mp.layout is not None else mp.pp
            raise ConfigError(f"--mapping {key}={value}: moeplug train refuses this split: "
                              f"{_reason(e)}. Fix: {str(e).split('. Fix: ', 1)[-1]}") from None
    if n < mp.pp * mp.vpp:
        raise ConfigError(f"--mapping pp={mp.pp},vpp={mp.vpp}: pp·vpp = {mp.pp * mp.vpp} "
                          f"exceeds num_layers {n}. Fix: lower pp or vpp")
    try:
        return split_config(mp).layer_layout(n, mtp), {}
    except ConfigError:
        pass
    if mp.pp > 1:
        best = _best_first_last(n, mp)
        if best is not None:
            fields = {"num_layers_in_first_stage": best[0], "num_layers_in_last_stage": best[1]}
            return split_config(mp, **fields).layer_layout(n, mtp), fields
    layout = from_stage_sizes(balanced_sizes(n, mtp, mp.pp * mp.vpp), mp.pp, mtp)
    layout = layout_of_string(layout.text(), mp.pp, num_layers=n, mtp_num_layers=mtp)
    return layout, {"pipeline_layout": layout.text()}


def _best_first_last(n: int, mp) -> tuple[int, int] | None:
    """The most balanced (first, last) train's count rules accept: middle stages of m layers
    each (a multiple of vpp), the rest split over the first and last stage as evenly as
    multiples of vpp allow; the fullest rank decides, then the spread."""
    pp, v, best = mp.pp, mp.vpp, None
    for m in sorted({n // pp // v * v, -(-n // pp // v) * v}) if pp > 2 else [0]:
        rest = n - (pp - 2) * m
        if rest < 0:
            continue
        last = rest // 2 // v * v
        try:
            counts = split_config(mp, num_layers_in_first_stage=rest - last,
                                  num_layers_in_last_stage=last).rank_layer_counts(n)
        except ConfigError:
            continue
        key = (max(counts), max(counts) - min(counts))
        if best is None or key < best[0]:
            best = (key, rest - last, last)
    return None if best is None else best[1:]


def rank_parts(cfg: ModelConfig, mp) -> list[RankPart]:
    """What each pipeline rank of ``mp`` holds under :func:`plan_layout`'s split."""
    layout, _ = plan_layout(cfg, mp) if mp.pp > 1 or _given(mp) else \
        (split_config(replace(mp, vpp=1)).layer_layout(cfg.num_layers, cfg.mtp_num_layers), {})
    pattern = list(cfg.moe_layer_pattern)
    tied = cfg.tie_embeddings
    holders = layout.embedding_ranks(tied)
    out = []
    for r in range(layout.pp):
        stages = layout.rank_stages(r)
        chunks = tuple(tuple(pattern[i] for i in s.layers) + (bool(pattern[-1]),) * s.mtp
                       for s in stages)
        out.append(RankPart(chunks=chunks, embedding=r in holders,
                            loss=any(s.loss for s in stages), mtp=sum(s.mtp for s in stages)))
    return out


def model_blocks(cfg: ModelConfig) -> list[bool]:
    """The MoE flag of every block of the whole model: its layers, then its MTP blocks."""
    pattern = list(cfg.moe_layer_pattern)
    return pattern + [bool(pattern[-1])] * cfg.mtp_num_layers


def _reason(e: ConfigError) -> str:
    """The middle of train's "<field> = <value>: <reason>. Fix: ..." line."""
    text = str(e).split(". Fix:")[0]
    return text.split(": ", 1)[1] if ": " in text else text
