"""An imported Hugging Face model fine-tuned end to end, every step a real `moeplug` process.

A small random Qwen3-MoE made with transformers is saved (save_pretrained) with a tokenizer
trained here; ``convert import`` brings both in; one command fine-tunes it on a corpus with
that tokenizer (``train --out IMPORT --resume auto --set data.corpus=...``), SIGKILLed midway and
resumed with ``--resume auto``, ending on the losses of a run nobody killed, bit for bit;
``generate`` continues a prompt; ``convert export`` writes it back, and transformers'
AutoTokenizer and AutoModelForCausalLM load the export: the same token ids as the original
tokenizer, and logits equal to moeplug's within 1e-5 (fp32).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from moeplug.testing.runs import launch_and_wait, latest_step, trajectory  # noqa: E402
from tests.test_hf_tokenizer import save_hf_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 20


def _moeplug(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "moeplug", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (args, proc.stderr[-3000:])
    return proc


def _fine_tune_args(out: str, corpus: str) -> list[str]:
    # The import's model, router and tokenizer come from its checkpoint: one command. The
    # corpus is JSONL, as a user's usually is: the training file and a validation file.
    sets = [f"data.corpus={corpus}/train.jsonl", f"data.val_corpus={corpus}/val.jsonl",
            "train.micro_batch_size=4",
            "train.seq_len=32", "train.warmup_steps=2", "train.eval_interval=10",
            "train.eval_batches=2", "train.log_interval=1", "train.ckpt_interval=5",
            "train.threads=1"]
    return [sys.executable, "-m", "moeplug", "train", "--out", out, "--resume", "auto",
            "--steps", str(STEPS), *[a for s in sets for a in ("--set", s)]]


def test_import_fine_tune_kill_resume_generate_export(tmp_path, cli_env, tiny_corpus):
    # The corpus: the tiny corpus' works as JSONL records ({"text": ...} per line).
    names = sorted(os.listdir(tiny_corpus))
    texts = [open(os.path.join(tiny_corpus, f), encoding="utf-8").read() for f in names]
    corpus = tmp_path / "jsonl"
    corpus.mkdir()
    for split, keep in (("train", lambda n: n != "val_text.txt"), ("val", lambda n: n == "val_text.txt")):
        with open(corpus / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for name, text in zip(names, texts):
                if keep(name):
                    f.write(json.dumps({"text": text}) + "\n")
    corpus = str(corpus)
    chunks = [t[i:i + 3000] for t in texts for i in range(0, len(t), 3000)]
    hf_dir = tmp_path / "hf"
    save_hf_tokenizer(hf_dir, chunks, "eos", vocab_size=320)
    original = AutoTokenizer.from_pretrained(hf_dir)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=352, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
        max_position_embeddings=64, eos_token_id=original.eos_token_id))
    hf.save_pretrained(hf_dir)

    run = str(tmp_path / "run")
    imported = _moeplug(cli_env, "convert", "import", "--hf", str(hf_dir), "--out", run)
    assert "tokenizer: imported (320 ids, EOS id 0 appended" in imported.stdout
    assert "aux loss: Megatron's convention" in imported.stdout

    # The uninterrupted fine-tune, from a copy of the import.
    reference = str(tmp_path / "reference")
    shutil.copytree(run, reference)
    done = subprocess.run(_fine_tune_args(reference, corpus), env=cli_env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = trajectory(reference, "train", "loss"), trajectory(reference, "val", "val_loss")
    assert sorted(expected[0]) == list(range(1, STEPS + 1))

    # The same command, SIGKILLed after 8 more logged steps, then run again to the end.
    proc, _ = launch_and_wait(_fine_tune_args(run, corpus), run, cli_env, 8, 0.0)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    assert 0 < latest_step(run) < STEPS
    done = subprocess.run(_fine_tune_args(run, corpus), env=cli_env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (trajectory(run, "train", "loss"), trajectory(run, "val", "val_loss")) == expected
    last = os.path.join(run, f"step_{STEPS:06d}")
    assert os.path.isfile(os.path.join(last, "tokenizer", "tokenizer.json"))

    prompt = "KING:"
    generated = _moeplug(cli_env, "generate", "--ckpt", run, "--prompt", prompt,
                         "--max-new-tokens", "12")
    assert generated.stdout.startswith(prompt) and len(generated.stdout) > len(prompt)

    exported = str(tmp_path / "export")
    _moeplug(cli_env, "convert", "export", "--ckpt", run, "--out", exported)
    tok = AutoTokenizer.from_pretrained(exported)
    doc = texts[1][:600]
    assert tok(doc)["input_ids"] == original(doc)["input_ids"]
    assert tok.eos_token_id == original.eos_token_id
    back = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert back.config.eos_token_id == original.eos_token_id

    from moeplug.generate import load_checkpoint_model
    ours = load_checkpoint_model(run, "cpu").model
    x_BS = torch.tensor([tok(doc)["input_ids"][:32]])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x_BS).logits, ours(x_BS).logits_BSV,
                                   rtol=0, atol=1e-5)
