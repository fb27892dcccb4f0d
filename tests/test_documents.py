"""Packed documents with document masking (``data.document_mask``).

* positions and masks: equal to megatron-core's own ``_get_ltor_masks_and_position_ids``
  (reset_position_ids, reset_attention_mask) on rows with EODs anywhere, at the ends, twice in a
  row and nowhere; and a hand-worked example;
* the proof: in a packed sample, every document's logits and per-token losses equal that
  document run alone (fp32, 1e-5), for GQA (with and without qk-norm), MLA and the MTP block,
  MoE layers included, while the unmasked packed run differs;
* context parallelism alone, on real ranks (CP4, CP2 x DP2; ring and allgather): output and
  dq/dk/dv of every rank's shard equal SDPA with the block-diagonal causal mask on the full
  sequence, with a document layout in which some ring blocks hold no key a row may see;
* refusals: a tokenizer without EOS, at the CLI before any rank starts (also under --nproc);
* the trainer: ``train()`` feeds the positions to every step and to the validation batches.

The layout matrix (tests/test_parallel_train.py) has the document-masked rows that compare
whole training steps at CP2 (ring and allgather), TP2 + SP, EP2, PP2 and CP2 x EP2 with one
process.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moeplug.data.documents import (attention_mask, document_ids, document_positions,
                               visible, with_positions)
from moeplug.testing.distributed import run_distributed

V, EOD = 50, 0
TOL = 1e-5

MLA = {"attention": "mla", "mla": {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                   "qk_rope_head_dim": 4, "v_head_dim": 8}}


def _rows_with_eods() -> torch.Tensor:
    """Rows of 12 tokens: EODs inside, first, last, doubled, and none at all."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(1, V, (6, 12), generator=g)
    rows[0, [3, 8]] = EOD
    rows[1, 0] = EOD
    rows[2, 11] = EOD
    rows[3, [4, 5]] = EOD
    rows[5, [0, 1, 6, 11]] = EOD  # row 4 has no EOD
    return rows


def test_positions_and_document_ids_by_hand():
    tokens = torch.tensor([[5, EOD, 7, 8, EOD, EOD, 9]])
    assert document_positions(tokens, EOD).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    # The token after an EOD may not see the EOD's document; the EOD itself still sees its own.
    vis = visible(torch.arange(7), torch.arange(7), document_positions(tokens, EOD))[0]
    assert vis[2].tolist() == [False, False, True, False, False, False, False]
    assert vis[4].tolist() == [False, False, True, True, True, False, False]
    assert vis[1].tolist() == [True, True, False, False, False, False, False]
    same_doc = document_ids(tokens, EOD)[0][:, None] == document_ids(tokens, EOD)[0][None, :]
    assert torch.equal(vis, same_doc & torch.ones(7, 7, dtype=torch.bool).tril())


def test_positions_and_masks_equal_megatron_cores():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra "
                        "pins it)")
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    rows = _rows_with_eods()
    positions_BS = document_positions(rows, EOD)
    index_S = torch.arange(rows.shape[1])
    ours = visible(index_S, index_S, positions_BS)
    for b, row in enumerate(rows):
        masked, _, position_ids = _get_ltor_masks_and_position_ids(
            row, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
            create_attention_mask=True)
        assert torch.equal(positions_BS[b], position_ids), (b, row.tolist())
        assert torch.equal(ours[b], ~masked[0]), (b, row.tolist())  # Megatron: True = masked
    # Without documents: the causal mask, as Megatron's without the resets.
    masked, _, _ = _get_ltor_masks_and_position_ids(rows[0], EOD, False, False, False, True)
    assert torch.equal(visible(index_S, index_S), ~masked[0])


def test_with_positions_appends_them_and_off_is_unchanged():
    t, y = _rows_with_eods(), _rows_with_eods()
    assert with_positions([(t, y)], None) == [(t, y)]
    (t2, y2, p), = with_positions([(t, y)], EOD)
    assert t2 is t and y2 is y and torch.equal(p, document_positions(t, EOD))
    assert attention_mask(torch.arange(12), torch.arange(12), p).shape == (6, 1, 12, 12)


# --- the proof: each document as if alone ------------------------------------------------------

def _model(extra: dict, mtp: int = 0):
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    cfg = config_from_dict({
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 32, "first_k_dense": 1, "dense_ffn_hidden_size": 32,
                  "init_std": 0.1, "mtp_num_layers": mtp,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16}, **extra},
        "train": {"seq_len": 24}})
    torch.manual_seed(0)
    return build_model(cfg, PluginHost.load(), V).eval()


