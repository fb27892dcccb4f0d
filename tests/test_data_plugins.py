"""Corpus readers are plugins: a third-party package (plugins/examples/moeplug-example-reader,
installed with pip into a private directory) adds a format through the same ``moeplug``
entry-point group the built-in readers use; ``moeplug plugins`` lists it, ``moeplug data
prepare`` and ``moeplug train`` read with it, and it can be blocked like any plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moeplug.testing.example_plugin import EXAMPLES_DIR, install_plugin_package

BUILTIN = ["hf_disk", "jsonl", "megatron", "parquet", "shakespeare", "txt"]


@pytest.fixture(scope="module")
def reader_env(tmp_path_factory):
    return install_plugin_package(EXAMPLES_DIR / "moeplug-example-reader",
                           tmp_path_factory.mktemp("site") / "example-reader")


def _run(args, env):
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    return done


def test_builtin_readers_come_through_the_entry_point_group():
    from moeplug.plugin_host import PluginHost
    host = PluginHost.load()
    infos = {i.name: i for i in host.infos() if i.kind == "dataset"}
    assert BUILTIN == sorted(n for n in infos if n in BUILTIN)
    assert {(infos[n].dist, infos[n].entry_point) for n in BUILTIN} == {("moeplug",
                                                                         "builtin_datasets")}
    from moeplug.data.reader import CorpusReader
    assert all(isinstance(host.create("dataset", n, None, interface=CorpusReader), CorpusReader) for n in BUILTIN)


def test_plugins_lists_the_third_party_reader(reader_env):
    done = _run([sys.executable, "-m", "moeplug", "plugins"], reader_env)
    assert done.returncode == 0, done.stderr
    section = done.stdout.split("dataset:")[1]
    line = next(l for l in section.splitlines() if l.strip().startswith("csv "))
    assert "moeplug-example-reader" in line and "available" in line
    assert all(f"  {n} " in section for n in BUILTIN)


def test_prepare_and_train_read_with_the_third_party_reader(reader_env, tmp_path, cache_dir,
                                                            tiny_config_file):
    import yaml
    rows = [f"row {i}: " + "some words " * (i % 7 + 3) for i in range(120)]
    src = tmp_path / "corpus.csv"
    src.write_text("id,body\n" + "".join(f'{i},"{r}"\n' for i, r in enumerate(rows)))
    env = dict(reader_env, MOEPLUG_CACHE=cache_dir)
    out = tmp_path / "prepared"
    done = _run([sys.executable, "-m", "moeplug", "data", "prepare", "--corpus", str(src),
                 "--tokenizer", "bytes", "--text-field", "body", "--out", str(out)], env)
    assert done.returncode == 0, done.stderr
    from moeplug.data.indexed import open_indexed
    tokens = open_indexed(str(out / "corpus"))
    assert [tokens.get(i).tolist() for i in range(tokens.num_docs)] == \
        [list(r.encode()) + list(b"\n\n") for r in rows]
    assert json.load(open(out / "meta.json"))["reader"] == "csv"
    cfg = yaml.safe_load(open(tiny_config_file(str(tmp_path / "run"))))
    cfg["data"].update({"corpus": str(src), "text_field": "body", "val_fraction": 0.1})
    cfg["data"].pop("val_works")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    done = _run([sys.executable, "-m", "moeplug", "train", "--config", str(tmp_path / "cfg.yaml"),
                 "--steps", "2"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data: train 108 documents" in done.stdout
    # a bad row: the host names the file and the row; blocked, the format is unknown again
    bad = tmp_path / "bad.csv"
    bad.write_text("id,other\n1,x\n")
    done = _run([sys.executable, "-m", "moeplug", "data", "prepare", "--corpus", str(bad),
                 "--tokenizer", "bytes", "--out", str(tmp_path / "p")], env)
    assert done.returncode == 2 and f"{bad} row 1: no column 'text'" in done.stderr
    blocked = dict(env, MOEPLUG_BLOCK_PLUGINS="example_reader")
    done = _run([sys.executable, "-m", "moeplug", "data", "prepare", "--corpus", str(src),
                 "--tokenizer", "bytes", "--out", str(tmp_path / "p2")], blocked)
    assert done.returncode == 2 and "unknown format" in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "p") and not os.path.exists(tmp_path / "p2")
