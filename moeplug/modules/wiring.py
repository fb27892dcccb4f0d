"""What the model's modules do at the edges of a parallel region, as one object they hold.

Legend: B batch, S sequence, s = S / TP sequence chunk (sequence parallelism), D hidden,
V vocabulary (V / TP columns under tensor parallelism).

The modules are built for one process and never import the parallel code: each of
``Attention``, ``SwiGLUMLP``, ``TransformerBlock`` and the model (its stages) holds a
``wiring`` whose hooks it calls at the few places a parallel layout changes the forward. This
class is one process: every hook is the identity (or the plain loss). ``moeplug.parallelize``
installs its subclass on every module of a model it parallelizes (TP/SP, then CP), the way
torchtitan's ``parallelize_module`` changes a built model from outside.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F


class Wiring:
    """One process: no region to enter or leave, the whole sequence and vocabulary on this
    rank. Holds configuration only (groups, flags), nothing from a call."""

    tp_group: Any = None          # the TP process group (None: no tensor parallelism)
    sequence_parallel: bool = False
    cp_group: Any = None          # the CP process group (None: no context parallelism)
    # RoPE at global positions + attention over the CP group (context_parallel's
    # ContextParallelAttention), or None: the local core attention.
    cp_attention: Callable | None = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input of column-parallel layers (q/k/v, gate/up, the output head)."""
        return x

    def moe_tokens_in(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """The tokens the MoE layer routes on this rank."""
        return x_BSD

    def moe_tokens_out(self, y_BsD: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`moe_tokens_in`."""
        return y_BsD

    def aux_loss(self, aux: torch.Tensor) -> torch.Tensor:
        """The blocks' summed aux loss as the loss takes it (CP scales its grad)."""
        return aux

    def lm_loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy; fp32, since under bf16 autocast the log-softmax over V
        would lose precision."""
        return F.cross_entropy(logits_BSV.float().reshape(-1, logits_BSV.shape[-1]),
                               targets_BS.reshape(-1))

    def ahead(self, ids_BS: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
        """Each held position's token id ``k`` positions further on in the sequence, ``fill``
        past its end (multi-token prediction's t_{i+k}; Megatron's roll_tensor fills with 0)."""
        return F.pad(ids_BS[:, k:], (0, k), value=fill)

    def lm_loss_ahead(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor,
                      k: int) -> torch.Tensor:
        """MTP depth k's mean cross-entropy: its logits at the S - k first positions against
        the next-token targets k further on (t_{i+k+1} = targets[:, i + k])."""
        S = targets_BS.shape[1]
        return self.lm_loss(logits_BSV[:, :S - k], targets_BS[:, k:])

    def whole_seq_len(self, S: int) -> int:
        """The sequence's length when this rank holds ``S`` of its tokens (S x CP under CP)."""
        return S

    def local_seq_len(self, S: int) -> int:
        """Positions of the [B, S, D] activation between blocks on this rank (S / TP under SP)."""
        return S


LOCAL = Wiring()  # shared by every module of an unparallelized model (it holds nothing)