def _packed() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Three documents (the first two ended by EOD, the last cut off by the sample's end) and
    the packed sample's tokens and next-token targets."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, V, (n,), generator=g) for n in (6, 9, 8)]
    docs[0][-1] = docs[1][-1] = EOD
    stream = torch.cat(docs + [torch.randint(1, V, (1,), generator=g)])
    return docs, stream[None, :-1], stream[None, 1:]


@pytest.mark.parametrize("name,extra", [("gqa", {}), ("gqa_qk_norm", {"qk_norm": True}),
                                        ("mla", MLA),
                                        ("mla_no_q_lora", {**MLA, "mla": {**MLA["mla"],
                                                                          "q_lora_rank": 0}})])
def test_each_packed_documents_loss_equals_the_document_alone(name, extra):
    model = _model(extra)
    docs, tokens, targets = _packed()
    positions = document_positions(tokens, EOD)
    with torch.no_grad():
        packed = model(tokens, targets, positions).logits_BSV[0]
        unmasked = model(tokens, targets).logits_BSV[0]
        start, gaps = 0, []
        for doc in docs:
            n = len(doc)
            alone = model(doc[None]).logits_BSV[0]
            # the same targets: those the packed sample trains this document's tokens on
            want = F.cross_entropy(alone, targets[0, start:start + n], reduction="none")
            got = F.cross_entropy(packed[start:start + n], targets[0, start:start + n],
                                  reduction="none")
            assert (got - want).abs().max() <= TOL, (name, n, (got - want).abs().max())
            assert (packed[start:start + n] - alone).abs().max() <= TOL
            gaps.append((unmasked[start:start + n] - alone).abs().max().item())
            start += n
    assert gaps[0] <= TOL and min(gaps[1:]) > 1e-2, gaps  # without the mask, docs 2, 3 differ


def test_mtp_block_attends_within_each_document():
    # Depth 1 at position i reads h_i and the embedding of token i + 1; where both lie in one
    # document its MTP logits equal the document's alone.
    model = _model({}, mtp=1)
    docs, tokens, targets = _packed()
    positions = document_positions(tokens, EOD)
    layer, S = model.mtp[0], tokens.shape[1]

    def depth1_logits(t, y, pos):
        h = model.run_blocks(model.embed_tokens(t), model.blocks, positions_BS=pos).x_BSD
        seq = torch.cat((t[:, :1], y), dim=1)
        h1, _, _ = layer(h[:, :t.shape[1] - 1], model.embed(seq[:, 1:t.shape[1]]),
                         None if pos is None else pos[:, :t.shape[1] - 1])
        return F.linear(layer.norm(h1), model.output_weight())[0]

    with torch.no_grad():
        packed = depth1_logits(tokens, targets, positions)
        unmasked = depth1_logits(tokens, targets, None)
        start, gaps = 0, []
        for doc in docs:
            n = len(doc)
            alone = depth1_logits(doc[None], targets[:, start:start + n], None)
            keep = slice(start, start + n - 1)  # token i + 1 still in the document
            assert (packed[keep] - alone).abs().max() <= TOL
            gaps.append((unmasked[keep] - alone).abs().max().item())
            start += n
        assert S == start and min(gaps[1:]) > 1e-2
        out = model(tokens, targets, positions)  # and the model's MTP loss runs with them
        assert out.mtp_loss is not None and torch.isfinite(out.mtp_loss)


def test_positions_change_nothing_for_one_document_per_row():
    model = _model({})
    tokens = torch.randint(1, V, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = model(tokens, positions_BS=document_positions(tokens, EOD)).logits_BSV
        b = model(tokens).logits_BSV
    assert (a - b).abs().max() <= TOL


# --- context parallelism alone, on real ranks ----------------------------------------------------

def _cp_pieces(rank: int, world: int) -> dict[str, float]:
    from moeplug.testing.cp_attention import cp_attention_errors

    B, H, G, N, Dh = 2, 4, 2, 16, 8
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(B, h, N, Dh, generator=g) for h in (H, G, G, H))
    tokens = torch.randint(1, V, (B, N), generator=g)
    # Row 0: documents of 3, 9 and 4 tokens. Row 1: one boundary at 13, so under CP4 the
    # last chunks' queries see no key of the early blocks (whole ring blocks masked per row).
    tokens[0, [2, 11]] = EOD
    tokens[1, 12] = EOD
    positions = document_positions(tokens, EOD)
    index = torch.arange(N)
    mask = attention_mask(index, index, positions)
    return cp_attention_errors(
        rank, world, q, k, v, dout, positions=positions,
        reference=lambda *qkv: F.scaled_dot_product_attention(*qkv, attn_mask=mask,
                                                              enable_gqa=True))


def test_cp_attention_with_documents_equals_masked_sdpa_on_the_full_sequence():
    reports = run_distributed(_cp_pieces, 4, timeout=120)
    for rank, errs in enumerate(reports):
        assert len(errs) == 16
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: document-masked CP attention differs: {bad}"


# --- refusals ------------------------------------------------------------------------------------

def test_document_mask_without_eos_is_refused_naming_the_fix():
    from moeplug.config import ConfigError
    from moeplug.data.documents import document_eod
    cfg = SimpleNamespace(data=SimpleNamespace(document_mask=True, tokenizer="bytes"))
    with pytest.raises(ConfigError) as err:
        document_eod(cfg, SimpleNamespace(eos_id=None))
    msg = str(err.value)
    assert msg.startswith("DataConfig.document_mask = True: data.tokenizer = 'bytes' has no "
                          "end-of-document token") and "Fix: use a tokenizer with an EOS" in msg
    assert document_eod(cfg, SimpleNamespace(eos_id=7)) == 7
    off = SimpleNamespace(data=SimpleNamespace(document_mask=False, tokenizer="bytes"))
    assert document_eod(off, SimpleNamespace(eos_id=None)) is None


@pytest.mark.parametrize("nproc", [None, "2"])
def test_cli_refuses_document_mask_with_a_tokenizer_without_eos(run_cli, tiny_config_file,
                                                                tmp_path, nproc):
    out = tmp_path / "run"
    args = ["train", "--config", tiny_config_file(str(out)), "--steps", "2",
            "--set", "data.document_mask=true"]
    if nproc:  # the launcher refuses it before starting any rank
        args += ["--nproc", nproc, "--set", "parallel.ep=2"]
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("moeplug: configuration error: DataConfig.document_mask = True: "
                               "data.tokenizer = 'bytes' has no end-of-document token")
    assert not (out / "metrics.jsonl").exists()


# --- the trainer feeds them ------------------------------------------------------------------------

class _Tok:
    eos_id = EOD

    def fingerprint(self) -> str:
        return "test-eod"

    def hf_files(self) -> dict:
        return {}  # no files to carry into the checkpoints


def _doc_stream(n: int, seed: int) -> "object":
    import numpy as np
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V, n).astype(np.int64)
    ids[rng.random(n) < 0.2] = EOD  # documents of ~5 tokens
    return ids


