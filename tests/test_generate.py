"""`moeplug generate` through the real CLI on checkpoints of real (tiny) `moeplug train` runs.

The central check decodes in-process with nothing but the trainer's own pieces (prepare_corpus,
build_model, load_checkpoint) and a hand-written argmax loop, and demands the CLI's text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
import yaml

from conftest import tiny_config_dict
from moeplug.config import config_from_dict
from moeplug.data import prepare_corpus
from moeplug.build import build_model
from moeplug.plugin_host import PluginHost
from moeplug.testing.cli import run_cli
from moeplug.training.checkpoint import load_checkpoint

PROMPT = "MACBETH. What"


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run_cli(args, env=env, timeout=300)


def _train(env: dict, root, corpus: str, steps: int, *overrides: str) -> str:
    """A finished `moeplug train` run of the tiny config; returns its run directory.
    ``overrides``: ``key=value`` for --set, or a flag such as ``--nproc=2``."""
    root.mkdir(parents=True, exist_ok=True)
    out, cfg = str(root / "run"), root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config_dict(corpus, out, str(root / "cache"))))
    sets = [a for o in overrides for a in ((o,) if o.startswith("--") else ("--set", o))]
    proc = _cli(env, "train", "--config", str(cfg), "--steps", str(steps),
                "--set", "train.warmup_steps=2", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["MOEPLUG_CACHE"] = str(tmp_path_factory.mktemp("generate_cache"))
    e.pop("MOEPLUG_BLOCK_PLUGINS", None)
    return e


@pytest.fixture(scope="module")
def run_dir(env, tiny_corpus, tmp_path_factory) -> str:
    """Byte tokens, 150 steps (seconds): enough to write " the the" rather than spaces."""
    return _train(env, tmp_path_factory.mktemp("generate_run"), tiny_corpus, 150)


def _generate(env: dict, ckpt: str, *args: str) -> subprocess.CompletedProcess:
    return _cli(env, "generate", "--ckpt", ckpt, *args)


def _text(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.endswith("\n")
    return proc.stdout[:-1]


def test_greedy_is_repeatable_and_continues_the_prompt(env, run_dir):
    args = ("--prompt", PROMPT, "--max-new-tokens", "30")
    first, second = _text(_generate(env, run_dir, *args)), _text(_generate(env, run_dir, *args))
    assert first == second
    assert first.startswith(PROMPT) and len(first) > len(PROMPT)
    # A run directory means its newest checkpoint: the step directory gives the same text.
    step_dir = os.path.join(run_dir, "step_000150")
    assert _text(_generate(env, step_dir, *args)) == first


def test_greedy_equals_an_argmax_loop_over_the_models_logits(env, run_dir):
    new_tokens = 40  # prompt + 40 > train.seq_len (32): the context is cropped on the way
    cli_text = _text(_generate(env, run_dir, "--prompt", PROMPT,
                               "--max-new-tokens", str(new_tokens), "--device", "cpu"))

    step_dir = os.path.join(run_dir, "step_000150")
    with open(os.path.join(step_dir, "meta.json"), encoding="utf-8") as f:
        cfg = config_from_dict(json.load(f)["config"])
    corpus = prepare_corpus(cfg.data)  # data.cache_dir is the run's: the cached tokenizer
    model = build_model(cfg, PluginHost.load(), corpus.vocab_size)
    load_checkpoint(step_dir, model, restore_rng=False)
    model.eval()
    ids = corpus.tokenizer.encode(PROMPT)
    with torch.no_grad():
        for _ in range(new_tokens):
            window = torch.tensor([ids[-cfg.train.seq_len:]])
            ids.append(int(model(window).logits_BSV[0, -1].argmax()))
    expected = corpus.tokenizer.decode(ids)
    assert cli_text == expected
    assert len(set(expected[len(PROMPT):])) > 1, "a trained model writes more than one char"


def test_sampling_is_repeatable_per_seed_and_top_k_1_is_greedy(env, run_dir):
    def sample(*extra: str) -> str:
        return _text(_generate(env, run_dir, "--prompt", PROMPT, "--max-new-tokens", "40",
                               *extra))
    a = sample("--temperature", "1.0", "--seed", "1")
    assert a.startswith(PROMPT)
    assert sample("--temperature", "1.0", "--seed", "1") == a
    assert sample("--temperature", "1.0", "--seed", "2") != a
    # top-k 1 leaves one token to draw: the argmax, whatever the temperature and seed.
    assert sample("--temperature", "1.5", "--top-k", "1", "--seed", "7") == sample()


def test_long_empty_and_unseen_prompts(env, run_dir):
    long_prompt = "To be, or not to be, that is the question. " * 5  # 215 bytes > max_seq_len 64
    assert _text(_generate(env, run_dir, "--prompt", long_prompt, "--max-new-tokens", "5")
                 ).startswith(long_prompt)
    unseen = "日本語 ✓ {}"  # characters the corpus never had: byte tokens still encode them
    assert _text(_generate(env, run_dir, "--prompt", unseen, "--max-new-tokens", "5")
                 ).startswith(unseen)
    empty = _generate(env, run_dir, "--max-new-tokens", "10")  # starts at a work boundary
    assert len(_text(empty)) > 0


@pytest.mark.parametrize("args, parts", [
    (("--ckpt", "{missing}"), ["--ckpt", "{missing}", "no checkpoint there", "Fix:"]),
    (("--ckpt", "{run}", "--top-k", "3"), ["--top-k 3", "--temperature", "Fix:"]),
    (("--ckpt", "{run}", "--max-new-tokens", "0"), ["--max-new-tokens 0", "Fix:"]),
    (("--ckpt", "{run}", "--temperature", "-1"), ["--temperature -1", "Fix:"]),
    # an overflow traceback from torch's generator once
    (("--ckpt", "{run}", "--temperature", "1", "--seed", str(2 ** 64)),
     [f"--seed {2 ** 64}: must be in [0, 2**63)", "Fix:"]),
    (("--ckpt", "{run}", "--temperature", "1", "--seed", "-1"), ["--seed -1", "Fix:"]),
    (("--ckpt", "{run}", "--device", "tpu"), ["--device tpu", "must be auto, cpu, cuda or cuda:N", "Fix:"]),
])
def test_bad_input_exits_2_with_the_fix(env, run_dir, tmp_path, args, parts):
    fill = {"missing": str(tmp_path / "no_such_run"), "run": run_dir}
    proc = _cli(env, "generate", *(a.format(**fill) for a in args))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for part in parts:
        assert part.format(**fill) in proc.stderr, proc.stderr


def test_checkpoints_of_every_layout_load_as_the_ranks_saved_them(env, tiny_corpus, tmp_path):
    """Data parallel: every rank saved the whole model. Expert parallel: each rank saved half the
    experts; they once were refused ('moeplug does not merge such shards') and now load joined,
    checked here against the rank files themselves. The export of that checkpoint once died
    looking for a model.safetensors a multi-process run does not write."""
    from safetensors.torch import load_file
    from moeplug.generate import load_checkpoint_model

    dp2 = _train(env, tmp_path / "dp2", tiny_corpus, 3, "parallel.dp=2", "--nproc=2")
    assert _text(_generate(env, dp2, "--prompt", PROMPT, "--max-new-tokens", "5")
                 ).startswith(PROMPT)
    loaded = load_checkpoint_model(dp2, "cpu").model.state_dict()
    replica = load_file(os.path.join(dp2, "step_000003", "model_rank1.safetensors"))
    assert replica.keys() <= loaded.keys()
    for name, t in replica.items():
        assert torch.equal(loaded[name], t), name

    # EP2 with the sync-free static path and its execution settings: none of them is needed to
    # read the model, and each rank holds experts 0-1 or 2-3 of [4, ...] (qk_norm: a model
    # Qwen3-MoE's format can hold, for the export below).
    ep2 = _train(env, tmp_path / "ep2", tiny_corpus, 3, "parallel.ep=2", "--nproc=2",
                 "runtime.sync_free=true", "runtime.stash=true", "model.qk_norm=true")
    proc = _generate(env, ep2, "--prompt", PROMPT, "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _text(proc).startswith(PROMPT)
    loaded = load_checkpoint_model(ep2, "cpu").model.state_dict()
    ranks = [load_file(os.path.join(ep2, "step_000003", f"model_rank{r}.safetensors"))
             for r in (0, 1)]
    experts = 0
    for name, t0 in ranks[0].items():
        if loaded[name].shape == t0.shape:  # replicated over EP
            assert torch.equal(loaded[name], t0) and torch.equal(ranks[1][name], t0), name
        else:
            experts += 1
            assert torch.equal(loaded[name], torch.cat([t0, ranks[1][name]])), name
    assert experts == 2  # the MoE layer's gate_up_proj and down_proj

    hf = tmp_path / "ep2_hf"
    proc = _cli(env, "convert", "export", "--ckpt", ep2, "--out", str(hf), "--family",
                "qwen3_moe")
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = load_file(str(hf / "model.safetensors"))
    down = loaded["blocks.1.ffn.experts.down_proj"]
    assert torch.equal(exported["model.layers.1.mlp.experts.3.down_proj.weight"], down[3])


def test_a_checkpoint_without_a_config_or_a_tensor_is_refused_with_the_fix(env, run_dir,
                                                                           tmp_path):
    """generate rebuilds the model from meta.json's config (a checkpoint older than it stores
    none), and convert export reads the vocabulary from the saved embedding: each missing
    piece is a CheckpointError naming the checkpoint and the fix, not a KeyError."""
    from moeplug.training.checkpoint import (CheckpointError, find_checkpoint, read_meta,
                                             saved_model_shape)
    step = find_checkpoint(run_dir)
    meta = read_meta(step)
    assert saved_model_shape(step, meta, "embed.weight")[0] == 256  # byte tokens
    with pytest.raises(CheckpointError, match=r"holds no complete 'no\.such\.weight'.*Fix: "):
        saved_model_shape(step, meta, "no.such.weight")
    copy = str(tmp_path / "step")
    shutil.copytree(step, copy)
    meta_path = os.path.join(copy, "meta.json")
    with open(meta_path) as f:
        stored = json.load(f)
    del stored["config"]
    with open(meta_path, "w") as f:
        json.dump(stored, f)
    proc = _generate(env, copy)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "stores no 'config'" in proc.stderr and "Fix: generate from a checkpoint written " \
        "by moeplug train" in proc.stderr, proc.stderr


def test_bpe_tokenizer_is_found_rebuilt_and_checked(env, tiny_corpus, tmp_path):
    corpus = str(tmp_path / "corpus")
    shutil.copytree(tiny_corpus, corpus)
    run = _train(env, tmp_path, corpus, 3, "data.tokenizer=bpe", "data.vocab_size=300")
    args = ("--prompt", PROMPT, "--max-new-tokens", "12")
    cached = _text(_generate(env, run, *args))
    assert cached.startswith(PROMPT)
    # Cache deleted: the BPE is trained again from the run's data config, to the same tokenizer.
    shutil.rmtree(tmp_path / "cache")
    assert _text(_generate(env, run, *args)) == cached
    # Corpus edited since the run: the rebuilt tokenizer differs, and generate says so.
    with open(os.path.join(corpus, "train_text.txt"), "a", encoding="utf-8") as f:
        f.write("zyzzyva quixotic " * 200)
    proc = _generate(env, run, *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "differs from the one it trained with" in proc.stderr and "Fix:" in proc.stderr


def test_hugging_face_import_is_refused_with_the_reason(env, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    run = str(tmp_path / "run")
    imported = _cli(env, "convert", "import", "--hf", str(tmp_path / "hf"), "--out", run)
    assert imported.returncode == 0, imported.stderr[-3000:]
    proc = _generate(env, run)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "imported from Hugging Face" in proc.stderr and "Fix:" in proc.stderr
