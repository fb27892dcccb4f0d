"""The ``deepep`` dispatcher: listed unavailable with the reason where ``deep_ep`` does not
import; CPU tokens refused naming the fix; and its own layout code (the local permute of the
rows DeepEP hands over, padding, the local sum before DeepEP's combine, both backwards) proven at
one rank on the CPU.

DeepEP itself needs NVIDIA GPUs and is not installed here or on the lent GPU, so the exchange
runs through ``OneRankBuffer``: DeepEP's ``Buffer`` reduced to one rank, as its documentation
defines the three calls the dispatcher makes (``get_dispatch_layout``; ``dispatch``: every token
with at least one valid choice arrives once, its ids local, -1 kept; ``combine``: the rows summed
back onto their source tokens, the probs' gradients alike; ``dispatch(handle=...)`` resends the
same tokens). It is a stand-in for a library that cannot run here, not for one of ours: what the
test proves is the dispatcher's side - the same x_SD, probs_S, counts, outputs and gradients as
``alltoall`` at one rank, with dropped choices, pad-to-capacity and pad_multiple.

Legend: T tokens, K top-k, D hidden, E experts, R tokens DeepEP delivers.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.interfaces import RouterOutput

E, K, D, T = 6, 2, 8, 9


class OneRankBuffer:
    """deep_ep.Buffer at one rank (see the module docstring); ``calls`` counts what ran."""

    def __init__(self) -> None:
        self.calls = {"layout": 0, "dispatch": 0, "redispatch": 0, "combine": 0}

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls["layout"] += 1
        in_rank = (topk_idx >= 0).any(dim=1, keepdim=True)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
        return in_rank.sum(0), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, topk_idx=None, topk_weights=None, **layout):
        if handle is not None:  # combine's backward: the same tokens as the cached layout
            self.calls["redispatch"] += 1
            sent, _ = handle
            return x.index_select(0, sent), None, None, None, handle, None
        self.calls["dispatch"] += 1
        assert layout["is_token_in_rank"].shape == (x.shape[0], 1)
        sent = (topk_idx >= 0).any(dim=1).nonzero().reshape(-1)
        counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=E).tolist()
        return (x.index_select(0, sent), topk_idx.index_select(0, sent),
                topk_weights.index_select(0, sent), counts, (sent, x.shape[0]), None)

    def combine(self, x, handle, topk_weights=None, **_):
        self.calls["combine"] += 1
        sent, num_tokens = handle
        out = x.new_zeros(num_tokens, *x.shape[1:]).index_add_(0, sent, x)
        w = (None if topk_weights is None else
             topk_weights.new_zeros(num_tokens, topk_weights.shape[1]).index_add_(0, sent,
                                                                                 topk_weights))
        return out, w, None


def _cfg():
    from moeplug.testing import tiny_model_config
    return tiny_model_config(num_experts=E, top_k=K, hidden_size=D)


def _dispatcher(buffer):
    from moeplug_plugins.dispatchers.deepep import DeepEPDispatcher
    return DeepEPDispatcher(_cfg(), None, buffer_for=lambda group, hidden_bytes: buffer)


def test_listed_unavailable_with_the_reason_and_cpu_tokens_refused():
    from moeplug.plugin_host import PluginHost
    from moeplug_plugins.dispatchers import deepep_unavailable
    from moeplug_plugins.dispatchers.deepep import DeepEPDispatcher
    host = PluginHost.load()
    info = {(i.kind, i.name): i for i in host.infos()}[("dispatcher", "deepep")]
    assert info.reason == deepep_unavailable() and info.available == (not info.reason)
    if info.reason:  # this machine: no deep_ep
        assert "needs module 'deep_ep'" in info.reason and "Fix:" in info.reason
        assert "deepep" not in host.names("dispatcher")
    routing = RouterOutput(torch.rand(T, K), torch.zeros(T, K, dtype=torch.int64),
                           torch.zeros(()))
    with pytest.raises(ValueError, match="deepep moves CUDA tensors.*Fix: use dispatcher "
                                         "direct_write or hierarchical"):
        DeepEPDispatcher(_cfg(), None).dispatch(torch.randn(T, D), routing)


def test_contract_one_process():
    from moeplug.testing import check_dispatcher
    check_dispatcher(lambda model, options, group: _dispatcher(OneRankBuffer()), "deepep",
                     model_cfg=_cfg())


@pytest.mark.parametrize("case", ["plain", "dropped", "dropped_pad_to_capacity",
                                  "pad_multiple", "all_dropped"])
def test_equals_alltoall_at_one_rank(case):
    from moeplug.plugin_host import PluginHost
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    probs = torch.rand(T, K, generator=gen)
    dropped, capacity, pad_multiple = None, None, 1
    if case != "plain" and case != "pad_multiple":
        dropped = torch.rand(T, K, generator=gen) < 0.4
        dropped[0] = True  # a token with every choice dropped: DeepEP does not send it
        if case == "all_dropped":
            dropped[:] = True
        probs = probs.masked_fill(dropped, 0.0)
        if case == "dropped_pad_to_capacity":
            capacity = int(torch.bincount(ids[~dropped], minlength=E).max()) + 1
    if case == "pad_multiple":
        pad_multiple = 4
    buffer = OneRankBuffer()
    ours = _dispatcher(buffer)
    ref = PluginHost.load().create("dispatcher", "alltoall", {}, _cfg(), None)
    x = torch.randn(T, D, generator=gen)
    w_TD = torch.randn(T, D, generator=gen)
    w1 = torch.randn(E, D, D, generator=gen)
    out = {}
    for name, disp in (("deepep", ours), ("alltoall", ref)):
        x_TD, p_TK = x.clone().requires_grad_(), probs.clone().requires_grad_()
        routing = RouterOutput(p_TK, ids, torch.zeros(()), dropped_TK=dropped, capacity=capacity,
                               pad_multiple=pad_multiple)
        d = disp.dispatch(x_TD, routing)
        # experts: a different linear map per local expert, scaled by the row's prob
        rows, at = [], 0
        for e, n in enumerate(d.counts_L.tolist()):
            rows.append(d.x_SD[at:at + n] @ w1[e] * d.probs_S[at:at + n, None])
            at += n
        y_TD = disp.combine(torch.cat(rows), d.meta)
        gx, gp = torch.autograd.grad((y_TD * w_TD).sum(), (x_TD, p_TK), allow_unused=True)
        out[name] = (d.x_SD.detach(), d.probs_S.detach(), d.counts_L, y_TD.detach(), gx, gp)
    for what, a, b in zip(("x_SD", "probs_S", "counts_L", "y_TD", "grad x", "grad probs"),
                          out["deepep"], out["alltoall"]):
        assert (a is None) == (b is None), what
        assert a is None or torch.equal(a, b), what
    expect_redispatch = 1  # combine's backward resends the gradient along the cached layout
    assert buffer.calls == {"layout": 1, "dispatch": 1, "redispatch": expect_redispatch,
                            "combine": 2}, buffer.calls
