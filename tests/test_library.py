"""moeplug.library: build a model and train it on batches of one's own, in Python.

The proof that it is the trainer of ``moeplug train`` and not a second loop: fed the very
micro-batches ``moeplug train`` draws, it logs the same losses and validation losses bit for
bit. And a model built from an import trains through the API alone, its checkpoints loading
back into :func:`build`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from moeplug import library
from moeplug.cli import main as cli_main
from moeplug.config import ConfigError
from moeplug.testing.runs import trajectory
from tests.conftest import tiny_config_dict


def test_library_train_is_moeplug_train_fed_its_own_batches(tiny_corpus, cache_dir, tmp_path):
    from moeplug.data import prepare_corpus
    from moeplug.data.loader import Batches, eval_batches
    data = tiny_config_dict(tiny_corpus, str(tmp_path / "cli"), cache_dir)
    data["train"].update(steps=8, eval_interval=4, grad_accum_steps=2)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))  # YAML is a superset of JSON
    assert cli_main(["train", "--config", str(path)]) == 0

    built = library.build(data)
    tc = built.cfg.train
    # the data readers' own stream and validation set, as moeplug train reads them
    corpus = prepare_corpus(built.cfg.data)
    stream = Batches(corpus.train_samples(tc.seq_len, tc.seed), tc.micro_batch_size,
                     tc.grad_accum_steps)
    batches = (mb for step in range(tc.steps) for mb in stream.step(step * stream.global_batch()))
    val = eval_batches(corpus.val_samples(tc.seq_len, tc.seed), tc.micro_batch_size,
                       tc.eval_batches).batches
    summary = library.train(built, batches, out_dir=str(tmp_path / "lib"), val_batches=val,
                            log=lambda _line: None)
    for kind, key in (("train", "loss"), ("val", "val_loss"), ("train", "grad_norm")):
        assert trajectory(str(tmp_path / "lib"), kind, key) == trajectory(
            str(tmp_path / "cli"), kind, key), (kind, key)
    assert summary.steps == 8 and os.path.isdir(tmp_path / "lib" / "step_000008")


def _import(tmp_path) -> str:
    transformers = pytest.importorskip("transformers")
    from moeplug.convert import import_hf
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")
    return import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))


def test_an_import_fine_tunes_through_the_api_alone(tmp_path):
    """Any iterable of batches: here a repeating token pattern the model learns to predict."""
    ckpt = _import(tmp_path)
    built = library.build(checkpoint=str(tmp_path / "imported"),
                          overrides=["train.lr=1e-2", "train.warmup_steps=0", "train.log_interval=1"])
    assert built.checkpoint == ckpt and built.cfg.model.vocab_size == 128
    pattern = torch.arange(40) % 7 + 3

    def batches():
        for step in range(1000):
            start = step % 7
            window = pattern[start:start + 17].repeat(4, 1)  # [B, S + 1]
            yield window

    val = [(pattern[:16].repeat(2, 1), pattern[1:17].repeat(2, 1))]
    out = str(tmp_path / "tuned")
    summary = library.train(built, batches(), out_dir=out, steps=30, val_batches=val,
                            log=lambda _line: None)
    losses = trajectory(out, "train", "lm_loss")
    assert losses[30] < 0.3 * losses[5], losses
    assert summary.val_loss < 0.5
    # the checkpoint it wrote builds the model it trained
    again = library.build(checkpoint=out)
    for (name, a), b in zip(built.model.state_dict().items(), again.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_batches_that_are_no_micro_batches_or_run_out_are_refused(tmp_path):
    _import(tmp_path)
    built = library.build(checkpoint=str(tmp_path / "imported"))
    with pytest.raises(ConfigError, match=r"batch 0 is a tensor of shape \(17,\).*Fix:"):
        library.train(built, [torch.zeros(17, dtype=torch.int64)], out_dir=str(tmp_path / "a"),
                      steps=1, log=lambda _line: None)
    with pytest.raises(ConfigError, match="ran out at step 3"):
        library.train(built, [torch.zeros(2, 9, dtype=torch.int64)] * 2,
                      out_dir=str(tmp_path / "b"), steps=5, log=lambda _line: None)
    with pytest.raises(ConfigError, match="already holds a run"):
        library.train(built, [], out_dir=str(tmp_path / "b"), steps=5)


def test_an_mfu_above_one_measures_the_gemm_peak_again(tiny_corpus, cache_dir, tmp_path,
                                                       monkeypatch):
    """The GEMM peak MFU divides by is measured once at start-up; measured beside other work
    (a compile, another run) it reads low and MFU above 100 %. The trainer then measures it
    again and keeps the best: here the first measure is made 1000x too low."""
    from moeplug.training import trainer
    real, calls = trainer.measure_peak_tflops, []

    def measure(*args, **kwargs):
        calls.append(args)
        peak = real(*args, **kwargs)
        return peak / 1000 if len(calls) == 1 else peak
    monkeypatch.setattr(trainer, "measure_peak_tflops", measure)
    data = tiny_config_dict(tiny_corpus, str(tmp_path / "run"), cache_dir)
    data["train"].update(steps=4, log_interval=2, eval_interval=4)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))
    assert cli_main(["train", "--config", str(path)]) == 0
    mfus = trajectory(str(tmp_path / "run"), "train", "mfu")
    # against the low figure every record would read some 100x over 100 %; a loaded host may
    # depress the second measure too, so the bound leaves it room
    assert len(calls) >= 2 and 0 < max(mfus) < 10, (calls, mfus)
