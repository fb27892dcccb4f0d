"""A resume continues the tokenizer its checkpoint was trained with, or says why not.

Found as a new user would find it: resuming with another ``data.corpus`` exited 0 and trained a
new BPE over the old embedding (its rows then meant other tokens); the checkpoint recorded the
tokenizer's fingerprint, but the resume never checked it. Now every resume compares what the
tokenizer encodes (its fingerprint) and how many ids it has with the checkpoint, and refuses in
one line naming both, exit 2, before anything is built; a resume that names no tokenizer takes
the checkpoint's own copy (which every checkpoint of a run with a Hugging Face tokenizer
carries), and a checkpoint from before vocabulary padding resumes with the rows it has.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from moeplug.testing.runs import records
from tests.conftest import tiny_config_dict

pytest.importorskip("transformers")
from tests.test_hf_tokenizer import save_hf_tokenizer  # noqa: E402


@pytest.fixture
def texts(tiny_corpus) -> list[str]:
    raw = open(os.path.join(tiny_corpus, "train_text.txt"), encoding="utf-8").read()
    return [raw[i:i + 3000] for i in range(0, 60_000, 3000)]


def _config(tmp_path, tiny_corpus, cache_dir, **data) -> str:
    """The tiny config as YAML; ``data`` replaces data fields (None: the field left out)."""
    cfg = tiny_config_dict(tiny_corpus, str(tmp_path / "run"), cache_dir)
    for key, value in data.items():
        if value is None:
            cfg["data"].pop(key)
        else:
            cfg["data"][key] = value
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _train(run_cli, cfg: str, out, steps: int, *sets: str):
    return run_cli("train", "--config", cfg, "--out", str(out), "--steps", str(steps),
                   "--resume", "auto", *[a for s in sets for a in ("--set", s)], timeout=600)


def _refused(proc, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in ("Fix:", *fragments):
        assert f in lines[0], lines[0]
    return lines[0]


def _train_steps(out) -> list[int]:
    return [r["step"] for r in records(str(out)) if r["kind"] == "train"]


def test_resuming_a_bpe_run_on_another_corpus_is_refused(run_cli, tiny_corpus, cache_dir,
                                                         tmp_path):
    cfg = _config(tmp_path, tiny_corpus, cache_dir, tokenizer="bpe", vocab_size=300)
    assert _train(run_cli, cfg, tmp_path / "run", 2).returncode == 0
    other = tmp_path / "other_corpus"
    shutil.copytree(tiny_corpus, other)
    with open(other / "train_text.txt", "a", encoding="utf-8") as f:
        f.write("zyzzyva quixotic jabberwocky " * 300)
    before = _train_steps(tmp_path / "run")
    proc = _train(run_cli, cfg, tmp_path / "run", 4, f"data.corpus={other}")
    _refused(proc, f"DataConfig.corpus = '{other}'", "BPE tokenizer trained on it",
             f"--set data.corpus={tiny_corpus}")
    assert _train_steps(tmp_path / "run") == before  # nothing trained, nothing written
    # the run's own corpus resumes
    assert _train(run_cli, cfg, tmp_path / "run", 4).returncode == 0


def test_an_hf_tokenizer_run_resumes_with_its_own_copy_and_refuses_another(
        run_cli, tiny_corpus, cache_dir, texts, tmp_path):
    tok = save_hf_tokenizer(tmp_path / "tok", texts, "bos")
    cfg = _config(tmp_path, tiny_corpus, cache_dir, tokenizer=tok)
    assert _train(run_cli, cfg, tmp_path / "run", 2).returncode == 0
    ckpt = tmp_path / "run" / "step_000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= set(meta["files"])
    assert meta["model_vocab_size"] == 384  # 320 ids padded to a multiple of 128

    other = save_hf_tokenizer(tmp_path / "other", texts[:5], "eos")
    proc = _train(run_cli, cfg, tmp_path / "run", 4, f"data.tokenizer={other}")
    _refused(proc, f"DataConfig.tokenizer = '{other}'", "not the tokenizer checkpoint",
             f"{ckpt}/tokenizer', the copy it carries")

    # The tokenizer's original directory is gone; a config that names none takes the copy.
    shutil.rmtree(tmp_path / "tok")
    bare = _config(tmp_path, tiny_corpus, cache_dir, tokenizer=None)
    proc = _train(run_cli, bare, tmp_path / "run", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = [r for r in records(str(tmp_path / "run")) if r["kind"] == "run"][-1]
    assert run["config"]["data"]["tokenizer"] == str(ckpt / "tokenizer")
    assert run["config"]["model"]["vocab_size"] == 384  # the checkpoint's rows, kept
    assert _train_steps(tmp_path / "run")[-1] == 4


def test_an_import_resumed_with_a_tokenizer_larger_than_its_embedding_is_refused(
        run_cli, tiny_corpus, cache_dir, texts, tmp_path):
    transformers = pytest.importorskip("transformers")
    from moeplug.convert import import_hf
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")  # the model alone: no tokenizer imported
    import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    tok = save_hf_tokenizer(tmp_path / "tok", texts, vocab_size=320)
    cfg = _config(tmp_path, tiny_corpus, cache_dir, tokenizer=tok)
    data = yaml.safe_load(open(cfg))
    data.pop("model")  # the import's model
    data["train"]["seq_len"] = 16
    open(cfg, "w").write(yaml.safe_dump(data))
    _refused(_train(run_cli, cfg, tmp_path / "run", 2), f"DataConfig.tokenizer = '{tok}'",
             "320 token ids exceed the 256 embedding rows")


def test_an_import_with_its_tokenizer_generates_and_refuses_another_on_resume(
        run_cli, tiny_corpus, cache_dir, texts, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = save_hf_tokenizer(tmp_path / "hf", texts, "bos")
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=320, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")
    proc = run_cli("convert", "import", "--hf", tok, "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenizer: imported (320 ids, EOS id 0 appended to every document, BOS id 1" \
        in proc.stdout
    # generate reads the import at step 0 with its tokenizer (no corpus, no cache)
    proc = run_cli("generate", "--ckpt", str(tmp_path / "run"), "--prompt", "KING:",
                   "--max-new-tokens", "5")
    assert proc.returncode == 0 and proc.stdout.startswith("KING:"), proc.stderr[-3000:]
    other = save_hf_tokenizer(tmp_path / "other", texts[:5], "bos")
    proc = run_cli("train", "--out", str(tmp_path / "run"), "--resume", "auto", "--steps", "2",
                   "--set", f"data.corpus={tiny_corpus}", "--set", "data.val_works=[val_text]",
                   "--set", f"data.tokenizer={other}")
    _refused(proc, f"DataConfig.tokenizer = '{other}'", "step_000000/tokenizer', the copy")


def test_a_checkpoint_from_before_vocabulary_padding_resumes_with_its_rows(
        run_cli, tiny_corpus, cache_dir, tmp_path):
    cfg = _config(tmp_path, tiny_corpus, cache_dir, tokenizer="bpe", vocab_size=300)
    out = tmp_path / "run"
    proc = _train(run_cli, cfg, out, 2, "model.make_vocab_size_divisible_by=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # As an older moeplug wrote it: no padding field, no recorded rows.
    meta_path = out / "step_000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    rows = meta.pop("model_vocab_size")
    del meta["config"]["model"]["make_vocab_size_divisible_by"]
    meta_path.write_text(json.dumps(meta))
    assert rows % 128  # (the BPE's own count: padding to 128 would change the model)
    proc = _train(run_cli, cfg, out, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "step_000004" / "meta.json").read_text())["model_vocab_size"] == rows