def test_train_feeds_document_positions_to_every_step_and_to_validation(tmp_path):
    from moeplug.config import config_from_dict
    from moeplug.data import get_batch
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.metrics import read_metrics
    from moeplug.training.trainer import batch_generator, evaluate, seed_everything, train

    host = PluginHost.load()
    train_ids, val_ids = _doc_stream(4000, 1), _doc_stream(2000, 2)

    def run(mask: bool):
        cfg = config_from_dict({
            "model": {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                      "init_std": 0.3,  # logits far from uniform: the mask shows in the loss
                      "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}},
            "data": {"document_mask": mask},
            "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 1,
                      "eval_interval": 1, "eval_batches": 2, "log_interval": 1,
                      "out_dir": str(tmp_path / f"mask{mask}"), "time_breakdown": False}})
        seed_everything(cfg.train.seed)
        model = build_model(cfg, host, V)
        precision = host.create("precision", "fp32", {})
        # The first train record: the initial model's loss on step 0's micro-batches.
        seed_everything(cfg.train.seed)
        ref = build_model(cfg, host, V)
        from moeplug.training.trainer import step_batches
        batches = with_positions(step_batches(train_ids, cfg.train, 0), EOD if mask else None)
        with torch.no_grad():
            want = sum(float(ref(*b).lm_loss) for b in batches) / len(batches)
        # the caller's batches (the library's path): the trainer adds the positions itself
        gen = batch_generator(cfg.train.seed, 0, 1)
        train(cfg, model, None, precision, {}, log=lambda _m: None, use_bar=False,
              batches=(mb for t in range(cfg.train.steps)
                       for mb in step_batches(train_ids, cfg.train, t)),
              val_batches=[get_batch(val_ids, 2, 16, gen) for _ in range(2)], tokenizer=_Tok())
        records = read_metrics(os.path.join(cfg.train.out_dir, "metrics.jsonl"))
        first = next(r for r in records if r["kind"] == "train")
        assert abs(first["lm_loss"] - want) <= TOL, (mask, first["lm_loss"], want)
        # the last val record: the final model on the validation batches, as evaluate gives it
        gen = batch_generator(cfg.train.seed, 0, 1)
        val = with_positions([get_batch(val_ids, 2, 16, gen) for _ in range(2)],
                             EOD if mask else None)
        last_val = [r for r in records if r["kind"] == "val"][-1]["val_loss"]
        assert abs(last_val - evaluate(model, val, precision)) <= TOL
        # the same model on the same batches without positions: what the mask changes
        gen = batch_generator(cfg.train.seed, 0, 1)
        unmasked = evaluate(model, [get_batch(val_ids, 2, 16, gen) for _ in range(2)], precision)
        return first["lm_loss"], last_val, unmasked

    masked, plain = run(True), run(False)
    assert abs(masked[0] - plain[0]) > 100 * TOL, (masked, plain)  # the training batches
    assert abs(masked[1] - masked[2]) > 100 * TOL, masked  # the validation batches
    assert plain[1] == plain[2], plain  # (no mask: nothing to remove)
