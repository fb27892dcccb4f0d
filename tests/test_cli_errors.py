"""Configuration problems found only once the data is known (vocabulary, split length) exit
with status 2 and one paragraph naming the field, the value and the fix — no traceback.

Runs the real CLI in a subprocess on a tiny text corpus of our own (byte tokens, 256 ids).
"""

from __future__ import annotations

import pytest
import yaml

from moeplug.config import load_config
from moeplug.data import prepare_corpus

EXIT_CONFIG = 2
VAL_CHARS = 300  # byte tokenizer: one token per ASCII character


@pytest.fixture
def small_corpus_config(tmp_path, cache_dir):
    """Factory: a YAML config on a corpus with ~3000 training and VAL_CHARS validation tokens."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = "To be, or not to be, that is the question.\n"
    (corpus / "train_text.txt").write_text(line * 70, encoding="ascii")
    (corpus / "val_text.txt").write_text((line * 10)[:VAL_CHARS], encoding="ascii")

    def make(**sections) -> str:
        data = {
            "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                      "max_seq_len": 512, "first_k_dense": 0, "dense_ffn_hidden_size": 16,
                      "moe": {"num_experts": 2, "top_k": 1, "ffn_hidden_size": 8}},
            "data": {"corpus": str(corpus), "tokenizer": "bytes", "val_works": ["val_text"],
                     "cache_dir": cache_dir},
            "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 0,
                      "eval_interval": 2, "eval_batches": 1, "log_interval": 1,
                      "out_dir": str(tmp_path / "run"), "threads": 1},
        }
        for section, values in sections.items():
            data[section].update(values)
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)
    return make


def assert_config_error(proc, *fragments: str) -> None:
    assert proc.returncode == EXIT_CONFIG, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "moeplug: configuration error:" in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


def test_model_vocab_smaller_than_tokenizer_exits_2(run_cli, small_corpus_config):
    path = small_corpus_config(model={"vocab_size": 100})
    proc = run_cli("train", "--config", path, timeout=300)
    assert_config_error(proc, "ModelConfig.vocab_size = 100", "256 ids of the tokenizer",
                        "data.tokenizer = 'bytes'", "set model.vocab_size: 0", ">= 256")


def test_seq_len_longer_than_validation_split_exits_2(run_cli, small_corpus_config):
    # 400 fits model.max_seq_len (512) and the ~3000-token train split, not the ~300-token val.
    path = small_corpus_config(train={"seq_len": 400})
    num_val = len(prepare_corpus(load_config(path).data).val_ids)
    assert VAL_CHARS <= num_val < 400
    proc = run_cli("train", "--config", path, timeout=300)
    assert_config_error(proc, "train.seq_len = 400", "the validation split of",
                        f"has {num_val}. Fix: lower train.seq_len below {num_val}")


def test_small_corpus_config_trains(run_cli, small_corpus_config):
    """The same config with a fitting seq_len runs, so the failures above are the errors'."""
    proc = run_cli("train", "--config", small_corpus_config(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# Message slips: each says what the problem really is
# --------------------------------------------------------------------------------------------

def test_config_that_is_a_directory_says_so(run_cli, tmp_path):
    (tmp_path / "run.yaml").write_text("train: {steps: 2}\n")
    proc = run_cli("train", "--config", str(tmp_path))
    assert_config_error(proc, f"config file '{tmp_path}' is a directory, not a YAML file",
                        "Fix: pass a file (there: run.yaml)")
    assert "does not exist" not in proc.stderr


def test_binary_config_file_is_not_a_traceback(run_cli, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"\xff\xfe\x00model")
    proc = run_cli("train", "--config", str(path))
    assert_config_error(proc, f"config file '{path}' is not UTF-8 text", "Fix:")


def test_empty_config_file_says_it_trains_the_dataclass_defaults(run_cli, tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    # A later error stops the run before any data or model work; the note comes first.
    proc = run_cli("train", "--config", str(path), "--set", "model.moe.top_k=99")
    assert_config_error(proc, "MoEConfig.top_k = 99")
    assert f"config file '{path}' is empty: training the dataclass defaults" in proc.stderr
    assert "not the packaged default.yaml" in proc.stderr
    proc = run_cli("train", "--set", "model.moe.top_k=99")  # no --config: no such note
    assert_config_error(proc, "MoEConfig.top_k = 99")
    assert "is empty" not in proc.stderr


def test_unknown_experts_plugin_lists_the_available_experts(run_cli):
    proc = run_cli("train", "--experts", "nope")
    assert_config_error(proc, "unknown experts 'nope'. Available experts: ")
    assert "expertss" not in proc.stderr


@pytest.mark.parametrize("out, fragment", [
    ("afile", "is a file, not a directory"),
    ("afile/sub", "cannot be created or written (Not a directory)"),
])
def test_an_out_dir_that_cannot_be_one_exits_2(run_cli, small_corpus_config, tmp_path, out,
                                               fragment):
    # a FileExistsError / NotADirectoryError traceback from the run lock once
    (tmp_path / "afile").write_text("not a run")
    proc = run_cli("train", "--config", small_corpus_config(), "--out", str(tmp_path / out))
    assert_config_error(proc, f"train.out_dir = '{tmp_path / out}' {fragment}", "Fix: pass --out")


def test_a_stash_overflow_under_policy_fail_stops_in_one_line(run_cli, small_corpus_config):
    # runtime.stash_overflow: fail is the documented way to stop: one line and exit 3 as any
    # fault that stops training, not a StashOverflowError traceback
    proc = run_cli("train", "--config", small_corpus_config(), "--set", "runtime.stash=true",
                   "--set", "runtime.stash_pages=1", "--set", "runtime.stash_page_bytes=4096",
                   "--set", "runtime.stash_overflow=fail", timeout=300)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("moeplug: runtime.stash_overflow = 'fail': the stash pool (1 pages")
    assert "Fix: set runtime.stash_pages to at least" in last
