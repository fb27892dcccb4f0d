"""Router contract: shapes, dtypes, id ranges, distinct ids, probs >= 0, scalar aux loss with a
gradient to the gate, fp32 routing under autocast, no per-call state.

Legend: T tokens, D hidden, E experts, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug.config import ModelConfig
from moeplug.interfaces import Router, RouterOutput
from moeplug.testing._common import (build, differentiable, expect, expect_no_new_state,
                                     state_snapshot, tiny_model_config)
from moeplug.testing.capabilities import check_declared


def check_router(source: Any, name: str | None = None, *, model_cfg: ModelConfig | None = None,
                 options: Any = None, num_tokens: int = 13, seed: int = 0) -> None:
    cfg = model_cfg or tiny_model_config()
    E, K, D, T = cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden_size, num_tokens
    torch.manual_seed(seed)
    router, label = build(source, "router", name, options, cfg)
    expect(isinstance(router, Router), label,
           f"is a {type(router).__name__}, not a moeplug.interfaces.Router")
    check_declared(router, Router, label)
    expect(router.num_experts == E and router.top_k == K, label,
           f"num_experts/top_k = {router.num_experts}/{router.top_k}, expected {E}/{K} from the model config")

    x_TD = torch.randn(T, D, requires_grad=True)
    before = state_snapshot(router)
    out = router(x_TD)
    expect_no_new_state(before, router, label, "forward")
    _check_output(out, label, T, E, K)

    again = router(x_TD)
    expect(torch.equal(again.ids_TK, out.ids_TK) and torch.equal(again.probs_TK, out.probs_TK), label,
           "two forwards on the same input routed differently; routing must be deterministic")

    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        auto = router(x_TD)
    expect(auto.probs_TK.dtype == torch.float32, label,
           f"under bf16 autocast probs_TK is {auto.probs_TK.dtype}; routing must stay float32")

    params = [p for p in router.parameters() if p.requires_grad]
    if not params:
        expect(float(out.aux_loss) == 0.0 or out.aux_loss.requires_grad, label,
               "has no parameters but a constant non-zero aux_loss")
        return
    if out.aux_loss.requires_grad:
        grads = torch.autograd.grad(out.aux_loss, params, allow_unused=True, retain_graph=True)
        expect(any(g is not None and g.abs().sum() > 0 for g in grads), label,
               "aux_loss does not reach the gate weights (all gradients zero)")
    else:
        expect(float(out.aux_loss) == 0.0, label, "aux_loss is non-zero but carries no gradient")
    w_TK = torch.randn(T, K)
    (differentiable(out.probs_TK, label, "probs_TK") * w_TK).sum().backward()
    expect(x_TD.grad is not None and torch.isfinite(x_TD.grad).all(), label,
           "probs_TK gives no finite gradient to the input")
    for p in params:
        expect(p.grad is not None and torch.isfinite(p.grad).all(), label,
               "probs_TK gives no finite gradient to a router parameter")


def _check_output(out: Any, label: str, T: int, E: int, K: int) -> None:
    expect(isinstance(out, RouterOutput), label, f"forward returned {type(out).__name__}, not RouterOutput")
    expect(out.probs_TK.shape == (T, K) and out.probs_TK.dtype == torch.float32, label,
           f"probs_TK is {out.probs_TK.dtype}{tuple(out.probs_TK.shape)}, expected float32{(T, K)}")
    expect(out.ids_TK.shape == (T, K) and out.ids_TK.dtype == torch.int64, label,
           f"ids_TK is {out.ids_TK.dtype}{tuple(out.ids_TK.shape)}, expected int64{(T, K)}")
    expect(((out.ids_TK >= 0) & (out.ids_TK < E)).all(), label,
           f"ids_TK has ids outside [0, {E}): {out.ids_TK.unique().tolist()}")
    sorted_TK = out.ids_TK.sort(dim=-1).values
    expect((sorted_TK[:, 1:] != sorted_TK[:, :-1]).all(), label,
           "a token chose the same expert twice; a token's K ids must be distinct")
    expect(torch.isfinite(out.probs_TK).all() and (out.probs_TK >= 0).all(), label,
           "probs_TK must be finite and >= 0")
    expect(isinstance(out.aux_loss, torch.Tensor) and out.aux_loss.dim() == 0, label,
           f"aux_loss must be a scalar tensor, got {getattr(out.aux_loss, 'shape', out.aux_loss)!r}")
    expect(torch.isfinite(out.aux_loss), label, "aux_loss is not finite")
    if out.logits_TE is not None:
        expect(out.logits_TE.shape == (T, E) and out.logits_TE.dtype == torch.float32, label,
               f"logits_TE is {out.logits_TE.dtype}{tuple(out.logits_TE.shape)}, expected float32{(T, E)}")
